"""A target is its weights too (issue 30, item 1): two models with byte-identical config.json and tokenizer but
other weights -- a base model and its fine-tune -- are different targets at every stage boundary: a dump resumed
with the other, training, a resumed run, eval, a vocabulary and regenerated data from the other are refused."""

import json
import os
import shutil

import pytest

from eagle3 import contract as C
from eagle3.target import fingerprint as FP
from eagle3.target.load import TargetError, target_info


@pytest.fixture(scope="module")
def twins(tiny_targets, tmp_path_factory):
    """tiny_targets['llama'] and its 'fine-tune': the same config.json and tokenizer files, other weights."""
    from tiny import make_target
    base = tiny_targets["llama"]
    tuned = make_target(str(tmp_path_factory.mktemp("tuned")), "llama", seed=1)
    for f in os.listdir(base):
        if not f.endswith(".safetensors"):
            shutil.copy(os.path.join(base, f), os.path.join(tuned, f))
    return base, tuned


def test_twins_share_config_and_tokenizer_but_not_weights(twins):
    base, tuned = twins
    a, b = target_info(base), target_info(tuned)
    assert a.config_sha256 == b.config_sha256
    assert a.weights_sha256 != b.weights_sha256 and a.weights_sha256.startswith(FP.SAMPLED + ":")


def _big(path, size, seed=0):
    import random
    rng = random.Random(seed)
    with open(path, "wb") as f:
        f.write(rng.randbytes(size))


def test_sampled_digest_sees_what_it_reads_and_full_sees_every_byte(tmp_path):
    a = tmp_path / "a"
    a.mkdir()
    size = FP.HEAD_BYTES + 40 * FP.BLOCK_BYTES  # large enough to be sampled
    _big(a / "model-00001.safetensors", size)
    _big(a / "model-00002.safetensors", size, seed=1)
    (a / "config.json").write_text("{}")
    d = FP.weights_fingerprint(str(a))
    assert d["files"] == 2 and d["bytes"] == 2 * size and d["sha256"].startswith("sampled-v1:")
    # a copy elsewhere and a README beside the weights: the same weights
    b = tmp_path / "b"
    shutil.copytree(a, b)
    (b / "README.md").write_text("fine")
    assert FP.weights_fingerprint(str(b)) == d

    def flipped(offset):
        c = tmp_path / f"c{offset}"
        if c.exists():
            return str(c)
        shutil.copytree(a, c)
        with open(c / "model-00002.safetensors", "r+b") as f:
            f.seek(offset)
            byte = f.read(1)
            f.seek(offset)
            f.write(bytes([byte[0] ^ 1]))
        return str(c)
    assert FP.weights_fingerprint(flipped(10))["sha256"] != d["sha256"]          # the header
    assert FP.weights_fingerprint(flipped(size - 1))["sha256"] != d["sha256"]    # the last block
    # the first sampled block (at fraction 1/32 of the part after the header)
    first = FP.HEAD_BYTES + (size - FP.HEAD_BYTES - FP.BLOCK_BYTES) // (2 * FP.SAMPLES)
    assert FP.weights_fingerprint(flipped(first + 5))["sha256"] != d["sha256"]
    # a byte between samples: not seen by the sampled digest (documented), seen by the full one
    between = FP.HEAD_BYTES + 2
    assert FP.weights_fingerprint(flipped(between))["sha256"] == d["sha256"]
    full = FP.weights_fingerprint(str(a), full=True)["sha256"]
    assert full.startswith("full-v1:") and full != d["sha256"]
    assert FP.weights_fingerprint(flipped(between), full=True)["sha256"] != full
    # a small file is hashed whole by either method
    (a / "tiny.bin").write_bytes(b"x" * 100)
    assert FP.weights_fingerprint(str(a))["files"] == 3


def test_no_weights_and_hub_revision(tmp_path, tiny_targets):
    (tmp_path / "config.json").write_text(open(os.path.join(tiny_targets["llama"], "config.json")).read())
    with pytest.raises(TargetError, match="no weight files"):
        target_info(str(tmp_path))
    assert target_info(str(tmp_path), weights=False).weights_sha256 == ""
    snap = tmp_path / "hub" / "models--moonshotai--Kimi-K2.5" / "snapshots" / ("ab12" * 10)
    snap.mkdir(parents=True)
    assert FP.hub_revision(str(snap)) == "moonshotai/Kimi-K2.5@" + "ab12" * 10
    assert FP.hub_revision(str(tmp_path)) == ""


def _dump(target, data, out, **kw):
    from eagle3.dump.job import DumpConfig, run_dump
    return run_dump(DumpConfig(target=target, data=[data], out=str(out), layers=[1, 3, 4], dtype="fp32",
                               shard_size_mb=0.03, progress=False, **kw))


def test_a_dump_resumed_with_other_weights_is_refused(twins, convs, tmp_path):
    base, tuned = twins
    with pytest.raises(SystemExit):
        _dump(base, convs, tmp_path / "d", stop_after_shards=2)
    with pytest.raises(C.ContractError, match="target.weights_sha256"):
        _dump(tuned, convs, tmp_path / "d")
    m = _dump(base, convs, tmp_path / "d")  # the same target resumes it
    assert m.target.weights_sha256 == target_info(base).weights_sha256
    # the full digest is another method: named, not silently compared
    with pytest.raises(C.ContractError, match="different methods"):
        _dump(base, convs, tmp_path / "d", full_weights_digest=True)


def _train_cfg(dump, target, out, **kw):
    from eagle3.train.config import TrainConfig
    return TrainConfig(**dict(dict(dump=[dump], target=target, out=str(out), drafter="tiny", draft_vocab_size=512,
                                   bf16=False, max_steps=2, token_budget=256, warmup_steps=1, held_out_fraction=0.0,
                                   save_interval=1, num_workers=0, progress=False, wandb_mode="disabled"), **kw))


def test_training_and_eval_with_other_weights_are_refused(twins, tiny_dump, tiny_export, tmp_path):
    from eagle3.eval.speculative import evaluate
    from eagle3.train.trainer import train
    base, tuned = twins
    with pytest.raises(C.ContractError, match="target.weights_sha256"):
        train(_train_cfg(tiny_dump, tuned, tmp_path / "run"))
    assert not os.path.exists(tmp_path / "run" / "checkpoints")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"conversations": [{"from": "human", "value": "hello there"}]}) + "\n")
    with pytest.raises(C.ContractError, match="target.weights_sha256"):
        evaluate(tuned, tiny_export, str(prompts), draft_steps=2, max_new_tokens=4, num_prompts=1, dtype="fp32",
                 device="cpu")


def test_a_resume_with_the_other_target_and_a_vocab_of_its_dump_are_refused(twins, convs, tiny_dump, tmp_path):
    from eagle3.train.trainer import train
    from eagle3.cli import main
    base, tuned = twins
    train(_train_cfg(tiny_dump, base, tmp_path / "run"))
    with pytest.raises(C.ContractError, match="target.weights_sha256"):
        train(_train_cfg(tiny_dump, tuned, tmp_path / "run", max_steps=3, resume=True))
    other = _dump(tuned, convs, tmp_path / "tuned_dump")
    assert other.target.weights_sha256 != target_info(base).weights_sha256
    main(["vocab", "--dump", str(tmp_path / "tuned_dump"), "--out", str(tmp_path / "vocab.safetensors"),
          "--draft-vocab-size", "64"])
    with pytest.raises(C.ContractError, match="target.weights_sha256"):
        train(_train_cfg(tiny_dump, base, tmp_path / "run2", vocab=str(tmp_path / "vocab.safetensors"),
                         draft_vocab_size=64))


def test_regenerated_data_of_the_other_weights(twins, tmp_path):
    """A regeneration resumed with the fine-tune is refused; a dump of the base over the fine-tune's answers names
    the weights."""
    from eagle3.regenerate.config import RegenConfig
    from eagle3.regenerate.files import CONVERSATIONS
    from eagle3.regenerate.job import run_regenerate
    from tiny import write_conversations
    base, tuned = twins
    chats = write_conversations(tmp_path / "chats.jsonl", n=6, seed=2)

    def regen(target, out, **kw):
        return run_regenerate(RegenConfig(data=[str(chats)], out=str(out), target=target, engine="hf",
                                          max_new_tokens=4, batch_size=2, progress=False, **kw))
    with pytest.raises(SystemExit):
        regen(base, tmp_path / "r", stop_after_batches=1)
    with pytest.raises(C.ContractError, match="weights"):
        regen(tuned, tmp_path / "r")
    rec = regen(base, tmp_path / "r")
    assert rec["identity"]["weights_sha256"] == target_info(base).weights_sha256
    regen(tuned, tmp_path / "t")
    with pytest.raises(C.ContractError, match="OTHER WEIGHTS"):
        _dump(base, str(tmp_path / "t" / CONVERSATIONS), tmp_path / "dt")


def test_legacy_records_without_weights_are_named(tiny_dump, tiny_targets):
    """A manifest written before weights were recorded matches no target, and the error says why."""
    m = C.load_manifest(tiny_dump)
    legacy = C.DumpManifest.from_dict(json.loads(json.dumps(m.to_dict())))
    legacy.target.weights_sha256 = ""
    from eagle3.train.setup import check_target_matches_dumps
    with pytest.raises(C.ContractError, match="written before eagle3 made a target's weights part"):
        check_target_matches_dumps(tiny_targets["llama"], legacy)
