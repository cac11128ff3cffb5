"""Reading dumps: one or more dump directories as one verified, zero-copy sample store.

Shards are opened with safetensors' `safe_open` (memory-mapped); a sample is a slice of each token-major tensor,
read without touching the rest of the shard. Each manifest is validated and each shard's size and sha256 are
checked on first open; dumps whose target, capture indices, hidden size or tokenizer differ are refused.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import torch.utils.data
from safetensors import safe_open
from tqdm import tqdm

from eagle3 import contract as C
from eagle3.contract import ContractError, DumpManifest
from eagle3.data.standardize import standardize_data_v1


@dataclass(frozen=True)
class SampleRef:
    dump: int          # index into DumpSet.dirs
    shard: int         # index into that dump's manifest.shards
    start: int         # token offset inside the shard
    length: int        # tokens
    sample_index: int  # position in the source data


class DumpSet:
    """`DumpSet([dir, ...])`: `.refs` lists every sample; `.sample(ref)` / `.standardized(ref)` read one."""

    def __init__(self, dirs: list[str] | str, verify: bool = True, progress: bool = False):
        self.dirs = [dirs] if isinstance(dirs, str) else list(dirs)
        if not self.dirs:
            raise ValueError("no dump directories given")
        self.manifests: list[DumpManifest] = [C.load_manifest(d) for d in self.dirs]
        first = self.manifests[0].identity()
        for d, m in zip(self.dirs[1:], self.manifests[1:]):
            C.require_same_capture(first, m.identity(), self.dirs[0], d)
        if verify:
            self.verify(progress=progress)
        self.refs: list[SampleRef] = []
        for di, (d, m) in enumerate(zip(self.dirs, self.manifests)):
            for si, rec in enumerate(m.shards):
                path = os.path.join(d, rec.file)
                with safe_open(path, "pt") as f:
                    offsets = f.get_tensor(C.SAMPLE_OFFSETS).tolist()
                    index = f.get_tensor(C.SAMPLE_INDEX).tolist()
                if len(index) != rec.samples or offsets[-1] != rec.tokens:
                    raise ContractError(f"{path}: holds {len(index)} samples / {offsets[-1]} tokens, the manifest "
                                        f"says {rec.samples} / {rec.tokens}")
                self.refs += [SampleRef(di, si, offsets[n], offsets[n + 1] - offsets[n], index[n])
                              for n in range(len(index))]
        self._handles: dict = {}

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

    def sample(self, ref: SampleRef, keys: list[str] | None = None) -> dict:
        """The raw tensors of one sample (slices read from the mmap'd shard)."""
        f = self._shard(ref.dump, ref.shard)
        names = keys if keys is not None else [k for k in f.keys() if k not in (C.SAMPLE_OFFSETS, C.SAMPLE_INDEX)]
        a, b = ref.start, ref.start + ref.length
        return {k: f.get_slice(k)[a:b] for k in names}

    def standardized(self, ref: SampleRef, concat: bool = True) -> dict:
        keys = [C.INPUT_IDS, C.LOSS_MASK, C.FINAL_HIDDEN] + [C.hidden_state_key(k) for k in self.indices]
        try:
            if C.TARGET_ARGMAX in self._shard(ref.dump, ref.shard).keys():
                keys.append(C.TARGET_ARGMAX)
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


def _mix64(x: int) -> int:
    """splitmix64: a fixed, platform-independent hash (Python's hash() is salted per process)."""
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def is_held_out(sample_index: int, fraction: float, seed: int) -> bool:
    """Deterministic by (seed, sample_index): a source sample is on the same side in every dump and every run."""
    return _mix64(_mix64(seed) ^ sample_index) < fraction * 2.0**64


def split(refs: list[SampleRef], held_out_fraction: float, seed: int = 0) -> tuple[list[SampleRef], list[SampleRef]]:
    train, held = [], []
    for r in refs:
        (held if is_held_out(r.sample_index, held_out_fraction, seed) else train).append(r)
    return train, held


def _batch_tensor(shape, dtype) -> torch.Tensor:
    """Uninitialised; in a DataLoader worker, in shared memory already, so handing it over copies nothing."""
    if torch.utils.data.get_worker_info() is None:
        return torch.empty(shape, dtype=dtype)
    n = math.prod(shape)
    storage = torch.empty(0, dtype=dtype)._typed_storage()._new_shared(n)
    return torch.empty(0, dtype=dtype).set_(storage).view(shape)


def collate(samples: list[dict], pad_id: int = 0) -> dict:
    """Right-pad standardized samples into a batch with an attention mask. Samples may carry `hidden_state` or
    `hidden_parts` (standardized(concat=False)): the parts are written straight into their columns."""
    B, T = len(samples), max(s["input_ids"].shape[0] for s in samples)
    first = samples[0]
    parts0 = first.get("hidden_parts")
    hs_dtype = first["hidden_state"].dtype if parts0 is None else parts0[0].dtype
    hs_width = first["hidden_state"].shape[-1] if parts0 is None else sum(p.shape[-1] for p in parts0)
    out = {
        "input_ids": torch.full((B, T), pad_id, dtype=torch.long),
        "loss_mask": torch.zeros((B, T), dtype=torch.uint8),
        "attention_mask": torch.zeros((B, T), dtype=torch.long),
        "hidden_state": _batch_tensor((B, T, hs_width), hs_dtype),
        "target_hidden": _batch_tensor((B, T, first["target_hidden"].shape[-1]), first["target_hidden"].dtype),
    }
    if all("target_argmax" in s for s in samples):  # the dump recorded the teacher's argmax (all or nothing)
        out["target_argmax"] = torch.zeros((B, T), dtype=torch.long)
    for b, s in enumerate(samples):
        n = s["input_ids"].shape[0]
        if "target_argmax" in out:
            out["target_argmax"][b, :n] = s["target_argmax"]
        out["input_ids"][b, :n] = s["input_ids"]
        out["loss_mask"][b, :n] = s["loss_mask"]
        out["attention_mask"][b, :n] = 1
        if "hidden_parts" in s:
            c = 0
            for p in s["hidden_parts"]:
                out["hidden_state"][b, :n, c:c + p.shape[-1]] = p
                c += p.shape[-1]
        else:
            out["hidden_state"][b, :n] = s["hidden_state"]
        out["target_hidden"][b, :n] = s["target_hidden"]
        out["hidden_state"][b, n:] = 0  # only the padding is zeroed (the rest was just written)
        out["target_hidden"][b, n:] = 0
    return out
