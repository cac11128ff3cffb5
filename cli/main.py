"""The `eagle3` command: one subcommand per pipeline stage ([regenerate ->] dump -> vocab -> train -> export ->
eval).

The layer above every stage. Each cmd_* imports its stage when it runs, not at the top (a measured reason: startup):
`eagle3 --help` builds every parser from the commands' config classes in 2.9 s, while importing every stage's job
module first takes 6.0 s (DeepSpeed, the dump, the eval, 2-core Xeon, 2026-12-07), paid by every command and every
`--help`. cli/quickstart.py does the same for the same reason.
"""

from __future__ import annotations

import argparse
import sys

from eagle3 import options
from eagle3.contract import ContractError

EXAMPLE = "example"


def resolve_example(target: str | None, data: list[str]) -> tuple[str | None, list[str]]:
    """'example' stands for the embedded default target/data. Otherwise --target is a model directory or a hub
    model id in the local HF cache, --data files / dataset directories or hub dataset ids in the local HF cache
    (offline lookups: the snapshot directory replaces the id; FileNotFoundError naming id and cache if absent)."""
    if target == EXAMPLE:
        from eagle3.dump.example import example_target_dir
        target = example_target_dir()
    elif target is not None:
        from eagle3.target.load import resolve_target
        target = resolve_target(target)
    if data == [EXAMPLE]:
        from eagle3.dump.example import example_sharegpt_jsonl
        data = [example_sharegpt_jsonl()[0]]
    elif data:
        from eagle3.conversations.formats import resolve_data
        data = resolve_data(data)
    return target, data


def cmd_dump(a: argparse.Namespace) -> None:
    from eagle3 import presets
    from eagle3.dump.job import DumpConfig, run_dump
    from eagle3.target.load import read_config, text_config_dict
    target, data = resolve_example(a.target, a.data)
    values = {}  # DumpConfig's defaults < the --preset's < the command line's
    if a.preset:
        preset = presets.load("targets", a.preset)
        cfg = read_config(target)
        presets.check_target_expectations(a.preset, preset, text_config_dict(cfg), cfg.get("model_type", ""))
        values.update(preset.get("dump", {}))
    values.update(options.given(DumpConfig, a), target=target, data=data)
    run_dump(DumpConfig(**values))


def cmd_regenerate(a: argparse.Namespace) -> None:
    from eagle3.regenerate.config import RegenConfig
    from eagle3.regenerate.job import run_regenerate
    from eagle3.regenerate.record import check_record
    from eagle3.regenerate.server_client import ServerError
    target, data = resolve_example(a.target, a.data)
    cfg = RegenConfig(**{**options.given(RegenConfig, a), "target": target, "data": data})
    try:
        record = run_regenerate(cfg)
    except ServerError as e:
        print(f"eagle3 regenerate: error: {e}", file=sys.stderr)
        raise SystemExit(1)
    problem = check_record(record)
    if problem:
        print(f"eagle3 regenerate: error: {problem}", file=sys.stderr)
        raise SystemExit(1)


def cmd_example_target(a: argparse.Namespace) -> None:
    from eagle3.dump.example import example_target_dir
    print(example_target_dir())


def cmd_quickstart(a: argparse.Namespace) -> None:
    """The main job on the embedded default: regenerate -> dump -> vocab -> train -> export -> eval, then a summary."""
    from eagle3.cli.quickstart import QuickstartConfig, run_quickstart
    run_quickstart(QuickstartConfig(**options.given(QuickstartConfig, a)))


def cmd_eval(a: argparse.Namespace) -> None:
    import json
    from eagle3.eval.speculative import EvalConfig, evaluate
    args = options.given(EvalConfig, a)
    args["target_dir"], _ = resolve_example(args["target_dir"], [])
    rep = evaluate(**args)
    keys = ("acceptance_length", "acceptance_rate_per_position", "tokens_per_target_forward", "speedup", "lossless",
            "capture_indices", "prompts", "generated_tokens")
    print(json.dumps({k: rep[k] for k in keys}, indent=1))
    if rep.get("draft_steps_choice"):
        c = rep["draft_steps_choice"]
        print(f"draft steps (auto): {c['chosen']}; predicted speedup {c['predicted_speedup']:.2f}x, measured "
              f"{rep['speedup']:.2f}x")
    if not rep["lossless"]:
        raise SystemExit(f"speculative output differs from target-only greedy on {len(rep['mismatches'])} prompts")


def cmd_vocab(a: argparse.Namespace) -> None:
    from eagle3.data.vocab import VocabConfig, describe_vocab, make_vocab_file
    cfg = VocabConfig(**options.given(VocabConfig, a))
    vocab = make_vocab_file(cfg)
    print(f"draft vocab {describe_vocab(vocab['meta'])} -> {cfg.out}")


def cmd_inspect(a: argparse.Namespace) -> None:
    import json
    import os
    if os.path.isfile(os.path.join(a.path, "config.json")):  # a drafter directory (ours or a published one)
        from eagle3.model.checkpoint import inspect_export as inspect_path, render_export as render
    else:
        from eagle3.data.inspect import inspect_path, render
    report = inspect_path(a.path, verify=not a.no_verify)
    print(json.dumps(report, indent=1) if a.json else render(report))
    if str(report.get("verified", "")).startswith("FAILED"):
        raise SystemExit(1)


def cmd_train(a: argparse.Namespace) -> None:
    from eagle3.train.config import from_args
    from eagle3.train.trainer import train
    train(from_args(a))


def cmd_export_sglang(a: argparse.Namespace) -> None:
    from eagle3.export.sglang import ExportConfig, export_drafter
    prov = export_drafter(**options.given(ExportConfig, a))
    where = f"SGLang {prov.sglang_release}" if prov.engine == "sglang" else f"vLLM {prov.vllm_release}"
    print(f"exported step {prov.step} of {a.run} -> {a.out}")
    print(f"drafter: {prov.architecture}, options: {', '.join(prov.options) or 'none'}; draft KV cache "
          f"{prov.draft_kv_bytes_per_token:,} B per speculated token")
    print(f"eagle_aux_hidden_state_layer_ids: {prov.eagle_aux_hidden_state_layer_ids}")
    print(f"{where} will capture HF {prov.served_capture_indices} (trained on HF "
          f"{prov.capture.hidden_state_indices})")
    for note in prov.notes:
        print(f"note: {note}")
    print(prov.server_command)


def _add_export_sglang(sub) -> None:
    from eagle3.export.sglang import ExportConfig
    p = sub.add_parser("export-sglang", help="export a trained drafter for SGLang (LlamaForCausalLMEagle3 or "
                                             "Eagle3DeepseekV2ForCausalLM) or vLLM")
    options.add_options(p, ExportConfig)
    _add_config(p)
    p.set_defaults(fn=cmd_export_sglang)


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's default in its help, unless the help already says it (or the flag is a switch, off unless
    given)."""
    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text.lower() or action.default in (None, argparse.SUPPRESS) or \
                isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction,
                                    argparse.BooleanOptionalAction)):
            return text
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """No abbreviated flags (`--num-sample 5` is an error, not --num-samples), defaults shown in --help."""
    def __init__(self, *a, **kw):
        kw.setdefault("formatter_class", _Help)
        kw.setdefault("allow_abbrev", False)
        super().__init__(*a, **kw)


CONFIGURABLE = ("dump", "regenerate", "eval", "quickstart", "vocab", "export-sglang")  # train has its own --config


def _add_config(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None,
                   help="a YAML file of this command's options: keys are the flags' names with underscores "
                        "(max_length: 4096, trust_remote_code: true, data: [a.jsonl, b.jsonl]); flags given on the "
                        "command line override it")


def _config_path(words: list[str]) -> str | None:
    for i, w in enumerate(words):
        if w == "--config" and i + 1 < len(words):
            return words[i + 1]
        if w.startswith("--config="):
            return w.split("=", 1)[1]
    return None


def _with_config(parser: argparse.ArgumentParser, cmd: str, path: str, argv: list[str]) -> list[str]:
    """argv with the --config file's options placed before the command line's own (argparse keeps the last value of
    a flag, so the command line wins), so that argparse itself checks every value; an unknown key, or a file that
    is not a YAML mapping, is a ValueError naming the file."""
    import yaml
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[cmd]
    try:
        with open(path, encoding="utf-8") as f:
            values = yaml.safe_load(f)
    except (OSError, yaml.YAMLError, UnicodeDecodeError) as e:
        raise ValueError(f"--config {path}: not a YAML file this loader reads ({type(e).__name__}: "
                         f"{str(e).splitlines()[0][:200]})") from None
    if values is None:
        values = {}
    if not isinstance(values, dict):
        raise ValueError(f"--config {path}: expected a mapping of {cmd} options, got a {type(values).__name__}")
    flags = {a.dest: a for a in sub._actions if a.option_strings and a.dest not in ("help", "config")}
    unknown = sorted(k for k in values if k not in flags)
    if unknown:
        raise ValueError(f"--config {path}: unknown {cmd} options {unknown}; known: {sorted(flags)}")
    pre = []
    for key, value in values.items():
        action = flags[key]
        flag = next(o for o in action.option_strings if o.startswith("--"))
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            if not isinstance(value, bool):
                raise ValueError(f"--config {path}: {key}: {value!r} is not true or false")
            if value != action.default:
                pre.append(flag)
        elif isinstance(action, argparse.BooleanOptionalAction):
            pre.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, list):
            pre += [flag, *map(str, value)]
        elif isinstance(value, (dict, bool)) or value is None:
            raise ValueError(f"--config {path}: {key}: {value!r} is not a value for {flag}")
        else:
            pre += [flag, str(value)]
    rest, skip = [], False
    for i, w in enumerate(argv):  # the command line without --config FILE
        if skip:
            skip = False
            continue
        if w == "--config":
            skip = True
            continue
        if w.startswith("--config="):
            continue
        rest.append(w)
    at = rest.index(cmd)
    return rest[:at + 1] + pre + rest[at + 1:]


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("eagle3")
    except PackageNotFoundError:
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="eagle3", description=__doc__)
    ap.add_argument("--version", action="version", version=f"eagle3 {_version()}")
    sub = ap.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    from eagle3.dump.job import DumpConfig
    p = sub.add_parser("dump", help="capture the target's hidden states into sharded safetensors")
    options.add_options(p, DumpConfig)
    p.add_argument("--preset", default=None,
                   help="configs/targets preset (e.g. kimi-k2.5): checks the target and supplies defaults")
    _add_config(p)
    p.set_defaults(fn=cmd_dump)
    p = sub.add_parser("regenerate", help="let the target (a server, or transformers) rewrite the assistant turns of "
                                          "conversations, so the drafter trains on the target's own answers")
    from eagle3.regenerate.config import RegenConfig
    options.add_options(p, RegenConfig)
    _add_config(p)
    p.set_defaults(fn=cmd_regenerate)
    p = sub.add_parser("vocab", help="draft vocabulary (d2t/t2d) from the training split of dumps")
    from eagle3.data.vocab import VocabConfig
    options.add_options(p, VocabConfig)
    _add_config(p)
    p.set_defaults(fn=cmd_vocab)
    from eagle3.train.config import train_parser
    p = sub.add_parser("train", parents=[train_parser()],
                       help="fit the drafter with DeepSpeed (launch with `deepspeed --module eagle3.train`)")
    p.set_defaults(fn=cmd_train)
    p = sub.add_parser("inspect", help="describe and verify a dump directory or a drafter export (architecture, "
                                       "options, draft KV bytes per token)")
    p.add_argument("path", help="a dump directory or a drafter export directory")
    p.add_argument("--json", action="store_true", help="the report as JSON")
    p.add_argument("--no-verify", action="store_true", help="skip the sha256 check of every file")
    p.set_defaults(fn=cmd_inspect)
    p = sub.add_parser("example-target", help="convert (once) and print the example target directory")
    p.set_defaults(fn=cmd_example_target)
    from eagle3.cli.quickstart import QuickstartConfig
    p = sub.add_parser("quickstart", help="the whole pipeline on the embedded default (SmolLM2-135M + ShareGPT)")
    options.add_options(p, QuickstartConfig)
    _add_config(p)
    p.set_defaults(fn=cmd_quickstart)
    from eagle3.eval.speculative import EvalConfig
    p = sub.add_parser("eval", help="speculative decoding with the target and an exported drafter, as SGLang runs it")
    options.add_options(p, EvalConfig)
    _add_config(p)
    p.set_defaults(fn=cmd_eval)
    _add_export_sglang(sub)
    return ap


def main(argv: list[str] | None = None, process_entry: bool | None = None) -> None:
    """The `eagle3` command. process_entry (default: argv not given, i.e. the console script or `python -m`):
    this call is the process's whole life, so an error also leaves the torch.distributed group it joined; a
    library caller (tests, a notebook) keeps its group."""
    args = None
    try:
        parser = build_parser()
        words = list(sys.argv[1:] if argv is None else argv)
        path = _config_path(words) if words and words[0] in CONFIGURABLE else None
        if path:  # before parsing: options the command requires may come from the file
            words = _with_config(parser, words[0], path, words)
        args = parser.parse_args(words)
        args.fn(args)
    except BrokenPipeError:  # `eagle3 inspect --json | head`: the reader left; not an error of ours
        import os
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # the interpreter's final flush must not raise again
        raise SystemExit(1)
    except (ContractError, ValueError, FileNotFoundError, FloatingPointError) as e:
        print(f"eagle3 {getattr(args, 'cmd', '')}: error: {e}", file=sys.stderr)
        if process_entry if process_entry is not None else argv is None:
            _close_process_group()
        raise SystemExit(2)


def _close_process_group() -> None:
    """A job that failed after joining a torch.distributed group leaves it cleanly: interpreter exit with a live
    gloo/NCCL group (and its C++ threads) ended some failed runs with "terminate called without an active
    exception" and rc 134 instead of the error's own exit code."""
    try:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - the error already printed is the one that matters
        pass


if __name__ == "__main__":
    main()
