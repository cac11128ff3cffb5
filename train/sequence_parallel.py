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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


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
                           target_hidden, *, steps: int, decay: float, chunk_tokens: int, attention_mask=None,
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
    from eagle3.train.loss import full_vocab_argmax
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    chunk = chunk_of(input_ids.shape[1], size, rank, steps)
    outs = _window_forward(drafter, chunk, hidden_state, input_ids, attention_mask, steps, fast,
                           prefix_kv(chunk, size, group))
    loss, m = _window_loss(drafter, outs, chunk, target_lm_head, input_ids, loss_mask, target_hidden, attention_mask,
                           target_argmax, draft_head, decay, chunk_tokens, fast, sum_over_group(group), objective,
                           sum_over_group(group))
    if not with_hits:
        return loss, m
    from eagle3.train.acceptance import draft_hits
    targ = full_vocab_argmax(window(target_hidden, chunk), target_lm_head, chunk_tokens) if target_argmax is None \
        else window(target_argmax, chunk)
    return loss, m, gather_owned(draft_hits(drafter, outs, targ.long(), chunk_tokens), chunk, size, group)


def _window_forward(drafter, c: Chunk, hidden_state, input_ids, attention_mask, steps: int, fast: bool, hook):
    """The TTT unroll over chunk c's window (its positions and halo), at their own positions; `hook` is the
    drafter's prefix_kv (the keys of the positions before the chunk)."""
    positions = torch.arange(c.start, c.window_end, device=input_ids.device).expand(input_ids.shape[0], -1)
    return drafter.ttt_forward(window(hidden_state, c), window(input_ids, c), window(attention_mask, c), steps,
                               positions, fast=fast, prefix_kv=hook)


def _window_loss(drafter, outs, c: Chunk, target_lm_head, input_ids, loss_mask, target_hidden, attention_mask,
                 target_argmax, draft_head, decay: float, chunk_tokens: int, fast: bool, reduce_counts, objective=None,
                 reduce_alpha=None):
    """(loss, metrics) of chunk c's own pairs over its window, each step's count (and alpha sum) made the whole
    row's by `reduce_counts` (`reduce_alpha`) (eagle3_loss `queries` / `reduce_counts` / `reduce_alpha`)."""
    from eagle3.train.loss import KL, eagle3_loss, eagle3_loss_fused
    th, ids, lm, mask = (window(x, c) for x in (target_hidden, input_ids, loss_mask, attention_mask))
    share = dict(queries=c.end - c.start, reduce_counts=reduce_counts, objective=objective or KL,
                 reduce_alpha=reduce_alpha)
    if fast:
        return eagle3_loss_fused(drafter, outs, th, ids, lm, mask, decay, chunk_tokens, lm_head_weight=target_lm_head,
                                 target_argmax=window(target_argmax, c), draft_head_weight=draft_head, **share)
    return eagle3_loss(drafter, outs, th, target_lm_head, ids, lm, mask, decay=decay, chunk_tokens=chunk_tokens,
                       **share)


# ---- one process, several pieces --------------------------------------------------------------------------------
# The same split without a group: one GPU takes a row longer than it holds in `pieces` contiguous pieces, one after
# another, each forward followed by its own backward, so only one piece's activations exist at a time. A piece's
# queries also see the step-0 keys of every earlier piece (the prefix): those are computed first without autograd
# (the projection alone, ~0.4% of the step at the Kimi shape) and handed to later pieces as leaves, whose gradients
# are then added to the earlier piece's own keys when that piece runs. Pieces run last to first, so each piece's
# keys have received every later query's gradient by then. The gradient is the unsplit row's (float64 tests).

def piece_chunks(length: int, pieces: int, ttt_steps: int, align: int = 128) -> list[Chunk]:
    """sequence_pieces_loss's pieces: contiguous, every boundary at a multiple of `align` (so every prefix of keys is
    one, which lets the prefix block run on cuDNN: kernels._block_forward; 128 = kernels.CUDNN_T_MULTIPLE), as
    equal as that allows; a row shorter than pieces x align is cut as chunk_of cuts it."""
    if length < pieces * align:
        return [chunk_of(length, pieces, r, ttt_steps) for r in range(pieces)]
    cuts = [0] + [length * r // pieces // align * align for r in range(1, pieces)] + [length]
    return [Chunk(a, b, min(b + halo(ttt_steps), length), length) for a, b in zip(cuts, cuts[1:])]


class _KeysOnly(Exception):
    """Raised by the prefix hook of the key pre-pass: the step-0 keys are all it needs of a piece's forward."""

    def __init__(self, k0: torch.Tensor, v0: torch.Tensor):
        super().__init__()
        self.k0, self.v0 = k0, v0


def _stop_at_keys(k0, v0):
    raise _KeysOnly(k0, v0)


class _GivenGrads(torch.autograd.Function):
    """0 in forward; in backward each of `tensors` receives its precomputed gradient (times the incoming one). The
    earlier pieces' parameter gradients (torch.autograd.grad: nothing reaches .grad or an optimizer's hooks) thus
    arrive through the one backward of the returned loss, as DeepSpeed expects of a micro-step."""

    @staticmethod
    def forward(ctx, grads, *tensors):
        ctx.grads = grads
        return tensors[0].new_zeros((), dtype=torch.float32)

    @staticmethod
    def backward(ctx, g):
        return (None, *[None if x is None else x * g.to(x.dtype) for x in ctx.grads])


def sequence_pieces_loss(drafter, target_lm_head: torch.Tensor, hidden_state, input_ids, loss_mask,
                         target_hidden, *, pieces: int, steps: int, decay: float, chunk_tokens: int,
                         attention_mask=None, target_argmax=None, fast: bool = False, draft_head=None,
                         objective=None):
    """(loss, metrics) of a batch whose rows are taken in `pieces` contiguous pieces one after another on this
    process: the unsplit loss and metrics (eagle3_loss's), and `loss.backward()` gives the unsplit gradients while
    the activations of only one piece are alive at a time. Every piece but the first has already run its backward
    here (torch.autograd.grad); their parameter gradients come with the returned loss's backward. Grad mode only
    (no_grad evaluation holds no activations: take the row whole). target_argmax [B, T] (None: from
    target_lm_head) is the target's full-vocab argmax; fast / draft_head / objective as in sequence_parallel_loss.
    Under --loss lk-hybrid the first piece's backward already needs every step's weight, a function of the whole
    row's mean acceptance: the pieces are first run forward without autograd for their alpha sums (one more forward
    of the row, with no activations kept)."""
    from eagle3.train.loss import KL, full_vocab_argmax, step_counts, summarize
    objective = objective or KL
    T = input_ids.shape[1]
    if pieces < 2:
        raise ValueError(f"sequence_pieces_loss needs pieces >= 2, got {pieces}")
    if not torch.is_grad_enabled():
        raise RuntimeError("sequence_pieces_loss runs each piece's backward: call it with autograd on")
    full = full_vocab_argmax(target_hidden, target_lm_head, chunk_tokens) if target_argmax is None else target_argmax
    total = step_counts(drafter.t2d, full, loss_mask, attention_mask, steps)   # the unsplit denominators
    chunks = piece_chunks(T, pieces, steps)

    def forward(c: Chunk, hook):
        return _window_forward(drafter, c, hidden_state, input_ids, attention_mask, steps, fast, hook)

    keys = []  # (k0, v0) leaves of every piece but the last: [B, nkv, own, d]
    with torch.no_grad():
        for c in chunks[:-1]:
            try:
                forward(c, _stop_at_keys)
                raise AssertionError("ttt_forward did not call prefix_kv")
            except _KeysOnly as e:
                own = c.end - c.start
                keys.append(tuple(x[:, :, :own].detach().requires_grad_() for x in (e.k0, e.v0)))
    alpha_total = None
    if objective.name == "lk-hybrid":
        with torch.no_grad():
            sums_a = []
            for r, c in enumerate(chunks):
                def frozen(k0, v0, r=r):  # the earlier pieces' keys as computed above; nothing to route gradients to
                    if r == 0:
                        return k0, v0, (k0[:, :, :0], v0[:, :, :0])
                    return k0, v0, tuple(torch.cat([kv[i] for kv in keys[:r]], dim=2) for i in (0, 1))
                _, m = _window_loss(drafter, forward(c, frozen), c, target_lm_head, input_ids, loss_mask,
                                    target_hidden, attention_mask, target_argmax, draft_head, decay, chunk_tokens,
                                    fast, lambda _count: total)  # the soft cross-entropy: its metrics hold alpha_sum
                sums_a.append(m["alpha_sum"])
            alpha_total = torch.stack(sums_a).sum(0)
    extra = [[None, None] for _ in keys]  # gradients later pieces' queries put on each piece's keys
    params = [p for p in drafter.parameters() if p.requires_grad]
    given = [None] * len(params)
    sums, first_loss, rest = [], None, 0.0
    for r in reversed(range(pieces)):
        c = chunks[r]

        def hook(k0, v0, r=r):
            if r < len(keys):  # this piece's own keys also get what later pieces' queries put on them
                k0, v0 = (_plus_grad(x, g) for x, g in zip((k0, v0), extra[r]))
            if r == 0:
                return k0, v0, (k0[:, :, :0], v0[:, :, :0])
            return k0, v0, tuple(torch.cat([kv[i] for kv in keys[:r]], dim=2) for i in (0, 1))

        outs = forward(c, hook)
        loss, m = _window_loss(drafter, outs, c, target_lm_head, input_ids, loss_mask, target_hidden, attention_mask,
                               target_argmax, draft_head, decay, chunk_tokens, fast, lambda _count: total, objective,
                               lambda _alpha: alpha_total)
        sums.append(torch.stack([m["ce_sum"], m["correct"], m["count"], m["alpha_sum"]]))
        if r == 0:
            first_loss = loss
            break
        leaves = [x for kv in keys[:r] for x in kv]
        grads = torch.autograd.grad(loss, params + leaves, allow_unused=True)
        for i, g in enumerate(grads[:len(params)]):
            if g is not None:
                given[i] = g if given[i] is None else given[i] + g
        for i, g in enumerate(grads[len(params):]):
            if g is not None:
                slot = extra[i // 2]
                slot[i % 2] = g if slot[i % 2] is None else slot[i % 2] + g
        rest = rest + loss.detach()
        del outs, loss, grads
    ce_sum, correct, count, alpha_sum = torch.stack(sums).sum(0)
    metrics = {"ce_sum": ce_sum, "correct": correct, "count": count, "alpha_sum": alpha_sum}
    metrics.update(summarize(ce_sum, correct, count, alpha_sum))
    return first_loss + rest + _GivenGrads.apply(tuple(given), *params), metrics


def _plus_grad(x: torch.Tensor, extra: torch.Tensor | None) -> torch.Tensor:
    """x, whose gradient also gets `extra` on its first extra.shape[2] positions (the rest: the halo's keys)."""
    if extra is None:
        return x
    pad = x.shape[2] - extra.shape[2]
    full = torch.nn.functional.pad(extra, (0, 0, 0, pad)) if pad else extra
    x.register_hook(lambda g: g + full.to(g.dtype))
    return x
