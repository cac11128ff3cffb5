"""The EAGLE-3 drafter against independent, naive float64 implementations of docs/contract.md §6, §8 and §9."""

from __future__ import annotations

import math

import pytest
import torch

from eagle3.model import EXPORT_KEYS, DrafterConfig, Eagle3Drafter, tensor_shapes
from eagle3.model.layers import attention_causal_plus_diagonal, llama_inv_freq as rope_inv_freq

# head_dim 12 != hidden/heads (8), GQA 4/2, target hidden 24 != hidden 32, small theta so rotations matter.
CFG = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=12, intermediate_size=48,
           vocab_size=50, draft_vocab_size=20, target_hidden_size=24, rms_norm_eps=1e-6, rope_theta=50.0,
           max_position_embeddings=64, num_aux_layers=3)


def make_drafter(seed=0, dtype=torch.float64, **over) -> Eagle3Drafter:
    torch.manual_seed(seed)
    return randomize(Eagle3Drafter(DrafterConfig(**dict(CFG, **over))).to(dtype))


def randomize(d: Eagle3Drafter) -> Eagle3Drafter:
    """Random weights (every norm's too), a random target embedding and a random draft vocab map."""
    with torch.no_grad():
        for name, p in d.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))  # not all ones: a swapped or skipped norm must show
            else:
                p.copy_(torch.randn_like(p) * (0.5 / math.sqrt(p.shape[-1]) if p.dim() == 2 else 1))
        d.load_target_embedding(torch.randn_like(d.embed_tokens.weight))
    V, Dv = d.config.vocab_size, d.config.draft_vocab_size
    ids = torch.randperm(V)[:Dv].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    d.set_vocab_map(ids - torch.arange(Dv), t2d)
    return d


# ------------------------------------------------------------------------- naive pieces (docs/contract.md §8)

def n_rms(x, w, eps):
    return w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def n_rope(x, pos, theta):
    """x [S, heads, d], pos [S] (float). Pairs (i, i + d/2) rotate by pos * theta^(-2i/d)."""
    d = x.shape[-1]
    half = d // 2
    out = torch.empty_like(x)
    for i in range(half):
        ang = (pos * theta ** (-2.0 * i / d))[:, None]
        c, s = torch.cos(ang), torch.sin(ang)
        x1, x2 = x[..., i], x[..., i + half]
        out[..., i] = x1 * c - x2 * s
        out[..., i + half] = x2 * c + x1 * s
    return out


def weights(d: Eagle3Drafter):
    return {k: v.detach().clone().double() for k, v in d.state_dict().items()}


def n_qkv(W, cfg, e, h, pos):
    """e, h [S, H]; pos [S] -> q [S, nh, d], k, v [S, nkv, d] (RoPE on q, k)."""
    x = torch.cat([n_rms(e, W["midlayer.input_layernorm.weight"], cfg.rms_norm_eps),
                   n_rms(h, W["midlayer.hidden_norm.weight"], cfg.rms_norm_eps)], dim=-1)
    S = x.shape[0]
    q = (x @ W["midlayer.self_attn.q_proj.weight"].T).view(S, cfg.num_attention_heads, cfg.head_dim)
    k = (x @ W["midlayer.self_attn.k_proj.weight"].T).view(S, cfg.num_key_value_heads, cfg.head_dim)
    v = (x @ W["midlayer.self_attn.v_proj.weight"].T).view(S, cfg.num_key_value_heads, cfg.head_dim)
    pos = pos.double()
    return n_rope(q, pos, cfg.rope_theta), n_rope(k, pos, cfg.rope_theta), v


def n_attend(cfg, q, keys, vals, allowed):
    """q [S, nh, d]; keys/vals [N, nkv, d]; allowed bool [S, N] -> [S, nh*d]."""
    rep = cfg.num_attention_heads // cfg.num_key_value_heads
    out = []
    for hd in range(cfg.num_attention_heads):
        sc = q[:, hd] @ keys[:, hd // rep].T / math.sqrt(cfg.head_dim)
        sc = sc.masked_fill(~allowed, float("-inf"))
        out.append(torch.softmax(sc, -1) @ vals[:, hd // rep])
    return torch.stack(out, 1).reshape(q.shape[0], -1)


def n_finish(W, cfg, o, h):
    r = o @ W["midlayer.self_attn.o_proj.weight"].T + h
    n = n_rms(r, W["midlayer.post_attention_layernorm.weight"], cfg.rms_norm_eps)
    g = n @ W["midlayer.mlp.gate_proj.weight"].T
    u = n @ W["midlayer.mlp.up_proj.weight"].T
    return (g * torch.sigmoid(g) * u) @ W["midlayer.mlp.down_proj.weight"].T + r


def n_logits(W, cfg, m):
    return n_rms(m, W["norm.weight"], cfg.rms_norm_eps) @ W["lm_head.weight"].T


def shifted(ids, k):
    out = torch.zeros_like(ids)
    if k < ids.shape[-1]:
        out[..., : ids.shape[-1] - k] = ids[..., k:]
    return out


def ttt_reference(d, aux, input_ids, attention_mask, K):
    """Slow, obvious TTT: for each step j the FULL key list [step0 keys 0..T-1, step1 keys, ..., stepj keys] with a
    dense boolean mask (step 0: causal over real keys; steps 1..j: the same position only), per-step RoPE t + j."""
    W, cfg = weights(d), d.config
    B, T = input_ids.shape
    outs = [torch.zeros(B, T, cfg.hidden_size, dtype=torch.float64) for _ in range(K)]
    for b in range(B):
        am = attention_mask[b].bool()
        h = aux[b].double() @ W["fc.weight"].T
        ks, vs = [], []
        for j in range(K):
            e = W["embed_tokens.weight"][shifted(input_ids[b], 1 + j)]
            q, k, v = n_qkv(W, cfg, e, h, torch.arange(T) + j)
            ks.append(k)
            vs.append(v)
            allowed = torch.zeros(T, (j + 1) * T, dtype=torch.bool)
            for t in range(T):
                for s in range(t + 1):
                    allowed[t, s] = bool(am[s])
                for i in range(1, j + 1):
                    allowed[t, i * T + t] = True
            o = n_attend(cfg, q, torch.cat(ks), torch.cat(vs), allowed)
            h = n_finish(W, cfg, o, h)
            outs[j][b] = h
    return outs


def batch(d, B=2, T=11, lengths=(11, 7), seed=1):
    g = torch.Generator().manual_seed(seed)
    cfg = d.config
    aux = torch.randn(B, T, cfg.num_aux_layers * cfg.target_hidden_size, generator=g, dtype=torch.float64)
    ids = torch.randint(1, cfg.vocab_size, (B, T), generator=g)
    am = torch.zeros(B, T, dtype=torch.long)
    for b, n in enumerate(lengths):
        am[b, :n] = 1
    ids = ids * am  # pad id 0
    return aux, ids, am


# ------------------------------------------------------------------------------------------- tests

EXPECTED_KEYS = {
    "fc.weight", "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
    "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight", "midlayer.post_attention_layernorm.weight", "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
}


def test_state_dict_keys_and_shapes():
    d = make_drafter()
    sd = d.state_dict()
    assert {k for k in sd if not k.startswith("embed_tokens")} == EXPECTED_KEYS
    assert set(d.export_state_dict()) == EXPECTED_KEYS
    c = d.config
    H, Ht, nh, nkv, hd = c.hidden_size, c.target_hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
    shapes = {"fc.weight": (H, 3 * Ht), "midlayer.self_attn.q_proj.weight": (nh * hd, 2 * H),
              "midlayer.self_attn.k_proj.weight": (nkv * hd, 2 * H), "midlayer.self_attn.v_proj.weight": (nkv * hd, 2 * H),
              "midlayer.self_attn.o_proj.weight": (H, nh * hd), "midlayer.mlp.gate_proj.weight": (c.intermediate_size, H),
              "midlayer.mlp.down_proj.weight": (H, c.intermediate_size), "lm_head.weight": (c.draft_vocab_size, H),
              "d2t": (c.draft_vocab_size,), "t2d": (c.vocab_size,), "embed_tokens.weight": (c.vocab_size, H)}
    for k, s in shapes.items():
        assert tuple(sd[k].shape) == s, k
    assert sd["d2t"].dtype == torch.int64 and sd["t2d"].dtype == torch.bool
    assert not d.embed_tokens.weight.requires_grad
    assert all(p.requires_grad for n, p in d.named_parameters() if not n.startswith("embed_tokens"))
    assert not any("inv_freq" in k for k in sd)
    # tensor_shapes (what the exporter and its checks read) is exactly the model's own export state dict
    assert {k: tuple(v.shape) for k, v in d.export_state_dict().items()} == tensor_shapes(c)
    assert tuple(tensor_shapes(c)) == EXPORT_KEYS


def test_config_roundtrip_and_validation():
    c = DrafterConfig(**CFG, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 16})
    assert DrafterConfig.from_dict(c.to_dict()) == c
    with pytest.raises(ValueError):
        DrafterConfig.from_dict(dict(c.to_dict(), hiden_size=3))
    assert DrafterConfig.from_dict(dict(c.to_dict(), architectures=["x"]), strict=False) == c
    assert DrafterConfig(**dict(CFG, head_dim=None)).head_dim == 8
    with pytest.raises(ValueError):
        DrafterConfig(**dict(CFG, num_key_value_heads=3))
    with pytest.raises(NotImplementedError):
        DrafterConfig(**CFG, rope_scaling={"rope_type": "yarn", "factor": 4.0})


def test_vocab_map_and_embedding_checks():
    d = make_drafter()
    ids = d.t2d.nonzero().squeeze(-1)
    assert torch.equal(torch.arange(20) + d.d2t, ids)
    bad = d.d2t.clone()
    bad[0] += 1
    with pytest.raises(ValueError):
        d.set_vocab_map(bad, d.t2d)
    with pytest.raises(ValueError):
        d.load_target_embedding(torch.zeros(50, 31))


def test_target_head_init_takes_the_draft_vocab_rows_and_the_final_norm():
    d = make_drafter()
    head, norm = torch.randn(50, 32, dtype=torch.float64), torch.randn(32, dtype=torch.float64)
    d.load_target_head(head, norm)
    ids = [i for i in range(50) if d.t2d[i]]  # target ids of the draft vocab, ascending: draft id order
    for draft_id, target_id in enumerate(ids):
        assert torch.equal(d.lm_head.weight[draft_id], head[target_id])
    assert torch.equal(d.norm.weight, norm)
    with pytest.raises(ValueError, match="init-head random"):
        d.load_target_head(torch.randn(50, 31, dtype=torch.float64), torch.randn(31, dtype=torch.float64))


def test_llama3_rope_matches_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    rs = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
    c = DrafterConfig(**dict(CFG, head_dim=16, rope_theta=500000.0, max_position_embeddings=256), rope_scaling=rs)
    hf = LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=16, max_position_embeddings=256,
                     rope_parameters=dict(rs, rope_theta=500000.0))
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](hf)
    torch.testing.assert_close(rope_inv_freq(c, torch.float64), ref.double(), rtol=1e-6, atol=0)
    plain = rope_inv_freq(DrafterConfig(**dict(CFG, head_dim=16, rope_theta=500000.0)), torch.float64)
    assert not torch.allclose(plain, ref.double())


def test_single_step_matches_naive():
    """forward_step over a whole prefix (the step-0 'extend') == naive docs/contract.md §8, and
    draft_logits == lm_head(norm(m))."""
    d = make_drafter()
    W, cfg = weights(d), d.config
    aux, ids, _ = batch(d, B=1, T=9, lengths=(9,))
    T = 9
    h = aux[0] @ W["fc.weight"].T
    e = W["embed_tokens.weight"][ids[0]]
    pos = torch.arange(T) + 3
    q, k, v = n_qkv(W, cfg, e, h, pos)
    o = n_attend(cfg, q, k, v, torch.ones(T, T, dtype=torch.bool).tril())
    m_ref = n_finish(W, cfg, o, h)

    m, (kc, vc) = d.forward_step(d.project_aux(aux), ids, pos[None])
    torch.testing.assert_close(m[0], m_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(d.draft_logits(m)[0], n_logits(W, cfg, m_ref), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(kc[0].transpose(0, 1), k, rtol=1e-10, atol=1e-10)  # cache holds post-RoPE keys
    # and the order of the concatenation matters: swapping embedding/hidden must change the result
    x_sw = torch.cat([n_rms(h, W["midlayer.hidden_norm.weight"], 1e-6),
                      n_rms(e, W["midlayer.input_layernorm.weight"], 1e-6)], -1)
    assert not torch.allclose(x_sw, torch.cat([n_rms(e, W["midlayer.input_layernorm.weight"], 1e-6),
                                               n_rms(h, W["midlayer.hidden_norm.weight"], 1e-6)], -1))


@pytest.mark.parametrize("kv_heads", [2, 4, 1])
def test_ttt_matches_dense_reference(kv_heads):
    d = make_drafter(num_key_value_heads=kv_heads)
    aux, ids, am = batch(d)
    K = 4
    outs = d.ttt_forward(aux, ids, am, steps=K)
    ref = ttt_reference(d, aux, ids, am, K)
    assert len(outs) == K
    real = am.bool()
    for j in range(K):
        assert outs[j].shape == (2, 11, 32)
        assert torch.isfinite(outs[j]).all()
        torch.testing.assert_close(outs[j][real], ref[j][real], rtol=1e-9, atol=1e-9)
    assert not torch.allclose(outs[1][real], outs[0][real])


def test_ttt_more_steps_than_tokens():
    d = make_drafter()
    aux, ids, am = batch(d, B=2, T=3, lengths=(3, 2))
    outs = d.ttt_forward(aux, ids, am, steps=5)
    ref = ttt_reference(d, aux, ids, am, 5)
    for j in range(5):
        torch.testing.assert_close(outs[j][am.bool()], ref[j][am.bool()], rtol=1e-9, atol=1e-9)


def test_ttt_equals_chain_drafting_with_kv_cache():
    """TTT step j at position t == inference: extend the prefix 0..t at step 0, then feed back m and the next token
    at position t+j with the cache holding step 0's keys and the previous draft steps' keys."""
    for dtype, tol in ((torch.float64, 1e-10), (torch.float32, 2e-5)):
        d = make_drafter(dtype=dtype)
        aux, ids, am = batch(d, lengths=(11, 9))
        aux = aux.to(dtype)
        K = 4
        outs = d.ttt_forward(aux, ids, am, steps=K)
        for b, t in ((0, 0), (0, 3), (0, 6), (1, 4)):
            h = d.project_aux(aux[b:b + 1, : t + 1])
            m, kv = d.forward_step(h, ids[b:b + 1, 1: t + 2], torch.arange(t + 1)[None])
            torch.testing.assert_close(m[0, -1], outs[0][b, t], rtol=tol, atol=tol)
            for j in range(1, K):
                m, kv = d.forward_step(m[:, -1:], ids[b:b + 1, t + 1 + j: t + 2 + j], torch.tensor([[t + j]]), kv)
                assert kv[0].shape[2] == t + 1 + j
                torch.testing.assert_close(m[0, -1], outs[j][b, t], rtol=tol, atol=tol)


def test_forward_step_block_with_cache_equals_one_at_a_time():
    d = make_drafter()
    aux, ids, _ = batch(d, B=1, T=10, lengths=(10,))
    h = d.project_aux(aux)
    pos = torch.arange(10)[None]
    full, _ = d.forward_step(h, ids, pos)
    m1, kv = d.forward_step(h[:, :4], ids[:, :4], pos[:, :4])
    m2, kv = d.forward_step(h[:, 4:], ids[:, 4:], pos[:, 4:], kv)
    torch.testing.assert_close(torch.cat([m1, m2], 1), full, rtol=1e-10, atol=1e-10)


def test_causal_plus_diagonal_low_precision():
    """The sink merge stays accurate in bf16 with large scores (the hi/lo split of lse)."""
    g = torch.Generator().manual_seed(3)
    B, nh, nkv, T, dd, j = 2, 4, 2, 16, 16, 3
    q = torch.randn(B, nh, T, dd, generator=g, dtype=torch.float64) * 3
    k0, v0 = (torch.randn(B, nkv, T, dd, generator=g, dtype=torch.float64) * 3 for _ in range(2))
    dk = [torch.randn(B, nkv, T, dd, generator=g, dtype=torch.float64) * 3 for _ in range(j)]
    dv = [torch.randn(B, nkv, T, dd, generator=g, dtype=torch.float64) for _ in range(j)]
    scale = dd ** -0.5
    # dense reference
    rep = nh // nkv
    keys = torch.cat([k0] + dk, 2).repeat_interleave(rep, 1)
    vals = torch.cat([v0] + dv, 2).repeat_interleave(rep, 1)
    allowed = torch.zeros(T, (j + 1) * T, dtype=torch.bool)
    allowed[:, :T] = torch.ones(T, T, dtype=torch.bool).tril()
    for i in range(1, j + 1):
        allowed[torch.arange(T), i * T + torch.arange(T)] = True
    sc = (q @ keys.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
    ref = torch.softmax(sc, -1) @ vals
    torch.testing.assert_close(attention_causal_plus_diagonal(q, k0, v0, dk, dv, scale), ref, rtol=1e-12, atol=1e-12)
    bf = [x.bfloat16() for x in (q, k0, v0)]
    lo = attention_causal_plus_diagonal(*bf, [x.bfloat16() for x in dk], [x.bfloat16() for x in dv], scale).double()
    # no worse than plain bf16 attention with the dense mask
    dense = torch.nn.functional.scaled_dot_product_attention(bf[0], keys.bfloat16(), vals.bfloat16(),
                                                             attn_mask=allowed, scale=scale).double()
    err, err_dense = ((x - ref).abs().max() / ref.abs().max() for x in (lo, dense))
    assert err < 1.5 * err_dense + 1e-3, (err, err_dense)


def test_ttt_rejects_left_padding():
    d = make_drafter()
    aux, ids, am = batch(d)
    with pytest.raises(ValueError):
        d.ttt_forward(aux, ids, am.flip(1), steps=2)


def test_ttt_low_precision_close_to_reference():
    import copy
    d = make_drafter()
    aux, ids, am = batch(d)
    ref = ttt_reference(d, aux, ids, am, 3)
    real = am.bool()
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        dl = copy.deepcopy(d).to(dtype)
        outs = dl.ttt_forward(aux.to(dtype), ids, am, steps=3)
        for j in range(3):
            assert outs[j].dtype == dtype
            err = (outs[j][real].double() - ref[j][real]).norm() / ref[j][real].norm()
            assert err < tol, (dtype, j, err)


def test_activation_checkpointing_gives_the_same_gradients():
    torch.manual_seed(0)
    cfg = DrafterConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                        intermediate_size=64, vocab_size=50, draft_vocab_size=50, target_hidden_size=32)
    d = Eagle3Drafter(cfg).double()
    aux = torch.randn(2, 9, 3 * 32, dtype=torch.float64)
    ids = torch.randint(0, 50, (2, 9))
    grads, calls = [], []
    n_mlp = [0]
    mlp_forward = d.midlayer.mlp.forward

    def counted(x):  # (module hooks are muted during checkpoint recomputation; count the calls themselves)
        n_mlp[0] += 1
        return mlp_forward(x)
    d.midlayer.mlp.forward = counted
    for ckpt in (False, True):
        d.zero_grad()
        d.activation_checkpointing = ckpt
        n_mlp[0] = 0
        sum(m.square().sum() for m in d.ttt_forward(aux, ids, steps=3)).backward()
        calls.append(n_mlp[0])
        grads.append({n: p.grad.clone() for n, p in d.named_parameters() if p.grad is not None})
    assert calls == [3, 6], "with checkpointing the MLP is recomputed in backward"
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 5
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n])
