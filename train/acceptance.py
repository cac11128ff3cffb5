"""What speculative decoding would accept, computed from a training-time-test unroll on held-out data.

Training's per-step accuracies (`acc_j`, loss.py) are teacher-forced marginals: step j at position t is scored whether
or not steps 0..j-1 were right, and positions whose target token lies outside the draft vocab are left out. Decoding
accepts a chain only up to its first miss and restarts right after the target's correction, so the product of
marginals (`loss.acceptance_length`) overstates it. This module replays the decoder exactly instead.

On target-written (greedy) data the TTT unroll IS the chain the decoder drafts: step j at position t reads the data
token t+1+j, which is what the decoder feeds back when drafts 0..j-1 were accepted (docs/contract.md §9). So
  hit[t, j] = (draft argmax at step j, position t, mapped to a target id) == (target's full-vocab argmax at t+1+j)
and a walk over each assistant turn reproduces `eagle3 eval`'s rounds: the prompt ends at P-1, the target produces
the turn's first token at P, the first round drafts from t = P-1, a round accepting n drafts emits n+1 tokens and the
next round starts at t + n + 1. `ChainStats` is the one bookkeeping of rounds, shared with eval/speculative.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class ChainStats:
    """Greedy chain drafting with K draft steps: rounds, tokens, and per draft position reached/accepted counts."""
    draft_steps: int
    verify_steps: int = 0
    round_tokens: int = 0      # accepted drafts + the target's bonus token, summed over verify steps
    target_forwards: int = 0
    new_tokens: int = 0
    reached: list[int] = field(default_factory=list)   # per draft position i: rounds that got as far as i
    accepted: list[int] = field(default_factory=list)  # per draft position i: rounds that accepted draft i

    def __post_init__(self):
        self.reached = self.reached or [0] * self.draft_steps
        self.accepted = self.accepted or [0] * self.draft_steps

    def add_round(self, n_accepted: int, checked: int | None = None) -> None:
        """A round that accepted n drafts. `checked` (default K): how many draft positions could be judged at all
        (a walk over data ends with the turn; the decoder would judge drafts past its end)."""
        checked = self.draft_steps if checked is None else checked
        self.verify_steps += 1
        self.round_tokens += n_accepted + 1
        for i in range(min(n_accepted + 1, checked)):
            self.reached[i] += 1
        for i in range(n_accepted):
            self.accepted[i] += 1

    def merge(self, o: "ChainStats") -> None:
        self.verify_steps += o.verify_steps
        self.round_tokens += o.round_tokens
        self.target_forwards += o.target_forwards
        self.new_tokens += o.new_tokens
        self.reached = [a + b for a, b in zip(self.reached, o.reached)]
        self.accepted = [a + b for a, b in zip(self.accepted, o.accepted)]

    @property
    def acceptance_length(self) -> float:
        return self.round_tokens / max(self.verify_steps, 1)

    @property
    def rates(self) -> list[float]:
        """Acceptance rate per draft position, given the round reached it (what `eagle3 eval` reports)."""
        return [a / r if r else 0.0 for a, r in zip(self.accepted, self.reached)]

    def as_tensor(self) -> torch.Tensor:
        return torch.tensor([self.verify_steps, self.round_tokens, *self.reached, *self.accepted], dtype=torch.float64)

    @classmethod
    def from_tensor(cls, t: torch.Tensor, draft_steps: int) -> "ChainStats":
        v = [int(round(x)) for x in t.tolist()]
        K = draft_steps
        return cls(K, verify_steps=v[0], round_tokens=v[1], reached=v[2:2 + K], accepted=v[2 + K:2 + 2 * K])


@torch.no_grad()
def draft_hits(drafter, step_outputs, target_argmax: torch.Tensor, chunk_tokens: int = 4096) -> torch.Tensor:
    """hit [B, T, K] bool: step j at position t drafts the target's own next token at t+1+j.

    step_outputs: [m_0..m_{K-1}] each [B, T, H] (ttt_forward); target_argmax [B, T]: the target's FULL-vocab argmax at
    each position (a token outside the draft vocab can never be drafted, so it is a miss, as in decoding).
    Positions past the end are False."""
    B, T = target_argmax.shape
    K = len(step_outputs)
    hits = torch.zeros(B, T, K, dtype=torch.bool, device=target_argmax.device)
    for j, m in enumerate(step_outputs):
        if 1 + j >= T:
            break
        flat = m[:, : T - 1 - j].reshape(B * (T - 1 - j), -1)
        pred = torch.cat([drafter.draft_logits(flat[s:s + chunk_tokens]).argmax(-1)
                          for s in range(0, flat.shape[0], chunk_tokens)])
        pred = drafter.target_ids(pred).view(B, T - 1 - j)
        hits[:, : T - 1 - j, j] = pred == target_argmax[:, 1 + j:].to(pred.dtype)
    return hits


def assistant_turns(loss_mask: torch.Tensor, attention_mask: torch.Tensor | None = None) -> list[tuple[int, int]]:
    """[(start, end)] inclusive spans of consecutive loss-masked real tokens in one row."""
    m = loss_mask.bool()
    if attention_mask is not None:
        m = m & attention_mask.bool()
    m = m.tolist()
    spans, start = [], None
    for i, v in enumerate(m + [False]):
        if v and start is None:
            start = i
        elif not v and start is not None:
            spans.append((start, i - 1))
            start = None
    return spans


def walk(hits: torch.Tensor, loss_mask: torch.Tensor, attention_mask: torch.Tensor | None, draft_steps: int,
         max_new_tokens: int | None = None, first_turn_only: bool = False,
         stats: ChainStats | None = None) -> ChainStats:
    """Replay greedy chain decoding of every assistant turn in a batch (see the module docstring).

    hits [B, T, K'] with K' >= draft_steps; loss_mask / attention_mask [B, T]. max_new_tokens: stop a turn once this
    many tokens (its first token included) are out, as `eagle3 eval --max-new-tokens` does."""
    K = draft_steps
    if hits.shape[-1] < K:
        raise ValueError(f"hits hold {hits.shape[-1]} draft steps, the walk needs {K}")
    stats = stats if stats is not None else ChainStats(K)
    hits = hits[..., :K].cpu()
    for b in range(hits.shape[0]):
        spans = assistant_turns(loss_mask[b], None if attention_mask is None else attention_mask[b])
        for s, e in spans[:1] if first_turn_only else spans:
            if s == 0:
                continue  # no prompt: the decoder never drafts such a turn
            t, produced = s - 1, 1           # the target itself writes the turn's first token (position s)
            while t + 2 <= e and (max_new_tokens is None or produced < max_new_tokens):
                checked = min(K, e - t - 1)  # draft j predicts position t + 2 + j, which must lie in the turn
                row = hits[b, t, :checked].tolist()
                n = row.index(False) if False in row else checked
                stats.add_round(n, checked)
                produced += n + 1
                t += n + 1
    return stats
