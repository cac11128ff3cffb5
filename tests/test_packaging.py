"""The install layout: the top-level folders are one `eagle3` namespace that type checkers can follow."""

import importlib.util
import os
import subprocess
import sys

import pytest

import eagle3


def test_no_bare_top_level_stage_modules():
    # dump/, data/, train/ ... install as eagle3.dump, eagle3.data, eagle3.train, never as `data` or `train`
    for name in ("dump", "data", "train", "export", "eval", "target", "cli", "core"):
        spec = importlib.util.find_spec(name)
        assert spec is None or "eagle3" not in (spec.origin or ""), name


def test_core_imports_no_stage():
    # the core is the foundation the stages import; the CLI is the layer above them all
    core = os.path.dirname(eagle3.__file__)
    for f in os.listdir(core):
        if f.endswith(".py"):
            text = open(os.path.join(core, f)).read()
            for stage in ("dump", "data", "train", "export", "eval", "target", "cli"):
                assert f"eagle3.{stage}" not in text, (f, stage)


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
