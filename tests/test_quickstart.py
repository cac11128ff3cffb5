"""The main job on the embedded default, at a reduced size: every stage runs and the export loads."""

import json
import os

import pytest


@pytest.mark.slow
def test_quickstart_reduced(tmp_path):
    from eagle3.model.checkpoint import load_export
    from eagle3.cli.quickstart import QuickstartConfig, run_quickstart
    out = str(tmp_path / "qs")
    s = run_quickstart(QuickstartConfig(out=out, num_samples=16, max_length=256, regen_max_new_tokens=12,
                                        train_steps=3, token_budget=1024, draft_steps=3, eval_prompts=2,
                                        max_new_tokens=8, held_out_fraction=0.3, progress=False))
    config, tensors, prov = load_export(os.path.join(out, "sglang-drafter"))
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert prov.capture.hidden_state_indices == [3, 16, 28]   # the example target's default (30 layers)
    assert tensors["fc.weight"].shape == (576, 3 * 576)
    assert s["eval"]["lossless"] and s["eval"]["acceptance_length"] >= 1.0
    assert "--speculative-algorithm EAGLE3" in s["serve"]
    summary = json.load(open(os.path.join(out, "summary.json")))
    regen = summary["regenerate"]
    assert regen["backend"] == "hf" and regen["sampling"]["temperature"] == 0
    assert summary["dump_totals"]["samples"] == regen["counts"]["conversations"] >= 4   # the dump read the target's answers
    assert summary["heldout_replay"]["decode_steps"] == 3                             # training's decoding replay ran
    # training's dtype follows this CPU's GEMMs (core/cpu.py), and the run trained in it; the eval stays fp32
    from eagle3.cpu import cpu_prefers_bf16
    want = "bf16" if cpu_prefers_bf16() else "fp32"
    assert summary["dtypes"] == {"regenerate": "fp32", "dump": "fp32", "train": want, "eval": "fp32"}
    run = json.load(open(os.path.join(out, "run", "run.json")))
    assert run["train"]["bf16"] is (want == "bf16")
