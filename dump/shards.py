"""Shard format v1: one safetensors file per shard, token-major, zero-copy readable.

    input_ids [N] int32, loss_mask [N] uint8, hidden_states.<k> [N, H] per captured HF index k,
    final_hidden [N, H], sample_offsets [n+1] int64, sample_index [n] int64

A shard is written to a temporary name and renamed; then a small sidecar `shard-XXXXX.json` (its ShardRecord) is
renamed into place. A shard counts as finished only when its sidecar exists, so a killed run leaves at most a
temporary file, which the rerun replaces.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict

import torch
from safetensors.torch import save_file

from eagle3 import contract as C
from eagle3.contract import ShardRecord


SHARD_METADATA_KEY = "eagle3"


def shard_name(j: int) -> str:
    return f"shard-{j:05d}.safetensors"


def sidecar_name(j: int) -> str:
    return f"shard-{j:05d}.json"


def atomic_write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_shard(out_dir: str, j: int, samples: list[dict], indices: list[int], meta: dict) -> ShardRecord:
    """samples: [{'sample_index', 'input_ids' [T], 'loss_mask' [T], 'final' [T,H], k: [T,H] ...}] on CPU, in order."""
    lengths = [len(s["input_ids"]) for s in samples]
    offsets = torch.zeros(len(samples) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    tensors = {
        C.INPUT_IDS: torch.cat([torch.as_tensor(s["input_ids"], dtype=torch.int32) for s in samples]),
        C.LOSS_MASK: torch.cat([torch.as_tensor(s["loss_mask"], dtype=torch.uint8) for s in samples]),
        C.SAMPLE_OFFSETS: offsets,
        C.SAMPLE_INDEX: torch.tensor([s["sample_index"] for s in samples], dtype=torch.int64),
        C.FINAL_HIDDEN: torch.cat([s["final"] for s in samples]),
    }
    for k in indices:
        tensors[C.hidden_state_key(k)] = torch.cat([s[k] for s in samples])
    path = os.path.join(out_dir, shard_name(j))
    tmp = f"{path}.tmp-{os.getpid()}"
    # One metadata key: safetensors writes its metadata map in hash order, so several keys make the file's bytes
    # (and its sha256) differ between identical runs.
    save_file(tensors, tmp, metadata={SHARD_METADATA_KEY: json.dumps(meta, sort_keys=True)})
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    rec = ShardRecord(file=shard_name(j), samples=len(samples), tokens=int(offsets[-1]),
                      bytes=os.path.getsize(path), sha256=C.file_sha256(path))
    atomic_write_text(os.path.join(out_dir, sidecar_name(j)), json.dumps(asdict(rec), indent=1))
    return rec


def finished_shard(out_dir: str, j: int) -> ShardRecord | None:
    """The shard's record if it was completed (sidecar present and file size matches), else None."""
    side = os.path.join(out_dir, sidecar_name(j))
    if not os.path.isfile(side):
        return None
    with open(side) as f:
        rec = ShardRecord(**json.load(f))
    path = os.path.join(out_dir, rec.file)
    if not os.path.isfile(path) or os.path.getsize(path) != rec.bytes:
        return None
    return rec
