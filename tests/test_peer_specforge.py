"""bench/peer_specforge_quality.py end to end on the CPU: SpecForge 0.2.0's own EAGLE-3 training on our tiny dump,
exported in our SGLang layout and decoded losslessly by `eagle3 eval`; and, at equal weights, SpecForge's step
outputs and loss against ours (same inputs and teacher; its loss mask two tokens behind ours; a 1/(B*T) mean).
Skipped when specforge is not installed (CI does not install it: `pip install --no-deps specforge==0.2.0`)."""

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("specforge") is None,
                                reason="specforge is not installed (pip install --no-deps specforge==0.2.0)")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "peer_specforge_quality.py")


def _script():
    spec = importlib.util.spec_from_file_location("peer_specforge_quality", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def our_run(convs, tmp_path_factory):
    """Our pipeline at a tiny scale on a whole-word tiny Llama and its own (greedy) answers, as test_eval does: fp32
    dump (HF [1, 3, 4]), a few training steps with a draft vocab of half the target's (so some teacher argmaxes
    fall outside it), the SGLang export."""
    from tiny import WORDS, make_target, self_distilled_conversations
    from tiny_tokenizers import make_word_tokenizer

    from eagle3.dump.job import DumpConfig, run_dump
    from eagle3.export.sglang import export_drafter
    from eagle3.train.config import TrainConfig
    from eagle3.train.trainer import train
    root = tmp_path_factory.mktemp("peer")
    tok = make_word_tokenizer(WORDS)
    target = make_target(str(root / "target"), "llama", tokenizer=tok, vocab_size=len(tok), layer_scale=8.0)
    data = self_distilled_conversations(target, convs, str(root / "distilled.jsonl"), max_new_tokens=24)
    dump = str(root / "dump")
    run_dump(DumpConfig(target=target, data=[data], out=dump, layers=[1, 3, 4], dtype="fp32", progress=False))
    run = str(root / "run")
    train(TrainConfig(dump=[dump], target=target, out=run, drafter="tiny", draft_vocab_size=len(tok) // 2,
                      bf16=False, max_steps=4, token_budget=256, lr=3e-3, warmup_steps=2, held_out_fraction=0.2,
                      save_interval=1000, eval_interval=1000, num_workers=0, progress=False, wandb_mode="disabled",
                      ttt_steps=3))
    export = str(root / "export")
    export_drafter(run, export)
    return {"root": root, "dump": dump, "run": run, "export": export, "target": target, "data": data}


def test_peer_trains_exports_and_decodes_losslessly(our_run):
    from eagle3.eval.speculative import evaluate, load_drafter_from_export
    from eagle3.model.checkpoint import load_export
    from eagle3.target.weights import load_embedding_and_head
    out = str(our_run["root"] / "peer")
    cmd = [sys.executable, SCRIPT, "--run", our_run["run"], "--dump", our_run["dump"], "--target", our_run["target"],
           "--vocab", os.path.join(our_run["run"], "vocab.safetensors"), "--template-export", our_run["export"],
           "--out", out, "--steps", "20", "--device", "cpu", "--no-bf16", "--num-workers", "0", "--log-interval", "5"]
    env = dict(os.environ, OMP_NUM_THREADS="2", WANDB_MODE="disabled")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, (r.stdout + r.stderr)[-5000:]
    rows = [json.loads(line) for line in open(os.path.join(out, "peer_metrics.jsonl"))]
    steps = [row for row in rows if "step" in row]
    assert [row["step"] for row in steps] == [5, 10, 15, 20]
    assert all(len(row["acc_j"]) == 3 and len(row["ploss_j"]) == 3 and row["tok_s"] > 0 for row in steps)
    assert steps[-1]["loss"] < steps[0]["loss"]                 # it learns
    summary = rows[-1]["summary"]
    s = summary["settings"]                                      # taken from our run.json
    assert (s["ttt"], s["token_budget"], s["lr"], s["warmup_steps"], s["held_out_fraction"]) == (3, 256, 3e-3, 2, 0.2)
    assert summary["export_check_max_rel_diff"] < 1e-3          # our loader computes what SpecForge computes
    assert "export check" in r.stderr and "tok/s" in r.stderr

    # the same layout as our export: names, shapes, dtypes; config copied; provenance updated
    cfg_t, ten_t, prov_t = load_export(our_run["export"])
    cfg_p, ten_p, prov_p = load_export(out)
    assert cfg_p == cfg_t
    assert {k: (v.shape, v.dtype) for k, v in ten_p.items()} == {k: (v.shape, v.dtype) for k, v in ten_t.items()}
    assert ten_p["lm_head.weight"].dtype == torch.bfloat16 and ten_p["d2t"].dtype == torch.int64
    assert ten_p["t2d"].dtype == torch.bool
    assert torch.equal(ten_p["d2t"], ten_t["d2t"]) and torch.equal(ten_p["t2d"], ten_t["t2d"])
    assert not torch.equal(ten_p["fc.weight"], ten_t["fc.weight"])
    from eagle3 import contract as C
    assert prov_p.model_safetensors_sha256 == C.file_sha256(os.path.join(out, "model.safetensors"))
    assert prov_p.extra["peer"]["trainer"] == "specforge-0.2.0" and any("PEER WEIGHTS" in n for n in prov_p.notes)
    assert prov_p.identity == prov_t.identity and out in prov_p.server_command
    embed, _ = load_embedding_and_head(our_run["target"])
    load_drafter_from_export(out, embed, torch.float32, torch.device("cpu"))

    rep = evaluate(our_run["target"], out, our_run["data"], draft_steps=3, max_new_tokens=16, num_prompts=3,
                   progress=False, device="cpu")
    assert rep["lossless"], rep["mismatches"]
    assert rep["capture_indices"] == [1, 3, 4]


def _shift_right(x: torch.Tensor, n: int) -> torch.Tensor:
    out = torch.zeros_like(x)
    out[:, n:] = x[:, :-n]
    return out


def test_same_weights_same_outputs_and_the_loss_difference(our_run):
    """Our drafter's weights copied into SpecForge's model (same names). On one training batch:
    - the TTT step outputs agree (same inputs, attention pattern and RoPE positions);
    - SpecForge's ploss_j is sum(soft CE over ITS pairs) / (B*T), its pairs being (t, j) with loss_mask[t+j] = 1 and
      the teacher argmax at t+1+j in the draft vocab (last token's mask zeroed): checked against a reference;
    - with a mask for which both rules can select the same pairs (the last two tokens of each sample unmasked) and
      ours given that mask shifted right by two, our per-step CE sums equal SpecForge's ploss_j * B*T;
    - at step 0 of training the two total losses differ by the documented normalisation, not by the teacher."""
    import torch._dynamo
    from safetensors.torch import load_file

    from eagle3.data.dumps import DumpSet, split
    from eagle3.data.loader import BatchPlan, make_loader
    from eagle3.train.loss import eagle3_loss, teacher
    from eagle3.target.weights import load_embedding_and_head

    peer = _script()
    sf = peer.import_specforge("cpu")
    run = json.load(open(os.path.join(our_run["run"], "run.json")))
    cfg = run["train"]
    ck = sorted(d for d in os.listdir(os.path.join(our_run["run"], "checkpoints")) if d.startswith("step"))[-1]
    weights = load_file(os.path.join(our_run["run"], "checkpoints", ck, "drafter.safetensors"))
    embed, head = load_embedding_and_head(our_run["target"])
    embed, head = embed.float(), head.float()
    ours, draft = same_weights(peer, sf, run["drafter"], weights, embed)
    K = cfg["ttt_steps"]
    model = sf.OnlineEagle3Model(draft, length=K, attention_backend="sdpa")

    dumps = DumpSet(our_run["dump"], verify=False)
    train_refs, _ = split(dumps.refs, cfg["held_out_fraction"], cfg["seed"])
    plan = BatchPlan([r.length for r in train_refs], cfg["token_budget"], cfg["seed"], 0, 1)
    # a batch of the training plan with several samples and right padding
    batch = next(b for b in make_loader(dumps, train_refs, plan, 0, len(plan.epoch(0)), num_workers=0)
                 if b.input_ids.shape[0] > 1 and bool((b.attention_mask == 0).any()))
    B, T = batch.input_ids.shape
    hs, ids, am = batch.hidden_state.float(), batch.input_ids.long(), batch.attention_mask.long()
    th, lm = batch.final_hidden.float(), batch.loss_mask.long()
    n = am.sum(1)

    with torch._dynamo.config.patch(disable=True), torch.no_grad():
        sf_outs, res = peer.step_outputs(model, peer.specforge_inputs(sf, batch, head, "cpu", torch.float32))
        our_outs = ours.ttt_forward(hs, ids, am, steps=K)
        # 1) the same function: the step outputs agree at every real position
        real = am.bool()
        for a, b in zip(our_outs, sf_outs):
            assert torch.allclose(a[real], b[real], rtol=1e-4, atol=1e-4), float((a - b)[real].abs().max())
        plosses = torch.stack([p.double() for p in res[0]])

        # 2) SpecForge's loss = reference with its own pairs and denominator
        lm_sf = lm.clone()
        lm_sf[torch.arange(B), n - 1] = 0
        th_s = sf.padding(th, left=False)
        p_t, in_vocab, _ = teacher(th_s.reshape(B * T, -1), head, ours.t2d)
        p_t, in_vocab = p_t.view(B, T, -1), in_vocab.view(B, T)
        ref = []
        for j, m in enumerate(our_outs):
            lp = torch.log_softmax(ours.draft_logits(m).double(), -1)
            ce = torch.zeros(B, T, dtype=torch.float64)
            valid = torch.zeros(B, T, dtype=torch.bool)
            ce[:, : T - j] = -(p_t[:, j:].double() * lp[:, : T - j]).sum(-1)
            valid[:, : T - j] = (in_vocab & lm_sf.bool())[:, j:]
            ref.append((ce * valid).sum() / (B * T))
        assert torch.allclose(plosses, torch.stack(ref), rtol=1e-4), (plosses, ref)

        # 3) where the two rules select the same pairs, the sums agree: SpecForge's mask is ours shifted by two
        lm2 = lm.clone()
        for b in range(B):
            lm2[b, max(0, n[b] - 2):] = 0
        b2 = dataclasses.replace(batch, loss_mask=lm2.to(batch.loss_mask.dtype))
        _, res2 = peer.step_outputs(model, peer.specforge_inputs(sf, b2, head, "cpu", torch.float32))
        _, met = eagle3_loss(ours, our_outs, th, head, ids, _shift_right(lm2, 2), am, decay=0.8)
        sf_sum = torch.stack([p.double() for p in res2[0]]) * (B * T)
        assert torch.allclose(met["ce_sum"], sf_sum, rtol=1e-4), (met["ce_sum"], sf_sum)

        # 4) the real step-0 losses: same teacher, different pairs and normalisation
        our_loss, met0 = eagle3_loss(ours, our_outs, th, head, ids, lm, am, decay=0.8)
        sf_loss = sum(0.8 ** j * p for j, p in enumerate(plosses))
        ratio = met0["count"] / (B * T)
        approx = sum(0.8 ** j * met0["loss_per_step"][j] * ratio[j] for j in range(K))
        frac = float(in_vocab[am.bool()].float().mean())
        assert 0.3 < frac < 0.99, f"teacher argmax in the draft vocab at {frac:.0%} of positions: want a mix"
        print(f"\nstep-0 loss on one batch (B={B}, T={T}, teacher argmax in draft vocab {frac:.0%}): ours "
              f"{float(our_loss):.4f}, SpecForge {float(sf_loss):.4f}, ours x count_j/(B*T) {float(approx):.4f}")
        assert float(sf_loss) < float(our_loss)                 # the 1/(B*T) mean over a padded, partly masked batch
        assert abs(float(sf_loss) - float(approx)) < 0.25 * float(sf_loss)  # what remains is the 2-token mask shift

        # 5) SpecForge's own LK objectives (what `--loss lk` / `lk-hybrid` select) on the same pairs: alpha from the
        # target's full-vocab probabilities of the draft tokens (not renormalised, unlike ours), in float64
        p_full = torch.softmax(th_s.double() @ head.double().T, -1)[..., ours.t2d.bool()]   # [B, T, Dv]
        mean_alpha, mean_log_alpha = [], []
        for j, m in enumerate(our_outs):
            q = torch.softmax(ours.draft_logits(m).double(), -1)
            alpha = torch.minimum(p_full[:, j:], q[:, : T - j]).sum(-1)
            valid = (in_vocab & lm_sf.bool())[:, j:]
            mean_alpha.append(alpha[valid].mean())
            mean_log_alpha.append(torch.log(alpha[valid]).mean())
        for mode, ref_j in (("alpha", [-x for x in mean_log_alpha]),
                            ("lambda", [torch.exp(-a) * kl + (1 - torch.exp(-a)) * (1 - a)
                                        for a, kl in zip(mean_alpha, ref)])):
            lk_model = sf.OnlineEagle3Model(draft, length=K, attention_backend="sdpa", lk_loss_type=mode)
            _, res_lk = peer.step_outputs(lk_model, peer.specforge_inputs(sf, batch, head, "cpu", torch.float32))
            got = torch.stack([p.double() for p in res_lk[0]])
            assert torch.allclose(got, torch.stack(ref_j), rtol=1e-4), (mode, got, ref_j)
            assert not torch.allclose(got, plosses, rtol=1e-2)   # not the KL losses under another name


def test_the_objective_comes_from_our_run(our_run, tmp_path):
    """--loss defaults to --run's objective (SpecForge then runs its own LK code: lk -> 'alpha', lk-hybrid ->
    'lambda' with our kl_scale / kl_decay); the command line wins; kl without --run."""
    peer = _script()
    run = json.load(open(os.path.join(our_run["run"], "run.json")))
    assert run["train"]["loss"] == "kl"
    run["train"].update(loss="lk-hybrid", lk_kl_scale=0.5, lk_kl_decay=2.0)
    (tmp_path / "run.json").write_text(json.dumps(run))
    base = ["--dump", our_run["dump"], "--target", our_run["target"], "--vocab", "v", "--template-export", "e",
            "--out", "o", "--device", "cpu"]
    a = peer.resolve_settings(peer.parse_args(base + ["--run", str(tmp_path)]))
    assert (peer.SPECFORGE_LK[a.loss], a.lk_kl_scale, a.lk_kl_decay) == ("lambda", 0.5, 2.0)
    a = peer.resolve_settings(peer.parse_args(base + ["--run", str(tmp_path), "--loss", "lk"]))
    assert peer.SPECFORGE_LK[a.loss] == "alpha" and "alpha" in peer.LOSS_CONVENTION[a.loss]
    a = peer.resolve_settings(peer.parse_args(base + ["--steps", "3"]))
    assert a.loss == "kl" and peer.SPECFORGE_LK[a.loss] is None


# ------------------------------------------------------------------------------------------ EAGLE-3.1 templates

@pytest.fixture(scope="module")
def runs_31(our_run):
    """Two more tiny runs on our_run's dump, target and settings with EAGLE-3.1 options, each exported as a template:
    fc_norm + norm_output (which SpecForge 0.2.0 cannot train: refused) and fc_norm alone (which it can)."""
    from eagle3.export.sglang import export_drafter
    from eagle3.train.config import TrainConfig
    from eagle3.train.trainer import train
    root = our_run["root"]
    tok_count = json.load(open(os.path.join(our_run["run"], "run.json")))["drafter"]["vocab_size"]
    out = {}
    for name, opts in (("fcn_out", dict(fc_norm=True, norm_output=True)), ("fcn", dict(fc_norm=True))):
        run = str(root / f"run_{name}")
        train(TrainConfig(dump=[our_run["dump"]], target=our_run["target"], out=run, drafter="tiny",
                          draft_vocab_size=tok_count // 2, bf16=False, max_steps=4, token_budget=256, lr=3e-3,
                          warmup_steps=2, held_out_fraction=0.2, save_interval=1000, eval_interval=1000,
                          num_workers=0, progress=False, wandb_mode="disabled", ttt_steps=3, **opts))
        export = str(root / f"export_{name}")
        export_drafter(run, export)
        out[name] = {"run": run, "export": export}
    return out


def _peer_cmd(our_run, run, export, out, *extra):
    return [sys.executable, SCRIPT, "--run", run, "--dump", our_run["dump"], "--target", our_run["target"],
            "--vocab", os.path.join(run, "vocab.safetensors"), "--template-export", export, "--out", out,
            "--device", "cpu", "--no-bf16", "--num-workers", "0", *extra]


def test_fc_norm_norm_output_template_is_refused(our_run, runs_31):
    """A template trained with fc_norm + norm_output: the script refuses it before training or writing anything,
    saying how SpecForge's norm_output differs from ours; and that difference is real: SpecForge's model built with
    the template's fc_norm and the same weights agrees with ours at step 0 (lm_head on norm(m) both) and not after
    (ours feeds norm(m) to the next step, SpecForge m)."""
    import torch._dynamo

    from eagle3.data.dumps import DumpSet
    from eagle3.data.loader import BatchPlan, make_loader
    from eagle3.eval.speculative import load_drafter_from_export
    from eagle3.model import DrafterConfig
    from eagle3.model.checkpoint import export_drafter_config, load_export
    from eagle3.target.weights import load_embedding_and_head

    t = runs_31["fcn_out"]
    config, tensors, prov = load_export(t["export"])
    dcfg = export_drafter_config(config, prov, t["export"])
    assert dcfg.fc_norm and dcfg.norm_output and not dcfg.norm_before_fc and dcfg.layout == "llama"
    assert {f"fc_norm.{i}.weight" for i in range(3)} <= set(tensors)

    out = str(our_run["root"] / "peer_fcn_out")
    env = dict(os.environ, OMP_NUM_THREADS="2", WANDB_MODE="disabled")
    r = subprocess.run(_peer_cmd(our_run, t["run"], t["export"], out, "--steps", "2"), capture_output=True,
                       text=True, timeout=300, env=env)
    assert r.returncode != 0, (r.stdout + r.stderr)[-3000:]
    assert "cannot train the template's drafter" in r.stderr and "norm_output" in r.stderr, r.stderr[-3000:]
    assert "hidden_states = hidden_states_out" in r.stderr      # says where SpecForge feeds m to the next step
    assert "Traceback" not in r.stderr and not os.path.exists(out)

    peer = _script()
    sf = peer.import_specforge("cpu")
    # the refusals, one per option / layout SpecForge 0.2.0 cannot build as ours
    with pytest.raises(ValueError, match="norm_output"):
        peer.specforge_options(dcfg)
    with pytest.raises(ValueError, match="norm_output"):
        peer.build_draft(sf, prov.drafter, torch.zeros(dcfg.vocab_size, dcfg.hidden_size), tensors["d2t"],
                         tensors["t2d"], "sdpa", "cpu", torch.float32)
    base = dict(prov.drafter, fc_norm=False, norm_output=False)
    with pytest.raises(ValueError, match="input_norm"):
        peer.specforge_options(dict(base, norm_before_fc=True))
    mla = DrafterConfig(hidden_size=64, num_attention_heads=2, num_key_value_heads=2, intermediate_size=96,
                        vocab_size=100, draft_vocab_size=50, target_hidden_size=32, layout="mla", q_lora_rank=32,
                        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
    with pytest.raises(ValueError, match="no MLA drafter"):
        peer.specforge_options(mla)
    # what maps: fc_norm -> its fc_norm; our norm_output off -> its norm_output True (its default)
    assert peer.specforge_options(dict(base, fc_norm=True)) == {"fc_norm": True, "norm_output": True}
    assert peer.specforge_options(base) == {"fc_norm": False, "norm_output": True}

    # the difference is real: the same weights in SpecForge's fc_norm model and in ours with norm_output
    embed, _ = load_embedding_and_head(our_run["target"])
    ours = load_drafter_from_export(t["export"], embed, torch.float32, torch.device("cpu"))
    draft = peer.build_draft(sf, dict(prov.drafter, norm_output=False), embed, tensors["d2t"], tensors["t2d"],
                             "sdpa", "cpu", torch.float32)
    missing, unexpected = draft.load_state_dict({k: v.float() if v.is_floating_point() else v
                                                 for k, v in tensors.items()}, strict=False)
    assert missing == ["embed_tokens.weight"] and not unexpected
    dumps = DumpSet(our_run["dump"], verify=False)
    refs = dumps.refs[:1]
    batch = next(iter(make_loader(dumps, refs, BatchPlan([refs[0].length], 4096, 0, 0, 1), 0, 1, num_workers=0)))
    model = sf.OnlineEagle3Model(draft, length=2, attention_backend="sdpa")
    with torch._dynamo.config.patch(disable=True), torch.no_grad():
        theirs, _ = peer.step_outputs(model, peer.specforge_inputs(sf, batch, torch.randn(embed.shape[0],
                                      batch.final_hidden.shape[-1]), "cpu", torch.float32))
        mine = ours.ttt_forward(batch.hidden_state.float(), batch.input_ids.long(), None, steps=2)
        assert torch.allclose(mine[0], draft.norm(theirs[0]), rtol=1e-4, atol=1e-5)   # ours hands on norm(m_0)
        assert torch.allclose(ours.draft_logits(mine[0]), draft.compute_logits(theirs[0]), rtol=1e-4, atol=1e-5)
        d1 = float((ours.draft_logits(mine[1]) - draft.compute_logits(theirs[1])).abs().max())
        assert d1 > 1e-2, d1                                    # step 1 takes norm(m_0) in ours, m_0 in SpecForge's


def test_fc_norm_template_trains_exports_and_matches(our_run, runs_31):
    """A template trained with fc_norm: SpecForge's drafter is built with its fc_norm (its own 3 RMSNorms, eps
    rms_norm_eps), trained, exported as fc_norm.{i}.weight in our layout, and our loader computes what SpecForge
    computes; and at equal (random) fc_norm weights the two models agree on a training batch."""
    import torch._dynamo
    from safetensors.torch import load_file

    from eagle3.data.dumps import DumpSet, split
    from eagle3.data.loader import BatchPlan, make_loader
    from eagle3.eval.speculative import load_drafter_from_export
    from eagle3.model.checkpoint import export_drafter_config, load_export
    from eagle3.target.weights import load_embedding_and_head

    t = runs_31["fcn"]
    out = str(our_run["root"] / "peer_fcn")
    env = dict(os.environ, OMP_NUM_THREADS="2", WANDB_MODE="disabled")
    r = subprocess.run(_peer_cmd(our_run, t["run"], t["export"], out, "--steps", "6", "--log-interval", "3"),
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, (r.stdout + r.stderr)[-5000:]
    summary = [json.loads(line) for line in open(os.path.join(out, "peer_metrics.jsonl"))][-1]["summary"]
    assert summary["export_check_max_rel_diff"] < 1e-3          # step outputs and logits, our loader vs SpecForge

    cfg_t, ten_t, prov_t = load_export(t["export"])
    cfg_p, ten_p, prov_p = load_export(out)
    assert cfg_p == cfg_t and cfg_p.get("fc_norm") is True and not cfg_p.get("norm_output")
    dcfg = export_drafter_config(cfg_p, prov_p, out)
    assert dcfg.fc_norm and not dcfg.norm_output
    assert {k: (v.shape, v.dtype) for k, v in ten_p.items()} == {k: (v.shape, v.dtype) for k, v in ten_t.items()}
    for i in range(3):
        w = ten_p[f"fc_norm.{i}.weight"]
        assert w.shape == (dcfg.target_hidden_size,) and w.dtype == torch.bfloat16
        assert not torch.equal(w, torch.ones_like(w))           # SpecForge trained its fc_norm
        assert not torch.equal(w, ten_t[f"fc_norm.{i}.weight"])
    embed, head = load_embedding_and_head(our_run["target"])
    load_drafter_from_export(out, embed, torch.float32, torch.device("cpu"))

    # at equal weights (fc_norm made far from 1 and different per captured state): same step outputs and logits
    peer = _script()
    sf = peer.import_specforge("cpu")
    run = json.load(open(os.path.join(t["run"], "run.json")))
    assert run["drafter"]["fc_norm"] and not run["drafter"]["norm_output"]
    ck = sorted(d for d in os.listdir(os.path.join(t["run"], "checkpoints")) if d.startswith("step"))[-1]
    weights = load_file(os.path.join(t["run"], "checkpoints", ck, "drafter.safetensors"))
    g = torch.Generator().manual_seed(0)
    for i in range(3):
        weights[f"fc_norm.{i}.weight"] = 0.25 + 2.0 * torch.rand(dcfg.target_hidden_size, generator=g)
    embed = embed.float()
    ours, draft = same_weights(peer, sf, run["drafter"], weights, embed)
    sd = peer.export_state_dict(draft, run["drafter"])          # SpecForge's names are ours
    assert set(sd) == set(ours.state_dict()) - {"embed_tokens.weight"}
    assert all(torch.equal(sd[k], weights[k].to(sd[k].dtype)) for k in sd)
    dumps = DumpSet(our_run["dump"], verify=False)
    cfg = run["train"]
    train_refs, _ = split(dumps.refs, cfg["held_out_fraction"], cfg["seed"])
    plan = BatchPlan([r.length for r in train_refs], cfg["token_budget"], cfg["seed"], 0, 1)
    batch = next(iter(make_loader(dumps, train_refs, plan, 0, 1, num_workers=0)))
    K = cfg["ttt_steps"]
    model = sf.OnlineEagle3Model(draft, length=K, attention_backend="sdpa")
    with torch._dynamo.config.patch(disable=True), torch.no_grad():
        sf_outs, _ = peer.step_outputs(model, peer.specforge_inputs(sf, batch, head.float(), "cpu", torch.float32))
        our_outs = ours.ttt_forward(batch.hidden_state.float(), batch.input_ids.long(),
                                    batch.attention_mask.long(), steps=K)
        real = batch.attention_mask.bool()
        for a, b in zip(our_outs, sf_outs):
            assert torch.allclose(a[real], b[real], rtol=1e-4, atol=1e-4), float((a - b)[real].abs().max())
            la, lb = ours.draft_logits(a)[real], draft.compute_logits(b)[real]
            assert torch.allclose(la, lb, rtol=1e-4, atol=1e-4), float((la - lb).abs().max())
        # and the fc_norm weights matter (a check that could fail): without them the step-0 output moves
        draft.fc_norm = None
        plain, _ = peer.step_outputs(model, peer.specforge_inputs(sf, batch, head.float(), "cpu", torch.float32))
        assert not torch.allclose(plain[0][real], sf_outs[0][real], rtol=1e-3, atol=1e-3)


def same_weights(peer, sf, drafter: dict, weights: dict, embed: torch.Tensor):
    """Our drafter and SpecForge's, both holding `weights` (a checkpoint's drafter.safetensors) and the target
    embedding, in float32 on the CPU."""
    from eagle3.model import DrafterConfig, Eagle3Drafter
    ours = Eagle3Drafter(DrafterConfig.from_dict(drafter))
    ours.load_state_dict(weights, strict=False)
    ours.load_target_embedding(embed)
    draft = peer.build_draft(sf, drafter, embed, weights["d2t"], weights["t2d"], "sdpa", "cpu", torch.float32)
    missing, unexpected = draft.load_state_dict({k: v.float() if v.is_floating_point() else v
                                                 for k, v in weights.items()}, strict=False)
    assert missing == ["embed_tokens.weight"] and not unexpected
    return ours, draft
