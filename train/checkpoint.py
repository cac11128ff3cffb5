"""Training checkpoints that are safe to load and checked before they are.

checkpoints/stepNNNNNNNN/ holds DeepSpeed's state (its *.pt files), drafter.safetensors, and eagle3_checkpoint.json,
which is written last and records the sha256 of every other file there. So a checkpoint is complete exactly when its
record exists; resume and export check each file they read against it; `latest` (written here, not by DeepSpeed,
whose own would name the checkpoint before its drafter and record are written) only ever names a complete checkpoint,
and older checkpoints are deleted only after a newer one is complete.

DeepSpeed reads its *.pt files with `torch.load(weights_only=False)`, i.e. unpickles them: a planted object in one
of them would run code on resume, and a sha256 recorded beside the file does not stop whoever planted it from
rewriting the record too. SafeCheckpointEngine loads them with `weights_only=True` and an allowlist of the few
DeepSpeed types their state holds; anything else is refused, naming the file.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
import pickle
import re
import shutil

import torch

from eagle3 import contract as C
from eagle3 import dist as D
from eagle3.atomic import atomic_write_bytes
# what reading a checkpoint needs lives below train/ (export reads checkpoints too): re-exported here
from eagle3.records import CKPT_FILE, LATEST, CheckpointError, CheckpointRecord, check_files, data_files  # noqa: F401


def _allowed_globals() -> list:
    """The non-tensor, non-container types in DeepSpeed 0.19's checkpoint files as this trainer writes them (ZeRO
    1-3, fp32 or bf16; listed with torch.serialization.get_unsafe_globals_in_checkpoint): all in the optimizer
    states -- the static loss scaler, the ZeRO stage enum, and (ZeRO 1-2) the flat partitions' fragment addresses."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address
    return [LossScaler, ZeroStageEnum, fragment_address]


@contextlib.contextmanager
def naming_disk_full(path: str):
    """A write to a full disk fails with a bare ENOSPC that names no file: say which file was being written."""
    try:
        yield
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
        raise OSError(errno.ENOSPC, f"disk full (no space left on the device) while writing {path}: free space, "
                                    "then resume from the last complete checkpoint (--resume)") from e


def write_bytes_atomic(path: str, data: bytes) -> None:
    """The dump's atomic write (temporary name, fsync, rename), its full-disk error naming the file."""
    with naming_disk_full(path):
        atomic_write_bytes(path, data)


def install_safe_engine(engine) -> None:
    """Replace the engine's checkpoint engine: DeepSpeed reads and writes every checkpoint file through it."""
    engine.checkpoint_engine = _safe_engine_class()(engine._config)


@functools.cache
def _safe_engine_class():
    # Built on first use: the export imports this module for check_files and should not have to import DeepSpeed.
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

    class SafeCheckpointEngine(TorchCheckpointEngine):
        """DeepSpeed's torch engine, with a load that never runs code and a save whose full-disk error names the
        file."""

        def save(self, state_dict, path: str):
            # Through a Python file object, so ENOSPC arrives as an OSError (a path handed to torch.save is written
            # by C++, whose error is only "unexpected pos N vs M").
            with naming_disk_full(path), open(path, "wb") as f:
                torch.save(state_dict, f, _use_new_zipfile_serialization=self.zipfile_serialization)

        def load(self, path: str, map_location=None):
            return safe_load(path, map_location)

    return SafeCheckpointEngine


def safe_load(path: str, map_location=None):
    """torch.load that only rebuilds tensors, containers and the allowlisted DeepSpeed types."""
    try:
        with torch.serialization.safe_globals(_allowed_globals()):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        # torch's message goes on to suggest allowlisting whatever was found: not advice to pass on here
        found = re.search(r"GLOBAL (\S+)", str(e))
        what = f"it names {found.group(1)}, not on the allowlist" if found else str(e).strip().splitlines()[0]
        raise CheckpointError(f"{path}: refusing to load: it holds more than tensors and plain training state, "
                              f"and unpickling it could run code ({what})") from None


# ------------------------------------------------------------------------------------------------- records

def read_record(ckpt_dir: str) -> CheckpointRecord:
    return CheckpointRecord.read(os.path.join(ckpt_dir, CKPT_FILE))


def is_complete(ckpt_dir: str) -> bool:
    return os.path.isfile(os.path.join(ckpt_dir, CKPT_FILE))


def hash_files(ckpt_dir: str, world: D.World) -> dict[str, str]:
    """sha256 of every file of the checkpoint, the files shared out among the ranks (DeepSpeed's optimizer state
    is many GB for a large drafter)."""
    names = D.broadcast_object(data_files(ckpt_dir) if world.is_main else None)
    mine = {n: C.file_sha256(os.path.join(ckpt_dir, n)) for n in names[world.rank::world.world_size]}
    return {k: v for part in D.all_gather_objects(mine) for k, v in sorted(part.items())}


def write_record(ckpt_dir: str, record: CheckpointRecord) -> None:
    path = os.path.join(ckpt_dir, CKPT_FILE)
    write_bytes_atomic(path, json.dumps(record.to_dict(), indent=1).encode())


# ---------------------------------------------------------------------------------------- latest, rotation

def step_tags(root: str) -> list[str]:
    if not os.path.isdir(root):
        return []
    return sorted(t for t in os.listdir(root) if t.startswith("step") and t[4:].isdigit())


def resume_tag(root: str) -> str | None:
    """The checkpoint `latest` names, or None without one; an empty or dangling `latest` is an error."""
    latest = os.path.join(root, LATEST)
    if not os.path.isfile(latest):
        return None
    with open(latest) as f:
        tag = f.read().strip()
    complete = [t for t in step_tags(root) if is_complete(os.path.join(root, t))]
    hint = f"complete checkpoints here: {', '.join(complete) or 'none'}"
    if not tag:
        raise CheckpointError(f"{latest} is empty (a save was interrupted): write the tag of the checkpoint to resume "
                              f"from into it ({hint})")
    if tag not in complete:
        raise CheckpointError(f"{latest} names {tag!r}, which is not a complete checkpoint (no {CKPT_FILE}) ({hint})")
    return tag


def set_latest(root: str, tag: str) -> None:
    write_bytes_atomic(os.path.join(root, LATEST), tag.encode())


def rotate(root: str, newest: str, keep: int) -> None:
    """Called once `newest` is complete: keep the `keep` newest complete checkpoints up to it and delete the others
    up to it, complete or not (an incomplete one below `newest` is a save the run has passed). Later directories
    are left alone: stale saves of an abandoned attempt, rewritten when the run gets there."""
    tags = [t for t in step_tags(root) if t <= newest]
    complete = [t for t in tags if is_complete(os.path.join(root, t))]
    kept = set(complete[-keep:]) if keep > 0 else set(complete)
    assert newest in kept, newest
    for t in tags:
        if t not in kept:
            shutil.rmtree(os.path.join(root, t), ignore_errors=True)
