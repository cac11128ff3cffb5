"""Integrity of training runs at every resume and every load: a checkpoint never runs code, is checked against its
record, a resume never changes the data order or the split, and nothing already written is lost (in-process runs,
a world of one)."""

import errno
import json
import math
import os
import re
import shutil

import pytest
import torch

from eagle3 import contract as C
from test_train import metrics


def config(tiny_dump, tiny_targets, out, **kw):
    from eagle3.train.config import TrainConfig
    base = dict(dump=[tiny_dump], target=tiny_targets["llama"], out=str(out), drafter="tiny", draft_vocab_size=512,
                bf16=False, max_steps=6, token_budget=256, lr=3e-3, warmup_steps=2, held_out_fraction=0.25,
                save_interval=2, eval_interval=2, eval_batches=1, num_workers=0, log_interval=1, progress=False,
                wandb_mode="disabled")
    return TrainConfig(**dict(base, **kw))


@pytest.fixture(scope="module")
def killed_run(tiny_dump, tiny_targets, tmp_path_factory):
    """A 6-step run killed after step 5: complete checkpoints at steps 2 and 4 (latest: 4), metrics of steps 1-5."""
    from eagle3.train.trainer import train
    out = tmp_path_factory.mktemp("integrity") / "killed"
    with pytest.raises(SystemExit, match="stopped at step 5"):
        train(config(tiny_dump, tiny_targets, out, stop_after_steps=5))
    return str(out)


@pytest.fixture
def run(killed_run, tmp_path):
    """A copy of the killed run to tamper with."""
    return str(shutil.copytree(killed_run, tmp_path / "run"))


def resume(tiny_dump, tiny_targets, run, **kw):
    from eagle3.train.trainer import train
    return train(config(tiny_dump, tiny_targets, run, resume=True, **kw))


def ckpt(run, step):
    return os.path.join(run, "checkpoints", f"step{step:08d}")


def snapshot(d):
    """sha256 of every file under d."""
    return {os.path.relpath(os.path.join(r, f), d): C.file_sha256(os.path.join(r, f))
            for r, _, files in os.walk(d) for f in files}


def rerecord(ckpt_dir, name):
    """What someone who rewrote a checkpoint file would also do: record the file's new sha256."""
    path = os.path.join(ckpt_dir, "eagle3_checkpoint.json")
    rec = json.load(open(path))
    rec.setdefault("sha256", {})[name] = C.file_sha256(os.path.join(ckpt_dir, name))
    json.dump(rec, open(path, "w"))


def flip_bit(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([b ^ 1]))


class _Payload:
    """Unpickled, it opens (creates) the marker file: a stand-in for any code a planted object would run."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return open, (self.marker, "w")


def test_resume_never_unpickles_code(run, tiny_dump, tiny_targets, tmp_path):
    marker = str(tmp_path / "payload_ran")
    ck = ckpt(run, 4)
    path = os.path.join(ck, "mp_rank_00_model_states.pt")
    state = torch.load(path, weights_only=False)  # our own file
    state["note"] = _Payload(marker)
    torch.save(state, path)
    rerecord(ck, "mp_rank_00_model_states.pt")  # so that only the loader itself stands in the way
    with pytest.raises(C.ContractError, match=r"step00000004/mp_rank_00_model_states\.pt: refusing to load"):
        resume(tiny_dump, tiny_targets, run)
    assert not os.path.exists(marker), "the planted payload ran"


@pytest.mark.parametrize("change, match", [
    (dict(seed=1), "--seed: 0 -> 1"),
    (dict(held_out_fraction=0.5), "--held-out-fraction: 0.25 -> 0.5"),
    (dict(token_budget=512), "--token-budget: 256 -> 512"),
    (dict(lr=1e-3), "--lr: 0.003 -> 0.001"),
    (dict(max_steps=3), "would end at step 3, before its checkpoint"),
])
def test_resume_refuses_changes_to_the_data_order_split_or_optimizer(run, tiny_dump, tiny_targets, change, match):
    before = snapshot(run)
    with pytest.raises(ValueError, match=re.escape(match)):
        resume(tiny_dump, tiny_targets, run, **change)
    assert snapshot(run) == before, "a refused resume changed the run"


def test_resume_refuses_other_data_and_a_replaced_vocab(run, tiny_dump, tiny_targets, convs, tmp_path):
    from eagle3.data.vocab import load_vocab, save_vocab
    from eagle3.dump.job import DumpConfig, run_dump
    other = str(tmp_path / "other_dump")  # the same target and capture: only the data differ
    run_dump(DumpConfig(target=tiny_targets["llama"], data=[convs], out=other, layers=[4, 1, 3], dtype="fp32",
                        num_samples=10, progress=False))
    before = snapshot(run)
    with pytest.raises(ValueError, match="the dumps hold other data"):
        resume(other, tiny_targets, run)
    path = os.path.join(run, "vocab.safetensors")
    vocab = load_vocab(path)
    save_vocab(path, dict(vocab, meta={}))  # the same ids, another file: not what run.json recorded
    before["vocab.safetensors"] = C.file_sha256(path)
    with pytest.raises(C.ContractError, match=r"vocab\.safetensors: sha256 differs from the one .*run\.json records"):
        resume(tiny_dump, tiny_targets, run)
    assert snapshot(run) == before


def test_resume_may_extend_the_run_records_that_and_recomputes_metrics_after_the_checkpoint(
        run, killed_run, tiny_dump, tiny_targets):
    killed = metrics(run)
    resume(tiny_dump, tiny_targets, run, max_steps=7)
    rows = metrics(run)
    assert [r["step"] for r in rows] == list(range(1, 8)), "each step once: the killed run's step 5 was dropped"
    assert rows[:4] == killed[:4]
    # the same data in the same order: step 5 (weights of step 4, the batch of step 5) computes the same loss again
    assert rows[4]["loss"] == pytest.approx(killed[4]["loss"], rel=1e-6)
    assert [r["step"] for r in metrics(run, "eval")] == [2, 4, 6, 7]
    # the lr schedule (warm-up 2, cosine to 0.1 x 3e-3) continues: on the 6-step curve up to the checkpoint, on the
    # 7-step curve after it (the logged lr is the one the next step uses)
    def lr(step, total):
        return 3e-3 * (step / 2 if step < 2 else 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - 2) / (total - 2))))
    assert [r["lr"] for r in rows] == pytest.approx([lr(s, 6) for s in range(1, 5)] + [lr(s, 7) for s in (5, 6, 7)],
                                                    rel=1e-9)
    rec = json.load(open(os.path.join(run, "run.json")))
    assert rec["train"]["max_steps"] == 7
    assert rec["resumes"] == [{"step": 4, "from": "step00000004",
                               "changed": {"max_steps": [6, 7], "stop_after_steps": [5, None],
                                           "out": [killed_run, run]}}]
    assert json.load(open(os.path.join(ckpt(run, 7), "eagle3_checkpoint.json")))["resumes"] == rec["resumes"]


def test_a_fresh_run_into_a_used_folder_is_refused(run, tiny_dump, tiny_targets):
    from eagle3.train.trainer import train
    shutil.rmtree(os.path.join(run, "checkpoints"))  # a run that logged steps but kept no checkpoint
    before = snapshot(run)
    with pytest.raises(ValueError, match=r"already holds a training run \(.*metrics\.jsonl\)"):
        train(config(tiny_dump, tiny_targets, run))
    assert snapshot(run) == before


def test_a_vocab_left_by_a_failed_start_is_rebuilt_for_other_settings(tiny_dump, tiny_targets, tmp_path):
    from eagle3.data.vocab import load_vocab
    from eagle3.train.trainer import train
    out = tmp_path / "run"
    with pytest.raises(ValueError, match="needs the fast path"):  # fails after the vocabulary was written
        train(config(tiny_dump, tiny_targets, out, draft_vocab_size=512, fast_path=False,
                     activation_checkpointing="step"))
    assert load_vocab(str(out / "vocab.safetensors"))["d2t"].numel() == 512
    train(config(tiny_dump, tiny_targets, out, draft_vocab_size=128, max_steps=1, held_out_fraction=0.0))
    vocab = load_vocab(str(out / "vocab.safetensors"))
    assert vocab["d2t"].numel() == 128
    assert vocab["meta"]["source"]["draft_vocab_size"] == 128 and vocab["meta"]["source"]["held_out_fraction"] == 0
    rec = json.load(open(out / "run.json"))
    assert rec["drafter"]["draft_vocab_size"] == 128
    assert rec["vocab_sha256"] == C.file_sha256(str(out / "vocab.safetensors"))


def test_a_flipped_bit_in_a_checkpoint_is_refused_by_export_and_resume(run, tiny_dump, tiny_targets, tmp_path):
    from eagle3.export.sglang import export_drafter
    weights = os.path.join(ckpt(run, 4), "drafter.safetensors")
    pristine = open(weights, "rb").read()
    header = int.from_bytes(pristine[:8], "little")
    fc = json.loads(pristine[8:8 + header])["fc.weight"]["data_offsets"][0]
    flip_bit(weights, 8 + header + fc)  # the lowest mantissa bit of fc.weight[0, 0]: still finite, well-formed
    with pytest.raises(C.ContractError, match=r"step00000004/drafter\.safetensors: sha256 differs"):
        export_drafter(run, str(tmp_path / "export"))
    assert not os.path.exists(tmp_path / "export")
    with pytest.raises(C.ContractError, match=r"step00000004/drafter\.safetensors: sha256 differs"):
        resume(tiny_dump, tiny_targets, run)
    open(weights, "wb").write(pristine)

    states = os.path.join(ckpt(run, 4), "mp_rank_00_model_states.pt")  # DeepSpeed's own state
    flip_bit(states, os.path.getsize(states) // 2)
    with pytest.raises(C.ContractError, match=r"mp_rank_00_model_states\.pt: sha256 differs"):
        resume(tiny_dump, tiny_targets, run)
    flip_bit(states, os.path.getsize(states) // 2)
    # a file beside them that DeepSpeed's glob for model states would pick up
    shutil.copy(states, os.path.join(ckpt(run, 4), "mp_rank_01_model_states.pt"))
    with pytest.raises(C.ContractError, match=r"files its record does not list: \['mp_rank_01_model_states\.pt'\]"):
        resume(tiny_dump, tiny_targets, run)


def test_an_empty_latest_is_named(run, tiny_dump, tiny_targets):
    open(os.path.join(run, "checkpoints", "latest"), "w").close()
    with pytest.raises(C.ContractError, match=r"checkpoints/latest is empty .*step00000002, step00000004"):
        resume(tiny_dump, tiny_targets, run)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (writes to it fail with ENOSPC)")
def test_a_full_disk_is_named_and_the_last_checkpoint_survives(run, tiny_dump, tiny_targets):
    from eagle3.train.checkpoint import check_files, read_record
    os.makedirs(ckpt(run, 6))
    os.symlink("/dev/full", os.path.join(ckpt(run, 6), "mp_rank_00_model_states.pt"))  # the disk fills there
    with pytest.raises(OSError) as e:
        resume(tiny_dump, tiny_targets, run, keep_checkpoints=1)
    assert e.value.errno == errno.ENOSPC
    assert re.search(r"disk full .* while writing \S*step00000006/mp_rank_00_model_states\.pt", str(e.value))
    assert open(os.path.join(run, "checkpoints", "latest")).read() == "step00000004"
    check_files(ckpt(run, 4), read_record(ckpt(run, 4)))


def test_rotation_deletes_older_checkpoints_only_after_the_new_one_is_complete(run, tiny_dump, tiny_targets):
    from eagle3.train.checkpoint import check_files, read_record
    # a kill during the save of step 6 left that directory incomplete (latest still names step 4)
    os.makedirs(ckpt(run, 6))
    open(os.path.join(ckpt(run, 6), "mp_rank_00_model_states.pt"), "wb").write(b"PK\x03\x04")
    with pytest.raises(SystemExit, match="stopped at step 5"):
        resume(tiny_dump, tiny_targets, run, save_interval=1, keep_checkpoints=1, stop_after_steps=5)
    assert open(os.path.join(run, "checkpoints", "latest")).read() == "step00000005"
    check_files(ckpt(run, 5), read_record(ckpt(run, 5)))
    assert sorted(t for t in os.listdir(os.path.join(run, "checkpoints")) if t.startswith("step")) == \
        ["step00000005", "step00000006"]
