#!/usr/bin/env python3
"""The MLA drafter's causal attention block (q/k width 192, v width 128, 64 heads, bf16) on each fused CUDA kernel
PyTorch offers, forward + backward, against a float64 reference of the same block:

  python bench/mla_attention.py --out DIR [--tokens 4096,32768]

  fa2_padded     FlashAttention-2 (one head width): v zero-padded to 192, what kernels.causal_plus_diagonal runs
  cudnn_padded   cuDNN's fused attention on the padded v
  cudnn_native   cuDNN's fused attention with v at its own width (q/k 192, v 128), if it takes it
  sdpa           F.scaled_dot_product_attention as PyTorch dispatches it (the reference speed of the plain path)
Each row: median ms (5 runs after 2 warm-ups), the max relative error of out / dq / dk / dv against float64 on a
512-token slice (checked at T = 512), or the error the kernel raised. Writes DIR/mla_attention.jsonl.
"""
import argparse
import json
import os
import statistics

import torch
import torch.nn.functional as F

NH, DQK, DV = 64, 192, 128


def kernels():
    def fa2_padded(q, k, v, s):
        o = torch.ops.aten._scaled_dot_product_flash_attention(q, k, F.pad(v, (0, DQK - DV)), 0.0, True, False,
                                                               scale=s)[0]
        return o[..., :DV]

    def cudnn(q, k, v, s):
        return torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, False, 0.0, True, False, scale=s)[0]

    def cudnn_padded(q, k, v, s):
        return cudnn(q, k, F.pad(v, (0, DQK - DV)), s)[..., :DV]

    def sdpa(q, k, v, s):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=s)
    return {"fa2_padded": fa2_padded, "cudnn_padded": cudnn_padded, "cudnn_native": cudnn, "sdpa": sdpa}


def inputs(T, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda d: torch.randn(1, T, NH, d, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
    return [mk(DQK), mk(DQK), mk(DV)], mk(DV)


def run(fn, leaves, gout, s):
    xs = [x.detach().requires_grad_(True) for x in leaves]
    out = fn(*(x.transpose(1, 2) for x in xs), s)
    out.backward(gout.transpose(1, 2))
    return out, [x.grad for x in xs]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    ap.add_argument("--tokens", default="4096,32768")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    s = DQK ** -0.5 * 2.0
    leaves, gout = inputs(512)
    ref_out, ref_g = run(lambda q, k, v, s: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=s),
                         [x.double().cpu() for x in leaves], gout.double().cpu(), s)
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    for name, fn in kernels().items():
        row = {**env, "kernel": name}
        try:
            out, g = run(fn, leaves, gout, s)
            rel = lambda a, b: float((a.double().cpu() - b).norm() / b.norm())  # noqa: E731
            row["rel_err"] = {"out": rel(out, ref_out), **{f"d{n}": rel(x, r) for n, x, r in zip("qkv", g, ref_g)}}
            for T in map(int, a.tokens.split(",")):
                lv, go = inputs(T, 1)
                for _ in range(2):
                    run(fn, lv, go, s)
                times = []
                for _ in range(5):
                    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    e0.record()
                    run(fn, lv, go, s)
                    e1.record()
                    torch.cuda.synchronize()
                    times.append(e0.elapsed_time(e1))
                row[f"ms_{T}"] = round(statistics.median(times), 2)
        except Exception as e:  # a kernel that refuses this shape: recorded, the others still measured
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        print(json.dumps(row), flush=True)
        with open(os.path.join(a.out, "mla_attention.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
