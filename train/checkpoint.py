"""Training checkpoints: saved complete or not at all, checked before they are read, safe to load, resumed exactly.

checkpoints/stepNNNNNNNN/ holds DeepSpeed's state (its *.pt files), drafter.safetensors, and eagle3_checkpoint.json,
which is written last and records the sha256 of every other file there. So a checkpoint is complete exactly when its
record exists; resume and export check each file they read against it; `latest` (written here, not by DeepSpeed,
whose own would name the checkpoint before its drafter and record are written) only ever names a complete checkpoint,
and older checkpoints are deleted only after a newer one is complete.

DeepSpeed reads its *.pt files with `torch.load(weights_only=False)`, i.e. unpickles them: a planted object in one
of them would run code on resume, and a sha256 recorded beside the file does not stop whoever planted it from
rewriting the record too. SafeCheckpointEngine loads them with `weights_only=True` and an allowlist of the few
DeepSpeed types their state holds; anything else is refused, naming the file.

--resume continues a run from checkpoints/latest (`Resume`) with the same data order and held-out split: it refuses
any option whose change would alter them or the run the checkpoint continues (`check_resume`), and allows only
RESUMABLE ones, recorded in run.json's `resumes`.
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

from dataclasses import dataclass

import torch
from safetensors.torch import save

from eagle3 import contract as C
from eagle3 import dist as D
from eagle3.atomic import atomic_write_bytes, replaced_dir
# what reading a checkpoint needs lives below train/ (export reads checkpoints too): re-exported here
from eagle3.records import (BEST_DIR, CHECKPOINTS_DIR, CKPT_FILE, DRAFTER_WEIGHTS_FILE, LATEST, MEANING_KEY,  # noqa: F401
                            METRICS_FILE, CheckpointError, CheckpointRecord, RunRecord, check_files, checkpoint_tag,
                            data_files)
from eagle3.train.config import TrainConfig


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
    # Built on first use: reading a checkpoint (check_files, read_record) needs no DeepSpeed import.
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


# ------------------------------------------------------------------------------------------------- saving

def consolidated_state_dict(engine) -> dict[str, torch.Tensor]:
    """The drafter's full weights on every rank (ZeRO-3 gathers its partitions), as exported to SGLang."""
    import deepspeed  # here, not at the top: tests and tools read checkpoints without DeepSpeed's import time
    drafter = engine.module.drafter
    params = list(drafter.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None, enabled=engine.zero_optimization_stage() == 3):
        return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in drafter.export_state_dict().items()}


def drafter_bytes(weights: dict[str, torch.Tensor], step: int, run_record: RunRecord) -> bytes:
    """The consolidated drafter as safetensors, its metadata holding the step and what the weights mean
    (records.MEANING_KEY): export checks the checkpoint's record against it."""
    return save(weights, metadata={"eagle3_step": str(step), MEANING_KEY: run_record.meaning_sha256()})


def save_checkpoint(engine, run_dir: str, step: int, keep: int, world: D.World, run_record: RunRecord) -> str:
    """checkpoints/stepN: DeepSpeed's state, the consolidated drafter, then the record with every file's sha256
    (complete from then on), then `latest`, and only then the deletion of older checkpoints (`keep` are kept)."""
    root = os.path.join(run_dir, CHECKPOINTS_DIR)
    tag = checkpoint_tag(step)
    path = os.path.join(root, tag)
    if world.is_main and is_complete(path):
        # left by an abandoned attempt that got this far: incomplete until this save has rewritten and recorded it
        os.remove(os.path.join(path, CKPT_FILE))
    rng = {"torch": torch.get_rng_state().tolist()}
    engine.save_checkpoint(root, tag=tag, client_state={"step": step, "rng": rng}, save_latest=False)
    weights = consolidated_state_dict(engine)
    D.run_on_main(lambda: write_bytes_atomic(os.path.join(path, DRAFTER_WEIGHTS_FILE),
                                             drafter_bytes(weights, step, run_record)), world)
    sha256 = hash_files(path, world)

    def complete():
        write_record(path, CheckpointRecord.of_run(run_record, step=step, tag=tag, weights=DRAFTER_WEIGHTS_FILE,
                                                   sha256=sha256))
        set_latest(root, tag)
        rotate(root, tag, keep)
    D.run_on_main(complete, world)
    return path


def save_best(engine, run_dir: str, step: int, world: D.World, run_record: RunRecord, best: dict) -> None:
    """checkpoints/best/: the consolidated drafter with the best held-out decoding acceptance so far (for export:
    `export-sglang --step best`); replaced atomically (written aside, then renamed over)."""
    weights = consolidated_state_dict(engine)

    def write():
        data = drafter_bytes(weights, step, run_record)
        with replaced_dir(os.path.join(run_dir, CHECKPOINTS_DIR, BEST_DIR)) as tmp:
            write_bytes_atomic(os.path.join(tmp, DRAFTER_WEIGHTS_FILE), data)
            write_record(tmp, CheckpointRecord.of_run(run_record, step=step, tag=BEST_DIR,
                                                      weights=DRAFTER_WEIGHTS_FILE, best=best,
                                                      sha256={DRAFTER_WEIGHTS_FILE: C.sha256_bytes(data)}))
    D.run_on_main(write, world)


def read_best(run_dir: str) -> dict | None:
    """The held-out record of checkpoints/best, None without one."""
    path = os.path.join(run_dir, CHECKPOINTS_DIR, BEST_DIR, CKPT_FILE)
    if not os.path.isfile(path):
        return None
    return CheckpointRecord.read(path).best


# ------------------------------------------------------------------------------------------------- resuming

# Options a resume may change. None of them moves a sample between the training and held-out sets, reorders or
# rebatches the data, or changes the optimizer, loss or held-out measure the checkpoint continues with. The training
# length (max_steps, epochs) may change as long as the run does not end before its checkpoint; the cosine LR
# schedule then continues on the curve of the new length. Dumps and target may be given by other paths: their
# contents are compared (data_sha256, the target identity).
RESUMABLE = frozenset({"max_steps", "epochs", "save_interval", "keep_checkpoints", "eval_interval", "keep_best",
                       "log_interval", "num_workers", "activation_checkpointing", "piece_tokens", "fast_path",
                       "attention_kernel", "teacher_chunk_tokens", "report_to", "wandb_project", "wandb_mode",
                       "progress", "stop_after_steps", "resume", "dump", "target", "out", "trust_remote_code"})


@dataclass(frozen=True)
class Resume:
    """The checkpoint a --resume continues from: checkpoints/latest's tag, its directory and its record."""
    tag: str
    dir: str
    record: CheckpointRecord

    @classmethod
    def latest(cls, run_dir: str) -> "Resume":
        root = os.path.join(run_dir, CHECKPOINTS_DIR)
        tag = resume_tag(root)
        if tag is None:
            raise FileNotFoundError(f"--resume: no checkpoint in {root}")
        return cls(tag, os.path.join(root, tag), read_record(os.path.join(root, tag)))


def resume_changes(run_path: str, old: RunRecord, cfg: TrainConfig, identity: dict, data_sha: str,
                   world_size: int) -> dict:
    """{option: [before, now]} for the RESUMABLE options changed since the run was started (or last resumed);
    a difference in anything else is refused, naming every one."""
    C.require_same_capture(old.identity, identity, f"the run being resumed ({run_path})",
                           "the dumps given now")
    problems = []
    if old.data_sha256 != data_sha:
        problems.append(f"the dumps hold other data (shard sha256s: {old.data_sha256} -> {data_sha})")
    if old.world_size != world_size:
        problems.append(f"world size {old.world_size} -> {world_size} (it sets the batches)")
    now = json.loads(json.dumps(cfg.to_dict()))
    # An option added since the run was recorded ran as its default then (e.g. --loss: kl): compare it as such.
    defaults = json.loads(json.dumps(TrainConfig().to_dict()))
    before = {**{k: v for k, v in defaults.items() if k not in old.train}, **old.train}
    changed = {k: [before.get(k), v] for k, v in now.items() if before.get(k) != v}
    problems += [f"--{k.replace('_', '-')}: {a!r} -> {b!r}" for k, (a, b) in changed.items() if k not in RESUMABLE]
    if problems:
        raise ValueError(f"--resume: {run_path} was trained otherwise; a resume keeps the data order, the held-out "
                         "split and the run its checkpoint continues (start a new run with another --out to change "
                         "them):\n  " + "\n  ".join(problems))
    return {k: c for k, c in changed.items() if k != "resume"}


def check_resume(resume: Resume, run_path: str, vocab_path: str, cfg: TrainConfig, identity: dict, data_sha: str,
                 world_size: int, total: int, init_weights_sha256: str | None) -> dict:
    """What run.json's `resumes` records of this resume ({step, from, changed}), once everything it continues with
    is known to be the run's own: the options (resume_changes), the length, the vocabulary, the --init-from export."""
    old = RunRecord.read(run_path)
    changes = resume_changes(run_path, old, cfg, identity, data_sha, world_size)
    if total < resume.record.step:
        raise ValueError(f"--resume: the run would end at step {total}, before its checkpoint {resume.dir} "
                         f"(step {resume.record.step}): give a --max-steps of at least that")
    if C.file_sha256(vocab_path) != old.vocab_sha256:
        raise CheckpointError(f"{vocab_path}: sha256 differs from the one {run_path} records ({old.vocab_sha256}): "
                              "the draft vocabulary the checkpoints were trained with was replaced or altered")
    started = (old.extra.get("init_from") or {}).get("model_safetensors_sha256")
    if init_weights_sha256 is not None and started != init_weights_sha256:
        raise CheckpointError(f"--init-from: its weights are not the ones {run_path} started from (the export was "
                              "replaced since)")
    return {"step": resume.record.step, "from": resume.tag, "changed": changes}


def load_engine_state(engine, run_dir: str, resume: Resume) -> int:
    """DeepSpeed's state and the torch RNG of the resumed checkpoint (its files already checked against its
    record); the step it holds."""
    _, client = engine.load_checkpoint(os.path.join(run_dir, CHECKPOINTS_DIR), tag=resume.tag)
    if client is None or client.get("step") != resume.record.step:
        raise CheckpointError(f"{resume.dir}: DeepSpeed's state holds step "
                              f"{None if client is None else client.get('step')}, the record {resume.record.step}")
    torch.set_rng_state(torch.tensor(client["rng"]["torch"], dtype=torch.uint8))
    return client["step"]


def traces_of_a_run(run_dir: str) -> list[str]:
    """What a fresh run would mix with or overwrite: metrics rows, checkpoints."""
    found = []
    metrics = os.path.join(run_dir, METRICS_FILE)
    if os.path.isfile(metrics) and os.path.getsize(metrics):
        found.append(metrics)
    root = os.path.join(run_dir, CHECKPOINTS_DIR)
    if os.path.isdir(root) and os.listdir(root):
        found.append(root)
    return found
