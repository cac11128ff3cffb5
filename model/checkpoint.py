"""A drafter directory as the serving engines load it: config.json + model.safetensors (+ eagle3_provenance.json).

The one place that maps between DrafterConfig / the drafter's tensors and that format, both ways:
  * `draft_config`: the config.json an export writes (every key SGLang and vLLM read for the layout);
  * `load_export`: an export read back and checked (weights' sha256, ids against the trained capture, every
    tensor's name and shape), or a published drafter (no provenance; names mapped as SGLang's loaders map them);
  * `export_drafter_config`: config.json -> DrafterConfig; `capture_indices_of_export`: what a server captures.
export (writes), eval (serves) and train --init-from (warm start) all read exports through here
(docs/contract.md §6-§7, docs/drafters.md).
"""

from __future__ import annotations

import os
import sys

import torch

from eagle3 import contract as C
from eagle3 import serving as S
from eagle3.model.config import OPTIONS, DrafterConfig
from eagle3.model.drafter import LAYOUT_MODULES, architecture, tensor_shapes
from eagle3.records import (EXPORT_CONFIG_FILE as CONFIG_FILE, EXPORT_WEIGHTS_FILE as WEIGHTS_FILE, PROVENANCE_FILE,
                            ExportProvenance)
from eagle3.vocab_map import vocab_map_problem

# SGLang class -> DrafterConfig.layout
ARCHITECTURES = {m.ARCHITECTURE: layout for layout, m in LAYOUT_MODULES.items()}
EXPORT_DTYPE = torch.bfloat16


def check_tensors(tensors: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]], source: str,
                  float_dtype: torch.dtype | None = None, architecture: str = "LlamaForCausalLMEagle3") -> None:
    """Exactly the expected names, shapes and dtypes (floats: any float, or `float_dtype`; d2t int64; t2d bool),
    finite weights, and d2t consistent with t2d. ContractError naming every problem otherwise."""
    problems = []
    missing, unknown = sorted(set(shapes) - set(tensors)), sorted(set(tensors) - set(shapes))
    if missing:
        problems.append(f"missing tensors {missing}")
    if unknown:
        problems.append(f"unknown tensors {unknown} (SGLang <= 0.5.11 silently drops names it does not know)")
    for name, shape in shapes.items():
        t = tensors.get(name)
        if t is None:
            continue
        if tuple(t.shape) != tuple(shape):
            problems.append(f"{name}: shape {tuple(t.shape)}, expected {tuple(shape)}")
        if name == "d2t":
            if t.dtype != torch.int64:
                problems.append(f"d2t: dtype {t.dtype}, expected torch.int64")
        elif name == "t2d":
            if t.dtype != torch.bool:
                problems.append(f"t2d: dtype {t.dtype}, expected torch.bool")
        elif not t.is_floating_point() or (float_dtype is not None and t.dtype != float_dtype):
            problems.append(f"{name}: dtype {t.dtype}, expected {float_dtype or 'a floating dtype'}")
        elif not bool(torch.isfinite(t).all()):
            problems.append(f"{name}: holds NaN or inf")
    d2t, t2d = tensors.get("d2t"), tensors.get("t2d")
    if (d2t is not None and t2d is not None and d2t.dtype == torch.int64 and t2d.dtype == torch.bool
            and d2t.dim() == 1 and t2d.dim() == 1):  # wrong dtypes or ranks are reported above already
        problem = vocab_map_problem(d2t, t2d)
        if problem:
            problems.append(problem)
    if problems:
        raise C.ContractError(f"{source}: does not fit SGLang's {architecture}:\n  " + "\n  ".join(problems))



def draft_config(dcfg, ids: list[int]) -> dict:
    """config.json of the exported drafter: every key SGLang (and vLLM) read for its layout, explicit, and the
    EAGLE-3.1 switches where each engine reads them (docs/drafters.md): fc_norm / norm_output at the top level,
    norm_before_fc in eagle_config (SGLang reads it there first) and at the top level (vLLM < 0.22 reads only that)."""
    common = {
        "architectures": [architecture(dcfg)],
        "num_hidden_layers": 1,
        "hidden_size": dcfg.hidden_size,
        "num_attention_heads": dcfg.num_attention_heads,
        "num_key_value_heads": dcfg.num_key_value_heads,
    }
    if dcfg.layout == "mla":
        # model_type kimi_k2: SGLang registers it as DeepseekV3's config (sglang/srt/utils/hf_transformers/common.py)
        shape = {"model_type": "kimi_k2", "q_lora_rank": dcfg.q_lora_rank, "kv_lora_rank": dcfg.kv_lora_rank,
                 "qk_nope_head_dim": dcfg.qk_nope_head_dim, "qk_rope_head_dim": dcfg.qk_rope_head_dim,
                 "v_head_dim": dcfg.v_head_dim, "rope_interleave": True}
    else:
        shape = {"model_type": "llama", "head_dim": dcfg.head_dim}
    return {
        **common, **shape,
        "intermediate_size": dcfg.intermediate_size,
        "hidden_act": dcfg.hidden_act,
        "rms_norm_eps": dcfg.rms_norm_eps,
        "rope_theta": dcfg.rope_theta,
        "rope_scaling": dcfg.rope_scaling,
        "max_position_embeddings": dcfg.max_position_embeddings,
        "vocab_size": dcfg.vocab_size,
        "draft_vocab_size": dcfg.draft_vocab_size,  # never null: null makes SGLang serve the TARGET's lm_head
        "target_hidden_size": dcfg.target_hidden_size,
        "tie_word_embeddings": False,
        "fc_norm": dcfg.fc_norm,
        "norm_output": dcfg.norm_output,
        "norm_before_fc": dcfg.norm_before_fc,
        "torch_dtype": "bfloat16",
        "dtype": "bfloat16",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(ids), "use_aux_hidden_state": True,
                         "norm_before_fc": dcfg.norm_before_fc},
    }


# ---------------------------------------------------------------------------------------------- reading back

_FOREIGN_HINT = "a drafter from elsewhere: pass allow_foreign (eagle3 eval --allow-foreign-export) to use it anyway"


def _read_provenance(export_dir: str, allow_foreign: bool = False) -> ExportProvenance | None:
    """The export's provenance; None for an export without one (a drafter from elsewhere), only if
    `allow_foreign`: without it nothing says what the drafter was trained on, so its ids cannot be checked."""
    path = os.path.join(export_dir, PROVENANCE_FILE)
    if not os.path.exists(path):
        if allow_foreign:
            return None
        raise C.ContractError(f"{export_dir}: no {PROVENANCE_FILE}, so nothing records which hidden states the "
                              f"drafter was trained on and its eagle_aux_hidden_state_layer_ids cannot be checked "
                              f"({_FOREIGN_HINT})")
    return ExportProvenance.read(path)  # ContractError naming the file and the key it lacks


def _served_capture(config: dict, engine: str, model_type: str, release: str | None, num_layers: int) -> list[int]:
    """The contract's forward rule of `engine` (SGLang: of `release` and the target's `model_type`) applied to
    config.json's ids: the HF indices that server captures and feeds the drafter's fc."""
    ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if engine == "vllm":
        if ids is None:
            ids = config.get("eagle_aux_hidden_state_layer_ids")
        return S.vllm_capture_indices(ids, num_layers)
    if engine != "sglang":
        raise C.ContractError(f"unknown engine {engine!r}")
    return S.sglang_capture_indices(ids, model_type, release, num_layers)


def _check_ids_against_provenance(export_dir: str, config: dict, prov: ExportProvenance,
                                  allow_foreign: bool) -> list[int]:
    """What the provenance's server captures with config.json's ids; refused (with `allow_foreign`: a warning)
    unless it is exactly the capture the drafter was trained on, since other states silently cost acceptance."""
    where = f"{export_dir}/{CONFIG_FILE}"
    trained = prov.capture.hidden_state_indices
    try:
        served = _served_capture(config, prov.engine, prov.target.model_type, prov.sglang_release,
                                 prov.target.num_hidden_layers)
    except C.ContractError as e:
        raise C.ContractError(f"{where}: eagle_aux_hidden_state_layer_ids cannot be served: {e}") from e
    if served != trained:
        server = "vLLM" if prov.engine == "vllm" else f"SGLang {prov.sglang_release}"
        msg = (f"{where}: eagle_aux_hidden_state_layer_ids "
               f"{(config.get('eagle_config') or {}).get('eagle_aux_hidden_state_layer_ids')} make {server} capture "
               f"HF {served}, but {PROVENANCE_FILE} says the drafter was trained on HF {trained} (ids "
               f"{prov.eagle_aux_hidden_state_layer_ids})")
        if not allow_foreign:
            raise C.ContractError(f"{msg}; re-export, or {_FOREIGN_HINT}")
        print(f"warning: {msg}; used anyway (allow_foreign)", file=sys.stderr)
    return served


def _verify_weights(export_dir: str, prov: ExportProvenance) -> None:
    """sha256 of the weight file against the one the exporter recorded: a flipped bit loads silently otherwise."""
    path = os.path.join(export_dir, WEIGHTS_FILE)
    recorded = prov.model_safetensors_sha256
    if not recorded:
        raise C.ContractError(f"{export_dir}/{PROVENANCE_FILE}: records no model_safetensors_sha256, so {path} "
                              "cannot be verified; re-export")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: not found")
    actual = C.file_sha256(path)
    if actual != recorded:
        raise C.ContractError(f"{path}: sha256 {actual} differs from the {recorded} recorded in {PROVENANCE_FILE} "
                              "(corrupted or modified after the export); re-export")


def export_num_aux_layers(config: dict, prov: ExportProvenance | None, where: str = CONFIG_FILE) -> int:
    """How many target hidden states the server concatenates into fc: those its forward rule captures with
    config.json's ids (docs/contract.md §7); for an export without provenance, one per id. The one rule for an
    export's num_aux_layers: load_export checks fc against it, eval builds its drafter with it."""
    if prov is None:
        ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        if not ids:  # the server's default set then depends on the target; nothing here to check fc against
            raise C.ContractError(f"{where}: no eagle_config.eagle_aux_hidden_state_layer_ids and no "
                                  f"{PROVENANCE_FILE}: set the ids explicitly")
        return len(ids)
    return len(_served_capture(config, prov.engine, prov.target.model_type, prov.sglang_release,
                               prov.target.num_hidden_layers))


def _option(config: dict, key: str) -> bool:
    """An EAGLE-3.1 switch as SGLang 0.5.23 reads it for this layout (sglang/srt/models/llama_eagle3.py and
    kimi_k25_eagle3.py, docs/drafters.md): fc_norm (or the legacy use_aux_norm) and norm_output at the top level;
    norm_before_fc from eagle_config first, then the top level (the MLA class never reads it)."""
    if key == "fc_norm":
        return bool(config.get("fc_norm") or config.get("use_aux_norm"))
    if key == "norm_before_fc":
        return bool((config.get("eagle_config") or {}).get("norm_before_fc", config.get("norm_before_fc", False)))
    return bool(config.get(key, False))


def export_drafter_config(config: dict, prov: ExportProvenance | None, where: str = CONFIG_FILE):
    """The DrafterConfig of an export (the inverse of draft_config): the layout from `architectures`, config.json's
    fields, the options where SGLang reads them, num_aux_layers by export_num_aux_layers. ContractError when
    config.json lacks a field, holds one the drafter cannot take, or asks for what no SGLang release does (an MLA
    drafter's norm_before_fc: served without it, it is another function than the one trained)."""
    from dataclasses import fields
    arch = config.get("architectures")
    layout = ARCHITECTURES.get(arch[0]) if isinstance(arch, list) and len(arch) == 1 else None
    if layout is None or config.get("num_hidden_layers") != 1:
        raise C.ContractError(f"{where}: expected architectures one of {[[a] for a in ARCHITECTURES]} and 1 layer, "
                              f"got {arch} with {config.get('num_hidden_layers')} layers")
    opts = {o: _option(config, o) for o in OPTIONS}
    if layout == "mla" and opts["norm_before_fc"]:
        raise C.ContractError(f"{where}: norm_before_fc on {arch[0]}: no SGLang release reads it for this class "
                              "(it would be served without its input_norm)")
    if opts["fc_norm"] and opts["norm_before_fc"]:
        raise C.ContractError(f"{where}: fc_norm and norm_before_fc both on (SGLang would apply both; eagle3 trains "
                              "one or the other)")
    names = {f.name for f in fields(DrafterConfig)} - {"num_aux_layers", "layout", *OPTIONS}
    num_aux = export_num_aux_layers(config, prov, where)
    kw = {k: v for k, v in config.items() if k in names}
    if kw.get("draft_vocab_size") is None and "vocab_size" in config:
        kw["draft_vocab_size"] = config["vocab_size"]  # only a foreign export: ours always writes it
    try:
        return DrafterConfig(**kw, layout=layout, **opts, num_aux_layers=num_aux)
    except (TypeError, ValueError, NotImplementedError) as e:
        raise C.ContractError(f"{where}: not a drafter config ({e})") from e


def foreign_tensors(tensors: dict[str, torch.Tensor], dcfg) -> dict[str, torch.Tensor]:
    """A published drafter's tensors under the names this exporter writes, as SGLang 0.5.23's loaders map them:
    `layers.0.` -> `midlayer.`, the legacy `aux_norm_low/mid/high` -> `fc_norm.0/1/2` (Llama class only; the MLA
    class drops them), a fused `gate_up_proj` split; `embed_tokens` dropped (SGLang serves the target's); a
    full-vocab drafter without d2t/t2d gets the identity map. What is left over is reported by check_tensors."""
    import re
    out: dict[str, torch.Tensor] = {}
    legacy = {"aux_norm_low": "fc_norm.0", "aux_norm_mid": "fc_norm.1", "aux_norm_high": "fc_norm.2"}
    for name, t in tensors.items():
        name = re.sub(r"^(model\.)?layers\.0\.", "midlayer.", name)
        if dcfg.layout == "llama":
            name = re.sub(r"^model\.", "", name)
            for old, new in legacy.items():
                name = name.replace(old, new)
        if name.endswith("embed_tokens.weight"):
            continue
        if name == "midlayer.mlp.gate_up_proj.weight":
            out["midlayer.mlp.gate_proj.weight"], out["midlayer.mlp.up_proj.weight"] = t.chunk(2, dim=0)
            continue
        out[name] = t
    return with_identity_vocab_map(out, dcfg)


def omits_vocab_map(dcfg, engine: str) -> bool:
    """Whether an export for `engine` leaves d2t/t2d out: vLLM builds its `draft_id_to_target_id` parameter only for a
    draft vocabulary smaller than the target's and refuses to load a d2t it has no parameter for (vLLM 0.32.0's own
    loader on the CPU, bench/vllm_check.py: "There is no module or parameter named 'draft_id_to_target_id'"), so a
    full-vocab drafter (TorchSpec's Kimi shape) goes to vLLM without them. SGLang reads the identity d2t as its hot
    tokens and serves the same drafts with or without it; its exports keep the pair."""
    return engine == "vllm" and dcfg.draft_vocab_size == dcfg.vocab_size


def with_identity_vocab_map(tensors: dict[str, torch.Tensor], dcfg) -> dict[str, torch.Tensor]:
    """A full-vocab drafter's tensors without d2t/t2d get the identity map (every token draftable, d2t all 0)."""
    if "d2t" not in tensors and "t2d" not in tensors and dcfg.draft_vocab_size == dcfg.vocab_size:
        tensors["d2t"] = torch.zeros(dcfg.vocab_size, dtype=torch.int64)
        tensors["t2d"] = torch.ones(dcfg.vocab_size, dtype=torch.bool)
    return tensors


def load_export(export_dir: str,
                allow_foreign: bool = False) -> tuple[dict, dict[str, torch.Tensor], ExportProvenance | None]:
    """(config, tensors, provenance) of an export, after checking, in this order: model.safetensors' sha256
    against the provenance; that config.json's ids make the provenance's server capture exactly the states the
    drafter was trained on; every tensor's name, dtype and shape against config.json (fc's in-features = the
    number of states the server captures x target_hidden_size, export_num_aux_layers). `allow_foreign` (a drafter
    from elsewhere) accepts an export without provenance (provenance None; only the shapes are checked, after
    foreign_tensors maps its names and any floating dtype is taken) and turns disagreeing ids into a warning."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    config = C.read_json(os.path.join(export_dir, CONFIG_FILE))
    prov = _read_provenance(export_dir, allow_foreign)
    if prov is not None:
        _verify_weights(export_dir, prov)
        _check_ids_against_provenance(export_dir, config, prov, allow_foreign)
    dcfg = export_drafter_config(config, prov, f"{export_dir}/{CONFIG_FILE}")
    tensors = {}
    files = _weight_files(export_dir, foreign=prov is None)
    for path in files:
        try:
            tensors.update(load_file(path))
        except (SafetensorError, OSError) as e:
            raise C.ContractError(f"{path}: cannot be read as safetensors ({e})") from e
    if prov is None:
        tensors = foreign_tensors(tensors, dcfg)
    elif omits_vocab_map(dcfg, prov.engine):  # written without d2t/t2d for vLLM: the identity map it stands for
        tensors = with_identity_vocab_map(tensors, dcfg)
    check_tensors(tensors, tensor_shapes(dcfg),
                  f"{files[0] if len(files) == 1 else export_dir} (shapes from {CONFIG_FILE}, {dcfg.num_aux_layers} "
                  "aux hidden states)",
                  float_dtype=EXPORT_DTYPE if prov is not None else None, architecture=architecture(dcfg))
    return config, tensors, prov


def weights_sha256(export_dir: str) -> str:
    """What identifies a drafter directory's weights: model.safetensors' sha256, or for a sharded published one the
    sha256 of its shards' names and sha256s in order."""
    files = _weight_files(export_dir, foreign=True)
    if len(files) == 1:
        return C.file_sha256(files[0])
    return C.sha256_bytes(C.canonical_json([[os.path.basename(f), C.file_sha256(f)] for f in files]))


def _weight_files(export_dir: str, foreign: bool) -> list[str]:
    """model.safetensors; a published drafter may come as shards (model-0000N-of-0000M.safetensors)."""
    single = os.path.join(export_dir, WEIGHTS_FILE)
    if not foreign or os.path.isfile(single):
        return [single]
    shards = sorted(f for f in os.listdir(export_dir) if f.endswith(".safetensors"))
    if not shards:
        raise FileNotFoundError(f"{export_dir}: no *.safetensors")
    return [os.path.join(export_dir, f) for f in shards]


def capture_indices_of_export(export_dir: str, num_layers: int, sglang_version: str | None = None,
                              target_model_type: str | None = None, allow_foreign: bool = False) -> list[int]:
    """What a server would capture (HF indices, ascending) for this export on a `num_layers`-layer target: the
    forward rule of the provenance's engine / SGLang release (or `sglang_version`, the release actually served)
    / target model_type, applied to config.json's ids. Reads only the export, never a training manifest.
    An export without provenance (only with `allow_foreign`) is taken as served by SGLang `sglang_version`
    (default: the latest known) for a `target_model_type` target."""
    config = C.read_json(os.path.join(export_dir, CONFIG_FILE))
    prov = _read_provenance(export_dir, allow_foreign)
    if prov is None:
        if target_model_type is None:
            raise C.ContractError(f"{export_dir}: no {PROVENANCE_FILE}; the target's model_type is needed to tell "
                                  "what SGLang captures with its ids")
        return _served_capture(config, "sglang", target_model_type, sglang_version or S.SGLANG_LATEST, num_layers)
    recorded = prov.target.num_hidden_layers
    if int(num_layers) != recorded:
        raise C.ContractError(f"{export_dir} was exported for a {recorded}-layer target "
                              f"({prov.target.model_type}), asked about a {num_layers}-layer one")
    return _served_capture(config, prov.engine, prov.target.model_type, sglang_version or prov.sglang_release,
                           num_layers)


def inspect_export(export_dir: str, verify: bool = True) -> dict:
    """`eagle3 inspect EXPORT`: what the drafter is (SGLang class, layout, options, shapes, draft KV cache bytes per
    token), what it was trained on and for which server, and whether it verifies (load_export's checks)."""
    config = C.read_json(os.path.join(export_dir, CONFIG_FILE))
    report: dict = {"kind": "export", "path": os.path.abspath(export_dir)}
    try:
        prov = _read_provenance(export_dir, allow_foreign=True)
        dcfg = export_drafter_config(config, prov, f"{export_dir}/{CONFIG_FILE}")
        if verify:
            load_export(export_dir, allow_foreign=prov is None)
        report["verified"] = ("ok" if prov is not None else "shapes only (no provenance: a drafter from elsewhere)") \
            if verify else "not checked (--no-verify)"
    except (C.ContractError, OSError, ValueError) as e:
        report["verified"] = f"FAILED: {e}"
        return report
    import math
    n_params = sum(math.prod(s) for k, s in tensor_shapes(dcfg).items() if k not in ("d2t", "t2d"))
    report.update(architecture=architecture(dcfg), layout=dcfg.layout, options=dcfg.options,
                  drafter=dcfg.to_dict(), parameters=n_params,
                  draft_kv_bytes_per_token=dcfg.draft_kv_bytes_per_token(),
                  eagle_aux_hidden_state_layer_ids=(config.get("eagle_config") or {}).get(
                      "eagle_aux_hidden_state_layer_ids"))
    if prov is not None:
        report.update(engine=prov.engine, release=prov.sglang_release or prov.vllm_release,
                      trained_capture=prov.capture.hidden_state_indices, target=prov.target.path,
                      served_capture=prov.served_capture_indices, server_command=prov.server_command)
    return report


def render_export(r: dict) -> str:
    if str(r.get("verified", "")).startswith("FAILED"):
        return f"export      {r['path']}\nverified    {r['verified']}"
    d = r["drafter"]
    attn = (f"MLA q_lora {d['q_lora_rank']}, kv_lora {d['kv_lora_rank']}, qk {d['qk_nope_head_dim']}+"
            f"{d['qk_rope_head_dim']}, v {d['v_head_dim']}" if r["layout"] == "mla"
            else f"heads {d['num_attention_heads']}/{d['num_key_value_heads']} x {d['head_dim']}")
    lines = [f"export      {r['path']}",
             f"drafter     {r['architecture']} (layout {r['layout']}), options: {', '.join(r['options']) or 'none'}",
             f"shape       hidden {d['hidden_size']}, {attn}, intermediate {d['intermediate_size']}, draft vocab "
             f"{d['draft_vocab_size']} of {d['vocab_size']}; {r['parameters'] / 1e6:,.1f}M parameters",
             f"draft KV    {r['draft_kv_bytes_per_token']:,} B per speculated token (bf16)",
             f"ids         eagle_aux_hidden_state_layer_ids {r['eagle_aux_hidden_state_layer_ids']}"]
    if "engine" in r:
        lines += [f"serving     {r['engine']} {r['release']}: captures HF {r['served_capture']} (trained on HF "
                  f"{r['trained_capture']}), target {r['target']}",
                  f"launch      {r['server_command']}"]
    lines.append(f"verified    {r['verified']}")
    return "\n".join(lines)
