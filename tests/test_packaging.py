"""The install layout: the top-level folders are one `eagle3` namespace that type checkers can follow."""

import importlib.util
import os
import subprocess
import sys

import pytest

import eagle3


def test_no_bare_top_level_stage_modules(tmp_path):
    """dump/, data/, train/ ... install as eagle3.dump, eagle3.data, eagle3.train, never as `data` or `train`. Looked
    up in a fresh interpreter run outside the checkout (a `python -m pytest` puts the checkout itself on sys.path,
    where its folders are importable by their bare names whatever the install does), so the answer does not depend
    on what the clone's folder is called."""
    names = ("dump", "data", "train", "export", "eval", "target", "cli", "core", "model", "regenerate", "conversations")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = ("import importlib.util, json, eagle3; "
            f"print(json.dumps({{n: (importlib.util.find_spec(n) or None) and importlib.util.find_spec(n).origin "
            f"for n in {names!r}}}))")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    import json
    found = json.loads(r.stdout.strip().splitlines()[-1])
    repo = os.path.realpath(os.path.join(os.path.dirname(__file__), ".."))
    ours = {n: o for n, o in found.items() if o and os.path.realpath(o).startswith(repo + os.sep)}
    assert ours == {}, ours


def test_core_imports_no_stage():
    # the core is the foundation the stages import; the CLI is the layer above them all
    core = os.path.dirname(eagle3.__file__)
    for f in os.listdir(core):
        if f.endswith(".py"):
            text = open(os.path.join(core, f)).read()
            for stage in ("dump", "data", "train", "export", "eval", "target", "cli", "regenerate"):
                assert f"eagle3.{stage}" not in text, (f, stage)


def test_the_dump_imports_no_regeneration_and_neither_job_the_cli():
    """regenerate runs before the dump, which learns where its data came from through eagle3.records, never by
    importing the earlier stage; and neither job imports the CLI (only the `python -m` launchers do, which nothing
    imports)."""
    code = ("import sys, eagle3.dump.job; a = sorted(m for m in sys.modules if m.startswith(('eagle3.regenerate', "
            "'eagle3.cli'))); import eagle3.regenerate.job; b = sorted(m for m in sys.modules "
            "if m.startswith('eagle3.cli')); print(a, b)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "[] []", r.stdout


def test_a_type_checker_resolves_eagle3():
    """mypy reads eagle3.* from the installed package (py.typed, the strict editable install's link tree): a
    wrong type assigned from eagle3.contract is reported, and nothing is unresolved."""
    pytest.importorskip("mypy")  # installed by launch/install.sh (the test extra)
    snippet = ("from eagle3.contract import layer_for_index\n"
               "ok: int = layer_for_index(3)\n"
               "bad: str = layer_for_index(3)\n")
    r = subprocess.run([sys.executable, "-m", "mypy", "--no-incremental", "--follow-imports=silent",
                        "--python-executable", sys.executable, "-c", snippet],
                       capture_output=True, text=True, timeout=600, cwd=os.path.dirname(__file__))
    out = r.stdout + r.stderr
    assert "import-not-found" not in out and "import-untyped" not in out, out
    assert 'Incompatible types in assignment (expression has type "int", variable has type "str")' in out, out
    assert "Found 1 error" in out, out


def _subparsers():
    import argparse
    from eagle3.cli.main import build_parser
    ap = build_parser()
    sub = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction))
    return ap, sub.choices


def test_every_flag_of_every_subcommand_explains_itself_and_shows_its_default():
    import argparse
    ap, subs = _subparsers()
    for name, p in subs.items():
        for act in p._actions:
            if act.help == argparse.SUPPRESS or isinstance(act, argparse._HelpAction):
                continue
            assert act.help, f"eagle3 {name} {act.option_strings or act.dest}: no help"
        text = " ".join(p.format_help().split())
        for act in p._actions:
            if act.option_strings and act.default not in (None, argparse.SUPPRESS, False, True) \
                    and act.help != argparse.SUPPRESS:
                assert "default" in (act.help or "").lower() or f"(default: {act.default})" in text, \
                    f"eagle3 {name} {act.option_strings[0]}: default {act.default!r} not shown"
    assert "--stop-after-steps" not in subs["train"].format_help()
    assert "--stop-after-shards" not in subs["dump"].format_help()


def test_no_abbreviations_a_version_and_a_closed_pipe(tiny_dump):
    _, subs = _subparsers()
    with pytest.raises(SystemExit):
        subs["quickstart"].parse_args(["--num-sample", "5"])  # before: ran as --num-samples 5
    r = subprocess.run([sys.executable, "-m", "eagle3.cli", "--version"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("eagle3 "), r
    # `eagle3 inspect --json DIR | head -1`: the reader has left; stdout is a pipe nobody reads (deterministic: the
    # read end is closed before anything is written). Before: a BrokenPipeError traceback.
    code = ("import os, sys; r, w = os.pipe(); os.close(r); os.dup2(w, 1); from eagle3.cli import main; "
            f"main(['inspect', '--json', {tiny_dump!r}])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert "Traceback" not in r.stderr and "BrokenPipe" not in r.stderr, r.stderr[-2000:]
    assert r.returncode == 1


def test_every_command_with_many_options_takes_a_config_file(tmp_path, capsys):
    """--config FILE for dump, regenerate, eval, quickstart, vocab and export-sglang (train has its own, with
    presets): the file's options, the command line's over them, every value checked by argparse itself."""
    from eagle3.cli.main import CONFIGURABLE, _with_config, build_parser, main
    ap, subs = _subparsers()
    for cmd in CONFIGURABLE:
        assert "--config" in subs[cmd].format_help(), cmd
    f = tmp_path / "dump.yaml"
    f.write_text("target: /models/t\ndata: [a.jsonl, b.jsonl]\nout: o\nmax_length: 512\nno_record_argmax: true\n"
                 "trust_remote_code: false\n")
    words = _with_config(ap, "dump", str(f), ["dump", "--config", str(f), "--max-length", "256"])
    a = ap.parse_args(words)  # --target/--data/--out are required: the file gives them
    assert (a.target, a.data, a.out, a.max_length, a.no_record_argmax, a.trust_remote_code) == \
        ("/models/t", ["a.jsonl", "b.jsonl"], "o", 256, True, False)
    f.write_text("target: t\nmax_lenght: 5\n")
    with pytest.raises(SystemExit):
        main(["dump", "--config", str(f)])
    assert "unknown dump options ['max_lenght']" in capsys.readouterr().err
    f.write_text("target: t\ndata: [d]\nout: o\nmax_length: long\n")
    with pytest.raises(SystemExit):
        main(["dump", "--config", str(f)])
    assert "--max-length: invalid int value: 'long'" in capsys.readouterr().err
