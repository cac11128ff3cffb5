"""Export a trained drafter as the checkpoint SGLang's `LlamaForCausalLMEagle3` loads (docs/contract.md §6-§7).

    eagle3 export-sglang --run RUN --out DIR [--step N] [--sglang-version 0.5.23] [--engine sglang|vllm]

DIR/ holds
  config.json              every key SGLang reads, set explicitly; eagle_config.eagle_aux_hidden_state_layer_ids
                           computed from the checkpoint's recorded capture with the serving rules of
                           `eagle3.serving` for the target family and the SGLang release targeted;
  model.safetensors        exactly the tensors of docs/contract.md §6 (fc, midlayer.*, norm, lm_head in bf16;
                           d2t int64; t2d bool; a full-vocab drafter for vLLM without d2t/t2d);
  eagle3_provenance.json   what was exported from where, for which engine/release, and what that server captures.

Everything is checked before anything is written; the files go to a temporary directory that is renamed into place,
so a refused or failed export leaves no half-written DIR.

`eagle3.model.checkpoint.load_export` (what eval and --init-from read) checks an export before use: model.safetensors against the sha256 in its
provenance, config.json's ids against the provenance's trained capture (via the contract's forward rule), and every
tensor's shape against config.json. An export without provenance (a drafter from elsewhere) is refused unless
`allow_foreign`, since nothing then says which hidden states it was trained on.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from dataclasses import dataclass

import torch

from eagle3 import contract as C
from eagle3 import serving as S
from eagle3.atomic import replaced_dir
from eagle3.model import DrafterConfig, architecture, tensor_shapes
from eagle3.model.checkpoint import EXPORT_DTYPE, check_tensors, draft_config, load_export, omits_vocab_map
from eagle3.options import opt
from eagle3.records import (CKPT_FILE, DRAFTER_WEIGHTS_FILE, EXPORT_CONFIG_FILE as CONFIG_FILE, EXPORT_FILES,
                            EXPORT_FORMAT, EXPORT_WEIGHTS_FILE as WEIGHTS_FILE, MEANING_KEY, PROVENANCE_FILE, RUN_FILE,
                            VOCAB_FILE, CheckpointRecord, ExportProvenance, RunRecord, check_files, find_checkpoint)

ENGINES = ("sglang", "vllm")

NOT_PORTABLE = ("explicit eagle_aux_hidden_state_layer_ids are NOT portable between SGLang and vLLM: vLLM reads them "
                "as HF hidden_states indices, SGLang shifts them by a family- and release-dependent rule")


class ExportError(ValueError):
    """The export cannot be done as asked (missing checkpoint, occupied output directory, ...)."""


def _load_run(run_dir: str, step: int | None):
    """(run record, checkpoint record, checkpoint dir, step, DrafterConfig, capture, TargetInfo, weights)."""
    from safetensors.torch import load_file

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
    if cap.convention != C.HF_INDEX_CONVENTION:
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
    from safetensors import safe_open
    with safe_open(os.path.join(ckpt_dir, DRAFTER_WEIGHTS_FILE), "pt") as f:
        meaning = (f.metadata() or {}).get(MEANING_KEY)
    if meaning is not None and meaning != rec.meaning_sha256():  # (checkpoints saved before it carry none)
        raise C.ContractError(
            f"{ckpt_dir}/{CKPT_FILE}: its identity, capture, target, drafter or standardize version is not what "
            f"{DRAFTER_WEIGHTS_FILE} was saved with (the weights' metadata records another {MEANING_KEY}): the "
            f"record was edited after training; the weights mean what the training run recorded then")
    weights = load_file(os.path.join(ckpt_dir, DRAFTER_WEIGHTS_FILE))
    check_tensors(weights, tensor_shapes(dcfg), f"{ckpt_dir}/{DRAFTER_WEIGHTS_FILE}", architecture=architecture(dcfg))
    vocab_path = os.path.join(run_dir, VOCAB_FILE)
    if os.path.isfile(vocab_path):
        from safetensors import safe_open
        with safe_open(vocab_path, "pt") as f:
            if not (torch.equal(f.get_tensor("d2t"), weights["d2t"]) and torch.equal(f.get_tensor("t2d"),
                                                                                      weights["t2d"])):
                raise C.ContractError(f"{ckpt_dir}/{DRAFTER_WEIGHTS_FILE}: d2t/t2d differ from the run's {vocab_path}")
    return run, rec, ckpt_dir, step, dcfg, capture, target, weights


# ---------------------------------------------------------------------------------------------- the export
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


def step_arg(text: str) -> int | str:
    """--step: a step number or 'best'."""
    if text == "best":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--step {text!r}: a step number or 'best'") from None


@dataclass
class ExportConfig:
    """`eagle3 export-sglang`: export_drafter's arguments."""
    run_dir: str = opt(help="training run directory (eagle3 train --out)", flag="run")
    out_dir: str = opt(help="output directory (config.json, model.safetensors, provenance)", flag="out")
    step: int | str | None = opt(None, "checkpoint step, or 'best' (best held-out decoding acceptance; default: the "
                                       "latest)", type=step_arg)
    sglang_version: str = opt(S.SGLANG_LATEST, "SGLang release the ids are computed for and that must serve the "
                                               "drafter's architecture and options")
    engine: str = opt("sglang", "the serving engine the config.json is written for (its id rule and class names)",
                      choices=list(ENGINES))
    vllm_version: str = opt(S.VLLM_LATEST, "--engine vllm: the vLLM release that must serve the drafter's "
                                           "architecture and options")
    allow_cuda_graph_mismatch: bool = opt(False, "SGLang <= 0.5.10.post1 with a non-default capture set: export "
                                                 "anyway (serve with --disable-cuda-graph)")


def export_drafter(run_dir: str, out_dir: str, step: int | None = None, engine: str = ExportConfig.engine,
                   sglang_version: str = ExportConfig.sglang_version, allow_cuda_graph_mismatch: bool = False,
                   vllm_version: str = ExportConfig.vllm_version) -> ExportProvenance:
    """Export checkpoint `step` (default: the latest) of training run `run_dir` into `out_dir`; returns the
    provenance written to out_dir/eagle3_provenance.json. Refused when the engine release targeted would not serve
    the drafter's architecture or one of its options (eagle3.serving.check_drafter_served)."""
    from safetensors.torch import save_file

    if engine not in ENGINES:
        raise ExportError(f"engine must be one of {ENGINES}, got {engine!r}")
    out = os.path.abspath(out_dir)
    if os.path.exists(out):
        if not os.path.isdir(out):
            raise ExportError(f"{out} exists and is not a directory")
        if os.listdir(out) and not _is_previous_export(out):
            raise ExportError(f"{out} is not empty and is not a previous eagle3 export: choose another --out")

    run, rec, ckpt_dir, step, dcfg, capture, target, weights = _load_run(run_dir, step)
    arch = architecture(dcfg)
    S.check_drafter_served(engine, sglang_version if engine == "sglang" else vllm_version, dcfg.layout, dcfg.options,
                           arch, dcfg.q_lora_rank)
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
    if omits_vocab_map(dcfg, engine):  # vLLM refuses a full-vocab drafter's d2t (eagle3.model.checkpoint)
        shapes = {k: v for k, v in shapes.items() if k not in ("d2t", "t2d")}
    tensors = {k: (weights[k].to(EXPORT_DTYPE) if weights[k].is_floating_point() else weights[k]).contiguous()
               for k in shapes}
    check_tensors(tensors, shapes, "the converted tensors", float_dtype=EXPORT_DTYPE, architecture=arch)
    config = draft_config(dcfg, ids)
    provenance = ExportProvenance(
        engine=engine, sglang_release=release, serving_family=family,
        vllm_release=str(S.parse_release(vllm_version)) if engine == "vllm" else None, architecture=arch,
        options=dcfg.options, draft_kv_bytes_per_token=dcfg.draft_kv_bytes_per_token(),
        capture=C.CaptureSpec(hidden_state_indices=capture, convention=C.HF_INDEX_CONVENTION),
        eagle_aux_hidden_state_layer_ids=ids, served_capture_indices=served,
        ids_reproduce_capture_in_sglang=(None if reproducing is None
                                         else [{"first": a, "last": b} for a, b in reproducing]),
        needs_disable_cuda_graph=disable_cg, cuda_graph_default_capture=default,
        server_command=server_command(engine, target.path, out, target.model_type, disable_cg,
                                      steps=trained_chain_length(rec.train)),
        target=target, identity=rec.identity, run_dir=os.path.abspath(run_dir), step=step,
        checkpoint=os.path.abspath(ckpt_dir), standardize=rec.standardize, drafter=dcfg.to_dict(),
        vocab={k: rec.vocab_meta.get(k) for k in ("draft_vocab_size", "coverage")},
        heldout=rec.best if rec.best and rec.best.get("step") == step else None, notes=notes,
        created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))

    with replaced_dir(out) as tmp:
        save_file(tensors, os.path.join(tmp, WEIGHTS_FILE), metadata={"format": "pt"})
        provenance.model_safetensors_sha256 = C.file_sha256(os.path.join(tmp, WEIGHTS_FILE))
        with open(os.path.join(tmp, CONFIG_FILE), "w") as f:
            json.dump(config, f, indent=2)
        with open(os.path.join(tmp, PROVENANCE_FILE), "w") as f:
            json.dump(provenance.to_dict(), f, indent=1)
        # Read back what was written, as a server would: sha256, ids -> served capture == trained capture, shapes.
        load_export(tmp)
    return provenance
