"""EAGLE-3 teacher, training-time-test loss and metrics (docs/contract.md §9).

Alignment: step j at position t consumes token t+1+j and predicts token p = t+2+j; its teacher is the target's
distribution at position u = p-1 = t+1+j, softmax(lm_head(final_hidden[u])), restricted to the draft vocab and
renormalised. A pair (t, j) counts iff p < T, loss_mask[p] = 1 (an assistant-produced token), every position
<= p is real (attention_mask), and the target's full-vocab argmax at u lies inside the draft vocab.
Loss = sum_j decay^j * loss_j, loss_j a mean over step j's counted pairs (`Objective`): the soft cross-entropy
(--loss kl, the default), -log of the expected acceptance rate alpha = sum_v min(p_v, q_v) (--loss lk), or a mix of the
two weighted by the step's mean acceptance (--loss lk-hybrid); the LK losses of arXiv 2602.23881.

The teacher is computed once per needed position u (shared by all steps) and in chunks of tokens, so full-vocab
fp32 logits never exist for more than `chunk_tokens` tokens at once. Draft logits are computed per chunk too and,
when grad is on, recomputed in backward (activation checkpointing) so [tokens, draft_vocab] logits are not kept.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from eagle3.model.kernels import lean_norm, linear_alpha_sums, linear_soft_cross_entropy

DEFAULT_CHUNK_TOKENS = 1024
LOSSES = ("kl", "lk", "lk-hybrid")  # eagle3 train --loss


@dataclass(frozen=True)
class Objective:
    """What each TTT step's loss_j is (the total stays sum_j decay^j * loss_j); docs/contract.md §9.

    Per counted pair, p is the teacher row (the target's distribution restricted to the draft vocab and renormalised)
    and q = softmax(draft logits); alpha = sum_v min(p_v, q_v) is the probability that speculative sampling accepts
    a draft token drawn from q. With a draft vocab smaller than the target's this is the acceptance WITHIN the draft
    vocab (p renormalised there: the full-vocab normaliser is not available on the dump's target_argmax path, whose
    teacher multiplies the draft rows of the head only); for a full-vocab drafter it is the exact acceptance.

    kl:        loss_j = sum of the soft cross-entropy -sum_v p_v log q_v over the pairs / count_j.
    lk:        loss_j = sum of -log(alpha) over the pairs / count_j; a pair with alpha == 0 adds 0 (and no gradient),
               as SpecForge 0.2.0's `lk_loss` ("alpha") does -- and so does one whose alpha is subnormal (below
               torch.finfo(dtype).tiny, 1.2e-38 in fp32), where 1/alpha overflows to inf and would turn the whole
               gradient into NaN (SpecForge's does).
    lk-hybrid: loss_j = w_j * KL_j + (1 - w_j) * (1 - abar_j), abar_j = sum of alpha / count_j and
               w_j = kl_scale * exp(-kl_decay * abar_j) with abar_j taken as a constant (no gradient through w_j):
               SpecForge's "lambda" mode. A step with no counted pair has loss_j = 0 (its 1 - abar_j term is written
               (count_j - sum alpha) / max(count_j, 1), which is also what lets sequence-parallel ranks' shares add up).
    count_j and abar_j are the whole sequence's (summed over sequence-parallel ranks or pieces) when it is split."""
    name: str = "kl"
    kl_scale: float = 1.0
    kl_decay: float = 1.0

    def __post_init__(self):
        if self.name not in LOSSES:
            raise ValueError(f"loss {self.name!r}: expected one of {', '.join(LOSSES)}")
        for what, v in (("kl_scale", self.kl_scale), ("kl_decay", self.kl_decay)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"lk-hybrid {what} {v!r} must be a finite number >= 0")

    def kl_weights(self, alpha_sum: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        """lk-hybrid's w_j [K] float64 from the (pooled) per-step sums of alpha and counts; detached."""
        abar = alpha_sum.detach().to(torch.float64) / count.detach().to(torch.float64).clamp(min=1)
        return self.kl_scale * torch.exp(-self.kl_decay * abar)


KL = Objective()


def neg_log_alpha(alpha: torch.Tensor) -> torch.Tensor:
    """-log(alpha) per pair, 0 where alpha == 0 (a teacher and a draft with disjoint supports after underflow) or is
    subnormal (1/alpha overflows), with a zero gradient there rather than the 0 * inf = nan that a plain
    torch.where(alpha > 0, log(alpha), 0) backward gives. (kernels._lk_chunk holds the same rule.)"""
    pos = alpha >= torch.finfo(alpha.dtype).tiny
    return torch.where(pos, -torch.log(torch.where(pos, alpha, torch.ones_like(alpha))), torch.zeros_like(alpha))


def _pooled_alpha(alpha_sum: torch.Tensor, reduce_counts, reduce_alpha) -> torch.Tensor:
    """lk-hybrid's per-step alpha sums over the whole sequence: a split sequence's weight w_j must be the unsplit
    one, so whoever splits it (reduce_counts given) must say how its alpha sums pool."""
    if reduce_alpha is not None:
        return reduce_alpha(alpha_sum.detach())
    if reduce_counts is not None:
        raise ValueError("--loss lk-hybrid on a split sequence needs reduce_alpha (the whole sequence's acceptance "
                         "sets each step's KL weight) next to reduce_counts")
    return alpha_sum.detach()


@torch.no_grad()
def teacher(final_hidden: torch.Tensor, lm_head_weight: torch.Tensor, t2d: torch.Tensor,
            chunk_tokens: int = DEFAULT_CHUNK_TOKENS):
    """Teacher distributions for N tokens.

    final_hidden [N, Ht] (post-final-norm), lm_head_weight [V, Ht], t2d bool [V].
    Returns (p_draft [N, Dv] fp32 (fp64 for an fp64 weight): target probs restricted to the draft vocab (draft order = ascending target id)
    and renormalised; in_vocab bool [N]: full-vocab argmax is a draft token; target_argmax_draft [N] long: that
    argmax as a draft id, 0 where not in_vocab).
    The matmul runs in lm_head_weight's dtype (as the target computes its own logits); softmax in fp32 (or fp64).
    """
    if final_hidden.dim() != 2 or lm_head_weight.dim() != 2 or final_hidden.shape[1] != lm_head_weight.shape[1]:
        raise ValueError(f"teacher: final_hidden {tuple(final_hidden.shape)} vs lm_head {tuple(lm_head_weight.shape)}")
    V = lm_head_weight.shape[0]
    t2d = t2d.to(device=lm_head_weight.device, dtype=torch.bool)
    if t2d.shape != (V,):
        raise ValueError(f"t2d has shape {tuple(t2d.shape)}, lm_head has {V} rows")
    draft_ids = t2d.nonzero().squeeze(-1)                   # [Dv] target ids, ascending
    t2d_index = draft_index(t2d)                            # target id -> draft id, -1 where not a draft token
    N = final_hidden.shape[0]
    acc = torch.promote_types(lm_head_weight.dtype, torch.float32)
    p = torch.empty(N, draft_ids.numel(), dtype=acc, device=lm_head_weight.device)
    in_vocab = torch.empty(N, dtype=torch.bool, device=lm_head_weight.device)
    argmax_draft = torch.empty(N, dtype=torch.int64, device=lm_head_weight.device)
    chunk = max(1, int(chunk_tokens))
    for s in range(0, N, chunk):
        hs = final_hidden[s:s + chunk].to(device=lm_head_weight.device, dtype=lm_head_weight.dtype)
        logits = (hs @ lm_head_weight.T).to(acc)            # [c, V]
        am = logits.argmax(-1)
        d = t2d_index[am]
        in_vocab[s:s + chunk] = d >= 0
        argmax_draft[s:s + chunk] = d.clamp(min=0)
        p[s:s + chunk] = torch.softmax(logits.index_select(1, draft_ids), dim=-1)
        del logits
    return p, in_vocab, argmax_draft


@torch.no_grad()
def teacher_from_argmax(final_hidden: torch.Tensor, draft_head_weight: torch.Tensor, t2d_index: torch.Tensor,
                        target_argmax: torch.Tensor):
    """`teacher` when the full-vocab argmax was recorded at dump time: only the draft-vocab rows of the target head
    are multiplied (the renormalised teacher needs nothing else), so a step costs 2*H*Dv instead of 2*H*V per token.

    draft_head_weight [Dv, Ht] = lm_head_weight[draft ids]; t2d_index [V] long: draft id of each target id, -1 when
    not a draft token; target_argmax [N] long. Returns as `teacher` does, except that the probabilities come as a
    function (lo, hi) -> rows lo..hi-1, computed when kernels.linear_soft_cross_entropy reaches them (the whole
    [N, Dv] fp32 teacher is 16 GiB for one 131,072-token sample at the Kimi shape).
    """
    acc = torch.promote_types(draft_head_weight.dtype, torch.float32)
    dev = draft_head_weight.device

    @torch.no_grad()
    def rows(lo: int, hi: int) -> torch.Tensor:
        hs = final_hidden[lo:hi].to(device=dev, dtype=draft_head_weight.dtype)
        return torch.softmax((hs @ draft_head_weight.T).to(acc), dim=-1)

    d = t2d_index.to(dev)[target_argmax.to(dev).long()]
    return rows, d >= 0, d.clamp(min=0)


def draft_index(t2d: torch.Tensor) -> torch.Tensor:
    """[V] long: the draft id of each target id, -1 where t2d is False."""
    t2d = t2d.bool()
    return torch.where(t2d, torch.cumsum(t2d.long(), 0) - 1, -1)


def teacher_positions(loss_mask: torch.Tensor, attention_mask: torch.Tensor | None, device) -> torch.Tensor:
    """[B, T] bool: positions u whose teacher some (t, j) pair needs. Predicted token p = u + 1 counts iff p >= 2
    (t >= 0, j >= 0), loss_mask[p] = 1 and every position <= p is real (the vocab condition comes later)."""
    B, T = loss_mask.shape
    real = torch.ones(B, T, dtype=torch.bool, device=device) if attention_mask is None \
        else attention_mask.to(device).bool()
    target_ok = loss_mask.to(device=device).bool() & torch.cumprod(real.to(torch.int64), dim=1).bool()
    target_ok[:, :2] = False
    need = torch.zeros(B, T, dtype=torch.bool, device=device)
    need[:, :-1] = target_ok[:, 1:]
    return need


@torch.no_grad()
def full_vocab_argmax(final_hidden: torch.Tensor, lm_head_weight: torch.Tensor,
                      chunk_tokens: int) -> torch.Tensor:
    """[..., Ht] -> [...] long: the target's full-vocab argmax from its own head (what the dump records as
    `target_argmax` when it can), the logits computed `chunk_tokens` rows at a time."""
    th, w = final_hidden.reshape(-1, final_hidden.shape[-1]), lm_head_weight
    am = [(th[s:s + chunk_tokens].to(w.dtype) @ w.T).argmax(-1) for s in range(0, th.shape[0], chunk_tokens)]
    return torch.cat(am).view(final_hidden.shape[:-1])


def step_counts(t2d: torch.Tensor, target_argmax: torch.Tensor, loss_mask: torch.Tensor,
                attention_mask: torch.Tensor | None, steps: int) -> torch.Tensor:
    """[K] float64: the pairs (t, j) each TTT step counts over whole rows, i.e. the unsplit loss's denominators
    (the `count` metric of eagle3_loss / eagle3_loss_fused). target_argmax [B, T]: the target's full-vocab argmax
    (the vocab condition). Step j at t is taught at u = t + 1 + j, so it counts the valid u >= 1 + j."""
    dev = loss_mask.device
    valid_u = teacher_positions(loss_mask, attention_mask, dev) & t2d.to(dev).bool()[target_argmax.to(dev).long()]
    return torch.stack([valid_u[:, 1 + j:].sum() for j in range(steps)]).to(torch.float64)


def _ce_and_correct(drafter, m: torch.Tensor, p: torch.Tensor, tgt: torch.Tensor, grad_alpha: bool = False):
    logits = drafter.draft_logits(m)
    lp = F.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    ce = -(p.to(lp.dtype) * lp).sum()
    correct = (logits.argmax(-1) == tgt).sum()
    # alpha per row: a metric under --loss kl (no graph), differentiated under the LK losses
    q = lp.exp() if grad_alpha else lp.detach().exp()
    alpha = torch.minimum(p.to(lp.dtype), q).sum(-1)
    return ce, correct, alpha


def _soft_ce(drafter, m: torch.Tensor, p: torch.Tensor, tgt: torch.Tensor, chunk_tokens: int,
             grad_alpha: bool = False):
    """Sum over rows of -sum p * log_softmax(draft_logits(m)), the number of argmax hits, and each row's
    alpha = sum min(p, softmax(draft_logits(m))) [n] (with a graph only when grad_alpha). Chunked."""
    n = m.shape[0]
    chunk = max(1, int(chunk_tokens))
    if n <= chunk:
        return _ce_and_correct(drafter, m, p, tgt, grad_alpha)
    ce_total, correct_total = m.new_zeros((), dtype=torch.promote_types(m.dtype, torch.float32)), 0
    alphas = []
    for s in range(0, n, chunk):
        args = (drafter, m[s:s + chunk], p[s:s + chunk], tgt[s:s + chunk], grad_alpha)
        if torch.is_grad_enabled():
            ce, correct, alpha = checkpoint(_ce_and_correct, *args, use_reentrant=False)
        else:
            ce, correct, alpha = _ce_and_correct(*args)
        ce_total = ce_total + ce
        correct_total = correct_total + correct
        alphas.append(alpha)
    return ce_total, correct_total, torch.cat(alphas)


def eagle3_loss(drafter, step_outputs: Sequence[torch.Tensor], final_hidden: torch.Tensor,
                lm_head_weight: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                attention_mask: torch.Tensor | None = None, decay: float = 0.8,
                chunk_tokens: int = DEFAULT_CHUNK_TOKENS, queries: int | None = None, reduce_counts=None,
                objective: Objective = KL, reduce_alpha=None):
    """The EAGLE-3 TTT loss.

    drafter: has draft_logits(m) and buffer t2d; step_outputs: [m_0..m_{K-1}] each [B, T, H] (ttt_forward);
    final_hidden [B, T, Ht] (post-final-norm); lm_head_weight [V, Ht] (target's); input_ids [B, T] (only shapes
    are used: the teacher is the target's distribution, not the one-hot data token); loss_mask [B, T] (1 at tokens to
    learn to predict); attention_mask [B, T] (None = all real).

    Sequence parallel (train/sequence_parallel.py) passes a window of the sequence: `queries`, the positions t of
    this rank's own chunk (only pairs with t < queries count; the rest of the window is the next chunk's first
    tokens, which those pairs read), and `reduce_counts`, which sums the per-step counts over the ranks so that each
    rank's share of the loss is divided by the whole sequence's count. `objective` (default KL: the soft
    cross-entropy) says what loss_j is (`Objective`); under lk-hybrid a split sequence also passes `reduce_alpha`,
    which sums the per-step alpha sums over the ranks the same way (each step's KL weight is the whole sequence's).

    Returns (loss, metrics). loss = sum_j decay^j * loss_j, e.g. under kl decay^j * ce_sum_j / max(count_j, 1) (a
    local mean per step). metrics (all detached, float64, on the loss device):
      ce_sum [K], correct [K], count [K], alpha_sum [K]   -- sums, all-reduce these to pool across ranks
      loss_per_step [K] (the soft cross-entropy whatever the objective), acc_per_step [K], alpha_per_step [K]
      (mean expected acceptance), acceptance_length (scalar), and loss_{j}, acc_{j}, alpha_{j} (scalars).
    """
    K = len(step_outputs)
    if K < 1:
        raise ValueError("eagle3_loss needs at least one step output")
    B, T = input_ids.shape
    dev = step_outputs[0].device
    # Teacher positions u = p - 1, computed once each.
    need = teacher_positions(loss_mask, attention_mask, dev)
    flat = need.reshape(-1).nonzero().squeeze(-1)
    row_of = torch.full((B * T,), -1, dtype=torch.int64, device=dev)
    row_of[flat] = torch.arange(flat.numel(), device=dev)
    row_of = row_of.view(B, T)
    th = final_hidden.reshape(B * T, -1).index_select(0, flat.to(final_hidden.device))
    p_t, in_vocab, argmax_d = teacher(th, lm_head_weight, drafter.t2d, chunk_tokens)
    p_t, in_vocab, argmax_d = p_t.to(dev), in_vocab.to(dev), argmax_d.to(dev)

    # valid_u[b, u]: teacher at u exists and its argmax is a draft token.
    valid_u = torch.zeros(B * T, dtype=torch.bool, device=dev)
    valid_u[flat] = in_vocab
    valid_u = valid_u.view(B, T)

    ces, corrects, counts, alphas = [], [], [], []
    for j, m in enumerate(step_outputs):
        if m.shape[:2] != (B, T):
            raise ValueError(f"step output {j} has shape {tuple(m.shape)}, expected [{B}, {T}, H]")
        # pair (t, j) -> teacher position u = t + 1 + j
        sel = torch.zeros(B, T, dtype=torch.bool, device=dev)
        if 1 + j < T:
            sel[:, : T - 1 - j] = valid_u[:, 1 + j:]
        if queries is not None:
            sel[:, queries:] = False
        idx = sel.reshape(-1).nonzero().squeeze(-1)
        b_idx, t_idx = idx // T, idx % T
        rows = row_of[b_idx, t_idx + 1 + j]
        mj = m.reshape(B * T, -1).index_select(0, idx)
        ce, correct, alpha = _soft_ce(drafter, mj, p_t.index_select(0, rows), argmax_d.index_select(0, rows),
                                      chunk_tokens, grad_alpha=objective.name != "kl")
        ces.append(ce)
        alphas.append(alpha)
        corrects.append(torch.as_tensor(correct, device=dev).to(torch.float64))
        counts.append(torch.tensor(float(idx.numel()), dtype=torch.float64, device=dev))

    count = torch.stack(counts)
    denom = (reduce_counts(count) if reduce_counts is not None else count).clamp(min=1)
    alpha_sum = torch.stack([a.detach().sum().to(torch.float64) for a in alphas])
    if objective.name == "kl":
        total = sum(ce / denom[j].to(ce.dtype) * (decay ** j) for j, ce in enumerate(ces))
    elif objective.name == "lk":
        total = sum(neg_log_alpha(a).sum() / denom[j].to(a.dtype) * (decay ** j) for j, a in enumerate(alphas))
    else:  # lk-hybrid: w_j from the whole sequence's mean acceptance, a constant for the gradient
        w = objective.kl_weights(_pooled_alpha(alpha_sum, reduce_counts, reduce_alpha), denom)
        total = sum((w[j].to(ce.dtype) * ce + (1 - w[j]).to(ce.dtype) * (count[j].to(ce.dtype) - a.sum()))
                    / denom[j].to(ce.dtype) * (decay ** j) for j, (ce, a) in enumerate(zip(ces, alphas)))
    ce_sum, correct = torch.stack([ce.detach().to(torch.float64) for ce in ces]), torch.stack(corrects)
    metrics = {"ce_sum": ce_sum, "correct": correct, "count": count, "alpha_sum": alpha_sum}
    metrics.update(summarize(ce_sum, correct, count, alpha_sum))
    return total, metrics


def summarize(ce_sum: torch.Tensor, correct: torch.Tensor, count: torch.Tensor,
              alpha_sum: torch.Tensor | None = None) -> dict:
    """Per-step mean loss/accuracy (and mean expected acceptance alpha, given its sums) and acceptance length from
    (possibly all-reduced / accumulated) sums."""
    denom = count.clamp(min=1)
    out = {"loss_per_step": ce_sum / denom, "acc_per_step": correct / denom,
           "acceptance_length": acceptance_length(correct, count)}
    if alpha_sum is not None:
        out["alpha_per_step"] = alpha_sum / denom
    for j in range(count.numel()):
        out[f"loss_{j}"] = out["loss_per_step"][j]
        out[f"acc_{j}"] = out["acc_per_step"][j]
        if alpha_sum is not None:
            out[f"alpha_{j}"] = out["alpha_per_step"][j]
    return out


def acceptance_length(correct_counts, totals):
    """Simulated chain acceptance length 1 + sum_j prod_{i<=j} acc_i, acc_i = correct_i / total_i (pooled ratios;
    a step with total 0 has acc 0). Tensors in -> 0-dim tensor out; lists/tuples in -> float out."""
    is_tensor = torch.is_tensor(correct_counts)
    c = torch.as_tensor(correct_counts, dtype=torch.float64)
    n = torch.as_tensor(totals, dtype=torch.float64, device=c.device)
    acc = torch.where(n > 0, c / n.clamp(min=1e-300), torch.zeros_like(c))
    tau = 1 + torch.cumprod(acc, 0).sum()
    return tau if is_tensor else float(tau)


def eagle3_loss_fused(drafter, step_outputs: Sequence[torch.Tensor], final_hidden: torch.Tensor,
                      input_ids: torch.Tensor, loss_mask: torch.Tensor, attention_mask: torch.Tensor | None = None,
                      decay: float = 0.8, chunk_tokens: int = DEFAULT_CHUNK_TOKENS, *,
                      lm_head_weight: torch.Tensor | None = None, target_argmax: torch.Tensor | None = None,
                      draft_head_weight: torch.Tensor | None = None, queries: int | None = None,
                      reduce_counts=None, objective: Objective = KL, reduce_alpha=None):
    """`eagle3_loss` computed through kernels.linear_soft_cross_entropy: the same loss and metrics, but no host
    sync (rows are weighted, not gathered), no [tokens, draft_vocab] logits kept, and, given `target_argmax` [B, T]
    from the dump with `draft_head_weight` (the draft rows of the target head), no full-vocab teacher matmul.
    Without them it needs `lm_head_weight` (the full target head) as `eagle3_loss` does. `queries`, `reduce_counts`,
    `objective`, `reduce_alpha`: as in `eagle3_loss`.
    Gradients are computed in forward, weighted per row, so lk-hybrid needs its weights w_j before its one gradient
    pass: with grad on it first runs a gradient-free pass over the draft head for the alpha sums
    (kernels.linear_alpha_sums, pooled by `reduce_alpha`), then the weighted pass. Without grad (held-out
    evaluation) one pass gives every sum the loss is made of.
    Reads the drafter's norm / lm_head weights directly (not for ZeRO-3)."""
    K = len(step_outputs)
    B, T = input_ids.shape
    dev = step_outputs[0].device
    need = teacher_positions(loss_mask, attention_mask, dev)            # teacher position u = predicted p - 1
    th = final_hidden.reshape(B * T, -1)
    if target_argmax is not None:
        if draft_head_weight is None:
            raise ValueError("target_argmax needs draft_head_weight (the draft-vocab rows of the target lm_head)")
        p_t, in_vocab, argmax_d = teacher_from_argmax(th, draft_head_weight, draft_index(drafter.t2d),
                                                      target_argmax.reshape(-1))
    else:
        p_t, in_vocab, argmax_d = teacher(th, lm_head_weight, drafter.t2d, chunk_tokens)
    valid_u = need & in_vocab.to(dev).view(B, T)
    # step j at position t is taught by u = t + 1 + j; rows past the end point anywhere with weight 0
    t = torch.arange(T, device=dev)
    u = torch.stack([t + 1 + j for j in range(K)])                      # [K, T]
    inside = u < T
    uc = u.clamp(max=T - 1)
    if queries is not None:  # pairs of this sequence-parallel rank's own positions only
        inside = inside & (t < queries)
    valid = (valid_u[:, uc] & inside).permute(1, 0, 2).reshape(K, B * T)  # [K, B*T]
    rows = (torch.arange(B, device=dev)[:, None, None] * T + uc).permute(1, 0, 2).reshape(K, B * T)
    count = valid.sum(1).to(torch.float64)
    denom = reduce_counts(count) if reduce_counts is not None else count
    w = torch.tensor([decay ** j for j in range(K)], dtype=torch.float64, device=dev) / denom.clamp(min=1)
    acc = torch.promote_types(step_outputs[0].dtype, torch.float32)

    def weights(per_step: torch.Tensor) -> torch.Tensor:  # [K] -> [K, B*T]: 0 where a pair does not count
        return valid.to(acc) * per_step.to(acc)[:, None]
    xs = [drafter.head_input(m.reshape(B * T, -1), lean_norm) for m in step_outputs]
    head = (xs, drafter.lm_head.weight, p_t, argmax_d, rows)
    if objective.name == "kl" or (objective.name == "lk-hybrid" and not torch.is_grad_enabled()):
        loss, ce_sum, correct, alpha_sum = linear_soft_cross_entropy(*head, weights(w), valid, chunk_tokens)
        if objective.name == "lk-hybrid":  # no gradient to weight: the loss is a function of the sums
            kw = objective.kl_weights(_pooled_alpha(alpha_sum, reduce_counts, reduce_alpha), denom)
            loss = (w * (kw * ce_sum + (1 - kw) * (count - alpha_sum))).sum().to(acc)
    elif objective.name == "lk":
        loss, ce_sum, correct, alpha_sum = linear_soft_cross_entropy(*head, None, valid, chunk_tokens,
                                                                     alpha_weights=weights(w), log_alpha=True)
    else:  # lk-hybrid with grad: sum_j decay^j / count_j * (w_j * ce_j + (1 - w_j) * (count_j - alpha_j))
        alpha_pre = linear_alpha_sums(xs, drafter.lm_head.weight, p_t, argmax_d.shape[0], rows, valid, chunk_tokens)
        kw = objective.kl_weights(_pooled_alpha(alpha_pre, reduce_counts, reduce_alpha), denom)
        loss, ce_sum, correct, alpha_sum = linear_soft_cross_entropy(*head, weights(w * kw), valid, chunk_tokens,
                                                                     alpha_weights=weights(w * (1 - kw)),
                                                                     log_alpha=False)
        loss = loss + (w * (1 - kw) * count).sum().to(loss.dtype)
    metrics = {"ce_sum": ce_sum, "correct": correct, "count": count, "alpha_sum": alpha_sum}
    metrics.update(summarize(ce_sum, correct, count, alpha_sum))
    return loss, metrics
