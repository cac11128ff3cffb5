"""Reader throughput: samples/s, tokens/s and GB/s of standardized batches from a dump on local disk.

    python bench/read_dump.py --dump DIR [--workers 4] [--token-budget 16384] [--steps 200]
    python bench/read_dump.py --synthetic /tmp/synth --hidden 7168 --tokens 200000   # writes a random dump first

The synthetic dump has the real format (shards + manifest + checksums) with random bf16 states, so the
reader does exactly the work it does on a real dump. Reports the median of --repeats passes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch


def write_synthetic(out: str, hidden: int, tokens: int, indices=(3, 31, 59), layers=61, mean_len=1024,
                    shard_mb=1024.0, seed=0) -> None:
    from eagle3 import contract as C
    from eagle3.atomic import atomic_write_text
    from eagle3.dump.shards import write_shard
    if os.path.isfile(os.path.join(out, C.MANIFEST_FILE)):
        return
    os.makedirs(out, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    m = C.DumpManifest(target=C.TargetInfo("synthetic", "Synthetic", layers, hidden, 163840, "synthetic"),
                       capture=C.CaptureSpec(list(indices)), tokenizer=C.TokenizerInfo("synthetic", "synthetic"),
                       dtype="bfloat16", max_length=None, tp_size=1, dp_size=1, shards=[],
                       data_fingerprint=C.data_fingerprint([("synthetic", "0" * 64, 0)]))
    meta = C.shard_identity(m, plan_sha256="synthetic")  # what the reader checks every shard against
    bpt = (len(indices) + 1) * hidden * 2 + 5
    records, shard, shard_tokens, j, si, done = [], [], 0, 0, 0, 0
    while done < tokens:
        n = int(torch.randint(mean_len // 4, mean_len * 7 // 4, (1,), generator=g))
        n = min(n, tokens - done)
        s = {"sample_index": si, "input_ids": torch.randint(0, 32000, (n,), generator=g).tolist(),
             "loss_mask": (torch.rand(n, generator=g) < 0.6).int().tolist(),
             C.FINAL_HIDDEN: torch.randn(n, hidden, generator=g).bfloat16()}
        for k in indices:
            s[C.hidden_state_key(k)] = torch.randn(n, hidden, generator=g).bfloat16()
        shard.append(s)
        shard_tokens += n
        done += n
        si += 1
        if shard_tokens * bpt >= shard_mb * 2**20 or done >= tokens:
            records.append(write_shard(out, j, shard, list(indices), meta))
            shard, shard_tokens, j = [], 0, j + 1
    m.shards = records
    atomic_write_text(os.path.join(out, C.MANIFEST_FILE), json.dumps(m.to_dict(), indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dump")
    ap.add_argument("--synthetic", help="write a random dump here first (reused if present)")
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--tokens", type=int, default=200_000)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--token-budget", type=int, default=16384)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    from eagle3.data.dumps import DumpSet
    from eagle3.data.loader import BatchPlan, make_loader

    path = a.dump
    if a.synthetic:
        write_synthetic(a.synthetic, a.hidden, a.tokens)
        path = a.synthetic
    t0 = time.perf_counter()
    ds = DumpSet(path, verify=True)
    verify_s = time.perf_counter() - t0
    refs = ds.refs
    plan = BatchPlan([r.length for r in refs], a.token_budget, seed=0, rank=0, world_size=1)
    runs = []
    for rep in range(a.repeats):
        os.system("sync")
        t0, n_samples, n_tokens, n_bytes = time.perf_counter(), 0, 0, 0
        for b in make_loader(ds, refs, plan, start_step=rep * a.steps, num_steps=a.steps, num_workers=a.workers):
            n_samples += b["input_ids"].shape[0]
            n_tokens += int(b["attention_mask"].sum())
            n_bytes += sum(v.numel() * v.element_size() for v in b.values())
        dt = time.perf_counter() - t0
        runs.append({"samples_s": n_samples / dt, "tokens_s": n_tokens / dt, "GB_s": n_bytes / dt / 1e9})
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    print(json.dumps({"dump": path, "hidden": ds.manifest.target.hidden_size, "tokens": ds.manifest.totals["tokens"],
                      "workers": a.workers, "token_budget": a.token_budget, "steps": a.steps, "verify_s": verify_s,
                      "median": med, "runs": runs, "host": platform.node(), "cpus": os.cpu_count(),
                      "command": " ".join(sys.argv)}, indent=1))


if __name__ == "__main__":
    main()
