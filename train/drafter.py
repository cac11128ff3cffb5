"""The EAGLE-3 drafter: SGLang's `LlamaForCausalLMEagle3`, one decoder layer, parameter names = checkpoint keys.

Structure and forward follow docs/contract.md §6 and §8:

    e = embed_target(token)                       # frozen, the target's own embedding (not exported)
    h = fc(cat(aux_low, aux_mid, aux_high))       # step 0 only; later steps feed back the draft's own m
    x = cat(input_layernorm(e), hidden_norm(h))   # embedding first -> width 2H
    a = o_proj(attention(q, k, v from x))         # causal, RoPE (Llama / neox "rotate_half" convention)
    r = a + h                                     # residual is the UN-normalised h
    m = mlp(post_attention_layernorm(r)) + r
    logits = lm_head(norm(m))                     # draft vocab; next h = m

`state_dict()` minus `embed_tokens.weight` is exactly the key set SGLang loads (docs/contract.md §6);
`tensor_shapes` gives it with the shapes.

Two entry points:
  * `ttt_forward` (= `forward`): the training-time test (docs/contract.md §9), K unrolled steps over whole sequences;
  * `forward_step`: one draft step over a block of new positions with an explicit KV cache, i.e. what inference
    does (prefix extend at step 0, then one token per draft step). Tests prove the two agree.
Logits are not computed by either: `draft_logits(m)` does it, and the loss calls it in chunks.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Sequence

import torch
import torch.utils.checkpoint
import torch.nn.functional as F
from torch import nn

_ACTIVATIONS = {"silu": F.silu}
_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(kw_only=True)
class DrafterConfig:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int            # the TARGET's vocab (embedding rows, t2d length)
    draft_vocab_size: int      # lm_head rows
    target_hidden_size: int
    head_dim: int | None = None  # None -> hidden_size // num_attention_heads (always written out by to_dict)
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    num_aux_layers: int = 3
    hidden_act: str = "silu"

    def __post_init__(self):
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError("head_dim not given and hidden_size is not divisible by num_attention_heads")
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"hidden_act {self.hidden_act!r} not supported (SGLang's Eagle3 drafter uses 'silu')")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} must lie in 1..vocab_size ({self.vocab_size})")
        if self.num_aux_layers < 1:
            raise ValueError("num_aux_layers must be >= 1")
        if self.rope_scaling is not None:
            self.rope_scaling = dict(self.rope_scaling)
            kind = _rope_type(self.rope_scaling)
            if kind not in _ROPE_TYPES:
                raise NotImplementedError(f"rope_scaling type {kind!r} not supported; supported: {_ROPE_TYPES}")

    def to_dict(self) -> dict:
        d = asdict(self)
        if d["rope_scaling"] is not None:
            d["rope_scaling"] = dict(d["rope_scaling"])
        return d

    @classmethod
    def from_dict(cls, d: dict, *, strict: bool = True) -> "DrafterConfig":
        """Inverse of to_dict. strict: unknown keys raise (a typo must not silently become a default)."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown and strict:
            raise ValueError(f"unknown DrafterConfig keys: {unknown}")
        return cls(**{k: v for k, v in d.items() if k in names})


def tensor_shapes(c: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """{checkpoint key: shape} of every tensor SGLang's LlamaForCausalLMEagle3 loads (docs/contract.md §6), in a
    stable order: `Eagle3Drafter(c).export_state_dict()` exactly (tests hold the two together). The exporter
    and the export checks read names and shapes from here."""
    H, I, d = c.hidden_size, c.intermediate_size, c.head_dim
    q, kv = c.num_attention_heads * d, c.num_key_value_heads * d
    return {
        "fc.weight": (H, c.num_aux_layers * c.target_hidden_size),
        "midlayer.input_layernorm.weight": (H,),
        "midlayer.hidden_norm.weight": (H,),
        "midlayer.self_attn.q_proj.weight": (q, 2 * H),
        "midlayer.self_attn.k_proj.weight": (kv, 2 * H),
        "midlayer.self_attn.v_proj.weight": (kv, 2 * H),
        "midlayer.self_attn.o_proj.weight": (H, q),
        "midlayer.post_attention_layernorm.weight": (H,),
        "midlayer.mlp.gate_proj.weight": (I, H),
        "midlayer.mlp.up_proj.weight": (I, H),
        "midlayer.mlp.down_proj.weight": (H, I),
        "norm.weight": (H,),
        "lm_head.weight": (c.draft_vocab_size, H),
        "d2t": (c.draft_vocab_size,),
        "t2d": (c.vocab_size,),
    }


# The key names alone, for checks that have no config at hand (they do not depend on it).
EXPORT_KEYS: tuple[str, ...] = tuple(tensor_shapes(DrafterConfig(
    hidden_size=2, num_attention_heads=1, num_key_value_heads=1, intermediate_size=1, vocab_size=1,
    draft_vocab_size=1, target_hidden_size=1)))


def _rope_type(rope_scaling: dict | None) -> str:
    if not rope_scaling:
        return "default"
    return rope_scaling.get("rope_type", rope_scaling.get("type", "default"))


def rope_inv_freq(cfg: DrafterConfig, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """[head_dim // 2] inverse frequencies, Llama convention, with 'linear' or 'llama3' rope_scaling."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64, device=device) / d))
    kind = _rope_type(cfg.rope_scaling)
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


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, S, d]; cos/sin [B, S, d]."""
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[B, kv_heads, S, d] -> [B, kv_heads * n_rep, S, d]; query head h uses kv head h // n_rep (as HF/SGLang)."""
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


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


class Eagle3Attention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.n_rep = self.num_heads // self.num_kv_heads
        self.scale = self.head_dim ** -0.5
        self.q_proj = nn.Linear(2 * cfg.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [B, S, 2H] -> q [B, nh, S, d], k/v [B, nkv, S, d]; RoPE applied to q and k."""
        B, S, _ = x.shape
        q = self.q_proj(x).view(B, S, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, S, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, S, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def out(self, o: torch.Tensor) -> torch.Tensor:
        """o [B, nh, S, d] -> [B, S, H]."""
        B, _, S, _ = o.shape
        return self.o_proj(o.transpose(1, 2).reshape(B, S, self.num_heads * self.head_dim))


class Eagle3MLP(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act = _ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Eagle3MidLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Eagle3Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = Eagle3MLP(cfg)

    def attn_input(self, e: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """cat(input_layernorm(embedding), hidden_norm(h)): embedding first."""
        return torch.cat([self.input_layernorm(e), self.hidden_norm(h)], dim=-1)

    def finish(self, a: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """a = attention output (after o_proj); residual is the un-normalised h."""
        r = a + h
        return self.mlp(self.post_attention_layernorm(r)) + r


def attention_causal_plus_diagonal(q, k0, v0, diag_k: Sequence[torch.Tensor], diag_v: Sequence[torch.Tensor],
                                   scale: float, prefix: tuple[torch.Tensor, torch.Tensor] | None = None
                                   ) -> torch.Tensor:
    """softmax attention of query t over {k0[s] : s <= t} U {diag_k[i][t] : all i}, without a [T, (1+j)T] mask.
    prefix (k, v) [B, nkv, P, d]: keys every query sees besides those (sequence parallel: the step-0 keys of the
    positions before this rank's chunk); their mass is merged through the same sink key as the diagonal's.

    q [B, nh, T, d]; k0, v0, diag_k[i], diag_v[i] [B, nkv, T, d] (nh a multiple of nkv). Returns [B, nh, T, d].

    The diagonal keys are one per query, so their scores s_i[t] = scale * q[t].k_i[t] are elementwise. Their
    softmax mass is merged into one causal SDPA call through a per-query "sink" key: every query gets an extra
    key (prepended, so causally visible to all) whose score is exactly lse_d[t] = logsumexp_i s_i[t], and whose
    value is an indicator column. SDPA's output in that column is p_sink[t] = exp(lse_d) / (Z0 + exp(lse_d)),
    the share of the total mass that falls on the diagonal; its regular columns are the step-0 part already
    divided by the full normaliser. So out = sdpa[..., :d] + p_sink * softmax_i(s_i) @ v_i, exactly, stable,
    differentiable, and in one (flash-capable) causal kernel call.
    The per-query score is injected through extra head dims: q' = [q, a_hi, a_lo, 0..], sink key = [0, 1, 1, 0..]
    with a_hi + a_lo = lse_d / scale (a hi/lo split so bf16 q' carries lse_d to ~16 bits; measured
    accuracy in bf16 matches plain dense-mask bf16 attention).
    """
    B, nh, T, d = q.shape
    n_rep = nh // k0.shape[1]
    dtype = q.dtype
    acc = torch.promote_types(dtype, torch.float32)

    parts = []  # (lse [B, nh, T], out [B, nh, T, d]) of every key set outside the causal block
    if len(diag_k):
        dk = repeat_kv(torch.stack(list(diag_k), dim=2), n_rep)  # [B, nh, j, T, d]
        dv = repeat_kv(torch.stack(list(diag_v), dim=2), n_rep)
        s = torch.einsum("bhtd,bhitd->bhit", q.to(acc), dk.to(acc)) * scale  # [B, nh, j, T]
        parts.append((torch.logsumexp(s, dim=2), torch.einsum("bhit,bhitd->bhtd", torch.softmax(s, dim=2), dv.to(acc))))
    if prefix is not None and prefix[0].shape[2] > 0:
        s = torch.einsum("bhtd,bhpd->bhtp", q.to(acc), repeat_kv(prefix[0], n_rep).to(acc)) * scale  # [B, nh, T, P]
        parts.append((torch.logsumexp(s, dim=-1),
                      torch.einsum("bhtp,bhpd->bhtd", torch.softmax(s, dim=-1), repeat_kv(prefix[1], n_rep).to(acc))))
    if not parts:
        return F.scaled_dot_product_attention(q, repeat_kv(k0, n_rep), repeat_kv(v0, n_rep), is_causal=True,
                                              scale=scale)
    lse_d = torch.logsumexp(torch.stack([lse for lse, _ in parts]), dim=0)  # [B, nh, T]
    o_d = sum(torch.exp(lse - lse_d).unsqueeze(-1) * o for lse, o in parts)  # [B, nh, T, d]

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
    vx = v0.new_zeros(B, nkv, T + 1, d + pad)
    vx[:, :, 1:, :d] = v0
    vx[:, :, 0, d] = 1
    o = F.scaled_dot_product_attention(qx, repeat_kv(kx, n_rep), repeat_kv(vx, n_rep), is_causal=True,
                                       scale=scale)[:, :, 1:]
    return (o[..., :d].to(acc) + o[..., d:d + 1].to(acc) * o_d).to(dtype)


class Eagle3Drafter(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.config = config
        c = config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(c.num_aux_layers * c.target_hidden_size, c.hidden_size, bias=False)
        self.midlayer = Eagle3MidLayer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        # Default map: the first draft_vocab_size target ids (identity); set_vocab_map installs the real one.
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.int64))
        t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
        t2d[: c.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)
        self.activation_checkpointing = "none"  # run-time switch (trainer's --activation-checkpointing): none/mlp/step

    # ---------------------------------------------------------------- setup

    def set_vocab_map(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        """Install the draft vocab map (target_id = draft_id + d2t[draft_id]; t2d[target_id] marks draft ids)."""
        c = self.config
        d2t = torch.as_tensor(d2t).to(torch.int64).cpu()
        t2d = torch.as_tensor(t2d).to(torch.bool).cpu()
        if d2t.shape != (c.draft_vocab_size,) or t2d.shape != (c.vocab_size,):
            raise ValueError(f"vocab map shapes d2t {tuple(d2t.shape)}, t2d {tuple(t2d.shape)}; expected "
                             f"({c.draft_vocab_size},), ({c.vocab_size},)")
        from eagle3.data.vocab import vocab_map_problem
        problem = vocab_map_problem(d2t, t2d)
        if problem:
            raise ValueError(problem)
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    @torch.no_grad()
    def load_target_embedding(self, weight: torch.Tensor) -> None:
        """Copy the target's input embedding [vocab_size, hidden_size] into the frozen embed_tokens."""
        if tuple(weight.shape) != tuple(self.embed_tokens.weight.shape):
            raise ValueError(f"target embedding {tuple(weight.shape)} does not fit the drafter's "
                             f"{tuple(self.embed_tokens.weight.shape)} (vocab_size, hidden_size)")
        self.embed_tokens.weight.copy_(weight)
        self.embed_tokens.weight.requires_grad_(False)

    @torch.no_grad()
    def load_target_head(self, lm_head: torch.Tensor, final_norm: torch.Tensor) -> None:
        """Start the draft head where the target's is: lm_head rows of the draft vocab (draft id i -> target id
        i + d2t[i], so set_vocab_map first) and the target's final norm: the drafter begins in the target's own
        output space. An option (--init-head target), not the default: on the CPU example it held out worse than a
        random head at equal steps (bench/quality.md)."""
        c = self.config
        if tuple(lm_head.shape) != (c.vocab_size, c.hidden_size) or tuple(final_norm.shape) != (c.hidden_size,):
            raise ValueError(f"target lm_head {tuple(lm_head.shape)} / final norm {tuple(final_norm.shape)} do not fit "
                             f"the drafter's (vocab_size, hidden_size) = ({c.vocab_size}, {c.hidden_size}); "
                             "train with --init-head random")
        ids = self.target_ids(torch.arange(c.draft_vocab_size, device=self.d2t.device))
        self.lm_head.weight.copy_(lm_head[ids.to(lm_head.device)])
        self.norm.weight.copy_(final_norm)

    def export_state_dict(self) -> dict[str, torch.Tensor]:
        """The tensors SGLang loads (docs/contract.md §6), i.e. state_dict() minus embed_tokens."""
        sd = self.state_dict()
        return {k: sd[k] for k in EXPORT_KEYS}

    # ---------------------------------------------------------------- pieces

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def project_aux(self, aux: torch.Tensor) -> torch.Tensor:
        """[..., num_aux * target_hidden] -> h [..., hidden] (step 0 input)."""
        return self.fc(aux.to(self.dtype))

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(token_ids).to(self.dtype)

    def rope_cos_sin(self, position_ids: torch.Tensor, dtype: torch.dtype):
        """position_ids [B, S] -> cos, sin [B, S, head_dim], computed in fp32 (fp64 for an fp64 model)."""
        acc = torch.promote_types(dtype, torch.float32)
        inv_freq = rope_inv_freq(self.config, acc, position_ids.device)
        ang = position_ids.to(acc)[..., None] * inv_freq
        emb = torch.cat([ang, ang], dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft ids -> target ids, SGLang's rule: target_id = draft_id + d2t[draft_id] (docs/contract.md)."""
        d2t = self.d2t.to(draft_ids.device)
        return draft_ids + d2t[draft_ids]

    def draft_logits(self, m: torch.Tensor) -> torch.Tensor:
        """lm_head(norm(m)) over the draft vocab."""
        return self.lm_head(self.norm(m))

    # ---------------------------------------------------------------- inference-style step

    def forward_step(self, h: torch.Tensor, token_ids: torch.Tensor, position_ids: torch.Tensor,
                     past_kv: tuple[torch.Tensor, torch.Tensor] | None = None):
        """One draft step over S new positions with a KV cache.

        h [B, S, H] (project_aux(aux) at step 0, else the previous step's m), token_ids [B, S] (for step 0, the
        token one position ahead of the aux state), position_ids [B, S]. past_kv: (k, v) [B, nkv, P, d] with RoPE
        applied. New query s sees every cached key and new keys <= s. No padding support (single sequences or
        equal lengths). Returns (m [B, S, H], (k, v) cache extended by the S new keys).
        """
        attn = self.midlayer.self_attn
        h = h.to(self.dtype)
        x = self.midlayer.attn_input(self.embed(token_ids), h)
        cos, sin = self.rope_cos_sin(position_ids, x.dtype)
        q, k, v = attn.qkv(x, cos, sin)
        if past_kv is not None:
            k = torch.cat([past_kv[0], k], dim=2)
            v = torch.cat([past_kv[1], v], dim=2)
        S, P = q.shape[2], k.shape[2] - q.shape[2]
        kr, vr = repeat_kv(k, attn.n_rep), repeat_kv(v, attn.n_rep)
        if P == 0:
            o = F.scaled_dot_product_attention(q, kr, vr, is_causal=True, scale=attn.scale)
        elif S == 1:
            o = F.scaled_dot_product_attention(q, kr, vr, scale=attn.scale)
        else:
            mask = torch.ones(S, P + S, dtype=torch.bool, device=q.device).tril(diagonal=P)
            o = F.scaled_dot_product_attention(q, kr, vr, attn_mask=mask, scale=attn.scale)
        m = self.midlayer.finish(attn.out(o), h)
        return m, (k, v)

    # ---------------------------------------------------------------- training-time test

    def ttt_forward(self, hidden_state: torch.Tensor, input_ids: torch.Tensor,
                    attention_mask: torch.Tensor | None = None, steps: int = 7,
                    position_ids: torch.Tensor | None = None, fast: bool = False,
                    prefix_kv=None) -> list[torch.Tensor]:
        """Unroll `steps` draft steps over whole sequences (docs/contract.md §9).
        Returns [m_0, ..., m_{K-1}], each [B, T, H].

        hidden_state [B, T, num_aux * Ht] (aux states, ascending HF index), input_ids [B, T], attention_mask [B, T]
        (1 real, 0 right padding; None = all real), position_ids [B, T] (default arange).
        Step j at position t: token input_ids[t + 1 + j] (0 past the end), h = fc(aux[t]) at j = 0 else m_{j-1}[t],
        RoPE position t + j; attends to step-0 keys at positions <= t and to the step-1..j keys at position t.
        With right padding, causality alone keeps real queries off padded keys; outputs at padded positions are
        finite but meaningless (the loss masks them).
        fast: the same function through train/kernels.py (flash attention + log-sum-exp merge, lean norms, the
        embedding half of q/k/v projected once for all steps). It reads weights directly, so not under ZeRO-3.
        prefix_kv: sequence parallel (train/sequence_parallel.py): a function of this chunk's step-0 keys and
        values (k0, v0) [B, nkv, T, d] returning (k0, v0, (k, v) of every position before the chunk, which all its
        queries also attend to); input_ids then starts at position_ids[:, 0] and carries the next chunk's first
        tokens.
        """
        if steps < 1:
            raise ValueError("steps must be >= 1")
        B, T = input_ids.shape
        if attention_mask is not None:
            am = attention_mask.to(torch.bool)
            if T > 1 and bool((am[:, 1:] & ~am[:, :-1]).any()):
                raise ValueError("ttt_forward expects right padding (attention_mask of the form 1..1 0..0)")
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device).expand(B, T)
        if fast:
            from eagle3.train.kernels import flash_supported
            # fp32 training or an odd head_dim on a GPU: the plain path (same function) instead of a kernel error
            fast = flash_supported(input_ids.device, self.dtype, self.config.head_dim)
        if fast:
            return self._ttt_fast(hidden_state, input_ids, position_ids, steps, prefix_kv)
        attn = self.midlayer.self_attn
        h = self.project_aux(hidden_state)
        outs: list[torch.Tensor] = []
        k0 = v0 = None
        diag_k: list[torch.Tensor] = []
        diag_v: list[torch.Tensor] = []
        for j in range(steps):
            tok = input_ids.new_zeros(B, T)
            if 1 + j < T:
                tok[:, : T - 1 - j] = input_ids[:, 1 + j:]
            x = self.midlayer.attn_input(self.embed(tok), h)
            cos, sin = self.rope_cos_sin(position_ids + j, x.dtype)
            q, k, v = attn.qkv(x, cos, sin)
            if j == 0:
                k0, v0, prefix = prefix_kv(k, v) if prefix_kv is not None else (k, v, None)
            else:
                diag_k.append(k)
                diag_v.append(v)
            o = attention_causal_plus_diagonal(q, k0, v0, diag_k, diag_v, attn.scale, prefix)
            if self.checkpointing != "none" and torch.is_grad_enabled():
                # Recompute the MLP (its [T, intermediate] activations dominate memory) in backward.
                m = torch.utils.checkpoint.checkpoint(self.midlayer.finish, attn.out(o), h, use_reentrant=False)
            else:
                m = self.midlayer.finish(attn.out(o), h)
            outs.append(m)
            h = m
        return outs

    @property
    def checkpointing(self) -> str:
        return checkpointing_mode(self.activation_checkpointing)

    def _ttt_fast(self, hidden_state, input_ids, position_ids, steps: int, prefix_kv=None) -> list[torch.Tensor]:
        from eagle3.train.kernels import causal_plus_diagonal, rms_norm, silu_mul
        c, ml = self.config, self.midlayer
        attn = ml.self_attn
        B, T = input_ids.shape
        H, nh, nkv, d, eps = c.hidden_size, attn.num_heads, attn.num_kv_heads, attn.head_dim, c.rms_norm_eps
        mode = self.checkpointing if torch.is_grad_enabled() else "none"
        # x = cat(norm(embed(token)), norm(h)) @ W^T = E + norm(h) @ W_h^T. Step j reads token t+1+j, i.e. the
        # same embedding rows shifted by j, so E is projected once for all steps (saves half of q/k/v in steps >= 1).
        w_qkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
        w_e, w_h = w_qkv[:, :H], w_qkv[:, H:]
        tok = torch.cat([input_ids[:, 1:], input_ids.new_zeros(B, steps)], dim=1)         # [B, T - 1 + K]
        e_qkv = rms_norm(self.embed(tok), ml.input_layernorm.weight, eps) @ w_e.T
        w_gu = torch.cat([ml.mlp.gate_proj.weight, ml.mlp.up_proj.weight])

        def gate_up(n2):
            return silu_mul(n2 @ w_gu.T)

        def mlp(n2):
            return ml.mlp.down_proj(gate_up(n2))

        def project(j, h):  # step j's q, k, v (RoPE applied)
            qkv = e_qkv[:, j:j + T] + rms_norm(h, ml.hidden_norm.weight, eps) @ w_h.T
            q, k, v = qkv.split([nh * d, nkv * d, nkv * d], dim=-1)
            cos, sin = self.rope_cos_sin(position_ids + j, qkv.dtype)
            q = apply_rope(q.view(B, T, nh, d).transpose(1, 2), cos, sin)
            k = apply_rope(k.view(B, T, nkv, d).transpose(1, 2), cos, sin)
            # v alone would keep the whole fused qkv alive (a view of it) for as long as later steps read it: 3x its
            # size in every step's saved keys, 29 GiB over 7 steps of 131,072 tokens at the Kimi shape
            return q, k, v.contiguous().view(B, T, nkv, d).transpose(1, 2)

        def step(j, h, k0, v0, dks, dvs, qkv0=None, kp=None, vp=None):
            q, k, v = qkv0 if qkv0 is not None else project(j, h)
            if j == 0:
                k0, v0 = k, v
            # step j's diagonal keys: steps 1..j at the same position (keys[0] is the causal block)
            o = causal_plus_diagonal(q, k0, v0, [*dks[1:], k] if j else [], [*dvs[1:], v] if j else [], attn.scale,
                                     (kp, vp) if kp is not None else None)
            r = attn.out(o) + h
            n2 = rms_norm(r, ml.post_attention_layernorm.weight, eps)
            if mode == "step_mlp":  # the MLP over token chunks, each recomputed in its own backward
                rows = max(1, MLP_CHUNK_TOKENS // n2.shape[0])
                return torch.cat([torch.utils.checkpoint.checkpoint(mlp, c, use_reentrant=False)
                                  for c in n2.split(rows, dim=1)], dim=1) + r, k, v
            z = torch.utils.checkpoint.checkpoint(gate_up, n2, use_reentrant=False) if mode == "mlp" else gate_up(n2)
            return ml.mlp.down_proj(z) + r, k, v

        h = self.project_aux(hidden_state)
        outs, keys, values = [], [], []
        qkv0 = kp = vp = None
        if prefix_kv is not None:
            # Sequence parallel: step 0's keys go through the group's collective, which must run once per forward
            # on every rank, so step 0 is projected here, outside the steps that 'step' checkpointing recomputes.
            q0, k0, v0 = project(0, h)
            k0, v0, (kp, vp) = prefix_kv(k0, v0)
            qkv0 = (q0, k0, v0)
        for j in range(steps):
            args = (j, h, keys[0] if keys else None, values[0] if values else None, tuple(keys), tuple(values),
                    qkv0 if j == 0 else None, kp, vp)
            if mode in ("step", "step_mlp"):
                h, k, v = torch.utils.checkpoint.checkpoint(step, *args, use_reentrant=False)
            else:
                h, k, v = step(*args)
            keys.append(k)
            values.append(v)
            outs.append(h)
        return outs

    def forward(self, hidden_state, input_ids, attention_mask=None, steps: int = 7, position_ids=None,
                fast: bool = False, prefix_kv=None):
        return self.ttt_forward(hidden_state, input_ids, attention_mask, steps, position_ids, fast, prefix_kv)
