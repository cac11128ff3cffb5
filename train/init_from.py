"""`eagle3 train --init-from EXPORT_DIR`: start the drafter from an exported one (ours, or a published SGLang EAGLE-3
drafter directory of either layout and version -- LlamaForCausalLMEagle3 or Eagle3DeepseekV2ForCausalLM, EAGLE-3 or
3.1: config.json + safetensors, tensor names as SGLang's loaders accept them) instead of from random weights. The
layout and the EAGLE-3.1 options come from its config.json, read where SGLang reads them.

A warm start is only worth anything if the drafter meets the states it was trained on, so before a weight is
copied the export must agree with the dumps about everything its weights depend on, and each disagreement is an
error naming both sides (docs/contract.md §7):
- capture: the hidden states a server captures with the export's `eagle_aux_hidden_state_layer_ids` (the serving
  rules, eagle3.serving, for the dump's target) are exactly the dump's capture indices;
- shapes: the export's drafter config, read back by the exporter's own reader (`export_drafter_config`), fits the
  target: hidden size, embedding rows, fc's in-features = capture count x the target's hidden size;
- vocab map: its d2t/t2d become the run's draft vocabulary; a `--vocab` given as well must be that same map.
The drafter's shape then comes from the export (not from --drafter / --draft-vocab-size).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from eagle3 import contract as C
from eagle3.model.checkpoint import capture_indices_of_export, export_drafter_config, load_export, weights_sha256
from eagle3.records import PROVENANCE_FILE


@dataclass
class InitFrom:
    path: str                      # the export directory (absolute)
    config: object                 # its DrafterConfig (eagle3.model), checked against the target
    tensors: dict                  # {checkpoint key: tensor} as exported
    weights_sha256: str            # of its model.safetensors: what run.json records as the start
    served_capture: list[int]      # HF indices a server captures with its ids (== the dump's)

    def record(self) -> dict:
        """What run.json keeps of the start (a resume must start from the same one)."""
        return {"path": self.path, "model_safetensors_sha256": self.weights_sha256,
                "served_capture": self.served_capture}

    def vocab(self, identity: dict) -> dict:
        """The export's draft vocabulary as a vocab file's content (data/vocab.py's save_vocab)."""
        d2t, t2d = self.tensors["d2t"].to(torch.int64), self.tensors["t2d"].to(torch.bool)
        return {"d2t": d2t, "t2d": t2d,
                "meta": {"draft_vocab_size": int(d2t.numel()), "vocab_size": int(t2d.numel()),
                         "init_from": self.path, "identity": identity}}


def read_init_from(export_dir: str, manifest: C.DumpManifest, sglang_version: str | None = None) -> InitFrom:
    """Load the export at `export_dir` and check it against the dumps' `manifest`; ContractError otherwise."""
    path = os.path.abspath(export_dir)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"--init-from {export_dir}: not a directory")
    # Ours carries its provenance (weights' sha256 and trained capture are then checked strictly); a published
    # drafter has none, and only its ids and shapes can speak for it.
    foreign = not os.path.isfile(os.path.join(path, PROVENANCE_FILE))
    config, tensors, prov = load_export(path, allow_foreign=foreign)
    target, trained = manifest.target, list(manifest.capture.hidden_state_indices)
    try:
        served = capture_indices_of_export(path, target.num_hidden_layers, sglang_version, target.model_type,
                                           allow_foreign=foreign)
    except C.ContractError as e:
        raise C.ContractError(f"--init-from {path}: {e}") from e
    if served != trained:
        raise C.ContractError(
            f"--init-from {path}: its eagle_aux_hidden_state_layer_ids make the server capture {C.describe(served)}, "
            f"but the dumps hold {C.describe(trained)}: a drafter trained on other hidden states is no start for "
            "this one")
    dcfg = export_drafter_config(config, prov, f"{path}/config.json")
    problems = []
    if dcfg.hidden_size != target.hidden_size:
        problems.append(f"hidden_size {dcfg.hidden_size} (the target's: {target.hidden_size})")
    if dcfg.target_hidden_size != target.hidden_size:
        problems.append(f"target_hidden_size {dcfg.target_hidden_size} (the target's hidden size: {target.hidden_size})")
    if dcfg.vocab_size != target.vocab_size:
        problems.append(f"vocab_size {dcfg.vocab_size} (the target's: {target.vocab_size})")
    if problems:
        raise C.ContractError(f"--init-from {path}/config.json does not fit the dumps' target {target.path}: "
                              + "; ".join(problems))
    return InitFrom(path=path, config=dcfg, tensors=tensors,
                    weights_sha256=weights_sha256(path), served_capture=served)


def _is_exports_map(init: InitFrom, d2t: torch.Tensor, t2d: torch.Tensor) -> bool:
    return (torch.equal(d2t.cpu().to(torch.int64), init.tensors["d2t"].to(torch.int64))
            and torch.equal(t2d.cpu().to(torch.bool), init.tensors["t2d"].to(torch.bool)))


def check_same_vocab(init: InitFrom, vocab: dict, where: str) -> None:
    """A --vocab given with --init-from must be the export's own map: its lm_head rows are those tokens."""
    if not _is_exports_map(init, vocab["d2t"], vocab["t2d"]):
        raise C.ContractError(f"{where}: not the draft vocabulary of --init-from {init.path} (its lm_head rows are "
                              "other tokens): drop --vocab to train with the export's own map")


@torch.no_grad()
def load_into(drafter, init: InitFrom) -> None:
    """Copy the export's weights into `drafter` (built from init.config, vocab map already set)."""
    if not _is_exports_map(init, drafter.d2t, drafter.t2d):
        raise C.ContractError(f"--init-from {init.path}: the drafter's vocab map is not the export's")
    params = dict(drafter.named_parameters())
    for name, t in init.tensors.items():
        if name in ("d2t", "t2d"):
            continue
        params[name].copy_(t.to(params[name].dtype))
