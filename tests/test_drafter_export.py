"""Every layout and EAGLE-3.1 option through the real trainer (DeepSpeed, ZeRO 2 fast path and ZeRO 3 plain path,
resume) and the exporter: config.json as SGLang reads it, the serving release table's refusals, read back by the
export reader, and (slow, where SGLang 0.5.23's CPU environment exists) SGLang's own loader and decode."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch
from safetensors.torch import load_file

from eagle3 import contract as C
from eagle3 import serving as S
from eagle3.model import DrafterConfig, tensor_shapes

VARIANTS = {
    "llama+fc_norm+norm_output": dict(drafter="tiny", fc_norm=True, norm_output=True),
    "llama+norm_before_fc": dict(drafter="tiny", norm_before_fc=True),
    "mla": dict(drafter="tiny-mla"),
    "mla+fc_norm+norm_output": dict(drafter="tiny-mla", fc_norm=True, norm_output=True),
}


def _train(dump, target, out, steps=4, **kw):
    from eagle3.train.config import TrainConfig
    from eagle3.train.trainer import train
    args = dict(dump=[dump], target=target, out=out, bf16=False, max_steps=steps, save_interval=2, token_budget=512,
                warmup_steps=1, held_out_fraction=0.0, num_workers=0, progress=False, wandb_mode="disabled")
    return train(TrainConfig(**{**args, **kw}))


@pytest.fixture(scope="module")
def variant_runs(tiny_dump, tiny_targets, tmp_path_factory):
    root = tmp_path_factory.mktemp("variant_runs")
    runs = {}
    for name, kw in VARIANTS.items():
        runs[name] = str(root / name)
        _train(tiny_dump, tiny_targets["llama"], runs[name], **kw)
    return runs


@pytest.fixture(scope="module")
def variant_exports(variant_runs, tmp_path_factory):
    from eagle3.export.sglang import export_drafter
    root = tmp_path_factory.mktemp("variant_exports")
    out = {}
    for name, run in variant_runs.items():
        out[name] = str(root / name)
        export_drafter(run, out[name])
    return out


@pytest.mark.parametrize("name", list(VARIANTS))
def test_the_run_records_and_exports_the_architecture_and_options(name, variant_runs, variant_exports):
    from eagle3.model.checkpoint import export_drafter_config, load_export
    kw = VARIANTS[name]
    run = json.load(open(os.path.join(variant_runs[name], "run.json")))
    dcfg = DrafterConfig.from_dict(run["drafter"])
    assert dcfg.layout == ("mla" if kw["drafter"] == "tiny-mla" else "llama")
    assert dcfg.options == [o for o in ("fc_norm", "norm_before_fc", "norm_output") if kw.get(o)]
    export = variant_exports[name]
    cfg = json.load(open(os.path.join(export, "config.json")))
    prov = json.load(open(os.path.join(export, "eagle3_provenance.json")))
    w = load_file(os.path.join(export, "model.safetensors"))
    assert {k: tuple(v.shape) for k, v in w.items()} == tensor_shapes(dcfg)
    # where SGLang 0.5.23 reads each switch (docs/drafters.md)
    assert cfg["fc_norm"] is dcfg.fc_norm and cfg["norm_output"] is dcfg.norm_output
    assert cfg["eagle_config"]["norm_before_fc"] is dcfg.norm_before_fc and cfg["norm_before_fc"] is dcfg.norm_before_fc
    if dcfg.layout == "mla":
        assert cfg["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and cfg["model_type"] == "kimi_k2"
        assert (cfg["q_lora_rank"], cfg["kv_lora_rank"], cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"],
                cfg["v_head_dim"]) == (32, 16, 16, 8, 16)
        assert cfg["rope_scaling"]["type"] == "yarn" and cfg["rope_interleave"] is True
        assert prov["draft_kv_bytes_per_token"] == (16 + 8) * 2
    else:
        assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
        assert prov["draft_kv_bytes_per_token"] == 2 * 2 * 16 * 2
    assert prov["architecture"] == cfg["architectures"][0] and prov["options"] == dcfg.options
    config, tensors, p = load_export(export)  # the reader gives back the trained config exactly
    assert export_drafter_config(config, p) == dcfg


@pytest.mark.parametrize("name,release,match", [
    ("mla", "0.5.11", r"SGLang 0.5.11 would not serve .*Eagle3DeepseekV2ForCausalLM is served from 0.5.12"),
    ("mla+fc_norm+norm_output", "0.5.12", r"SGLang 0.5.12 would not .*fc_norm .* from 0.5.13 on; norm_output .*0.5.13"),
    ("llama+fc_norm+norm_output", "0.5.11", r"SGLang 0.5.11 would not serve .*fc_norm.*needs SGLang >= 0.5.12"),
    ("llama+norm_before_fc", "0.5.16", r"SGLang 0.5.16 would not serve .*norm_before_fc .*from 0.5.17"),
])
def test_export_refuses_a_release_that_would_ignore_an_option(name, release, match, variant_runs, tmp_path):
    from eagle3.export.sglang import export_drafter
    with pytest.raises(C.ContractError, match=match):
        export_drafter(variant_runs[name], str(tmp_path / "x"), sglang_version=release)
    assert not os.path.exists(tmp_path / "x")
    export_drafter(variant_runs[name], str(tmp_path / "ok"), sglang_version=S.first_release_serving(
        "sglang", *_layout_options(variant_runs[name])) if name != "mla" else "0.5.13")


def _layout_options(run):
    d = DrafterConfig.from_dict(json.load(open(os.path.join(run, "run.json")))["drafter"])
    return d.layout, d.options


def test_vllm_release_rules(variant_runs, tmp_path):
    from eagle3.export.sglang import export_drafter
    with pytest.raises(C.ContractError, match=r"vLLM 0.22.1 would not serve .*fc_norm .* from 0.23.0"):
        export_drafter(variant_runs["mla+fc_norm+norm_output"], str(tmp_path / "v"), engine="vllm",
                       vllm_version="0.22.1")
    prov = export_drafter(variant_runs["mla+fc_norm+norm_output"], str(tmp_path / "v"), engine="vllm",
                          vllm_version="0.23.0")
    assert prov.vllm_release == "0.23.0" and prov.sglang_release is None


def test_the_table_refuses_what_no_release_serves():
    with pytest.raises(C.ContractError, match=r"no SGLang release serves norm_before_fc .*Eagle3DeepseekV2"):
        S.check_drafter_served("sglang", "0.5.23", "mla", ["norm_before_fc"], "Eagle3DeepseekV2ForCausalLM", 32)
    with pytest.raises(C.ContractError, match="needs q_lora_rank"):
        S.check_drafter_served("sglang", "0.5.23", "mla", [], "Eagle3DeepseekV2ForCausalLM", None)
    S.check_drafter_served("sglang", "0.5.23", "llama", ["fc_norm", "norm_output"], "LlamaForCausalLMEagle3")
    assert S.first_release_serving("sglang", "llama", ["norm_before_fc", "fc_norm"]) == "0.5.17"
    assert S.first_release_serving("vllm", "mla", ["norm_before_fc"]) is None


def test_mla_trains_under_zero3_and_resumes_exactly(tiny_dump, tiny_targets, tmp_path):
    """ZeRO-3 (the plain path, parameters partitioned) trains the MLA drafter with its options; a run stopped and
    resumed ends on exactly the weights of one that was not (ZeRO-2, the fast path)."""
    kw = dict(drafter="tiny-mla", fc_norm=True, norm_output=True)
    r3 = _train(tiny_dump, tiny_targets["llama"], str(tmp_path / "z3"), zero_stage=3, **kw)
    assert r3["step"] == 4 and all(torch.isfinite(torch.tensor(r3["acc_j"])))
    whole = str(tmp_path / "whole")
    _train(tiny_dump, tiny_targets["llama"], whole, **kw)
    cut = str(tmp_path / "cut")
    with pytest.raises(SystemExit):
        _train(tiny_dump, tiny_targets["llama"], cut, stop_after_steps=2, **kw)
    _train(tiny_dump, tiny_targets["llama"], cut, resume=True, **kw)
    a = load_file(os.path.join(whole, "checkpoints", "step00000004", "drafter.safetensors"))
    b = load_file(os.path.join(cut, "checkpoints", "step00000004", "drafter.safetensors"))
    assert a.keys() == b.keys() and "fc_norm.0.weight" in a
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_init_from_refuses_an_option_the_export_lacks(tiny_dump, tiny_targets, variant_exports, tmp_path):
    with pytest.raises(ValueError, match="would train another architecture"):
        _train(tiny_dump, tiny_targets["llama"], str(tmp_path / "w"), init_from=variant_exports["mla"], fc_norm=True)
    r = _train(tiny_dump, tiny_targets["llama"], str(tmp_path / "ok"), steps=2,
               init_from=variant_exports["mla+fc_norm+norm_output"])
    run = json.load(open(tmp_path / "ok" / "run.json"))
    assert run["drafter"]["layout"] == "mla" and run["drafter"]["fc_norm"] and r["step"] == 2


def _engine_env(variable: str, default: str) -> str | None:
    """A serving engine's CPU environment (SGLang's or vLLM's), where it has been built (its .ok marker)."""
    env = os.environ.get(variable, os.path.expanduser(default))
    return env if os.path.isfile(os.path.join(env, ".ok")) else None


@pytest.mark.slow
@pytest.mark.skipif(_engine_env("SGLANG_CPU_ENV", "~/.cache/sglang-cpu") is None,
                    reason="SGLang 0.5.23's CPU environment is not built here (bash ../shared/sglang_cpu_env.sh); its "
                           "result is in bench/RESULTS.md")
def test_sglang_loads_and_decodes_every_export(variant_exports, tiny_export):
    """SGLang 0.5.23's own classes build each export, load every tensor into the right parameter, read the options,
    and a decode written from its semantics reproduces forward_step (bench/sglang_check.py)."""
    exports = [*variant_exports.values(), tiny_export]
    p = subprocess.run(["bash", "bench/sglang_check.sh", *exports], cwd=os.path.dirname(os.path.dirname(__file__)),
                       capture_output=True, text=True, timeout=900)
    rows = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == len(exports), p.stdout + p.stderr
    for r in rows:
        assert r["ok"], r
        assert r["options_sglang_read"] == r["options_recorded"] and r["loaded"] >= 10


@pytest.fixture(scope="module")
def full_vocab_runs(tiny_dump, tiny_targets, tmp_path_factory):
    """Both layouts with draft_vocab_size = the target's vocabulary (TorchSpec's Kimi MLA drafter has no d2t)."""
    from tiny import VOCAB
    root = tmp_path_factory.mktemp("full_vocab_runs")
    runs = {}
    for name, drafter in (("llama+full_vocab", "tiny"), ("mla+full_vocab", "tiny-mla")):
        runs[name] = str(root / name)
        _train(tiny_dump, tiny_targets["llama"], runs[name], steps=2, drafter=drafter, draft_vocab_size=VOCAB)
    return runs


@pytest.mark.parametrize("name", ["llama+full_vocab", "mla+full_vocab"])
def test_a_full_vocab_export_for_vllm_has_no_vocab_map(name, full_vocab_runs, tmp_path):
    """vLLM builds draft_id_to_target_id only for a draft vocabulary smaller than the target's and refuses a d2t it
    has no parameter for (bench/vllm_check.py, vLLM 0.32.0): the vLLM export leaves d2t/t2d out, the SGLang export
    keeps them, and both read back as the identity map with the same weights."""
    from eagle3.export.sglang import export_drafter
    from eagle3.model.checkpoint import load_export
    from tiny import VOCAB
    for engine in ("vllm", "sglang"):
        export_drafter(full_vocab_runs[name], str(tmp_path / engine), engine=engine)
    written = {e: load_file(str(tmp_path / e / "model.safetensors")) for e in ("vllm", "sglang")}
    assert "d2t" not in written["vllm"] and "t2d" not in written["vllm"]
    assert set(written["sglang"]) - set(written["vllm"]) == {"d2t", "t2d"}
    read = {e: load_export(str(tmp_path / e))[1] for e in ("vllm", "sglang")}
    assert read["vllm"].keys() == read["sglang"].keys()
    for k in read["vllm"]:
        assert torch.equal(read["vllm"][k], read["sglang"][k]), k
    assert bool(read["vllm"]["t2d"].all()) and not bool(read["vllm"]["d2t"].any())
    assert read["vllm"]["lm_head.weight"].shape[0] == VOCAB


@pytest.mark.slow
@pytest.mark.skipif(_engine_env("VLLM_CPU_ENV", "~/.cache/vllm-cpu") is None,
                    reason="vLLM 0.32.0's CPU environment is not built here (bash bench/vllm_cpu_env.sh); its result "
                           "is in bench/RESULTS.md")
def test_vllm_loads_and_decodes_every_export(variant_runs, full_vocab_runs, tmp_path):
    """vLLM 0.32.0's own classes build each --engine vllm export as its EAGLE proposer does, load every tensor into
    the right parameter, read the options and the aux ids, and its modules decode as forward_step
    (bench/vllm_check.py)."""
    from eagle3.export.sglang import export_drafter
    exports = []
    for name, run in {**variant_runs, **full_vocab_runs}.items():
        exports.append(str(tmp_path / name))
        export_drafter(run, exports[-1], engine="vllm")
    p = subprocess.run(["bash", "bench/vllm_check.sh", *exports], cwd=os.path.dirname(os.path.dirname(__file__)),
                       capture_output=True, text=True, timeout=900)
    rows = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == len(exports), p.stdout + p.stderr[-4000:]
    for r in rows:
        assert r["ok"], r
        assert r["options_vllm_read"] == r["options_recorded"]


def test_inspect_states_architecture_options_and_kv_bytes(variant_exports, capsys):
    from eagle3.cli import main
    main(["inspect", variant_exports["mla+fc_norm+norm_output"]])
    out = capsys.readouterr().out
    assert "Eagle3DeepseekV2ForCausalLM (layout mla), options: fc_norm, norm_output" in out
    assert "draft KV    48 B per speculated token" in out and "verified    ok" in out
    main(["inspect", "--json", variant_exports["llama+norm_before_fc"]])
    r = json.loads(capsys.readouterr().out)
    assert r["options"] == ["norm_before_fc"] and r["draft_kv_bytes_per_token"] == 128 and r["verified"] == "ok"
