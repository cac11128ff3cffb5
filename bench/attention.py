#!/usr/bin/env python3
"""The TTT attention block alone (kernels.causal_plus_diagonal, forward + backward) on each CUDA kernel, in one run:

  python bench/attention.py --out DIR [--tokens 4096,8192,32768] [--diag 0,6]

Shape: the Kimi-K2.5 drafter's attention (64 heads, 64 kv heads, head_dim 128, bf16, one sequence of T tokens, in
the drafter's strided [B, T, h, d] -> [B, h, T, d] layout);
`--diag j` adds the j diagonal keys of TTT step j (step 0 has none, step 6 of K = 7 has six).
  warm       median ms of forward + backward after 2 warm-ups; TFLOP/s counts the causal block only
             (4 * T^2/2 * heads * head_dim forward, 2.5x that backward), the diagonal keys' few FLOPs not counted
  new shape  the first forward + backward at each of 24 lengths never seen before (in [1024, 2048)), summed, next to
             the warm time at those lengths: what batches of new lengths cost (cuDNN builds one graph per shape, so
             kernels.py rounds its T up to a multiple of 128; torch.compile's dynamic shapes do not recompile)
Writes DIR/attention.jsonl.
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch

NH, HD = 64, 128


def fwd_bwd(T, j, gen):
    from eagle3.model import kernels
    # the drafter's layout: projections are [B, T, h, d] and attention sees them transposed (strided) to [B, h, T, d]
    leaves = []

    def r():
        x = torch.randn(1, T, NH, HD, device="cuda", dtype=torch.bfloat16, generator=gen, requires_grad=True)
        leaves.append(x)
        return x.transpose(1, 2)
    q, k0, v0 = r(), r(), r()
    dk, dv = [r() for _ in range(j)], [r() for _ in range(j)]
    g = torch.randn(1, T, NH, HD, device="cuda", dtype=torch.bfloat16, generator=gen).transpose(1, 2)

    def step():
        for x in leaves:
            x.grad = None  # a fresh gradient each call, as in training (no accumulate kernels timed)
        out = kernels.causal_plus_diagonal(q, k0, v0, dk, dv, HD ** -0.5)
        out.backward(g)
    return step


def ms_of(step, iters):
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        s.record()
        step()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    ap.add_argument("--tokens", default="4096,8192,32768")
    ap.add_argument("--diag", default="0,6")
    ap.add_argument("--kernels", default="flash,cudnn")
    ap.add_argument("--iters", type=int, default=10)
    a = ap.parse_args()
    from eagle3.model import kernels
    os.makedirs(a.out, exist_ok=True)
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
           "cmd": " ".join(sys.argv), "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    print(json.dumps(env), flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    with open(os.path.join(a.out, "attention.jsonl"), "a") as f:
        def emit(row):
            f.write(json.dumps({**env, **row}) + "\n")
            print(json.dumps(row), flush=True)

        for name in a.kernels.split(","):
            kernels.set_cuda_attention_kernel(name)
            for T in [int(x) for x in a.tokens.split(",")]:
                for j in [int(x) for x in a.diag.split(",")]:
                    step = fwd_bwd(T, j, gen)
                    step(), step()
                    ms = ms_of(step, a.iters)
                    flops = 3.5 * 4 * T * T / 2 * NH * HD
                    emit({"kernel": name, "tokens": T, "diag": j, "warm_ms": round(ms, 2),
                          "causal_tflop_s": round(flops / (ms / 1e3) / 1e12, 1)})
            # lengths as a length-grouped loader yields them: 24 distinct values in [1024, 2048), never seen before
            lengths = sorted(torch.randperm(1024, generator=torch.Generator().manual_seed(1))[:24].add(1024).tolist())
            # one length outside that range first (2049, padded to 2176 for cuDNN), so the one-time torch.compile
            # specialisation of the merge for the padded layout is not charged to the first new length
            w = fwd_bwd(2049, 6, gen)
            w(), w()
            first, warm = [], []
            for T in lengths:
                step = fwd_bwd(T, 6, gen)
                torch.cuda.synchronize()
                first.append(ms_of(step, 1))
                warm.append(ms_of(step, 3))
            emit({"kernel": name, "new_lengths": len(lengths), "new_shape_first_ms_sum": round(sum(first), 1),
                  "new_shape_warm_ms_sum": round(sum(warm), 1), "first_ms_all": [round(x, 1) for x in first],
                  "lengths": lengths})
        kernels.set_cuda_attention_kernel("auto")


if __name__ == "__main__":
    main()
