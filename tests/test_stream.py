"""Streaming (issue 34): a dump written as a spool on a byte budget while `eagle3 train --follow --delete-consumed`
trains on it -- real dump jobs and a real 2-process DeepSpeed trainer, killed with SIGKILL at chosen points."""

import glob
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

import pytest
import torch
from safetensors.torch import load_file

from eagle3 import contract as C
from eagle3.data.loader import length_grouped_batches
from eagle3.data.stream import Spool, WindowPlan
from eagle3.dump import spool as SP

BUDGET = "1.5MiB"
FRACTION = 0.15
POLL = "0.05"


def _env():
    # PYTHONFAULTHANDLER: a run that outlives its timeout is sent SIGABRT (finish), which prints every thread's stack
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled", EAGLE3_SPOOL_POLL_S=POLL,
               PYTHONFAULTHANDLER="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def _port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_dump(target, data, out, job=0, jobs=1, budget=BUDGET, nproc=1):
    launch = [sys.executable, "-m", "eagle3.dump"] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--standalone", "-m",
        "eagle3.dump"]
    cmd = [*launch, "--target", target, "--data", data, "--out", str(out), "--dtype",
           "fp32", "--shard-size-mb", "0.05", "--spool-budget", budget, "--held-out-fraction", str(FRACTION),
           "--num-jobs", str(jobs), "--job-index", str(job), "--no-progress"]
    return _start(cmd, f"dump{job}")


def _start(cmd, name):
    """`cmd` in a session of its own, its output into a file. Not a pipe: a pipe nobody reads blocks its writer
    after 64 KiB, and a test waits on one process while the others run. (The trainer writes ~4.5 KB here, so that
    is not what stalled the CI of 1d479dc; what did is not established, and a timeout now prints every stack.)"""
    fd, log = tempfile.mkstemp(prefix=f"{name}-", suffix=".log")
    with os.fdopen(fd, "w") as f:
        p = subprocess.Popen(cmd, env=_env(), stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    p.log = log
    _STARTED.append(p)
    return p


_STARTED: list = []  # every process a test started: on a timeout all of them print their stacks


def start_train(target, spool, run, *extra):
    cmd = ["deepspeed", "--num_gpus", "2", "--master_port", str(_port()), "--module", "eagle3.train",
           "--dump", str(spool), "--target", target, "--out", str(run), "--drafter", "tiny", "--no-bf16",
           "--token-budget", "256", "--lr", "3e-3", "--warmup-steps", "2", "--held-out-fraction", str(FRACTION),
           "--eval-interval", "1000", "--eval-batches", "1", "--num-workers", "1", "--no-progress",
           "--log-interval", "1", "--save-interval", "1000", "--follow", "--delete-consumed", *map(str, extra)]
    return _start(cmd, "train")


def _output(p):
    with open(p.log, errors="replace") as f:
        return f.read()


def finish(p, what, timeout=420):
    try:
        p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:  # every live process of the test prints its threads' stacks (PYTHONFAULTHANDLER)
        live = [q for q in _STARTED if q.poll() is None]
        for q in live:
            os.killpg(q.pid, signal.SIGABRT)
        for q in live:
            q.wait(timeout=60)
        raise AssertionError(f"{what} still running after {timeout} s; the stacks of every process left:\n"
                             + "\n".join(f"==== {q.args[:6]}\n{_output(q)[-12000:]}" for q in live)) from None
    out = _output(p)
    assert p.returncode == 0, f"{what} failed:\n{out[-5000:]}"
    os.remove(p.log)
    return out


def kill9(p):
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()


def wait_for(cond, what, timeout=300):
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, f"timed out waiting for {what}"
        time.sleep(0.05)


def final_weights(run):
    ck = os.path.join(run, "checkpoints")
    tag = open(os.path.join(ck, "latest")).read().strip()  # DeepSpeed's pointer file
    return load_file(os.path.join(ck, tag, "drafter.safetensors"))


def sidecars(spool):
    return {os.path.basename(p): json.load(open(p)) for p in sorted(glob.glob(os.path.join(spool, "shard-*.json")))}


@pytest.fixture(scope="module")
def data40(tmp_path_factory):
    from tiny import write_conversations
    return write_conversations(tmp_path_factory.mktemp("stream_data") / "chats.jsonl", n=40)


@pytest.fixture(scope="module")
def streamed(tiny_targets, data40, tmp_path_factory):
    """The uninterrupted streamed run: one dump job and the follower at once."""
    root = tmp_path_factory.mktemp("streamed")
    spool, run = root / "spool", root / "run"
    dump = start_dump(tiny_targets["llama"], data40, spool)
    wait_for(lambda: os.path.exists(spool / SP.SPOOL_FILE), "spool.json")
    hw = SP.HighWater(spool)
    train = start_train(tiny_targets["llama"], spool, run)
    finish(dump, "dump")
    log = finish(train, "train")
    hw.stop()
    return {"spool": str(spool), "run": str(run), "high": hw.high, "log": log}


@pytest.mark.slow
def test_follower_trains_every_sample_once_within_the_budget(streamed):
    spool = Spool(streamed["spool"])
    rec = spool.record
    assert len(rec["windows"]) >= 3 and rec["held_out_shards"] >= 1  # the test exercises several windows
    # the budget: files on disk never passed it (one writer here), and the dump did have to wait for the trainer
    assert streamed["high"] <= rec["budget_bytes"]
    total = sum(s["planned_bytes"] for s in rec["shards"])
    assert total > rec["budget_bytes"]
    # every training shard was consumed and deleted; the held-out shards stay
    for j in range(len(rec["shards"])):
        held = j < rec["held_out_shards"]
        assert os.path.exists(os.path.join(spool.dir, f"shard-{j:05d}.safetensors")) == held
        assert SP.is_consumed(spool.dir, j, spool.plan_hash) != held
    # exactly once: the tokens the two ranks trained on are the training samples' tokens
    rows = [json.loads(line) for line in open(os.path.join(streamed["run"], "metrics.jsonl"))]
    trained = sum(r["tokens"] for r in rows if r.get("split", "train") == "train")
    assert trained == sum(r.length for r in spool.train_refs)
    # the dump's manifest lists every shard, consumed ones included
    m = C.load_manifest(spool.dir)
    assert len(m.shards) == len(rec["shards"])


@pytest.mark.slow
def test_kill9_of_dump_and_trainer_gives_the_same_drafter(streamed, tiny_targets, data40, tmp_path):
    """SIGKILL the dump mid-way and the trainer after its first window's checkpoint, rerun both: the shards and the
    final drafter are bit-identical to the uninterrupted run's."""
    target = tiny_targets["llama"]
    spool, run = tmp_path / "spool", tmp_path / "run"
    dump = start_dump(target, data40, spool)
    wait_for(lambda: len(glob.glob(str(spool / "shard-*.json"))) >= 6, "six shards")
    kill9(dump)
    assert not os.path.exists(spool / C.MANIFEST_FILE)
    train = start_train(target, spool, run)
    dump = start_dump(target, data40, spool)  # the rerun resumes; the trainer waited meanwhile
    # the save writes `latest` last (train/checkpoint.save_checkpoint): until then a resume would not take it
    wait_for(lambda: os.path.exists(run / "checkpoints" / "latest"), "a checkpoint")
    kill9(train)
    killed_at = open(run / "checkpoints" / "latest").read().strip()
    assert killed_at < open(os.path.join(streamed["run"], "checkpoints", "latest")).read().strip()  # mid-run
    assert dump.poll() is None or dump.returncode == 0
    train = start_train(target, spool, run, "--resume")
    finish(dump, "dump rerun")
    finish(train, "train rerun")
    a, b = final_weights(streamed["run"]), final_weights(str(run))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert sidecars(str(spool)) == sidecars(streamed["spool"])


@pytest.mark.slow
@pytest.mark.parametrize("writers", ["two jobs", "one world of two data-parallel ranks"])
def test_two_writers_into_one_spool(streamed, tiny_targets, data40, tmp_path, writers):
    """Two dump jobs (--num-jobs 2), or one torchrun world of two DP ranks, write one spool while the follower
    trains: within the budget, the same shards and the same drafter as one writer."""
    target = tiny_targets["llama"]
    spool, run = tmp_path / "spool", tmp_path / "run"
    jobs = ([start_dump(target, data40, spool, job=i, jobs=2) for i in range(2)] if writers == "two jobs"
            else [start_dump(target, data40, spool, nproc=2)])
    wait_for(lambda: os.path.exists(spool / SP.SPOOL_FILE), "spool.json")
    hw = SP.HighWater(spool)
    train = start_train(target, spool, run)
    logs = [finish(p, f"dump job {i}") for i, p in enumerate(jobs)]
    finish(train, "train")
    hw.stop()
    assert hw.high <= SP.read_spool(str(spool))["budget_bytes"]
    assert sidecars(str(spool)) == sidecars(streamed["spool"])
    assert os.path.exists(spool / C.MANIFEST_FILE)
    assert sum("the last job to finish writes" in log for log in logs) <= 1
    a, b = final_weights(streamed["run"]), final_weights(str(run))
    assert all(torch.equal(a[k], b[k]) for k in a)


def _in_process_spool(target, data, out, budget="1GB", **kw):
    from eagle3.dump.job import DumpConfig, run_dump
    return run_dump(DumpConfig(target=target, data=[data], out=str(out), dtype="fp32", shard_size_mb=0.05,
                               spool_budget=budget, held_out_fraction=FRACTION, progress=False, **kw))


def _follow(target, spool, run, **kw):
    from eagle3.train.config import TrainConfig
    from eagle3.train.trainer import train
    return train(TrainConfig(dump=[str(spool)], target=target, out=str(run), drafter="tiny", bf16=False,
                             token_budget=256, warmup_steps=1, held_out_fraction=FRACTION, num_workers=0,
                             progress=False, wandb_mode="disabled", follow=True, eval_interval=1000,
                             save_interval=1000, **kw))


def test_a_failed_dump_stops_the_follower_naming_the_shard(tiny_targets, data40, tmp_path, monkeypatch):
    """A dump job that fails mid-way leaves its error for the follower, which stops naming the shard and the error
    instead of waiting; what it trained is checkpointed, and both reruns finish the work."""
    from eagle3.dump import shards as S
    monkeypatch.setattr(SP, "POLL_S", 0.02)
    target = tiny_targets["llama"]
    spool, run = tmp_path / "spool", tmp_path / "run"
    write = S.write_shard

    def failing(out_dir, j, *a, **k):
        if j == 8:
            raise OSError(28, "No space left on device (injected)")
        return write(out_dir, j, *a, **k)
    monkeypatch.setattr(S, "write_shard", failing)
    with pytest.raises(RuntimeError, match="No space left"):
        _in_process_spool(target, data40, spool, budget="1.5MiB")
    assert os.path.exists(spool / SP.failed_name(0))
    with pytest.raises(C.ContractError, match=r"waiting for shard-00008.*dump job 0 failed on shard-00008.*No space"):
        _follow(target, spool, run, delete_consumed=True)
    done = glob.glob(str(run / "checkpoints" / "step*"))
    assert done, "the windows trained before the failure are checkpointed"
    consumed = [j for j in range(8) if SP.is_consumed(str(spool), j)]
    assert consumed, "and freed"
    monkeypatch.setattr(S, "write_shard", write)
    dump = threading.Thread(target=_in_process_spool, args=(target, data40, spool), kwargs={"budget": "1.5MiB"})
    dump.start()  # the rerun removes the failure record and writes the rest as the trainer frees room
    time.sleep(0.5)
    _follow(target, spool, run, delete_consumed=True, resume=True)
    dump.join(timeout=300)
    assert not os.path.exists(spool / SP.failed_name(0))
    assert os.path.exists(spool / C.MANIFEST_FILE)


def test_the_follower_may_start_before_the_dump(tiny_targets, data40, tmp_path, monkeypatch):
    """Started together, the dump spends a while reading its data before it plans the spool: the follower waits."""
    monkeypatch.setattr(SP, "POLL_S", 0.02)
    target = tiny_targets["llama"]
    spool = tmp_path / "spool"
    seen = {}

    def dump_later():
        time.sleep(1.0)
        seen["before"] = spool.exists()
        _in_process_spool(target, data40, spool)
    dump = threading.Thread(target=dump_later)
    dump.start()
    r = _follow(target, spool, tmp_path / "run")
    dump.join(timeout=300)
    assert seen["before"] is False and r["step"] > 0
    assert os.path.exists(tmp_path / "run" / "checkpoints" / "latest")


def test_an_altered_shard_is_refused_by_name(tiny_targets, data40, tmp_path):
    target = tiny_targets["llama"]
    spool = tmp_path / "spool"
    _in_process_spool(target, data40, spool)
    path = spool / "shard-00007.safetensors"
    b = bytearray(path.read_bytes())
    b[-3] ^= 0xFF
    path.write_bytes(bytes(b))
    with pytest.raises(C.ContractError, match="shard-00007.safetensors: sha256 differs"):
        _follow(target, spool, tmp_path / "run")


def test_spool_refusals(tiny_targets, data40, tmp_path):
    target = tiny_targets["llama"]
    spool = tmp_path / "spool"
    # a budget that cannot hold the held-out shards plus one shard: refused before anything is written
    with pytest.raises(ValueError, match="cannot hold the held-out shards"):
        _in_process_spool(target, data40, spool, budget="100KiB")
    assert not glob.glob(str(spool / "shard-*"))
    _in_process_spool(target, data40, spool, budget="1GB")
    # rerun with another budget: the follower's order is made from the first
    with pytest.raises(C.ContractError, match="budget_bytes"):
        _in_process_spool(target, data40, spool, budget="2GB")
    # another held-out fraction than the spool's
    with pytest.raises(ValueError, match="held-out-fraction 0.3"):
        from eagle3.train.config import TrainConfig
        from eagle3.train.trainer import train
        train(TrainConfig(dump=[str(spool)], target=target, out=str(tmp_path / "r"), drafter="tiny", bf16=False,
                          held_out_fraction=0.3, follow=True, num_workers=0, progress=False, wandb_mode="disabled"))
    # a plain dump is not a spool
    plain = tmp_path / "plain"
    from eagle3.dump.job import DumpConfig, run_dump
    run_dump(DumpConfig(target=target, data=[data40], out=str(plain), dtype="fp32", num_samples=4, progress=False))
    with pytest.raises(C.ContractError, match="not a spool"):
        _follow(target, plain, tmp_path / "r2")


def test_a_budget_too_small_for_the_whole_dump_needs_delete_consumed(tiny_targets, data40, tmp_path):
    target = tiny_targets["llama"]
    spool = tmp_path / "spool"
    p = start_dump(target, data40, spool)  # blocks once the budget is full: nobody consumes
    try:
        wait_for(lambda: os.path.exists(spool / SP.SPOOL_FILE), "spool.json")
        with pytest.raises(ValueError, match="without --delete-consumed its writer would stop"):
            _follow(target, spool, tmp_path / "run")
    finally:
        kill9(p)


@pytest.mark.parametrize("text, n", [("2TB", 2 * 10**12), ("512MiB", 512 * 2**20), ("1.5MiB", 1572864),
                                     ("4096", 4096), ("3 gb", 3 * 10**9)])
def test_parse_size(text, n):
    assert SP.parse_size(text) == n


@pytest.mark.parametrize("text", ["", "2XB", "-1GB", "0", "GB"])
def test_parse_size_refuses(text):
    with pytest.raises(ValueError):
        SP.parse_size(text)


def test_windows_and_the_budget_rule(tmp_path):
    planned = [10, 10, 30, 30, 30, 50, 30, 30]  # two held-out shards, then training shards
    w = SP.make_windows(planned, 2, budget=140)  # room 120: windows of at most 60
    assert w == [[2, 3], [4], [5], [6, 7]]
    assert [j for ws in w for j in ws] == list(range(2, 8))
    with pytest.raises(ValueError, match="largest training shard"):
        SP.make_windows(planned, 2, budget=60)
    rec = {"budget_bytes": 140, "held_out_shards": 2, "shards": [{"planned_bytes": b} for b in planned]}
    g = SP.Gate(str(tmp_path), rec, print)
    # held-out 20 + shards 2..j within 140: 2, 3, 4 (20 + 90 = 110) yes; 5 (160) no
    assert [g.room_for(j) for j in range(8)] == [True] * 5 + [False] * 3
    SP.mark_consumed(str(tmp_path), 2, "h", 1)
    SP.mark_consumed(str(tmp_path), 3, "h", 1)
    assert g.room_for(6) and not g.room_for(7)  # 20 + 30 + 50 + 30 = 130 fits; + shard 7 no


@pytest.mark.parametrize("world", [1, 2, 3])
def test_window_plan_deals_every_sample_once(world):
    g = torch.Generator().manual_seed(0)
    lengths = [int(x) for x in torch.randint(5, 120, (60,), generator=g)]
    windows = [list(range(0, 17)), list(range(17, 30)), list(range(30, 60))]
    shards = [[0], [1], [2]]
    plans = [WindowPlan(windows, shards, lengths, 256, seed=3, rank=r, world_size=world) for r in range(world)]
    assert len({tuple(p.window_end) for p in plans}) == 1  # every rank ends each window at the same step
    seen = sorted(i for p in plans for b in p.batches for i in b)
    assert seen == list(range(60))
    # a window's batches come from that window only, and the order is the pure function of (seed, window)
    for p in plans:
        for s, b in enumerate(p.batches):
            assert {next(w for w, ws in enumerate(windows) if i in ws) for i in b} == {p.window_of(s)}
    again = WindowPlan(windows, shards, lengths, 256, seed=3, rank=0, world_size=world)
    assert again.batches == plans[0].batches and again.window_shards == shards
    assert list(again.batches_from(3, 4)) == plans[0].batches[3:7]
    first = length_grouped_batches(lengths[:17], 256, 3, 0, world)[0::world]
    assert plans[0].batches[:len(first)] == first


def test_window_plan_joins_windows_too_small_for_the_ranks():
    lengths = [50] * 7
    windows, shards = [[0], [1, 2], [3], [4, 5], [6]], [[5], [6], [7], [8], [9]]
    p = WindowPlan(windows, shards, lengths, 256, seed=0, rank=0, world_size=2)
    assert p.window_shards == [[5, 6], [7, 8, 9]]  # the last, alone too small, joins the one before
    with pytest.raises(ValueError, match="cannot fill 4 data-parallel ranks"):
        WindowPlan([[0], [1, 2]], [[0], [1]], lengths, 256, seed=0, rank=0, world_size=4)


@pytest.mark.parametrize("kw, msg", [
    (dict(dump=["a", "b"], follow=True), "one spool"),
    (dict(dump=["a"], follow=True, epochs=2.0), "one pass"),
    (dict(dump=["a"], delete_consumed=True), "go with --follow"),
    (dict(dump=["a"], follow_timeout=5.0), "go with --follow"),
    (dict(dump=["a"], follow=True, follow_timeout=0.0), "must be > 0"),
    (dict(dump=["a"], follow=True, delete_consumed=True, grad_accum=2), "partial gradient"),
])
def test_follow_options_are_checked_up_front(kw, msg):
    from eagle3.train.config import TrainConfig
    with pytest.raises(ValueError, match=msg):
        TrainConfig(**kw)


@pytest.mark.parametrize("kw, msg", [
    (dict(held_out_fraction=0.1), "goes with --spool-budget"),
    (dict(spool_budget="lots"), "not a size"),
    (dict(num_jobs=2, job_index=2), r"--job-index 2: must be in 0..1"),
    (dict(num_jobs=0), "--num-jobs 0"),
])
def test_spool_dump_options_are_checked_up_front(kw, msg):
    from eagle3.dump.job import DumpConfig
    with pytest.raises(ValueError, match=msg):
        DumpConfig(target="t", data=["d.jsonl"], out="o", **kw)
