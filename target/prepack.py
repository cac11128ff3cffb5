"""Prepacked (oneDNN) Linear weights for decoding on the CPU.

Why: speculative decoding pays off only when verifying K+1 tokens costs about what one token costs. On a CPU,
`F.linear` repacks the whole weight on every call once a matmul has more than one row, so a 6-token verify forward
of the example target took 1.9x a 1-token forward (2-core EPYC, torch 2.13: 116 vs 60 ms), and no drafter could
win. Packing each weight once into oneDNN's blocked layout -- what torch.compile's CPU "freezing" does -- took
the same forwards to 67 vs 50 ms. The baseline and the speculative decoder share the packed target, so the
speedup `eagle3 eval` reports still compares like with like. One-row calls (target-only greedy, the drafter's
steps) run whichever of the plain and the packed matmul is faster on this machine, timed per weight shape: a Xeon
with AMX ran them faster plain, and target-only greedy should be the fastest it can be here. The target's one-row
path is then settled by timing its whole one-token step (`choose_one_row_path`): the per-shape timings alone
changed from process to process, and in one they picked a forward slower than all packed.

Inference only (no autograd), float32 only (bf16 packing needs CPU bf16 instructions these machines may lack),
CPU only. The module keeps its `weight` (tied embeddings, get_output_embeddings and state_dict are unchanged);
only its forward is replaced. Each packed Linear is checked against `F.linear` once, at packing time.
"""

from __future__ import annotations

import statistics
import time
import types
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from eagle3.cpu import best_seconds


def prepack_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise") \
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def _packed_forward(self, x: torch.Tensor) -> torch.Tensor:
    if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
        return F.linear(x, self.weight, self.bias)  # packed weights carry no autograd
    if x.numel() // self.in_features in self._plain_rows:
        return F.linear(x, self.weight, self.bias)  # a row count the plain matmul measured faster at (see below)
    return _packed_matmul(x, self._packed_weight, self.bias)


def _packed_matmul(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _plain_is_faster(w: torch.Tensor, packed: torch.Tensor, rows: int, reps: int = 20) -> bool:
    """Whether F.linear beats the packed matmul on `rows` rows of this weight's shape. Machine-dependent, so measured:
    a 2-core EPYC ran the example target's one-token forward faster packed (50 vs 60 ms), a 2-core Xeon with AMX
    slower (40.7 vs 34.5 ms) while packing still won its 6-token verify (50.0 vs 55.5 ms). On that Xeon (2026-12-07)
    two rows ran plain at the cost of one (576x576: 9 vs 37 us packed; the 49152x576 head 3.4 vs 3.6 ms) while four
    and six ran faster packed on the large weights only (the head: 6.9 vs 3.7 ms at four): a 2-token verify of a
    chain of 1 cost 1.46x a 1-token forward with every multi-row call packed. Both paths are fp32 GEMMs of the same
    weight. Best of `reps` calls each."""
    x = torch.randn(rows, w.shape[1])
    with torch.no_grad():
        return best_seconds(lambda: F.linear(x, w), reps) < best_seconds(lambda: _packed_matmul(x, packed, None), reps)


def prepack_linears(model: nn.Module, rows_hint: int = 8, check: bool = True, single_row: str = "auto") -> int:
    """Replace the forward of every float32 CPU nn.Linear in `model` with a oneDNN prepacked matmul.
    rows_hint: the matmul rows to pack for (decoding: K+1). single_row: "auto" runs each call of 1..rows_hint rows on
    the faster of the plain and the packed matmul on this machine (timed once per weight shape and row count);
    "plain" runs one-row calls plain and packs the rest, "packed" packs every call.
    Returns how many were packed; 0 where the backend is missing (the model is then left exactly as it was)."""
    if single_row not in ("auto", "packed", "plain"):
        raise ValueError(f"single_row={single_row!r}: choose auto, packed or plain")
    if not prepack_available():
        return 0
    todo = [m for m in model.modules() if isinstance(m, nn.Linear) and m.weight.device.type == "cpu"
            and m.weight.dtype == torch.float32 and not hasattr(m, "_packed_weight")]
    gen = torch.Generator().manual_seed(0)
    plain_rows: dict[tuple[int, int], frozenset[int]] = {}  # by weight shape: timed once per shape
    for m in todo:
        w = m.weight.detach()
        m._packed_weight = torch.ops.mkldnn._reorder_linear_weight(w, rows_hint)
        if tuple(w.shape) not in plain_rows:
            # "auto": every row count up to rows_hint (a verify forward's K + 1) runs the faster path on this machine
            # (one row: target-only greedy and the drafter's steps; more: verify and the drafter's re-read);
            # "plain" / "packed" fix the one-row path and pack every multi-row call, as before "auto" timed them
            measured = {r for r in range(1, max(1, rows_hint) + 1) if _plain_is_faster(w, m._packed_weight, r)} \
                if single_row == "auto" else ({1} if single_row == "plain" else set())
            plain_rows[tuple(w.shape)] = frozenset(measured)
        m._plain_rows = plain_rows[tuple(w.shape)]
        m._plain_single_row = 1 in m._plain_rows
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


def choose_one_row_path(model: nn.Module, one_row_step: Callable[[], object], repeats: int = 15) -> dict:
    """Settle the one-row path of every packed Linear in `model` by timing the model's own one-row step
    (`one_row_step`: e.g. the target's one-token forward with its cache, what target-only greedy decoding repeats):
    the per-shape choices of `prepack_linears(single_row="auto")`, every one-row call plain, and every one packed,
    interleaved (each repeat runs each once), each the median of `repeats`; the fastest is kept. Returns {"chosen",
    "median_s": {name: seconds}, "one_row_plain": how many Linears then run one-row calls plain}.
    Why: the per-shape timings, each weight alone in a hot loop, did not add up to the fastest forward. On a 2-core
    EPYC (2026-12-08) they marked 210 of the example target's 211 Linears plain, whose one-token step then ran at a
    median 87.7 and 101.4 ms in two processes against 85.7 and 97.7 ms all packed; and from one process to the next
    they marked 150 to 210 of the 211 plain (126 to 219 of the target's and the drafter's 220 in three `eagle3 eval`
    processes minutes apart, whose greedy baselines ran at 10.0 to 12.4 tok/s): a speedup measured against a slow
    baseline is flattered by it."""
    mods = [m for m in model.modules() if hasattr(m, "_plain_rows")]
    if not mods:
        return {"chosen": None, "median_s": {}, "one_row_plain": 0}
    per_shape = {id(m): m._plain_rows for m in mods}
    paths = {"per_shape": lambda m: per_shape[id(m)], "plain": lambda m: per_shape[id(m)] | {1},
             "packed": lambda m: per_shape[id(m)] - {1}}

    def use(name: str) -> None:
        for m in mods:
            m._plain_rows = frozenset(paths[name](m))
            m._plain_single_row = 1 in m._plain_rows
    times: dict[str, list[float]] = {name: [] for name in paths}
    with torch.no_grad():
        for name in paths:  # warm-up: oneDNN picks its kernels on a path's first calls
            use(name)
            one_row_step()
        for _ in range(max(1, repeats)):
            for name in paths:
                use(name)
                t0 = time.perf_counter()
                one_row_step()
                times[name].append(time.perf_counter() - t0)
    median = {name: statistics.median(v) for name, v in times.items()}
    chosen = min(median, key=median.get)
    use(chosen)
    return {"chosen": chosen, "median_s": median, "one_row_plain": sum(m._plain_single_row for m in mods)}
