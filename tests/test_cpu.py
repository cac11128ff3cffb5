"""core/cpu.py: the bf16-or-fp32 choice the quickstart's CPU training follows."""

import math

import pytest
import torch


def test_the_probe_times_both_dtypes_and_decides_by_the_ratio(monkeypatch):
    from eagle3 import cpu
    seen = []

    def fake(dtype, rows, k, n, reps):
        seen.append(dtype)
        return {torch.float32: 3.0, torch.bfloat16: times[0]}[dtype]

    monkeypatch.setattr(cpu, "_gemm_seconds", fake)
    for bf16_s, want in [(1.0, True), (1.5, True), (1.6, False), (12.0, False)]:
        times = [bf16_s]
        cpu.bf16_gemm_speedup.cache_clear()
        assert cpu.bf16_gemm_speedup() == pytest.approx(3.0 / bf16_s)
        assert cpu.cpu_prefers_bf16() is want, bf16_s
    assert set(seen) == {torch.float32, torch.bfloat16}
    cpu.bf16_gemm_speedup.cache_clear()


def test_the_probe_measures_this_machine():
    from eagle3 import cpu
    cpu.bf16_gemm_speedup.cache_clear()
    s = cpu.bf16_gemm_speedup(rows=64, k=64, n=64, reps=2)
    assert math.isfinite(s) and s > 0
    # a GEMM 64x larger in work takes longer in fp32: the timer measures the matmul, not a constant
    assert cpu._gemm_seconds(torch.float32, 512, 512, 1024, 3) > cpu._gemm_seconds(torch.float32, 64, 64, 128, 3)
    cpu.bf16_gemm_speedup.cache_clear()
