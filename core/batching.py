"""Length-grouped batching under a padded-token budget, shared by the dump (target forwards) and the trainer."""

from __future__ import annotations


def group_by_length(items: list[int], lengths, token_budget: int) -> list[list[int]]:
    """Longest first; each batch's padded size (batch size x its longest length) stays within token_budget
    (a single longer item gets a batch of its own). Ties keep the given order."""
    order = sorted(items, key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        if cur and (len(cur) + 1) * lengths[cur[0]] > token_budget:
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    return batches
