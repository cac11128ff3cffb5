"""Teacher, EAGLE-3 TTT loss and metrics against naive float64 references (docs/contract.md §9)."""

from __future__ import annotations

import math

import pytest
import torch

from eagle3.model import DrafterConfig, Eagle3Drafter
from eagle3.train.loss import acceptance_length, eagle3_loss, summarize, teacher

V, DV, HT = 50, 20, 24
CFG = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48,
           vocab_size=V, draft_vocab_size=DV, target_hidden_size=HT, rms_norm_eps=1e-6, rope_theta=50.0)


def make_drafter(seed=0, dtype=torch.float64, draft_ids=None) -> Eagle3Drafter:
    torch.manual_seed(seed)
    d = Eagle3Drafter(DrafterConfig(**CFG)).to(dtype)
    with torch.no_grad():
        for name, p in d.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (1.0 / math.sqrt(p.shape[-1]) if p.dim() == 2 else 1))
    ids = torch.randperm(V)[:DV].sort().values if draft_ids is None else torch.as_tensor(draft_ids)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    d.set_vocab_map(ids - torch.arange(DV), t2d)
    return d


def naive_loss(d, step_outputs, target_hidden, W, loss_mask, attention_mask, decay=0.8):
    """Per-(b, t, j) loop: the literal statement of the alignment and masking rules."""
    draft_ids = d.t2d.nonzero().squeeze(-1).tolist()
    nw, lw, eps = d.norm.weight.detach().double(), d.lm_head.weight.detach().double(), d.config.rms_norm_eps
    B, T = loss_mask.shape
    K = len(step_outputs)
    ce_sum, correct, count = [0.0] * K, [0.0] * K, [0] * K
    for j in range(K):
        for b in range(B):
            for t in range(T):
                p = t + 2 + j
                if p >= T or not loss_mask[b, p] or not attention_mask[b, : p + 1].all():
                    continue
                logits = W.double() @ target_hidden[b, p - 1].double()
                a = int(logits.argmax())
                if a not in draft_ids:
                    continue
                pt = torch.softmax(logits[draft_ids], -1)
                m = step_outputs[j][b, t].detach().double()
                dl = (nw * m / torch.sqrt((m * m).mean() + eps)) @ lw.T
                ce_sum[j] += float(-(pt * torch.log_softmax(dl, -1)).sum())
                correct[j] += float(int(dl.argmax()) == draft_ids.index(a))
                count[j] += 1
    loss = sum(decay ** j * ce_sum[j] / max(count[j], 1) for j in range(K))
    return loss, ce_sum, correct, count


def data(B=2, T=12, K=4, seed=1, lengths=(12, 8)):
    g = torch.Generator().manual_seed(seed)
    th = torch.randn(B, T, HT, generator=g, dtype=torch.float64)
    W = torch.randn(V, HT, generator=g, dtype=torch.float64)
    ids = torch.randint(1, V, (B, T), generator=g)
    am = torch.zeros(B, T, dtype=torch.long)
    for b, n in enumerate(lengths):
        am[b, :n] = 1
    lm = (torch.rand(B, T, generator=g) < 0.7).long() * am
    ms = [torch.randn(B, T, CFG["hidden_size"], generator=g, dtype=torch.float64, requires_grad=True) for _ in range(K)]
    return th, W, ids, lm, am, ms


# --------------------------------------------------------------------------------------------- teacher

@pytest.mark.parametrize("chunk", [1, 4, 7, 37, 100])
def test_teacher_chunked_equals_full_reference(chunk):
    g = torch.Generator().manual_seed(0)
    N = 37
    h = torch.randn(N, HT, generator=g, dtype=torch.float64)
    W = torch.randn(V, HT, generator=g, dtype=torch.float64)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[torch.randperm(V, generator=g)[:DV]] = True
    draft_ids = t2d.nonzero().squeeze(-1)

    logits = h @ W.T
    am = logits.argmax(-1)
    ref_p = torch.softmax(logits[:, draft_ids], -1)
    ref_in = t2d[am]
    assert ref_in.any() and not ref_in.all()

    p, in_vocab, tgt = teacher(h, W, t2d, chunk_tokens=chunk)
    torch.testing.assert_close(p, ref_p, rtol=1e-12, atol=1e-12)
    assert torch.equal(in_vocab, ref_in)
    assert torch.equal(draft_ids[tgt[in_vocab]], am[in_vocab])  # draft id -> target id round trip
    torch.testing.assert_close(p.sum(-1), torch.ones(N, dtype=torch.float64))

    p32, in32, tgt32 = teacher(h.float(), W.float(), t2d, chunk_tokens=chunk)
    assert p32.dtype == torch.float32
    torch.testing.assert_close(p32.double(), ref_p, rtol=1e-4, atol=1e-5)
    assert torch.equal(in32, ref_in) and torch.equal(tgt32[in32], tgt[in_vocab])


# --------------------------------------------------------------------------------------------- loss

@pytest.mark.parametrize("chunk", [1000, 5])
def test_loss_equals_naive_loop(chunk):
    d = make_drafter()
    th, W, ids, lm, am, ms = data()
    loss, met = eagle3_loss(d, ms, th, W, ids, lm, am, chunk_tokens=chunk)
    ref, ce, correct, count = naive_loss(d, ms, th, W, lm, am)
    assert min(count) > 0 and max(correct) > 0
    torch.testing.assert_close(loss, torch.tensor(ref, dtype=loss.dtype), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(met["ce_sum"], torch.tensor(ce, dtype=torch.float64), rtol=1e-10, atol=1e-10)
    assert met["correct"].tolist() == correct
    assert met["count"].tolist() == [float(c) for c in count]
    for j in range(4):
        torch.testing.assert_close(met[f"loss_{j}"], torch.tensor(ce[j] / count[j], dtype=torch.float64))
        torch.testing.assert_close(met[f"acc_{j}"], torch.tensor(correct[j] / count[j], dtype=torch.float64))
    assert met["acceptance_length"] == pytest.approx(acceptance_length(correct, count))


def test_chunked_loss_gradients_equal_unchunked():
    d = make_drafter()
    th, W, ids, lm, am, ms = data()
    grads = []
    for chunk in (1000, 3):
        d.zero_grad()
        for m in ms:
            m.grad = None
        loss, _ = eagle3_loss(d, ms, th, W, ids, lm, am, chunk_tokens=chunk)
        loss.backward()
        grads.append([d.lm_head.weight.grad.clone(), d.norm.weight.grad.clone()] + [m.grad.clone() for m in ms])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_masking_rules_by_hand():
    """B=1, T=6, K=2. Targets' argmax is rigged: u=1 -> id 2 (draft), u=2 -> 3 (not draft), u=3 -> 4, u=4 -> 6."""
    draft_ids = list(range(0, 40, 2))
    d = make_drafter(draft_ids=draft_ids)
    W = 5 * torch.eye(V, dtype=torch.float64)  # lm_head [V, Ht=V]
    argmax_at = {0: 8, 1: 2, 2: 3, 3: 4, 4: 6, 5: 10}
    th = 0.01 * torch.randn(1, 6, V, dtype=torch.float64)
    for u, a in argmax_at.items():
        th[0, u, a] = 1.0
    ids = torch.arange(1, 7)[None]
    am = torch.tensor([[1, 1, 1, 1, 1, 0]])
    lm = torch.tensor([[0, 0, 1, 1, 1, 1]])
    ms = [torch.randn(1, 6, 32, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    # step 0 (p = t+2): t=0 p=2 ok; t=1 p=3 teacher u=2 out of vocab; t=2 p=4 ok; t=3 p=5 padded.
    # step 1 (p = t+3): t=0 p=3 out of vocab; t=1 p=4 ok; t=2 p=5 padded.
    _, met = eagle3_loss(d, ms, th, W, ids, lm, am)
    assert met["count"].tolist() == [2.0, 1.0]
    _, met = eagle3_loss(d, ms, th, W, ids, torch.tensor([[0, 0, 1, 1, 0, 1]]), am)  # token 4 not trained on
    assert met["count"].tolist() == [1.0, 0.0]
    _, met = eagle3_loss(d, ms, th, W, ids, lm, torch.ones(1, 6, dtype=torch.long))  # unpadded: p=5 counts
    assert met["count"].tolist() == [3.0, 2.0]

    # excluded (t, j) pairs do not influence the loss; included ones do
    loss, _ = eagle3_loss(d, ms, th, W, ids, lm, am)
    loss.backward()
    g0, g1 = ms[0].grad[0].abs().sum(-1), ms[1].grad[0].abs().sum(-1)
    assert (g0 > 0).tolist() == [True, False, True, False, False, False]
    assert (g1 > 0).tolist() == [False, True, False, False, False, False]
    with torch.no_grad():
        ms2 = [m.clone() for m in ms]
        ms2[0][0, 1] += 5
        ms2[0][0, 3] += 5
        ms2[1][0, 0] += 5
    loss2, _ = eagle3_loss(d, ms2, th, W, ids, lm, am)
    assert loss2.item() == pytest.approx(loss.item(), rel=1e-12)
    with torch.no_grad():
        ms2[1][0, 1] += 5
    assert eagle3_loss(d, ms2, th, W, ids, lm, am)[0].item() != pytest.approx(loss.item(), rel=1e-6)


def test_end_to_end_gradients_and_frozen_embedding():
    d = make_drafter(dtype=torch.float32)
    g = torch.Generator().manual_seed(5)
    B, T = 2, 10
    aux = torch.randn(B, T, 3 * HT, generator=g)
    ids = torch.randint(1, V, (B, T), generator=g)
    am = torch.tensor([[1] * 10, [1] * 6 + [0] * 4])
    lm = am.clone()
    lm[:, :3] = 0
    th = torch.randn(B, T, HT, generator=g)
    W = torch.randn(V, HT, generator=g)
    outs = d.ttt_forward(aux, ids, am, steps=3)
    loss, met = eagle3_loss(d, outs, th, W, ids, lm, am)
    assert torch.isfinite(loss) and met["count"].min() > 0
    loss.backward()
    assert d.embed_tokens.weight.grad is None
    for n, p in d.named_parameters():
        if n.startswith("embed_tokens"):
            continue
        assert p.grad is not None and torch.isfinite(p.grad).all(), n
        assert p.grad.abs().sum() > 0, n

    # nothing to learn from: loss 0, backward still works
    d.zero_grad()
    outs = d.ttt_forward(aux, ids, am, steps=3)
    loss, met = eagle3_loss(d, outs, th, W, ids, torch.zeros_like(lm), am)
    loss.backward()
    assert loss.item() == 0 and met["count"].sum() == 0 and float(met["acceptance_length"]) == 1.0


def test_counts_pool_across_batches():
    """Sums from two half batches add up to the full batch (what an all-reduce across ranks does)."""
    d = make_drafter()
    th, W, ids, lm, am, ms = data()
    _, full = eagle3_loss(d, ms, th, W, ids, lm, am)
    parts = [eagle3_loss(d, [m[b:b + 1] for m in ms], th[b:b + 1], W, ids[b:b + 1], lm[b:b + 1], am[b:b + 1])[1]
             for b in range(2)]
    pooled = {k: parts[0][k] + parts[1][k] for k in ("ce_sum", "correct", "count")}
    for k, v in pooled.items():
        torch.testing.assert_close(v, full[k])
    s = summarize(**pooled)
    torch.testing.assert_close(s["acceptance_length"], full["acceptance_length"])
    torch.testing.assert_close(s["acc_per_step"], full["acc_per_step"])


def test_acceptance_length_by_hand():
    assert acceptance_length([8, 6, 3], [10, 10, 10]) == pytest.approx(1 + 0.8 + 0.8 * 0.6 + 0.8 * 0.6 * 0.3)
    assert acceptance_length([5, 0, 7], [10, 0, 10]) == pytest.approx(1.5)
    assert acceptance_length([0], [0]) == pytest.approx(1.0)
    t = acceptance_length(torch.tensor([10.0, 10.0]), torch.tensor([10.0, 10.0]))
    assert torch.is_tensor(t) and float(t) == pytest.approx(3.0)


def test_attention_mask_hole_and_teacher_once_per_position(monkeypatch):
    """A pair needs EVERY position up to the predicted token real; the teacher runs once per needed position."""
    import eagle3.train.loss as L
    seen = []
    real_teacher = L.teacher
    monkeypatch.setattr(L, "teacher", lambda h, *a, **k: (seen.append(h.shape[0]), real_teacher(h, *a, **k))[1])
    d = make_drafter(draft_ids=list(range(DV)))
    th = torch.randn(1, 8, HT, dtype=torch.float64)
    W = torch.zeros(V, HT, dtype=torch.float64)
    W[:DV] = torch.randn(DV, HT, dtype=torch.float64)  # every argmax is a draft token
    ms = [torch.randn(1, 8, 32, dtype=torch.float64) for _ in range(3)]
    ids = torch.ones(1, 8, dtype=torch.long)
    lm = torch.ones(1, 8, dtype=torch.long)
    _, met = L.eagle3_loss(d, ms, th, W, ids, lm, torch.ones(1, 8, dtype=torch.long))
    assert met["count"].tolist() == [6.0, 5.0, 4.0] and seen == [6]  # u = 1..6, shared by all steps
    am = torch.tensor([[1, 1, 1, 1, 0, 1, 1, 1]])  # position 4 not real: no pair may predict p >= 4
    _, met = L.eagle3_loss(d, ms, th, W, ids, lm, am)
    assert met["count"].tolist() == [2.0, 1.0, 0.0] and seen[-1] == 2  # p in {2, 3}
    ref = naive_loss(d, ms, th, W, lm, am)
    assert met["count"].tolist() == [float(c) for c in ref[3]]
