"""The EAGLE-3 drafter, every layout behind one interface; parameter names = the checkpoint keys SGLang loads.

Structure and forward follow docs/contract.md §6 and §8, with the EAGLE-3.1 options of docs/drafters.md:

    e = embed_target(token)                       # frozen, the target's own embedding (not exported)
    a_i = fc_norm[i](aux_i)   (fc_norm)           # or input_norm over cat(aux) (norm_before_fc), or aux as is
    h = fc(cat(a_low, a_mid, a_high))             # step 0 only; later steps feed back the draft's own output
    x = cat(input_layernorm(e), hidden_norm(h))   # embedding first -> width 2H
    a = o_proj(attention(q, k, v from x))         # causal; the layout's attention (llama.py, mla.py)
    r = a + h                                     # residual is the UN-normalised h
    m = mlp(post_attention_layernorm(r)) + r
    out = norm(m) if norm_output else m           # what the next step receives
    logits = lm_head(out if norm_output else norm(m))

`state_dict()` minus `embed_tokens.weight` is exactly the key set SGLang loads; `tensor_shapes` gives it with the
shapes. The layout (llama.py, mla.py) gives the attention module and its keys.

Two entry points:
  * `ttt_forward` (= `forward`): the training-time test (docs/contract.md §9), K unrolled steps over whole sequences;
  * `forward_step`: one draft step over a block of new positions with an explicit KV cache, i.e. what inference
    does (prefix extend at step 0, then one token per draft step). Tests prove the two agree.
Logits are not computed by either: `draft_logits(out)` does it, and the loss calls it in chunks.
"""

from __future__ import annotations

import torch
import torch.utils.checkpoint
from torch import nn

import eagle3.model.llama as llama
import eagle3.model.mla as mla
from eagle3.model.config import DrafterConfig
from eagle3.model.kernels import causal_plus_diagonal, flash_supported, lean_norm, rms_norm, silu_mul
from eagle3.model.layers import (MLP_CHUNK_TOKENS, Eagle3MLP, RMSNorm, attention_causal_plus_diagonal,
                                 cached_attention, checkpointing_mode, module_norm, repeat_kv)
from eagle3.vocab_map import vocab_map_problem

LAYOUT_MODULES = {"llama": llama, "mla": mla}  # each: ARCHITECTURE, ATTENTION, attention_shapes


def architecture(c: DrafterConfig) -> str:
    """The SGLang model class that serves this drafter (config.json's `architectures`)."""
    return LAYOUT_MODULES[c.layout].ARCHITECTURE


def tensor_shapes(c: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """{checkpoint key: shape} of every tensor SGLang's class for this layout loads, in a stable order:
    `Eagle3Drafter(c).export_state_dict()` exactly (tests hold the two together). The exporter and the export
    checks read names and shapes from here."""
    H, I, Ht, n = c.hidden_size, c.intermediate_size, c.target_hidden_size, c.num_aux_layers
    pre: dict[str, tuple[int, ...]] = {}
    if c.fc_norm:
        pre = {f"fc_norm.{i}.weight": (Ht,) for i in range(n)}
    elif c.norm_before_fc:
        pre = {"input_norm.weight": (n * Ht,)}
    attn = {f"midlayer.self_attn.{k}": s for k, s in LAYOUT_MODULES[c.layout].attention_shapes(c).items()}
    return {
        **pre,
        "fc.weight": (H, n * Ht),
        "midlayer.input_layernorm.weight": (H,),
        "midlayer.hidden_norm.weight": (H,),
        **attn,
        "midlayer.post_attention_layernorm.weight": (H,),
        "midlayer.mlp.gate_proj.weight": (I, H),
        "midlayer.mlp.up_proj.weight": (I, H),
        "midlayer.mlp.down_proj.weight": (H, I),
        "norm.weight": (H,),
        "lm_head.weight": (c.draft_vocab_size, H),
        "d2t": (c.draft_vocab_size,),
        "t2d": (c.vocab_size,),
    }


class Eagle3MidLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig, attention: nn.Module):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = attention
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = Eagle3MLP(cfg)

    def attn_input(self, e: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """cat(input_layernorm(embedding), hidden_norm(h)): embedding first."""
        return torch.cat([self.input_layernorm(e), self.hidden_norm(h)], dim=-1)

    def finish(self, a: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """a = attention output (after o_proj); residual is the un-normalised h."""
        r = a + h
        return self.mlp(self.post_attention_layernorm(r)) + r


class Eagle3Drafter(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.config = c = config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        if c.fc_norm:
            self.fc_norm = nn.ModuleList(RMSNorm(c.target_hidden_size, c.rms_norm_eps)
                                         for _ in range(c.num_aux_layers))
        elif c.norm_before_fc:
            self.input_norm = RMSNorm(c.num_aux_layers * c.target_hidden_size, c.rms_norm_eps)
        self.fc = nn.Linear(c.num_aux_layers * c.target_hidden_size, c.hidden_size, bias=False)
        self.midlayer = Eagle3MidLayer(c, LAYOUT_MODULES[c.layout].ATTENTION(c))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        # Default map: the first draft_vocab_size target ids (identity); set_vocab_map installs the real one.
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.int64))
        t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
        t2d[: c.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)
        self.activation_checkpointing = "none"  # run-time switch (trainer's --activation-checkpointing)

    # ---------------------------------------------------------------- setup

    def set_vocab_map(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        """Install the draft vocab map (target_id = draft_id + d2t[draft_id]; t2d[target_id] marks draft ids)."""
        c = self.config
        d2t = torch.as_tensor(d2t).to(torch.int64).cpu()
        t2d = torch.as_tensor(t2d).to(torch.bool).cpu()
        if d2t.shape != (c.draft_vocab_size,) or t2d.shape != (c.vocab_size,):
            raise ValueError(f"vocab map shapes d2t {tuple(d2t.shape)}, t2d {tuple(t2d.shape)}; expected "
                             f"({c.draft_vocab_size},), ({c.vocab_size},)")
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
        """The tensors SGLang loads, i.e. state_dict() minus embed_tokens, in tensor_shapes' order."""
        sd = self.state_dict()
        return {k: sd[k] for k in tensor_shapes(self.config)}

    # ---------------------------------------------------------------- pieces

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def project_aux(self, aux: torch.Tensor, norm=module_norm) -> torch.Tensor:
        """[..., num_aux * target_hidden] -> h [..., hidden] (step 0 input), through fc_norm / input_norm if on."""
        c, x = self.config, aux.to(self.dtype)
        if c.fc_norm:
            x = torch.cat([norm(a, n) for a, n in zip(x.split(c.target_hidden_size, dim=-1), self.fc_norm)], dim=-1)
        elif c.norm_before_fc:
            x = norm(x, self.input_norm)
        return self.fc(x)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(token_ids).to(self.dtype)

    def target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft ids -> target ids, SGLang's rule: target_id = draft_id + d2t[draft_id] (docs/contract.md)."""
        d2t = self.d2t.to(draft_ids.device)
        return draft_ids + d2t[draft_ids]

    def step_output(self, m: torch.Tensor, norm=module_norm) -> torch.Tensor:
        """What a draft step hands on (to the next step and to the head): norm(m) with norm_output, else m."""
        return norm(m, self.norm) if self.config.norm_output else m

    def head_input(self, out: torch.Tensor, norm=module_norm) -> torch.Tensor:
        """A step's output -> what lm_head reads: already normed with norm_output, else norm(m)."""
        return out if self.config.norm_output else norm(out, self.norm)

    def draft_logits(self, out: torch.Tensor) -> torch.Tensor:
        """lm_head over the draft vocab, from a step's output."""
        return self.lm_head(self.head_input(out))

    # ---------------------------------------------------------------- inference-style step

    def forward_step(self, h: torch.Tensor, token_ids: torch.Tensor, position_ids: torch.Tensor,
                     past_kv: tuple[torch.Tensor, torch.Tensor] | None = None):
        """One draft step over S new positions with a KV cache.

        h [B, S, H] (project_aux(aux) at step 0, else the previous step's output), token_ids [B, S] (for step 0,
        the token one position ahead of the aux state), position_ids [B, S]. past_kv: (k, v) [B, nkv, P, .] with
        RoPE applied. New query s sees every cached key and new keys <= s. No padding support (single sequences or
        equal lengths). Returns (out [B, S, H], (k, v) cache extended by the S new keys).
        """
        attn = self.midlayer.self_attn
        h = h.to(self.dtype)
        x = self.midlayer.attn_input(self.embed(token_ids), h)
        q, k, v = attn.split(attn.in_proj(x), position_ids)
        if past_kv is not None:
            k = torch.cat([past_kv[0], k], dim=2)
            v = torch.cat([past_kv[1], v], dim=2)
        o = cached_attention(q, repeat_kv(k, attn.n_rep), repeat_kv(v, attn.n_rep), attn.scale)
        return self.step_output(self.midlayer.finish(attn.out(o), h)), (k, v)

    # ---------------------------------------------------------------- training-time test

    def ttt_forward(self, hidden_state: torch.Tensor, input_ids: torch.Tensor,
                    attention_mask: torch.Tensor | None = None, steps: int = 7,
                    position_ids: torch.Tensor | None = None, fast: bool = False,
                    prefix_kv=None) -> list[torch.Tensor]:
        """Unroll `steps` draft steps over whole sequences (docs/contract.md §9).
        Returns [out_0, ..., out_{K-1}], each [B, T, H] (step_output of each step).

        hidden_state [B, T, num_aux * Ht] (aux states, ascending HF index), input_ids [B, T], attention_mask [B, T]
        (1 real, 0 right padding; None = all real), position_ids [B, T] (default arange).
        Step j at position t: token input_ids[t + 1 + j] (0 past the end), h = fc(aux[t]) at j = 0 else out_{j-1}[t],
        RoPE position t + j; attends to step-0 keys at positions <= t and to the step-1..j keys at position t.
        With right padding, causality alone keeps real queries off padded keys; outputs at padded positions are
        finite but meaningless (the loss masks them).
        fast: the same function through kernels.py (flash attention + log-sum-exp merge, lean norms, the
        embedding half of the attention's input projection computed once for all steps). It reads weights
        directly, so not under ZeRO-3.
        prefix_kv: sequence parallel (train/sequence_parallel.py): a function of this chunk's step-0 keys and
        values (k0, v0) returning (k0, v0, (k, v) of every position before the chunk, which all its queries also
        attend to); input_ids then starts at position_ids[:, 0] and carries the next chunk's first tokens.
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
        attn = self.midlayer.self_attn
        if fast:
            # fp32 training or an odd head width on a GPU: the plain path (same function) instead of a kernel error
            fast = flash_supported(input_ids.device, self.dtype, max(attn.qk_dim, attn.v_dim))
        if fast:
            return self._ttt_fast(hidden_state, input_ids, position_ids, steps, prefix_kv)
        h = self.project_aux(hidden_state)
        outs: list[torch.Tensor] = []
        k0 = v0 = prefix = None
        diag_k: list[torch.Tensor] = []
        diag_v: list[torch.Tensor] = []
        for j in range(steps):
            tok = input_ids.new_zeros(B, T)
            if 1 + j < T:
                tok[:, : T - 1 - j] = input_ids[:, 1 + j:]
            x = self.midlayer.attn_input(self.embed(tok), h)
            q, k, v = attn.split(attn.in_proj(x), position_ids + j)
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
            h = self.step_output(m)
            outs.append(h)
        return outs

    @property
    def checkpointing(self) -> str:
        return checkpointing_mode(self.activation_checkpointing)

    def _ttt_fast(self, hidden_state, input_ids, position_ids, steps: int, prefix_kv=None) -> list[torch.Tensor]:
        c, ml = self.config, self.midlayer
        attn = ml.self_attn
        B, T = input_ids.shape
        H, eps = c.hidden_size, c.rms_norm_eps
        mode = self.checkpointing if torch.is_grad_enabled() else "none"
        # x = cat(norm(embed(token)), norm(h)) @ W^T = E + norm(h) @ W_h^T for every linear that reads x. Step j
        # reads token t+1+j, i.e. the same embedding rows shifted by j, so E is projected once for all steps (saves
        # half of the input projection in steps >= 1).
        w_in = torch.cat(attn.in_weights())
        w_e, w_h = w_in[:, :H], w_in[:, H:]
        tok = torch.cat([input_ids[:, 1:], input_ids.new_zeros(B, steps)], dim=1)         # [B, T - 1 + K]
        e_in = rms_norm(self.embed(tok), ml.input_layernorm.weight, eps) @ w_e.T
        w_gu = torch.cat([ml.mlp.gate_proj.weight, ml.mlp.up_proj.weight])

        def gate_up(n2):
            return silu_mul(n2 @ w_gu.T)

        def mlp(n2):
            return ml.mlp.down_proj(gate_up(n2))

        def project(j, h):  # step j's q, k, v (RoPE applied)
            z = e_in[:, j:j + T] + rms_norm(h, ml.hidden_norm.weight, eps) @ w_h.T
            return attn.split(z, position_ids + j, lean_norm)

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
                m = torch.cat([torch.utils.checkpoint.checkpoint(mlp, ch, use_reentrant=False)
                               for ch in n2.split(rows, dim=1)], dim=1) + r
            else:
                z = torch.utils.checkpoint.checkpoint(gate_up, n2, use_reentrant=False) if mode == "mlp" \
                    else gate_up(n2)
                m = ml.mlp.down_proj(z) + r
            return self.step_output(m, lean_norm), k, v

        h = self.project_aux(hidden_state, lean_norm)
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


# The key names of the original EAGLE-3 Llama layout with no option on (what the example and older runs export).
EXPORT_KEYS: tuple[str, ...] = tuple(tensor_shapes(DrafterConfig(
    hidden_size=2, num_attention_heads=1, num_key_value_heads=1, intermediate_size=1, vocab_size=1,
    draft_vocab_size=1, target_hidden_size=1)))
