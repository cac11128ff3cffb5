"""The dump stage against references: a plain forward's output_hidden_states, a single-process run, an
uninterrupted run."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from eagle3 import contract as C
from eagle3.contract import load_manifest as read_manifest
from eagle3.dump.job import DumpConfig, run_dump

from tiny import reference_hidden_states, write_conversations

def read_dump(out):
    """{sample_index: {name: tensor}} over all shards of a dump, plus the manifest."""
    m = read_manifest(out)
    samples = {}
    for rec in m.shards:
        with safe_open(os.path.join(out, rec.file), "pt") as f:
            t = {k: f.get_tensor(k) for k in f.keys()}
            meta = f.metadata()
        assert json.loads(meta["eagle3"])["hidden_state_indices"] == m.capture.hidden_state_indices
        off = t[C.SAMPLE_OFFSETS]
        for n, si in enumerate(t[C.SAMPLE_INDEX].tolist()):
            a, b = int(off[n]), int(off[n + 1])
            samples[si] = {k: v[a:b] for k, v in t.items() if k not in (C.SAMPLE_OFFSETS, C.SAMPLE_INDEX)}
    return samples, m


def dump(target, data, out, **kw):
    kw.setdefault("dtype", "fp32")
    kw.setdefault("progress", False)
    return run_dump(DumpConfig(target=target, data=[data], out=str(out), **kw))


@pytest.mark.parametrize("kind", ["llama", "deepseek_v3", "kimi_k25"])
def test_captured_states_equal_output_hidden_states(tiny_targets, convs, tmp_path, kind):
    """Every captured tensor of the (batched, right-padded) dump equals hidden_states[k] of a plain per-sample forward."""
    target = tiny_targets[kind]
    layers = [4, 1, 3]  # out of order on purpose: stored ascending
    dump(target, convs, tmp_path / "d", layers=layers, batch_tokens=256)
    samples, m = read_dump(tmp_path / "d")
    assert m.capture.hidden_state_indices == [1, 3, 4]
    assert len(samples) == 12 and m.totals["samples"] == 12
    lengths = {len(s[C.INPUT_IDS]) for s in samples.values()}
    assert len(lengths) > 3, "want varied lengths so batches are padded"
    for si, s in samples.items():
        ids = s[C.INPUT_IDS].long()[None]
        hs, logits, model = reference_hidden_states(target, ids)
        for k in (1, 3, 4):
            torch.testing.assert_close(s[C.hidden_state_key(k)], hs[k][0], atol=1e-5, rtol=1e-5)
        # the teacher's input: post-final-norm state, the one the target's lm_head turns into logits
        torch.testing.assert_close(s[C.FINAL_HIDDEN], hs[-1][0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(model.lm_head(s[C.FINAL_HIDDEN]), logits[0], atol=1e-4, rtol=1e-4)
        # the teacher's full-vocab argmax, recorded at dump time for the trainer's draft-row teacher
        assert s[C.TARGET_ARGMAX].dtype == torch.int32
        assert torch.equal(s[C.TARGET_ARGMAX].long(), logits[0].argmax(-1))
        assert s[C.LOSS_MASK].dtype == torch.uint8 and s[C.INPUT_IDS].dtype == torch.int32
        assert 0 < int(s[C.LOSS_MASK].sum()) < len(s[C.LOSS_MASK])


def test_bf16_dump_within_dtype_tolerance(tiny_targets, convs, tmp_path):
    target = tiny_targets["llama"]
    dump(target, convs, tmp_path / "d", dtype="bf16", num_samples=4)
    samples, m = read_dump(tmp_path / "d")
    assert m.dtype == "bfloat16"
    for s in samples.values():
        hs, _, _ = reference_hidden_states(target, s[C.INPUT_IDS].long()[None])
        for k in m.capture.hidden_state_indices:
            assert s[C.hidden_state_key(k)].dtype == torch.bfloat16
            torch.testing.assert_close(s[C.hidden_state_key(k)].float(), hs[k][0], atol=3e-2, rtol=3e-2)


def test_batched_equals_per_sample_dump(tiny_targets, convs, tmp_path):
    target = tiny_targets["deepseek_v3"]
    dump(target, convs, tmp_path / "batched", batch_tokens=512)
    dump(target, convs, tmp_path / "single", batch_tokens=1)  # one sample per forward, no padding
    a, _ = read_dump(tmp_path / "batched")
    b, _ = read_dump(tmp_path / "single")
    assert a.keys() == b.keys()
    for si in a:
        for k in a[si]:
            torch.testing.assert_close(a[si][k], b[si][k], atol=1e-5, rtol=1e-5)


def test_manifest_totals_and_checksums(tiny_targets, convs, tmp_path):
    target = tiny_targets["llama"]
    m = dump(target, convs, tmp_path / "d", shard_size_mb=0.02)
    assert len(m.shards) > 2
    on_disk = read_manifest(str(tmp_path / "d"))
    assert on_disk.to_dict() == m.to_dict()
    samples, _ = read_dump(tmp_path / "d")
    assert m.totals["tokens"] == sum(len(s[C.INPUT_IDS]) for s in samples.values())
    assert m.totals["samples"] == len(samples)
    for rec in m.shards:
        path = tmp_path / "d" / rec.file
        assert rec.sha256 == C.file_sha256(str(path)) and rec.bytes == path.stat().st_size
    assert m.target.num_hidden_layers == 6 and m.target.hidden_size == 64
    assert m.capture.hidden_state_indices == C.default_capture_indices(6)
    # sample_index is the position in the source, in order
    assert sorted(samples) == list(range(12))


def test_kill_and_resume_gives_the_same_shards(tiny_targets, convs, tmp_path):
    target = tiny_targets["llama"]
    full = dump(target, convs, tmp_path / "full", shard_size_mb=0.02)
    with pytest.raises(SystemExit):
        dump(target, convs, tmp_path / "resumed", shard_size_mb=0.02, stop_after_shards=2)
    out = tmp_path / "resumed"
    assert not (out / "manifest.json").exists()
    # what a kill during the third shard's write leaves behind: temp files and a shard without its sidecar
    (out / "shard-00002.safetensors.tmp-999").write_bytes(b"partial")
    (out / "shard-00001.json.tmp-999").write_text("{")
    (out / "shard-00002.safetensors").write_bytes(b"truncated")
    mine = ["notes.txt.tmp-999", "shard-00002.safetensors.tmp-old", "shard-2.safetensors.tmp-1"]  # not the dump's
    for name in mine:
        (out / name).write_text("keep")
    resumed = dump(target, convs, out, shard_size_mb=0.02)
    assert [r.sha256 for r in resumed.shards] == [r.sha256 for r in full.shards]
    assert resumed.totals == full.totals
    assert sorted(p.name for p in out.glob("*.tmp-*")) == sorted(mine)  # the dump's own stale temp files are gone
    # rerunning a finished dump writes nothing new and keeps the manifest
    again = dump(target, convs, out, shard_size_mb=0.02)
    assert again.to_dict() == resumed.to_dict()


def test_rerun_into_out_with_other_layers_target_or_tokenizer_is_refused(tiny_targets, convs, tmp_path):
    out = tmp_path / "d"
    dump(tiny_targets["llama"], convs, out, num_samples=2)
    with pytest.raises(C.ContractError, match="capture.hidden_state_indices"):
        dump(tiny_targets["llama"], convs, out, num_samples=2, layers=[1, 2, 3])
    with pytest.raises(C.ContractError, match="target.config_sha256"):
        dump(tiny_targets["deepseek_v3"], convs, out, num_samples=2)
    with pytest.raises(C.ContractError, match="different data"):
        dump(tiny_targets["llama"], convs, out, num_samples=3)
    assert read_manifest(str(out)).totals["samples"] == 2  # nothing already written was touched


def _shards(out):
    return {p.name: p.read_bytes() for p in sorted(out.glob("shard-*"))}


def test_resume_checks_each_shards_own_identity(tiny_targets, convs, tmp_path):
    """With dump_config.json and manifest.json gone, the shards' own metadata still refuses another target or other
    layers, before anything is written (no dump_config.json claiming the foreign run either)."""
    import shutil
    from dump_edits import edit_json
    llama, out = tiny_targets["llama"], tmp_path / "d"
    dump(llama, convs, out, shard_size_mb=0.02, num_samples=4)
    (out / "dump_config.json").unlink()
    (out / "manifest.json").unlink()
    before = _shards(out)
    eps = tmp_path / "eps"  # the same model, one config value changed: another target
    shutil.copytree(llama, eps)
    edit_json(str(eps / "config.json"), lambda c: c.update(rms_norm_eps=1e-5))
    with pytest.raises(C.ContractError, match=r"shard-00000.safetensors and this run:\n(.|\n)*target.config_sha256"):
        dump(str(eps), convs, out, shard_size_mb=0.02, num_samples=4)
    other_layers = r"capture.hidden_state_indices: \[3, 4\] \(\S*shard-00000.safetensors\) != \[1, 4\] \(this run"
    with pytest.raises(C.ContractError, match=other_layers):
        dump(llama, convs, out, shard_size_mb=0.02, num_samples=4, layers=[1, 4])
    assert _shards(out) == before and not (out / "dump_config.json").exists()
    # the run that wrote them adopts them
    assert dump(llama, convs, out, shard_size_mb=0.02, num_samples=4).totals["samples"] == 4


def test_resume_into_a_dump_by_an_older_eagle3_is_refused(tiny_targets, convs, tmp_path):
    """Shards or a dump_config.json without the identity this eagle3 records cannot be checked: no resume into them."""
    from dump_edits import edit_json, make_legacy
    llama, out = tiny_targets["llama"], tmp_path / "d"
    dump(llama, convs, out, shard_size_mb=0.02, num_samples=3)
    make_legacy(str(out), 1)
    before = _shards(out)
    with pytest.raises(C.ContractError, match=r"shard-00001.safetensors was written by an eagle3 that did not record"):
        dump(llama, convs, out, shard_size_mb=0.02, num_samples=3)
    edit_json(str(out / "dump_config.json"), lambda c: c.pop("data"))
    with pytest.raises(C.ContractError, match="did not fingerprint the data"):
        dump(llama, convs, out, shard_size_mb=0.02, num_samples=3)
    assert _shards(out) == before


def _swap_words(text):
    w = text.split(" ")
    if len(w) > 3 and w[1] != w[2]:
        w[1], w[2] = w[2], w[1]  # not the first word: each word after a space is tokenized on its own
    return " ".join(w)


def test_resume_refuses_data_edited_in_place(tiny_targets, convs, tmp_path):
    """An edit that keeps every token length (so the shard plan is the same) is still other data."""
    from eagle3.conversations.masking import load_samples
    from eagle3.target.load import load_tokenizer
    llama, out, data = tiny_targets["llama"], tmp_path / "d", tmp_path / "c.jsonl"
    data.write_text(open(convs).read())
    data = str(data)
    with pytest.raises(SystemExit):
        dump(llama, data, out, shard_size_mb=0.02, num_samples=6, stop_after_shards=2)
    tok = load_tokenizer(llama)
    lengths = [len(s.input_ids) for s in load_samples([data], tok, num_samples=6, progress=False)[0]]
    with open(data) as f:
        original = f.read()
    recs = [json.loads(line) for line in original.splitlines()]
    for r in recs:
        for turn in r["conversations"]:
            turn["value"] = _swap_words(turn["value"])
    edited = "".join(json.dumps(r) + "\n" for r in recs)
    assert edited != original
    with open(data, "w") as f:
        f.write(edited)
    assert [len(s.input_ids) for s in load_samples([data], tok, num_samples=6, progress=False)[0]] == lengths
    before = _shards(out)
    with pytest.raises(C.ContractError, match=r"the data changed since the dump in .* started: \[.*c\.jsonl'\]"):
        dump(llama, data, out, shard_size_mb=0.02, num_samples=6)
    (out / "dump_config.json").unlink()  # the shards' own metadata says it too
    with pytest.raises(C.ContractError, match=r"shard-00000.safetensors and this run:\n(.|\n)*data.sha256"):
        dump(llama, data, out, shard_size_mb=0.02, num_samples=6)
    assert _shards(out) == before


@pytest.mark.parametrize("kw, msg", [
    (dict(tp=0), "--tp 0: must be a positive integer"),
    (dict(tp=-3), "--tp -3: must be a positive integer"),
    (dict(max_length=-20), "--max-length -20: must be a positive integer"),
    (dict(batch_tokens=0), "--batch-tokens 0: must be a positive integer"),
    (dict(num_samples=0), "--num-samples 0: must be a positive integer"),
    (dict(shard_size_mb=-1.0), "--shard-size-mb -1.0: must be a positive number"),
    (dict(layers=[]), "--layers names no index"),
    (dict(dtype="int8"), "--dtype 'int8': choose one of"),
])
def test_bad_arguments_are_refused_up_front(kw, msg):
    with pytest.raises(ValueError, match=re.escape(msg)):
        DumpConfig(target="t", data=["d.jsonl"], out="o", **kw)


@pytest.mark.parametrize("args, msg", [(["--tp", "0"], "--tp 0: must be a positive integer"),
                                       (["--layers", ","], "--layers names no index")])
def test_cli_refuses_bad_arguments_without_a_traceback(tiny_targets, convs, tmp_path, capsys, args, msg):
    from eagle3.cli import main
    with pytest.raises(SystemExit) as e:
        main(["dump", "--target", tiny_targets["llama"], "--data", convs, "--out", str(tmp_path / "d"), *args])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"eagle3 dump: error: {msg}" in err and "Traceback" not in err
    assert not (tmp_path / "d").exists()


def test_other_tokenizer_is_refused(tiny_targets, convs, tmp_path):
    import shutil
    from tiny_tokenizers import make_tokenizer
    other = tmp_path / "other"
    shutil.copytree(tiny_targets["llama"], other)
    make_tokenizer("llama3").save_pretrained(other)
    dump(tiny_targets["llama"], convs, tmp_path / "d", num_samples=2)
    with pytest.raises(C.ContractError, match="tokenizer"):
        dump(str(other), convs, tmp_path / "d", num_samples=2)


@pytest.mark.parametrize("layers", [[0, 3], [3, 6], [2, 9]])
def test_layers_out_of_range(tiny_targets, convs, tmp_path, layers):
    with pytest.raises(C.ContractError, match="0 < k < 6"):
        dump(tiny_targets["llama"], convs, tmp_path / "d", layers=layers)
    assert not (tmp_path / "d").exists()


def test_tp_that_does_not_divide_heads(tiny_targets, convs, tmp_path):
    with pytest.raises(ValueError, match="--tp 3 does not divide num_attention_heads=4"):
        dump(tiny_targets["llama"], convs, tmp_path / "d", tp=3)


def test_unwritable_out(tiny_targets, convs, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(C.ContractError, match="not writable"):
        dump(tiny_targets["llama"], convs, blocker / "out")


def test_malformed_line_names_file_and_line(tiny_targets, tmp_path):
    from eagle3.conversations.formats import DataError
    data = write_conversations(tmp_path / "bad.jsonl", n=3, extra_lines=['{"conversations": ['])
    with pytest.raises(DataError, match=r"bad\.jsonl:4"):
        dump(tiny_targets["llama"], data, tmp_path / "d")
    assert not (tmp_path / "d").exists()


def test_tokenizer_without_chat_template(tiny_targets, convs, tmp_path):
    import shutil
    from eagle3.target.load import TargetError
    t = tmp_path / "t"
    shutil.copytree(tiny_targets["llama"], t)
    for name in ("chat_template.jinja",):
        if (t / name).exists():
            (t / name).unlink()
    cfg = json.loads((t / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (t / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(TargetError, match="no chat template"):
        dump(str(t), convs, tmp_path / "d")


def _torchrun(n, *args, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n), "--standalone",
           "-m", "eagle3.dump", *map(str, args), "--dtype", "fp32", "--no-progress"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr[-4000:]
    return r


@pytest.mark.slow
@pytest.mark.parametrize("kind, nproc, tp", [("llama", 2, 2), ("deepseek_v3", 2, 2), ("kimi_k25", 4, 2)])
def test_tensor_parallel_dump_equals_single_process(tiny_targets, convs, tmp_path, kind, nproc, tp):
    """torchrun + gloo: TP (and DP x TP on 4 ranks) gives the same dataset as one process."""
    target = tiny_targets[kind]
    ref = dump(target, convs, tmp_path / "one", shard_size_mb=0.02, num_samples=8)
    _torchrun(nproc, "--target", target, "--data", convs, "--out", tmp_path / "tp", "--tp", tp,
              "--shard-size-mb", 0.02, "--num-samples", 8)
    a, ma = read_dump(tmp_path / "one")
    b, mb = read_dump(tmp_path / "tp")
    assert (mb.tp_size, mb.dp_size) == (tp, nproc // tp)
    assert [(r.file, r.samples, r.tokens) for r in ma.shards] == [(r.file, r.samples, r.tokens) for r in mb.shards]
    assert ma.identity() == mb.identity()
    for si in a:
        for k in a[si]:
            torch.testing.assert_close(b[si][k], a[si][k], atol=1e-5, rtol=1e-5)


def test_cli_dump_and_clear_error(tiny_targets, convs, tmp_path):
    r = subprocess.run([sys.executable, "-m", "eagle3.cli", "dump", "--target", tiny_targets["llama"], "--data", convs,
                        "--out", str(tmp_path / "d"), "--layers", "1,5", "--num-samples", "2", "--no-progress"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    assert read_manifest(str(tmp_path / "d")).capture.hidden_state_indices == [1, 5]
    r = subprocess.run([sys.executable, "-m", "eagle3.cli", "dump", "--target", tiny_targets["llama"], "--data", convs,
                        "--out", str(tmp_path / "e"), "--layers", "0,5"], capture_output=True, text=True)
    assert r.returncode == 2 and "0 < k < 6" in r.stderr


def _hub_cache_entry(cache, kind, repo_id, rev="0123456789abcdef0123456789abcdef01234567"):
    """The Hugging Face hub cache layout by hand (no network): <kind>s--org--name/snapshots/<rev>/ + refs/main."""
    root = cache / f"{kind}s--{repo_id.replace('/', '--')}"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(rev)
    return root / "snapshots" / rev


def test_cli_dump_reads_datasets_dirs_and_hub_ids_from_the_local_cache(tiny_targets, convs, tmp_path):
    """--target a hub model id and --data a save_to_disk directory + a hub dataset id, all offline from a local
    cache: the dump holds the same samples as one of the JSON lines file and the target directory."""
    import shutil
    from datasets import Dataset
    from eagle3.conversations.masking import load_samples
    from eagle3.target.load import load_tokenizer
    hub = tmp_path / "hub"
    model_dir = _hub_cache_entry(hub, "model", "tiny-org/tiny-llama")
    shutil.copytree(tiny_targets["llama"], model_dir)
    with open(convs) as f:
        records = [json.loads(line) for line in f]
    saved = tmp_path / "saved"
    Dataset.from_list(records[:5]).save_to_disk(str(saved))
    data_dir = _hub_cache_entry(hub, "dataset", "tiny-org/chats")
    (data_dir / "data").mkdir(parents=True)
    (data_dir / "data" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[5:]))
    env = dict(os.environ, HF_HOME=str(tmp_path / "hf"), HF_HUB_CACHE=str(hub), HF_HUB_OFFLINE="1",
               HF_DATASETS_CACHE=str(tmp_path / "datasets-cache"), OMP_NUM_THREADS="1")

    def cli(target, *data, out="d"):
        return subprocess.run([sys.executable, "-m", "eagle3.cli", "dump", "--target", target, "--data", *data,
                               "--out", str(tmp_path / out), "--no-progress", "--dtype", "fp32"],
                              capture_output=True, text=True, env=env)
    r = cli("tiny-org/tiny-llama", str(saved), "tiny-org/chats")
    assert r.returncode == 0, r.stderr[-3000:]
    samples, m = read_dump(str(tmp_path / "d"))
    assert m.target.path == str(model_dir) and m.data_files == [str(saved), str(data_dir)]
    assert all(len(f["sha256"]) == 64 for f in m.data_fingerprint["files"])
    ref, _ = load_samples([convs], load_tokenizer(tiny_targets["llama"]), max_length=2048, progress=False)
    assert sorted(samples) == [s.sample_index for s in ref] and len(ref) == len(records)
    for s in ref:
        assert samples[s.sample_index][C.INPUT_IDS].tolist() == s.input_ids
        assert samples[s.sample_index][C.LOSS_MASK].tolist() == s.loss_mask

    # not there: the error names what was looked for and where, no traceback
    r = cli("tiny-org/missing", str(saved), out="e")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert f"--target tiny-org/missing: no such file or directory, and no model 'tiny-org/missing' (revision main) " \
           f"in the local Hugging Face hub cache {hub}" in r.stderr
    r = cli("tiny-org/tiny-llama", "tiny-org/no-chats", out="e")
    assert r.returncode == 2 and "no dataset 'tiny-org/no-chats' (revision main)" in r.stderr, r.stderr[-3000:]


def test_preset_mismatch_is_refused(tiny_targets, convs, tmp_path):
    r = subprocess.run([sys.executable, "-m", "eagle3.cli", "dump", "--preset", "kimi-k2.5", "--target",
                        tiny_targets["kimi_k25"], "--data", convs, "--out", str(tmp_path / "d")],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "num_hidden_layers expected 61, found 6" in r.stderr


def test_without_argmax_the_shards_have_no_argmax_and_batches_none(tiny_targets, convs, tmp_path):
    from eagle3.data.batch import collate
    from eagle3.data.dumps import DumpSet
    dump(tiny_targets["llama"], convs, tmp_path / "d", record_argmax=False, num_samples=4)
    samples, m = read_dump(tmp_path / "d")
    assert all(C.TARGET_ARGMAX not in s for s in samples.values())
    ds = DumpSet(str(tmp_path / "d"))
    assert collate([ds.standardized(r) for r in ds.refs]).target_argmax is None


def test_shard_writer_bytes_are_deterministic_and_hashed_while_written(tmp_path):
    from safetensors import safe_open
    from eagle3.dump.shards import write_safetensors
    g = torch.Generator().manual_seed(0)
    pieces = {"a": [torch.randn(3, 5, generator=g).bfloat16(), torch.randn(0, 5).bfloat16(),
                    torch.randn(4, 5, generator=g).bfloat16()],
              "b": [torch.arange(7, dtype=torch.int64)], "c": [torch.ones(3, dtype=torch.uint8)]}
    shas = [write_safetensors(str(tmp_path / f"{i}.safetensors"), pieces, {"m": "x"}) for i in range(2)]
    blobs = [(tmp_path / f"{i}.safetensors").read_bytes() for i in range(2)]
    assert blobs[0] == blobs[1] and shas[0] == shas[1] == C.file_sha256(str(tmp_path / "0.safetensors"))
    with safe_open(str(tmp_path / "0.safetensors"), "pt") as f:
        assert f.metadata() == {"m": "x"}
        for k, v in pieces.items():
            assert torch.equal(f.get_tensor(k), torch.cat(v))
    with pytest.raises(ValueError, match="dtype"):
        write_safetensors(str(tmp_path / "bad.safetensors"), {"a": [torch.zeros(2), torch.zeros(2).double()]}, {})


def test_shard_writer_survives_short_writes(tmp_path, monkeypatch):
    """An unbuffered write may take fewer bytes than asked (Linux: ~2 GiB per call): nothing may be lost."""
    import io
    from safetensors import safe_open
    from eagle3.dump import shards
    real_open = open

    class Short(io.FileIO):
        def write(self, b):
            return super().write(memoryview(b)[:7])  # at most 7 bytes per call
    monkeypatch.setattr(shards, "open", lambda p, mode, buffering=-1: Short(p, "wb") if "w" in mode
                        else real_open(p, mode, buffering), raising=False)
    t = {"a": [torch.randn(5, 3)], "b": [torch.arange(4, dtype=torch.int32)]}
    sha = shards.write_safetensors(str(tmp_path / "s.safetensors"), t, {})
    assert sha == C.file_sha256(str(tmp_path / "s.safetensors"))
    with safe_open(str(tmp_path / "s.safetensors"), "pt") as f:
        assert torch.equal(f.get_tensor("a"), t["a"][0]) and torch.equal(f.get_tensor("b"), t["b"][0])


def test_a_plain_tokenizer_records_no_remote_code(tiny_dump):
    from eagle3.contract import load_manifest
    assert load_manifest(tiny_dump).tokenizer.remote_code is None
