"""The Llama layout: SGLang's `LlamaForCausalLMEagle3` (the original EAGLE-3 drafter, and EAGLE-3.1 with its options).

Attention: q/k/v projections of the 2H layer input, GQA, RoPE over the whole head (Llama's rotate_half convention,
with 'linear' / 'llama3' scaling). Checkpoint keys under `midlayer.self_attn.`: q_proj, k_proj, v_proj, o_proj.
"""

from __future__ import annotations

import torch
from torch import nn

from eagle3.model.config import DrafterConfig
from eagle3.model.layers import apply_rope, cos_sin, llama_inv_freq, module_norm

ARCHITECTURE = "LlamaForCausalLMEagle3"


def attention_shapes(c: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """{key under midlayer.self_attn: shape}."""
    H, d = c.hidden_size, c.head_dim
    q, kv = c.num_attention_heads * d, c.num_key_value_heads * d
    return {"q_proj.weight": (q, 2 * H), "k_proj.weight": (kv, 2 * H), "v_proj.weight": (kv, 2 * H),
            "o_proj.weight": (H, q)}


class LlamaAttention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.config = cfg
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.n_rep = self.num_heads // self.num_kv_heads
        self.qk_dim = self.v_dim = self.head_dim
        self.scale = self.head_dim ** -0.5
        self.q_proj = nn.Linear(2 * cfg.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)

    # The layer input x [B, S, 2H] enters only through in_proj's linears (their rows stacked in in_weights' order);
    # the fast path projects the embedding half of x once for all steps with those weights and calls `split`.
    def in_weights(self) -> list[torch.Tensor]:
        return [self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]

    def in_proj(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)

    def rope(self, position_ids: torch.Tensor, dtype: torch.dtype):
        return cos_sin(llama_inv_freq(self.config, torch.float64, position_ids.device), position_ids, dtype)

    def split(self, z: torch.Tensor, position_ids: torch.Tensor, norm=module_norm):
        """in_proj output [B, S, .] -> q [B, nh, S, d], k / v [B, nkv, S, d], RoPE applied to q and k (`norm`: the
        layout interface's way of applying norms; this layout has none after its projections)."""
        B, S, _ = z.shape
        nh, nkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = z.split([nh * d, nkv * d, nkv * d], dim=-1)
        cos, sin = self.rope(position_ids, z.dtype)
        q = apply_rope(q.reshape(B, S, nh, d).transpose(1, 2), cos, sin)
        k = apply_rope(k.reshape(B, S, nkv, d).transpose(1, 2), cos, sin)
        # v alone would keep the whole fused projection alive (a view of it) for as long as later steps read it:
        # 3x its size in every step's saved keys, 29 GiB over 7 steps of 131,072 tokens at the Kimi shape
        return q, k, v.contiguous().view(B, S, nkv, d).transpose(1, 2)

    def out(self, o: torch.Tensor) -> torch.Tensor:
        """o [B, nh, S, d] -> [B, S, H]."""
        B, _, S, _ = o.shape
        return self.o_proj(o.transpose(1, 2).reshape(B, S, self.num_heads * self.head_dim))


ATTENTION = LlamaAttention
