"""Pieces every drafter layout shares: RMSNorm, the SiLU MLP, RoPE (Llama's and DeepSeek's YaRN), and the plain
(reference-speed, any dtype, ZeRO-3-safe) training-time-test attention. The fast path's versions are in kernels.py."""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from eagle3.model.config import DrafterConfig, rope_type

CHECKPOINTING = ("none", "mlp", "step", "step_mlp")
# 'step_mlp': tokens per MLP chunk. At 131,072 tokens and the Kimi shape the whole gate/up gradient alone is 9 GiB
# ([T, 2 x 18432] bf16), which is where one H200 ran out of memory under 'step' (bench/RESULTS.md).
MLP_CHUNK_TOKENS = 16384


def checkpointing_mode(value) -> str:
    """'none', 'mlp' (recompute gate/up in backward), 'step' (recompute whole TTT steps) or 'step_mlp' (whole steps,
    and within each the MLP over chunks of MLP_CHUNK_TOKENS tokens, each chunk recomputed in its own backward: no
    [T, 2 x intermediate] tensor at any point, for one more gate/up matmul; least memory); the booleans of the older
    switch (True = 'mlp') are accepted."""
    a = {True: "mlp", False: "none", None: "none", "true": "mlp", "false": "none"}.get(value, value)
    if a not in CHECKPOINTING:
        raise ValueError(f"activation_checkpointing must be one of {', '.join(CHECKPOINTING)}; got {value!r}")
    return a


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.to(torch.promote_types(dtype, torch.float32))
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


def module_norm(x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
    """The plain path's way of applying a norm (a module call: ZeRO-3 gathers its weight); kernels.lean_norm is the
    fast path's, with the same signature."""
    return norm(x)


class Eagle3MLP(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


# ------------------------------------------------------------------------------------------------ RoPE

def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, S, d]; cos/sin [B, S, d]. Pairs (i, i + d/2) rotate together (neox / rotate_half)."""
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


def llama_inv_freq(cfg: DrafterConfig, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """[head_dim // 2] inverse frequencies, Llama convention, with 'linear' or 'llama3' rope_scaling."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64, device=device) / d))
    kind = rope_type(cfg.rope_scaling)
    rs = cfg.rope_scaling or {}
    if kind == "linear":
        inv_freq = inv_freq / rs["factor"]
    elif kind == "llama3":
        factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
        old_ctx = rs.get("original_max_position_embeddings", cfg.max_position_embeddings)
        low_freq_wavelen, high_freq_wavelen = old_ctx / lo, old_ctx / hi
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq.to(dtype)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """DeepSeek's YaRN attention-temperature factor."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def deepseek_rope(cfg: DrafterConfig, device=None) -> tuple[torch.Tensor, float, float]:
    """(inv_freq [rope_dim // 2] float64, cos/sin multiplier, softmax-scale multiplier) of DeepSeek's rotary
    embedding over the qk_rope_head_dim dims: plain RoPE, or YaRN ('yarn' / 'deepseek_yarn': frequencies blended
    between extrapolation and interpolation over the correction range of beta_fast/beta_slow; cos/sin scaled by
    mscale(factor, mscale) / mscale(factor, mscale_all_dim); the softmax scale by mscale(factor, mscale_all_dim)^2)."""
    d, base = cfg.qk_rope_head_dim, cfg.rope_theta
    pos_freqs = base ** (torch.arange(0, d, 2, dtype=torch.float64, device=device) / d)
    if rope_type(cfg.rope_scaling) == "default":
        return 1.0 / pos_freqs, 1.0, 1.0
    rs = cfg.rope_scaling
    factor = float(rs["factor"])
    orig = rs.get("original_max_position_embeddings", 4096)
    beta_fast, beta_slow = rs.get("beta_fast", 32), rs.get("beta_slow", 1)

    def correction_dim(rotations):
        return d * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))
    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), d - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(d // 2, dtype=torch.float64, device=device) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1.0 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    m, m_all = rs.get("mscale", 1.0), rs.get("mscale_all_dim", 0.0)
    cos_scale = yarn_mscale(factor, m) / yarn_mscale(factor, m_all)
    softmax_scale = yarn_mscale(factor, m_all) ** 2 if m_all else 1.0
    return inv_freq, cos_scale, softmax_scale


def cos_sin(inv_freq: torch.Tensor, position_ids: torch.Tensor, dtype: torch.dtype, scale: float = 1.0):
    """position_ids [B, S] -> cos, sin [B, S, 2 * len(inv_freq)] (halves repeated, rotate_half layout), computed in
    fp32 (fp64 for an fp64 model), times `scale`."""
    acc = torch.promote_types(dtype, torch.float32)
    ang = position_ids.to(acc)[..., None] * inv_freq.to(device=position_ids.device, dtype=acc)
    emb = torch.cat([ang, ang], dim=-1)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[B, kv_heads, S, d] -> [B, kv_heads * n_rep, S, d]; query head h uses kv head h // n_rep (as HF/SGLang)."""
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


# ------------------------------------------------------------------------------------------------ attention

def attention_causal_plus_diagonal(q, k0, v0, diag_k: Sequence[torch.Tensor], diag_v: Sequence[torch.Tensor],
                                   scale: float, prefix: tuple[torch.Tensor, torch.Tensor] | None = None
                                   ) -> torch.Tensor:
    """softmax attention of query t over {k0[s] : s <= t} U {diag_k[i][t] : all i}, without a [T, (1+j)T] mask.
    prefix (k, v) [B, nkv, P, .]: keys every query sees besides those (sequence parallel: the step-0 keys of the
    positions before this rank's chunk); their mass is merged through the same sink key as the diagonal's.

    q [B, nh, T, d]; k0, diag_k[i] [B, nkv, T, d]; v0, diag_v[i] [B, nkv, T, dv] (nh a multiple of nkv; dv may
    differ from d, as in MLA). Returns [B, nh, T, dv].

    The diagonal keys are one per query, so their scores s_i[t] = scale * q[t].k_i[t] are elementwise. Their
    softmax mass is merged into one causal SDPA call through a per-query "sink" key: every query gets an extra
    key (prepended, so causally visible to all) whose score is exactly lse_d[t] = logsumexp_i s_i[t], and whose
    value is an indicator column. SDPA's output in that column is p_sink[t] = exp(lse_d) / (Z0 + exp(lse_d)),
    the share of the total mass that falls on the diagonal; its regular columns are the step-0 part already
    divided by the full normaliser. So out = sdpa[..., :dv] + p_sink * softmax_i(s_i) @ v_i, exactly, stable,
    differentiable, and in one (flash-capable) causal kernel call.
    The per-query score is injected through extra head dims: q' = [q, a_hi, a_lo, 0..], sink key = [0, 1, 1, 0..]
    with a_hi + a_lo = lse_d / scale (a hi/lo split so bf16 q' carries lse_d to ~16 bits; measured
    accuracy in bf16 matches plain dense-mask bf16 attention).
    """
    B, nh, T, d = q.shape
    dv = v0.shape[-1]
    n_rep = nh // k0.shape[1]
    dtype = q.dtype
    acc = torch.promote_types(dtype, torch.float32)

    parts = []  # (lse [B, nh, T], out [B, nh, T, dv]) of every key set outside the causal block
    if len(diag_k):
        dk = repeat_kv(torch.stack(list(diag_k), dim=2), n_rep)  # [B, nh, j, T, d]
        dvs = repeat_kv(torch.stack(list(diag_v), dim=2), n_rep)
        s = torch.einsum("bhtd,bhitd->bhit", q.to(acc), dk.to(acc)) * scale  # [B, nh, j, T]
        parts.append((torch.logsumexp(s, dim=2), torch.einsum("bhit,bhitd->bhtd", torch.softmax(s, dim=2),
                                                              dvs.to(acc))))
    if prefix is not None and prefix[0].shape[2] > 0:
        s = torch.einsum("bhtd,bhpd->bhtp", q.to(acc), repeat_kv(prefix[0], n_rep).to(acc)) * scale  # [B, nh, T, P]
        parts.append((torch.logsumexp(s, dim=-1),
                      torch.einsum("bhtp,bhpd->bhtd", torch.softmax(s, dim=-1), repeat_kv(prefix[1], n_rep).to(acc))))
    if not parts:
        return F.scaled_dot_product_attention(q, repeat_kv(k0, n_rep), repeat_kv(v0, n_rep), is_causal=True,
                                              scale=scale)
    lse_d = torch.logsumexp(torch.stack([lse for lse, _ in parts]), dim=0)  # [B, nh, T]
    o_d = sum(torch.exp(lse - lse_d).unsqueeze(-1) * o for lse, o in parts)  # [B, nh, T, dv]

    pad = 8  # extra head dims (keeps d + pad a multiple of 8 when d is)
    a = lse_d / scale
    a_hi = a.to(dtype)
    a_lo = (a - a_hi.to(acc)).to(dtype)
    qx = q.new_zeros(B, nh, T + 1, d + pad)
    qx[:, :, 1:, :d] = q
    qx[:, :, 1:, d] = a_hi
    qx[:, :, 1:, d + 1] = a_lo
    nkv = k0.shape[1]
    kx = k0.new_zeros(B, nkv, T + 1, d + pad)
    kx[:, :, 1:, :d] = k0
    kx[:, :, 0, d] = 1
    kx[:, :, 0, d + 1] = 1
    vx = v0.new_zeros(B, nkv, T + 1, dv + pad)
    vx[:, :, 1:, :dv] = v0
    vx[:, :, 0, dv] = 1
    o = F.scaled_dot_product_attention(qx, repeat_kv(kx, n_rep), repeat_kv(vx, n_rep), is_causal=True,
                                       scale=scale)[:, :, 1:]
    return (o[..., :dv].to(acc) + o[..., dv:dv + 1].to(acc) * o_d).to(dtype)


def cached_attention(q, k, v, scale: float) -> torch.Tensor:
    """Inference attention over a KV cache: q [B, nh, S, d] are the LAST S positions of k [B, nh, P + S, d] /
    v [B, nh, P + S, dv]; query s sees every cached key and the new keys <= s."""
    S, P = q.shape[2], k.shape[2] - q.shape[2]
    if P == 0:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    if S == 1:
        return F.scaled_dot_product_attention(q, k, v, scale=scale)
    mask = torch.ones(S, P + S, dtype=torch.bool, device=q.device).tril(diagonal=P)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
