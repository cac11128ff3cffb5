"""Memory-lean autograd pieces of the fast training path (`Eagle3Drafter.ttt_forward(fast=True)`, `eagle3_loss(
fused=True)`). Each computes exactly the function of its plain counterpart in drafter.py / loss.py (tests compare them
on the CPU; bench/train_step.py on the GPU), but saves fewer activations and syncs nothing to the host.

* `rms_norm`: saves the input and one fp32 rstd per row (the plain module keeps two fp32 copies of the input).
* `silu_mul`: silu(gate) * up from the fused [.., 2I] gate_up output, saving only that output.
* `causal_plus_diagonal`: TTT attention (docs/contract.md §9) as one fused causal-attention call (cuDNN or
  FlashAttention-2 on CUDA, or the memory-efficient kernel where pinned; torch's flash kernel on the CPU) over the
  step-0 keys plus the diagonal keys merged by log-sum-exp. Backward re-uses the fused kernel's own backward: called
  with the MERGED output and MERGED log-sum-exp, it yields exactly the step-0 keys' share of the gradient (the
  kernel uses `out` only for D = rowsum(dO * out) and `lse` only to rebuild P, and both are the full softmax's), so
  no [T, (1+j)T] mask and no log-sum-exp gradient are needed.
* `linear_soft_cross_entropy`: draft lm_head + soft cross-entropy (or the LK losses' -log alpha / -alpha, alpha the
  expected acceptance sum_v min(p_v, q_v)) for all K steps in token chunks, gradients computed in forward (the loss
  is the last op), so [tokens, draft_vocab] logits never exist beyond one chunk.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from eagle3.model.layers import repeat_kv

_COMPILED: dict = {}
_EAGER: set = set()          # functions whose compiled version failed once: they run as written from then on
COMPILE_ON_CPU: str | None = None  # tests: a torch.compile backend (e.g. "eager") to exercise the compiled path on CPU


def _is_compiler_error(e: BaseException) -> bool:
    """An error raised by dynamo/inductor themselves (a recompile limit, an unsupported op), not by the math."""
    return type(e).__module__.startswith(("torch._dynamo", "torch._inductor"))


def _fused(fn):
    """fn on CPU as written; on CUDA through torch.compile (dynamic shapes, compiled once per function), which fuses
    its chains of elementwise ops and reductions into a few kernels. Same math either way: tests hold the CPU
    version to float64 references and the device run holds the compiled one to the same.

    A compiled piece must never end a run: new shapes (a size-1 batch, held-out batches, another dtype) can make
    dynamo recompile, and past its recompile limit `fullgraph=True` turns that into a hard error
    (FailOnRecompileLimitHit, which once killed a run at its final evaluation). Any compiler error therefore falls
    back to the function as written, for that function, for the rest of the process (one warning)."""
    def call(*args):
        backend = "inductor" if args[0].is_cuda else COMPILE_ON_CPU
        if backend is None or fn in _EAGER:
            return fn(*args)
        if fn not in _COMPILED:
            _COMPILED[fn] = torch.compile(fn, dynamic=True, fullgraph=True, backend=backend)
        try:
            return _COMPILED[fn](*args)
        except Exception as e:
            if not _is_compiler_error(e):
                raise
            _EAGER.add(fn)
            import warnings
            warnings.warn(f"torch.compile of {fn.__name__} failed ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
                          "running it uncompiled from now on (same math, slower)", RuntimeWarning, stacklevel=2)
            return fn(*args)
    call.__wrapped__ = fn
    return call


# ------------------------------------------------------------------------------------------------ RMSNorm

@_fused
def _rms_fwd(x, weight, eps: float):
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * (xf * rstd).to(x.dtype), rstd  # the plain module's rounding: normalise, cast, then scale


@_fused
def _rms_bwd(x, weight, rstd, g):
    acc = rstd.dtype
    xhat = x.to(acc) * rstd
    gf = g.to(acc)
    gw = (gf * xhat.to(x.dtype).to(acc)).reshape(-1, x.shape[-1]).sum(0)
    gn = gf * weight.to(acc)
    gx = rstd * (gn - xhat * (gn * xhat).mean(-1, keepdim=True))
    return gx.to(x.dtype), gw.to(weight.dtype)


@_fused
def _rms_bwd_weight(x, rstd, g):
    """The weight's gradient alone: fc_norm on the captured states, which need none (the [T, 3 x target_hidden]
    input gradient would be computed and dropped)."""
    xhat = (x.to(rstd.dtype) * rstd).to(x.dtype).to(rstd.dtype)
    return (g.to(rstd.dtype) * xhat).reshape(-1, x.shape[-1]).sum(0)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        y, rstd = _rms_fwd(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, g):
        x, weight, rstd = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, _rms_bwd_weight(x, rstd, g).to(weight.dtype), None
        gx, gw = _rms_bwd(x, weight, rstd, g)
        return gx, gw, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _RMSNorm.apply(x, weight, eps)


def lean_norm(x: torch.Tensor, norm) -> torch.Tensor:
    """An RMSNorm module's function through rms_norm (layers.module_norm's fast-path twin, same signature)."""
    return _RMSNorm.apply(x, norm.weight, norm.eps)


# ------------------------------------------------------------------------------------------------ SiLU * up

@_fused
def _silu_mul_fwd(gate_up):
    g, u = gate_up.chunk(2, dim=-1)
    return F.silu(g) * u


@_fused
def _silu_mul_bwd(gate_up, dz):
    acc = torch.promote_types(gate_up.dtype, torch.float32)
    g, u = (t.to(acc) for t in gate_up.chunk(2, dim=-1))
    sg = torch.sigmoid(g)
    dzf = dz.to(acc)
    return torch.cat([dzf * u * sg * (1 + g * (1 - sg)), dzf * g * sg], dim=-1).to(gate_up.dtype)


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up):
        ctx.save_for_backward(gate_up)
        return _silu_mul_fwd(gate_up)

    @staticmethod
    def backward(ctx, dz):
        (gate_up,) = ctx.saved_tensors
        return _silu_mul_bwd(gate_up, dz)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2I] (gate then up) -> silu(gate) * up [..., I]."""
    return _SiluMul.apply(gate_up)


# ------------------------------------------------------------------------------------------------ attention

# Which CUDA kernel computes the causal block. 'cudnn' is cuDNN's fused attention (the kernel plain SDPA itself
# picks on Hopper); 'flash' is PyTorch's FlashAttention-2 build; 'efficient' is PyTorch's memory-efficient (CUTLASS)
# kernel, which takes values narrower than keys as they are. All return the log-sum-exp the merge needs and take the
# merged out/lse in backward (their backward passes use `out` only for rowsum(dO * out) and `lse` only to rebuild P).
# 'auto' takes cuDNN on sm90/sm100 for head_dim <= 128 (where its backward is supported), else flash -- also for the
# MLA drafter (keys 192, values 128, zero-padded to 192 for FA2): in the whole training step on an H200 the
# memory-efficient kernel was 2.8x slower than FA2 on padded values at 32,768 tokens (12.1 s against 4.3 s) and 1.4x
# at 4,096 (bench/RESULTS.md), though the attention block alone had timed the other way. Deterministic runs get flash.
CUDA_ATTENTION_KERNELS = ("auto", "cudnn", "flash", "efficient")
CUDNN_MAX_HEAD_DIM = 128
_cuda_attention = "auto"


def set_cuda_attention_kernel(name: str) -> None:
    """Pin the CUDA kernel of `causal_plus_diagonal` (benchmarks and tests compare them); 'auto' restores the rule."""
    global _cuda_attention
    if name not in CUDA_ATTENTION_KERNELS:
        raise ValueError(f"CUDA attention kernel {name!r}: expected one of {CUDA_ATTENTION_KERNELS}")
    _cuda_attention = name


def cuda_attention_kernel(q: torch.Tensor) -> str:
    """The kernel `causal_plus_diagonal` uses for this CUDA query tensor [B, h, T, d]."""
    if _cuda_attention == "cudnn" and q.shape[-1] > CUDNN_MAX_HEAD_DIM:
        raise ValueError(f"attention kernel 'cudnn' was pinned but head_dim {q.shape[-1]} > {CUDNN_MAX_HEAD_DIM}, "
                         "where cuDNN has no attention backward; use 'auto', 'flash' or 'efficient'")
    if _cuda_attention != "auto":
        return _cuda_attention
    if torch.are_deterministic_algorithms_enabled():  # cuDNN's attention backward is not
        return "flash"
    # Hopper and datacenter Blackwell only (sm_90 / sm_100): the parts cuDNN's fused attention is tuned for and
    # PyTorch's SDPA itself prefers it on.
    cudnn_ok = (torch.backends.cudnn.is_available() and torch.backends.cuda.cudnn_sdp_enabled()
                and torch.cuda.get_device_capability(q.device)[0] in (9, 10) and q.shape[-1] <= CUDNN_MAX_HEAD_DIM)
    return "cudnn" if cudnn_ok else "flash"


# cuDNN builds a graph per shape on first sight (measured ~0.1 s on an H200, bench/attention.py) and caches it; batches
# of every length would pay that on most steps. So its T is rounded up to a multiple of this, which bounds the
# distinct lengths at max_len / 128. (cuDNN's cache key also holds the batch size and strides, and the cache is per
# thread, so 'step' checkpointing's recompute on the autograd thread builds its own: a run may still pay a few hundred
# one-time builds, not one per step.) Keep it at 128: that is what the CUDA tests and the H200 benches ran, and
# cuDNN's fused attention has had length-dependent restrictions across releases. Zero rows appended to a CAUSAL
# block change nothing for the real rows (every padded key sits after every real query); the padded query rows are
# dropped, and in backward get dO = 0 and their own finite lse from the forward, so they add nothing to dK / dV.
CUDNN_T_MULTIPLE = 128


def _pad_t(x, t_pad):
    return x if x.shape[2] == t_pad else F.pad(x, (0, 0, 0, t_pad - x.shape[2]))


def _cudnn_forward(q, k, v, scale, causal: bool):
    """causal: q, k, v one length, all padded to a multiple of CUDNN_T_MULTIPLE. Not causal (a sequence-parallel
    prefix block): only the queries are padded (padded keys would take softmax mass), so the caller sends keys of a
    multiple of CUDNN_T_MULTIPLE (`_block_forward`)."""
    T = q.shape[2]
    tp = -(-T // CUDNN_T_MULTIPLE) * CUDNN_T_MULTIPLE
    if causal:
        k, v = _pad_t(k, tp), _pad_t(v, tp)
    # (query, key, value, attn_bias, compute_log_sumexp, dropout_p, is_causal, return_debug_mask); lse [B, h, T, 1]
    r = torch.ops.aten._scaled_dot_product_cudnn_attention(_pad_t(q, tp), k, v, None, True, 0.0, causal, False,
                                                           scale=scale)
    out, lse = r[0], r[1].squeeze(-1)
    # cloned: a view would keep the whole padded output alive until backward (and, under 'step' checkpointing, whose
    # recompute does not refresh ctx attributes, for as long as the graph lives)
    tail = (out[:, :, T:].clone(), lse[:, :, T:].clone()) if tp > T else None
    return out[:, :, :T], lse[:, :, :T], ("cudnn", r[6], r[7], tail)


def _cudnn_backward(dout, q, k, v, out, lse, state, scale, causal: bool):
    _, seed, offset, tail = state
    T = q.shape[2]
    if tail is not None:
        tp = T + tail[0].shape[2]
        q = _pad_t(q, tp)
        if causal:
            k, v = _pad_t(k, tp), _pad_t(v, tp)
        out = torch.cat([out, tail[0]], 2)
        dout = torch.cat([dout, dout.new_zeros(tail[0].shape)], 2)
        lse = torch.cat([lse, tail[1]], 2)
    # (..., out, logsumexp, philox_seed, philox_offset, attn_bias, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
    # is_causal); None is an undefined tensor: no bias, dense (not nested) batches
    dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        dout, q, k, v, out, lse.unsqueeze(-1).contiguous(), seed, offset, None, None, None, q.shape[2], k.shape[2],
        0.0, causal, scale=scale)
    if tail is None:
        return dq, dk, dv
    return (dq[:, :, :T], dk[:, :, :T], dv[:, :, :T]) if causal else (dq[:, :, :T], dk, dv)


def _flash_forward(q, k, v, scale, causal: bool):
    """PyTorch's flash attention (CPU or FA2) with its log-sum-exp: (out [B, h, T, d], lse [B, h, T] fp32, state for
    backward)."""
    if not q.is_cuda:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse, None
    r = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    return r[0], r[1], ("flash", r[2], r[3], r[4], r[5], r[6], r[7])


def _flash_backward(dout, q, k, v, out, lse, state, scale, causal: bool):
    if not q.is_cuda:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale)
    _, cq, ck, mq, mk, seed, offset = state
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse, cq, ck, mq, mk, 0.0, causal, seed, offset, scale=scale)


def _efficient_forward(q, k, v, scale, causal: bool):
    """PyTorch's memory-efficient kernel (CUDA): any value width. Its log-sum-exp comes padded to a multiple of 32
    rows; the pad is kept for the backward, which reads the padded shape."""
    r = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)
    T = q.shape[2]
    lse = r[1]
    tail = lse[:, :, T:].clone() if lse.shape[2] > T else None
    return r[0], lse[:, :, :T], ("efficient", r[2], r[3], tail)


def _efficient_backward(dout, q, k, v, out, lse, state, scale, causal: bool):
    _, seed, offset, tail = state
    if tail is not None:
        lse = torch.cat([lse, tail], 2)
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, None, out, lse.contiguous(), seed, offset, 0.0, [True, True, True, False], causal,
        scale=scale)
    return dq, dk, dv


def _block_forward(q, k, v, scale, causal: bool):
    """One attention block with its log-sum-exp: (out [B, h, T, dv], lse [B, h, T] fp32, state for backward).
    causal: the chunk's own keys; not causal: every query over all the prefix keys (the earlier chunks'). The CUDA
    kernel is `cuda_attention_kernel`'s; cuDNN for a prefix block only when its keys come in a multiple of
    CUDNN_T_MULTIPLE (sequence_pieces_loss cuts its pieces so; at 131,072 tokens in pieces that block is most of the
    attention), else FA2 (or the CPU flash kernel).
    Values narrower than the keys (MLA: 128 against 192) are zero-padded to the key width for the flash kernels
    (CUDA and CPU), which take one head width: the padded output columns are zero and are dropped. The
    memory-efficient kernel ('efficient' pinned) takes them as they are."""
    dv = v.shape[-1]
    kernel = cuda_attention_kernel(q) if q.is_cuda else "cpu"
    if kernel == "efficient":
        return _efficient_forward(q, k, v, scale, causal)
    if dv != q.shape[-1]:
        out, lse, state = _block_forward(q, k, _pad_d(v, q.shape[-1]), scale, causal)
        return out[..., :dv].contiguous(), lse, state
    if kernel == "cudnn" and (causal or k.shape[2] % CUDNN_T_MULTIPLE == 0):
        return _cudnn_forward(q, k, v, scale, causal)
    return _flash_forward(q, k, v, scale, causal)


def _block_backward(dout, q, k, v, out, lse, state, scale, causal: bool):
    if state is not None and state[0] == "efficient":
        return _efficient_backward(dout, q, k, v, out, lse, state, scale, causal)
    dv = v.shape[-1]
    if dv != q.shape[-1]:  # as padded in _block_forward; the zero columns of dout leave rowsum(dO * O) as it is
        w = q.shape[-1]
        dq, dk, dvp = _block_backward(_pad_d(dout, w), q, k, _pad_d(v, w), _pad_d(out, w), lse, state, scale, causal)
        return dq, dk, dvp[..., :dv]
    if state is not None and state[0] == "cudnn":
        return _cudnn_backward(dout, q, k, v, out, lse, state, scale, causal)
    return _flash_backward(dout, q, k, v, out, lse, state, scale, causal)


def _pad_d(x, width: int):
    if x.shape[-1] > width:
        raise NotImplementedError(f"value head width {x.shape[-1]} wider than the key width {width}")
    return F.pad(x, (0, width - x.shape[-1]))


def flash_supported(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether `causal_plus_diagonal` can run here: PyTorch's CUDA flash kernel takes fp16/bf16 and head_dim a
    multiple of 8 up to 256; its CPU flash kernel takes any float dtype and size."""
    if device.type != "cuda":
        return True
    return dtype in (torch.float16, torch.bfloat16) and head_dim % 8 == 0 and head_dim <= 256


def _fold_kv(g: torch.Tensor, n_rep: int) -> torch.Tensor:
    """Gradient of repeat_kv: sum the n_rep query heads that shared a kv head."""
    if n_rep == 1:
        return g
    B, nh, T, d = g.shape
    return g.view(B, nh // n_rep, n_rep, T, d).sum(2)


# The diagonal keys are folded in one at a time, each read where it lies: stacking them ([j, B, h, T, d] copies of
# the keys and values, then of their gradients) cost 2 x 6 x 2 GiB at step 6 of a 131,072-token sample at the Kimi
# shape, which is where one H200 ran out of memory (bench/RESULTS.md). Their scores are only [B, h, T] each. Query
# heads that share a kv head are viewed as [B, nkv, n_rep, T, d] against the key's [B, nkv, 1, T, d] instead of
# repeating the key.

@_fused
def _diag_score(q, k, scale: float):
    """Score of each query against one diagonal key at its own position: [B, nh, T] in fp32 (or wider)."""
    B, nh, T, d = q.shape
    acc = torch.promote_types(q.dtype, torch.float32)
    s = (q.to(acc).reshape(B, k.shape[1], -1, T, d) * k.to(acc).unsqueeze(2)).sum(-1) * scale
    return s.reshape(B, nh, T)


@_fused
def _diag_fold(acc_o, s, lse, v):
    """acc_o + softmax weight of this key (exp(s - lse), lse the merged one) times its value, in fp32 (or wider)."""
    B, nh, T = s.shape
    w = torch.exp(s - lse).reshape(B, v.shape[1], -1, T, 1)
    return acc_o + (w * v.to(acc_o.dtype).unsqueeze(2)).reshape(acc_o.shape)


@_fused
def _diag_grads(q, dout, lse, D, k, v, scale: float):
    """One diagonal key's share of the gradient given the merged lse and D = rowsum(dO * O): (dq share in fp32,
    dk, dv), dk/dv summed over the query heads that share the key's kv head."""
    B, nh, T, d = q.shape
    nkv = k.shape[1]
    acc = torch.promote_types(q.dtype, torch.float32)
    qf, df = q.to(acc).reshape(B, nkv, -1, T, d), dout.to(acc).reshape(B, nkv, -1, T, dout.shape[-1])
    kf, vf = k.to(acc).unsqueeze(2), v.to(acc).unsqueeze(2)
    p = torch.exp((qf * kf).sum(-1) * scale - lse.reshape(B, nkv, -1, T))            # [B, nkv, n_rep, T]
    ds = (p * ((df * vf).sum(-1) - D.reshape(B, nkv, -1, T)) * scale).unsqueeze(-1)
    dq = (ds * kf).reshape(B, nh, T, d)
    return dq, (ds * qf).sum(2).to(k.dtype), (p.unsqueeze(-1) * df).sum(2).to(v.dtype)


def _merge_fwd(q, o_c, lse_c, diag_k, diag_v, scale: float):
    """Fold the diagonal keys into the causal block's (o_c, lse_c): merged out (q's dtype), merged lse."""
    scores = [_diag_score(q, k, scale) for k in diag_k]
    lse = lse_c0 = lse_c.to(scores[0].dtype)
    for s in scores:
        lse = torch.logaddexp(lse, s)
    acc_o = torch.exp(lse_c0 - lse).unsqueeze(-1) * o_c.to(lse.dtype)
    for s, v in zip(scores, diag_v):
        acc_o = _diag_fold(acc_o, s, lse, v)
    return acc_o.to(q.dtype), lse


def _merge_bwd(q, dout, out, lse, diag_k, diag_v, dq_causal, scale: float):
    """The diagonal keys' share of the gradient, given the merged out/lse: (dq total, [dk], [dv])."""
    acc = torch.promote_types(q.dtype, torch.float32)
    D = (dout.to(acc) * out.to(acc)).sum(-1)                                    # rowsum(dO * O) of the full softmax
    dq, dks, dvs = dq_causal.to(acc), [], []
    for k, v in zip(diag_k, diag_v):
        dq_i, dk, dv = _diag_grads(q, dout, lse, D, k, v, scale)
        dq = dq + dq_i
        dks.append(dk)
        dvs.append(dv)
    return dq.to(q.dtype), dks, dvs


class _CausalPlusDiagonal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scale, n_rep, has_prefix, q, k0, v0, *rest):
        kp, vp = rest[-2:] if has_prefix else (None, None)
        diag = rest[:-2] if has_prefix else rest
        j = len(diag) // 2
        o_c, lse_c, state = _block_forward(q, repeat_kv(k0, n_rep), repeat_kv(v0, n_rep), scale, causal=True)
        p_state = None
        if has_prefix:  # the earlier chunks' block, merged by log-sum-exp into the causal one
            o_p, lse_p, p_state = _block_forward(q, repeat_kv(kp, n_rep), repeat_kv(vp, n_rep), scale, causal=False)
            acc = torch.promote_types(q.dtype, torch.float32)
            lse = torch.logaddexp(lse_c.to(acc), lse_p.to(acc))
            o = torch.exp(lse_c.to(acc) - lse).unsqueeze(-1) * o_c.to(acc) \
                + torch.exp(lse_p.to(acc) - lse).unsqueeze(-1) * o_p.to(acc)
            o_m = torch.empty_strided(o_c.shape, o_c.stride(), dtype=o_c.dtype, device=o_c.device)
            o_m.copy_(o)
            o_c, lse_c = o_m, lse.to(lse_c.dtype).contiguous()
        if j == 0:
            out, lse = o_c, lse_c
        else:
            merged, lse = _merge_fwd(q, o_c, lse_c, diag[:j], diag[j:], scale)
            out = torch.empty_strided(o_c.shape, o_c.stride(), dtype=o_c.dtype, device=o_c.device)
            out.copy_(merged)  # keep the kernel's own layout: its backward is handed this tensor
            lse = lse.to(lse_c.dtype).contiguous()
        ctx.save_for_backward(q, k0, v0, out, lse, *([kp, vp] if has_prefix else []), *diag)
        ctx.state, ctx.p_state, ctx.scale, ctx.n_rep, ctx.j, ctx.has_prefix = state, p_state, scale, n_rep, j, has_prefix
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k0, v0, out, lse, *kv = ctx.saved_tensors
        scale, n_rep, j = ctx.scale, ctx.n_rep, ctx.j
        if ctx.has_prefix:
            kp, vp, *kv = kv
        if dout.stride() != out.stride():
            d2 = torch.empty_strided(out.shape, out.stride(), dtype=dout.dtype, device=dout.device)
            d2.copy_(dout)
            dout = d2
        dq, dk0, dv0 = _block_backward(dout, q, repeat_kv(k0, n_rep), repeat_kv(v0, n_rep), out, lse, ctx.state,
                                       scale, causal=True)
        gp = ()
        if ctx.has_prefix:  # the same merged out / lse serve the prefix block's backward (see above)
            dq_p, dkp, dvp = _block_backward(dout, q, repeat_kv(kp, n_rep), repeat_kv(vp, n_rep), out, lse,
                                             ctx.p_state, scale, causal=False)
            dq = dq + dq_p
            gp = (_fold_kv(dkp, n_rep), _fold_kv(dvp, n_rep))
        gk = gv = ()
        if j:
            dq, gk, gv = _merge_bwd(q, dout, out, lse, kv[:j], kv[j:], dq, scale)
        return (None, None, None, dq, _fold_kv(dk0, n_rep), _fold_kv(dv0, n_rep), *gk, *gv, *gp)


def causal_plus_diagonal(q: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor, diag_k: Sequence[torch.Tensor],
                         diag_v: Sequence[torch.Tensor], scale: float,
                         prefix: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Same function as drafter.attention_causal_plus_diagonal (query t attends to k0[<= t] and to diag_k[i][t],
    and to every prefix key); q [B, nh, T, d], k0/v0/diag [B, nkv, T, d], prefix [B, nkv, P, d]. With no diagonal
    keys and no prefix it is plain causal attention."""
    if len(diag_k) != len(diag_v):
        raise ValueError("diag_k and diag_v differ in length")
    n_rep = q.shape[1] // k0.shape[1]
    has_prefix = prefix is not None and prefix[0].shape[2] > 0
    return _CausalPlusDiagonal.apply(scale, n_rep, has_prefix, q, k0, v0, *diag_k, *diag_v,
                                     *(prefix if has_prefix else ()))


# ------------------------------------------------------------------------------------------------ lm_head + loss

@_fused
def _soft_ce_chunk(logits, p, w, ok, tgt):
    """One chunk: (sum w * ce, sum ce over ok, argmax hits over ok, sum alpha over ok, d(sum w * ce)/d(logits) in
    logits' dtype). alpha = sum_v min(p_v, q_v), q = softmax(logits): the expected acceptance, a metric here."""
    lf = logits.to(torch.promote_types(logits.dtype, torch.float32))
    p = p.to(lf.dtype)
    lse = torch.logsumexp(lf, dim=-1)
    psum = p.sum(-1)
    ce = lse * psum - (p * lf).sum(-1)
    hits = ((lf.argmax(-1) == tgt) & ok).sum()
    # d(ce)/d(logits) = psum * softmax - p, weighted per row. In place, the same operations in the same order (the
    # same bits) as out of place: on a CPU a fresh [rows, vocab] tensor costs about as much as the arithmetic on it,
    # which pays for the alpha metric's pass over d below.
    d = (lf - lse.unsqueeze(-1)).exp_().mul_(psum.unsqueeze(-1)).sub_(p)
    # alpha = sum_v min(p_v, x_v) = (sum p + sum x - sum |x - p|) / 2 with x = psum * q, whose sum is psum to rounding
    # (and x is q to rounding: p sums to 1); one read of d, which the kl path computes anyway
    alpha = psum - 0.5 * torch.linalg.vector_norm(d, 1, -1)
    g = d.mul_(w.to(lf.dtype).unsqueeze(-1)).to(logits.dtype)
    return (w * ce).sum(), torch.where(ok, ce, 0).sum(), hits, torch.where(ok, alpha, 0).sum(), g


# The LK chunks below are written for few [rows, vocab] temporaries and in-place updates: on a CPU (eager) each fresh
# tensor of that size costs about as much as the arithmetic on it, and under torch.compile (CUDA) it makes no
# difference. Their alpha is the sum of the minima itself, never 1 - (a sum of differences): -log(alpha) needs a
# small alpha to its last digit, which that cancellation loses (1 - (1 - 1e-20) is 0). The lk-hybrid pre-pass sums
# the same minima as its gradient pass.

def _softmax_lse_hits(lf, tgt, ok):
    """(q = softmax(lf), logsumexp(lf), argmax hits over ok) from one softmax and one max: q at the row's argmax
    is exp(max - lse) and at least 1/vocab, so lse = max - log(q[argmax]) loses nothing to cancellation."""
    q = torch.softmax(lf, dim=-1)
    mx, am = lf.max(-1)
    lse = mx - torch.log(q.gather(-1, am.unsqueeze(-1)).squeeze(-1))
    return q, lse, ((am == tgt) & ok).sum()


def _alpha_parts(p, q):
    """(alpha, S, qb) per row, with B = {v: q_v < p_v} (where the minimum is q), S = sum_{v in B} q_v and qb = q on
    B, 0 elsewhere (a fresh tensor the caller may overwrite). alpha = sum_v min(p_v, q_v) = S + sum_{v not in B} p_v,
    and since dq_v/dz_k = q_v (1[v = k] - q_k): d alpha / d z_k = q_k (1[k in B] - S) = qb_k - q_k S."""
    alpha = torch.minimum(p, q).sum(-1)
    qb = (p - q).gt_(0).mul_(q)                     # 1[k in B] q_k, in place (a float mask: a bool one is slower)
    return alpha, qb.sum(-1), qb


def _lk_terms(logits, p, ok, tgt):
    """What both LK chunks start from: (lf: the logits in fp32 or wider, p in lf's dtype, q = softmax, argmax hits
    over ok, the soft cross-entropy per row, and _alpha_parts' alpha, S, qb)."""
    lf = logits.to(torch.promote_types(logits.dtype, torch.float32))
    p = p.to(lf.dtype)
    q, lse, hits = _softmax_lse_hits(lf, tgt, ok)
    psum = p.sum(-1)
    ce = lse * psum - (p * lf).sum(-1)
    return lf, p, q, hits, psum, ce, *_alpha_parts(p, q)


@_fused
def _lk_chunk(logits, p, w, ok, tgt):
    """--loss lk, one chunk: (sum w * -log alpha, sum ce over ok, argmax hits over ok, sum alpha over ok,
    d(sum w * -log alpha)/d(logits) in logits' dtype). A row with alpha == 0, or subnormal, adds 0 and gets no
    gradient (loss.neg_log_alpha)."""
    lf, p, q, hits, psum, ce, alpha, s, qb = _lk_terms(logits, p, ok, tgt)
    pos = alpha >= torch.finfo(lf.dtype).tiny
    safe = torch.where(pos, alpha, 1)
    wf = w.to(lf.dtype)
    c = torch.where(pos, -wf / safe, 0)             # d(w * -log alpha)/d alpha
    g = qb.mul_(c.unsqueeze(-1)).addcmul_(q, (-c * s).unsqueeze(-1))   # c * (qb - q S), in place
    loss = (wf * torch.where(pos, -torch.log(safe), 0)).sum()
    return loss, torch.where(ok, ce, 0).sum(), hits, torch.where(ok, alpha, 0).sum(), g.to(logits.dtype)


@_fused
def _hybrid_chunk(logits, p, w_ce, w_alpha, ok, tgt):
    """--loss lk-hybrid, one chunk: (sum w_ce * ce - sum w_alpha * alpha, sum ce over ok, argmax hits over ok, sum
    alpha over ok, its gradient with respect to the logits in logits' dtype)."""
    lf, p, q, hits, psum, ce, alpha, s, qb = _lk_terms(logits, p, ok, tgt)
    wc, wa = w_ce.to(lf.dtype), w_alpha.to(lf.dtype)
    # wc (psum q - p) - wa (qb - q S) = q (wc psum + wa S) - wc p - wa qb, in place in qb
    g = qb.mul_(-wa.unsqueeze(-1)).addcmul_(p, -wc.unsqueeze(-1)).addcmul_(q, (wc * psum + wa * s).unsqueeze(-1))
    loss = (wc * ce).sum() - (wa * alpha).sum()
    return loss, torch.where(ok, ce, 0).sum(), hits, torch.where(ok, alpha, 0).sum(), g.to(logits.dtype)


@_fused
def _alpha_chunk(logits, p, ok):
    """sum over ok rows of alpha = sum_v min(p_v, softmax(logits)_v), computed as _alpha_parts computes it."""
    lf = logits.to(torch.promote_types(logits.dtype, torch.float32))
    alpha = torch.minimum(p.to(lf.dtype), torch.softmax(lf, dim=-1)).sum(-1)
    return torch.where(ok, alpha, 0).sum()


def _head_chunks(xs, teacher_p, rows, M: int, chunk: int):
    """(s, j, x rows s..s+chunk of step j, their teacher rows, their teacher row ids) in the order the loss takes
    them. Every step's teacher rows for a chunk of positions lie in [s, s + chunk + K] (u = t + 1 + j, clamped at
    each row's end): one window of the teacher serves all K steps."""
    K = len(xs)
    for s in range(0, xs[0].shape[0], chunk):
        lo, hi = s, min(M, s + chunk + K)
        p_win = teacher_p(lo, hi) if callable(teacher_p) else teacher_p[lo:hi]
        for jj, x in enumerate(xs):
            r = rows[jj, s:s + chunk]
            yield s, jj, x[s:s + chunk], p_win.index_select(0, r - lo), r
        del p_win


class _LinearSoftCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight, teacher_p, teacher_argmax, chunk, rows, row_weights, valid, alpha_weights, log_alpha,
                grad, *xs):
        K = len(xs)
        acc = torch.promote_types(weight.dtype, torch.float32)
        gw = torch.zeros(weight.shape, dtype=acc, device=weight.device) if grad and weight.requires_grad else None
        gxs = [torch.empty_like(x) if grad and x.requires_grad else None for x in xs]
        loss = torch.zeros((), dtype=acc, device=weight.device)
        ce_sum = torch.zeros(K, dtype=torch.float64, device=weight.device)
        correct = torch.zeros(K, dtype=torch.float64, device=weight.device)
        alpha_sum = torch.zeros(K, dtype=torch.float64, device=weight.device)
        for s, jj, xc, p, r in _head_chunks(xs, teacher_p, rows, teacher_argmax.shape[0], chunk):
            logits, ok, tgt = xc @ weight.T, valid[jj, s:s + chunk], teacher_argmax.index_select(0, r)
            if alpha_weights is None:      # kl
                parts = _soft_ce_chunk(logits, p, row_weights[jj, s:s + chunk], ok, tgt)
            elif log_alpha:                # lk: -log alpha alone (row_weights None: checked by the caller)
                parts = _lk_chunk(logits, p, alpha_weights[jj, s:s + chunk], ok, tgt)
            else:                          # lk-hybrid: ce and -alpha
                parts = _hybrid_chunk(logits, p, row_weights[jj, s:s + chunk], alpha_weights[jj, s:s + chunk], ok,
                                      tgt)
            l_part, ce_part, hits, a_part, g = parts
            loss += l_part
            ce_sum[jj] += ce_part
            correct[jj] += hits
            alpha_sum[jj] += a_part
            if gxs[jj] is not None:
                gxs[jj][s:s + chunk] = g @ weight
            if gw is not None:
                gw += (g.T @ xc).to(acc)
        ctx.save_for_backward(gw if gw is not None else torch.empty(0), *[g if g is not None else torch.empty(0)
                                                                          for g in gxs])
        ctx.has_gw, ctx.has_gx = gw is not None, [g is not None for g in gxs]
        ctx.mark_non_differentiable(ce_sum, correct, alpha_sum)
        return loss, ce_sum, correct, alpha_sum

    @staticmethod
    def backward(ctx, gloss, _g1, _g2, _g3):
        gw, *gxs = ctx.saved_tensors
        dw = (gw * gloss).to(gw.dtype) if ctx.has_gw else None
        out = [(g * gloss.to(g.dtype)) if has else None for g, has in zip(gxs, ctx.has_gx)]
        return (dw, None, None, None, None, None, None, None, None, None, *out)


def linear_soft_cross_entropy(xs: Sequence[torch.Tensor], weight: torch.Tensor,
                              teacher_p: torch.Tensor | Callable[[int, int], torch.Tensor],
                              teacher_argmax: torch.Tensor, rows: torch.Tensor, row_weights: torch.Tensor | None,
                              valid: torch.Tensor, chunk: int = 4096, *, alpha_weights: torch.Tensor | None = None,
                              log_alpha: bool = False):
    """Weighted soft cross-entropy of K heads sharing one lm_head, without keeping any logits; or the LK losses'
    terms in the expected acceptance alpha = sum_v min(p_v, softmax(logits)_v) of each row.

    xs: K tensors [N, H] (normed draft states); weight [V, H]; teacher_p [M, V] (rows sum to 1), or a function
    (lo, hi) -> its rows lo..hi-1, computed as the loss reaches them (a whole [M, V] teacher in fp32 is 16 GiB at
    131,072 tokens and a 32,000-token draft vocab); teacher_argmax [M] (draft ids); rows [K, N] long: the teacher
    row of each (step, token), which must lie in [n, n + K] for token n (u = t + 1 + j, clamped at a row's end);
    row_weights [K, N]: the loss weight of each (e.g. decay^j / count_j, 0 where not counted); valid [K, N] bool:
    counted in the metrics.
    alpha_weights [K, N] (None: the soft cross-entropy alone): with log_alpha and row_weights None, loss =
    sum alpha_weights * -log(alpha) (a row with alpha 0 or subnormal adds 0: --loss lk); without log_alpha, loss =
    sum row_weights * ce - sum alpha_weights * alpha (--loss lk-hybrid, whose constant part the caller adds).
    Returns (loss, ce_sum [K] fp64 over valid, correct [K] fp64: argmax hits over valid, alpha_sum [K] fp64 over
    valid), every objective's metrics alike.
    """
    if (row_weights is None) != (alpha_weights is not None and log_alpha):
        raise ValueError("linear_soft_cross_entropy: row_weights (ce) are needed except with alpha_weights and "
                         "log_alpha (-log alpha alone), and not allowed then")
    # Gradients are computed in forward only when a backward can follow (not under no_grad, e.g. held-out eval).
    return _LinearSoftCE.apply(weight, teacher_p, teacher_argmax, int(chunk), rows, row_weights, valid,
                               alpha_weights, bool(log_alpha), torch.is_grad_enabled(), *xs)


@torch.no_grad()
def linear_alpha_sums(xs: Sequence[torch.Tensor], weight: torch.Tensor,
                      teacher_p: torch.Tensor | Callable[[int, int], torch.Tensor], num_teacher_rows: int,
                      rows: torch.Tensor, valid: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
    """[K] fp64: each step's sum over valid rows of alpha = sum_v min(p_v, softmax(x @ weight.T)_v), arguments as
    linear_soft_cross_entropy's (num_teacher_rows: M, its teacher_argmax's length). The gradient-free pass that
    --loss lk-hybrid makes first: its per-row gradients need the step's mean alpha (through the KL weight) before
    they are formed. Costs one draft-head matmul per token (of the gradient pass's three) and the teacher's rows
    once more."""
    out = torch.zeros(len(xs), dtype=torch.float64, device=weight.device)
    for s, jj, xc, p, _ in _head_chunks(xs, teacher_p, rows, num_teacher_rows, chunk):
        out[jj] += _alpha_chunk(xc @ weight.T, p, valid[jj, s:s + chunk])
    return out
