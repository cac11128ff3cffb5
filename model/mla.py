"""The MLA layout: SGLang's `Eagle3DeepseekV2ForCausalLM` (sglang/srt/models/kimi_k25_eagle3.py, 0.5.23), the
EAGLE-3 drafter with DeepSeek-V2 multi-latent attention in its one decoder layer (docs/drafters.md).

From the 2H layer input x (cat(input_layernorm(embed), hidden_norm(h)), as in the Llama layout):
    q            = q_b_proj(q_a_layernorm(q_a_proj(x)))        (q_proj(x) when q_lora_rank is None)
                   -> per head [q_nope (qk_nope_head_dim), q_pe (qk_rope_head_dim)]
    c_kv, k_pe   = kv_a_proj_with_mqa(x)                       latent (kv_lora_rank) + ONE shared rope key
    k_nope, v    = kv_b_proj(kv_a_layernorm(c_kv))             per head [k_nope, v (v_head_dim)]
    k            = [k_nope, k_pe]                               (k_pe shared by every head)
    RoPE on q_pe / k_pe only, DeepSeek's convention: the rope dims taken as interleaved pairs (2i, 2i+1) (SGLang's
    is_neox_style=False); YaRN as DeepSeek's (layers.deepseek_rope), softmax scale qk_head_dim^-0.5 x mscale^2.
    o_proj over the heads' v.
What the serving engine caches per token is the latent (c_kv, k_pe): (kv_lora_rank + qk_rope_head_dim) values.
Training materialises per-head keys (qk_nope + qk_rope) and values (v_head_dim); the same attention function.
"""

from __future__ import annotations

import torch
from torch import nn

from eagle3.model.config import DrafterConfig
from eagle3.model.layers import RMSNorm, apply_rope, cos_sin, deepseek_rope, module_norm

ARCHITECTURE = "Eagle3DeepseekV2ForCausalLM"


def attention_shapes(c: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """{key under midlayer.self_attn: shape}."""
    H, nh = c.hidden_size, c.num_attention_heads
    qk = c.qk_nope_head_dim + c.qk_rope_head_dim
    if c.q_lora_rank:
        q = {"q_a_proj.weight": (c.q_lora_rank, 2 * H), "q_a_layernorm.weight": (c.q_lora_rank,),
             "q_b_proj.weight": (nh * qk, c.q_lora_rank)}
    else:
        q = {"q_proj.weight": (nh * qk, 2 * H)}
    return {**q,
            "kv_a_proj_with_mqa.weight": (c.kv_lora_rank + c.qk_rope_head_dim, 2 * H),
            "kv_a_layernorm.weight": (c.kv_lora_rank,),
            "kv_b_proj.weight": (nh * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank),
            "o_proj.weight": (H, nh * c.v_head_dim)}


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """[..., d] with rope pairs at (2i, 2i+1) -> pairs at (i, i + d/2), so that rotate_half RoPE rotates exactly the
    pairs DeepSeek's interleaved RoPE rotates. q and k are permuted alike, so q.k is unchanged by the relayout."""
    *lead, d = x.shape
    return x.reshape(*lead, d // 2, 2).transpose(-1, -2).reshape(*lead, d)


class MLAAttention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.config = cfg
        H, nh = cfg.hidden_size, cfg.num_attention_heads
        self.num_heads = self.num_kv_heads = nh
        self.n_rep = 1
        self.nope, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.qk_dim = self.nope + self.rope_dim
        self.q_lora_rank, self.kv_lora_rank = cfg.q_lora_rank, cfg.kv_lora_rank
        _, self.cos_scale, softmax_mul = deepseek_rope(cfg)
        self.scale = self.qk_dim ** -0.5 * softmax_mul
        if self.q_lora_rank:
            self.q_a_proj = nn.Linear(2 * H, self.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = nn.Linear(self.q_lora_rank, nh * self.qk_dim, bias=False)
        else:
            self.q_proj = nn.Linear(2 * H, nh * self.qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(2 * H, self.kv_lora_rank + self.rope_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, nh * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(nh * self.v_dim, H, bias=False)

    def _q_in(self) -> nn.Linear:
        return self.q_a_proj if self.q_lora_rank else self.q_proj

    def in_weights(self) -> list[torch.Tensor]:
        return [self._q_in().weight, self.kv_a_proj_with_mqa.weight]

    def in_proj(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self._q_in()(x), self.kv_a_proj_with_mqa(x)], dim=-1)

    def rope(self, position_ids: torch.Tensor, dtype: torch.dtype):
        inv_freq, _, _ = deepseek_rope(self.config, position_ids.device)
        return cos_sin(inv_freq, position_ids, dtype, self.cos_scale)

    def split(self, z: torch.Tensor, position_ids: torch.Tensor, norm=module_norm):
        """in_proj output [B, S, .] -> q, k [B, nh, S, qk_nope + qk_rope], v [B, nh, S, v_head_dim]."""
        B, S, _ = z.shape
        nh = self.num_heads
        q_width = self.q_lora_rank or nh * self.qk_dim
        q, kv_a = z.split([q_width, self.kv_lora_rank + self.rope_dim], dim=-1)
        if self.q_lora_rank:
            q = self.q_b_proj(norm(q, self.q_a_layernorm))
        q = q.reshape(B, S, nh, self.qk_dim).transpose(1, 2)
        c_kv, k_pe = kv_a.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(norm(c_kv, self.kv_a_layernorm)).reshape(B, S, nh, self.nope + self.v_dim)
        k_nope, v = kv.transpose(1, 2).split([self.nope, self.v_dim], dim=-1)
        cos, sin = self.rope(position_ids, z.dtype)
        q_pe = apply_rope(deinterleave(q[..., self.nope:]), cos, sin)
        k_pe = apply_rope(deinterleave(k_pe.unsqueeze(1)), cos, sin)               # [B, 1, S, rope]
        q = torch.cat([q[..., :self.nope], q_pe], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(B, nh, S, self.rope_dim)], dim=-1)
        return q, k, v.contiguous()

    def out(self, o: torch.Tensor) -> torch.Tensor:
        """o [B, nh, S, v_head_dim] -> [B, S, H]."""
        B, _, S, _ = o.shape
        return self.o_proj(o.transpose(1, 2).reshape(B, S, self.num_heads * self.v_dim))


ATTENTION = MLAAttention
