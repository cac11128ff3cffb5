"""The fast training path (model/kernels.py, ttt_forward(fast=True), eagle3_loss_fused) computes the same function
and gradients as the plain path, which the other tests hold to naive float64 references. On the CPU the flash kernel
is torch's CPU flash attention; test_cuda_* run the CUDA kernels where a GPU exists (the device bench runs them)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from eagle3.model import kernels
from eagle3.model.layers import attention_causal_plus_diagonal
from eagle3.train.loss import draft_index, eagle3_loss, eagle3_loss_fused

from test_drafter import batch, make_drafter, ttt_reference
from test_loss import data as loss_data
from test_loss import make_drafter as make_loss_drafter
from test_loss import naive_loss


def dense_attention(q, k0, v0, dk, dv, scale):
    """softmax over [k0 causal | diagonal keys] with an explicit mask (the definition)."""
    B, nh, T, d = q.shape
    rep = nh // k0.shape[1]
    keys = torch.cat([k0, *dk], 2).repeat_interleave(rep, 1)
    vals = torch.cat([v0, *dv], 2).repeat_interleave(rep, 1)
    allowed = torch.zeros(T, (len(dk) + 1) * T, dtype=torch.bool)
    allowed[:, :T] = torch.ones(T, T, dtype=torch.bool).tril()
    for i in range(1, len(dk) + 1):
        allowed[torch.arange(T), i * T + torch.arange(T)] = True
    sc = (q @ keys.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
    return torch.softmax(sc, -1) @ vals


def grads_of(fn, inputs, seed=0):
    xs = [x.detach().clone().requires_grad_(True) for x in inputs]
    out = fn(*xs)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    (out * g).sum().backward()
    return out.detach(), [x.grad for x in xs]


def _assert_close_to_float64(out, xs, ref, g_ref):
    """A bf16 CUDA kernel's output and its inputs' gradients (`xs`, under the cotangent grads_of draws with seed 0)
    against the float64 reference `ref`, `g_ref`: within bf16 rounding (1% / 2% relative)."""
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    (out.double() * g.cuda()).sum().backward()
    rel = lambda a, b: float((a.double().cpu() - b).norm() / b.norm())  # noqa: E731
    assert rel(out, ref) < 1e-2, rel(out, ref)
    for x, gr in zip(xs, g_ref):
        assert rel(x.grad, gr) < 2e-2, rel(x.grad, gr)


@pytest.mark.parametrize("nkv,j", [(4, 0), (4, 3), (2, 2), (1, 5)])
def test_causal_plus_diagonal_matches_dense_mask_with_gradients(nkv, j):
    gen = torch.Generator().manual_seed(nkv * 10 + j)
    B, nh, T, d = 2, 4, 13, 8
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64) * 2  # noqa: E731
    q, k0, v0 = r(B, nh, T, d), r(B, nkv, T, d), r(B, nkv, T, d)
    dk, dv = [r(B, nkv, T, d) for _ in range(j)], [r(B, nkv, T, d) for _ in range(j)]
    scale = d ** -0.5
    inputs = [q, k0, v0, *dk, *dv]

    def split(f):
        return lambda q, k0, v0, *rest: f(q, k0, v0, rest[:j], rest[j:], scale)
    out, g = grads_of(split(kernels.causal_plus_diagonal), inputs)
    ref, g_ref = grads_of(split(dense_attention), inputs)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_rms_norm_and_silu_mul_match_plain_autograd():
    gen = torch.Generator().manual_seed(5)
    x, w = torch.randn(3, 7, 16, generator=gen, dtype=torch.float64), 1 + torch.randn(16, generator=gen, dtype=torch.float64)
    plain = lambda x, w: w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))  # noqa: E731
    out, g = grads_of(lambda x, w: kernels.rms_norm(x, w, 1e-6), [x, w])
    ref, g_ref = grads_of(plain, [x, w])
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    # an input that needs no gradient (fc_norm on the captured states): the weight's gradient alone, the same
    wl = w.clone().requires_grad_(True)
    (kernels.rms_norm(x, wl, 1e-6) * ref.detach().cos()).sum().backward()
    wr = w.clone().requires_grad_(True)
    (plain(x, wr) * ref.detach().cos()).sum().backward()
    torch.testing.assert_close(wl.grad, wr.grad, rtol=1e-10, atol=1e-10)
    gu = torch.randn(5, 2 * 9, generator=gen, dtype=torch.float64) * 3
    out, (g,) = grads_of(kernels.silu_mul, [gu])
    ref, (g_ref,) = grads_of(lambda t: F.silu(t[:, :9]) * t[:, 9:], [gu])
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g, g_ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kv_heads", [2, 4, 1])
def test_fast_ttt_matches_dense_reference(kv_heads):
    d = make_drafter(num_key_value_heads=kv_heads)
    aux, ids, am = batch(d)
    outs = d.ttt_forward(aux, ids, am, steps=4, fast=True)
    ref = ttt_reference(d, aux, ids, am, 4)
    real = am.bool()
    for j in range(4):
        torch.testing.assert_close(outs[j][real], ref[j][real], rtol=1e-9, atol=1e-9)
    # more steps than tokens
    aux, ids, am = batch(d, B=2, T=3, lengths=(3, 2))
    outs, ref = d.ttt_forward(aux, ids, am, steps=5, fast=True), ttt_reference(d, aux, ids, am, 5)
    for j in range(5):
        torch.testing.assert_close(outs[j][am.bool()], ref[j][am.bool()], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("mode", ["none", "mlp", "step", "step_mlp"])
def test_fast_ttt_gradients_equal_plain(mode, monkeypatch):
    import eagle3.model.drafter as drafter_module
    monkeypatch.setattr(drafter_module, "MLP_CHUNK_TOKENS", 8)  # step_mlp: several chunks of the 2 x 11 tokens
    from test_drafter_layouts import assert_fast_gradients_equal_plain
    d = make_drafter()
    assert_fast_gradients_equal_plain(d, *batch(d), steps=4, mode=mode)


@pytest.mark.parametrize("chunk", [1000, 5])
def test_fused_loss_equals_naive_loop_and_plain_gradients(chunk):
    d = make_loss_drafter()
    th, W, ids, lm, am, ms = loss_data()
    ref, ce, correct, count = naive_loss(d, ms, th, W, lm, am)
    results = []
    argmax = (th @ W.T).argmax(-1)
    for variant in ("plain", "fused", "fused_argmax"):
        d.zero_grad()
        for m in ms:
            m.grad = None
        if variant == "plain":
            loss, met = eagle3_loss(d, ms, th, W, ids, lm, am, chunk_tokens=chunk)
        elif variant == "fused":
            loss, met = eagle3_loss_fused(d, ms, th, ids, lm, am, chunk_tokens=chunk, lm_head_weight=W)
        else:
            loss, met = eagle3_loss_fused(d, ms, th, ids, lm, am, chunk_tokens=chunk, target_argmax=argmax,
                                          draft_head_weight=W[d.t2d])
        loss.backward()
        results.append((loss.detach(), met, [d.lm_head.weight.grad.clone(), d.norm.weight.grad.clone()]
                        + [m.grad.clone() for m in ms]))
    assert min(count) > 0 and max(correct) > 0
    for loss, met, g in results[1:]:
        torch.testing.assert_close(loss, torch.tensor(ref, dtype=loss.dtype), rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(met["ce_sum"], torch.tensor(ce, dtype=torch.float64), rtol=1e-10, atol=1e-10)
        assert met["correct"].tolist() == correct
        assert met["count"].tolist() == [float(c) for c in count]
        for a, b in zip(g, results[0][2]):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_draft_index_inverts_the_vocab_map():
    d = make_loss_drafter()
    idx = draft_index(d.t2d)
    ids = torch.arange(d.config.draft_vocab_size) + d.d2t
    assert torch.equal(idx[ids], torch.arange(d.config.draft_vocab_size))
    assert (idx[~d.t2d] == -1).all()


def test_fast_path_bf16_error_no_worse_than_plain():
    """In bf16 both paths sit at bf16 distance from the float64 truth; the fast one no further than the plain one."""
    d = make_drafter()
    aux, ids, am = batch(d)
    ref = ttt_reference(d, aux, ids, am, 3)
    real = am.bool()
    errs = {}
    for fast in (False, True):
        dl = copy.deepcopy(d).to(torch.bfloat16)
        outs = dl.ttt_forward(aux.bfloat16(), ids, am, steps=3, fast=fast)
        errs[fast] = max(float((o[real].double() - r[real]).norm() / r[real].norm()) for o, r in zip(outs, ref))
    assert errs[True] < 2e-2 and errs[True] < 1.5 * errs[False] + 1e-3, errs


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (run on the device by "
                                                                      "bench/train_step.sh)")


@pytest.fixture
def cuda_kernel(request):
    kernels.set_cuda_attention_kernel(request.param)
    yield request.param
    kernels.set_cuda_attention_kernel("auto")


@needs_gpu
@pytest.mark.parametrize("cuda_kernel", ["flash", "cudnn", "efficient", "auto"], indirect=True)
@pytest.mark.parametrize("nkv,j,T,d,dv", [(64, 0, 300, 128, 128), (16, 3, 300, 128, 128), (64, 2, 37, 128, 128),
                                          (64, 6, 1024, 128, 128), (64, 3, 300, 192, 128), (64, 6, 1024, 192, 128)])
def test_cuda_causal_plus_diagonal_matches_float64_dense(cuda_kernel, nkv, j, T, d, dv):
    """Each CUDA kernel at the Kimi head shapes (Llama layout 128; MLA: q/k 192, v 128: the values padded to the key
    width for flash, which 'auto' picks there, as they are for the memory-efficient kernel): bf16 output and gradients against the float64 dense mask on the CPU, within bf16
    rounding. A wrong log-sum-exp convention or layout in the merge fails here, and so does cuDNN's T padding (300
    and 37 are padded to 384 and 128; 1024 is not)."""
    if cuda_kernel == "cudnn" and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("cuDNN attention is picked only on sm90+")
    if cuda_kernel == "cudnn" and d > kernels.CUDNN_MAX_HEAD_DIM:
        pytest.skip("cuDNN's attention backward is not taken above head width 128 (FlashAttention-2 there)")
    gen = torch.Generator().manual_seed(j)
    B, nh = 1, 64
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k0, v0 = r(B, nh, T, d), r(B, nkv, T, d), r(B, nkv, T, dv)
    dk, dv = [r(B, nkv, T, d) for _ in range(j)], [r(B, nkv, T, dv) for _ in range(j)]
    inputs, scale = [q, k0, v0, *dk, *dv], d ** -0.5

    def split(f):
        return lambda q, k0, v0, *rest: f(q, k0, v0, rest[:j], rest[j:], scale)
    ref, g_ref = grads_of(split(dense_attention), inputs)
    xs = [x.to("cuda", torch.bfloat16).requires_grad_(True) for x in inputs]
    out = split(kernels.causal_plus_diagonal)(*xs)
    _assert_close_to_float64(out, xs, ref, g_ref)


def test_cuda_attention_kernel_names_are_checked():
    with pytest.raises(ValueError, match="expected one of"):
        kernels.set_cuda_attention_kernel("fa3")
    try:
        kernels.set_cuda_attention_kernel("flash")
        assert kernels.cuda_attention_kernel(torch.empty(1, 1, 1, 128)) == "flash"
        kernels.set_cuda_attention_kernel("efficient")
        assert kernels.cuda_attention_kernel(torch.empty(1, 1, 1, 128)) == "efficient"
        kernels.set_cuda_attention_kernel("cudnn")
        assert kernels.cuda_attention_kernel(torch.empty(1, 1, 1, 128)) == "cudnn"
        with pytest.raises(ValueError, match="head_dim 256 > 128"):  # cuDNN has no backward there
            kernels.cuda_attention_kernel(torch.empty(1, 1, 1, 256))
    finally:
        kernels.set_cuda_attention_kernel("auto")


@needs_gpu
def test_cuda_auto_kernel_rule():
    q = torch.empty(1, 1, 1, 128, device="cuda")
    hopper = torch.cuda.get_device_capability()[0] in (9, 10) and torch.backends.cudnn.is_available()
    assert kernels.cuda_attention_kernel(q) == ("cudnn" if hopper else "flash")
    assert kernels.cuda_attention_kernel(torch.empty(1, 1, 1, 256, device="cuda")) == "flash"
    mla_q = torch.empty(1, 1, 1, 192, device="cuda")
    assert kernels.cuda_attention_kernel(mla_q) == "flash"   # MLA's 192: values padded, faster in the step (RESULTS.md)
    torch.use_deterministic_algorithms(True)
    try:  # cuDNN's attention backward is not deterministic
        assert kernels.cuda_attention_kernel(q) == "flash"
    finally:
        torch.use_deterministic_algorithms(False)


@needs_gpu
@pytest.mark.parametrize("cuda_kernel", ["flash", "cudnn"], indirect=True)
@pytest.mark.parametrize("T,kv_heads", [(300, 2), (256, 4)])
def test_cuda_fast_path_matches_float64_reference(cuda_kernel, T, kv_heads):
    """CUDA attention kernels inside the fast path: bf16 outputs and gradients vs the float64 plain path on the CPU,
    no further off than the plain bf16 path on the same GPU. T = 300 takes cuDNN's padded path with GQA (kv heads
    repeated, so contiguous); T = 256 its unpadded path with kv_heads = heads, i.e. the strided views of the fused
    q/k/v projection reach the kernel as they are."""
    if cuda_kernel == "cudnn" and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("cuDNN attention is picked only on sm90+")
    d = make_drafter(hidden_size=256, num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=64,
                     intermediate_size=512, target_hidden_size=256)
    aux, ids, am = batch(d, B=2, T=T, lengths=(T, T * 2 // 3))
    real = am.bool()
    w = [torch.randn(2, T, 256, generator=torch.Generator().manual_seed(j), dtype=torch.float64) for j in range(4)]

    def run(model, fast, device, dtype):
        model = copy.deepcopy(model).to(device=device, dtype=dtype)
        model.zero_grad()
        outs = model.ttt_forward(aux.to(device, dtype), ids.to(device), am.to(device), steps=4, fast=fast)
        sum((o.double() * wj.to(device))[real.to(device)].sum() for o, wj in zip(outs, w)).backward()
        return ([o.detach().double().cpu()[real] for o in outs],
                {n: p.grad.double().cpu() for n, p in model.named_parameters() if p.grad is not None})

    ref_o, ref_g = run(d, False, "cpu", torch.float64)
    err = {}
    for fast in (False, True):
        o, g = run(d, fast, "cuda", torch.bfloat16)
        err[fast] = (max(float((a - b).norm() / b.norm()) for a, b in zip(o, ref_o)),
                     max(float((g[n] - ref_g[n]).norm() / ref_g[n].norm()) for n in ref_g))
    assert err[True][0] < 2e-2 and err[True][1] < 5e-2, err
    assert err[True][0] < 1.5 * err[False][0] + 1e-3 and err[True][1] < 1.5 * err[False][1] + 1e-3, err


def test_train_step_uses_the_fast_path_below_zero3_and_refuses_step_checkpointing_without_it():
    from eagle3.train.config import TrainConfig
    from eagle3.train.step import DrafterTrainStep
    d = make_loss_drafter()
    head = torch.randn(d.config.vocab_size, d.config.target_hidden_size, dtype=torch.float64)
    fast = DrafterTrainStep(d, head, TrainConfig(zero_stage=2))
    assert fast.fast and torch.equal(fast.draft_head, head[d.t2d])
    plain = DrafterTrainStep(d, head, TrainConfig(zero_stage=3))
    assert not plain.fast and plain.draft_head is None
    with pytest.raises(ValueError, match="fast path"):
        DrafterTrainStep(d, head, TrainConfig(zero_stage=3, activation_checkpointing="step"))
    with pytest.raises(ValueError, match="fast path"):
        DrafterTrainStep(d, head, TrainConfig(zero_stage=3, activation_checkpointing="step_mlp"))
    with pytest.raises(ValueError, match="none, mlp, step, step_mlp"):
        TrainConfig(activation_checkpointing="sometimes")
    with pytest.raises(ValueError, match="attention_kernel 'fa3'"):
        TrainConfig(attention_kernel="fa3")
    try:  # the config's kernel choice reaches kernels.py
        DrafterTrainStep(d, head, TrainConfig(zero_stage=2, attention_kernel="flash"))
        assert kernels.cuda_attention_kernel(torch.empty(1, 1, 1, 64)) == "flash"
    finally:
        kernels.set_cuda_attention_kernel("auto")


def test_flash_support_rules_send_unsupported_gpu_cases_to_the_plain_path():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert kernels.flash_supported(cuda, torch.bfloat16, 128) and kernels.flash_supported(cuda, torch.float16, 64)
    assert not kernels.flash_supported(cuda, torch.float32, 128)     # fp32 training on a GPU
    assert not kernels.flash_supported(cuda, torch.bfloat16, 12)     # head_dim not a multiple of 8
    assert not kernels.flash_supported(cuda, torch.bfloat16, 512)    # beyond the kernel's 256
    assert kernels.flash_supported(cpu, torch.float64, 12)


def dense_attention_with_prefix(q, k0, v0, dk, dv, kp, vp, scale):
    """softmax over [prefix keys, all visible | k0 causal | diagonal keys] with an explicit mask (the definition of
    a sequence-parallel chunk's attention)."""
    B, nh, T, d = q.shape
    P, rep = kp.shape[2], nh // k0.shape[1]
    keys = torch.cat([kp, k0, *dk], 2).repeat_interleave(rep, 1)
    vals = torch.cat([vp, v0, *dv], 2).repeat_interleave(rep, 1)
    allowed = torch.zeros(T, P + (len(dk) + 1) * T, dtype=torch.bool)
    allowed[:, :P] = True
    allowed[:, P:P + T] = torch.ones(T, T, dtype=torch.bool).tril()
    for i in range(1, len(dk) + 1):
        allowed[torch.arange(T), P + i * T + torch.arange(T)] = True
    sc = (q @ keys.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
    return torch.softmax(sc, -1) @ vals


def _prefix_case(nkv, j, T, P, B=1, nh=4, d=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k0, v0, kp, vp = r(B, nh, T, d), r(B, nkv, T, d), r(B, nkv, T, d), r(B, nkv, P, d), r(B, nkv, P, d)
    dk, dv = [r(B, nkv, T, d) for _ in range(j)], [r(B, nkv, T, d) for _ in range(j)]
    return [q, k0, v0, *dk, *dv, kp, vp], d ** -0.5


@pytest.mark.parametrize("nkv,j,P", [(4, 0, 9), (2, 3, 20), (1, 2, 1)])
def test_causal_plus_diagonal_with_a_prefix_matches_dense_mask(nkv, j, P):
    """Sequence parallel: the earlier chunks' keys merged into the fused kernel (CPU flash, float64) and into the plain
    path, with gradients for every input, the prefix keys included."""
    inputs, scale = _prefix_case(nkv, j, 11, P, B=2, seed=nkv + j)

    def call(f, **kw):
        return lambda q, k0, v0, *rest: f(q, k0, v0, rest[:j], rest[j:2 * j], scale, prefix=tuple(rest[2 * j:]), **kw)
    ref, g_ref = grads_of(lambda q, k0, v0, *rest: dense_attention_with_prefix(q, k0, v0, rest[:j], rest[j:2 * j],
                                                                               *rest[2 * j:], scale), inputs)
    for f in (kernels.causal_plus_diagonal, attention_causal_plus_diagonal):
        out, g = grads_of(call(f), inputs)
        torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
        for a, b in zip(g, g_ref):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


@needs_gpu
@pytest.mark.parametrize("cuda_kernel", ["flash", "cudnn"], indirect=True)
@pytest.mark.parametrize("j,T,P", [(0, 300, 300), (2, 300, 256), (6, 1024, 2048)])
def test_cuda_causal_plus_diagonal_with_a_prefix_matches_float64_dense(cuda_kernel, j, T, P):
    """The same at the Kimi head shape in bf16 on each CUDA kernel. The prefix block runs on cuDNN where the causal
    one does and the prefix is a multiple of 128 keys (300 queries: padded ones), else on FA2 (P = 300)."""
    if cuda_kernel == "cudnn" and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("cuDNN attention is picked only on sm90+")
    inputs, scale = _prefix_case(64, j, T, P, nh=64, d=128, seed=j)
    ref, g_ref = grads_of(lambda q, k0, v0, *rest: dense_attention_with_prefix(q, k0, v0, rest[:j], rest[j:2 * j],
                                                                               *rest[2 * j:], scale), inputs)
    xs = [x.to("cuda", torch.bfloat16).requires_grad_(True) for x in inputs]
    out = kernels.causal_plus_diagonal(xs[0], xs[1], xs[2], xs[3:3 + j], xs[3 + j:3 + 2 * j], scale,
                                       prefix=(xs[-2], xs[-1]))
    _assert_close_to_float64(out, xs, ref, g_ref)
