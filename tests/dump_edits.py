"""Test helpers that alter a dump on disk the way an older eagle3 or a hand edit would have left it."""

from __future__ import annotations

import json
import os

from safetensors import safe_open

from eagle3 import contract as C
from eagle3.dump.shards import shard_name, sidecar_name, write_safetensors


def set_shard_metadata(out: str, j: int, meta: dict) -> None:
    """Rewrite shard j with `meta` as its eagle3 metadata; its sidecar and the manifest (where present) follow, so
    only the shard's own metadata tells."""
    path = os.path.join(out, shard_name(j))
    with safe_open(path, "pt") as f:
        tensors = {k: [f.get_tensor(k).clone()] for k in f.keys()}  # not views of the file rewritten below
    # widest elements first: every tensor's data stays aligned, as the dump writes them
    tensors = dict(sorted(tensors.items(), key=lambda kv: -kv[1][0].element_size()))
    sha = write_safetensors(path, tensors, {C.SHARD_METADATA_KEY: json.dumps(meta, sort_keys=True)})
    fix = {"bytes": os.path.getsize(path), "sha256": sha}
    side = os.path.join(out, sidecar_name(j))
    if os.path.isfile(side):
        edit_json(side, lambda rec: rec.update(fix))
    if os.path.isfile(os.path.join(out, C.MANIFEST_FILE)):
        def refit(m):  # the shard's record and the totals it is part of, as eagle3 writes them
            m["shards"][j].update(fix)
            if "totals" in m:
                m["totals"]["bytes"] = sum(s["bytes"] for s in m["shards"])
        edit_json(os.path.join(out, C.MANIFEST_FILE), refit)


def make_legacy(out: str, j: int) -> None:
    """Shard j as eagle3 wrote it before shards carried their identity: only the format-v1 keys."""
    from eagle3.dump.shards import read_shard_metadata
    meta = read_shard_metadata(os.path.join(out, shard_name(j)))
    set_shard_metadata(out, j, {k: meta[k] for k in C.LEGACY_SHARD_KEYS})


def edit_json(path: str, fn) -> None:
    with open(path) as f:
        d = json.load(f)
    fn(d)
    with open(path, "w") as f:
        json.dump(d, f)
