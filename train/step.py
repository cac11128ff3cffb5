"""One training step, and the one place where the parallel layout is applied to it.

The layout: the world is `dp_size` data-parallel groups of `sp` consecutive ranks; a group holds one batch and its
ranks split the batch's positions (sequence parallel, train/sequence_parallel.py); one process may also walk a long
batch in pieces of --piece-tokens (train/pieces.py). `Parallel` says which group a rank is in and how each per-rank
quantity (the loss DeepSpeed averages, the tokens counted, the held-out walk) is weighted under it;
`DrafterTrainStep` (what DeepSpeed wraps) dispatches the loss to one of the three ways of computing it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from eagle3 import dist as D
from eagle3.model import kernels
from eagle3.train.acceptance import draft_hits
from eagle3.train.config import TrainConfig
from eagle3.train.loss import Objective, eagle3_loss, eagle3_loss_fused, full_vocab_argmax, summarize
from eagle3.train.pieces import sequence_pieces_loss
from eagle3.train.sequence_parallel import sequence_parallel_loss

# The per-step sums a training step reports (the loss metrics' own names), summed over tokens, ranks and log
# intervals as they are, then turned into means by `pooled`.
STATS = ("ce_sum", "correct", "count", "alpha_sum")


@dataclass(frozen=True)
class Parallel:
    """This rank's place in the layout: `sp` ranks per sequence-parallel group (`group` its communicator, None for
    sp 1), data-parallel group `dp_rank` of `dp_size` (the index the data is dealt by)."""
    sp: int = 1
    group: Any = None
    dp_rank: int = 0
    dp_size: int = 1
    rank_in_group: int = 0

    @classmethod
    def of(cls, world: D.World, sp: int) -> "Parallel":
        if sp < 1 or world.world_size % sp:
            raise ValueError(f"--sequence-parallel {sp}: the world size ({world.world_size}) must be a multiple of it")
        return cls(sp=sp, group=D.sequence_parallel_group(world, sp), dp_rank=world.rank // sp,
                   dp_size=world.world_size // sp, rank_in_group=world.rank % sp)

    def loss_for_backward(self, loss: torch.Tensor) -> torch.Tensor:
        """DeepSpeed averages gradients over every rank; a sequence-parallel group's shares add up to one batch's."""
        return loss * self.sp if self.sp > 1 else loss

    def tokens(self, attention_mask: torch.Tensor) -> float:
        """This rank's share of the tokens trained on: a group's ranks count the same batch."""
        return int(attention_mask.sum()) / self.sp

    def mean_loss(self, summed: float, steps: int) -> float:
        """The loss per batch from its sum over every rank and `steps` steps: a group's shares add up to its batch's."""
        return summed / self.dp_size / steps

    @property
    def walks_hits(self) -> bool:
        """A sequence-parallel group holds the same held-out hits on every rank: one of them walks them."""
        return self.rank_in_group == 0


class DrafterTrainStep(nn.Module):
    """What DeepSpeed wraps: the drafter and its loss, so that under ZeRO-3 every parameter the loss touches
    (norm, lm_head) is gathered inside forward. The target's lm_head is a frozen buffer (the teacher); its draft-vocab
    rows are a second one, enough for the teacher when the dump recorded the full-vocab argmax (`target_argmax`).
    fast: kernels.py's forward and fused loss (they read weights directly, so ZeRO-3 keeps the plain path)."""

    def __init__(self, drafter: nn.Module, target_lm_head: torch.Tensor, cfg: TrainConfig,
                 parallel: Parallel | None = None):
        super().__init__()
        self.drafter = drafter
        self.steps, self.decay, self.chunk = cfg.ttt_steps, cfg.step_decay, cfg.teacher_chunk_tokens
        self.objective = Objective(cfg.loss, cfg.lk_kl_scale, cfg.lk_kl_decay)
        self.fast = bool(cfg.fast_path) and cfg.zero_stage < 3
        self.sp_group = (parallel or Parallel()).group
        self.piece_tokens = cfg.piece_tokens
        kernels.set_cuda_attention_kernel(cfg.attention_kernel)
        if not self.fast and cfg.activation_checkpointing in ("step", "step_mlp"):
            raise ValueError(f"--activation-checkpointing {cfg.activation_checkpointing} needs the fast path "
                             "(--fast-path, ZeRO 0-2); the plain path recomputes the MLP only ('mlp')")
        self.register_buffer("target_lm_head", target_lm_head, persistent=False)
        draft_rows = target_lm_head[drafter.t2d.to(target_lm_head.device)].clone() if self.fast else None
        self.register_buffer("draft_head", draft_rows, persistent=False)

    def forward(self, hidden_state, input_ids, attention_mask, loss_mask, final_hidden, target_argmax=None,
                with_hits: bool = False):
        """(loss, stats [len(STATS), K]: the STATS sums); with_hits (held-out evaluation, no grad) also the
        [B, T, K] draft hits that acceptance.walk replays as decoding would."""
        common = dict(steps=self.steps, decay=self.decay, chunk_tokens=self.chunk, attention_mask=attention_mask,
                      target_argmax=target_argmax, fast=self.fast, draft_head=self.draft_head,
                      objective=self.objective)
        if self.sp_group is not None:  # this rank's chunk of every row
            r = sequence_parallel_loss(self.drafter, self.target_lm_head, hidden_state, input_ids, loss_mask,
                                       final_hidden, group=self.sp_group, with_hits=with_hits, **common)
            stats = torch.stack([r[1][k] for k in STATS])
            return (r[0], stats, r[2]) if with_hits else (r[0], stats)
        pieces = -(-input_ids.shape[1] // self.piece_tokens) if self.piece_tokens else 1
        if pieces > 1 and torch.is_grad_enabled() and not with_hits:  # one piece's activations at a time
            loss, m = sequence_pieces_loss(self.drafter, self.target_lm_head, hidden_state, input_ids, loss_mask,
                                           final_hidden, pieces=pieces, **common)
            return loss, torch.stack([m[k] for k in STATS])
        outs = self.drafter(hidden_state, input_ids, attention_mask, steps=self.steps, fast=self.fast)
        if with_hits:
            targ = target_argmax if target_argmax is not None else \
                full_vocab_argmax(final_hidden, self.target_lm_head, self.chunk)
            hits = draft_hits(self.drafter, outs, targ.long(), self.chunk)
        if self.fast:
            loss, m = eagle3_loss_fused(self.drafter, outs, final_hidden, input_ids, loss_mask, attention_mask,
                                        self.decay, self.chunk, lm_head_weight=self.target_lm_head,
                                        target_argmax=target_argmax, draft_head_weight=self.draft_head,
                                        objective=self.objective)
        else:
            loss, m = eagle3_loss(self.drafter, outs, final_hidden, self.target_lm_head, input_ids, loss_mask,
                                  attention_mask, decay=self.decay, chunk_tokens=self.chunk, objective=self.objective)
        stats = torch.stack([m[k] for k in STATS])
        return (loss, stats, hits) if with_hits else (loss, stats)


def noisy_aux(hidden_state: torch.Tensor, scale: float, num_aux: int, seed: int) -> torch.Tensor:
    """hidden_state [B, T, num_aux * H] plus Gaussian noise whose std is `scale` times each captured layer's RMS at
    that token (the layers' scales differ by orders of magnitude; one absolute std would drown the low one and
    miss the high one). `seed` fixes the draw (the trainer derives it from the run's seed, data-parallel rank and
    step, so a resumed run draws what an uninterrupted one would)."""
    B, T, D = hidden_state.shape
    x = hidden_state.view(B, T, num_aux, D // num_aux)
    acc = torch.promote_types(x.dtype, torch.float32)
    rms = x.to(acc).pow(2).mean(-1, keepdim=True).sqrt()
    g = torch.Generator(device=x.device).manual_seed(seed)
    noise = torch.randn(x.shape, generator=g, device=x.device, dtype=acc)
    return (x.to(acc) + scale * rms * noise).to(x.dtype).view(B, T, D)


def pooled(stats: torch.Tensor) -> dict:
    """stats [len(STATS), K] = (ce_sum, correct, count, alpha_sum) summed over tokens (and ranks) -> per-step
    metrics: loss_j the soft cross-entropy (whatever --loss is), acc_j, alpha_j the mean expected acceptance."""
    ce, correct, count, alpha = stats.double().cpu()
    s = summarize(ce, correct, count, alpha)
    return {"loss_j": s["loss_per_step"].tolist(), "acc_j": s["acc_per_step"].tolist(),
            "alpha_j": s["alpha_per_step"].tolist(), "accept_len": float(s["acceptance_length"]),
            "counted": int(count[0])}


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(t)
    return t
