"""The draft vocabulary's map (docs/contract.md §5): draft id i stands for target id i + d2t[i], and t2d marks the
target ids that have a draft id, ascending. Below every stage: the vocab file (data/vocab.py), the drafter, the
exporter and the eval all read or check maps by this one rule.
"""

from __future__ import annotations

import torch


def vocab_map(ids: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = ids.to(torch.int64)
    d2t = ids - torch.arange(ids.numel(), dtype=torch.int64)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return d2t, t2d


def draft_ids(d2t: torch.Tensor) -> torch.Tensor:
    return d2t + torch.arange(d2t.numel(), dtype=torch.int64)


def vocab_map_problem(d2t: torch.Tensor, t2d: torch.Tensor) -> str | None:
    """Why d2t/t2d are not one draft vocabulary (None if they are): draft id i must map to the i-th target id
    marked in t2d (target_id = draft_id + d2t[draft_id], ascending), which is what vocab_map builds. The vocab file,
    the drafter and the exporter all check with this (docs/contract.md §5)."""
    if d2t.dtype != torch.int64 or t2d.dtype != torch.bool or d2t.dim() != 1 or t2d.dim() != 1:
        return f"d2t/t2d must be 1-d int64/bool, got {d2t.dtype} {tuple(d2t.shape)}, {t2d.dtype} {tuple(t2d.shape)}"
    if not torch.equal(draft_ids(d2t), t2d.nonzero().squeeze(-1)):
        return (f"d2t and t2d disagree: draft id i must map to the i-th target id marked in t2d "
                f"({int(t2d.sum())} marked, {d2t.numel()} draft ids)")
    return None
