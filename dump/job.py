"""The dump job: conversations -> target forward with the capture patch -> sharded safetensors + manifest.

World = DP x TP. Ranks [d*tp, (d+1)*tp) form TP group d (transformers shards the replica over them); TP group d
dumps shards j with j % dp == d, and only its first rank writes. The shard plan depends on the data and the
arguments only (never on dp, tp or batch size), so reruns, resumed runs and runs on other world sizes produce the
same dataset.
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

from eagle3 import contract as C
from eagle3 import dist as D
from eagle3.atomic import atomic_write_text
from eagle3.batching import group_by_length
from eagle3.contract import CaptureSpec, ContractError, DumpManifest
from eagle3.dump import shards as S
from eagle3.records import data_sources
from eagle3.target import load as T
from eagle3.target.capture import ARGMAX, HiddenStateCapture, verify_full_width

MANIFEST = C.MANIFEST_FILE
DUMP_CONFIG = "dump_config.json"


@dataclass
class DumpConfig:
    target: str
    data: list[str]
    out: str
    layers: list[int] | None = None      # HF hidden_states indices; None -> contract default for the target
    tp: int = 1
    max_length: int = 2048
    batch_tokens: int = 16384            # padded tokens per forward
    num_samples: int | None = None
    dtype: str = "bf16"
    storage: str = C.STORAGE_DTYPE       # "dtype": states stored in `dtype`; "fp8": e4m3 + a float32 scale per row
    shard_size_mb: float = 1024.0
    device: str | None = None            # default: cuda if available, else cpu
    progress: bool = True
    record_argmax: bool = True           # store the target's full-vocab argmax per token (4 B/token; fast teacher)
    stop_after_shards: int | None = None  # testing aid: exit after writing this many shards (simulates a kill)
    allow_foreign_data: bool = False     # dump data that `eagle3 regenerate` wrote with another target anyway
    trust_remote_code: bool = False      # run the tokenizer code the target ships (Kimi-K2.5: tokenization_kimi.py)
    full_weights_digest: bool = False    # hash every byte of the target's weights (target/fingerprint.py)

    def __post_init__(self):
        # Checked here, not in the CLI: `python -m eagle3.dump` under torchrun and library callers get the same
        # refusals, before anything loads (else: a ZeroDivisionError for tp=0, a misleading "does not divide"
        # for tp<0, every sample "skipped" for max_length<0, the default layers for an empty --layers).
        def positive(flag, v, kind=int, optional=False):
            if optional and v is None:
                return
            if not isinstance(v, kind) or isinstance(v, bool) or not v > 0:
                raise ValueError(f"{flag} {v!r}: must be a positive {'integer' if kind is int else 'number'}")
        positive("--tp", self.tp)
        positive("--max-length", self.max_length, optional=True)
        positive("--batch-tokens", self.batch_tokens)
        positive("--num-samples", self.num_samples, optional=True)
        positive("--shard-size-mb", self.shard_size_mb, kind=(int, float))
        positive("--stop-after-shards", self.stop_after_shards, optional=True)
        if self.layers is not None and not self.layers:
            raise ContractError("--layers names no index (leave it out for the default capture set)")
        if self.dtype not in T.DTYPES:
            raise ValueError(f"--dtype {self.dtype!r}: choose one of {sorted(T.DTYPES)}")
        if self.storage not in C.STORAGES:
            raise ValueError(f"--storage {self.storage!r}: choose one of {list(C.STORAGES)}")
        if isinstance(self.data, (str, os.PathLike)) or not self.data:
            raise ValueError(f"--data: expected a list of data files, got {self.data!r}")
        self.data = [os.fspath(p) for p in self.data]  # recorded in dump_config.json


def plan_shards(lengths: list[int], bytes_per_token: int, shard_bytes: int) -> list[list[int]]:
    """Consecutive samples, each shard under shard_bytes (a single larger sample gets its own shard)."""
    shards, cur, cur_bytes = [], [], 0
    for i, n in enumerate(lengths):
        b = n * bytes_per_token
        if cur and cur_bytes + b > shard_bytes:
            shards.append(cur)
            cur, cur_bytes = [], 0
        cur.append(i)
        cur_bytes += b
    if cur:
        shards.append(cur)
    return shards


def _scale(k) -> str:
    """Where _quantize_states keeps the scales of captured state k (an HF index, or 'final')."""
    return f"scale:{k}"


def _quantize_states(states: dict, indices: list[int]) -> dict:
    """fp8 storage: each captured [B, T, H] state -> e4m3 and its [B, T] float32 scales (quantized from the
    states as captured, in the model's dtype), one state at a time to bound the float32 temporaries."""
    out = dict(states)
    for k in [*indices, "final"]:
        out[k], out[_scale(k)] = S.quantize_fp8(states[k])
    return out


def pad_batch(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right padding: with a causal mask the real tokens never see the pads, so captured values don't change."""
    n = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), n), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), n), dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, : len(s)] = torch.as_tensor(s)
        mask[b, : len(s)] = 1
    return ids, mask


class _Writer:
    """Writes finished shards on a background thread so the next shard's forwards overlap the disk. A shard's
    host tensors may still be arriving from the GPU (async copies): the thread waits for their events first."""

    def __init__(self, out: str, indices: list[int], meta: dict, device: torch.device, threads: int = 3):
        # Several shards in flight: one shard's sha256 runs at roughly the disk's rate, so one writer alone
        # would leave the disk idle part of the time; shards are independent files. Host memory held: the shards
        # being written, one queued and the one being collected.
        self.out, self.indices, self.meta, self.device = out, indices, meta, device
        self.q: queue.Queue = queue.Queue(maxsize=1)
        self.error: BaseException | None = None
        self.threads = [threading.Thread(target=self._loop, daemon=True) for _ in range(threads)]
        for t in self.threads:
            t.start()

    def _loop(self):
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # a new thread starts on GPU 0: don't make a context there
        while (item := self.q.get()) is not None:
            if self.error is None:
                try:
                    for ev in item[2]:
                        ev.synchronize()
                    S.write_shard(self.out, item[0], item[1], self.indices, self.meta)
                except BaseException as e:  # surfaced on the main thread by put()/close()
                    self.error = e

    def put(self, j: int, samples: list[dict], events=()):
        self._raise()
        self.q.put((j, samples, list(events)))

    def close(self):
        for _ in self.threads:
            self.q.put(None)
        for t in self.threads:
            t.join()
        self._raise()

    def _raise(self):
        if self.error is not None:
            raise RuntimeError(f"writing a shard failed: {self.error}") from self.error


class _ToHost:
    """Device -> host copies that overlap the next forward: on CUDA, into pinned memory (torch's caching host
    allocator reuses it) on a side stream, with an event the writer waits on; on the CPU, nothing to do."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None

    def __call__(self, states: dict) -> tuple[dict, object]:
        if not self.cuda:
            return {k: v.to("cpu") for k, v in states.items()}, None
        self.stream.wait_stream(torch.cuda.current_stream())
        host = {}
        with torch.cuda.stream(self.stream):
            for k, v in states.items():
                host[k] = torch.empty(v.shape, dtype=v.dtype, pin_memory=True)
                host[k].copy_(v, non_blocking=True)
                v.record_stream(self.stream)  # the forward's allocator must not reuse v before the copy ran
            ev = torch.cuda.Event()
            ev.record(self.stream)
        return host, ev


def _prepare_out_dir(out: str, manifest: DumpManifest, plan_hash: str, shard_meta: dict, n_shards: int,
                     cfg: DumpConfig, log) -> tuple[str | None, set[int]]:
    """Rank 0: make OUT and refuse a different dump already there -- by its dump_config.json and by every finished
    shard's own metadata (either may be missing or stale) -- before writing anything; then remove what a killed
    run left. Returns (error message or None, the finished shards)."""
    try:
        os.makedirs(out, exist_ok=True)
        probe = os.path.join(out, f".write-probe-{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        return f"--out {out} is not writable: {e}", set()
    identity, data = manifest.identity(), manifest.data_fingerprint
    path = os.path.join(out, DUMP_CONFIG)
    record = {"identity": identity, "plan_sha256": plan_hash, "data": data,
              "args": {"data": cfg.data, "max_length": cfg.max_length, "num_samples": cfg.num_samples,
                       "dtype": cfg.dtype, "storage": cfg.storage, "shard_size_mb": cfg.shard_size_mb,
                       "trust_remote_code": cfg.trust_remote_code}}
    old = None
    if os.path.isfile(path):
        with open(path) as f:
            old = json.load(f)
        try:
            C.require_same_capture(old["identity"], identity, f"the dump already in {out}", "this run")
        except ContractError as e:
            return f"{e}\nrefusing to mix them: use a new --out", set()
        if "data" not in old:
            return (f"{path} was written by an eagle3 that did not fingerprint the data: a resumed run cannot tell "
                    "whether the data changed; use a new --out"), set()
        was = [r["sha256"] for r in old["data"]["files"]]
        if was != [r["sha256"] for r in data["files"]]:
            changed = [r["file"] for k, r in enumerate(data["files"]) if k >= len(was) or was[k] != r["sha256"]]
            return (f"the data changed since the dump in {out} started: {changed or cfg.data} no longer hold the "
                    "bytes it read; resuming would mix old and new samples: use a new --out"), set()
        if old.get("plan_sha256") != plan_hash:
            return (f"{out} holds a dump of different data or arguments ({old.get('args')}); "
                    f"resuming needs the same --data/--max-length/--num-samples/--dtype/--storage/--shard-size-mb "
                    "(and --no-record-argmax for a dump started without target_argmax), or use a new --out"), set()
    try:
        finished = {j for j in range(n_shards) if S.finished_shard(out, j, shard_meta)}
    except ContractError as e:
        return str(e), set()
    if old is None:
        atomic_write_text(path, json.dumps(record, indent=1))
    stale = S.remove_stale_tmp(out)  # no writer of this dump runs yet: the other ranks wait for this answer
    if stale:
        log(f"[dump] removed {len(stale)} temporary files a killed run left in {out}: {stale[:4]}"
            f"{' ...' if len(stale) > 4 else ''}")
    return None, finished


def run_dump(cfg: DumpConfig) -> DumpManifest:
    from eagle3.dump.conversations import check_distinct_data, data_sha256, load_samples

    # Everything that can be refused is refused before the model loads (the arguments: DumpConfig itself).
    dtype = T.DTYPES[cfg.dtype]
    info = T.target_info(cfg.target, full_weights=cfg.full_weights_digest)
    check_distinct_data(cfg.data)
    indices = C.validate_indices(cfg.layers if cfg.layers is not None
                                 else C.default_capture_indices(info.num_hidden_layers), info.num_hidden_layers)
    T.check_tp_divisibility(T.read_config(cfg.target), cfg.tp, f"{cfg.target}/config.json")
    world = D.init_world(cfg.device)
    if world.world_size % cfg.tp:
        raise ValueError(f"--tp {cfg.tp} does not divide the world size {world.world_size}")
    tp, dp = cfg.tp, world.world_size // cfg.tp
    dp_rank, tp_rank = world.rank // tp, world.rank % tp
    writer_rank = tp_rank == 0
    log = D.main_log(world.is_main)
    tokenizer = T.load_tokenizer(cfg.target, trust_remote_code=cfg.trust_remote_code)
    tok_info = T.tokenizer_info(tokenizer, T.remote_code_tokenizer(cfg.target) if cfg.trust_remote_code else None)
    manifest = DumpManifest(target=info, capture=CaptureSpec(hidden_state_indices=indices), tokenizer=tok_info,
                            dtype=str(dtype).removeprefix("torch."), storage=cfg.storage,
                            max_length=cfg.max_length, tp_size=tp,
                            dp_size=dp, data_files=[os.path.abspath(p) for p in cfg.data],
                            # regenerated data must come from this target (ContractError otherwise); a record
                            # whose weights were digested by the other method is compared with ours taken likewise
                            data_sources=data_sources(cfg.data, info, tok_info, cfg.allow_foreign_data,
                                                      lambda like: T.target_info(info.path, like=like).weights_sha256))
    log(f"[dump] target {info.architecture} L={info.num_hidden_layers} H={info.hidden_size}; capturing "
        f"{C.describe(indices)} + post-norm final state; world {world.world_size} = dp {dp} x tp {tp}")

    file_starts: list[int] = []
    max_positions = T.text_config_dict(T.read_config(cfg.target)).get("max_position_embeddings")
    samples, skipped = load_samples(cfg.data, tokenizer, max_length=cfg.max_length, num_samples=cfg.num_samples,
                                    progress=cfg.progress and world.is_main, file_starts=file_starts,
                                    max_positions=max_positions if isinstance(max_positions, int) else None)
    # The data's bytes: a resumed run compares content, not only the lengths the plan hash covers (an edit in
    # place keeps them); and across dumps, (file sha256, record) names a sample (data.dumps refuses repeats).
    manifest.data_fingerprint = C.data_fingerprint(
        [(f, data_sha256(f), file_starts[i] if i < len(file_starts) else None)  # a file or a dataset dir
         for i, f in enumerate(manifest.data_files)])
    manifest.skipped = dict(sorted(skipped.items()))
    if not samples:
        raise ValueError(f"no usable conversations in {cfg.data} (skipped: {dict(skipped)})")
    if info.vocab_size >= 2**31:
        raise ValueError("vocab does not fit the int32 input_ids of shard format v1")
    bytes_per_token = C.bytes_per_token(len(indices) + 1, info.hidden_size, dtype.itemsize, cfg.storage,
                                        cfg.record_argmax)
    lengths = [len(s.input_ids) for s in samples]
    plan = plan_shards(lengths, bytes_per_token, int(cfg.shard_size_mb * 2**20))
    plan_hash = C.sha256_bytes(C.canonical_json(
        [[samples[i].sample_index for i in sh] for sh in plan] + [lengths, cfg.dtype]
        + ([C.TARGET_ARGMAX] if cfg.record_argmax else [])  # without it: the same hash as dumps made before it
        + ([cfg.storage] if cfg.storage != C.STORAGE_DTYPE else [])))  # likewise

    shard_meta = C.shard_identity(manifest, plan_hash)
    err, finished = D.broadcast_object(_prepare_out_dir(cfg.out, manifest, plan_hash, shard_meta, len(plan), cfg, log)
                                       if world.is_main else None)
    if err:
        raise ContractError(err)
    mine = [j for j in range(len(plan)) if j % dp == dp_rank]
    todo = [j for j in mine if j not in finished]
    log(f"[dump] {len(samples)} samples, {sum(lengths)} tokens in {len(plan)} shards; "
        f"{len(finished)} already finished in {cfg.out}")

    if todo:
        model = T.load_target(cfg.target, dtype, world.device, tp_size=tp, dp_size=dp)
        backbone = T.find_backbone(model, info.num_hidden_layers)
        device = next(backbone.module.parameters()).device
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        head = model.get_output_embeddings() if cfg.record_argmax else None
        to_host = _ToHost(device)
        with HiddenStateCapture(backbone, indices, head=head) as cap:
            probe = torch.as_tensor([samples[0].input_ids[:8]], device=device)
            verify_full_width(cap.run(probe, torch.ones_like(probe)), info.hidden_size, tuple(probe.shape))
            writer = _Writer(cfg.out, indices, shard_meta, device) if writer_rank else None
            bar = tqdm(total=sum(lengths[i] for j in mine for i in plan[j]), unit="tok", unit_scale=True,
                       desc=f"dump dp{dp_rank}", disable=not (cfg.progress and world.is_main), dynamic_ncols=True)
            bar.update(sum(lengths[i] for j in mine if j in finished for i in plan[j]))
            t0, done_tokens = time.perf_counter(), 0
            for n_written, j in enumerate(todo):
                if cfg.stop_after_shards is not None and n_written >= cfg.stop_after_shards:
                    break
                collected, events = [], []
                for batch in group_by_length(plan[j], lengths, cfg.batch_tokens):
                    ids, mask = pad_batch([samples[i].input_ids for i in batch], pad_id)
                    states = cap.run(ids.to(device), mask.to(device))
                    if cfg.storage == C.STORAGE_FP8:
                        states = _quantize_states(states, indices)  # on the device: a quarter of the bytes to copy
                    if writer_rank:
                        host, ev = to_host(states)  # async on CUDA: the next forward starts at once
                        events += [ev] if ev is not None else []
                        for b, i in enumerate(batch):
                            n = lengths[i]
                            rec = {k: host[k][b, :n] for k in indices}
                            if cfg.storage == C.STORAGE_FP8:
                                rec["scales"] = {k: host[_scale(k)][b, :n] for k in [*indices, "final"]}
                            rec.update(final=host["final"][b, :n], sample_index=samples[i].sample_index,
                                       input_ids=samples[i].input_ids, loss_mask=samples[i].loss_mask)
                            if ARGMAX in host:
                                rec[C.TARGET_ARGMAX] = host[ARGMAX][b, :n]
                            collected.append(rec)
                    del states
                    done_tokens += sum(lengths[i] for i in batch)
                    bar.update(sum(lengths[i] for i in batch))
                    bar.set_postfix(tok_s=f"{done_tokens / (time.perf_counter() - t0):,.0f}")
                if writer_rank:
                    collected.sort(key=lambda r: r["sample_index"])
                    writer.put(j, collected, events)
            if writer:
                writer.close()
            bar.close()
        if cfg.stop_after_shards is not None and len(todo) > cfg.stop_after_shards:
            D.barrier()
            raise SystemExit(f"stopped after {cfg.stop_after_shards} shards (--stop-after-shards)")

    D.barrier()
    if world.is_main:
        records = [S.finished_shard(cfg.out, j, shard_meta) for j in range(len(plan))]
        missing = [S.shard_name(j) for j, r in enumerate(records) if r is None]
        if missing:
            raise RuntimeError(f"{cfg.out}: shards {missing} were not written")
        manifest.shards = records
        atomic_write_text(os.path.join(cfg.out, MANIFEST), json.dumps(manifest.to_dict(), indent=1))
        tot = manifest.totals
        log(f"[dump] done: {tot['samples']} samples, {tot['tokens']} tokens, {tot['bytes'] / 2**20:,.1f} MiB in "
            f"{tot['shards']} shards ({bytes_per_token} B/token) -> {cfg.out}/{MANIFEST}; "
            f"skipped {tot['skipped']}: {manifest.skipped or 'none'}")
    D.barrier()
    return manifest
