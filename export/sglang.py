"""Export a trained drafter as the checkpoint SGLang's `LlamaForCausalLMEagle3` loads (docs/contract.md §6-§7).

    eagle3 export-sglang --run RUN --out DIR [--step N] [--sglang-version 0.5.23] [--engine sglang|vllm]

DIR/ holds
  config.json              every key SGLang reads, set explicitly; eagle_config.eagle_aux_hidden_state_layer_ids
                           computed from the checkpoint's recorded capture with the serving rules of
                           `eagle3.export.serving` for the target family and the SGLang release targeted;
  model.safetensors        exactly the tensors of docs/contract.md §6 (fc, midlayer.*, norm, lm_head in bf16;
                           d2t int64; t2d bool);
  eagle3_provenance.json   what was exported from where, for which engine/release, and what that server captures.

Everything is checked before anything is written; the files go to a temporary directory that is renamed into place,
so a refused or failed export leaves no half-written DIR.

`load_export` (what eval reads) checks an export before use: model.safetensors against the sha256 in its
provenance, config.json's ids against the provenance's trained capture (via the contract's forward rule), and every
tensor's shape against config.json. An export without provenance (a drafter from elsewhere) is refused unless
`allow_foreign`, since nothing then says which hidden states it was trained on.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import sys
import tempfile
import time

import torch

from eagle3 import contract as C
from eagle3.export import serving as S
from eagle3.records import (CKPT_FILE, DRAFTER_WEIGHTS_FILE, EXPORT_CONFIG_FILE as CONFIG_FILE, EXPORT_FILES,
                            EXPORT_FORMAT, EXPORT_WEIGHTS_FILE as WEIGHTS_FILE, PROVENANCE_FILE, RUN_FILE, VOCAB_FILE,
                            CheckpointRecord, ExportProvenance, RunRecord, find_checkpoint)

ENGINES = ("sglang", "vllm")
ARCHITECTURE = "LlamaForCausalLMEagle3"
EXPORT_DTYPE = torch.bfloat16

NOT_PORTABLE = ("explicit eagle_aux_hidden_state_layer_ids are NOT portable between SGLang and vLLM: vLLM reads them "
                "as HF hidden_states indices, SGLang shifts them by a family- and release-dependent rule")


class ExportError(ValueError):
    """The export cannot be done as asked (missing checkpoint, occupied output directory, ...)."""


def check_tensors(tensors: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]], source: str,
                  float_dtype: torch.dtype | None = None) -> None:
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
        from eagle3.data.vocab import vocab_map_problem
        problem = vocab_map_problem(d2t, t2d)
        if problem:
            problems.append(problem)
    if problems:
        raise C.ContractError(f"{source}: does not fit SGLang's {ARCHITECTURE}:\n  " + "\n  ".join(problems))


def _load_run(run_dir: str, step: int | None):
    """(run record, checkpoint record, checkpoint dir, step, DrafterConfig, capture, TargetInfo, weights)."""
    from safetensors.torch import load_file
    from eagle3.train.checkpoint import check_files
    from eagle3.model import DrafterConfig, tensor_shapes

    run = RunRecord.read(os.path.join(run_dir, RUN_FILE))
    ckpt_dir, step = find_checkpoint(run_dir, step)
    rec = CheckpointRecord.read(os.path.join(ckpt_dir, CKPT_FILE))
    C.require_same_capture(run.identity, rec.identity, f"{run_dir}/{RUN_FILE}", f"{ckpt_dir}/{CKPT_FILE}")
    if rec.step != step:
        raise C.ContractError(f"{ckpt_dir}/{CKPT_FILE}: records step {rec.step}, directory says {step}")
    target, cap = rec.target, rec.capture
    try:
        dcfg = DrafterConfig.from_dict(rec.drafter)
    except (KeyError, TypeError, ValueError) as e:
        raise C.ContractError(f"{ckpt_dir}/{CKPT_FILE}: malformed checkpoint record ({e})") from e
    if cap.convention != "hf_hidden_states_index":
        raise C.ContractError(f"{ckpt_dir}/{CKPT_FILE}: capture convention {cap.convention!r} is not "
                              "'hf_hidden_states_index'")
    capture = C.validate_indices(cap.hidden_state_indices, target.num_hidden_layers)
    recorded = rec.identity.get("capture.hidden_state_indices")
    if capture != list(cap.hidden_state_indices) or capture != recorded:
        raise C.ContractError(f"{ckpt_dir}/{CKPT_FILE}: capture {cap.hidden_state_indices} is not ascending or "
                              f"disagrees with the run identity {recorded}")
    if rec.standardize != C.STANDARDIZE_VERSION:
        raise C.ContractError(f"{ckpt_dir}/{CKPT_FILE}: trained on standardize {rec.standardize!r}; this "
                              f"exporter knows {C.STANDARDIZE_VERSION!r} (aux states concatenated low -> high)")
    if dcfg.num_aux_layers != len(capture):
        raise C.ContractError(f"drafter num_aux_layers={dcfg.num_aux_layers} but the checkpoint records "
                              f"{len(capture)} captured states (HF {capture})")
    if dcfg.target_hidden_size != target.hidden_size or dcfg.vocab_size != target.vocab_size:
        raise C.ContractError(f"drafter target_hidden_size/vocab_size {dcfg.target_hidden_size}/{dcfg.vocab_size} "
                              f"!= target hidden_size/vocab_size {target.hidden_size}/{target.vocab_size}")
    check_files(ckpt_dir, rec, [DRAFTER_WEIGHTS_FILE])  # the bytes the trainer wrote: a flipped bit is refused here
    weights = load_file(os.path.join(ckpt_dir, DRAFTER_WEIGHTS_FILE))
    check_tensors(weights, tensor_shapes(dcfg), f"{ckpt_dir}/{DRAFTER_WEIGHTS_FILE}")
    vocab_path = os.path.join(run_dir, VOCAB_FILE)
    if os.path.isfile(vocab_path):
        from safetensors import safe_open
        with safe_open(vocab_path, "pt") as f:
            if not (torch.equal(f.get_tensor("d2t"), weights["d2t"]) and torch.equal(f.get_tensor("t2d"),
                                                                                      weights["t2d"])):
                raise C.ContractError(f"{ckpt_dir}/{DRAFTER_WEIGHTS_FILE}: d2t/t2d differ from the run's {vocab_path}")
    return run, rec, ckpt_dir, step, dcfg, capture, target, weights


# ---------------------------------------------------------------------------------------------- the export

def draft_config(dcfg, ids: list[int]) -> dict:
    """config.json of the exported drafter: every key SGLang (and vLLM) read, explicit (docs/contract.md §6)."""
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": dcfg.hidden_size,
        "num_attention_heads": dcfg.num_attention_heads,
        "num_key_value_heads": dcfg.num_key_value_heads,
        "head_dim": dcfg.head_dim,
        "intermediate_size": dcfg.intermediate_size,
        "hidden_act": dcfg.hidden_act,
        "rms_norm_eps": dcfg.rms_norm_eps,
        "rope_theta": dcfg.rope_theta,
        "rope_scaling": dcfg.rope_scaling,
        "max_position_embeddings": dcfg.max_position_embeddings,
        "vocab_size": dcfg.vocab_size,
        "draft_vocab_size": dcfg.draft_vocab_size,
        "target_hidden_size": dcfg.target_hidden_size,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "dtype": "bfloat16",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(ids), "use_aux_hidden_state": True},
    }


SERVE_DRAFT_STEPS = 3  # the export's hint: a chain of 3, the length published acceptance lengths are quoted at


def trained_chain_length(train: dict) -> int:
    """The chain the run was trained and judged for: its held-out replay's length (--accept-steps, else the TTT
    unroll), so the launch line drafts what training measured; the default for a run that records neither."""
    steps = train.get("accept_steps") or train.get("ttt_steps")
    return int(steps) if isinstance(steps, int) and steps > 0 else SERVE_DRAFT_STEPS


def server_command(engine: str, target_path: str, export_dir: str, model_type: str = "",
                   disable_cuda_graph: bool = False, steps: int = SERVE_DRAFT_STEPS) -> str:
    """The launch line that serves the target with the exported drafter, chain drafting `steps` tokens (top-1,
    so steps + 1 tokens verified per round)."""
    q = shlex.quote
    if engine == "vllm":
        spec = json.dumps({"method": "eagle3", "model": export_dir, "num_speculative_tokens": steps})
        return f"vllm serve {q(target_path)} --speculative-config {q(spec)}"
    cmd = (f"python -m sglang.launch_server --model-path {q(target_path)} --speculative-algorithm EAGLE3 "
           f"--speculative-draft-model-path {q(export_dir)} --speculative-num-steps {steps} "
           f"--speculative-eagle-topk 1 --speculative-num-draft-tokens {steps + 1}")
    if model_type in ("kimi_k2", "kimi_k25"):
        cmd += " --trust-remote-code"
    if disable_cuda_graph:
        cmd += " --disable-cuda-graph"
    return cmd


def _is_previous_export(path: str) -> bool:
    entries = set(os.listdir(path))
    if not entries <= set(EXPORT_FILES) or PROVENANCE_FILE not in entries:
        return False
    try:
        with open(os.path.join(path, PROVENANCE_FILE)) as f:
            return json.load(f).get("format") == EXPORT_FORMAT
    except (OSError, json.JSONDecodeError):
        return False


def export_drafter(run_dir: str, out_dir: str, step: int | None = None, engine: str = "sglang",
                   sglang_version: str = S.SGLANG_LATEST, allow_cuda_graph_mismatch: bool = False) -> ExportProvenance:
    """Export checkpoint `step` (default: the latest) of training run `run_dir` into `out_dir`; returns the
    provenance written to out_dir/eagle3_provenance.json."""
    from safetensors.torch import save_file
    from eagle3.model import tensor_shapes

    if engine not in ENGINES:
        raise ExportError(f"engine must be one of {ENGINES}, got {engine!r}")
    out = os.path.abspath(out_dir)
    if os.path.exists(out):
        if not os.path.isdir(out):
            raise ExportError(f"{out} exists and is not a directory")
        if os.listdir(out) and not _is_previous_export(out):
            raise ExportError(f"{out} is not empty and is not a previous eagle3 export: choose another --out")

    run, rec, ckpt_dir, step, dcfg, capture, target, weights = _load_run(run_dir, step)
    L = target.num_hidden_layers
    notes: list[str] = []
    release = family = None
    default = None
    if engine == "sglang":
        release = str(S.check_release(sglang_version))
        family = S.serving_family(target.model_type)
        ids = S.sglang_ids_for(capture, target.model_type, release, L)
        served = S.sglang_capture_indices(ids, target.model_type, release, L)
        reproducing = S.sglang_releases_reproducing(ids, capture, target.model_type, L)
        disable_cg = S.needs_disable_cuda_graph(capture, release, L)
        if disable_cg:
            default = sorted(S.sglang_default_capture(L))
            msg = (f"SGLang {release} (<= {S.SGLANG_CUDA_GRAPH_DEFAULT_UNTIL}) captures the DEFAULT HF {default} in "
                   f"its CUDA-graph decode/verify passes whatever the config says, but this drafter was trained on HF "
                   f"{capture}")
            if not allow_cuda_graph_mismatch:
                raise C.ContractError(f"{msg}. Target SGLang >= 0.5.11, or pass allow_cuda_graph_mismatch "
                                      "(--allow-cuda-graph-mismatch) and serve with --disable-cuda-graph")
            print(f"[export] {msg}: the server MUST run with --disable-cuda-graph", file=sys.stderr)
            notes.append(f"{msg}: serve with --disable-cuda-graph")
    else:
        ids = S.vllm_ids_for(capture, L)
        served = S.vllm_capture_indices(ids, L)
        reproducing, disable_cg = None, False
        notes.append(NOT_PORTABLE)
    if served != capture:  # the forward rule of the engine gives back exactly what the drafter was trained on
        raise C.ContractError(f"internal: ids {ids} make {engine} capture {served}, not the trained HF {capture}")

    shapes = tensor_shapes(dcfg)
    tensors = {k: (weights[k].to(EXPORT_DTYPE) if weights[k].is_floating_point() else weights[k]).contiguous()
               for k in shapes}
    check_tensors(tensors, shapes, "the converted tensors", float_dtype=EXPORT_DTYPE)
    config = draft_config(dcfg, ids)
    provenance = ExportProvenance(
        engine=engine, sglang_release=release, serving_family=family,
        capture=C.CaptureSpec(hidden_state_indices=capture, convention="hf_hidden_states_index"),
        eagle_aux_hidden_state_layer_ids=ids, served_capture_indices=served,
        ids_reproduce_capture_in_sglang=(None if reproducing is None
                                         else [{"first": a, "last": b} for a, b in reproducing]),
        needs_disable_cuda_graph=disable_cg, cuda_graph_default_capture=default,
        server_command=server_command(engine, target.path, out, target.model_type, disable_cg,
                                      steps=trained_chain_length(rec.train)),
        target=target, identity=rec.identity, run_dir=os.path.abspath(run_dir), step=step,
        checkpoint=os.path.abspath(ckpt_dir), standardize=rec.standardize, drafter=dcfg.to_dict(),
        vocab={k: rec.vocab_meta.get(k) for k in ("draft_vocab_size", "coverage")}, notes=notes,
        created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))

    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.tmp-", dir=parent)
    try:
        save_file(tensors, os.path.join(tmp, WEIGHTS_FILE), metadata={"format": "pt"})
        provenance.model_safetensors_sha256 = C.file_sha256(os.path.join(tmp, WEIGHTS_FILE))
        with open(os.path.join(tmp, CONFIG_FILE), "w") as f:
            json.dump(config, f, indent=2)
        with open(os.path.join(tmp, PROVENANCE_FILE), "w") as f:
            json.dump(provenance.to_dict(), f, indent=1)
        # Read back what was written, as a server would: sha256, ids -> served capture == trained capture, shapes.
        load_export(tmp)
        if os.path.exists(out):
            old = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.old-", dir=parent)
            os.rename(out, os.path.join(old, "x"))
            os.rename(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return provenance


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


def export_drafter_config(config: dict, prov: ExportProvenance | None, where: str = CONFIG_FILE):
    """The DrafterConfig of an export (the inverse of draft_config): config.json's fields, num_aux_layers by
    export_num_aux_layers. ContractError when config.json lacks a field or holds one the drafter cannot take."""
    from dataclasses import fields
    from eagle3.model import DrafterConfig
    names = {f.name for f in fields(DrafterConfig)} - {"num_aux_layers"}
    num_aux = export_num_aux_layers(config, prov, where)
    try:
        return DrafterConfig(**{k: v for k, v in config.items() if k in names}, num_aux_layers=num_aux)
    except (TypeError, ValueError, NotImplementedError) as e:
        raise C.ContractError(f"{where}: not a drafter config ({e})") from e


def load_export(export_dir: str,
                allow_foreign: bool = False) -> tuple[dict, dict[str, torch.Tensor], ExportProvenance | None]:
    """(config, tensors, provenance) of an export, after checking, in this order: model.safetensors' sha256
    against the provenance; that config.json's ids make the provenance's server capture exactly the states the
    drafter was trained on; every tensor's name, dtype and shape against config.json (fc's in-features = the
    number of states the server captures x target_hidden_size, export_num_aux_layers). `allow_foreign` (a drafter from elsewhere) accepts an export without provenance
    (provenance None; only the shapes are checked) and turns disagreeing ids into a warning."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    config = C.read_json(os.path.join(export_dir, CONFIG_FILE))
    if config.get("architectures") != [ARCHITECTURE] or config.get("num_hidden_layers") != 1:
        raise C.ContractError(f"{export_dir}/{CONFIG_FILE}: expected architectures [{ARCHITECTURE}] and 1 layer")
    prov = _read_provenance(export_dir, allow_foreign)
    if prov is not None:
        _verify_weights(export_dir, prov)
        _check_ids_against_provenance(export_dir, config, prov, allow_foreign)
    dcfg = export_drafter_config(config, prov, f"{export_dir}/{CONFIG_FILE}")
    weights = os.path.join(export_dir, WEIGHTS_FILE)
    try:
        tensors = load_file(weights)
    except (SafetensorError, OSError) as e:
        raise C.ContractError(f"{weights}: cannot be read as safetensors ({e})") from e
    from eagle3.model import tensor_shapes
    check_tensors(tensors, tensor_shapes(dcfg),
                  f"{weights} (shapes from {CONFIG_FILE}, {dcfg.num_aux_layers} aux hidden states)",
                  float_dtype=EXPORT_DTYPE)
    return config, tensors, prov


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
