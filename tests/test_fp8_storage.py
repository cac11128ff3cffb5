"""fp8 storage of a dump (issue 15 part 3): e4m3 states with one float32 scale per token row, dequantized on read."""

import json
import os

import pytest
import torch
from safetensors import safe_open

from eagle3 import contract as C
from eagle3.data.dumps import DumpSet
from eagle3.data.loader import BatchPlan, make_loader
from eagle3.dump.job import DumpConfig, run_dump
from eagle3.dump.shards import dequantize_fp8, quantize_fp8, read_shard_metadata, shard_name

LAYERS = [4, 1, 3]  # as tiny_dump (conftest): stored ascending 1, 3, 4


@pytest.fixture(scope="module")
def fp8_dump(tiny_targets, convs, tmp_path_factory):
    """The tiny_dump data again (fp32 model), stored in fp8, written through the CLI flag."""
    from eagle3.cli import main
    out = str(tmp_path_factory.mktemp("fp8") / "llama")
    main(["dump", "--target", tiny_targets["llama"], "--data", convs, "--out", out, "--layers", "4,1,3",
          "--dtype", "fp32", "--storage", "fp8", "--shard-size-mb", "0.03", "--no-progress"])
    return out


def naive_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round float64 values to the nearest float8 e4m3fn value (ties to even), written from the format's
    definition (3 mantissa bits, exponent bias 7, subnormal step 2^-9, max 448), not with torch's float8 cast."""
    a = x.abs()
    e = torch.floor(torch.log2(a.clamp(min=2.0**-6)))  # values below 2^-6 are subnormal: one fixed step
    step = torch.exp2(e - 3)
    return (torch.round(x / step) * step).clamp(-448.0, 448.0)


def naive_roundtrip(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] -> dequant(quant(x)) in float64 with the contract's scale rule (row amax / 448, 1 for zero rows),
    and the size of one e4m3 step there (in x's units)."""
    x = x.double()
    amax = x.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    y = x / scale
    return naive_e4m3(y) * scale, torch.exp2(torch.floor(torch.log2(y.abs().clamp(min=2.0**-6))) - 3) * scale


def by_index(ds: DumpSet) -> dict:
    return {r.sample_index: r for r in ds.refs}


def test_fp8_dump_records_its_storage_and_layout(fp8_dump):
    m = C.load_manifest(fp8_dump)
    assert m.storage == "fp8" and m.dtype == "float32"
    H, n = m.target.hidden_size, len(LAYERS) + 1
    names = [C.FINAL_HIDDEN] + [C.hidden_state_key(k) for k in (1, 3, 4)]
    for rec in m.shards:
        path = os.path.join(fp8_dump, rec.file)
        assert read_shard_metadata(path)["storage"] == "fp8"
        with safe_open(path, "pt") as f:
            N = rec.tokens
            for name in names:
                assert f.get_tensor(name).dtype == torch.float8_e4m3fn and f.get_slice(name).get_shape() == [N, H]
                assert f.get_tensor(C.scale_key(name)).dtype == torch.float32
                assert f.get_slice(C.scale_key(name)).get_shape() == [N]
            fixed = sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size()
                        for k in (C.SAMPLE_OFFSETS, C.SAMPLE_INDEX))
        header = 8 + int.from_bytes(open(path, "rb").read(8), "little")
        # the documented formula: n states of H + 4 bytes, ids 4, mask 1, argmax 4
        assert rec.bytes - header - fixed == rec.tokens * C.bytes_per_token(n, H, 1, "fp8") == rec.tokens * (
            n * (H + 4) + 9)


def test_reader_dequantizes_within_the_e4m3_bound(fp8_dump, tiny_dump):
    ref_ds, ds = DumpSet(tiny_dump), DumpSet(fp8_dump)
    assert len(ds.refs) == len(ref_ds.refs)
    ref_at = by_index(ref_ds)
    for r in ds.refs:
        got, want = ds.standardized(r), ref_ds.standardized(ref_at[r.sample_index])
        assert torch.equal(got["input_ids"], want["input_ids"]) and torch.equal(got["loss_mask"], want["loss_mask"])
        H = want["final_hidden"].shape[-1]
        pairs = [(got["final_hidden"], want["final_hidden"])] + [
            (got["hidden_state"][:, c:c + H], want["hidden_state"][:, c:c + H]) for c in range(0, 3 * H, H)]
        for g, w in pairs:
            assert g.dtype == torch.float32  # the dump's --dtype: what a trainer gets from an fp32 dump too
            amax = w.double().abs().amax(-1, keepdim=True)
            assert ((g.double() - w.double()).abs() <= 2.0**-4 * amax).all()
            # the same values as the format's definition computed independently in float64 -- except where x /
            # scale lies (within float32 rounding) on a tie between two e4m3 values: there one step apart
            naive, step = naive_roundtrip(w)
            off = (g.double() - naive).abs() > 1e-6 * amax
            assert off.sum() <= max(1, off.numel() // 1000)
            assert ((g.double() - naive).abs()[off] <= 1.0001 * step[off]).all()
    # raw access: the stored tensors, and the dtype a consumer asks for
    r = ds.refs[0]
    raw = ds.sample(r, dequantize=False)
    assert raw[C.FINAL_HIDDEN].dtype == torch.float8_e4m3fn and C.scale_key(C.FINAL_HIDDEN) in raw
    assert set(ds.sample(r)) == {C.INPUT_IDS, C.LOSS_MASK, C.TARGET_ARGMAX, C.FINAL_HIDDEN,
                                 *(C.hidden_state_key(k) for k in (1, 3, 4))}
    bf = DumpSet(fp8_dump, verify=False, dtype=torch.bfloat16).standardized(r)
    assert bf["hidden_state"].dtype == torch.bfloat16
    torch.testing.assert_close(bf["hidden_state"], ds.standardized(r)["hidden_state"].bfloat16())


def test_zero_and_non_finite_rows():
    x = torch.randn(5, 64) * 3
    x[1] = 0
    x[3, 7] = float("nan")
    q, scale = quantize_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and scale.shape == (5,)
    deq = dequantize_fp8(q, scale)
    assert scale[1] == 1 and torch.equal(deq[1], torch.zeros(64))  # exact zeros, no 0/0
    assert not torch.isfinite(deq[3]).all()  # a NaN stays visible: the reader refuses the sample
    ok = [0, 2, 4]
    assert ((deq[ok] - x[ok]).abs() <= 2.0**-4 * x[ok].abs().amax(-1, keepdim=True)).all()
    # a row's maximum is stored exactly (448 * scale), and tiny rows keep their relative precision
    assert torch.equal(deq[0].abs().max(), x[0].abs().max())
    tiny = torch.full((1, 8), 1e-30)
    assert torch.allclose(dequantize_fp8(*quantize_fp8(tiny)), tiny, rtol=2.0**-4)


@pytest.mark.parametrize("workers", [0, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_left_in_the_batch_dequantizes_to_the_readers_batch(fp8_dump, workers, dtype):
    """fp8_in_batch: the loader ships q and the scales (a quarter of the bytes), Batch.dequantized does the
    reader's multiply where the batch is used; the batches must equal the reader-dequantized ones exactly,
    padding included, in the main process and through a worker's shared memory."""
    plain, late = DumpSet(fp8_dump, verify=False, dtype=dtype), DumpSet(fp8_dump, verify=False, fp8_in_batch=True)
    plan = BatchPlan([r.length for r in plain.refs], 512, seed=0, rank=0, world_size=1)
    n = len(plan.epoch(0))
    got = list(make_loader(late, late.refs, plan, num_steps=n, num_workers=workers))
    want = list(make_loader(plain, plain.refs, plan, num_steps=n, num_workers=workers))
    assert len(got) == len(want) == n and any(int(b.attention_mask.eq(0).sum()) for b in want)  # some padding
    for g, w in zip(got, want):
        assert g.hidden_state.dtype == g.final_hidden.dtype == torch.float8_e4m3fn
        d, w = g.dequantized(dtype).tensors(), w.tensors()
        assert set(d) == set(w) and all(torch.equal(d[k], w[k]) for k in w), [k for k in w if not torch.equal(d[k], w[k])]
    assert want[0].dequantized(dtype) is want[0]  # a dequantized (or bf16-stored) batch passes through


def test_table_dequantize_equals_torchs_conversion():
    """The reader's byte-pair lookup gives exactly q.float() for every byte (NaNs as NaNs), and odd widths fall
    back to torch's conversion."""
    from eagle3.dump.shards import _fp8_to_float32
    every = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    for q in (every.reshape(8, 32), every.reshape(32, 8).t().contiguous(), every[:255].reshape(15, 17)):
        got, want = _fp8_to_float32(q), q.float()
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())
    x = torch.randn(4, 8)
    x[2, 5] = float("inf")
    assert torch.isnan(dequantize_fp8(*quantize_fp8(x))[2]).all()  # an Inf row is refused on read, not rounded


def test_old_manifests_and_shards_read_as_dtype_storage(tiny_dump, tmp_path):
    import shutil
    from dump_edits import edit_json, set_shard_metadata
    d = str(tmp_path / "old")
    shutil.copytree(tiny_dump, d)
    edit_json(os.path.join(d, C.MANIFEST_FILE), lambda m: m.pop("storage"))
    meta = read_shard_metadata(os.path.join(d, shard_name(0)))
    meta.pop("storage")
    set_shard_metadata(d, 0, meta)
    ds = DumpSet(d)
    assert ds.manifest.storage == "dtype" and not ds.legacy
    torch.testing.assert_close(ds.standardized(ds.refs[0]), DumpSet(tiny_dump).standardized(ds.refs[0]))


def test_manifest_claiming_another_storage_is_refused(fp8_dump, tmp_path):
    import shutil
    from dump_edits import edit_json
    d = str(tmp_path / "edited")
    shutil.copytree(fp8_dump, d)
    edit_json(os.path.join(d, C.MANIFEST_FILE), lambda m: m.update(storage="dtype"))
    with pytest.raises(C.ContractError, match=r"format version 2 with storage 'dtype'.*malformed"):
        DumpSet(d, verify=False)
    edit_json(os.path.join(d, C.MANIFEST_FILE), lambda m: m.update(format_version=1))  # consistent, still a lie
    with pytest.raises(C.ContractError, match="scale tensors"):
        DumpSet(d, verify=False)


def test_fp8_dumps_carry_a_format_version_that_readers_before_fp8_refuse(fp8_dump, tiny_dump):
    """A reader from before fp8 storage accepted format version 1 only (and ignored the storage key): an fp8 dump
    says version 2 in its manifest and in every shard, so such a reader refuses it instead of reading fp8 bytes as
    states; dumps stored in their dtype stay version 1, readable by every eagle3."""
    import json
    from eagle3.dump.shards import read_shard_metadata
    for d, version in ((fp8_dump, 2), (tiny_dump, 1)):
        with open(os.path.join(d, C.MANIFEST_FILE)) as f:
            raw = json.load(f)
        assert raw["format_version"] == version == C.load_manifest(d).format_version
        assert {read_shard_metadata(os.path.join(d, s["file"]))["format_version"] for s in raw["shards"]} == {version}
    assert C.DUMP_FORMAT_VERSIONS == {"dtype": 1, "fp8": 2}


def test_resume_with_another_storage_is_refused(tiny_targets, convs, tmp_path):
    def dump(out, storage):
        return run_dump(DumpConfig(target=tiny_targets["llama"], data=[convs], out=str(out), dtype="fp32",
                                   num_samples=3, shard_size_mb=0.02, storage=storage, progress=False))
    for first, second in (("dtype", "fp8"), ("fp8", "dtype")):
        out = tmp_path / first
        dump(out, first)
        with pytest.raises(C.ContractError, match="--storage"):
            dump(out, second)
        (out / "dump_config.json").unlink()  # the shards' own identity still refuses it
        with pytest.raises(C.ContractError, match=f"storage: '{first}' .* != '{second}'"):
            dump(out, second)
        assert C.load_manifest(str(out)).storage == first
        assert dump(out, first).totals["samples"] == 3  # the same storage resumes


def test_bad_storage_is_refused_up_front():
    with pytest.raises(ValueError, match="--storage 'int4'"):
        DumpConfig(target="t", data=["d"], out="o", storage="int4")


def test_inspect_names_storage_bytes_and_projection(fp8_dump, tiny_dump):
    from eagle3.data.inspect import inspect_dump, render
    rep = inspect_dump(fp8_dump)
    H, n = 64, 4
    assert rep["verified"] == "sha256 ok"
    assert rep["storage"]["storage"] == "fp8" and rep["storage"]["bytes_per_token"] == n * (H + 4) + 9
    p = rep["projection"]
    tot = rep["totals"]
    assert p["mean_tokens_per_conversation"] == pytest.approx(tot["tokens"] / tot["samples"])
    assert p["bytes_per_million_conversations"]["fp8"] == pytest.approx((n * (H + 4) + 9) * 1e6 * tot["tokens"]
                                                                       / tot["samples"])
    assert p["bytes_for_this_dumps_totals"]["bf16"] == (n * 2 * H + 9) * tot["tokens"]
    text = render(rep)
    assert f"storage     fp8: states float8_e4m3fn + float32 scale per token row, read as float32; {n * (H + 4) + 9} "\
           "B/token" in text
    assert "projected   per 1M conversations of" in text
    plain = inspect_dump(tiny_dump)
    assert plain["storage"]["storage"] == "dtype" and plain["storage"]["bytes_per_token"] == n * 4 * H + 9
    # the fp8 shards hold about a quarter of the fp32 bytes
    assert rep["totals"]["bytes"] < 0.3 * plain["totals"]["bytes"]


def _train_losses(fp8_dump, target, out):
    from eagle3.train.config import TrainConfig
    from eagle3.train.trainer import train
    train(TrainConfig(dump=[fp8_dump], target=target, out=out, drafter="tiny", bf16=False,
                      max_steps=3, save_interval=3, token_budget=512, warmup_steps=1, held_out_fraction=0.0,
                      num_workers=0, progress=False, report_to="none", log_interval=1))
    with open(os.path.join(out, "run.json")) as f:
        assert json.load(f)  # the run finished and recorded itself
    metrics = sorted(os.path.join(dp, fn) for dp, _, fns in os.walk(out) for fn in fns if fn.endswith(".jsonl"))
    return [x for p in metrics for line in open(p) if line.strip() for x in [json.loads(line).get("loss")]
            if x is not None]


def test_short_training_run_on_an_fp8_dump(fp8_dump, tiny_targets, tmp_path, monkeypatch):
    """The trainer takes fp8 batches and dequantizes them where it trains (to_device); its losses must be exactly
    those of the same run fed batches the reader dequantized (a dropped or misapplied scale changes them)."""
    losses = _train_losses(fp8_dump, tiny_targets["llama"], str(tmp_path / "run"))
    assert len(losses) >= 3 and all(torch.isfinite(torch.tensor(x)) for x in losses)

    class ReaderDequantizes(DumpSet):  # the trainer's `fp8_in_batch = True` has no effect on it
        fp8_in_batch = property(lambda self: False, lambda self, value: None)
    monkeypatch.setattr("eagle3.data.dumps.DumpSet", ReaderDequantizes)
    assert _train_losses(fp8_dump, tiny_targets["llama"], str(tmp_path / "reader")) == losses
