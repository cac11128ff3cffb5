"""fp8 storage (issue 15 part 3): its error against a dump stored in bf16/fp32, and the reader's throughput for both.

    python bench/fp8_storage.py --dump DIR --out /tmp/fp8bench [--workers 0] [--token-budget 8192] [--repeats 3]

Re-encodes DIR's shards as an fp8 dump under --out (e4m3 states + one float32 scale per token row, exactly what
`eagle3 dump --storage fp8` writes; reused when already there), then reports as JSON:

- per captured state (hidden_states.<k> and final_hidden), over every token of the dump: max and mean of
  |x - deq(q(x))| / row amax, and the relative Frobenius error ||x - deq(q(x))|| / ||x||. x is the stored state:
  for an fp32 dump the captured values, for a bf16 dump their bf16 round (a real fp8 dump quantizes before it).
- reader throughput, tokens/s, of both dumps: read + dequantize + collate of training batches (`make_loader`,
  length-grouped under --token-budget), median of --repeats passes after a warm-up pass (page cache warm).
DIR is only read.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time

import torch
from safetensors import safe_open

from eagle3 import contract as C
from eagle3.atomic import atomic_write_text
from eagle3.dump import shards as S


def state_names(m: C.DumpManifest) -> list[str]:
    return [*m.capture.keys(), C.FINAL_HIDDEN]


def reencode_fp8(src: str, out: str) -> str:
    """DIR's dump as an fp8 dump in `out` (manifest, shards with their identity and sidecars); returns out."""
    if os.path.isfile(os.path.join(out, C.MANIFEST_FILE)):
        return out
    os.makedirs(out, exist_ok=True)
    m = dataclasses.replace(C.load_manifest(src), storage=C.STORAGE_FP8)  # format version 2 with it
    records = []
    for j, rec in enumerate(m.shards):
        with safe_open(os.path.join(src, rec.file), "pt") as f:
            t = {k: f.get_tensor(k) for k in f.keys()}
        meta = dict(S.read_shard_metadata(os.path.join(src, rec.file)), **{C.STORAGE: C.STORAGE_FP8,
                                                                       "format_version": m.format_version})
        off = t[C.SAMPLE_OFFSETS].tolist()
        samples = []
        for n, si in enumerate(t[C.SAMPLE_INDEX].tolist()):
            a, b = off[n], off[n + 1]
            s = {"sample_index": si, "input_ids": t[C.INPUT_IDS][a:b], "loss_mask": t[C.LOSS_MASK][a:b]}
            if C.TARGET_ARGMAX in t:
                s["target_argmax"] = t[C.TARGET_ARGMAX][a:b]
            for name in state_names(m):
                s[name], s[C.scale_key(name)] = S.quantize_fp8(t[name][a:b])
            samples.append(s)
        meta.pop(C.SHARD_INDEX, None)
        records.append(S.write_shard(out, j, samples, m.capture.hidden_state_indices, meta))
    m.shards = records
    atomic_write_text(os.path.join(out, C.MANIFEST_FILE), json.dumps(m.to_dict(), indent=1))
    return out


def errors(src: str, fp8: str) -> dict:
    """Per state: the error of the fp8 dump's values (as the reader returns them) against the source dump's."""
    from eagle3.data.dumps import DumpSet
    a, b = DumpSet(src, verify=False), DumpSet(fp8, verify=False, dtype=torch.float32)
    acc = {n: {"max": 0.0, "sum": 0.0, "count": 0, "err2": 0.0, "ref2": 0.0} for n in state_names(a.manifest)}
    for ra, rb in zip(a.refs, b.refs):
        assert ra.sample_index == rb.sample_index
        xa, xb = a.sample(ra, list(acc)), b.sample(rb, list(acc))
        for n, s in acc.items():
            x, d = xa[n].double(), xb[n].double()
            err = (x - d).abs()
            rel = err / x.abs().amax(-1, keepdim=True).clamp(min=torch.finfo(torch.float64).tiny)
            s["max"] = max(s["max"], float(rel.max()))
            s["sum"] += float(rel.sum())
            s["count"] += rel.numel()
            s["err2"] += float((err**2).sum())
            s["ref2"] += float((x**2).sum())
    return {n: {"max_abs_err_over_row_amax": s["max"], "mean_abs_err_over_row_amax": s["sum"] / s["count"],
                "rel_frobenius": (s["err2"] / s["ref2"]) ** 0.5} for n, s in acc.items()}


def throughput(path: str, workers: int, token_budget: int, repeats: int, device: str = "cpu", pin: bool = True) -> dict:
    """tokens/s of training batches (read + dequantize + collate), median of `repeats` passes over the whole dump
    after one warm-up pass. device cuda: what the trainer does there, batches pinned, moved to the GPU and fp8
    states dequantized there (DumpSet fp8_in_batch + Batch.to), synchronized before the clock stops."""
    from eagle3.data.dumps import DumpSet
    from eagle3.data.loader import BatchPlan, make_loader
    on_gpu = device != "cpu"
    ds = DumpSet(path, verify=False, fp8_in_batch=on_gpu)
    plan = BatchPlan([r.length for r in ds.refs], token_budget, seed=0, rank=0, world_size=1)
    steps = len(plan.epoch(0))
    runs = []
    for rep in range(repeats + 1):
        t0, tokens, nbytes = time.perf_counter(), 0, 0
        for b in make_loader(ds, ds.refs, plan, start_step=0, num_steps=steps, num_workers=workers,
                             pin_memory=on_gpu and pin):
            if on_gpu:
                b = b.to(device, torch.bfloat16)
            tokens += int(b.attention_mask.sum())
            nbytes += b.hidden_state.numel() * b.hidden_state.element_size()
        if on_gpu:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        if rep:  # the first pass warms the page cache
            runs.append({"tokens_s": tokens / dt, "batch_GB_s": nbytes / dt / 1e9, "seconds": dt})
    m = ds.manifest
    return {"dump": path, "storage": m.storage, "device": device, "pin_memory": on_gpu and pin, "read_as": str(b.hidden_state.dtype).removeprefix("torch."),
            "shard_bytes": m.totals["bytes"], "bytes_per_token": m.totals["bytes"] / m.totals["tokens"],
            "batches_per_pass": steps, "median_tokens_s": statistics.median(r["tokens_s"] for r in runs),
            "runs": runs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dump", required=True, help="a dump stored in bf16 or fp32 (only read)")
    ap.add_argument("--out", required=True, help="where the fp8 re-encoding goes (reused when present)")
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--token-budget", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu", help="cuda: batches end on the GPU, fp8 dequantized there")
    ap.add_argument("--no-pin", action="store_true", help="with --device cuda: no pinned copy (the trainer pins)")
    a = ap.parse_args()
    if os.path.realpath(a.out).startswith(os.path.realpath(a.dump) + os.sep):
        raise SystemExit("--out must not be inside --dump (the source dump is only read)")
    src = C.load_manifest(a.dump)
    if src.storage != C.STORAGE_DTYPE:
        raise SystemExit(f"{a.dump}: storage {src.storage!r}; give a dump stored in its dtype (bf16 or fp32)")
    t0 = time.perf_counter()
    fp8 = reencode_fp8(a.dump, a.out)
    encode_s = time.perf_counter() - t0
    report = {"source": {"dump": a.dump, "dtype": src.dtype, "hidden_size": src.target.hidden_size,
                         "indices": src.capture.hidden_state_indices, "samples": src.totals["samples"],
                         "tokens": src.totals["tokens"]},
              "fp8_dump": fp8, "reencode_s": encode_s, "errors": errors(a.dump, fp8),
              "reader": {"source": throughput(a.dump, a.workers, a.token_budget, a.repeats, a.device, not a.no_pin),
                         "fp8": throughput(fp8, a.workers, a.token_budget, a.repeats, a.device, not a.no_pin)},
              "workers": a.workers, "token_budget": a.token_budget, "host": platform.node(), "cpus": os.cpu_count(),
              "torch": torch.__version__, "command": " ".join(sys.argv)}
    r = report["reader"]
    r["fp8_over_source"] = r["fp8"]["median_tokens_s"] / r["source"]["median_tokens_s"]
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
