"""Where a target's tensors are: the tensor name -> safetensors file map (its index, or the single file). A leaf
module: the loader (target/load.py), the packed INT4 experts (target/int4_experts.py) and the embedding/head reader
(target/weights.py) all read it, so none of them needs to import another for it."""

from __future__ import annotations

import json
import os

from safetensors import safe_open


def tensor_files(target_dir: str) -> dict[str, str]:
    """tensor name -> file, from the index or the single model.safetensors (also how target/int4_experts.py finds
    the packed experts)."""
    index = os.path.join(target_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return {k: os.path.join(target_dir, v) for k, v in json.load(f)["weight_map"].items()}
    single = os.path.join(target_dir, "model.safetensors")
    if os.path.isfile(single):
        with safe_open(single, "pt") as f:
            return {k: single for k in f.keys()}
    raise FileNotFoundError(f"{target_dir}: no model.safetensors or model.safetensors.index.json")
