"""--loss lk / lk-hybrid (train/loss.py Objective, model/kernels.py's fused LK chunks) against a naive float64
statement of the LK losses (arXiv 2602.23881, SpecForge 0.2.0's lk_loss): per (b, t, j) loops, dense softmaxes, the
acceptance alpha = sum_v min(p_v, q_v) of each counted pair, its loss and its gradients by autograd through them."""

from __future__ import annotations

import math
import types

import pytest
import torch

from eagle3.model import kernels
from eagle3.train.loss import KL, Objective, eagle3_loss, eagle3_loss_fused

from test_loss import CFG, HT, data, make_drafter, naive_loss

TINY = torch.finfo(torch.float64).tiny  # below it (0 or subnormal) a pair adds nothing to lk: Objective's docstring
OBJECTIVES = {"lk": Objective("lk"), "lk-hybrid": Objective("lk-hybrid", kl_scale=0.7, kl_decay=2.5)}


def naive_lk(d, step_outputs, target_hidden, W, loss_mask, attention_mask, objective: Objective, decay=0.8):
    """The LK loss of one batch, written out pair by pair from the formulas, differentiable (autograd) in the step
    outputs and the drafter's norm / lm_head. Returns (loss, per-step lists: alphas of the counted pairs, ce sums)."""
    draft_ids = d.t2d.nonzero().squeeze(-1).tolist()
    nw, lw, eps = d.norm.weight, d.lm_head.weight, d.config.rms_norm_eps
    B, T = loss_mask.shape
    K = len(step_outputs)
    alphas, ces = [[] for _ in range(K)], [[] for _ in range(K)]
    for j in range(K):
        for b in range(B):
            for t in range(T):
                p = t + 2 + j                                   # the predicted token
                if p >= T or not loss_mask[b, p] or not attention_mask[b, : p + 1].all():
                    continue
                logits = W.double() @ target_hidden[b, p - 1].double()
                if int(logits.argmax()) not in draft_ids:       # the target's argmax outside the draft vocab
                    continue
                z = logits[draft_ids]
                pt = torch.exp(z - z.max()) / torch.exp(z - z.max()).sum()    # teacher: renormalised on the vocab
                m = step_outputs[j][b, t]
                dl = (nw * m / torch.sqrt((m * m).mean() + eps)) @ lw.T
                logq = dl - dl.max() - torch.log(torch.exp(dl - dl.max()).sum())   # finite where q underflows
                q = torch.exp(logq)
                alphas[j].append(sum(torch.minimum(pt[v], q[v]) for v in range(len(draft_ids))))
                ces[j].append(-(pt * logq).sum())
    total = 0.0
    for j in range(K):
        n = len(alphas[j])
        if n == 0:
            continue
        if objective.name == "lk":
            lj = sum(-torch.log(a) if float(a.detach()) >= TINY else 0.0 * a for a in alphas[j]) / n
        else:
            abar = sum(alphas[j]) / n
            # a number: no gradient through the weight
            w = objective.kl_scale * math.exp(-objective.kl_decay * float(abar.detach()))
            lj = w * sum(ces[j]) / n + (1 - w) * (1 - abar)
        total = total + decay ** j * lj
    return total, alphas, ces


def run(variant: str, d, ms, th, W, ids, lm, am, objective, chunk):
    """(loss, metrics, grads [lm_head, norm, *step outputs]) of one loss path."""
    d.zero_grad()
    for m in ms:
        m.grad = None
    kw = {} if objective is None else {"objective": objective}   # None: the callers' default (kl)
    if variant == "plain":
        loss, met = eagle3_loss(d, ms, th, W, ids, lm, am, chunk_tokens=chunk, **kw)
    elif variant == "fused":
        loss, met = eagle3_loss_fused(d, ms, th, ids, lm, am, chunk_tokens=chunk, lm_head_weight=W, **kw)
    else:  # the dump's full-vocab argmax with the draft rows of the target head (the teacher computed by rows)
        loss, met = eagle3_loss_fused(d, ms, th, ids, lm, am, chunk_tokens=chunk, target_argmax=(th @ W.T).argmax(-1),
                                      draft_head_weight=W[d.t2d], **kw)
    loss.backward()
    return loss.detach(), met, [d.lm_head.weight.grad.clone(), d.norm.weight.grad.clone()] + [m.grad.clone()
                                                                                             for m in ms]


def naive_grads(d, ms, th, W, lm, am, objective):
    d.zero_grad()
    for m in ms:
        m.grad = None
    loss, alphas, ces = naive_lk(d, ms, th, W, lm, am, objective)
    loss.backward()
    return loss.detach(), alphas, ces, [d.lm_head.weight.grad.clone(), d.norm.weight.grad.clone()] + [
        m.grad.clone() for m in ms]


def peaked(head_scale, teacher_scale, seed=6):
    """The test batch with a sharper draft head and teacher: many pairs' acceptance far below 1."""
    d = make_drafter()
    with torch.no_grad():
        d.lm_head.weight.mul_(head_scale)
    th, W, ids, lm, am, ms = data(B=2, T=16, lengths=(16, 11), seed=seed)
    return d, th * teacher_scale, W, ids, lm, am, ms


@pytest.mark.parametrize("variant", ["plain", "fused", "fused_argmax"])
@pytest.mark.parametrize("name", ["lk", "lk-hybrid"])
@pytest.mark.parametrize("chunk", [1000, 5])
def test_lk_losses_and_gradients_equal_the_naive_loop(variant, name, chunk):
    """Both paths, chunked (5 < the pairs per step: several chunks, and on the fused path several teacher windows)
    or not, on padding, a loss mask, a draft vocab of 20 of the target's 50 tokens (pairs whose target argmax lies
    outside it are dropped) and pairs whose acceptance ranges from ~1e-6 to ~0.9."""
    d, th, W, ids, lm, am, ms = peaked(4.0, 3.0)
    objective = OBJECTIVES[name]
    ref, alphas, ces, g_ref = naive_grads(d, ms, th, W, lm, am, objective)
    flat = [float(a.detach()) for aj in alphas for a in aj]
    assert min(len(aj) for aj in alphas) > 5 and min(flat) < 1e-6 and max(flat) > 0.5, sorted(flat)
    loss, met, g = run(variant, d, ms, th, W, ids, lm, am, objective, chunk)
    torch.testing.assert_close(loss, ref.to(loss.dtype), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(met["alpha_sum"], torch.tensor([float(sum(a).detach()) for a in alphas],
                                                             dtype=torch.float64),
                               rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(met["ce_sum"], torch.tensor([float(sum(c).detach()) for c in ces],
                                                          dtype=torch.float64),
                               rtol=1e-10, atol=1e-12)
    assert met["count"].tolist() == [float(len(a)) for a in alphas]
    torch.testing.assert_close(met["alpha_per_step"], met["alpha_sum"] / met["count"])
    for name_, a, b in zip(["lm_head", "norm"] + [f"m{j}" for j in range(len(ms))], g, g_ref):
        assert b.abs().max() > 0, name_
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12, msg=name_)


@pytest.mark.parametrize("name", ["lk", "lk-hybrid"])
def test_pairs_with_zero_acceptance_add_nothing_and_get_no_gradient(name):
    """A head and a teacher so sharp that softmaxes underflow in float64: pairs whose argmaxes differ have alpha
    exactly 0, subnormal (1/alpha = inf), or as small as 1e-277. The first two add 0 to lk's -log(alpha) (SpecForge's
    convention for 0) with a zero, not NaN, gradient; every path agrees with the naive loop on the loss and on
    every gradient, all finite."""
    d, th, W, ids, lm, am, ms = peaked(300.0, 300.0)
    objective = OBJECTIVES[name]
    ref, alphas, _, g_ref = naive_grads(d, ms, th, W, lm, am, objective)
    flat = [float(a.detach()) for aj in alphas for a in aj]
    # an in-process train() earlier in the session sets torch.set_flush_denormal(True), which makes subnormals 0
    flushed = float(torch.tensor(TINY, dtype=torch.float64) / 4) == 0.0
    assert flat.count(0.0) >= 3 and (flushed or any(0 < a < TINY for a in flat)), flat
    assert any(TINY < a < 1e-250 for a in flat) and any(a > 0.5 for a in flat), flat
    assert all(torch.isfinite(x).all() for x in g_ref)
    for variant in ("plain", "fused", "fused_argmax"):
        loss, met, g = run(variant, d, ms, th, W, ids, lm, am, objective, 5)
        assert torch.isfinite(loss) and all(torch.isfinite(x).all() for x in g), variant
        torch.testing.assert_close(loss, ref.to(loss.dtype), rtol=1e-10, atol=1e-12)
        for a, b in zip(g, g_ref):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_kl_is_unchanged_and_reports_the_naive_alpha():
    """--loss kl (the default): the loss, metrics and gradients are exactly those of not passing an objective, the
    loss is still the naive soft cross-entropy's, and the new alpha_sum metric is the naive sum of acceptances, on
    both paths."""
    d, th, W, ids, lm, am, ms = peaked(4.0, 3.0)
    ref_kl = naive_loss(d, ms, th, W, lm, am)[0]
    _, alphas, _ = naive_lk(d, ms, th, W, lm, am, OBJECTIVES["lk"])
    want = torch.tensor([float(sum(a).detach()) for a in alphas], dtype=torch.float64)
    for variant in ("plain", "fused", "fused_argmax"):
        loss, met, g = run(variant, d, ms, th, W, ids, lm, am, KL, 5)
        torch.testing.assert_close(loss, torch.tensor(ref_kl, dtype=loss.dtype), rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(met["alpha_sum"], want, rtol=1e-10, atol=1e-12)
        loss0, met0, g0 = run(variant, d, ms, th, W, ids, lm, am, None, 5)   # no objective passed
        assert torch.equal(loss0, loss) and all(torch.equal(a, b) for a, b in zip(g0, g))
        assert all(torch.equal(met0[k], met[k]) for k in ("ce_sum", "correct", "count", "alpha_sum"))


@pytest.mark.parametrize("name", ["kl", "lk", "lk-hybrid"])
def test_fused_equals_plain_through_the_drafter(name):
    """The whole unroll (ttt_forward, fast and plain) with each objective: every drafter parameter's gradient, the
    loss and the metrics agree in float64, with the fused head taken in chunks of 7 tokens (several chunks)."""
    from test_drafter import batch
    from test_drafter import make_drafter as make_unroll_drafter
    objective = OBJECTIVES.get(name, KL)
    d = make_unroll_drafter()
    aux, ids, am = batch(d)
    g = torch.Generator().manual_seed(3)
    B, T = ids.shape
    th = torch.randn(B, T, d.config.target_hidden_size, generator=g, dtype=torch.float64) * 2
    W = torch.randn(d.config.vocab_size, d.config.target_hidden_size, generator=g, dtype=torch.float64)
    lm = (torch.rand(B, T, generator=g) < 0.8).long() * am
    results = []
    for fast in (False, True):
        d.zero_grad()
        outs = d.ttt_forward(aux, ids, am, steps=4, fast=fast)
        if fast:
            loss, met = eagle3_loss_fused(d, outs, th, ids, lm, am, chunk_tokens=7, lm_head_weight=W,
                                          objective=objective)
        else:
            loss, met = eagle3_loss(d, outs, th, W, ids, lm, am, chunk_tokens=7, objective=objective)
        loss.backward()
        results.append((loss.detach(), met, {n: p.grad.clone() for n, p in d.named_parameters()
                                             if p.grad is not None}))
    (lp, mp, gp), (lf, mf, gf) = results
    assert mp["count"].min() > 0
    torch.testing.assert_close(lf, lp, rtol=1e-10, atol=1e-12)
    for k in ("ce_sum", "alpha_sum", "count", "correct"):
        torch.testing.assert_close(mf[k], mp[k], rtol=1e-10, atol=1e-12, msg=k)
    assert set(gp) == set(gf) and len(gp) > 5
    for n in gp:
        torch.testing.assert_close(gf[n], gp[n], rtol=1e-9, atol=1e-12, msg=n)


def test_fused_lk_chunks_give_the_gradient_of_their_formulas():
    """kernels._lk_chunk / _hybrid_chunk (the per-row gradients computed in forward) against autograd of the
    formulas written directly on one [rows, vocab] block, alpha near 0 and exactly 0 (underflow) included; and
    linear_alpha_sums against the same alpha."""
    gen = torch.Generator().manual_seed(11)
    n, v = 9, 13
    logits = torch.randn(n, v, generator=gen, dtype=torch.float64) * 4
    logits[0] *= 300                                           # q one-hot ...
    tz = torch.randn(n, v, generator=gen, dtype=torch.float64) * 3
    tz[0] = -logits[0]                                         # ... and p one-hot on another token: alpha == 0
    p = torch.softmax(tz, -1)
    ok = torch.tensor([True] * 7 + [False] * 2)
    w_ce, w_a = torch.rand(n, generator=gen, dtype=torch.float64), torch.rand(n, generator=gen, dtype=torch.float64)
    tgt = p.argmax(-1)

    def alpha_of(z):
        return torch.minimum(p, torch.softmax(z, -1)).sum(-1)
    z = logits.clone().requires_grad_(True)
    a = alpha_of(z)
    a_det = a.detach()
    assert float(a_det[0]) == 0.0 and float(a_det[1:].min()) > TINY
    lk_ref = (w_a * torch.where(a > 0, -torch.log(a.clamp(min=1e-300)), 0)).sum()
    g_lk, = torch.autograd.grad(lk_ref, z, retain_graph=True)
    ce = -(p * torch.log_softmax(z, -1)).sum(-1)
    hy_ref = (w_ce * ce).sum() - (w_a * a).sum()
    g_hy, = torch.autograd.grad(hy_ref, z)
    a_ok = torch.where(ok, a, 0).sum()

    loss, ce_ok, hits, alpha_ok, g = kernels._lk_chunk(logits, p, w_a, ok, tgt)
    torch.testing.assert_close(loss, lk_ref.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g, g_lk, rtol=1e-10, atol=1e-13)
    assert float(g[0].abs().max()) == 0.0
    torch.testing.assert_close(alpha_ok, a_ok.detach(), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(ce_ok, torch.where(ok, ce, 0).sum().detach(), rtol=1e-12, atol=1e-12)
    assert int(hits) == int(((logits.argmax(-1) == tgt) & ok).sum())
    loss, _, _, alpha_ok, g = kernels._hybrid_chunk(logits, p, w_ce, w_a, ok, tgt)
    torch.testing.assert_close(loss, hy_ref.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g, g_hy, rtol=1e-10, atol=1e-13)
    # the kl chunk's alpha metric, and the lk-hybrid pre-pass, over a whole [K, N] layout in chunks of 4 rows
    assert torch.allclose(kernels._soft_ce_chunk(logits, p, w_ce, ok, tgt)[3], a_ok.detach(), rtol=1e-12)
    H = 6
    weight = torch.randn(v, H, generator=gen, dtype=torch.float64)
    xs = [torch.randn(n, H, generator=gen, dtype=torch.float64) for _ in range(2)]
    rows = torch.stack([torch.arange(n).clamp(max=n - 1), (torch.arange(n) + 1).clamp(max=n - 1)])
    valid = torch.stack([ok, ok.roll(3)])
    got = kernels.linear_alpha_sums(xs, weight, p, n, rows, valid, 4)
    want = torch.stack([torch.where(valid[j], torch.minimum(p[rows[j]], torch.softmax(xs[j] @ weight.T, -1))
                                    .sum(-1), 0).sum() for j in range(2)])
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


def test_hybrid_weight_is_the_pooled_one_across_a_split_batch():
    """Two halves of a batch whose per-step counts and alpha sums are pooled (what sequence parallel's all-reduce
    does, here by summing the other half's sums in): their lk-hybrid losses and gradients add up to the whole
    batch's, on both paths. Pooling the counts without the alphas is refused."""
    d, th, W, ids, lm, am, ms = peaked(4.0, 3.0)
    objective = OBJECTIVES["lk-hybrid"]
    halves = [slice(0, 1), slice(1, 2)]
    for fused in (False, True):
        def call(sl, **kw):
            args = ([m[sl] for m in ms], th[sl])
            if fused:
                return eagle3_loss_fused(d, *args, ids[sl], lm[sl], am[sl], chunk_tokens=5, lm_head_weight=W,
                                         objective=objective, **kw)
            return eagle3_loss(d, *args, W, ids[sl], lm[sl], am[sl], chunk_tokens=5, objective=objective, **kw)
        with torch.no_grad():
            parts = [call(sl)[1] for sl in halves]
        d.zero_grad()
        for m in ms:
            m.grad = None
        whole, _ = call(slice(0, 2))
        whole.backward()
        g_whole = [d.lm_head.weight.grad.clone()] + [m.grad.clone() for m in ms]
        d.zero_grad()
        for m in ms:
            m.grad = None
        total = 0
        for i, sl in enumerate(halves):
            other = parts[1 - i]
            loss, _ = call(sl, reduce_counts=lambda c, o=other: c + o["count"],
                           reduce_alpha=lambda a, o=other: a + o["alpha_sum"])
            loss.backward()
            total = total + loss.detach()
        torch.testing.assert_close(total, whole.detach(), rtol=1e-11, atol=1e-12)
        for a, b in zip([d.lm_head.weight.grad] + [m.grad for m in ms], g_whole):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
        with pytest.raises(ValueError, match="reduce_alpha"):
            call(halves[0], reduce_counts=lambda c: c)


def test_no_grad_hybrid_loss_equals_the_grad_one():
    """Held-out evaluation runs the fused loss without grad, where lk-hybrid takes its value from the sums alone
    (no pre-pass): the same number as the training pass's."""
    d, th, W, ids, lm, am, ms = peaked(4.0, 3.0)
    objective = OBJECTIVES["lk-hybrid"]
    with torch.no_grad():
        a, ma = eagle3_loss_fused(d, ms, th, ids, lm, am, chunk_tokens=5, lm_head_weight=W, objective=objective)
    b, mb = eagle3_loss_fused(d, ms, th, ids, lm, am, chunk_tokens=5, lm_head_weight=W, objective=objective)
    torch.testing.assert_close(a, b.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ma["alpha_sum"], mb["alpha_sum"], rtol=1e-12, atol=1e-14)


def test_objective_refuses_bad_settings_by_name():
    with pytest.raises(ValueError, match="loss 'lk2'"):
        Objective("lk2")
    with pytest.raises(ValueError, match="kl_scale -0.5"):
        Objective("lk-hybrid", kl_scale=-0.5)
    with pytest.raises(ValueError, match="kl_decay inf"):
        Objective("lk-hybrid", kl_decay=float("inf"))
    with pytest.raises(ValueError, match="row_weights"):
        kernels.linear_soft_cross_entropy([torch.zeros(2, 3)], torch.zeros(4, 3), torch.zeros(2, 4),
                                          torch.zeros(2, dtype=torch.long), torch.zeros(1, 2, dtype=torch.long),
                                          torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool),
                                          alpha_weights=torch.zeros(1, 2), log_alpha=True)


# ------------------------------------------------------------------------------------------------ SpecForge

def test_one_step_matches_specforge_lk_loss():
    """SpecForge 0.2.0's own compute_acceptance_rate + compute_lk_loss ('alpha' and 'lambda') on the counted pairs
    of one step, given our teacher rows as its target probabilities (its fp32 softmax: fp32 agreement)."""
    lk = pytest.importorskip("specforge.core.lk_loss")
    d, th, W, ids, lm, am, ms = peaked(4.0, 3.0)
    ms = ms[:1]
    _, alphas, ces = naive_lk(d, ms, th, W, lm, am, OBJECTIVES["lk"])
    # the counted pairs' draft logits and teacher rows, gathered as the naive loop walks them
    draft_ids = d.t2d.nonzero().squeeze(-1)
    logits, probs = [], []
    for b in range(lm.shape[0]):
        for t in range(lm.shape[1] - 2):
            p = t + 2
            if not lm[b, p] or not am[b, : p + 1].all():
                continue
            full = W @ th[b, p - 1]
            if not bool(d.t2d[full.argmax()]):
                continue
            logits.append(d.draft_logits(ms[0][b, t][None]).detach()[0])
            probs.append(torch.softmax(full[draft_ids], -1))
    logits, probs = torch.stack(logits), torch.stack(probs)
    assert logits.shape[0] == len(alphas[0])
    mask = torch.ones(logits.shape[0], 1)
    acc, log_acc = lk.compute_acceptance_rate(logits=logits, target_probs=probs, position_mask=mask)
    kl = torch.tensor(float(sum(ces[0]).detach()) / len(ces[0]))
    for name, sf in (("lk", "alpha"), ("lk-hybrid", "lambda")):
        o = OBJECTIVES[name]
        want = lk.compute_lk_loss(kl_loss=kl, acceptance_rate=acc, log_acceptance_rate=log_acc, lk_loss_type=sf,
                                  kl_scale=o.kl_scale, kl_decay=o.kl_decay)
        got, met = eagle3_loss(d, ms, th, W, ids, lm, am, objective=o)
        torch.testing.assert_close(got.detach().float(), want.float(), rtol=2e-5, atol=1e-6)
        torch.testing.assert_close(met["alpha_per_step"][0].float(), acc.float(), rtol=2e-5, atol=1e-7)


# ------------------------------------------------------------------------------------------------ config, trainer

def test_loss_flags_parse_show_their_defaults_and_refuse_bad_values():
    from eagle3.train.config import TrainConfig
    from test_train_config import parse, train_subparser
    cfg = parse("--dump", "d", "--target", "t", "--loss", "lk-hybrid", "--lk-kl-scale", "0.5", "--lk-kl-decay", "3")
    assert (cfg.loss, cfg.lk_kl_scale, cfg.lk_kl_decay) == ("lk-hybrid", 0.5, 3.0)
    assert parse("--dump", "d", "--target", "t").loss == "kl"
    help_text = " ".join(train_subparser().format_help().split())
    assert "--loss {kl,lk,lk-hybrid}" in help_text and "(default: kl)" in help_text
    assert "--lk-kl-scale" in help_text and "--lk-kl-decay" in help_text and "(default: 1.0)" in help_text
    with pytest.raises(SystemExit):  # argparse's own refusal names the flag and its choices
        parse("--dump", "d", "--target", "t", "--loss", "acceptance")
    with pytest.raises(ValueError, match="--loss 'acceptance'"):  # a --config YAML value, past argparse
        TrainConfig(loss="acceptance")
    with pytest.raises(ValueError, match="--lk-kl-scale -1"):
        TrainConfig(loss="lk-hybrid", lk_kl_scale=-1)
    with pytest.raises(ValueError, match="--lk-kl-decay nan"):
        TrainConfig(loss="lk-hybrid", lk_kl_decay=float("nan"))
    with pytest.raises(ValueError, match="--loss lk has none"):
        TrainConfig(loss="lk", lk_kl_scale=0.5)


def test_a_resume_refuses_another_loss_and_reads_a_record_without_one_as_kl():
    from eagle3.train.config import TrainConfig
    from eagle3.train.checkpoint import resume_changes

    def old(**train):
        return types.SimpleNamespace(identity={}, data_sha256="d", world_size=1, train=train)
    recorded = {k: v for k, v in TrainConfig().to_dict().items()}
    recorded = dict(recorded, betas=list(recorded["betas"]))
    assert resume_changes("run.json", old(**recorded), TrainConfig(max_steps=9), {}, "d", 1) == \
        {"max_steps": [None, 9]}
    for cfg, flag in ((TrainConfig(loss="lk"), "--loss: 'kl' -> 'lk'"),
                      (TrainConfig(loss="lk-hybrid", lk_kl_decay=2.0), "--lk-kl-decay: 1.0 -> 2.0")):
        with pytest.raises(ValueError, match=flag):
            resume_changes("run.json", old(**recorded), cfg, {}, "d", 1)
    # a run recorded before --loss existed trained with the soft cross-entropy: resumable as kl, not as lk
    before = {k: v for k, v in recorded.items() if k not in ("loss", "lk_kl_scale", "lk_kl_decay")}
    assert resume_changes("run.json", old(**before), TrainConfig(), {}, "d", 1) == {}
    with pytest.raises(ValueError, match="--loss: 'kl' -> 'lk'"):
        resume_changes("run.json", old(**before), TrainConfig(loss="lk"), {}, "d", 1)


@pytest.mark.parametrize("fast", [False, True])
def test_train_step_passes_its_loss_to_the_loss_functions(fast):
    """DrafterTrainStep with --loss lk-hybrid computes exactly eagle3_loss(_fused) with that objective, and reports
    the alpha sums in its stats (ce_sum, correct, count, alpha_sum)."""
    from eagle3.train.config import TrainConfig
    from eagle3.train.step import STATS, DrafterTrainStep
    d = make_drafter()
    g = torch.Generator().manual_seed(4)
    B, T = 2, 10
    aux = torch.randn(B, T, 3 * HT, generator=g, dtype=torch.float64)
    ids = torch.randint(1, CFG["vocab_size"], (B, T), generator=g)
    am = torch.tensor([[1] * 10, [1] * 7 + [0] * 3])
    lm = am.clone()
    th = torch.randn(B, T, HT, generator=g, dtype=torch.float64)
    head = torch.randn(CFG["vocab_size"], HT, generator=g, dtype=torch.float64)
    cfg = TrainConfig(zero_stage=2 if fast else 3, ttt_steps=3, loss="lk-hybrid", lk_kl_scale=0.6, lk_kl_decay=1.5,
                      teacher_chunk_tokens=8)
    step = DrafterTrainStep(d, head, cfg)
    assert step.objective == Objective("lk-hybrid", 0.6, 1.5) and step.fast == fast
    loss, stats = step(aux, ids, am, lm, th)
    outs = d.ttt_forward(aux, ids, am, steps=3, fast=fast)
    if fast:
        ref, m = eagle3_loss_fused(d, outs, th, ids, lm, am, cfg.step_decay, 8, lm_head_weight=head,
                                   objective=step.objective)
    else:
        ref, m = eagle3_loss(d, outs, th, head, ids, lm, am, decay=cfg.step_decay, chunk_tokens=8,
                             objective=step.objective)
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)
    assert stats.shape == (len(STATS), 3)
    for i, k in enumerate(STATS):
        torch.testing.assert_close(stats[i], m[k], rtol=1e-12, atol=1e-12)
    _, kl_stats = DrafterTrainStep(d, head, TrainConfig(zero_stage=cfg.zero_stage, ttt_steps=3,
                                                        teacher_chunk_tokens=8))(aux, ids, am, lm, th)
    torch.testing.assert_close(kl_stats, stats, rtol=1e-12, atol=1e-12)  # the sums do not depend on the loss


def test_a_short_lk_run_trains_records_its_loss_and_reports_alpha(tiny_dump, tiny_targets, tmp_path):
    """`eagle3 train --loss lk` end to end in one process (DeepSpeed, ZeRO-2, fast path): it finishes, run.json and
    the checkpoint's record hold the loss, metrics.jsonl carries alpha_j (mean acceptance, in [0, 1]) in the
    training and held-out rows, and a resume with --loss kl is refused by name."""
    import json

    from eagle3.train.config import TrainConfig
    from eagle3.train.trainer import train
    from test_train import metrics
    out = tmp_path / "run"
    kw = dict(dump=[tiny_dump], target=tiny_targets["llama"], out=str(out), drafter="tiny", draft_vocab_size=512,
              bf16=False, max_steps=3, token_budget=256, lr=3e-3, warmup_steps=1, held_out_fraction=0.25,
              eval_interval=3, eval_batches=1, save_interval=3, num_workers=0, log_interval=1, progress=False,
              wandb_mode="disabled", ttt_steps=3)
    train(TrainConfig(loss="lk", **kw))
    assert json.load(open(out / "run.json"))["train"]["loss"] == "lk"
    assert json.load(open(out / "checkpoints" / "step00000003" / "eagle3_checkpoint.json"))["train"]["loss"] == "lk"
    rows, evals = metrics(str(out)), metrics(str(out), "eval")
    assert [r["step"] for r in rows] == [1, 2, 3] and evals
    for r in rows + evals:
        assert len(r["alpha_j"]) == 3 and all(0 < a <= 1 for a in r["alpha_j"]), r
    assert all(math.isfinite(r["loss"]) and r["loss"] > 0 for r in rows)
    with pytest.raises(ValueError, match="--loss: 'lk' -> 'kl'"):
        train(TrainConfig(loss="kl", resume=True, **{**kw, "max_steps": 6}))
