"""The serving rules (docs/contract.md §7) and the SGLang/vLLM export of a trained drafter (§6)."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3 import contract as C
from eagle3 import serving as S
from eagle3.model import EXPORT_KEYS

# ============================================================================================ the rules table

# One case per row of the docs/contract.md §7 table: (model_type, releases of the row, L, ids, capture they give,
# ids the inverse picks for that capture).
TABLE_ROWS = {
    "llama.py / qwen*: c = id + 1, all releases":
        ("llama", ("0.4.9", "0.5.23"), 32, [2, 16, 29], [3, 17, 30], [2, 16, 29]),
    "qwen3_moe: c = id + 1, all releases":
        ("qwen3_moe", ("0.4.9", "0.5.23"), 48, [2, 24, 45], [3, 25, 46], [2, 24, 45]),
    "deepseek_v2.py 0.5.4.post2 - 0.5.12.post1: c = id + 1":
        ("deepseek_v3", ("0.5.4.post2", "0.5.12.post1"), 61, [2, 30, 58], [3, 31, 59], [2, 30, 58]),
    "deepseek_v2.py 0.5.13 - 0.5.23, ids[0] != 1: c = id":
        ("deepseek_v3", ("0.5.13", "0.5.23"), 61, [3, 31, 59], [3, 31, 59], [3, 31, 59]),
    "deepseek_v2.py 0.5.13 - 0.5.23, ids[0] == 1: c = id + 1 (the portable list)":
        ("kimi_k2", ("0.5.13", "0.5.23"), 61, [1, 29, 57], [2, 30, 58], [1, 29, 57]),
    "kimi_k25 0.5.10 - 0.5.12.post1 (-> deepseek_v2): c = id + 1 (worked example)":
        ("kimi_k25", ("0.5.10", "0.5.12.post1"), 61, [2, 30, 58], [3, 31, 59], [2, 30, 58]),
    "kimi_k25 0.5.13 - 0.5.23 (-> deepseek_v2): c = id (worked example)":
        ("kimi_k25", ("0.5.13", "0.5.23"), 61, [3, 31, 59], [3, 31, 59], [3, 31, 59]),
    "gpt_oss.py >= 0.5.17, max(ids) != L: c = id + 1":
        ("gpt_oss", ("0.5.17", "0.5.23"), 36, [2, 18, 33], [3, 19, 34], [2, 18, 33]),
}


def releases(first, last):
    lo, hi = S.parse_release(first), S.parse_release(last)
    return [r for r in S.SGLANG_RELEASES if lo <= S.parse_release(r) <= hi]


@pytest.mark.parametrize("row", list(TABLE_ROWS))
def test_table_row_forward_and_inverse(row):
    model_type, (first, last), L, ids, capture, inverse = TABLE_ROWS[row]
    rels = releases(first, last)
    assert rels[0] == first and rels[-1] == last
    for rel in rels:
        assert S.sglang_capture_indices(ids, model_type, rel, L) == capture, rel
        got = S.sglang_ids_for(capture, model_type, rel, L)
        assert got == inverse, rel
        assert S.sglang_capture_indices(got, model_type, rel, L) == capture


def test_kimi_worked_example():
    """Kimi-K2.5 data at HF [3, 31, 59]: [2, 30, 58] up to 0.5.12.post1, [3, 31, 59] from 0.5.13; no single list."""
    assert S.sglang_ids_for([3, 31, 59], "kimi_k25", "0.5.11", 61) == [2, 30, 58]
    assert S.sglang_ids_for([3, 31, 59], "kimi_k25", "0.5.12.post1", 61) == [2, 30, 58]
    assert S.sglang_ids_for([3, 31, 59], "kimi_k25", "0.5.13", 61) == [3, 31, 59]
    assert S.sglang_ids_for([3, 31, 59], "kimi_k25", S.SGLANG_LATEST, 61) == [3, 31, 59]
    assert S.sglang_reproducible_in([3, 31, 59], "kimi_k25", 61) == [("0.5.10", "0.5.12.post1", [2, 30, 58]),
                                                                       ("0.5.13", "0.5.23", [3, 31, 59])]
    # the 0.5.12 ids served by 0.5.13 capture something else, and vice versa: silently wrong, hence the release
    assert S.sglang_capture_indices([2, 30, 58], "kimi_k25", "0.5.13", 61) == [2, 30, 58]
    assert S.sglang_capture_indices([3, 31, 59], "kimi_k25", "0.5.12", 61) == [4, 32, 60]


def test_portable_ids_preferred():
    """Data at HF [2, 30, 58]: [1, 29, 57] works in every deepseek release, [2, 30, 58] only from 0.5.13."""
    for rel in releases("0.5.4.post2", S.SGLANG_LATEST):
        assert S.sglang_ids_for([2, 30, 58], "deepseek_v3", rel, 61) == [1, 29, 57]
    assert S.sglang_capture_indices([2, 30, 58], "deepseek_v3", "0.5.13", 61) == [2, 30, 58]  # works, not chosen
    assert S.sglang_releases_reproducing([1, 29, 57], [2, 30, 58], "deepseek_v3", 61) == [("0.5.4.post2", "0.5.23")]
    assert S.sglang_releases_reproducing([2, 30, 58], [2, 30, 58], "deepseek_v3", 61) == [("0.5.13", "0.5.23")]


def test_gpt_oss_max_equal_L_is_taken_as_is_and_then_never_captured():
    # max(ids) == L: the ids are used as capture indices, and index L is past the end of the layer loop
    with pytest.raises(C.ContractError, match=r"capture index 36 >= L=36.*never captured"):
        S.sglang_capture_indices([3, 19, 36], "gpt_oss", "0.5.17", 36)  # (+1 would have named 37)
    # the same list shifted: max != L -> +1
    assert S.sglang_capture_indices([3, 19, 35], "gpt_oss", "0.5.17", 37) == [4, 20, 36]


@pytest.mark.parametrize("model_type, release", [("llama", "0.4.9"), ("qwen3", "0.5.23"), ("deepseek_v3", "0.5.5"),
                                                 ("deepseek_v3", "0.5.23"), ("kimi_k25", "0.5.13"),
                                                 ("gpt_oss", "0.5.20")])
def test_missing_ids_capture_the_sglang_default(model_type, release):
    assert S.sglang_capture_indices(None, model_type, release, 61) == [2, 30, 58]
    assert S.sglang_capture_indices(None, model_type, release, 32) == [2, 16, 29]


def test_release_parsing_and_order():
    order = ["0.4.9", "0.4.9.post6", "0.4.10", "0.5.4", "0.5.4.post1", "0.5.4.post2", "0.5.5", "0.5.10",
             "0.5.10.post1", "0.5.11", "0.5.12.post1", "0.5.13", "0.5.23"]
    assert sorted(order, key=S.parse_release) == order
    assert list(S.SGLANG_RELEASES) == sorted(S.SGLANG_RELEASES, key=S.parse_release)
    assert S.compare_releases("0.5.13", "0.5.12.post1") == 1 and S.compare_releases("0.5.4", "0.5.4.post1") == -1
    assert S.compare_releases("v0.5.9", "0.5.9") == 0 and str(S.parse_release("0.5.4.post1")) == "0.5.4.post1"
    assert S.SGLANG_LATEST == S.SGLANG_RELEASES[-1] == "0.5.23"


def test_table_covers_every_known_release_once():
    for family, rows in S.SGLANG_RULES.items():
        for rel in S.SGLANG_RELEASES:
            r = S.parse_release(rel)
            hits = [rule for a, b, rule in rows if S.parse_release(a) <= r <= S.parse_release(b)]
            assert len(hits) == 1, (family, rel, hits)
    # Kimi-K2.5 delegates to deepseek_v2 from 0.5.10
    for rel in releases("0.5.10", S.SGLANG_LATEST):
        assert S.sglang_rule("kimi_k25", rel) == S.sglang_rule("deepseek_v2", rel)


def test_serving_family():
    assert {m: S.serving_family(m) for m in ("llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3", "kimi_k2",
                                             "kimi_k25", "gpt_oss")} == {
        "llama": "llama", "qwen2": "llama", "qwen3": "llama", "qwen3_moe": "llama", "deepseek_v3": "deepseek_v2",
        "kimi_k2": "deepseek_v2", "kimi_k25": "kimi_k25", "gpt_oss": "gpt_oss"}
    for bad in ("mixtral", "", None):
        with pytest.raises(C.ContractError, match="no known SGLang"):
            S.serving_family(bad)


def test_vllm_reads_hf_indices_and_is_not_portable():
    assert S.vllm_capture_indices([3, 31, 59]) == [3, 31, 59] and S.vllm_ids_for([3, 31, 59]) == [3, 31, 59]
    assert S.vllm_capture_indices(None, 61) == [2, 30, 58]
    assert S.vllm_ids_for([3, 31, 59]) != S.sglang_ids_for([3, 31, 59], "kimi_k25", "0.5.12", 61)


def test_cuda_graph_rule():
    assert S.needs_disable_cuda_graph([3, 31, 59], "0.5.10.post1", 61)
    assert S.needs_disable_cuda_graph([3, 31, 59], "0.4.9", 61)
    assert not S.needs_disable_cuda_graph([3, 31, 59], "0.5.11", 61)
    assert not S.needs_disable_cuda_graph([2, 30, 58], "0.5.10", 61)  # the default is what the graphs capture


# ---------------------------------------------------------------------------------------------- refusals

@pytest.mark.parametrize("model_type, release, L, capture, match", [
    ("deepseek_v3", "0.5.4.post1", 61, [3, 31, 59], r"no EAGLE-3 support.*0\.5\.4\.post2 - 0\.5\.23"),
    ("kimi_k2", "0.4.9", 61, [3, 31, 59], "no EAGLE-3 support"),
    ("kimi_k25", "0.5.9", 61, [3, 31, 59], r"no EAGLE-3 support.*0\.5\.10 - 0\.5\.23"),
    ("gpt_oss", "0.5.16", 36, [3, 19, 34], r"no EAGLE-3 support.*0\.5\.17 - 0\.5\.23"),
    # HF 1 on deepseek >= 0.5.13: ids[0] == 1 adds 1 (-> 2), ids[0] == 0 keeps 0: neither gives 1
    ("deepseek_v3", "0.5.13", 61, [1, 29, 57], r"reproducible in: SGLang 0\.5\.4\.post2 - 0\.5\.12\.post1 with "
                                               r"ids \[0, 28, 56\]"),
    ("kimi_k25", "0.5.23", 61, [1, 29, 57], r"reproducible in: SGLang 0\.5\.10 - 0\.5\.12\.post1"),
    ("llama", "0.5.23", 32, [0, 16, 29], "out of range"),
    ("llama", "0.5.23", 32, [3, 16, 32], "out of range"),
    ("llama", "0.5.11", 32, [3, 9, 17, 30], "exactly 3"),
    ("llama", "0.5.23", 32, [3, 17, 30], None),
    ("llama", "0.5.24", 32, [3, 17, 30], r"outside the releases.*0\.4\.9 - 0\.5\.23"),
    ("llama", "0.4.8", 32, [3, 17, 30], "outside the releases"),
    ("llama", "0.5.9.post1", 32, [3, 17, 30], "not a published release"),
    ("llama", "latest", 32, [3, 17, 30], "not understood"),
])
def test_inverse_refusals(model_type, release, L, capture, match):
    if match is None:  # the control: the same call with a good release works
        assert S.sglang_ids_for(capture, model_type, release, L) == [c - 1 for c in capture]
        return
    with pytest.raises(C.ContractError, match=match):
        S.sglang_ids_for(capture, model_type, release, L)


@pytest.mark.parametrize("ids, release, L, match", [
    ([-1, 15, 28], "0.5.23", 32, "capture index 0"),        # llama: c = id + 1 = 0 is the embedding
    ([2, 15, 31], "0.5.23", 32, "never captured"),          # c = 32 = L
    ([2, 15], "0.5.11", 32, "exactly 3"),
    ([2, 15, 22, 28], "0.5.4", 32, "exactly 3"),
    ([2, 2, 28], "0.5.23", 32, "repeat"),
    ([], "0.5.23", 32, "empty"),
])
def test_forward_refusals(ids, release, L, match):
    with pytest.raises(C.ContractError, match=match):
        S.sglang_capture_indices(ids, "llama", release, L)
    assert S.sglang_capture_indices([2, 15, 28], "llama", "0.5.12", 32) == [3, 16, 29]
    assert S.sglang_capture_indices([2, 15], "llama", "0.5.12", 32) == [3, 16]  # 2 aux ids allowed from 0.5.12


# ============================================================================================ the export

def light_copy(run, dst, step=4):
    """run.json, vocab and one checkpoint's drafter files (no DeepSpeed state): what the export reads."""
    tag = f"step{step:08d}"
    os.makedirs(os.path.join(dst, "checkpoints", tag))
    for f in ("run.json", "vocab.safetensors"):
        shutil.copy(os.path.join(run, f), dst)
    for f in ("eagle3_checkpoint.json", "drafter.safetensors"):
        shutil.copy(os.path.join(run, "checkpoints", tag, f), os.path.join(dst, "checkpoints", tag))
    return str(dst)


def edit_records(run, fn, step=4, resign=True):
    """Edit run.json and the checkpoint's record alike. resign: as if the run had been trained so -- the weights'
    metadata records the edited meaning (records.MEANING_KEY) and the record the weights' new sha256; without it the
    edit is what export must refuse (tests/test_integrity_inputs.py)."""
    ckpt = os.path.join(run, "checkpoints", f"step{step:08d}")
    for path in (os.path.join(run, "run.json"), os.path.join(ckpt, "eagle3_checkpoint.json")):
        with open(path) as f:
            d = json.load(f)
        fn(d)
        with open(path, "w") as f:
            json.dump(d, f)
    if resign:
        from safetensors import safe_open
        from eagle3.records import CKPT_FILE, MEANING_KEY, CheckpointRecord
        wpath = os.path.join(ckpt, "drafter.safetensors")
        with safe_open(wpath, "pt") as f:
            meta = dict(f.metadata() or {})
        if MEANING_KEY in meta:
            meta[MEANING_KEY] = CheckpointRecord.read(os.path.join(ckpt, CKPT_FILE)).meaning_sha256()
            save_file(load_file(wpath), wpath, metadata=meta)
            sha = C.file_sha256(wpath)
            path = os.path.join(ckpt, "eagle3_checkpoint.json")
            with open(path) as f:
                d = json.load(f)
            d.setdefault("sha256", {})["drafter.safetensors"] = sha
            with open(path, "w") as f:
                json.dump(d, f)


def edit_weights(run, fn, step=4):
    path = os.path.join(run, "checkpoints", f"step{step:08d}", "drafter.safetensors")
    w = load_file(path)
    fn(w)
    save_file(w, path)
    # recorded as the trainer would have: what these tests refuse is the content, not a hash mismatch
    edit_records(run, lambda d: d.get("sha256", {}).update({"drafter.safetensors": C.file_sha256(path)}), step,
                 resign=False)


def no_leftovers(parent, name):
    return [e for e in os.listdir(parent) if e.startswith(f".{name}.") or e == name] == []


CONFIG_KEYS = {"architectures", "model_type", "num_hidden_layers", "hidden_size", "num_attention_heads",
               "num_key_value_heads", "head_dim", "intermediate_size", "hidden_act", "rms_norm_eps", "rope_theta",
               "rope_scaling", "max_position_embeddings", "vocab_size", "draft_vocab_size", "target_hidden_size",
               "tie_word_embeddings", "torch_dtype", "dtype", "eagle_config", "fc_norm", "norm_output",
               "norm_before_fc"}


def test_export_of_a_trained_run(tiny_run, tmp_path):
    from eagle3.export.sglang import export_drafter
    from eagle3.model.checkpoint import capture_indices_of_export, load_export
    run = json.load(open(os.path.join(tiny_run, "run.json")))
    capture = run["capture"]["hidden_state_indices"]
    assert capture == [1, 3, 4]
    out = str(tmp_path / "draft")
    prov = export_drafter(tiny_run, out)
    assert sorted(os.listdir(out)) == ["config.json", "eagle3_provenance.json", "model.safetensors"]
    assert not [e for e in os.listdir(tmp_path) if e.startswith(".")]  # no temp dirs left behind

    w = load_file(os.path.join(out, "model.safetensors"))
    assert set(w) == set(EXPORT_KEYS)
    H, V, dv = 64, 512, 64
    assert w["fc.weight"].shape == (H, 3 * H) and w["lm_head.weight"].shape == (dv, H)
    assert w["midlayer.self_attn.q_proj.weight"].shape == (4 * 16, 2 * H)
    assert w["midlayer.self_attn.k_proj.weight"].shape == (2 * 16, 2 * H)
    assert w["midlayer.mlp.down_proj.weight"].shape == (H, 128)
    assert w["d2t"].dtype == torch.int64 and w["d2t"].shape == (dv,)
    assert w["t2d"].dtype == torch.bool and w["t2d"].shape == (V,)
    assert all(w[k].dtype == torch.bfloat16 for k in EXPORT_KEYS if k not in ("d2t", "t2d"))
    src = load_file(os.path.join(tiny_run, "checkpoints", "step00000004", "drafter.safetensors"))
    assert all(torch.equal(w[k], src[k].to(w[k].dtype)) for k in EXPORT_KEYS)

    cfg = json.load(open(os.path.join(out, "config.json")))
    assert set(cfg) == CONFIG_KEYS
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    assert cfg["vocab_size"] == V and cfg["draft_vocab_size"] == dv and cfg["target_hidden_size"] == H
    assert cfg["head_dim"] == 16 and cfg["hidden_act"] == "silu" and cfg["tie_word_embeddings"] is False
    assert cfg["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [0, 2, 3], "use_aux_hidden_state": True,
                                   "norm_before_fc": False}
    assert cfg["fc_norm"] is False and cfg["norm_output"] is False and cfg["norm_before_fc"] is False

    assert prov.to_dict() == json.load(open(os.path.join(out, "eagle3_provenance.json")))
    assert prov.engine == "sglang" and prov.sglang_release == S.SGLANG_LATEST
    assert prov.capture.hidden_state_indices == capture and prov.served_capture_indices == capture
    assert prov.eagle_aux_hidden_state_layer_ids == [0, 2, 3] and prov.step == 4
    assert prov.target.model_type == "llama" and prov.target.num_hidden_layers == 6
    assert prov.target.config_sha256 == run["target"]["config_sha256"]
    assert prov.standardize == "v1" and prov.needs_disable_cuda_graph is False
    assert prov.architecture == "LlamaForCausalLMEagle3" and prov.options == []
    assert prov.draft_kv_bytes_per_token == 2 * 2 * 16 * 2  # k and v, 2 kv heads of 16, bf16
    assert "--speculative-algorithm EAGLE3" in prov.server_command and out in prov.server_command
    assert "--disable-cuda-graph" not in prov.server_command

    config, tensors, p2 = load_export(out)
    assert config == cfg and p2 == prov and set(tensors) == set(EXPORT_KEYS)
    assert capture_indices_of_export(out, 6) == capture
    with pytest.raises(C.ContractError, match="6-layer"):
        capture_indices_of_export(out, 61)

    # re-export into the same directory (a previous export) replaces it; an older step can be chosen
    prov2 = export_drafter(tiny_run, out, step=2)
    assert prov2.step == 2 and json.load(open(os.path.join(out, "eagle3_provenance.json")))["step"] == 2
    with pytest.raises(FileNotFoundError, match="step 3"):
        export_drafter(tiny_run, str(tmp_path / "other"), step=3)


def test_ids_come_from_the_recorded_capture_and_family(tiny_run, tmp_path):
    from eagle3.export.sglang import export_drafter
    from eagle3.model.checkpoint import capture_indices_of_export
    run = light_copy(tiny_run, tmp_path / "run")

    def recapture(d):
        d["capture"]["hidden_state_indices"] = [1, 3, 5]
        d["identity"]["capture.hidden_state_indices"] = [1, 3, 5]
    edit_records(run, recapture)
    prov = export_drafter(run, str(tmp_path / "a"))
    assert prov.eagle_aux_hidden_state_layer_ids == [0, 2, 4]
    assert capture_indices_of_export(str(tmp_path / "a"), 6) == [1, 3, 5]

    # the same run recorded as a DeepseekV3 target: HF 1 cannot be served by 0.5.13+, can by 0.5.12.post1
    edit_records(run, lambda d: d["target"].update(model_type="deepseek_v3"))
    with pytest.raises(C.ContractError, match=r"0\.5\.4\.post2 - 0\.5\.12\.post1"):
        export_drafter(run, str(tmp_path / "b"))
    assert no_leftovers(str(tmp_path), "b")
    prov = export_drafter(run, str(tmp_path / "b"), sglang_version="0.5.12.post1")
    assert prov.eagle_aux_hidden_state_layer_ids == [0, 2, 4]
    assert capture_indices_of_export(str(tmp_path / "b"), 6) == [1, 3, 5]
    with pytest.raises(C.ContractError, match="capture index 0"):  # the same export served by 0.5.13
        capture_indices_of_export(str(tmp_path / "b"), 6, sglang_version="0.5.13")

    edit_records(run, lambda d: d["target"].update(model_type="mixtral"))
    with pytest.raises(C.ContractError, match="mixtral"):
        export_drafter(run, str(tmp_path / "c"))


def test_cuda_graph_mismatch_needs_the_flag(tiny_run, tmp_path, capsys):
    from eagle3.export.sglang import export_drafter
    out = str(tmp_path / "old")
    with pytest.raises(C.ContractError, match="disable-cuda-graph"):
        export_drafter(tiny_run, out, sglang_version="0.5.10.post1")
    assert no_leftovers(str(tmp_path), "old")
    prov = export_drafter(tiny_run, out, sglang_version="0.5.10.post1", allow_cuda_graph_mismatch=True)
    assert prov.needs_disable_cuda_graph is True and prov.server_command.endswith("--disable-cuda-graph")
    assert "--disable-cuda-graph" in capsys.readouterr().err
    prov = export_drafter(tiny_run, str(tmp_path / "new"), sglang_version="0.5.11")
    assert prov.needs_disable_cuda_graph is False


def test_vllm_export(tiny_run, tmp_path):
    from eagle3.export.sglang import export_drafter
    from eagle3.model.checkpoint import capture_indices_of_export
    out = str(tmp_path / "v")
    prov = export_drafter(tiny_run, out, engine="vllm")
    cfg = json.load(open(os.path.join(out, "config.json")))
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4] == prov.served_capture_indices
    assert any("NOT portable" in n for n in prov.notes) and prov.server_command.startswith("vllm serve")
    assert capture_indices_of_export(out, 6) == [1, 3, 4]


def _flip_t2d(w):
    w["t2d"][int(w["t2d"].nonzero()[0])] = False


def _shift_vocab(w):  # a consistent d2t/t2d pair, but not the run's vocabulary
    t2d = torch.zeros_like(w["t2d"])
    t2d[torch.arange(w["d2t"].numel()) + 1] = True
    w["t2d"], w["d2t"] = t2d, torch.ones_like(w["d2t"])


@pytest.mark.parametrize("tamper, match", [
    (lambda w: w["d2t"].__setitem__(0, w["d2t"][0] + 1), "d2t and t2d disagree"),
    (_flip_t2d, "d2t and t2d disagree"),
    (_shift_vocab, "differ from the run's"),
    (lambda w: w.pop("midlayer.hidden_norm.weight"), "missing tensors"),
    (lambda w: w.__setitem__("layers.0.mlp.up_proj.weight", torch.zeros(2)), "unknown tensors"),
    (lambda w: w.__setitem__("lm_head.weight", w["lm_head.weight"][:-1].clone()), "lm_head.weight: shape"),
    (lambda w: w.__setitem__("d2t", w["d2t"].to(torch.int32)), "d2t: dtype"),
    (lambda w: w["norm.weight"].__setitem__(0, float("nan")), "NaN"),
])
def test_tampered_weights_are_refused_and_nothing_is_written(tiny_run, tmp_path, tamper, match):
    from eagle3.export.sglang import export_drafter
    run = light_copy(tiny_run, tmp_path / "run")
    edit_weights(run, tamper)
    with pytest.raises(C.ContractError, match=match):
        export_drafter(run, str(tmp_path / "out"))
    assert no_leftovers(str(tmp_path), "out")


def test_aux_count_must_match_capture(tiny_run, tmp_path):
    from eagle3.export.sglang import export_drafter
    run = light_copy(tiny_run, tmp_path / "run")
    edit_records(run, lambda d: d["drafter"].update(num_aux_layers=2))
    with pytest.raises(C.ContractError, match="num_aux_layers=2"):
        export_drafter(run, str(tmp_path / "out"))
    assert no_leftovers(str(tmp_path), "out")


def test_output_directory_rules(tiny_run, tmp_path):
    from eagle3.export.sglang import ExportError, export_drafter
    from eagle3.model.checkpoint import load_export
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    with pytest.raises(ExportError, match="not a previous eagle3 export"):
        export_drafter(tiny_run, str(busy))
    assert os.listdir(busy) == ["notes.txt"]
    empty = tmp_path / "empty"
    empty.mkdir()
    export_drafter(tiny_run, str(empty))
    # a tampered export is refused on reading
    w = load_file(str(empty / "model.safetensors"))
    w["layers.0.input_layernorm.weight"] = torch.ones(64, dtype=torch.bfloat16)
    save_file(w, str(empty / "model.safetensors"))
    with pytest.raises(C.ContractError, match="sha256"):
        load_export(str(empty))
    prov = json.load(open(empty / "eagle3_provenance.json"))  # the same file with its hash recorded: the names
    prov["model_safetensors_sha256"] = C.file_sha256(str(empty / "model.safetensors"))
    json.dump(prov, open(empty / "eagle3_provenance.json", "w"))
    with pytest.raises(C.ContractError, match="unknown tensors"):
        load_export(str(empty))


def test_cli_export(tiny_run, tmp_path, capsys):
    from eagle3.cli import main
    out = str(tmp_path / "cli")
    main(["export-sglang", "--run", tiny_run, "--out", out, "--sglang-version", "0.5.10",
          "--allow-cuda-graph-mismatch"])
    text = capsys.readouterr().out
    assert "eagle_aux_hidden_state_layer_ids: [0, 2, 3]" in text
    assert "SGLang 0.5.10 will capture HF [1, 3, 4]" in text
    assert "python -m sglang.launch_server --model-path" in text and "--disable-cuda-graph" in text
    with pytest.raises(SystemExit):
        main(["export-sglang", "--run", tiny_run, "--out", str(tmp_path / "cli2"), "--sglang-version", "0.5.10"])
    assert "disable-cuda-graph" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- reading an export

def _set_ids(export, ids):
    path = os.path.join(export, "config.json")
    cfg = json.load(open(path))
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = ids
    json.dump(cfg, open(path, "w"))


def test_a_flipped_bit_in_an_export_is_refused(tiny_run, tmp_path):
    from eagle3.export.sglang import export_drafter
    from eagle3.model.checkpoint import load_export
    out = str(tmp_path / "draft")
    export_drafter(tiny_run, out)
    path = os.path.join(out, "model.safetensors")
    with open(path, "r+b") as f:  # the lowest mantissa bit of fc.weight[0, 0] (bf16, little-endian)
        header_len = int.from_bytes(f.read(8), "little")
        start = 8 + header_len + json.loads(f.read(header_len))["fc.weight"]["data_offsets"][0]
        f.seek(start)
        byte = f.read(1)[0]
        f.seek(start)
        f.write(bytes([byte ^ 1]))
    flipped = load_file(path)  # still a well-formed file of finite weights: only the hash can tell
    assert bool(torch.isfinite(flipped["fc.weight"]).all())
    with pytest.raises(C.ContractError, match=r"model\.safetensors: sha256 .* differs from the .* recorded"):
        load_export(out)
    with pytest.raises(C.ContractError, match="sha256"):  # no flag turns the check off
        load_export(out, allow_foreign=True)


def test_ids_that_disagree_with_the_provenance_are_refused(tiny_run, tmp_path, capsys):
    from eagle3.export.sglang import export_drafter
    from eagle3.model.checkpoint import load_export
    out = str(tmp_path / "draft")
    export_drafter(tiny_run, out)
    _set_ids(out, [1, 3, 4])  # the trained capture written as ids: SGLang's +1 rule shifts every state
    with pytest.raises(C.ContractError, match=r"config\.json: eagle_aux_hidden_state_layer_ids \[1, 3, 4\] make "
                                              r"SGLang 0\.5\.23 capture HF \[2, 4, 5\].*trained on HF \[1, 3, 4\]"):
        load_export(out)
    config, _, prov = load_export(out, allow_foreign=True)  # a drafter from elsewhere: a warning only
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4] and prov.step == 4
    assert "HF [2, 4, 5]" in capsys.readouterr().err


def test_export_shapes_are_checked_against_its_config(tiny_run, tmp_path):
    """2 ids in config.json for an fc trained on 3 states: a clear error naming the tensor, not a matmul crash."""
    from eagle3.export.sglang import export_drafter
    from eagle3.model.checkpoint import load_export
    out = str(tmp_path / "draft")
    export_drafter(tiny_run, out)
    _set_ids(out, [0, 2])
    with pytest.raises(C.ContractError, match=r"capture HF \[1, 3\]"):
        load_export(out)
    with pytest.raises(C.ContractError, match=r"model\.safetensors \(shapes from config\.json, 2 aux hidden "
                                              r"states\).*\n  fc\.weight: shape \(64, 192\), expected \(64, 128\)"):
        load_export(out, allow_foreign=True)
    # the same without provenance (a drafter from elsewhere): refused unless allowed, then its shapes still checked
    os.remove(os.path.join(out, "eagle3_provenance.json"))
    with pytest.raises(C.ContractError, match="no eagle3_provenance.json"):
        load_export(out)
    with pytest.raises(C.ContractError, match=r"fc\.weight: shape \(64, 192\), expected \(64, 128\)"):
        load_export(out, allow_foreign=True)
    _set_ids(out, [0, 2, 3])
    config, tensors, prov = load_export(out, allow_foreign=True)
    assert prov is None and tensors["fc.weight"].shape == (64, 192)


def test_server_command_serves_the_given_chain():
    """One launch line for export (default chain) and quickstart (its own chain length)."""
    from eagle3.export.sglang import SERVE_DRAFT_STEPS, server_command
    line = server_command("sglang", "/m/target", "/m/draft", steps=5)
    assert "--speculative-num-steps 5 " in line and line.endswith("--speculative-num-draft-tokens 6")
    assert "--speculative-draft-model-path /m/draft" in line and "--model-path /m/target" in line
    assert f"--speculative-num-steps {SERVE_DRAFT_STEPS} " in server_command("sglang", "/t", "/d")
    assert server_command("sglang", "/t", "/d", "kimi_k25", True).endswith("--trust-remote-code --disable-cuda-graph")
    assert '"num_speculative_tokens": 5' in server_command("vllm", "/t", "/d", steps=5)


def test_the_export_launch_line_drafts_the_chain_the_run_was_judged_on(tiny_run, tmp_path):
    # the run trained a TTT unroll of 7 with no --accept-steps: its held-out replay walked chains of 7
    from eagle3.export.sglang import SERVE_DRAFT_STEPS, export_drafter, trained_chain_length
    prov = export_drafter(tiny_run, str(tmp_path / "e"))
    assert "--speculative-num-steps 7 " in prov.server_command
    assert trained_chain_length({"accept_steps": 5, "ttt_steps": 7}) == 5
    assert trained_chain_length({}) == SERVE_DRAFT_STEPS
