"""Runs that cannot mean anything end with a named error, not exit 0 (issue 30, item 5): a dump with no token in
the loss, a drafter config no forward can mean, training that turns non-finite, counts of 0 or less, a --config
or --vocab that is not what it claims, a shard cut short under --no-verify."""

import json
import os
import shutil

import pytest
import torch

from eagle3 import contract as C


def _cfg(tiny_dump, tiny_targets, out, **kw):
    from eagle3.train.config import TrainConfig
    base = dict(dump=[tiny_dump], target=tiny_targets["llama"], out=str(out), drafter="tiny", draft_vocab_size=64,
                bf16=False, max_steps=4, token_budget=256, warmup_steps=1, held_out_fraction=0.0, save_interval=2,
                num_workers=0, log_interval=1, progress=False, wandb_mode="disabled")
    return TrainConfig(**dict(base, **kw))


def _zero_masks(src, dst):
    """A copy of the dump with every loss_mask 0, its records refitted as eagle3 would have written them."""
    from safetensors import safe_open
    from eagle3.dump.shards import sidecar_name, write_safetensors
    shutil.copytree(src, dst)
    m = json.loads((dst / C.MANIFEST_FILE).read_text())
    for j, rec in enumerate(m["shards"]):
        path = str(dst / rec["file"])
        with safe_open(path, "pt") as f:
            meta = f.metadata()
            tensors = {k: [f.get_tensor(k).clone()] for k in f.keys()}
        tensors[C.LOSS_MASK] = [torch.zeros_like(tensors[C.LOSS_MASK][0])]
        tensors = dict(sorted(tensors.items(), key=lambda kv: -kv[1][0].element_size()))
        sha = write_safetensors(path, tensors, meta)
        rec.update(bytes=os.path.getsize(path), sha256=sha)
        side = dst / sidecar_name(j)
        if side.exists():
            s = json.loads(side.read_text())
            s.update(bytes=rec["bytes"], sha256=sha)
            side.write_text(json.dumps(s))
    m["totals"]["bytes"] = sum(r["bytes"] for r in m["shards"])
    (dst / C.MANIFEST_FILE).write_text(json.dumps(m))
    return str(dst)


def test_a_dump_with_no_token_in_the_loss_builds_no_vocab_and_trains_nothing(tiny_dump, tiny_targets, tmp_path):
    """Before: loss 0, a `best` checkpoint and a vocabulary of 0 tokens."""
    from eagle3.cli import main
    from eagle3.train.trainer import train
    d = _zero_masks(tiny_dump, tmp_path / "zero")
    with pytest.raises(SystemExit):
        main(["vocab", "--dump", d, "--out", str(tmp_path / "v.safetensors"), "--draft-vocab-size", "64"])
    assert not (tmp_path / "v.safetensors").exists()
    with pytest.raises(C.ContractError, match="every loss_mask is 0"):
        train(_cfg(d, tiny_targets, tmp_path / "run"))
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize("field,value", [("rms_norm_eps", -1.0), ("rope_theta", -5.0), ("hidden_size", 0),
                                         ("rms_norm_eps", float("nan"))])
def test_a_drafter_config_no_forward_can_mean_is_refused(field, value):
    """An --init-from export with rms_norm_eps -1 or rope_theta -5 trained to NaN and shipped the config."""
    from eagle3.model import DrafterConfig
    base = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, vocab_size=100,
                draft_vocab_size=50, target_hidden_size=64)
    DrafterConfig(**base)
    with pytest.raises(ValueError, match=field):
        DrafterConfig(**dict(base, **{field: value}))


def test_an_init_from_export_with_a_meaningless_config_is_refused(tiny_export, tiny_dump, tiny_targets, tmp_path):
    from eagle3.train.trainer import train
    bad = tmp_path / "bad"
    shutil.copytree(tiny_export, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["rms_norm_eps"] = -1
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises((ValueError, C.ContractError), match="rms_norm_eps"):
        train(_cfg(tiny_dump, tiny_targets, tmp_path / "run", init_from=str(bad), draft_vocab_size=None))


def test_training_that_turns_non_finite_stops_at_its_step(tiny_dump, tiny_targets, tmp_path):
    from eagle3.train.trainer import train
    with pytest.raises(FloatingPointError, match="training turned non-finite"):
        train(_cfg(tiny_dump, tiny_targets, tmp_path / "run", lr=1e30, warmup_steps=0, max_steps=8,
                   save_interval=8))
    assert not os.path.isdir(tmp_path / "run" / "checkpoints" / "step00000008")


@pytest.mark.parametrize("flag,value", [("max_steps", -3), ("max_steps", 0), ("draft_vocab_size", 0),
                                        ("grad_accum", 0), ("save_interval", 0), ("log_interval", 0),
                                        ("eval_interval", 0), ("teacher_chunk_tokens", 0), ("lr", float("nan")),
                                        ("held_out_fraction", 1.0), ("zero_stage", 4)])
def test_counts_that_cannot_mean_a_run_are_refused_by_name(tiny_dump, tiny_targets, tmp_path, flag, value):
    """Before: "done: 0 steps", a whole epoch for 0, the preset's vocab for 0, ZeroDivisionError, "range() arg 3
    must not be zero"."""
    with pytest.raises(ValueError, match="--" + flag.replace("_", "-")):
        _cfg(tiny_dump, tiny_targets, tmp_path / "run", **{flag: value})


@pytest.mark.parametrize("text,match", [("lr: [1, 2\n", "not a YAML file"),
                                        ("lr: fast\n", "lr: 'fast' is a str, expected float"),
                                        ("zero_stage: [2]\n", "zero_stage: \\[2\\] is a list"),
                                        ("!!python/object/apply:os.system ['echo hi']\n", "not a YAML file"),
                                        ("- 1\n- 2\n", "expected a mapping")])
def test_a_broken_config_file_is_named(tmp_path, text, match, capsys):
    from eagle3.cli import main
    p = tmp_path / "c.yaml"
    p.write_text(text)
    with pytest.raises(SystemExit) as e:
        main(["train", "--config", str(p), "--dump", "x", "--target", "y", "--out", str(tmp_path / "o")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert str(p) in err and __import__("re").search(match, err), err


def test_a_vocab_that_is_not_one_is_named(tiny_dump, tiny_targets, tmp_path):
    import pickle
    from eagle3.train.trainer import train
    from eagle3.data.vocab import load_vocab
    pk = tmp_path / "v.safetensors"
    pk.write_bytes(pickle.dumps({"d2t": [1, 2]}))
    js = tmp_path / "v.jsonl"
    js.write_text('{"a": 1}\n')
    for p in (pk, js):
        with pytest.raises(C.ContractError, match="not a safetensors vocabulary file"):
            load_vocab(str(p))
        with pytest.raises(C.ContractError, match="not a safetensors vocabulary file"):
            train(_cfg(tiny_dump, tiny_targets, tmp_path / f"run_{p.suffix}", vocab=str(p)))


def test_a_truncated_shard_is_named_without_verify(tiny_dump, tmp_path):
    from eagle3.data.dumps import DumpSet
    from eagle3.data.inspect import inspect_dump
    d = tmp_path / "d"
    shutil.copytree(tiny_dump, d)
    shard = d / C.load_manifest(str(d)).shards[0].file
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(C.ContractError, match="bytes, the manifest records"):
        DumpSet(str(d), verify=False)
    assert "bytes, the manifest records" in inspect_dump(str(d), verify=False)["verified"]  # reported, named
    shard.write_bytes(b"\0" * len(data))  # the right size, not a shard
    with pytest.raises(C.ContractError, match="not a readable dump shard"):
        DumpSet(str(d), verify=False)


def test_a_checkpoint_whose_weights_were_replaced_by_a_pickle_is_named(tiny_dump, tiny_targets, tmp_path):
    import pickle
    from eagle3.export.sglang import export_drafter
    from eagle3.train.trainer import train
    run = tmp_path / "run"
    train(_cfg(tiny_dump, tiny_targets, run, max_steps=2))
    w = run / "checkpoints" / "step00000002" / "drafter.safetensors"
    w.write_bytes(pickle.dumps({"fc.weight": [0.0]}))
    with pytest.raises(C.ContractError, match="drafter.safetensors"):
        export_drafter(str(run), str(tmp_path / "e"))
    with pytest.raises(C.ContractError, match="drafter.safetensors"):
        train(_cfg(tiny_dump, tiny_targets, run, max_steps=3, resume=True))
