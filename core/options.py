"""Every command's options, one idiom: a typed dataclass beside the job it configures, whose fields are the options.
The command's flags, their help and the defaults they show are generated from it here, so a default lives in one
place, the field.

A field is an option when its metadata has a "help" (opt() makes such a field); the other metadata keys, all optional:
  flag     the option's name when it is not the field's (RegenConfig.servers is --server); the namespace key too
  group    the title of the --help section the option is listed under
  hidden   a testing aid: accepted, left out of --help
  choices, metavar    as argparse takes them
  type     argparse's type, where the annotation does not say it: it parses the flag's one argument into the value
           (--layers 3,31,59, --betas 0.9,0.95, --draft-steps auto|N)

The flags, from each field's annotation (X | None is X):
  str, int, float: --name VALUE; list[X]: --name X [X ...]; a field without a default: a required flag.
  bool: a switch, --name for an option off by default, --no-name for one on by default (the field's help is then that
  of --no-name; the namespace key is no_name); bool | None: --name / --no-name (neither: None).
  hf_style=True (eagle3 train's flags, spelled as transformers' HfArgumentParser made them): every flag also as
  --name_with_underscores, and a bool as --name [{true,false}] (alone: true) beside --no-name.
Every parsed value is None when its flag was not given (a switch: off), and the help shows the field's default
instead, so that a preset or --config file can fill what the command line leaves out: given() returns what it set.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing

_OWN_KEYS = ("help", "flag", "group", "hidden")  # the rest of a field's metadata goes to add_argument as it is

# Help texts of options several commands share
TRUST_REMOTE_CODE_HELP = ("run the tokenizer code the target ships: the module tokenizer_config.json's auto_map names "
                          "(e.g. Kimi-K2.5's tokenization_kimi.py) and what it imports, nothing else (no configuration "
                          "or modeling code: the target loads through transformers' own classes); refused otherwise")
FULL_WEIGHTS_DIGEST_HELP = ("identify the target by a sha256 of every byte of its weight files (minutes for a 590 GB "
                            "checkpoint) instead of the default digest of each file's size, header and 18 sampled "
                            "blocks (seconds); recorded, and later stages check the target the same way")


def opt(default=dataclasses.MISSING, help: str = "", *, default_factory=dataclasses.MISSING, **metadata):
    """A dataclass field that is a command-line option: its default, its help and the metadata keys above."""
    return dataclasses.field(default=default, default_factory=default_factory, metadata={"help": help, **metadata})


def _bool(text: str) -> bool:
    from transformers.hf_argparser import string_to_bool  # yes/no, true/false, t/f, y/n, 1/0, as train always took
    return string_to_bool(text)


def _base(hint):
    """The annotation without None: `int | None` -> int."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return hint


def _options(cls, hf_style: bool):
    """(field, its type without None, namespace key, spelling) of each option of cls; spelling is 'value', or for a
    bool 'on' (a switch --name), 'off' (a switch --no-name), 'either' (--name / --no-name) or 'hf_bool'."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if "help" not in f.metadata:
            continue
        base, dest = _base(hints[f.name]), f.metadata.get("flag", f.name)
        if base is not bool:
            yield f, base, dest, "value"
        elif hf_style:
            yield f, base, dest, "hf_bool"
        elif f.default is None:
            yield f, base, dest, "either"
        else:
            yield f, base, ("no_" if f.default else "") + dest, "off" if f.default else "on"


def _flags(name: str, hf_style: bool) -> list[str]:
    dashed = "--" + name.replace("_", "-")
    return [dashed, "--" + name] if hf_style and "_" in name else [dashed]


def _default(f: dataclasses.Field):
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _with_default(text: str, default) -> str:
    if default is dataclasses.MISSING or default is None or default in ("", []) or "default" in text.lower():
        return text
    return f"{text} (default: {default})"


def add_options(parser: argparse.ArgumentParser, cls, hf_style: bool = False) -> None:
    """cls's options as flags of parser (the module's docstring says how each is spelled)."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f, base, dest, spelling in _options(cls, hf_style):
        meta = dict(f.metadata)
        title = meta.get("group")
        if title and title not in groups:
            groups[title] = parser.add_argument_group(title)
        where = groups[title] if title else parser
        text = argparse.SUPPRESS if meta.get("hidden") else meta["help"]
        kw = {k: v for k, v in meta.items() if k not in _OWN_KEYS}
        if spelling in ("on", "off"):
            where.add_argument(*_flags(dest, False), dest=dest, action="store_true", help=text)
            continue
        if spelling == "either":
            where.add_argument(*_flags(dest, False), dest=dest, action=argparse.BooleanOptionalAction, help=text)
            continue
        text = text if text == argparse.SUPPRESS else _with_default(text, _default(f))
        flags = _flags(dest, hf_style)
        if spelling == "hf_bool":
            where.add_argument(*flags, dest=dest, nargs="?", const=True, type=_bool, metavar="{true,false}",
                               default=None, help=text)
            where.add_argument(*_flags("no_" + dest, True), dest=dest, action="store_false", default=None,
                               help=f"turn off {flags[0]}")
            continue
        if "type" not in kw:
            if typing.get_origin(base) is list:
                kw.update(nargs="+", type=typing.get_args(base)[0])
            elif base in (str, int, float):
                kw["type"] = base
            else:
                raise TypeError(f"{cls.__name__}.{f.name}: give its argparse type in the field's metadata")
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        where.add_argument(*flags, dest=dest, default=None, required=required, help=text, **kw)


def given(cls, namespace: argparse.Namespace, hf_style: bool = False) -> dict:
    """{field name: value} of the options of cls that the parsed command line set; cls(**given(...)) takes its
    defaults for the rest (or a preset's or file's values for them, merged first)."""
    values = {}
    for f, _, dest, spelling in _options(cls, hf_style):
        v = getattr(namespace, dest)
        if spelling in ("on", "off"):
            v = (spelling == "on") if v else None
        if v is not None:
            values[f.name] = v
    return values
