"""One process, several pieces: sequence parallelism's split (train/sequence_parallel.py) without a group.

One GPU takes a row longer than it holds in `pieces` contiguous pieces, one after another, each forward followed by
its own backward, so only one piece's activations exist at a time. A piece's queries also see the step-0 keys of
every earlier piece (the prefix): those are computed first without autograd (the projection alone, ~0.4% of the step
at the Kimi shape) and handed to later pieces as leaves, whose gradients are then added to the earlier piece's own
keys when that piece runs. Pieces run last to first, so each piece's keys have received every later query's gradient
by then. The gradient is the unsplit row's (float64 tests).
"""

from __future__ import annotations

import torch

from eagle3.train.loss import KL, full_vocab_argmax, step_counts, summarize
from eagle3.train.sequence_parallel import Chunk, chunk_of, halo, window_forward, window_loss


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
                         final_hidden, *, pieces: int, steps: int, decay: float, chunk_tokens: int,
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
    objective = objective or KL
    T = input_ids.shape[1]
    if pieces < 2:
        raise ValueError(f"sequence_pieces_loss needs pieces >= 2, got {pieces}")
    if not torch.is_grad_enabled():
        raise RuntimeError("sequence_pieces_loss runs each piece's backward: call it with autograd on")
    full = full_vocab_argmax(final_hidden, target_lm_head, chunk_tokens) if target_argmax is None else target_argmax
    total = step_counts(drafter.t2d, full, loss_mask, attention_mask, steps)   # the unsplit denominators
    chunks = piece_chunks(T, pieces, steps)

    def forward(c: Chunk, hook):
        return window_forward(drafter, c, hidden_state, input_ids, attention_mask, steps, fast, hook)

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
                _, m = window_loss(drafter, forward(c, frozen), c, target_lm_head, input_ids, loss_mask,
                                    final_hidden, attention_mask, target_argmax, draft_head, decay, chunk_tokens,
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
        loss, m = window_loss(drafter, outs, c, target_lm_head, input_ids, loss_mask, final_hidden, attention_mask,
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
