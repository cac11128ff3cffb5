"""Stage 2: standardize_data_v1, the dump reader, the split, DP batching with resume, the draft vocabulary."""

import collections
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from eagle3 import contract as C
from eagle3.data import standardize_data_v1
from eagle3.data.batch import collate
from eagle3.data.dumps import DumpSet, split
from eagle3.data.loader import BatchPlan, length_grouped_batches, make_loader
from eagle3.data.vocab import build_vocab, count_tokens, load_vocab, save_vocab, select_draft_vocab
from eagle3.vocab_map import draft_ids, vocab_map

from tiny import reference_hidden_states


def test_standardize_equals_output_hidden_states(tiny_dump, tiny_targets):
    """hidden_state = cat(hidden_states[1], [3], [4]) of a plain forward -- ascending although dumped as 4,1,3."""
    ds = DumpSet(tiny_dump)
    assert ds.indices == [1, 3, 4]
    H = ds.manifest.target.hidden_size
    for ref in ds.refs[:5]:
        s = ds.standardized(ref)
        hs, _, _ = reference_hidden_states(tiny_targets["llama"], s["input_ids"].long()[None])
        assert s["hidden_state"].shape == (ref.length, 3 * H)
        torch.testing.assert_close(s["hidden_state"][:, :H], hs[1][0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(s["hidden_state"][:, H:2 * H], hs[3][0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(s["hidden_state"][:, 2 * H:], hs[4][0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(s["final_hidden"], hs[-1][0], atol=1e-5, rtol=1e-5)


def _manifest(indices, H=4):
    return C.DumpManifest(target=C.TargetInfo("/t", "X", 8, H, 100, "h"), capture=C.CaptureSpec(indices),
                          tokenizer=C.TokenizerInfo("a", "b"), dtype="float32", max_length=None, tp_size=1,
                          dp_size=1)


def _sample(indices, T=3, H=4):
    s = {C.INPUT_IDS: torch.arange(T), C.LOSS_MASK: torch.ones(T, dtype=torch.uint8),
         C.FINAL_HIDDEN: torch.randn(T, H)}
    for k in indices:
        s[C.hidden_state_key(k)] = torch.full((T, H), float(k))
    return s


def test_standardize_order_comes_from_the_manifest():
    out = standardize_data_v1(_sample([2, 5, 7]), _manifest([2, 5, 7]))
    assert out["hidden_state"][0].tolist() == [2.0] * 4 + [5.0] * 4 + [7.0] * 4
    # a manifest naming other layers than the sample has is an error, not a silent substitution
    with pytest.raises(C.ContractError, match=r"shard-00003.safetensors sample_index 9: missing \['hidden_states.6'\]"):
        standardize_data_v1(_sample([2, 5, 7]), _manifest([2, 6, 7]), source="shard-00003.safetensors sample_index 9")


def test_standardize_refuses_wrong_width_and_nan():
    s = _sample([2, 5])
    s[C.hidden_state_key(5)] = torch.zeros(3, 5)
    with pytest.raises(C.ContractError, match=r"hidden_states.5 has shape \(3, 5\), expected \(3, 4\)"):
        standardize_data_v1(s, _manifest([2, 5]), source="x")
    s = _sample([2, 5])
    s[C.FINAL_HIDDEN][1, 2] = float("nan")
    with pytest.raises(C.ContractError, match="x: final_hidden contains NaN"):
        standardize_data_v1(s, _manifest([2, 5]), source="x")


@pytest.mark.parametrize("nan_byte", [0x7F, 0xFF])
def test_standardize_of_fp8_left_quantized_refuses_nan_and_bad_scales(nan_byte):
    """fp8 states kept as stored (DumpSet fp8_in_batch): both e4m3fn NaN encodings are refused (checked on the
    bytes), and so is a non-finite or misshapen scale; clean ones pass their scales along in index order."""
    def fp8_sample():
        s = _sample([2, 5])
        for k in [C.FINAL_HIDDEN, C.hidden_state_key(2), C.hidden_state_key(5)]:
            s[k] = s[k].to(torch.float8_e4m3fn)
            s[C.scale_key(k)] = torch.full((3,), 0.5)
        return s
    out = standardize_data_v1(fp8_sample(), _manifest([2, 5]), source="x", concat=False)
    assert len(out["hidden_state.scale"]) == 2 and out["final_hidden.scale"].shape == (3,)
    s = fp8_sample()
    s[C.hidden_state_key(5)].view(torch.uint8)[2, 1] = nan_byte
    with pytest.raises(C.ContractError, match="x: hidden_states.5 contains NaN"):
        standardize_data_v1(s, _manifest([2, 5]), source="x")
    for bad in (torch.tensor([0.5, float("inf"), 0.5]), torch.full((2,), 0.5)):
        s = fp8_sample()
        s[C.scale_key(C.FINAL_HIDDEN)] = bad
        with pytest.raises(C.ContractError, match=r"x: final_hidden.scale has shape"):
            standardize_data_v1(s, _manifest([2, 5]), source="x")


def _copy(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


def test_altered_truncated_and_missing_shards_are_refused(tiny_dump, tmp_path):
    d = _copy(tiny_dump, tmp_path / "altered")
    shard = os.path.join(d, "shard-00001.safetensors")
    data = bytearray(open(shard, "rb").read())
    data[-5] ^= 0xFF
    open(shard, "wb").write(bytes(data))
    with pytest.raises(C.ContractError, match=r"shard-00001.safetensors: sha256 differs"):
        DumpSet(d)
    d = _copy(tiny_dump, tmp_path / "truncated")
    shard = os.path.join(d, "shard-00000.safetensors")
    open(shard, "r+b").truncate(100)
    with pytest.raises(C.ContractError, match=r"shard-00000.safetensors: 100 bytes, the manifest says"):
        DumpSet(d)
    d = _copy(tiny_dump, tmp_path / "missing")
    os.remove(os.path.join(d, "shard-00002.safetensors"))
    with pytest.raises(C.ContractError, match="shard-00002.safetensors: shard listed in the manifest is missing"):
        DumpSet(d)
    d = _copy(tiny_dump, tmp_path / "nomanifest")
    os.remove(os.path.join(d, "manifest.json"))
    with pytest.raises(FileNotFoundError, match="no manifest.json"):
        DumpSet(d)


def test_dumps_with_other_layers_or_target_are_not_mixed(tiny_dump, tiny_targets, convs, tmp_path):
    from eagle3.dump.job import DumpConfig, run_dump
    other = str(tmp_path / "other")
    run_dump(DumpConfig(target=tiny_targets["llama"], data=[convs], out=other, layers=[1, 3, 5], dtype="fp32",
                        num_samples=2, progress=False))
    with pytest.raises(C.ContractError, match=r"capture.hidden_state_indices: \[1, 3, 4\]"):
        DumpSet([tiny_dump, other])


def _dump(target, data, out, **kw):
    from eagle3.dump.job import DumpConfig, run_dump
    run_dump(DumpConfig(target=target, data=data, out=str(out), layers=[4, 1, 3], dtype="fp32", progress=False, **kw))
    return str(out)


def test_dumps_holding_the_same_samples_are_refused(tiny_dump, tiny_targets, convs, tmp_path):
    """A sample is (data file content, record in it): a dump listed twice, a copy of it, or a dump of [other, convs]
    overlapping convs would each count samples twice."""
    from tiny import write_conversations
    with pytest.raises(C.ContractError, match=r"dump .* is listed twice"):
        DumpSet([tiny_dump, tiny_dump])
    os.symlink(tiny_dump, tmp_path / "link")
    with pytest.raises(C.ContractError, match=r"dump .*link is listed twice"):
        DumpSet([tiny_dump, str(tmp_path / "link")])
    copy = _copy(tiny_dump, tmp_path / "copy")
    with pytest.raises(C.ContractError, match=rf"dumps {tiny_dump} and {copy} hold the same samples"):
        DumpSet([tiny_dump, copy])
    other = write_conversations(tmp_path / "other.jsonl", n=2, seed=1)
    # records 0, 1 of other.jsonl, then record 0 of convs (sample_index 2 here, 0 in tiny_dump)
    both = _dump(tiny_targets["llama"], [other, convs], tmp_path / "both", num_samples=3)
    with pytest.raises(C.ContractError, match=rf"{both}/shard-\d+.safetensors sample_index 2: the same record"):
        DumpSet([tiny_dump, both])
    only_other = _dump(tiny_targets["llama"], [other], tmp_path / "only_other")
    assert len(DumpSet([tiny_dump, only_other]).refs) == len(DumpSet(tiny_dump).refs) + 2


@pytest.mark.parametrize("edit, msg", [
    (lambda m: m["capture"].update(hidden_state_indices=[2, 3, 4]), r"holds hidden states \[1, 3, 4\], but .* claims "
                                                                    r"\[2, 3, 4\]"),
    (lambda m: m["capture"].update(hidden_state_indices=[3, 4]), r"holds hidden states \[1, 3, 4\], but .* claims "
                                                                 r"\[3, 4\]"),
    (lambda m: m["tokenizer"].update(sha256="0" * 64), r"tokenizer.sha256"),
    (lambda m: m.update(dtype="bfloat16"), r"dtype: 'float32'"),
    (lambda m: m["data_fingerprint"].update(sha256="0" * 64), r"data.sha256"),
])
def test_shards_are_checked_against_an_edited_manifest(tiny_dump, tmp_path, edit, msg):
    """The manifest's sha256s of the shards still match; only the shards' own metadata and tensors tell."""
    from dump_edits import edit_json
    from eagle3.data.inspect import inspect_dump
    d = _copy(tiny_dump, tmp_path / "d")
    edit_json(os.path.join(d, "manifest.json"), edit)
    with pytest.raises(C.ContractError, match=msg):
        DumpSet(d, verify=False)
    rep = inspect_dump(d)
    assert rep["verified"].startswith("FAILED: ") and re.search(msg, rep["verified"])


def test_dump_from_before_shard_identity_reads_with_its_checks(tiny_dump, tmp_path):
    """Legacy shards (format-v1 keys only) still read; their indices and target are still checked; a dump of legacy
    and new shards is no one dump."""
    from dump_edits import edit_json, make_legacy
    from eagle3.data.inspect import inspect_dump, render
    d = _copy(tiny_dump, tmp_path / "legacy")
    n = len(C.load_manifest(d).shards)
    make_legacy(d, 0)
    with pytest.raises(C.ContractError, match=rf"{d}: its shards come from 2 different dump runs"):
        DumpSet(d)
    for j in range(1, n):
        make_legacy(d, j)
    edit_json(os.path.join(d, "manifest.json"), lambda m: m.pop("data_fingerprint"))
    ds = DumpSet(d)
    assert ds.legacy == [d] and len(ds.refs) == len(DumpSet(tiny_dump).refs)
    torch.testing.assert_close(ds.standardized(ds.refs[0]), DumpSet(tiny_dump).standardized(ds.refs[0]))
    assert "identity legacy" in render(inspect_dump(d))
    edit_json(os.path.join(d, "manifest.json"), lambda m: m["target"].update(config_sha256="0" * 64))
    with pytest.raises(C.ContractError, match="target_config_sha256"):
        DumpSet(d)


def test_split_is_deterministic_disjoint_and_seeded(tiny_dump):
    ds = DumpSet(tiny_dump)
    tr, ho = split(ds.refs, 0.25, seed=3)
    assert set(tr).isdisjoint(ho) and len(tr) + len(ho) == len(ds.refs)
    assert split(ds.refs, 0.25, seed=3) == (tr, ho)
    # by sample_index: the same source sample stays on its side whatever dump it comes from
    many = [ds.refs[0].__class__(0, 0, 0, 1, i) for i in range(20000)]
    tr2, ho2 = split(many, 0.1, seed=1)
    assert 0.08 < len(ho2) / 20000 < 0.12
    assert {r.sample_index for r in split(many, 0.1, seed=2)[1]} != {r.sample_index for r in ho2}


@pytest.mark.parametrize("world", [1, 2, 3])
def test_ranks_read_every_sample_exactly_once_per_epoch(world):
    lengths = [int(x) for x in torch.randint(5, 200, (101,), generator=torch.Generator().manual_seed(0))]
    for epoch in range(3):
        seen = collections.Counter()
        steps = set()
        for rank in range(world):
            plan = BatchPlan(lengths, token_budget=600, seed=7, rank=rank, world_size=world)
            mine = plan.epoch(epoch)
            steps.add(len(mine))
            for b in mine:
                assert len(b) * max(lengths[i] for i in b) <= 600 or len(b) == 1
                seen.update(b)
        assert seen == collections.Counter(range(101)), "each sample exactly once"
        assert len(steps) == 1, "every rank runs the same number of steps"
    # epochs differ (shuffled), seeds differ
    assert length_grouped_batches(lengths, 600, 7, 0, 1) != length_grouped_batches(lengths, 600, 7, 1, 1)


def test_resume_at_step_gives_the_same_batches():
    lengths = [int(x) for x in torch.randint(5, 200, (60,), generator=torch.Generator().manual_seed(1))]
    plan = BatchPlan(lengths, token_budget=500, seed=0, rank=1, world_size=2)
    full = list(plan.batches_from(0, 50))  # crosses several epochs
    fresh = BatchPlan(lengths, token_budget=500, seed=0, rank=1, world_size=2)
    for s in (0, 7, 13, 31):
        assert list(fresh.batches_from(s, 50 - s)) == full[s:]


def test_loader_with_workers_reads_what_the_dumpset_holds(tiny_dump):
    ds = DumpSet(tiny_dump)
    refs, _ = split(ds.refs, 0.0)
    plan = BatchPlan([r.length for r in refs], token_budget=400, seed=0, rank=0, world_size=1)
    batches = list(plan.batches_from(0, 4))
    got = list(make_loader(ds, refs, plan, start_step=0, num_steps=4, num_workers=2))
    assert len(got) == 4
    for batch, b in zip(batches, got):
        want = collate([ds.standardized(refs[i]) for i in batch])
        assert want.tensors().keys() == b.tensors().keys()
        for k, v in want.tensors().items():
            assert torch.equal(v, b.tensors()[k]), k
        assert b.attention_mask.sum() == sum(refs[i].length for i in batch)


def test_vocab_matches_brute_force(tiny_dump):
    ds = DumpSet(tiny_dump)
    refs, _ = split(ds.refs, 0.2, seed=0)
    brute = collections.Counter()
    for r in refs:
        s = ds.sample(r, [C.INPUT_IDS, C.LOSS_MASK])
        brute.update(int(t) for t, m in zip(s[C.INPUT_IDS], s[C.LOSS_MASK]) if m)
    counts = count_tokens(ds, refs)
    assert {i: int(c) for i, c in enumerate(counts) if c} == dict(brute)
    n = 20
    expect = sorted(sorted(brute, key=lambda t: (-brute[t], t))[:n])
    vocab = build_vocab(ds, refs, n)
    assert draft_ids(vocab["d2t"]).tolist() == expect
    assert vocab["t2d"].nonzero().flatten().tolist() == expect
    assert vocab["meta"]["coverage"] == pytest.approx(sum(brute[t] for t in expect) / sum(brute.values()))


def test_vocab_ties_and_fill():
    counts = torch.tensor([0, 5, 3, 5, 0, 3, 1])
    assert select_draft_vocab(counts, 3).tolist() == [1, 2, 3]     # 5,5 then the smaller of the two 3s
    assert select_draft_vocab(counts, 6).tolist() == [0, 1, 2, 3, 5, 6]  # fill with the remaining ids in order
    assert select_draft_vocab(counts, 7).tolist() == list(range(7))
    with pytest.raises(ValueError):
        select_draft_vocab(counts, 8)


def test_d2t_t2d_round_trip(tmp_path):
    ids = torch.tensor([3, 4, 10, 99])
    d2t, t2d = vocab_map(ids, 100)
    assert d2t.tolist() == [3, 3, 8, 96]            # target = draft + d2t[draft]
    assert draft_ids(d2t).tolist() == ids.tolist()
    vocab = {"d2t": d2t, "t2d": t2d, "meta": {"coverage": 0.5}}
    save_vocab(str(tmp_path / "v.safetensors"), vocab)
    back = load_vocab(str(tmp_path / "v.safetensors"))
    assert torch.equal(back["d2t"], d2t) and torch.equal(back["t2d"], t2d) and back["meta"]["coverage"] == 0.5
    from safetensors.torch import save_file
    t2d_bad = t2d.clone()
    t2d_bad[5] = True
    save_file({"d2t": d2t, "t2d": t2d_bad}, str(tmp_path / "bad.safetensors"))
    with pytest.raises(C.ContractError, match="disagree"):
        load_vocab(str(tmp_path / "bad.safetensors"))


def test_cli_vocab_and_inspect(tiny_dump, tmp_path):
    out = str(tmp_path / "vocab.safetensors")
    r = subprocess.run([sys.executable, "-m", "eagle3.cli", "vocab", "--dump", tiny_dump, "--draft-vocab-size", "32",
                        "--out", out], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "coverage" in r.stdout and load_vocab(out)["d2t"].numel() == 32
    r = subprocess.run([sys.executable, "-m", "eagle3.cli", "inspect", tiny_dump, "--json"], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.loads(r.stdout)
    m = C.load_manifest(tiny_dump)
    assert rep["capture"]["hidden_state_indices"] == [1, 3, 4] and rep["verified"] == "sha256 ok"
    assert rep["totals"]["tokens"] == m.totals["tokens"]
    assert rep["bytes_per_token"] == pytest.approx(m.totals["bytes"] / m.totals["tokens"])
    r = subprocess.run([sys.executable, "-m", "eagle3.cli", "inspect", tiny_dump], capture_output=True, text=True)
    assert "HF indices [1, 3, 4]" in r.stdout and "output of layer 0" in r.stdout
