"""The spool: a dump written on a byte budget while a trainer (`eagle3 train --follow`, data/stream.py) consumes it.

What a spool adds to a dump directory (docs/usage.md, "Streaming"):

- `spool.json`, written before any shard: the manifest less its shard records, the shard plan (every shard's
  samples and tokens), which shards hold the held-out samples, the windows the follower trains in, and the budget.
  The follower's batch order is a function of this file and its seed alone, never of which shard arrived first.
- `spool_tokens.safetensors`: every planned sample's input_ids and loss mask (5 bytes a token against ~28.7 KB of
  states at the Kimi shape), so that the draft vocabulary is counted before the first shard exists.
- The held-out samples (by sample_index, eagle3.heldout) in shards of their own at the front: a fixed set
  that stays on disk for every evaluation. The training samples follow, in the order of the data.
- `shard-XXXXX.consumed`: the follower's record that a training shard was trained on and covered by a saved
  checkpoint, written before it deletes the shard file (the sidecar stays). A rerun dump counts the shard finished.

The budget rule: shard j is computed only when the held-out shards plus every training shard from the first one not
consumed up to j (written or not: another writer may still owe it) fit the budget, in planned bytes (the contract's
bytes per token plus a header allowance). So the files on disk never exceed the budget, whatever the number of
writers, and no writer can fill the budget with shards the trainer does not need yet. Windows are at most half of
what the budget leaves after the held-out shards, so the dump writes window w+1 while the trainer trains window w.
"""

from __future__ import annotations

import glob
import json
import os
import re
import threading
import time
from contextlib import contextmanager

import torch

from eagle3 import contract as C
from eagle3.atomic import atomic_write_text, tmp_name
from eagle3.dump.shards import shard_name, write_safetensors

SPOOL_FILE = "spool.json"
SPOOL_TOKENS = "spool_tokens.safetensors"
SPOOL_VERSION = 1
# a shard file's bytes beyond its states: the safetensors header (its metadata records the identity, ~2 KB) and
# the per-sample offsets and indices (16 B a sample); planned generously, so the real files stay under the plan
HEADER_ALLOWANCE = 64 * 1024
# how often a waiting writer or follower looks at the directory again (seconds)
POLL_S = float(os.environ.get("EAGLE3_SPOOL_POLL_S", "1.0"))
_UNITS = {"": 1, "B": 1, "K": 2**10, "KB": 10**3, "KIB": 2**10, "M": 2**20, "MB": 10**6, "MIB": 2**20,
          "G": 2**30, "GB": 10**9, "GIB": 2**30, "T": 2**40, "TB": 10**12, "TIB": 2**40}


def parse_size(text: str) -> int:
    """'2TB' -> 2e12 bytes; '512MiB' -> 512 * 2**20; a plain number is bytes. SI and binary units both."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"{text!r} is not a size (e.g. 2TB, 500GB, 64MiB)")
    n = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if n <= 0:
        raise ValueError(f"{text!r}: a size must be positive")
    return n


def consumed_name(j: int) -> str:
    return f"shard-{j:05d}.consumed"


def failed_name(job: int) -> str:
    return f"dump_failed.job{job}.json"


def failures(out: str) -> list[tuple[str, dict]]:
    """The failure records dump jobs left in `out` (failure_recorded), as (path, record); unreadable ones skipped
    (a record is written atomically: one being replaced is read next time)."""
    found = []
    for p in sorted(glob.glob(os.path.join(out, "dump_failed.job*.json"))):
        try:
            with open(p) as f:
                found.append((p, json.load(f)))
        except (OSError, ValueError):
            continue
    return found


def plan_spool(positions_held: list[int], positions_train: list[int], lengths: list[int], bytes_per_token: int,
               shard_bytes: int, plan_shards) -> tuple[list[list[int]], int]:
    """The spool's shard plan: the held-out samples' shards first, then the training samples' (each group in data
    order, packed by `plan_shards`). Returns (plan as positions into `lengths`, number of held-out shards)."""
    def packed(pos):
        return [[pos[k] for k in shard] for shard in plan_shards([lengths[i] for i in pos], bytes_per_token,
                                                                 shard_bytes)] if pos else []
    held = packed(positions_held)
    return held + packed(positions_train), len(held)


def planned_bytes(tokens: int, samples: int, bytes_per_token: int) -> int:
    return tokens * bytes_per_token + 16 * (samples + 1) + HEADER_ALLOWANCE


def make_windows(planned: list[int], n_held: int, budget: int) -> list[list[int]]:
    """Consecutive training shards, each window's planned bytes at most half of what the budget leaves after the
    held-out shards (a single larger shard is a window of its own)."""
    permanent = sum(planned[:n_held])
    train = list(range(n_held, len(planned)))
    room = budget - permanent
    biggest = max((planned[j] for j in train), default=0)
    if room < biggest:
        raise ValueError(f"--spool-budget {budget:,} B cannot hold the held-out shards ({permanent:,} B, kept on "
                         f"disk for evaluation) plus the largest training shard ({biggest:,} B): raise the budget "
                         "or lower --shard-size-mb")
    window_bytes = max(room // 2, 1)
    windows, cur, cur_bytes = [], [], 0
    for j in train:
        if cur and cur_bytes + planned[j] > window_bytes:
            windows.append(cur)
            cur, cur_bytes = [], 0
        cur.append(j)
        cur_bytes += planned[j]
    if cur:
        windows.append(cur)
    return windows


def spool_record(manifest: C.DumpManifest, plan_hash: str, plan: list[list[int]], sample_index: list[int],
                 lengths: list[int], n_held: int, bytes_per_token: int, budget: int, held_out_fraction: float,
                 split_seed: int) -> dict:
    shards = [{"file": shard_name(j), "sample_index": [sample_index[i] for i in sh],
               "lengths": [lengths[i] for i in sh], "held_out": j < n_held,
               "planned_bytes": planned_bytes(sum(lengths[i] for i in sh), len(sh), bytes_per_token)}
              for j, sh in enumerate(plan)]
    windows = make_windows([s["planned_bytes"] for s in shards], n_held, budget)
    m = manifest.to_dict()
    m.pop("totals")
    return {"spool_version": SPOOL_VERSION, C.PLAN_SHA256: plan_hash, "budget_bytes": budget,
            "held_out_fraction": held_out_fraction, "split_seed": split_seed, "bytes_per_token": bytes_per_token,
            "held_out_shards": n_held, "windows": windows, "shards": shards, "manifest": m}


def write_spool(out: str, record: dict, samples, write: bool = True) -> None:
    """spool.json and spool_tokens.safetensors, unless a resumed run finds the same ones there (an existing spool of
    another plan or budget is refused: the follower's batch order is made from it). `write=False` (the jobs other
    than job 0 of several, which may run on other hosts: temporary names are per process id) only checks."""
    path = os.path.join(out, SPOOL_FILE)
    if os.path.isfile(path):
        with open(path) as f:
            old = json.load(f)
        for key in (C.PLAN_SHA256, "budget_bytes", "windows", "held_out_fraction", "split_seed"):
            if old.get(key) != record[key]:
                raise C.ContractError(f"{path} was started with {key} {old.get(key)!r}, this run has "
                                      f"{record[key]!r}: a follower's batch order is made from it; rerun with the "
                                      "first run's --spool-budget / --held-out-fraction, or use a new --out")
        if os.path.isfile(os.path.join(out, SPOOL_TOKENS)):
            return
    if not write:
        return
    order = [s for sh in record["shards"] for s in sh["sample_index"]]
    by_index = {s.sample_index: s for s in samples}
    ids = [torch.as_tensor(by_index[i].input_ids, dtype=torch.int32) for i in order]
    mask = [torch.as_tensor(by_index[i].loss_mask, dtype=torch.uint8) for i in order]
    offsets = torch.zeros(len(order) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor([len(x) for x in ids], dtype=torch.int64).cumsum(0)
    tmp = tmp_name(os.path.join(out, SPOOL_TOKENS))
    write_safetensors(tmp, {C.SAMPLE_OFFSETS: [offsets], C.SAMPLE_INDEX: [torch.tensor(order, dtype=torch.int64)],
                            C.INPUT_IDS: ids, C.LOSS_MASK: mask}, {C.PLAN_SHA256: record[C.PLAN_SHA256]})
    os.replace(tmp, os.path.join(out, SPOOL_TOKENS))
    atomic_write_text(path, json.dumps(record))


def read_spool(out: str) -> dict:
    path = os.path.join(out, SPOOL_FILE)
    if not os.path.isfile(path):
        raise C.ContractError(f"{out}: no {SPOOL_FILE}: not a spool (a dump started with --spool-budget), or its "
                              "dump has not started yet")
    with open(path) as f:
        rec = json.load(f)
    if rec.get("spool_version") != SPOOL_VERSION:
        raise C.ContractError(f"{path}: spool version {rec.get('spool_version')!r}, this eagle3 reads {SPOOL_VERSION}")
    return rec


def is_consumed(out: str, j: int, plan_hash: str | None = None) -> bool:
    """The follower recorded shard j as trained on (and covered by a checkpoint); with plan_hash, a record written
    for another dump's plan is a ContractError (it would make a resumed dump skip a shard nobody trained on)."""
    path = os.path.join(out, consumed_name(j))
    if not os.path.isfile(path):
        return False
    if plan_hash is not None:
        with open(path) as f:
            got = json.load(f).get(C.PLAN_SHA256)
        if got != plan_hash:
            raise C.ContractError(f"{path}: a consumed record of another dump (plan {got}, this one {plan_hash}): "
                                  "refusing to mix them: use a new --out")
    return True


def mark_consumed(out: str, j: int, plan_hash: str, step: int) -> None:
    """Record shard j consumed, then delete its file (its sidecar stays: the manifest lists every shard)."""
    atomic_write_text(os.path.join(out, consumed_name(j)), json.dumps({C.PLAN_SHA256: plan_hash, "step": step}))
    try:
        os.remove(os.path.join(out, shard_name(j)))
    except FileNotFoundError:
        pass


class Gate:
    """A writer's wait for room: shard j only once the budget rule (module docstring) allows it. The rule only
    ever loosens (consumed shards stay consumed), so the ranks of one TP group, each asking on its own, agree."""

    def __init__(self, out: str, record: dict, log):
        self.out, self.log = out, log
        self.budget = record["budget_bytes"]
        self.n_held = record["held_out_shards"]
        self.planned = [s["planned_bytes"] for s in record["shards"]]
        self.permanent = sum(self.planned[:self.n_held])
        self.frontier = self.n_held  # first training shard not consumed (only grows)

    def room_for(self, j: int) -> bool:
        if j < self.n_held:
            return True  # the held-out shards come first and stay
        while self.frontier < len(self.planned) and is_consumed(self.out, self.frontier):
            self.frontier += 1
        return self.permanent + sum(self.planned[self.frontier:j + 1]) <= self.budget

    def wait(self, j: int, check=None) -> None:
        """Until shard j has room; `check()` (raising the writer's error, if any) is called while waiting."""
        t0, said = time.monotonic(), 0.0
        while not self.room_for(j):
            if check is not None:
                check()
            if time.monotonic() - t0 - said >= 60:
                said = time.monotonic() - t0
                self.log(f"[dump] spool full: {shard_name(j)} waits for the trainer to consume "
                         f"{shard_name(self.frontier)} ({said:.0f} s so far; budget {self.budget:,} B)")
            time.sleep(POLL_S)


class _Failure:
    shard: int | None = None


@contextmanager
def failure_recorded(out: str, job: int, on: bool):
    """Around a dump job's writing: an exception leaves `dump_failed.job<i>.json` (the error, the shard it was
    on) for a follower, which stops naming it instead of waiting for shards that will not come. A rerun of the
    job removes it (dump/job.py). A kill leaves nothing: the follower waits for the rerun."""
    where = _Failure()
    try:
        yield where
    except Exception as e:
        if on:
            shard = getattr(e, "shard", where.shard)  # a writer's error names the shard it was writing
            atomic_write_text(os.path.join(out, failed_name(job)), json.dumps(
                {"job_index": job, "shard": None if shard is None else shard_name(shard),
                 "error": f"{type(e).__name__}: {e}"[:2000], "time": time.time()}))
        raise


class HighWater(threading.Thread):
    """The most bytes of shard files (temporary ones included) seen in `out` at once, sampled every `every` s until
    `.stop()`: what the budget bounds (tests/test_stream.py, bench/streaming_example.py)."""

    def __init__(self, out: str, every: float = 0.01):
        super().__init__(daemon=True)
        self.out, self.every, self.high, self._done = str(out), every, 0, threading.Event()
        self.start()

    def run(self):
        while not self._done.is_set():
            n = 0
            for f in glob.glob(os.path.join(self.out, "shard-*.safetensors*")):
                try:
                    n += os.path.getsize(f)
                except OSError:  # deleted between the listing and the stat
                    pass
            self.high = max(self.high, n)
            self._done.wait(self.every)

    def stop(self) -> int:
        self._done.set()
        self.join()
        return self.high
