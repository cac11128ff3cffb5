"""Where the eval's target-only greedy step spends its time (`eagle3 eval` baseline: one-token forwards with a
DynamicCache, as eval/speculative.py runs them).

On the H200 the eval's baseline ran ~35 ms a token for a 135M-parameter target (bench/quality.md, run I): far more
than its arithmetic. This times one-token steps (synchronized, so each number is a whole step) and prints the
profiler's top operators by self CPU time, so the overhead can be named before anything is changed.

    python bench/decode_overhead.py [--target DIR] [--dtype fp32] [--steps 64] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default=None, help="target dir (default: the example target)")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    from transformers import DynamicCache
    from eagle3.dump.example import example_target_dir
    from eagle3.target.load import DTYPES, load_target
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    target_dir = a.target or example_target_dir()
    model = load_target(target_dir, DTYPES[a.dtype], dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def decode(n: int) -> list[float]:
        cache = DynamicCache(config=model.config)
        ids = torch.arange(100, 164, device=dev)[None]
        times = []
        with torch.no_grad():
            for _ in range(n):
                sync()
                t0 = time.perf_counter()
                logits = model(input_ids=ids, cache=cache, use_cache=True).logits
                tok = int(logits[0, -1].argmax())
                times.append(time.perf_counter() - t0)
                ids = torch.tensor([[tok]], device=dev)
        return times[1:]  # the first is the 64-token prefill

    decode(8)  # warm-up
    step = decode(a.steps)
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        decode(16)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    print(table)
    rep = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "dtype": a.dtype,
           "torch": torch.__version__, "one_token_step_ms_median": 1e3 * statistics.median(step),
           "one_token_step_ms_min": 1e3 * min(step), "steps": len(step)}
    print(json.dumps(rep, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rep | {"profile_top_self_cpu": table}, f, indent=1)


if __name__ == "__main__":
    main()
