"""Shard format v1: one safetensors file per shard, token-major, zero-copy readable.

    input_ids [N] int32, loss_mask [N] uint8, hidden_states.<k> [N, H] per captured HF index k,
    final_hidden [N, H], sample_offsets [n+1] int64, sample_index [n] int64, target_argmax [N] int32 (optional)

With storage "fp8" the states are float8 e4m3 and each has a companion `<name>.scale` [N] float32 (one scale per
token row, `quantize_fp8`); readers get them back with `dequantize_fp8` (docs/contract.md §3).

The file is written by `write_shard` itself in the safetensors layout (8-byte header length, JSON header, data),
streamed from the per-sample tensors: no concatenated copy of the shard, and the sha256 is computed on a second
thread from the same buffers while the first writes them, so the hash costs no pass of its own.

A shard is written to a temporary name and renamed; then a small sidecar `shard-XXXXX.json` (its ShardRecord) is
renamed into place. A shard counts as finished only when its sidecar exists and its own metadata (contract
`shard_identity`: target, capture indices, tokenizer, dtype, data and shard plan) is what the resuming run would
write; a killed run leaves at most temporary files, which the rerun removes (`remove_stale_tmp`).
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import re
import struct
import sys
import threading
from dataclasses import asdict

import torch

from eagle3 import contract as C
from eagle3.atomic import atomic_write_text, tmp_name
from eagle3.contract import ShardRecord


SHARD_METADATA_KEY = C.SHARD_METADATA_KEY
# What `tmp_name` makes of the files a dump writes (shards, sidecars, dump_config.json, manifest.json).
_STALE_TMP = re.compile(r"^(shard-(\d{5})\.(safetensors|json)|dump_config\.json|manifest\.json|spool\.json|"
                        r"spool_tokens\.safetensors)\.tmp-\d+$")


def shard_name(j: int) -> str:
    return f"shard-{j:05d}.safetensors"


def sidecar_name(j: int) -> str:
    return f"shard-{j:05d}.json"


def remove_stale_tmp(out_dir: str, shards: set[int] | None = None) -> list[str]:
    """Remove the temporary files a killed dump left in out_dir (only names the dump writes); returns them.
    Call it only while no writer of them runs: with `shards` (one of several jobs), only those shards' files."""
    def stale_name(n):
        m = _STALE_TMP.match(n)
        return m and (shards is None or (m.group(2) is not None and int(m.group(2)) in shards))
    stale = sorted(n for n in os.listdir(out_dir) if stale_name(n))
    for n in stale:
        os.remove(os.path.join(out_dir, n))
    return stale


_ST_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float64: "F64",
              torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8", torch.float8_e4m3fn: "F8_E4M3"}


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., H] (any float dtype, any device) -> (q [..., H] float8_e4m3fn, scale [...] float32) with
    x ~= q * scale, scale = row amax / 448. Computed in float32 from x as captured (no intermediate bf16 round).
    An all-zero row gets scale 1, so it reads back as exact zeros; a row holding NaN/Inf stays non-finite, and the
    reader refuses it as it would the unquantized row."""
    x = x.float()
    amax = x.abs().amax(dim=-1)
    # amax == 0, not amax > 0: a NaN row keeps a NaN scale, so it reads back non-finite however q holds it
    scale = torch.where(amax == 0, torch.ones_like(amax), amax / C.FP8_MAX)
    # The clamp guards rounding at the row's maximum: e4m3fn has no Inf, a value past 448 would become NaN.
    q = (x / scale.unsqueeze(-1)).clamp_(-C.FP8_MAX, C.FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


_FP8_PAIRS: list[torch.Tensor] = []


def _fp8_pairs() -> torch.Tensor:
    """[65536] int64: entry b0 | b1 << 8 holds the float32 values of the e4m3 bytes b0, b1 side by side (torch's
    own conversion of every byte, so the values are exactly q.float()'s)."""
    if not _FP8_PAIRS:
        pairs = torch.arange(65536, dtype=torch.int32).to(torch.uint16).view(torch.uint8)
        _FP8_PAIRS.append(pairs.view(torch.float8_e4m3fn).to(torch.float32).view(torch.int64))
    return _FP8_PAIRS[0]


def _fp8_to_float32(q: torch.Tensor) -> torch.Tensor:
    """q.to(float32); on the CPU by a table lookup over byte pairs, ~1.4x faster than torch's scalar conversion
    (the reader's dequantize is the cost fp8 storage adds to every batch)."""
    if q.device.type != "cpu" or q.shape[-1] % 2 or not q.is_contiguous() or sys.byteorder != "little":
        return q.to(torch.float32)
    idx = q.view(torch.uint16).reshape(-1).to(torch.int64)
    return torch.index_select(_fp8_pairs(), 0, idx).view(torch.float32).view(q.shape)


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q [T, H] float8_e4m3fn, scale [T] float32 -> q * scale in `dtype` (multiplied in float32)."""
    x = _fp8_to_float32(q).mul_(scale.unsqueeze(-1))
    return x if dtype == torch.float32 else x.to(dtype)


def _bytes(t: torch.Tensor) -> memoryview:
    t = t.contiguous()
    return memoryview(t.view(torch.uint8).numpy()).cast("B") if t.numel() else memoryview(b"")


def _write_all(f, b: memoryview) -> None:
    """An unbuffered write may be short (Linux moves at most ~2 GiB per call): loop until every byte is out."""
    b = memoryview(b).cast("B")
    while len(b):
        n = f.write(b)
        if not n:
            raise OSError("write returned 0 bytes")
        b = b[n:]


def _hash_in_order(q: queue.Queue, h, err: list):
    while (b := q.get()) is not None:
        try:
            h.update(b)  # hashlib releases the GIL on large buffers: this runs beside the writes
        except BaseException as e:  # pragma: no cover - reported by the caller
            err.append(e)


def write_safetensors(path: str, tensors: dict[str, list[torch.Tensor]], metadata: dict[str, str]) -> str:
    """Write a safetensors file whose tensor `name` is the concatenation (dim 0) of the pieces tensors[name], in the
    given key order, without concatenating them in memory. Returns the file's sha256 (hashed while writing)."""
    header: dict = {"__metadata__": metadata}
    off = 0
    for name, pieces in tensors.items():
        dt = {p.dtype for p in pieces}
        if len(dt) != 1 or next(iter(dt)) not in _ST_DTYPES:
            raise ValueError(f"{name}: pieces must share one supported dtype, got {dt}")
        rest = {tuple(p.shape[1:]) for p in pieces}
        if len(rest) != 1:
            raise ValueError(f"{name}: pieces differ beyond dim 0: {rest}")
        n = sum(p.shape[0] for p in pieces)
        nbytes = sum(p.numel() * p.element_size() for p in pieces)
        header[name] = {"dtype": _ST_DTYPES[pieces[0].dtype], "shape": [n, *next(iter(rest))],
                        "data_offsets": [off, off + nbytes]}
        off += nbytes
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-(len(hb) + 8) % 8)  # data starts 8-byte aligned (zero-copy views of every dtype)
    h, q, err = hashlib.sha256(), queue.Queue(maxsize=64), []
    hasher = threading.Thread(target=_hash_in_order, args=(q, h, err), daemon=True)
    hasher.start()
    try:
        with open(path, "wb", buffering=0) as f:
            for b in (struct.pack("<Q", len(hb)), hb):
                _write_all(f, b)
                q.put(b)
            for pieces in tensors.values():
                for p in pieces:
                    b = _bytes(p)
                    _write_all(f, b)
                    q.put(b)
            os.fsync(f.fileno())
    finally:
        q.put(None)
        hasher.join()
    if err:
        raise err[0]
    return h.hexdigest()


def write_shard(out_dir: str, j: int, samples: list[dict], indices: list[int], meta: dict) -> ShardRecord:
    """samples: [{'sample_index', 'input_ids' [T], 'loss_mask' [T], and the tensors under their shard names:
    'final_hidden' [T,H] and 'hidden_states.<k>' [T,H] for each captured k, optionally 'target_argmax' [T], and
    for fp8 storage each state's scales '<name>.scale' [T] float32}] on CPU, in order.
    Tensors are laid out so that every tensor's data stays aligned (wider elements first)."""
    lengths = [len(s["input_ids"]) for s in samples]
    offsets = torch.zeros(len(samples) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    states = [C.FINAL_HIDDEN, *map(C.hidden_state_key, indices)]
    tensors = {
        C.SAMPLE_OFFSETS: [offsets],
        C.SAMPLE_INDEX: [torch.tensor([s["sample_index"] for s in samples], dtype=torch.int64)],
    }
    state_tensors = {name: [s[name] for s in samples] for name in states}
    fp8 = bool(samples) and C.scale_key(C.FINAL_HIDDEN) in samples[0]
    if fp8:  # 4-byte scales and ids before the 1-byte states (the bf16 order would misalign them for odd N*H)
        tensors.update({C.scale_key(name): [s[C.scale_key(name)].to(torch.float32) for s in samples]
                        for name in states})
    else:
        tensors.update(state_tensors)
    tensors[C.INPUT_IDS] = [torch.as_tensor(s["input_ids"], dtype=torch.int32) for s in samples]
    if all(C.TARGET_ARGMAX in s for s in samples):
        tensors[C.TARGET_ARGMAX] = [torch.as_tensor(s[C.TARGET_ARGMAX], dtype=torch.int32) for s in samples]
    if fp8:
        tensors.update(state_tensors)
    tensors[C.LOSS_MASK] = [torch.as_tensor(s["loss_mask"], dtype=torch.uint8) for s in samples]
    path = os.path.join(out_dir, shard_name(j))
    tmp = tmp_name(path)
    meta = dict(meta, **{C.SHARD_INDEX: j})
    # One metadata key, and a header written by us in a fixed order: identical runs give identical bytes.
    sha = write_safetensors(tmp, tensors, {SHARD_METADATA_KEY: json.dumps(meta, sort_keys=True)})
    os.replace(tmp, path)
    rec = ShardRecord(file=shard_name(j), samples=len(samples), tokens=int(offsets[-1]),
                      bytes=os.path.getsize(path), sha256=sha)
    atomic_write_text(os.path.join(out_dir, sidecar_name(j)), json.dumps(asdict(rec), indent=1))
    return rec


def read_shard_metadata(path: str) -> dict:
    """The eagle3 metadata of a shard (a header read only), or ContractError naming the file."""
    from safetensors import safe_open
    try:
        with safe_open(path, "pt") as f:
            return json.loads((f.metadata() or {})[SHARD_METADATA_KEY])
    except Exception as e:  # safetensors' own errors, KeyError, JSONDecodeError: all mean "not a shard"
        raise C.ContractError(f"{path}: no readable eagle3 shard metadata ({type(e).__name__}: {e})") from e


def sidecar_record(out_dir: str, j: int) -> ShardRecord | None:
    """Shard j's sidecar (written after the shard file), or None."""
    side = os.path.join(out_dir, sidecar_name(j))
    if not os.path.isfile(side):
        return None
    with open(side) as f:
        return ShardRecord(**json.load(f))


def finished_shard(out_dir: str, j: int, expected: dict | None = None) -> ShardRecord | None:
    """The shard's record if it was completed (sidecar present and file size matches), else None. With
    `expected` (contract.shard_identity of the run resuming), a finished shard written for another dump -- other
    target, indices, tokenizer, dtype, data or plan, or by an eagle3 that recorded none of that -- is a
    ContractError: adopting it would mix two dumps, and deleting it would lose what someone else wrote."""
    rec = sidecar_record(out_dir, j)
    if rec is None:
        return None
    path = os.path.join(out_dir, rec.file)
    if not os.path.isfile(path) or os.path.getsize(path) != rec.bytes:
        return None
    if expected is not None:
        meta = read_shard_metadata(path)
        why = "refusing to mix them: use a new --out"
        if C.is_legacy_shard(meta):
            raise C.ContractError(f"{path} was written by an eagle3 that did not record a shard's identity (target, "
                                  f"tokenizer, dtype, data): a resumed run cannot check it; {why}")
        try:
            C.check_shard_identity(meta, dict(expected, **{C.SHARD_INDEX: j}), path, "this run")
        except C.ContractError as e:
            raise C.ContractError(f"{e}\n{why}") from None
    return rec
