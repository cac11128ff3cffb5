"""Reading dumps: one or more dump directories as one verified, zero-copy sample store.

Shards are opened with safetensors' `safe_open` (memory-mapped); a sample is a slice of each token-major tensor,
read without touching the rest of the shard. Each manifest is validated and each shard's size and sha256 are
checked on first open; dumps whose target, capture indices, hidden size or tokenizer differ are refused.
Each shard's own metadata and tensor names must agree with the manifest that lists it (a manifest edited to claim
other layers is refused here, not in a loader worker), and no sample may come twice: a dump listed twice, or two
dumps holding the same record of the same data file, are refused.

A dump stored in fp8 (docs/contract.md §3) is dequantized as it is read (`q * scale`, in float32, then the dtype
asked for: by default the dump's own --dtype), so consumers see the same tensors as from a dump stored in dtype.
With `fp8_in_batch=True` the states stay fp8 through `collate` (data/batch.py) instead (a quarter of bf16's bytes to
copy and ship) and `Batch.dequantized` does the same float32 multiply where the batch is used: on the GPU that costs
nothing, while the readers' CPU conversion limits them to ~1.3x the trainer at the Kimi shape (bench/RESULTS.md, fp8
storage).
"""

from __future__ import annotations

import bisect
import logging
import os
from dataclasses import dataclass

import torch
from safetensors import safe_open
from tqdm import tqdm

from eagle3 import contract as C
from eagle3.contract import ContractError, DumpManifest
from eagle3.data.standardize import Sample, standardize_data_v1
from eagle3.dump.shards import dequantize_fp8, read_shard_metadata
from eagle3.heldout import SPLIT_SEED, is_held_out

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SampleRef:
    dump: int          # index into DumpSet.dirs
    shard: int         # index into that dump's manifest.shards
    start: int         # token offset inside the shard
    length: int        # tokens
    sample_index: int  # position in the source data


class DumpSet:
    """`DumpSet([dir, ...])`: `.refs` lists every sample; `.sample(ref)` / `.standardized(ref)` read one.
    `dtype`: what fp8-stored states are dequantized to (default: each dump's --dtype, the manifest's `dtype`)."""

    def __init__(self, dirs: list[str] | str, verify: bool = True, progress: bool = False,
                 dtype: torch.dtype | None = None, fp8_in_batch: bool = False):
        self.dirs = [dirs] if isinstance(dirs, str) else list(dirs)
        if not self.dirs:
            raise ValueError("no dump directories given")
        seen: dict[str, str] = {}
        for d in self.dirs:
            real = os.path.realpath(d)
            if real in seen:
                raise ContractError(f"dump {d} is listed twice ({seen[real]!r} and {d!r}): every sample would "
                                    "count twice")
            seen[real] = d
        self.manifests: list[DumpManifest] = [C.load_manifest(d) for d in self.dirs]
        first = self.manifests[0].identity()
        for d, m in zip(self.dirs[1:], self.manifests[1:]):
            C.require_same_capture(first, m.identity(), self.dirs[0], d)
        if verify:
            self.verify(progress=progress)
        self.refs: list[SampleRef] = []
        self.legacy: list[str] = []  # dumps whose shards predate per-shard identity (see check_shard)
        for di, (d, m) in enumerate(zip(self.dirs, self.manifests)):
            plans = set()
            for si, rec in enumerate(m.shards):
                path = os.path.join(d, rec.file)
                # Without --verify's sha256 (--no-verify) a shard cut short or replaced is still named, not read
                # into a traceback: its size is checked, and whatever safetensors cannot read is refused by name.
                size = os.path.getsize(path) if os.path.isfile(path) else None
                if size != rec.bytes:
                    raise ContractError(f"{path}: {'missing' if size is None else f'{size:,} bytes'}, the manifest "
                                        f"records {rec.bytes:,} (truncated, replaced or removed)")
                offsets, index, plan = read_shard_index(path, si, m, os.path.join(d, C.MANIFEST_FILE))
                plans.add(plan)
                if len(index) != rec.samples or offsets[-1] != rec.tokens:
                    raise ContractError(f"{path}: holds {len(index)} samples / {offsets[-1]} tokens, the manifest "
                                        f"says {rec.samples} / {rec.tokens}")
                self.refs += [SampleRef(di, si, offsets[n], offsets[n + 1] - offsets[n], index[n])
                              for n in range(len(index))]
            if len(plans) > 1:  # e.g. an old run's shards adopted by a new one, or legacy and new shards
                raise ContractError(f"{d}: its shards come from {len(plans)} different dump runs (shard plans "
                                    f"{sorted(map(str, plans))}): not one dump; re-dump into a new directory")
            if None in plans:
                self.legacy.append(d)
                logger.warning("%s: shards written before eagle3 recorded their identity: capture indices and "
                               "target are checked against the manifest, tokenizer, dtype and data are not", d)
        self._handles: dict = {}
        self._deq_dtype = [(dtype or getattr(torch, m.dtype)) if m.storage == C.STORAGE_FP8 else None
                           for m in self.manifests]  # per dump: None = stored as read
        # standardized(): fp8 states and their scales as stored, for collate + Batch.dequantized (module docstring)
        self.fp8_in_batch = fp8_in_batch
        self._refuse_shared_samples()

    @classmethod
    def streamed(cls, path: str, manifest: DumpManifest, refs: list[SampleRef]) -> "DumpSet":
        """A DumpSet over a spool whose shards arrive while it is read (data/stream.py verifies each before its
        samples are read, filling in `manifest.shards`): the same reading path as any dump's."""
        self = cls.__new__(cls)
        self.dirs, self.manifests, self.refs, self.legacy = [path], [manifest], refs, []
        self._handles = {}
        self._deq_dtype = [getattr(torch, manifest.dtype) if manifest.storage == C.STORAGE_FP8 else None]
        self.fp8_in_batch = False
        return self

    def _refuse_shared_samples(self) -> None:
        """Two dumps must not hold the same sample: training would count it twice. A sample is named by its data
        file's sha256 and its record in that file (so [a, b] and [b] dumps overlap on b, whatever the paths)."""
        keys = [_sample_key(m) for m in self.manifests]
        owner: dict = {}
        for r in self.refs:
            prev = owner.setdefault(keys[r.dump](r.sample_index), r)
            if prev.dump != r.dump:
                raise ContractError(
                    f"dumps {self.dirs[prev.dump]} and {self.dirs[r.dump]} hold the same samples (e.g. "
                    f"{self.where(prev)} and {self.where(r)}: the same record of the same data file): training "
                    "would count them twice; give one of them, or dumps of disjoint data")

    @property
    def manifest(self) -> DumpManifest:
        """The shared contract (all dumps have the same identity)."""
        return self.manifests[0]

    @property
    def indices(self) -> list[int]:
        return list(self.manifest.capture.hidden_state_indices)

    def verify(self, progress: bool = False) -> None:
        """Every shard present with the manifest's size and sha256: a truncated or altered shard is an error."""
        items = [(d, rec) for d, m in zip(self.dirs, self.manifests) for rec in m.shards]
        for d, rec in tqdm(items, desc="verify shards", unit="shard", disable=not progress):
            path = os.path.join(d, rec.file)
            if not os.path.isfile(path):
                raise ContractError(f"{path}: shard listed in the manifest is missing")
            size = os.path.getsize(path)
            if size != rec.bytes:
                raise ContractError(f"{path}: {size} bytes, the manifest says {rec.bytes} (truncated or altered)")
            if C.file_sha256(path) != rec.sha256:
                raise ContractError(f"{path}: sha256 differs from the manifest (the shard was altered)")

    def _shard(self, dump: int, shard: int):
        # One mmap handle per shard per process (DataLoader workers each open their own after fork).
        key = (os.getpid(), dump, shard)
        h = self._handles.get(key)
        if h is None:
            h = safe_open(os.path.join(self.dirs[dump], self.manifests[dump].shards[shard].file), "pt")
            self._handles[key] = h
        return h

    def where(self, ref: SampleRef) -> str:
        return (f"{os.path.join(self.dirs[ref.dump], self.manifests[ref.dump].shards[ref.shard].file)} "
                f"sample_index {ref.sample_index}")

    def sample(self, ref: SampleRef, keys: list[str] | None = None, dequantize: bool = True) -> dict:
        """The tensors of one sample (slices read from the mmap'd shard); fp8-stored states dequantized (their
        `.scale` companions are not listed), unless dequantize=False: then the stored tensors, scales included."""
        f = self._shard(ref.dump, ref.shard)
        deq = self._deq_dtype[ref.dump] if dequantize else None
        names = keys if keys is not None else [k for k in f.keys() if k not in (C.SAMPLE_OFFSETS, C.SAMPLE_INDEX)
                                               and not (deq and k.endswith(C.SCALE_SUFFIX))]
        a, b = ref.start, ref.start + ref.length
        out = {}
        for k in names:
            x = f.get_slice(k)[a:b]
            if deq is not None and _is_state(k):
                x = dequantize_fp8(x, f.get_slice(C.scale_key(k))[a:b], deq)
            out[k] = x
        return out

    def standardized(self, ref: SampleRef, concat: bool = True) -> Sample:
        keys = [C.INPUT_IDS, C.LOSS_MASK, C.FINAL_HIDDEN] + [C.hidden_state_key(k) for k in self.indices]
        try:
            if C.TARGET_ARGMAX in self._shard(ref.dump, ref.shard).keys():
                keys.append(C.TARGET_ARGMAX)
            if self.fp8_in_batch and self._deq_dtype[ref.dump] is not None:
                raw = self.sample(ref, keys + [C.scale_key(k) for k in keys if _is_state(k)], dequantize=False)
            else:
                raw = self.sample(ref, keys)
        except Exception as e:  # safetensors raises its own error types; name the shard and sample
            if isinstance(e, ContractError):
                raise
            raise ContractError(f"{self.where(ref)}: cannot read ({type(e).__name__}: {e})") from e
        return standardize_data_v1(raw, self.manifests[ref.dump], source=self.where(ref), concat=concat)

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_handles"] = {}
        return state


def read_shard_index(path: str, position: int, m: DumpManifest,
                     manifest_path: str) -> tuple[list[int], list[int], str | None]:
    """(sample_offsets, sample_index, plan hash) of the shard at `position` of manifest m, after `check_shard`;
    whatever safetensors cannot read is a ContractError naming the file."""
    try:
        with safe_open(path, "pt") as f:
            offsets = f.get_tensor(C.SAMPLE_OFFSETS).tolist()
            index = f.get_tensor(C.SAMPLE_INDEX).tolist()
            plan = check_shard(path, position, sorted(f.keys()), m, manifest_path)
    except ContractError:
        raise
    except Exception as e:  # noqa: BLE001 - safetensors' errors, a missing tensor: not a readable shard
        raise ContractError(f"{path}: not a readable dump shard ({type(e).__name__}: {str(e)[:200]})") from None
    return offsets, index, plan


def check_shard(path: str, position: int, keys: list[str], m: DumpManifest, manifest_path: str) -> str | None:
    """The shard's own metadata and tensor names against the manifest listing it; returns its plan hash (None
    for a legacy shard).

    Legacy shards (written before shards recorded tokenizer, dtype, data and plan) are read, not refused: what
    silently ruins a drafter -- other capture indices, another target -- is still checked (their metadata has
    both, their tensor names show the indices), re-dumping a large target costs GPU-days, and a resumed run
    refuses to write into such a dump (dump.shards.finished_shard), so nothing new gets mixed into one."""
    held = sorted(k for k in map(C.captured_index, keys) if k is not None)
    if held != list(m.capture.hidden_state_indices):
        raise ContractError(f"{path} holds hidden states {held}, but {manifest_path} claims "
                            f"{m.capture.hidden_state_indices}: the manifest does not describe its shards")
    scales = sorted(k for k in keys if k.endswith(C.SCALE_SUFFIX))
    want = sorted(C.scale_key(n) for n in [C.FINAL_HIDDEN, *m.capture.keys()]) if m.storage == C.STORAGE_FP8 else []
    if scales != want:  # the manifest's storage decides how the states are read: it must be the shard's
        raise ContractError(f"{path} holds scale tensors {scales}, but {manifest_path} says storage "
                            f"{m.storage!r} (expects {want})")
    meta = read_shard_metadata(path)
    expected = C.shard_identity(m)
    if C.is_legacy_shard(meta):
        expected = {k: v for k, v in expected.items() if k in C.LEGACY_SHARD_KEYS}
    else:
        expected[C.SHARD_INDEX] = position
    C.check_shard_identity(meta, expected, path, manifest_path)
    return meta.get(C.PLAN_SHA256)


def _is_state(name: str) -> bool:
    """A [N, H] state tensor: what fp8 storage quantizes."""
    return name == C.FINAL_HIDDEN or C.captured_index(name) is not None


def _sample_key(m: DumpManifest):
    """sample_index -> the name of that sample across dumps: (data file sha256, record in that file)."""
    files = [r for r in m.data_fingerprint.get("files", []) if r["first_sample_index"] is not None]
    if not files:  # legacy dump: no data fingerprint; the same --data paths is the best it records
        paths = tuple(m.data_files)
        return lambda si: (paths, si)
    starts = [r["first_sample_index"] for r in files]

    def key(si: int) -> tuple:
        r = files[bisect.bisect_right(starts, si) - 1]
        return r["sha256"], si - r["first_sample_index"]
    return key


def split(refs: list[SampleRef], held_out_fraction: float,
          seed: int = SPLIT_SEED) -> tuple[list[SampleRef], list[SampleRef]]:
    train, held = [], []
    for r in refs:
        (held if is_held_out(r.sample_index, held_out_fraction, seed) else train).append(r)
    return train, held
