"""The README and docs/usage.md cannot drift from the code: every command in their bash blocks names a script that
exists or parses with the `eagle3` command's own parser (flags that exist, values of the right type), the torchrun
and deepspeed launches included."""

import json
import os
import re
import shlex

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ("README.md", os.path.join("docs", "usage.md"))
LAUNCHED = {"eagle3.dump": "dump", "eagle3.regenerate": "regenerate", "eagle3.train": "train"}


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


# The README's Llama-3.1-8B block run as its CPU twin: the same commands in the same order, with only what names the
# real model and its size swapped for the tiny target (every other flag as written).
TWIN = [(r"/models/m\b", "{target}"),  # $T, as commands() writes it
        (r"\bsharegpt\.jsonl\b", "{chats}"), (r"\bmtbench\.jsonl\b", "{chats}"),
        (r"--drafter llama-3\.1-8b", "--drafter tiny --draft-vocab-size 64"),
        (r"--max-new-tokens 1024", "--max-new-tokens 8"), (r"--draft-steps 5", "--draft-steps 2 --num-prompts 2"),
        (r"^torchrun --nproc-per-node 8 -m eagle3\.regenerate", "eagle3 regenerate"),
        (r"^torchrun --nproc-per-node 8 -m eagle3\.dump", "eagle3 dump"),
        (r"^deepspeed --num_gpus 8 --module eagle3\.train", "eagle3 train --no-progress --token-budget 256 --held-out-fraction 0.3 --eval-interval 2")]


def readme_block(title: str) -> list[str]:
    text = open(os.path.join(ROOT, "README.md")).read()
    section = text[text.index(title):]
    section = section[:section.index("\n## ", 1)]
    start = next(n for n, line in enumerate(open(os.path.join(ROOT, "README.md")), 1) if title in line)
    end = start + section.count("\n")
    return [c for n, c in commands("README.md") if start <= n <= end]


@pytest.mark.slow
def test_the_llama_block_runs_as_its_cpu_twin(word_target_dir, tmp_path, monkeypatch):
    from eagle3.cli import main
    from tiny import write_conversations
    chats = str(write_conversations(tmp_path / "chats.jsonl", n=8, seed=4))
    monkeypatch.chdir(tmp_path)
    ran = []
    for cmd in readme_block("## Llama-3.1-8B on one 8-GPU node"):
        twin = cmd
        for pattern, repl in TWIN:
            twin = re.sub(pattern, repl, twin)
        twin = twin.format(target=word_target_dir, chats=chats)
        argv = shlex.split(twin)
        assert argv[0] == "eagle3", twin
        main(argv[1:])
        ran.append(argv[1])
    assert ran == ["regenerate", "dump", "inspect", "train", "export-sglang", "inspect", "eval"], ran
    assert json.load(open(tmp_path / "eval" / "llama" / "eval.json"))["lossless"] is True


@pytest.fixture
def word_target_dir(tmp_path_factory):
    """A tiny Llama whose tokenizer has whole-word tokens (answers re-tokenize to the same ids)."""
    from tiny import WORDS, make_target
    from tiny_tokenizers import make_word_tokenizer
    tok = make_word_tokenizer(WORDS)
    return make_target(str(tmp_path_factory.mktemp("twin_target")), "llama", tokenizer=tok, vocab_size=len(tok),
                       layer_scale=8.0)


# The README's Kimi-K2.5 block as its CPU twin: a tiny Kimi-K2.5-layout target (kimi_k25 wrapper around a DeepseekV3
# backbone, 6 layers), a real OpenAI-compatible server process on localhost in place of SGLang, and what sizes it
# for 8 x H200 (the kimi-k2.5 presets' 61-layer expectations, TP 8, the Kimi drafter shape) swapped for CPU sizes.
KIMI_TWIN = [(r"/models/m\b", "{target}"), (r"\bsharegpt\.jsonl\b", "{chats}"),
             (r"http://10\.0\.0\.1:30000/v1", "{url}"),
             (r"^torchrun --nproc-per-node 8 -m eagle3\.dump --preset kimi-k2\.5", "eagle3 dump --layers 3,4,5"),
             (r"^deepspeed --num_gpus 8 --module eagle3\.train --config kimi-k2\.5",
              "eagle3 train --config kimi-k2.5 --drafter tiny --draft-vocab-size 64 --max-steps 4 --grad-accum 1 "
              "--no-bf16 --save-interval 2 --eval-interval 2 --held-out-fraction 0.4 --no-progress")]


@pytest.mark.slow
def test_the_kimi_block_runs_as_its_cpu_twin(tiny_targets, tmp_path, monkeypatch):
    from eagle3.cli import main
    from test_regenerate import fake_server
    from tiny import write_conversations
    chats = str(write_conversations(tmp_path / "chats.jsonl", n=10, seed=5))
    monkeypatch.chdir(tmp_path)
    ran = []
    with fake_server() as url:
        for cmd in readme_block("## Kimi-K2.5 on 8 × H200"):
            twin = cmd
            for pattern, repl in KIMI_TWIN:
                twin = re.sub(pattern, repl, twin)
            argv = shlex.split(twin.format(target=tiny_targets["kimi_k25"], chats=chats, url=url))
            assert argv[0] == "eagle3", twin
            main(argv[1:])
            ran.append(argv[1])
    assert ran == ["regenerate", "dump", "train", "export-sglang"], ran
    prov = json.load(open(tmp_path / "exports" / "kimi" / "eagle3_provenance.json"))
    assert prov["capture"]["hidden_state_indices"] == [3, 4, 5] and prov["sglang_release"] == "0.5.23"
