"""Every drafter layout (llama, mla) and EAGLE-3.1 option (fc_norm, norm_before_fc, norm_output) against an
independent, naive float64 implementation written from docs/drafters.md: the plain and the fast training-time test,
inference-style decoding with a KV cache, the head, the gradients of the fast path, and the key set."""

from __future__ import annotations

import math

import pytest
import torch

from eagle3.model import DrafterConfig, Eagle3Drafter, tensor_shapes

from test_drafter import randomize

BASE = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=12, intermediate_size=48,
            vocab_size=50, draft_vocab_size=20, target_hidden_size=24, rms_norm_eps=1e-6, rope_theta=50.0,
            max_position_embeddings=64, num_aux_layers=3)
# MLA: q/k width 6 + 4 = 10 != v width 5; YaRN with mscale_all_dim so both the cos/sin and the softmax factors act
YARN = {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16, "beta_fast": 4.0, "beta_slow": 1.0,
        "mscale": 0.7, "mscale_all_dim": 1.0}
MLA = dict(BASE, num_key_value_heads=4, head_dim=None, layout="mla", q_lora_rank=12, kv_lora_rank=10,
           qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5, rope_scaling=YARN)

CASES = {
    "llama": BASE,
    "llama+fc_norm+norm_output": dict(BASE, fc_norm=True, norm_output=True),
    "llama+norm_before_fc": dict(BASE, norm_before_fc=True),
    "mla": MLA,
    "mla+fc_norm+norm_output": dict(MLA, fc_norm=True, norm_output=True),
    "mla_no_q_lora+norm_before_fc+norm_output": dict(MLA, q_lora_rank=None, norm_before_fc=True, norm_output=True,
                                                     rope_scaling=None),
}


def make(case: str, seed=0, dtype=torch.float64) -> Eagle3Drafter:
    torch.manual_seed(seed)
    return randomize(Eagle3Drafter(DrafterConfig(**CASES[case])).to(dtype))


def batch(cfg, B=2, T=11, lengths=(11, 7), seed=1):
    g = torch.Generator().manual_seed(seed)
    # each captured state on its own scale, as a target's low/mid/high layers are: fc_norm must matter
    scales = torch.tensor([0.5, 4.0, 30.0][:cfg.num_aux_layers], dtype=torch.float64).repeat_interleave(
        cfg.target_hidden_size)
    aux = torch.randn(B, T, cfg.num_aux_layers * cfg.target_hidden_size, generator=g, dtype=torch.float64) * scales
    ids = torch.randint(1, cfg.vocab_size, (B, T), generator=g)
    am = torch.zeros(B, T, dtype=torch.long)
    for b, n in enumerate(lengths):
        am[b, :n] = 1
    return aux, ids * am, am


# ----------------------------------------------------------------------------- naive float64, written from the docs

def n_rms(x, w, eps):
    return w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def n_fc_in(W, c, aux):
    """aux [S, n * Ht] -> what fc reads: per-state norms (fc_norm), one norm over all (norm_before_fc), or as is."""
    if c.fc_norm:
        Ht = c.target_hidden_size
        return torch.cat([n_rms(aux[:, i * Ht:(i + 1) * Ht], W[f"fc_norm.{i}.weight"], c.rms_norm_eps)
                          for i in range(c.num_aux_layers)], -1)
    if c.norm_before_fc:
        return n_rms(aux, W["input_norm.weight"], c.rms_norm_eps)
    return aux


def n_rotate_pairs(x, pos, inv_freq, pairs, scale=1.0):
    """x [S, heads, d]; rotate each pair (a, b) of dims `pairs[i]` by angle pos * inv_freq[i]; cos/sin x scale."""
    out = x.clone()
    for i, (a, b) in enumerate(pairs):
        ang = (pos * inv_freq[i])[:, None]
        c, s = torch.cos(ang) * scale, torch.sin(ang) * scale
        out[..., a] = x[..., a] * c - x[..., b] * s
        out[..., b] = x[..., b] * c + x[..., a] * s
    return out


def n_yarn(c):
    """DeepSeek-V2's YaRN (its modeling_deepseek.py: yarn_find_correction_range, yarn_linear_ramp_mask,
    yarn_get_mscale), element by element: (inv_freq, cos/sin factor, softmax factor)."""
    d, base = c.qk_rope_head_dim, c.rope_theta
    plain = [base ** (-(2 * i) / d) for i in range(d // 2)]
    rs = c.rope_scaling
    if not rs:
        return torch.tensor(plain, dtype=torch.float64), 1.0, 1.0
    f, L0 = rs["factor"], rs["original_max_position_embeddings"]

    def dim_of(rot):
        return (d * math.log(L0 / (rot * 2 * math.pi))) / (2 * math.log(base))
    lo, hi = max(math.floor(dim_of(rs["beta_fast"])), 0), min(math.ceil(dim_of(rs["beta_slow"])), d - 1)
    hi = hi + 0.001 if lo == hi else hi
    inv = []
    for i in range(d // 2):
        keep = 1.0 - min(max((i - lo) / (hi - lo), 0.0), 1.0)    # 1: extrapolate (plain), 0: interpolate (/ f)
        inv.append(plain[i] / f * (1 - keep) + plain[i] * keep)

    def msc(m):
        return 0.1 * m * math.log(f) + 1.0
    return (torch.tensor(inv, dtype=torch.float64), msc(rs["mscale"]) / msc(rs["mscale_all_dim"]),
            msc(rs["mscale_all_dim"]) ** 2)


def n_qkv(W, c, e, h, pos):
    """e, h [S, H]; pos [S] -> q [S, nh, dq], k [S, nkv, dq], v [S, nkv, dv], softmax scale."""
    x = torch.cat([n_rms(e, W["midlayer.input_layernorm.weight"], c.rms_norm_eps),
                   n_rms(h, W["midlayer.hidden_norm.weight"], c.rms_norm_eps)], dim=-1)
    S, nh, A = x.shape[0], c.num_attention_heads, "midlayer.self_attn."
    pos = pos.double()
    if c.layout == "llama":
        d = c.head_dim
        q = (x @ W[A + "q_proj.weight"].T).view(S, nh, d)
        k = (x @ W[A + "k_proj.weight"].T).view(S, c.num_key_value_heads, d)
        v = (x @ W[A + "v_proj.weight"].T).view(S, c.num_key_value_heads, d)
        inv = torch.tensor([c.rope_theta ** (-2.0 * i / d) for i in range(d // 2)], dtype=torch.float64)
        pairs = [(i, i + d // 2) for i in range(d // 2)]                  # Llama: rotate_half pairs
        return n_rotate_pairs(q, pos, inv, pairs), n_rotate_pairs(k, pos, inv, pairs), v, d ** -0.5
    nope, r, dv, L = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank
    if c.q_lora_rank:
        qa = n_rms(x @ W[A + "q_a_proj.weight"].T, W[A + "q_a_layernorm.weight"], c.rms_norm_eps)
        q = (qa @ W[A + "q_b_proj.weight"].T).view(S, nh, nope + r)
    else:
        q = (x @ W[A + "q_proj.weight"].T).view(S, nh, nope + r)
    kva = x @ W[A + "kv_a_proj_with_mqa.weight"].T
    kv = (n_rms(kva[:, :L], W[A + "kv_a_layernorm.weight"], c.rms_norm_eps) @ W[A + "kv_b_proj.weight"].T)
    kv = kv.view(S, nh, nope + dv)
    inv, cos_scale, soft = n_yarn(c)
    pairs = [(2 * i, 2 * i + 1) for i in range(r // 2)]                   # DeepSeek: interleaved pairs
    q_pe = n_rotate_pairs(q[..., nope:], pos, inv, pairs, cos_scale)
    k_pe = n_rotate_pairs(kva[:, L:].view(S, 1, r), pos, inv, pairs, cos_scale).expand(S, nh, r)
    q = torch.cat([q[..., :nope], q_pe], -1)
    k = torch.cat([kv[..., :nope], k_pe], -1)
    return q, k, kv[..., nope:], (nope + r) ** -0.5 * soft


def n_attend(c, q, keys, vals, allowed, scale):
    nh = c.num_attention_heads
    rep = nh // keys.shape[1]
    out = []
    for hd in range(nh):
        sc = (q[:, hd] @ keys[:, hd // rep].T * scale).masked_fill(~allowed, float("-inf"))
        out.append(torch.softmax(sc, -1) @ vals[:, hd // rep])
    return torch.cat(out, -1)


def n_finish(W, c, o, h):
    r = o @ W["midlayer.self_attn.o_proj.weight"].T + h
    n = n_rms(r, W["midlayer.post_attention_layernorm.weight"], c.rms_norm_eps)
    g, u = n @ W["midlayer.mlp.gate_proj.weight"].T, n @ W["midlayer.mlp.up_proj.weight"].T
    m = (g * torch.sigmoid(g) * u) @ W["midlayer.mlp.down_proj.weight"].T + r
    return n_rms(m, W["norm.weight"], c.rms_norm_eps) if c.norm_output else m   # what the next step receives


def n_logits(W, c, out):
    x = out if c.norm_output else n_rms(out, W["norm.weight"], c.rms_norm_eps)
    return x @ W["lm_head.weight"].T


def n_ttt(d, aux, input_ids, attention_mask, K):
    """Step j: the FULL key list [step-0 keys, step-1 keys, ..., step-j keys] with a dense mask (step 0 causal over
    real keys, steps 1..j the same position only), RoPE position t + j."""
    W = {k: v.detach().double() for k, v in d.state_dict().items()}
    c = d.config
    B, T = input_ids.shape
    outs = [torch.zeros(B, T, c.hidden_size, dtype=torch.float64) for _ in range(K)]
    for b in range(B):
        h = n_fc_in(W, c, aux[b].double()) @ W["fc.weight"].T
        ks, vs = [], []
        for j in range(K):
            tok = torch.zeros(T, dtype=torch.long)
            tok[:max(0, T - 1 - j)] = input_ids[b, 1 + j:]
            q, k, v, scale = n_qkv(W, c, W["embed_tokens.weight"][tok], h, torch.arange(T) + j)
            ks.append(k)
            vs.append(v)
            allowed = torch.zeros(T, (j + 1) * T, dtype=torch.bool)
            allowed[:, :T] = torch.ones(T, T, dtype=torch.bool).tril() & attention_mask[b].bool()[None]
            for i in range(1, j + 1):
                allowed[torch.arange(T), i * T + torch.arange(T)] = True
            h = n_finish(W, c, n_attend(c, q, torch.cat(ks), torch.cat(vs), allowed, scale), h)
            outs[j][b] = h
    return outs, W


# ----------------------------------------------------------------------------------------------------- tests

@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("fast", [False, True])
def test_ttt_and_head_match_the_naive_reference(case, fast):
    d = make(case)
    aux, ids, am = batch(d.config)
    K = 4
    ref, W = n_ttt(d, aux, ids, am, K)
    outs = d.ttt_forward(aux, ids, am, steps=K, fast=fast)
    real = am.bool()
    for j in range(K):
        torch.testing.assert_close(outs[j][real], ref[j][real], rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(d.draft_logits(outs[j])[real], n_logits(W, d.config, ref[j])[real],
                                   rtol=1e-9, atol=1e-9)
    assert not torch.allclose(outs[1][real], outs[0][real])


@pytest.mark.parametrize("case", list(CASES))
def test_options_and_layouts_change_the_function(case):
    """Each option is live: the same weights with the option off give other outputs (a silently ignored option is
    the failure this guards against)."""
    d = make(case)
    c = d.config
    aux, ids, am = batch(c)
    out = d.ttt_forward(aux, ids, am, steps=2)[1]
    for opt in c.options:
        other = Eagle3Drafter(DrafterConfig(**dict(CASES[case], **{opt: False}))).double()
        other.load_state_dict({k: v for k, v in d.state_dict().items() if k in other.state_dict()})
        assert not torch.allclose(other.ttt_forward(aux, ids, am, steps=2)[1], out, rtol=1e-3, atol=1e-3), opt


@pytest.mark.parametrize("case", list(CASES))
def test_ttt_equals_chain_drafting_with_kv_cache(case):
    """TTT step j at position t == inference: extend the prefix 0..t at step 0, then feed back each step's output
    and the next token at position t + j with the cache of step 0's keys and the earlier draft steps'."""
    d = make(case)
    aux, ids, am = batch(d.config, lengths=(11, 9))
    K = 4
    outs = d.ttt_forward(aux, ids, am, steps=K)
    for b, t in ((0, 0), (0, 6), (1, 4)):
        m, kv = d.forward_step(d.project_aux(aux[b:b + 1, : t + 1]), ids[b:b + 1, 1: t + 2], torch.arange(t + 1)[None])
        torch.testing.assert_close(m[0, -1], outs[0][b, t], rtol=1e-10, atol=1e-10)
        for j in range(1, K):
            m, kv = d.forward_step(m[:, -1:], ids[b:b + 1, t + 1 + j: t + 2 + j], torch.tensor([[t + j]]), kv)
            torch.testing.assert_close(m[0, -1], outs[j][b, t], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("mode", ["none", "step_mlp"])
def test_fast_path_gradients_equal_the_plain_path(case, mode, monkeypatch):
    import eagle3.model.drafter as drafter_module
    monkeypatch.setattr(drafter_module, "MLP_CHUNK_TOKENS", 8)  # step_mlp: several chunks of the 2 x 11 tokens
    d = make(case)
    plain = assert_fast_gradients_equal_plain(d, *batch(d.config), steps=3, mode=mode)
    # every option's norm learns; the head is outside ttt_forward, and so is the final norm unless norm_output
    head = {"lm_head.weight"} | (set() if d.config.norm_output else {"norm.weight"})
    assert set(plain) == {n for n, p in d.named_parameters() if p.requires_grad} - head


def assert_fast_gradients_equal_plain(d, aux, ids, am, steps: int, mode: str) -> dict:
    """Gradients of a fixed random function of the TTT outputs through the plain path, and through the fast path
    with checkpointing `mode`: equal in float64. Returns the plain path's."""
    w = [torch.randn(*ids.shape, d.config.hidden_size, generator=torch.Generator().manual_seed(j),
                     dtype=torch.float64) for j in range(steps)]
    grads = []
    for fast in (False, True):
        d.zero_grad()
        d.activation_checkpointing = mode if fast else "none"
        sum((m * wj).sum() for m, wj in zip(d.ttt_forward(aux, ids, am, steps=steps, fast=fast), w)).backward()
        grads.append({n: p.grad.clone() for n, p in d.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and "embed_tokens.weight" not in grads[0]
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=1e-9, atol=1e-11)
    return grads[0]


@pytest.mark.parametrize("case", list(CASES))
def test_key_set_is_the_export_state_dict(case):
    d = make(case)
    c = d.config
    assert {k: tuple(v.shape) for k, v in d.export_state_dict().items()} == tensor_shapes(c)
    assert set(tensor_shapes(c)) == {k for k in d.state_dict() if k != "embed_tokens.weight"}
    A = "midlayer.self_attn."
    if c.layout == "mla":
        assert tensor_shapes(c)[A + "kv_a_proj_with_mqa.weight"] == (c.kv_lora_rank + c.qk_rope_head_dim, 64)
        assert tensor_shapes(c)[A + "kv_b_proj.weight"] == (4 * (6 + 5), c.kv_lora_rank)
        assert (A + "q_a_proj.weight" in tensor_shapes(c)) == bool(c.q_lora_rank)
        assert c.draft_kv_bytes_per_token() == (10 + 4) * 2
    else:
        assert c.draft_kv_bytes_per_token() == 2 * 2 * 12 * 2
    assert ("fc_norm.2.weight" in tensor_shapes(c)) == c.fc_norm
    assert ("input_norm.weight" in tensor_shapes(c)) == c.norm_before_fc


def test_mla_rope_is_interleaved_and_yarn_is_deepseeks():
    """The rope dims pair up as (2i, 2i+1) (SGLang's is_neox_style=False for DeepSeek); YaRN's frequencies and both
    of its factors agree with transformers' own DeepSeek-V3 YaRN."""
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from eagle3.model.layers import deepseek_rope
    c = DrafterConfig(**MLA)
    inv, cos_scale, soft = deepseek_rope(c)
    n_inv, n_cos, n_soft = n_yarn(c)
    torch.testing.assert_close(inv, n_inv, rtol=1e-12, atol=0)
    assert (cos_scale, soft) == pytest.approx((n_cos, n_soft), rel=1e-12)
    hf = DeepseekV3Config(hidden_size=32, num_attention_heads=4, qk_rope_head_dim=4, qk_nope_head_dim=6,
                          max_position_embeddings=64,
                          rope_parameters=dict({k: v for k, v in YARN.items() if k != "type"}, rope_type="yarn",
                                               rope_theta=50.0))
    ref, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf)
    torch.testing.assert_close(inv, ref.double(), rtol=1e-6, atol=0)
    assert cos_scale == pytest.approx(attention_factor, rel=1e-6)
    with pytest.raises(NotImplementedError):
        DrafterConfig(**dict(MLA, rope_scaling={"type": "llama3", "factor": 2.0}))


def test_config_rules():
    c = DrafterConfig(**MLA)
    assert c.head_dim == 10 and c.v_dim == 5 and DrafterConfig.from_dict(c.to_dict()) == c
    with pytest.raises(ValueError, match="exclusive"):
        DrafterConfig(**dict(BASE, fc_norm=True, norm_before_fc=True))
    with pytest.raises(ValueError, match="MLA fields"):
        DrafterConfig(**dict(BASE, kv_lora_rank=8))
    with pytest.raises(ValueError, match="needs"):
        DrafterConfig(**dict(MLA, kv_lora_rank=None))
    with pytest.raises(ValueError, match="num_key_value_heads"):
        DrafterConfig(**dict(MLA, num_key_value_heads=2))
    # a record from before layouts and options reads as the original EAGLE-3 Llama layout
    old = {k: v for k, v in DrafterConfig(**BASE).to_dict().items()
           if k not in ("layout", "fc_norm", "norm_before_fc", "norm_output", "q_lora_rank", "kv_lora_rank",
                        "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")}
    assert DrafterConfig.from_dict(old) == DrafterConfig(**BASE)


def test_full_vocab_drafter():
    """draft_vocab_size = vocab_size (TorchSpec's Kimi MLA drafter): the identity map, every token draftable."""
    d = Eagle3Drafter(DrafterConfig(**dict(MLA, draft_vocab_size=50))).double()
    assert bool(d.t2d.all()) and not bool(d.d2t.any())
    aux, ids, am = batch(d.config)
    out = d.ttt_forward(aux, ids, am, steps=2)
    assert d.draft_logits(out[1]).shape == (2, 11, 50)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (run on the device by bench/mla_step.sh)")
@pytest.mark.parametrize("case", ["mla+fc_norm+norm_output", "llama+fc_norm+norm_output"])
def test_cuda_fast_path_matches_float64(case):
    """The CUDA kernels ('auto': FA2 with values zero-padded to the key width for MLA; cuDNN or FA2 for Llama) in
    bf16: outputs and gradients against the float64 plain path on the CPU, no further off than the plain bf16 path
    on the same GPU."""
    import copy
    cfg = dict(CASES[case], hidden_size=256, intermediate_size=512, target_hidden_size=256)
    if cfg.get("layout") == "mla":
        cfg.update(qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, kv_lora_rank=64, q_lora_rank=96)
    else:
        cfg.update(head_dim=64)
    torch.manual_seed(0)
    d = Eagle3Drafter(DrafterConfig(**cfg)).double()
    aux, ids, am = batch(d.config, T=300, lengths=(300, 200))
    real = am.bool()
    w = [torch.randn(2, 300, 256, generator=torch.Generator().manual_seed(j), dtype=torch.float64) for j in range(4)]

    def run(fast, device, dtype):
        m = copy.deepcopy(d).to(device=device, dtype=dtype)
        outs = m.ttt_forward(aux.to(device, dtype), ids.to(device), am.to(device), steps=4, fast=fast)
        sum((o.double() * wj.to(device))[real.to(device)].sum() for o, wj in zip(outs, w)).backward()
        return ([o.detach().double().cpu()[real] for o in outs],
                {n: p.grad.double().cpu() for n, p in m.named_parameters() if p.grad is not None})

    ref_o, ref_g = run(False, "cpu", torch.float64)
    err = {}
    for fast in (False, True):
        o, g = run(fast, "cuda", torch.bfloat16)
        err[fast] = (max(float((a - b).norm() / b.norm()) for a, b in zip(o, ref_o)),
                     max(float((g[n] - ref_g[n]).norm() / ref_g[n].norm()) for n in ref_g))
    assert err[True][0] < 3e-2 and err[True][1] < 6e-2, err
    assert err[True][0] < 1.5 * err[False][0] + 1e-3 and err[True][1] < 1.5 * err[False][1] + 1e-3, err


def test_the_example_mla_preset_has_the_llama_presets_size():
    """configs/drafters/smollm2-135m-mla.yaml: trainable parameters within 10% of smollm2-135m's (quality compares
    fairly), and a smaller draft KV cache per token."""
    import math
    from eagle3 import presets
    sizes, kv = {}, {}
    for name in ("smollm2-135m", "smollm2-135m-mla"):
        c = DrafterConfig(**presets.load("drafters", name), vocab_size=49152, target_hidden_size=576)
        sizes[name] = sum(math.prod(s) for k, s in tensor_shapes(c).items() if k not in ("d2t", "t2d"))
        kv[name] = c.draft_kv_bytes_per_token()
    assert abs(sizes["smollm2-135m-mla"] / sizes["smollm2-135m"] - 1) < 0.10, sizes
    assert kv["smollm2-135m-mla"] < kv["smollm2-135m"], kv
    kimi = DrafterConfig(**presets.load("drafters", "kimi-k2.5-mla"), vocab_size=163840, target_hidden_size=7168)
    assert kimi.draft_kv_bytes_per_token() == 1152 and kimi.options == ["fc_norm", "norm_output"]
    assert DrafterConfig(**presets.load("drafters", "kimi-k2.5"), vocab_size=163840,
                         target_hidden_size=7168).draft_kv_bytes_per_token() == 32768
