"""Sequence parallelism for one long sample: its positions split into contiguous chunks over a group of ranks.

Why it works for the EAGLE-3 training step (docs/contract.md §9): everything in the TTT unroll is position-wise
except two things.
- Attention. Step j's query at position t sees the step-0 keys at positions <= t and the step-1..j keys at t
  itself. The diagonal keys are local; the step-0 keys of earlier chunks are all-gathered once per step
  (`prefix_kv`), and each query merges their softmax mass with its own chunk's (model/drafter.py
  attention_causal_plus_diagonal, `prefix`). Backward sums, over the ranks, the gradient every rank's queries put
  on a chunk's keys (`_GatherChunks`).
- Look-ahead. Step j at t reads token t+1+j and is taught at u = t+1+j about p = t+2+j, so a chunk's window carries
  the next K+1 positions of the sequence too (`halo`); pairs whose t falls there belong to the next chunk and are
  left out of this rank's loss (eagle3_loss `queries`).
The loss is each rank's sum over its own pairs divided by the whole sequence's count per step, so the ranks' losses
add up to the unsplit loss, and so do their gradients. Under --loss lk-hybrid each step's KL weight is a function of
the whole sequence's mean acceptance, so the ranks' alpha sums are pooled the same way as their counts
(eagle3_loss `reduce_alpha`), and the pieces of one process first measure them over the whole row.
The same split taken by one process, piece after piece: train/pieces.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from eagle3.train.acceptance import draft_hits
from eagle3.train.loss import KL, eagle3_loss, eagle3_loss_fused, full_vocab_argmax


@dataclass(frozen=True)
class Chunk:
    """This rank's positions [start, end) of a sequence of `length`, and its window [start, window_end): the chunk
    plus the halo that its pairs read."""
    start: int
    end: int
    window_end: int
    length: int


def halo(ttt_steps: int) -> int:
    """Positions past a chunk that its pairs read: tokens up to t+K (step K-1 reads t+1+j), labels up to t+K+1."""
    return ttt_steps + 1


def chunk_of(length: int, size: int, rank: int, ttt_steps: int) -> Chunk:
    """Rank `rank` of `size`: contiguous, as equal as possible (the first length % size chunks one longer)."""
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} of a sequence-parallel group of {size}")
    if length < size:
        raise ValueError(f"a sequence of {length} tokens cannot be split over {size} ranks")
    base, extra = divmod(length, size)
    start = rank * base + min(rank, extra)
    end = start + base + (rank < extra)
    return Chunk(start, end, min(end + halo(ttt_steps), length), length)


class _GatherChunks(torch.autograd.Function):
    """All ranks' [B, h, n_r, d] chunks (lengths may differ) -> the list of them, on every rank. Backward: every
    rank's gradient for every chunk is summed (all-reduce, which gloo has too) and each rank keeps its own."""

    @staticmethod
    def forward(ctx, x, lengths: tuple[int, ...], group):
        ctx.group, ctx.lengths, ctx.rank = group, lengths, dist.get_rank(group)
        n = max(lengths)
        padded = torch.nn.functional.pad(x, (0, 0, 0, n - x.shape[2])).contiguous()
        out = [torch.empty_like(padded) for _ in lengths]
        dist.all_gather(out, padded, group=group)
        return tuple(o[:, :, :m] for o, m in zip(out, lengths))

    @staticmethod
    def backward(ctx, *grads):
        n = max(ctx.lengths)
        g = torch.stack([torch.nn.functional.pad(gr, (0, 0, 0, n - gr.shape[2])) for gr in grads])
        dist.all_reduce(g, group=ctx.group)
        return g[ctx.rank][:, :, :ctx.lengths[ctx.rank]], None, None


def prefix_kv(chunk: Chunk, size: int, group=None):
    """The drafter's `prefix_kv` hook for this rank: (k0, v0) of its window -> (k0, v0, (k_prefix, v_prefix)), the
    prefix being the step-0 keys and values of every earlier chunk. One collective per forward, whose output every
    rank also uses for its own chunk's keys (the same values): so every rank's backward meets it exactly once and
    the all-reduces pair up, rank 0 (no prefix) included. The halo's keys stay local (only halo queries see them)."""
    lengths = tuple(c.end - c.start for c in (chunk_of(chunk.length, size, r, 0) for r in range(size)))
    rank, own = dist.get_rank(group), chunk.end - chunk.start

    def gather(k0: torch.Tensor, v0: torch.Tensor):
        d = k0.shape[-1]
        kv = _GatherChunks.apply(torch.cat([k0[:, :, :own], v0[:, :, :own]], dim=-1), lengths, group)
        mine = kv[rank]
        k0 = torch.cat([mine[..., :d], k0[:, :, own:]], dim=2)
        v0 = torch.cat([mine[..., d:], v0[:, :, own:]], dim=2)
        before = torch.cat(kv[:rank], dim=2) if rank else mine[:, :, :0]
        return k0, v0, (before[..., :d], before[..., d:])
    return gather


def sum_over_group(group=None):
    """eagle3_loss `reduce_counts`: per-step pair counts summed over the sequence-parallel group (no gradient)."""
    def reduce(count: torch.Tensor) -> torch.Tensor:
        count = count.detach().clone()
        dist.all_reduce(count, group=group)
        return count
    return reduce


def window(x: torch.Tensor | None, chunk: Chunk) -> torch.Tensor | None:
    """[B, T, ...] -> this rank's window [B, window_end - start, ...]."""
    return None if x is None else x[:, chunk.start:chunk.window_end]


def gather_owned(x: torch.Tensor, chunk: Chunk, size: int, group=None) -> torch.Tensor:
    """Every rank's own positions of a [B, W, ...] window tensor (no gradient) -> the whole [B, T, ...] on each."""
    lengths = [c.end - c.start for c in (chunk_of(chunk.length, size, r, 0) for r in range(size))]
    own = x[:, :chunk.end - chunk.start]
    pad = torch.zeros(own.shape[0], max(lengths) - own.shape[1], *own.shape[2:], dtype=own.dtype, device=own.device)
    out = [torch.empty_like(torch.cat([own, pad], 1)) for _ in lengths]
    dist.all_gather(out, torch.cat([own, pad], 1).contiguous(), group=group)
    return torch.cat([o[:, :n] for o, n in zip(out, lengths)], dim=1)


def sequence_parallel_loss(drafter, target_lm_head: torch.Tensor, hidden_state, input_ids, loss_mask,
                           final_hidden, *, steps: int, decay: float, chunk_tokens: int, attention_mask=None,
                           group=None, target_argmax=None, with_hits: bool = False, fast: bool = False,
                           draft_head=None, objective=None):
    """This rank's share of the EAGLE-3 loss of a batch whose positions are split over `group` (right padding
    allowed): (loss, metrics) as eagle3_loss returns them, the loss summing over the group to the unsplit one and
    the metrics this rank's own pairs (all-reduce ce_sum / correct / count / alpha_sum to pool them); objective:
    loss.Objective (None: the soft cross-entropy). with_hits (held-out
    evaluation, no grad): also the whole batch's [B, T, K] draft hits (acceptance.draft_hits), on every rank;
    target_argmax [B, T] is then the target's full-vocab argmax (None: from its head). fast: model/kernels.py's
    forward and fused loss, as DrafterTrainStep's fast path (draft_head: the draft rows of the target head, used
    with target_argmax)."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    chunk = chunk_of(input_ids.shape[1], size, rank, steps)
    outs = window_forward(drafter, chunk, hidden_state, input_ids, attention_mask, steps, fast,
                           prefix_kv(chunk, size, group))
    loss, m = window_loss(drafter, outs, chunk, target_lm_head, input_ids, loss_mask, final_hidden, attention_mask,
                           target_argmax, draft_head, decay, chunk_tokens, fast, sum_over_group(group), objective,
                           sum_over_group(group))
    if not with_hits:
        return loss, m
    targ = full_vocab_argmax(window(final_hidden, chunk), target_lm_head, chunk_tokens) if target_argmax is None \
        else window(target_argmax, chunk)
    return loss, m, gather_owned(draft_hits(drafter, outs, targ.long(), chunk_tokens), chunk, size, group)


def window_forward(drafter, c: Chunk, hidden_state, input_ids, attention_mask, steps: int, fast: bool, hook):
    """The TTT unroll over chunk c's window (its positions and halo), at their own positions; `hook` is the
    drafter's prefix_kv (the keys of the positions before the chunk)."""
    positions = torch.arange(c.start, c.window_end, device=input_ids.device).expand(input_ids.shape[0], -1)
    return drafter.ttt_forward(window(hidden_state, c), window(input_ids, c), window(attention_mask, c), steps,
                               positions, fast=fast, prefix_kv=hook)


def window_loss(drafter, outs, c: Chunk, target_lm_head, input_ids, loss_mask, final_hidden, attention_mask,
                 target_argmax, draft_head, decay: float, chunk_tokens: int, fast: bool, reduce_counts, objective=None,
                 reduce_alpha=None):
    """(loss, metrics) of chunk c's own pairs over its window, each step's count (and alpha sum) made the whole
    row's by `reduce_counts` (`reduce_alpha`) (eagle3_loss `queries` / `reduce_counts` / `reduce_alpha`)."""
    th, ids, lm, mask = (window(x, c) for x in (final_hidden, input_ids, loss_mask, attention_mask))
    share = dict(queries=c.end - c.start, reduce_counts=reduce_counts, objective=objective or KL,
                 reduce_alpha=reduce_alpha)
    if fast:
        return eagle3_loss_fused(drafter, outs, th, ids, lm, mask, decay, chunk_tokens, lm_head_weight=target_lm_head,
                                 target_argmax=window(target_argmax, c), draft_head_weight=draft_head, **share)
    return eagle3_loss(drafter, outs, th, target_lm_head, ids, lm, mask, decay=decay, chunk_tokens=chunk_tokens,
                       **share)
