"""The README and docs/usage.md cannot drift from the code: every command in their bash blocks names a script that
exists or parses with the `eagle3` command's own parser (flags that exist, values of the right type), the torchrun
and deepspeed launches included."""

import os
import re
import shlex

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ("README.md", os.path.join("docs", "usage.md"))
LAUNCHED = {"eagle3.dump": "dump", "eagle3.dump.regenerate": "regenerate", "eagle3.train": "train"}


def commands(doc: str) -> list[tuple[int, str]]:
    """(line number, command) of every command in the doc's ```bash blocks, continuation lines joined, comments
    and shell variables taken out."""
    out, block, start, cont = [], False, 0, ""
    with open(os.path.join(ROOT, doc)) as f:
        for n, line in enumerate(f, 1):
            if line.startswith("```"):
                block = line.strip() == "```bash" and not block
                continue
            if not block:
                continue
            text = re.sub(r"(^|\s)#.*$", "", line.rstrip("\n")).rstrip()
            if not cont:
                start = n
            if text.endswith("\\"):
                cont += text[:-1] + " "
                continue
            cmd = (cont + text).strip()
            cont = ""
            if cmd and not re.match(r"^[A-Z_]+=\S+$", cmd):
                out.append((start, re.sub(r"\$[A-Z]+", "/models/m", cmd)))
    return out


def eagle3_argv(cmd: str) -> list[str] | None:
    words = shlex.split(cmd)
    while words and re.match(r"^[A-Z_]+=", words[0]):  # VAR=value prefixes
        words = words[1:]
    if not words:
        return None
    if words[0] == "eagle3":
        return words[1:]
    for flag in ("-m", "--module"):
        if words[0] in ("torchrun", "deepspeed") and flag in words:
            i = words.index(flag)
            return [LAUNCHED[words[i + 1]], *words[i + 2:]]
    return None


@pytest.mark.parametrize("doc", DOCS)
def test_every_documented_command_parses_or_exists(doc):
    from eagle3.cli.main import build_parser
    cmds = commands(doc)
    assert cmds, f"{doc}: no bash blocks found"
    checked = 0
    for n, cmd in cmds:
        words = shlex.split(cmd)
        if words[:1] == ["bash"] or (len(words) > 1 and words[1] == "bash"):
            script = words[words.index("bash") + 1]
            assert os.path.isfile(os.path.join(ROOT, script)), f"{doc}:{n}: {script} does not exist"
            checked += 1
            continue
        argv = eagle3_argv(cmd)
        if argv is None:
            continue
        try:
            build_parser().parse_args(argv)
        except SystemExit:
            pytest.fail(f"{doc}:{n}: `{cmd}` does not parse as eagle3 {' '.join(argv[:1])}")
        checked += 1
    assert checked >= 5, (doc, checked)
