"""Kimi-K2.5 as shipped (compressed-tensors INT4 routed experts): the fixture is the shipped format, loading keeps
the experts packed, and the captured states equal a reference whose experts were dequantized up front -- in one
process, under TP 2 and under DP 2 x TP 2."""

import json
import re
import os
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from eagle3 import contract as C
from eagle3.target import int4_experts as I
from eagle3.target.capture import HiddenStateCapture
from eagle3.target.load import find_backbone, load_target

from kimi_int4 import QUANTIZATION_CONFIG, TEXT, write_dequantized, write_kimi_int4
from test_dump import dump, read_dump
from tiny import reference_hidden_states

pytest.importorskip("compressed_tensors")

INDICES = [1, 3, 4, 5]  # every MoE layer's output is captured (layer 0 is the dense one)
DEQUANTIZE = I.dequantize_weight  # the real one, which the broken variants below misuse
E, H, II = TEXT["n_routed_experts"], TEXT["hidden_size"], TEXT["moe_intermediate_size"]
DENSE = {(E, 2 * II, H), (E, II, H), (E, H, II)}  # transformers' fused experts, or a stack of one matrix per expert


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    root = tmp_path_factory.mktemp("kimi_int4")
    int4 = write_kimi_int4(str(root / "int4"))
    return int4, write_dequantized(int4, str(root / "reference"))


@pytest.fixture(scope="module")
def batch():
    ids = torch.randint(0, 512, (2, 19), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 13:] = 0  # right padding, as the dump batches
    return ids, mask


@pytest.fixture(scope="module")
def packed_model(kimi):
    return load_target(kimi[0], torch.float32, torch.device("cpu"))


@pytest.fixture(scope="module")
def reference(kimi, batch):
    hs, logits, _ = reference_hidden_states(kimi[1], *batch)
    return hs, logits


def capture(model, batch):
    with HiddenStateCapture(find_backbone(model, TEXT["num_hidden_layers"]), INDICES,
                            head=model.get_output_embeddings()) as cap:
        return cap.run(*batch)


def assert_equal_reference(states, reference, batch, atol=1e-5):
    hs, logits = reference
    real = batch[1].bool()  # padded positions are not compared (nor dumped)
    for k in INDICES:
        torch.testing.assert_close(states[C.hidden_state_key(k)][real], hs[k][real], atol=atol, rtol=atol)
    torch.testing.assert_close(states[C.FINAL_HIDDEN][real], hs[-1][real], atol=atol, rtol=atol)
    assert torch.equal(states[C.TARGET_ARGMAX][real].long(), logits.argmax(-1)[real])


def test_fixture_is_the_shipped_format(kimi):
    int4 = kimi[0]
    with open(os.path.join(int4, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["model_type"] == "kimi_k25" and cfg["architectures"] == ["KimiK25ForConditionalGeneration"]
    text = cfg["text_config"]
    assert text["model_type"] == "kimi_k2" and text["architectures"] == ["DeepseekV3ForCausalLM"]
    assert text["quantization_config"] == QUANTIZATION_CONFIG and "quantization_config" not in cfg
    assert (text["first_k_dense_replace"], text["n_shared_experts"], text["n_routed_experts"]) == (1, 1, E)
    assert text["moe_intermediate_size"] % 32 == 0 and text["vocab_size"] <= 512 and text["hidden_size"] == 64
    with open(os.path.join(int4, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    assert len(set(weight_map.values())) == 2
    seen = {}
    for key, name in weight_map.items():
        with safe_open(os.path.join(int4, name), "pt") as f:
            t = f.get_slice(key)
            seen[key] = (t.get_dtype(), t.get_shape())
    moe_layers = range(1, TEXT["num_hidden_layers"])
    for layer in moe_layers:
        for e in range(E):
            for proj, (out_f, in_f) in {"gate": (II, H), "up": (II, H), "down": (H, II)}.items():
                base = f"language_model.model.layers.{layer}.mlp.experts.{e}.{proj}_proj."
                assert seen.pop(base + "weight_packed") == ("I32", [out_f, in_f // 8])
                assert seen.pop(base + "weight_scale") == ("BF16", [out_f, in_f // 32])
                assert seen.pop(base + "weight_shape") == ("I32", [2])
    assert {dt for dt, _ in seen.values()} == {"BF16"}  # everything else
    assert "language_model.model.layers.0.mlp.gate_proj.weight" in seen  # the dense first layer
    assert "language_model.model.layers.1.mlp.shared_experts.down_proj.weight" in seen
    assert "language_model.lm_head.weight" in seen
    with open(os.path.join(int4, "chat_template.jinja")) as f:
        assert "<|im_assistant|>" in f.read()  # Kimi's template (tests/tiny_tokenizers.py "kimi")


def test_transformers_own_path_reads_the_fixture_like_the_reference(kimi, batch, reference):
    """Cross-check of the fixture, independent of the packed path: transformers' compressed-tensors loading (it
    dequantizes every expert, to bf16) gives the reference's states up to that bf16 rounding."""
    from transformers import AutoModelForImageTextToText
    model = AutoModelForImageTextToText.from_pretrained(kimi[0], dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.float()  # its experts come out bf16 whatever dtype says
    assert_equal_reference(capture(model, batch), reference, batch, atol=2e-3)


def test_bf16_equals_transformers_own_dequantization(kimi, batch):
    """In bf16 (the dump's default) every expert matrix the packed path makes is bit-identical to the bf16 experts
    transformers' own compressed-tensors loading holds, and the states agree within bf16 rounding (transformers
    runs them with grouped_mm, the packed path with its eager loop: another summation order)."""
    from transformers import AutoModelForImageTextToText
    theirs = AutoModelForImageTextToText.from_pretrained(kimi[0], dtype=torch.bfloat16)
    ours = load_target(kimi[0], torch.bfloat16, torch.device("cpu"))
    by_name = dict(theirs.named_modules())
    pairs = [(m, by_name[n]) for n, m in ours.named_modules() if isinstance(m, I.PackedInt4Experts)]
    assert len(pairs) == TEXT["num_hidden_layers"] - 1
    for m, t in pairs:
        for e in range(E):
            gate_up = I.dequantize_weight(m.gate_up_packed[e], m.gate_up_scale[e], (2 * II, H), m.args, torch.bfloat16)
            down = I.dequantize_weight(m.down_packed[e], m.down_scale[e], (H, II), m.args, torch.bfloat16)
            assert torch.equal(gate_up, t.gate_up_proj[e]) and torch.equal(down, t.down_proj[e])
    a, b = capture(ours, batch), capture(theirs, batch)
    real = batch[1].bool()
    for k in [*map(C.hidden_state_key, INDICES), C.FINAL_HIDDEN]:
        torch.testing.assert_close(a[k][real].float(), b[k][real].float(), atol=0.1, rtol=0.05)


def test_loading_keeps_the_experts_packed(packed_model):
    tensors = dict(packed_model.named_parameters()) | dict(packed_model.named_buffers())
    dense = [n for n, t in tensors.items() if t.is_floating_point() and tuple(t.shape) in DENSE]
    assert not dense, f"dense expert tensors: {dense}"
    experts = [m for m in packed_model.modules() if isinstance(m, I.PackedInt4Experts)]
    assert len(experts) == TEXT["num_hidden_layers"] - 1
    for m in experts:
        assert m.gate_up_packed.dtype == m.down_packed.dtype == torch.int32
        assert tuple(m.gate_up_packed.shape) == (E, 2 * II, H // 8) and tuple(m.down_packed.shape) == (E, H, II // 8)
        assert tuple(m.gate_up_scale.shape) == (E, 2 * II, H // 32) and m.gate_up_scale.dtype == torch.bfloat16
        assert (m.start, m.stop, m.group) == (0, E, None)


def test_captured_states_equal_the_dequantized_reference(packed_model, batch, reference):
    assert_equal_reference(capture(packed_model, batch), reference, batch)


def _wrong_group(packed, scale, shape, args, dtype):
    return DEQUANTIZE(packed, scale[:, ::2], shape, args.model_copy(update={"group_size": 64}),
                                           dtype)


def _transposed_scale(packed, scale, shape, args, dtype):
    return DEQUANTIZE(packed, scale.t().reshape(scale.shape), shape, args, dtype)


def _swapped_nibbles(packed, scale, shape, args, dtype):
    w = DEQUANTIZE(packed, torch.ones_like(scale), shape, args, dtype)
    s = scale.to(dtype).repeat_interleave(args.group_size, dim=1)
    return w.view(w.shape[0], -1, 2).flip(-1).reshape(w.shape) * s


@pytest.mark.parametrize("broken", [_wrong_group, _transposed_scale, _swapped_nibbles])
def test_a_wrong_dequantization_is_caught(packed_model, batch, reference, monkeypatch, broken):
    """The equality test fails for the right reason: each of these mistakes moves the captured states well past
    the tolerance."""
    monkeypatch.setattr(I, "dequantize_weight", broken)
    with pytest.raises(AssertionError):
        assert_equal_reference(capture(packed_model, batch), reference, batch)
    hs = reference[0]
    states = capture(packed_model, batch)
    assert (states[C.hidden_state_key(5)] - hs[5]).abs().max() > 1e-2


def _without(src, dst, key):
    """A copy of checkpoint `src` lacking one tensor."""
    import shutil
    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    name = index["weight_map"].pop(key)
    tensors = load_file(dst / name)
    del tensors[key]
    save_file(tensors, dst / name, metadata={"format": "pt"})
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    return str(dst)


@pytest.mark.parametrize("key, msg", [
    ("language_model.model.layers.2.mlp.shared_experts.down_proj.weight", "left missing .*shared_experts.down_proj"),
    ("language_model.model.layers.3.mlp.experts.5.up_proj.weight_scale", "no scale tensor for layer 3 expert 5 up"),
])
def test_a_checkpoint_with_a_tensor_missing_is_refused(kimi, tmp_path, key, msg):
    """Never a silently random (or empty) weight in what the dump runs."""
    from eagle3.target.load import TargetError
    with pytest.raises(TargetError, match=msg):
        load_target(_without(kimi[0], tmp_path / "c", key), torch.float32, torch.device("cpu"))


def test_only_the_int4_group_scheme_takes_the_packed_path():
    """Anything else (another bit width, unquantized, fp8) loads through transformers as before."""
    qc = json.loads(json.dumps(QUANTIZATION_CONFIG))
    def cfg(**text):
        return {"model_type": "kimi_k25", "text_config": {"model_type": "kimi_k2", **text}}
    assert I.packed_int4_config(cfg(quantization_config=qc)) == qc
    assert I.packed_int4_config({"model_type": "deepseek_v3", "quantization_config": qc}) == qc
    assert I.packed_int4_config({"model_type": "qwen3_moe", "quantization_config": qc}) is None
    assert I.packed_int4_config(cfg()) is None
    assert I.packed_int4_config(cfg(quantization_config={"quant_method": "fp8"})) is None
    qc["config_groups"]["group_0"]["weights"]["num_bits"] = 8
    assert I.packed_int4_config(cfg(quantization_config=qc)) is None


def _torchrun(n, *args, timeout=400):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n), "--standalone", *map(str, args)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr[-4000:]
    return r


SHARE_SCRIPT = """
import json, os, sys, torch
from eagle3.target import int4_experts as I
from eagle3.target.load import load_target
m = load_target(sys.argv[1], torch.float32, torch.device("cpu"), tp_size=2)
t = dict(m.named_parameters()) | dict(m.named_buffers())
experts = [x for x in m.modules() if isinstance(x, I.PackedInt4Experts)]
json.dump({"dense": [n for n, v in t.items() if v.is_floating_point() and tuple(v.shape) in %r],
           "shares": sorted({(x.start, x.stop, tuple(x.gate_up_packed.shape), str(x.gate_up_packed.dtype),
                              torch.distributed.get_world_size(x.group)) for x in experts})},
          open(os.path.join(sys.argv[2], f"rank{os.environ['RANK']}.json"), "w"))
"""


@pytest.mark.slow
def test_each_tp_rank_holds_its_share_of_the_packed_experts(kimi, tmp_path):
    script = tmp_path / "share.py"
    script.write_text(SHARE_SCRIPT % (DENSE | {(E // 2, *s[1:]) for s in DENSE},))
    _torchrun(2, script, kimi[0], tmp_path)
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["dense"] == []
        half = E // 2
        assert got["shares"] == [[rank * half, (rank + 1) * half, [half, 2 * II, H // 8], "torch.int32", 2]]


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [2, 4])
def test_tensor_parallel_dump_equals_single_process(kimi, convs, tmp_path, nproc):
    """torchrun + gloo, --tp 2 (and DP 2 x TP 2 on 4 ranks): the same dataset as one process, within fp32
    rounding (the experts' partial sums are all-reduced in another order)."""
    ref = dump(kimi[0], convs, tmp_path / "one", shard_size_mb=0.02, num_samples=8)
    _torchrun(nproc, "-m", "eagle3.dump", "--target", kimi[0], "--data", convs, "--out", tmp_path / "tp", "--tp", 2,
              "--shard-size-mb", 0.02, "--num-samples", 8, "--dtype", "fp32", "--no-progress")
    a, ma = read_dump(tmp_path / "one")
    b, mb = read_dump(tmp_path / "tp")
    assert (mb.tp_size, mb.dp_size) == (2, nproc // 2) and ma.identity() == mb.identity() == ref.identity()
    assert [(r.file, r.samples, r.tokens) for r in ma.shards] == [(r.file, r.samples, r.tokens) for r in mb.shards]
    for si in a:
        for k in a[si]:
            torch.testing.assert_close(b[si][k], a[si][k], atol=1e-5, rtol=1e-5)
    assert C.hidden_state_key(3) in a[0]


# --- The tokenizer: Kimi-K2.5 ships it as custom code (tokenization_kimi.py); it runs only behind a flag. ---

REMOTE_TOKENIZER = '''from transformers import PreTrainedTokenizerFast


class TinyRemoteTokenizer(PreTrainedTokenizerFast):
    """Stands in for a tokenizer a target ships as code (tokenization_kimi.TikTokenTokenizer)."""
'''


@pytest.fixture(scope="module")
def remote_tokenizer_target(tiny_targets, tmp_path_factory):
    import shutil
    path = tmp_path_factory.mktemp("remote_tok") / "llama"
    shutil.copytree(tiny_targets["llama"], path)
    (path / "tokenization_tiny.py").write_text(REMOTE_TOKENIZER)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg["auto_map"] = {"AutoTokenizer": [None, "tokenization_tiny.TinyRemoteTokenizer"]}  # Kimi: [slow, None]
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return str(path)


def test_a_tokenizer_shipped_as_code_needs_the_flag(remote_tokenizer_target, convs, tmp_path):
    from eagle3.target.load import TargetError, load_tokenizer
    with pytest.raises(TargetError, match=r"tokenization_tiny.TinyRemoteTokenizer.*--trust-remote-code"):
        load_tokenizer(remote_tokenizer_target)
    assert type(load_tokenizer(remote_tokenizer_target, trust_remote_code=True)).__name__ == "TinyRemoteTokenizer"
    with pytest.raises(TargetError, match="--trust-remote-code"):
        dump(remote_tokenizer_target, convs, tmp_path / "refused", num_samples=2)
    dump(remote_tokenizer_target, convs, tmp_path / "d", num_samples=2, trust_remote_code=True)
    assert json.loads((tmp_path / "d" / "dump_config.json").read_text())["args"]["trust_remote_code"] is True
    # the manifest names the shipped code that was run; a dump without the flag records none
    from eagle3.contract import load_manifest
    assert load_manifest(str(tmp_path / "d")).tokenizer.remote_code == "tokenization_tiny.TinyRemoteTokenizer"


def test_cli_takes_trust_remote_code(remote_tokenizer_target, convs, tmp_path):
    r = subprocess.run([sys.executable, "-m", "eagle3.cli", "dump", "--target", remote_tokenizer_target, "--data",
                        convs, "--out", str(tmp_path / "d"), "--num-samples", "2", "--dtype", "fp32",
                        "--no-progress", "--trust-remote-code"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]


SLOW_STAND_INS = {  # kind -> (this folder's file, the name it ships under, its class)
    "python": ("slow_tokenizer.py", "tokenization_tiny_slow", "SlowByteLevelBPE"),
    "tiktoken": ("tiktoken_tokenizer.py", "tokenization_tiny_tiktoken", "TiktokenBPE"),
}


@pytest.fixture(scope="module", params=sorted(SLOW_STAND_INS))
def slow_remote_tokenizer_target(request, tiny_targets, tmp_path_factory):
    """The tiny Llama target with its tokenizer shipped as code the way Kimi-K2.5 ships tokenization_kimi.py: a
    slow (Python, no offsets) tokenizer class, auto_map [slow, None]; same vocab as the target's fast tokenizer.
    "tiktoken": the vocabulary as a tiktoken.model run by the tiktoken package, as Kimi's is. Returns the target
    directory (shipped_code names the class)."""
    import shutil
    src, module, cls = SLOW_STAND_INS[request.param]
    path = tmp_path_factory.mktemp(f"slow_remote_tok_{request.param}") / "llama"
    shutil.copytree(tiny_targets["llama"], path)
    shutil.copy(os.path.join(os.path.dirname(__file__), src), path / f"{module}.py")
    if request.param == "tiktoken":
        from tiktoken_tokenizer import write_tiktoken_model
        write_tiktoken_model((path / "tokenizer.json").read_text(), str(path / "tiktoken.model"))
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg["auto_map"] = {"AutoTokenizer": [f"{module}.{cls}", None]}
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return str(path)


def shipped_code(target_dir: str) -> str:
    """The tokenizer class a target ships as code ("module.Class", auto_map's slow entry)."""
    return json.loads(open(os.path.join(target_dir, "tokenizer_config.json")).read())["auto_map"]["AutoTokenizer"][0]


def test_a_slow_tokenizer_shipped_as_code_dumps_like_the_fast_one(slow_remote_tokenizer_target, tiny_targets, convs,
                                                                  tmp_path):
    """Kimi-K2.5's tokenizer is slow: it loads behind --trust-remote-code, and the dump (loss mask by the offset-free
    path) holds the same ids, masks and states as a dump of the same model with the fast tokenizer."""
    from eagle3.contract import load_manifest
    from eagle3.target.load import TargetError, load_tokenizer
    code = shipped_code(slow_remote_tokenizer_target)
    with pytest.raises(TargetError, match=re.escape(code) + ".*--trust-remote-code"):
        load_tokenizer(slow_remote_tokenizer_target)
    tok = load_tokenizer(slow_remote_tokenizer_target, trust_remote_code=True)
    assert type(tok).__name__ == code.split(".")[1] and not tok.is_fast
    ref = dump(tiny_targets["llama"], convs, tmp_path / "fast", num_samples=6)
    dump(slow_remote_tokenizer_target, convs, tmp_path / "slow", num_samples=6, trust_remote_code=True)
    a, _ = read_dump(tmp_path / "fast")
    b, mb = read_dump(tmp_path / "slow")
    assert sorted(a) == sorted(b) and len(a) == 6 and mb.tokenizer.sha256 == ref.tokenizer.sha256
    for si in a:
        assert torch.equal(b[si][C.INPUT_IDS], a[si][C.INPUT_IDS]) and torch.equal(b[si][C.LOSS_MASK], a[si][C.LOSS_MASK])
        assert a[si][C.LOSS_MASK].any() and not a[si][C.LOSS_MASK].all()
        torch.testing.assert_close(b[si][C.FINAL_HIDDEN], a[si][C.FINAL_HIDDEN], atol=0, rtol=0)
    assert load_manifest(str(tmp_path / "slow")).tokenizer.remote_code == code
    # training checks the target's tokenizer against the dumps': the same flag lets it run the shipped code
    from eagle3.train.setup import check_target_matches_dumps
    with pytest.raises(TargetError, match="--trust-remote-code"):
        check_target_matches_dumps(slow_remote_tokenizer_target, mb)
    check_target_matches_dumps(slow_remote_tokenizer_target, mb, trust_remote_code=True)


def test_regenerate_runs_a_tokenizer_shipped_as_code_only_behind_the_flag(slow_remote_tokenizer_target, tiny_targets,
                                                                       convs, tmp_path):
    """eagle3 regenerate --engine hf with Kimi's kind of tokenizer: refused without --trust-remote-code; with it, the
    greedy answers equal those written through the fast tokenizer of the same model, and regenerate.json records
    the shipped code that ran."""
    from eagle3.regenerate.config import RegenConfig
    from eagle3.regenerate.job import run_regenerate
    from eagle3.target.load import TargetError
    kw = dict(engine="hf", max_new_tokens=8, batch_size=4, num_samples=4, max_turns=1, progress=False)
    with pytest.raises(TargetError, match="--trust-remote-code"):
        run_regenerate(RegenConfig(data=[convs], out=str(tmp_path / "refused"), target=slow_remote_tokenizer_target,
                                   **kw))
    fast = run_regenerate(RegenConfig(data=[convs], out=str(tmp_path / "fast"), target=tiny_targets["llama"], **kw))
    slow = run_regenerate(RegenConfig(data=[convs], out=str(tmp_path / "slow"), target=slow_remote_tokenizer_target,
                                      trust_remote_code=True, **kw))
    assert slow["tokenizer"]["remote_code"] == shipped_code(slow_remote_tokenizer_target)
    assert fast["tokenizer"]["remote_code"] is None and slow["identity"] == fast["identity"]
    lines = [(tmp_path / d / "conversations.jsonl").read_text() for d in ("fast", "slow")]
    # (the random tiny model's answer to one prompt is partial bytes of one character, cut at --max-new-tokens:
    # nothing decodes cleanly, so it is an empty-answer error under both tokenizers alike)
    assert lines[0] == lines[1] and lines[0].count("\n") == fast["counts"]["conversations"] >= 3


def test_trust_remote_code_runs_the_tokenizer_code_alone(remote_tokenizer_target, tmp_path):
    """--trust-remote-code runs the tokenizer class a target ships, and nothing else: a config.json auto_map naming
    a configuration / modeling file (code that would run on import) is not executed (before: it was, through
    AutoTokenizer(trust_remote_code=True) looking the tokenizer up via AutoConfig)."""
    import shutil
    from eagle3.target.load import load_tokenizer
    path = tmp_path / "t"
    shutil.copytree(remote_tokenizer_target, path)
    ran = tmp_path / "ran"
    for mod in ("configuration_evil", "modeling_evil"):
        (path / f"{mod}.py").write_text(
            f"open({str(ran / mod)!r}, 'w').write('imported')\n"
            "from transformers import LlamaConfig\n"
            "class EvilConfig(LlamaConfig):\n    model_type = 'llama'\n")
    ran.mkdir()
    cfg = json.loads((path / "config.json").read_text())
    cfg["auto_map"] = {"AutoConfig": "configuration_evil.EvilConfig", "AutoModelForCausalLM": "modeling_evil.Evil"}
    (path / "config.json").write_text(json.dumps(cfg))
    tok_cfg = json.loads((path / "tokenizer_config.json").read_text())
    tok_cfg.pop("tokenizer_class", None)  # what makes AutoTokenizer consult the config
    (path / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    tok = load_tokenizer(str(path), trust_remote_code=True)
    assert type(tok).__name__ == "TinyRemoteTokenizer"
    assert os.listdir(ran) == []  # neither the configuration nor the modeling file ran
