"""A tiny Kimi-K2.5 checkpoint in the shipped format (/work/shared/KIMI_K25.md), and its dequantized twin.

`write_kimi_int4(path)`: the `kimi_k25` wrapper config with its `text_config` as shipped (model_type `kimi_k2`,
DeepseekV3ForCausalLM, MLA, a dense first layer, routed experts + 1 shared, top-k) and `text_config.quantization_config`
exactly as shipped; routed experts as `weight_packed` int32 [out, in/8] / `weight_scale` bf16 [out, in/32] /
`weight_shape` int32 [2], quantized and packed by compressed-tensors' own pack-quantized compressor; bf16
elsewhere; two safetensors shards with a model.safetensors.index.json; the Kimi chat template.

`write_dequantized(int4_dir, out)`: the same model with every expert decompressed up front by compressed-tensors
(in fp32, so q * scale is exact) into an ordinary transformers checkpoint: the reference the packed path must equal.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import torch

from tiny import DEEPSEEK_V3, KIMI_K25, make_target

GROUP = 32
WEIGHTS = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": GROUP,
           "dynamic": False, "observer": "minmax", "actorder": None, "block_structure": None}
QUANTIZATION_CONFIG = {
    "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
    "kv_cache_scheme": None,
    "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "output_activations": None,
                                  "weights": WEIGHTS}},
    "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
               "re:.*lm_head.*", "re:vision_tower.*", "re:mm_projector.*"],
}
# Kimi-K2.5's text model at toy size: n_group 1 / topk_group 1 and a routed scaling factor as in the real one.
TEXT = dict(DEEPSEEK_V3, moe_intermediate_size=64, n_group=1, topk_group=1, routed_scaling_factor=2.827)
# What the shipped config.json names (it points at Moonshot's custom code; transformers 5.24 has the model natively).
SHIPPED_TOP = {"architectures": ["KimiK25ForConditionalGeneration"],
               "auto_map": {"AutoConfig": "configuration_kimi_k25.KimiK25Config",
                            "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
                            "AutoModelForCausalLM": "modeling_kimi_k25.KimiK25ForConditionalGeneration"}}
SHIPPED_TEXT = {"model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"]}
EXPERT_KEY = (".mlp.experts.", ".gate_proj.weight", ".up_proj.weight", ".down_proj.weight")


def _is_routed_expert(key: str) -> bool:
    return EXPERT_KEY[0] in key and key.endswith(EXPERT_KEY[1:])


def scheme():
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    return QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**WEIGHTS))


def compress(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """One expert matrix -> weight_packed / weight_scale / weight_shape, by compressed-tensors: its min-max qparams
    per group of 32 (the config's observer), then its pack-quantized compressor."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization.utils import calculate_qparams
    s = scheme()
    out_f, in_f = weight.shape
    groups = weight.reshape(out_f, in_f // GROUP, GROUP)
    scale, zero_point = calculate_qparams(groups.amin(-1), groups.amax(-1), s.weights)
    scale = scale.to(torch.bfloat16)  # shipped dtype; quantized against the stored (rounded) scale
    sd = PackedQuantizationCompressor.compress({"weight": weight, "weight_scale": scale,
                                                "weight_zero_point": zero_point}, s)
    assert set(sd) == {"weight_packed", "weight_scale", "weight_shape"}, sorted(sd)
    sd["weight_shape"] = sd["weight_shape"].to(torch.int32)  # the shipped files hold int32 (compressor: int64)
    return sd


def decompress(parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """compressed-tensors' own decompression of one matrix, in fp32 (exact: 4-bit ints times bf16 scales)."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    sd = dict(parts, weight_scale=parts["weight_scale"].float())
    return PackedQuantizationCompressor.decompress(sd, scheme())["weight"]


def _shipped_key(key: str) -> str:
    # transformers 5.24 writes the text layers back as `blocks` (its load-time rename is global); Kimi ships `layers`.
    return key.replace("language_model.model.blocks.", "language_model.model.layers.")


def _save_sharded(path: str, tensors: dict[str, torch.Tensor], split) -> None:
    from safetensors.torch import save_file
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    files: list[dict] = [{}, {}]
    for k, t in tensors.items():
        files[1 if split(k) else 0][k] = t.contiguous()
    weight_map = {}
    for name, part in zip(names, files):
        save_file(part, os.path.join(path, name), metadata={"format": "pt"})
        weight_map.update({k: name for k in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)


def write_kimi_int4(path: str, seed: int = 0, layer_scale: float = 3.0, **text_overrides) -> str:
    """The shipped-format checkpoint in `path` (see the module docstring). layer_scale > 1 makes the experts move
    the residual stream enough that a dequantization error shows in the captured states."""
    from safetensors.torch import load_file
    from tiny_tokenizers import make_tokenizer
    with tempfile.TemporaryDirectory() as tmp:
        src = make_target(tmp, "kimi_k25", seed=seed, tokenizer=make_tokenizer("kimi"), layer_scale=layer_scale,
                          text_config=dict(TEXT, architectures=None, **text_overrides))
        dense = load_file(os.path.join(src, "model.safetensors"))
        with open(os.path.join(src, "config.json")) as f:
            cfg = json.load(f)
        os.makedirs(path, exist_ok=True)
        for name in os.listdir(src):
            if name not in ("model.safetensors", "config.json"):
                shutil.copy(os.path.join(src, name), path)
    tensors = {}
    for key, t in sorted(dense.items()):
        key = _shipped_key(key)
        if _is_routed_expert(key):
            for part, v in compress(t).items():
                tensors[key.removesuffix(".weight") + "." + part] = v
        else:
            tensors[key] = t.to(torch.bfloat16)
    _save_sharded(path, tensors, split=lambda k: ".layers." in k and int(k.split(".layers.")[1].split(".")[0]) >= 3)
    cfg.update(SHIPPED_TOP, dtype="bfloat16")
    cfg["text_config"].update(SHIPPED_TEXT, dtype="bfloat16", quantization_config=QUANTIZATION_CONFIG)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return path


def write_dequantized(int4_dir: str, out: str) -> str:
    """The reference: `int4_dir` with every expert decompressed by compressed-tensors into fp32 dense weights, the
    rest cast to fp32, no quantization_config: an ordinary checkpoint transformers loads as DeepseekV3 layers."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    with open(os.path.join(int4_dir, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    tensors, packed = {}, {}
    for key, name in weight_map.items():
        with safe_open(os.path.join(int4_dir, name), "pt") as f:
            t = f.get_tensor(key)
        base, _, part = key.rpartition(".")
        if part in ("weight_packed", "weight_scale", "weight_shape"):
            packed.setdefault(base, {})[part] = t
        else:
            tensors[key] = t.float()
    for base, parts in packed.items():
        tensors[base + ".weight"] = decompress(parts)
    os.makedirs(out, exist_ok=True)
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    for name in os.listdir(int4_dir):
        if not name.startswith("model") and name != "config.json":
            shutil.copy(os.path.join(int4_dir, name), out)
    with open(os.path.join(int4_dir, "config.json")) as f:
        cfg = json.load(f)
    del cfg["text_config"]["quantization_config"]
    cfg["dtype"] = cfg["text_config"]["dtype"] = "float32"
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return out


__all__ = ["KIMI_K25", "QUANTIZATION_CONFIG", "write_kimi_int4", "write_dequantized", "compress", "decompress"]
