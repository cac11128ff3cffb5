"""A target's weights as part of its identity (docs/contract.md, "Identity").

Two models with the same config.json and tokenizer -- a base model and its fine-tune, two revisions of one model --
are different targets: a drafter trained on one's hidden states is served with the other's. So every artefact
records `target.weights_sha256` next to the config and tokenizer hashes, and every stage boundary compares it.

Hashing every byte of a 590 GB INT4 checkpoint takes many minutes, every time a stage starts. The default digest
("sampled-v1") reads, per weight file: its size, its first HEAD_BYTES (a safetensors file's header: every tensor's
name, dtype, shape and offsets, and the start of the first tensor), its last BLOCK_BYTES, and SAMPLES blocks of
BLOCK_BYTES at fixed fractions of its length -- about 2 MiB a file, so seconds for the whole checkpoint
(bench/RESULTS.md). A fine-tune or another revision changes bytes everywhere, so the samples differ. An edit confined
to a few bytes between samples is not seen: `full=True` ("full-v1", `--full-weights-digest`) hashes every byte.
The two methods give different digests and are never compared with each other as equal.
"""

from __future__ import annotations

import hashlib
import os
import re

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5", ".msgpack", ".npz")
HEAD_BYTES = 1 << 20
BLOCK_BYTES = 64 << 10
SAMPLES = 16
SAMPLED, FULL = "sampled-v1", "full-v1"


def weight_files(target_dir: str) -> list[str]:
    """Every weight file under the target directory (recursively; symlinks followed, as the hub cache's are),
    as paths relative to it, sorted."""
    found = []
    for root, dirs, files in os.walk(target_dir, followlinks=True):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for f in files:
            if f.endswith(WEIGHT_SUFFIXES):
                found.append(os.path.relpath(os.path.join(root, f), target_dir))
    return sorted(found)


def _file_digest(path: str, full: bool) -> str:
    h = hashlib.sha256()
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        if full or size <= HEAD_BYTES + (SAMPLES + 1) * BLOCK_BYTES:
            for block in iter(lambda: f.read(16 << 20), b""):
                h.update(block)
            return h.hexdigest()
        h.update(f.read(HEAD_BYTES))
        for i in range(SAMPLES):
            f.seek(HEAD_BYTES + (size - HEAD_BYTES - BLOCK_BYTES) * (2 * i + 1) // (2 * SAMPLES))
            h.update(f.read(BLOCK_BYTES))
        f.seek(size - BLOCK_BYTES)
        h.update(f.read(BLOCK_BYTES))
    return h.hexdigest()


def weights_fingerprint(target_dir: str, full: bool = False) -> dict:
    """{"sha256": "<method>:<hex>", "files": n, "bytes": total}. The method is part of the digest string, so a sampled
    and a full digest of the same weights never compare equal by accident (they name their method instead)."""
    files = weight_files(target_dir)
    if not files:
        raise FileNotFoundError(f"{target_dir}: no weight files ({', '.join(WEIGHT_SUFFIXES)}): a target's weights "
                                "are part of its identity")
    h = hashlib.sha256()
    total = 0
    for rel in files:
        p = os.path.join(target_dir, rel)
        size = os.path.getsize(p)
        total += size
        # the file's name is left out (the same bytes renamed are the same weights); its size and digest are not
        h.update(f"{size}:{_file_digest(p, full)}\n".encode())
    return {"sha256": f"{FULL if full else SAMPLED}:{h.hexdigest()}", "files": len(files), "bytes": total}


_SNAPSHOT = re.compile(r"[/\\]models--([^/\\]+)[/\\]snapshots[/\\]([0-9a-f]{40})(?:[/\\]|$)")


def hub_revision(target_dir: str) -> str:
    """'org/name@<commit>' for a directory inside the Hugging Face hub cache (models--org--name/snapshots/<commit>),
    else ''. Provenance: where the weights came from, not part of identity (the weights' digest is)."""
    m = _SNAPSHOT.search(os.path.abspath(target_dir))
    return f"{m.group(1).replace('--', '/')}@{m.group(2)}" if m else ""
