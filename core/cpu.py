"""Which dtype this CPU multiplies fastest, measured rather than guessed from its flags.

Why: the same 2-core machine type has come as an AMD EPYC without bf16 instructions (bf16 GEMMs at a quarter of
fp32's rate) and as an Intel Xeon with AMX tiles (bf16 GEMMs 6-12x fp32's rate; bench/quality.md, rows L).
The quickstart's CPU training dtype and data sizes follow whichever this machine is. A flag
check (`torch.cpu._is_amx_tile_supported`, private) says what the chip has, not what oneDNN makes of it through a
hypervisor, so this times the drafter's own GEMM shape in both dtypes: ~50 ms, once per process.
"""

from __future__ import annotations

import functools
import time

import torch


def best_seconds(f, reps: int) -> float:
    """The fastest of `reps` timed calls of f(), after one untimed call (oneDNN's kernel choice and any JIT)."""
    f()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t)
    return best


def _gemm_seconds(dtype: torch.dtype, rows: int, k: int, n: int, reps: int) -> float:
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(rows, k, generator=gen).to(dtype)
    w = torch.randn(n, k, generator=gen).to(dtype)
    return best_seconds(lambda: torch.nn.functional.linear(a, w), reps)


@functools.lru_cache(maxsize=None)
def bf16_gemm_speedup(rows: int = 512, k: int = 576, n: int = 1536, reps: int = 5) -> float:
    """fp32 time / bf16 time of one [rows, k] x [k, n] GEMM on this CPU (best of `reps`)."""
    with torch.no_grad():
        return _gemm_seconds(torch.float32, rows, k, n, reps) / _gemm_seconds(torch.bfloat16, rows, k, n, reps)


# bf16 pays only where its GEMMs are clearly faster: below this, fp32's exactness wins (AMX measured 7x at this
# shape, an EPYC without bf16 instructions 0.3x)
BF16_MIN_SPEEDUP = 2.0


def cpu_prefers_bf16() -> bool:
    return bf16_gemm_speedup() >= BF16_MIN_SPEEDUP
