"""Following a spool (dump/spool.py): training on a dump while it is written, in a fixed order, shard by verified shard.

The order is the spool's windows (consecutive training shards, fixed by spool.json when the dump started) and,
inside window w, the length-grouped batches of its samples shuffled with (seed, w), dealt to the data-parallel ranks
as data/loader.py deals an epoch: a pure function of spool.json, the seed and the world size, never of which shard
arrived first. So a resumed run replays it from any step, and every training sample is read once per pass.

Before a window's first batch the main rank has every shard of it verified exactly as a finished dump's are
(data/dumps.py: size, sha256, the shard's own identity and tensor names against the manifest; here also its samples
against the plan): a background thread verifies shards in order as their sidecars appear, so the hashing of window
w+1 overlaps the training of window w. A dump job that failed (its `dump_failed.job<i>.json`) stops the wait with its
error; a dump that is merely behind is waited for, up to --follow-timeout.
"""

from __future__ import annotations

import os
import threading
import time

import torch
from safetensors import safe_open

from eagle3 import contract as C
from eagle3 import dist as D
from eagle3.contract import ContractError, ShardRecord
from eagle3.data.dumps import DumpSet, SampleRef, read_shard_index
from eagle3.data.loader import length_grouped_batches
from eagle3.dump import spool as SP
from eagle3.dump.shards import shard_name, sidecar_record


class Spool:
    """A spool as its follower sees it: the manifest and plan from spool.json, `dumps` (a DumpSet reading the shards
    with the same code as any dump's), the training and held-out samples, and the windows (lists of positions into
    `train_refs`)."""

    def __init__(self, path: str, held_out_fraction: float | None = None):
        self.dir = path
        self.record = rec = SP.read_spool(path)
        self.source = os.path.join(path, SP.SPOOL_FILE)
        if held_out_fraction is not None and held_out_fraction != rec["held_out_fraction"]:
            raise ValueError(f"--held-out-fraction {held_out_fraction}: the spool {path} keeps "
                             f"{rec['held_out_fraction']} of its samples held out (its dump's --held-out-fraction); "
                             "leave the flag out or give that value")
        self.plan_hash = rec[C.PLAN_SHA256]
        self.manifest = C.DumpManifest.from_dict(dict(rec["manifest"], shards=[]), source=self.source)
        shards = rec["shards"]
        self.n_held = rec["held_out_shards"]
        # records filled in as each shard is verified; until then only what the plan says
        self.manifest.shards = [ShardRecord(file=s["file"], samples=len(s["sample_index"]), tokens=sum(s["lengths"]),
                                            bytes=0, sha256="") for s in shards]
        refs, self.shard_refs = [], []
        for j, s in enumerate(shards):
            start, mine = 0, []
            for si, n in zip(s["sample_index"], s["lengths"]):
                mine.append(len(refs))
                refs.append(SampleRef(0, j, start, n, si))
                start += n
            self.shard_refs.append(mine)
        self.dumps = DumpSet.streamed(path, self.manifest, refs)
        self.held_refs = [refs[i] for j in range(self.n_held) for i in self.shard_refs[j]]
        self.train_refs = [refs[i] for j in range(self.n_held, len(shards)) for i in self.shard_refs[j]]
        first_train = {}  # shard -> position of its first sample in train_refs
        for k, r in enumerate(self.train_refs):
            first_train.setdefault(r.shard, k)
        self.windows = [[first_train[j] + n for j in w for n in range(len(self.shard_refs[j]))]
                        for w in rec["windows"]]
        self.window_shards: list[list[int]] = rec["windows"]
        self._verified: dict[int, BaseException | None] = {}
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        # held by the checker while it reads a shard, and by follow() while a DataLoader forks its workers: a fork
        # copies every lock another thread holds at that instant (in safetensors, hashlib, a file object) into the
        # child as held forever, and a worker that then needs one hangs its rank and the whole run
        self.fork_guard = threading.Lock()

    @property
    def data_sha256(self) -> str:
        """What the data order depends on (run.json's data_sha256): the spool's plan."""
        return C.sha256_bytes(C.canonical_json(["spool", self.plan_hash]))

    def fits_without_deleting(self) -> bool:
        return sum(s["planned_bytes"] for s in self.record["shards"]) <= self.record["budget_bytes"]

    def count_tokens(self, refs: list[SampleRef]) -> torch.Tensor:
        """counts[id] at loss-masked positions of `refs`, from spool_tokens.safetensors (no shard needed)."""
        V = self.manifest.target.vocab_size
        path = os.path.join(self.dir, SP.SPOOL_TOKENS)
        with safe_open(path, "pt") as f:
            if (f.metadata() or {}).get(C.PLAN_SHA256) != self.plan_hash:
                raise ContractError(f"{path}: written for another plan than {self.source}'s")
            ids, mask = f.get_tensor(C.INPUT_IDS).long(), f.get_tensor(C.LOSS_MASK).bool()
            offsets, index = f.get_tensor(C.SAMPLE_OFFSETS).tolist(), f.get_tensor(C.SAMPLE_INDEX).tolist()
        want = {r.sample_index for r in refs}
        keep = torch.zeros_like(mask)
        for n, si in enumerate(index):
            if si in want:
                keep[offsets[n]:offsets[n + 1]] = True
        sel = ids[mask & keep]
        if sel.numel() and int(sel.max()) >= V:
            raise ContractError(f"{path}: token id {int(sel.max())} >= vocab_size {V}")
        return torch.bincount(sel, minlength=V)

    # ---- verification (main rank)
    def check_shard(self, j: int) -> ShardRecord:
        """Shard j as a finished dump's shards are checked, and its samples against the plan; the manifest's record
        of it filled in. A consumed shard (deleted by an earlier run) is an error naming it."""
        path = os.path.join(self.dir, shard_name(j))
        if SP.is_consumed(self.dir, j, self.plan_hash):
            raise ContractError(f"{path} was consumed (trained on and deleted) by an earlier run of this follower: "
                                "resume from a checkpoint at or after its window's end (checkpoints/latest)")
        rec = sidecar_record(self.dir, j)
        size = os.path.getsize(path) if os.path.isfile(path) else None
        if rec is None or size != rec.bytes:
            raise ContractError(f"{path}: {'missing' if size is None else f'{size:,} bytes'}, its sidecar records "
                                f"{'nothing' if rec is None else f'{rec.bytes:,}'} (truncated, replaced or removed)")
        if C.file_sha256(path) != rec.sha256:
            raise ContractError(f"{path}: sha256 differs from its sidecar (the shard was altered)")
        plan = self.record["shards"][j]
        offsets, index, plan_hash = read_shard_index(path, j, self.manifest, self.source)
        lengths = [b - a for a, b in zip(offsets, offsets[1:])]
        if plan_hash != self.plan_hash or index != plan["sample_index"] or lengths != plan["lengths"]:
            raise ContractError(f"{path}: holds samples {index[:4]}... of lengths {lengths[:4]}... under plan "
                                f"{plan_hash}; {self.source} plans {plan['sample_index'][:4]}... of lengths "
                                f"{plan['lengths'][:4]}... under {self.plan_hash}: not this spool's shard")
        self.manifest.shards[j] = rec
        return rec

    def _waiting_error(self, j: int) -> ContractError | None:
        for p, fail in SP.failures(self.dir):
            return ContractError(
                f"{self.dir}: waiting for {shard_name(j)}, but dump job {fail.get('job_index')} failed"
                f"{' on ' + fail['shard'] if fail.get('shard') else ''}: {fail.get('error')} ({p}). Nothing trained "
                "is lost: rerun that dump job (it resumes), then this command with --resume")
        return None

    def start_checking(self, shards: list[int], timeout: float | None) -> None:
        """Verify `shards` in order on a thread, each once its sidecar appears."""
        def run():
            for j in shards:
                t0 = time.monotonic()
                err = None
                while sidecar_record(self.dir, j) is None and not SP.is_consumed(self.dir, j):
                    err = self._waiting_error(j)
                    if err is None and timeout is not None and time.monotonic() - t0 > timeout:
                        err = ContractError(f"{self.dir}: {shard_name(j)} did not appear within --follow-timeout "
                                            f"{timeout:g} s (is its dump job running?)")
                    if err is not None:
                        break
                    time.sleep(SP.POLL_S)
                if err is None:
                    try:
                        with self.fork_guard:
                            self.check_shard(j)
                    except BaseException as e:  # noqa: BLE001 - handed to the waiting trainer
                        err = e
                with self._cond:
                    self._verified[j] = err
                    self._cond.notify_all()
                if err is not None:
                    return
        self._thread = threading.Thread(target=run, daemon=True, name="spool-check")
        self._thread.start()

    def wait_shards(self, shards: list[int], log=None) -> None:
        """Block until every shard in `shards` is verified; the first error found is raised here."""
        t0, said = time.monotonic(), 0.0
        with self._cond:
            while True:
                errs = [self._verified[j] for j in shards if j in self._verified and self._verified[j] is not None]
                if errs:
                    raise errs[0]
                late = [j for j in shards if j not in self._verified]
                if not late:
                    return
                if self._thread is None or not self._thread.is_alive():
                    stopped = [e for e in self._verified.values() if e is not None]
                    raise stopped[0] if stopped else RuntimeError("the spool checker is not running")
                if log is not None and time.monotonic() - t0 - said >= 60:
                    said = time.monotonic() - t0
                    log(f"[train] waiting for the dump: {shard_name(late[0])} ({said:.0f} s so far)")
                self._cond.wait(timeout=1.0)

    def adopt_records(self, shards: list[int]) -> None:
        """Other ranks: the records of shards the main rank verified (their sidecars)."""
        for j in shards:
            self.manifest.shards[j] = sidecar_record(self.dir, j)

    def consume(self, shards: list[int], step: int) -> None:
        """A window's shards trained on and covered by the checkpoint of `step`: record them and delete them."""
        for j in shards:
            SP.mark_consumed(self.dir, j, self.plan_hash, step)

    def check_windows(self, window_shards: list[list[int]]) -> None:
        """Joined windows (WindowPlan) must still fit the budget beside the held-out shards, or the dump and this
        run would wait for each other."""
        planned = [s["planned_bytes"] for s in self.record["shards"]]
        room = self.record["budget_bytes"] - sum(planned[:self.n_held])
        for shards in window_shards:
            if sum(planned[j] for j in shards) > room:
                raise ValueError(f"{self.dir}: shards {shards[0]}..{shards[-1]} hold too few samples for every "
                                 "data-parallel rank alone, and together more than the budget leaves: dump with a "
                                 "larger --spool-budget or --shard-size-mb")


def open_spool(path: str, held_out_fraction: float | None = None, timeout: float | None = None, log=None) -> Spool:
    """The spool in `path`, waiting for its dump to publish spool.json (a follower may start first: the dump reads
    and tokenizes all its data before it plans). A finished plain dump there, or a failed dump job, is an error at
    once; `timeout` seconds without a spool, too."""
    t0, said = time.monotonic(), False
    while not os.path.isfile(os.path.join(path, SP.SPOOL_FILE)):
        if os.path.isfile(os.path.join(path, C.MANIFEST_FILE)):
            SP.read_spool(path)  # raises: "not a spool"
        for p, fail in SP.failures(path):
            raise ContractError(f"{path}: its dump failed before it planned the spool: {fail.get('error')} ({p})")
        if timeout is not None and time.monotonic() - t0 > timeout:
            SP.read_spool(path)  # raises, naming what is missing
        if not said and log is not None:
            log(f"[train] waiting for the dump to start the spool in {path}")
            said = True
        time.sleep(SP.POLL_S)
    return Spool(path, held_out_fraction)


class WindowPlan:
    """data/loader.BatchPlan's interface over a spool: one pass, window after window (module docstring).
    `windows`: positions into `lengths` per spool window, `window_shards` their shards. A window with fewer samples
    than data-parallel ranks is joined to the next (the last to the one before): every rank needs a batch of each.
    `window_end[w]`: the global step after which window w is done on every rank; `window_shards[w]`: its shards."""

    def __init__(self, windows: list[list[int]], window_shards: list[list[int]], lengths: list[int],
                 token_budget: int, seed: int, rank: int, world_size: int):
        joined, self.window_shards, cur, cur_shards = [], [], [], []
        for pos, shards in zip(windows, window_shards):
            cur, cur_shards = cur + pos, cur_shards + shards
            if len(cur) >= world_size:
                joined.append(cur)
                self.window_shards.append(cur_shards)
                cur, cur_shards = [], []
        if cur:
            if not joined:
                raise ValueError(f"{len(cur)} training samples cannot fill {world_size} data-parallel ranks")
            joined[-1] += cur
            self.window_shards[-1] += cur_shards
        self.batches: list[list[int]] = []
        self.window_end: list[int] = []
        for w, pos in enumerate(joined):
            local = length_grouped_batches([lengths[i] for i in pos], token_budget, seed, w, world_size)
            self.batches += [[pos[k] for k in b] for b in local[rank::world_size]]
            self.window_end.append(len(self.batches))

    def epoch(self, e: int) -> list[list[int]]:
        return self.batches if e == 0 else []

    def position(self, step: int) -> tuple[int, int]:
        return 0, step

    def window_of(self, step: int) -> int:
        """The window the batch of `step` (0-based) belongs to."""
        return next(w for w, end in enumerate(self.window_end) if step < end)

    def batches_from(self, step: int, num_steps: int | None = None):
        yield from self.batches[step:None if num_steps is None else step + num_steps]


def follow(spool: Spool, plan: WindowPlan, start: int, num_steps: int, world, loader, log=None,
           timeout: float | None = None):
    """This rank's batches of steps [start, start + num_steps), window by window: before a window's first batch the
    main rank has its shards verified (the held-out shards with the first) and the other ranks take its word, so a
    rank never reads a shard that was not checked. `loader(plan, step, n)` makes the DataLoader of a stretch."""
    end = start + num_steps
    if start >= end:
        return
    first = plan.window_of(start)
    needed = list(range(spool.n_held)) + [j for w in plan.window_shards[first:] for j in w]
    if world.is_main:
        spool.start_checking(needed, timeout)
    for w in range(first, len(plan.window_end)):
        a, b = max(start, plan.window_end[w - 1] if w else 0), min(end, plan.window_end[w])
        if a >= b:
            break
        shards = (list(range(spool.n_held)) if w == first else []) + plan.window_shards[w]
        err = None
        if world.is_main:
            try:
                spool.wait_shards(shards, log)
            except BaseException as e:  # noqa: BLE001 - every rank raises it
                err = e
        said = D.broadcast_object(None if err is None else str(err) if isinstance(err, ContractError)
                                  else f"{type(err).__name__}: {err}")
        if err is not None:
            raise err
        if said is not None:
            raise ContractError(said)
        if not world.is_main:
            spool.adopt_records(shards)
        batches = loader(plan, a, b - a)
        with spool.fork_guard:  # the workers fork here, with no shard check mid-read (Spool.fork_guard)
            batches = iter(batches)
        yield from batches
