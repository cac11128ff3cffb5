"""What is read is what is recorded (issue 30, item 3): a replaced data file is read anew, the same data twice is
refused, a manifest reads nothing outside its directory and its totals match its shards, an edited checkpoint record
no longer exports, and samples or prompts past the target's positions are refused by name."""

import json
import os
import shutil

import pytest

from eagle3 import contract as C
from eagle3.conversations.formats import DataError


def _parquet(path, texts):
    import pyarrow as pa
    import pyarrow.parquet as pq
    rows = [{"conversations": [{"from": "human", "value": t}, {"from": "gpt", "value": "ok " + t}]} for t in texts]
    pq.write_table(pa.Table.from_pylist(rows), path)


def test_a_replaced_file_of_the_same_name_and_mtime_is_read_anew(tmp_path, monkeypatch):
    """`datasets` keyed its cache on path, size and mtime: `cp -p` of another file of the same size served the old
    records while the manifest recorded the new file's sha256."""
    from eagle3.conversations.formats import read_conversations
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    import datasets
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    f = tmp_path / "d.parquet"
    _parquet(f, ["alpha one", "beta two"])
    stat = os.stat(f)
    first = [m[0]["content"] for _, _, m in read_conversations([str(f)])]
    _parquet(tmp_path / "other.parquet", ["gamma six", "delta sev"])  # same size: same lengths of text
    shutil.copyfile(tmp_path / "other.parquet", f)
    os.utime(f, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert os.stat(f).st_mtime_ns == stat.st_mtime_ns
    second = [m[0]["content"] for _, _, m in read_conversations([str(f)])]
    assert first == ["alpha one", "beta two"] and second == ["gamma six", "delta sev"]


def test_the_same_data_twice_is_refused(tiny_targets, convs, tmp_path):
    from eagle3.dump.job import DumpConfig, run_dump
    copy = tmp_path / "copy.jsonl"
    shutil.copyfile(convs, copy)
    for data, what in (([convs, convs], "the same file twice"), ([convs, str(copy)], "the same data twice")):
        with pytest.raises(DataError, match=what):
            run_dump(DumpConfig(target=tiny_targets["llama"], data=data, out=str(tmp_path / "d"), layers=[1],
                                dtype="fp32", progress=False))
        assert not (tmp_path / "d").exists()
    from eagle3.regenerate.config import RegenConfig
    from eagle3.regenerate.job import run_regenerate
    with pytest.raises(DataError, match="the same file twice"):
        run_regenerate(RegenConfig(data=[convs, convs], out=str(tmp_path / "r"), target=tiny_targets["llama"],
                                   engine="hf", progress=False))
    assert not (tmp_path / "r").exists()


def _copy(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


def _edit(path, fn):
    with open(path) as f:
        d = json.load(f)
    fn(d)
    with open(path, "w") as f:
        json.dump(d, f)


def test_manifest_shards_stay_inside_and_totals_match(tiny_dump, tmp_path):
    from eagle3.data.inspect import inspect_dump

    def main(argv):  # `eagle3 inspect DIR`'s reading of the dump
        return inspect_dump(argv[1])
    d = _copy(tiny_dump, tmp_path / "d")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    first = C.load_manifest(d).shards[0].file
    shutil.copyfile(os.path.join(d, first), outside / first)
    for bad in (f"../elsewhere/{first}", str(outside / first)):
        e = _copy(tiny_dump, tmp_path / f"e{len(bad)}")
        _edit(os.path.join(e, C.MANIFEST_FILE), lambda m: m["shards"][0].update(file=bad))
        with pytest.raises(C.ContractError, match="not a file name inside the dump directory"):
            main(["inspect", e])
    # the tail of the shard list removed (totals left): refused; totals fixed too: the unlisted files tell
    n = len(C.load_manifest(d).shards)
    assert n >= 3
    _edit(os.path.join(d, C.MANIFEST_FILE), lambda m: m.update(shards=m["shards"][: n // 2]))
    with pytest.raises(C.ContractError, match="totals disagree with its shard list"):
        main(["inspect", d])

    def fix_totals(m):
        m["totals"] = {"shards": len(m["shards"]), "samples": sum(s["samples"] for s in m["shards"]),
                       "tokens": sum(s["tokens"] for s in m["shards"]), "bytes": sum(s["bytes"] for s in m["shards"]),
                       "skipped": m["totals"]["skipped"]}
    _edit(os.path.join(d, C.MANIFEST_FILE), fix_totals)
    with pytest.raises(C.ContractError, match="holds shards its manifest does not list"):
        main(["inspect", d])
    # fields of the wrong type: a named error, not a traceback
    w = _copy(tiny_dump, tmp_path / "w")
    _edit(os.path.join(w, C.MANIFEST_FILE), lambda m: m.update(tp_size="two"))
    with pytest.raises(C.ContractError, match="tp_size is 'two', expected int"):
        main(["inspect", w])
    w2 = _copy(tiny_dump, tmp_path / "w2")
    _edit(os.path.join(w2, C.MANIFEST_FILE), lambda m: m["shards"][1].update(tokens="many"))
    with pytest.raises(C.ContractError, match=r"shards\[1\].tokens is 'many'"):
        main(["inspect", w2])


def test_an_edited_checkpoint_record_does_not_export(tiny_run, tmp_path):
    """run.json and eagle3_checkpoint.json edited alike (HF [1, 3, 4] -> [1, 2, 4]): before, export wrote ids for
    the edited capture; now the weights' own metadata says what they were trained on."""
    from eagle3.export.sglang import export_drafter
    from eagle3.records import CKPT_FILE, RUN_FILE
    run = _copy(tiny_run, tmp_path / "run")
    export_drafter(run, str(tmp_path / "ok"))  # untouched: exports

    def recapture(d):
        d["capture"]["hidden_state_indices"] = [1, 2, 4]
        d["identity"]["capture.hidden_state_indices"] = [1, 2, 4]
    _edit(os.path.join(run, RUN_FILE), recapture)
    root = os.path.join(run, "checkpoints")
    for tag in os.listdir(root):
        if os.path.isfile(os.path.join(root, tag, CKPT_FILE)):
            _edit(os.path.join(root, tag, CKPT_FILE), recapture)
    with pytest.raises(C.ContractError, match="the record was edited after training"):
        export_drafter(run, str(tmp_path / "bad"))


def test_samples_and_prompts_past_the_targets_positions_are_refused(tiny_targets, tmp_path, tiny_export):
    from tiny import make_target, write_conversations
    from eagle3.dump.job import DumpConfig, run_dump
    from eagle3.eval.speculative import evaluate
    short = make_target(str(tmp_path / "short"), "llama", max_position_embeddings=48)
    data = write_conversations(tmp_path / "c.jsonl", n=6, seed=3)
    with pytest.raises(DataError, match=r"tokens, more than the target's max_position_embeddings 48; pass "
                                        r"--max-length 48"):
        run_dump(DumpConfig(target=short, data=[str(data)], out=str(tmp_path / "d"), layers=[1], dtype="fp32",
                            progress=False))
    m = run_dump(DumpConfig(target=short, data=[str(data)], out=str(tmp_path / "d2"), layers=[1], dtype="fp32",
                            max_length=48, progress=False))
    assert m.totals["samples"] > 0
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"conversations": [{"from": "human", "value": "word " * 5000}]}) + "\n")
    with pytest.raises(DataError, match=r"p.jsonl:1: a prompt of [\d,]+ tokens"):
        evaluate(tiny_targets["llama"], tiny_export, str(prompts), draft_steps=2, max_new_tokens=4, dtype="fp32",
                 device="cpu")
