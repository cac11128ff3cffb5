"""Prepacked (oneDNN) Linear weights for decoding on the CPU.

Why: speculative decoding pays off only when verifying K+1 tokens costs about what one token costs. On a CPU,
`F.linear` repacks the whole weight on every call once a matmul has more than one row, so a 6-token verify forward
of the example target took 1.9x a 1-token forward (2-core EPYC, torch 2.13: 116 vs 60 ms), and no drafter could
win. Packing each weight once into oneDNN's blocked layout -- what torch.compile's CPU "freezing" does -- took
the same forwards to 67 vs 50 ms. The baseline and the speculative decoder share the packed target, so the
speedup `eagle3 eval` reports still compares like with like.

Inference only (no autograd), float32 only (bf16 packing needs CPU bf16 instructions these machines may lack),
CPU only. The module keeps its `weight` (tied embeddings, get_output_embeddings and state_dict are unchanged);
only its forward is replaced. Each packed Linear is checked against `F.linear` once, at packing time.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn


def prepack_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise") \
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def _packed_forward(self, x: torch.Tensor) -> torch.Tensor:
    if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
        return F.linear(x, self.weight, self.bias)  # packed weights carry no autograd
    return torch.ops.mkldnn._linear_pointwise(x, self._packed_weight, self.bias, "none", [], "")


def prepack_linears(model: nn.Module, rows_hint: int = 8, check: bool = True) -> int:
    """Replace the forward of every float32 CPU nn.Linear in `model` with a oneDNN prepacked matmul.
    rows_hint: the matmul rows to pack for (decoding: K+1). Returns how many were packed; 0 where the backend
    is missing (the model is then left exactly as it was)."""
    if not prepack_available():
        return 0
    todo = [m for m in model.modules() if isinstance(m, nn.Linear) and m.weight.device.type == "cpu"
            and m.weight.dtype == torch.float32 and not hasattr(m, "_packed_weight")]
    gen = torch.Generator().manual_seed(0)
    for m in todo:
        w = m.weight.detach()
        m._packed_weight = torch.ops.mkldnn._reorder_linear_weight(w, rows_hint)
        m.forward = types.MethodType(_packed_forward, m)
        if check:
            x = torch.randn(3, m.in_features, generator=gen)
            with torch.no_grad():
                got, want = m(x), F.linear(x, w, m.bias)
            tol = 1e-4 * (1 + want.abs().max().item())
            if not torch.allclose(got, want, rtol=1e-4, atol=tol):
                raise RuntimeError(f"oneDNN prepacked linear disagrees with F.linear on a {tuple(w.shape)} weight "
                                   f"(max |diff| {(got - want).abs().max().item():.3g}); run with --no-prepack")
    return len(todo)
