#!/usr/bin/env python3
"""Where the time of one training step goes: torch.profiler over one step of each variant at the Kimi-K2.5 shape
(bench/train_step.py's set-up), the top CUDA kernels by total time.  python bench/profile_step.py [--tokens 4096]"""
import argparse
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_step import batch, build, make_step  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--variants", default="fast,eager")
    ap.add_argument("--rows", type=int, default=30)
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    a = ap.parse_args()
    drafter, head = build()
    draft_head = head[drafter.t2d].clone()
    b = batch(a.tokens, head)
    for v in a.variants.split(","):
        step = make_step(v, 7, drafter, head, draft_head, b)
        step(); step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        ev = [e for e in prof.key_averages() if getattr(e, "device_type", None) is None or "CUDA" in str(e.device_type)]
        tot = lambda e: getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)  # noqa: E731
        ev = sorted(ev, key=tot, reverse=True)
        total = sum(tot(e) for e in ev)
        table = f"total kernel time {total / 1e3:.1f} ms\n" + "\n".join(
            f"{tot(e) / 1e3:9.2f} ms {e.count:6d}x  {e.key[:90]}" for e in ev[:a.rows])
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, f"profile_{v}_{a.tokens}.txt"), "w") as f:
            f.write(table)
        print(f"==== {v} T={a.tokens}\n{table}", flush=True)


if __name__ == "__main__":
    main()
