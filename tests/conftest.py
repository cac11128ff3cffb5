import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # tiny.py, tiny_tokenizers.py
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
    os.environ.pop(k, None)  # in-process jobs are worlds of one; multi-process tests launch torchrun


@pytest.fixture(scope="session")
def tiny_targets(tmp_path_factory):
    """Tiny random Llama, DeepseekV3 (MoE, first_k_dense_replace=1) and Kimi-K2.5-layout targets, built once."""
    from tiny import make_target
    root = tmp_path_factory.mktemp("targets")
    return {kind: make_target(str(root / kind), kind) for kind in ("llama", "deepseek_v3", "kimi_k25")}


@pytest.fixture(scope="session")
def convs(tmp_path_factory):
    """12 synthetic ShareGPT conversations of varied length."""
    from tiny import write_conversations
    return write_conversations(tmp_path_factory.mktemp("data") / "chats.jsonl")


@pytest.fixture(scope="session")
def tiny_dump(tiny_targets, convs, tmp_path_factory):
    """An fp32 dump of the tiny Llama target with layers given out of order (stored ascending: 1, 3, 4),
    several shards."""
    from eagle3.dump.job import DumpConfig, run_dump
    out = str(tmp_path_factory.mktemp("dumps") / "llama")
    run_dump(DumpConfig(target=tiny_targets["llama"], data=[convs], out=out, layers=[4, 1, 3], dtype="fp32",
                        shard_size_mb=0.03, progress=False))
    return out


@pytest.fixture(scope="session")
def tiny_run(tiny_dump, tiny_targets, tmp_path_factory):
    """A real (4-step) training run on the tiny Llama dump (capture HF [1, 3, 4] of 6 layers); shared by the
    export and record tests, which only read it (or copy it to tamper with)."""
    from eagle3.train.config import TrainConfig
    from eagle3.train.trainer import train
    out = str(tmp_path_factory.mktemp("export_runs") / "run")
    train(TrainConfig(dump=[tiny_dump], target=tiny_targets["llama"], out=out, drafter="tiny", bf16=False,
                      max_steps=4, save_interval=2, token_budget=512, warmup_steps=1, held_out_fraction=0.0,
                      num_workers=0, progress=False, wandb_mode="disabled"))
    return out


@pytest.fixture(scope="session")
def tiny_export(tiny_run, tmp_path_factory):
    """tiny_run's latest checkpoint exported for SGLang (the Llama layout, no option): read only."""
    from eagle3.export.sglang import export_drafter
    out = str(tmp_path_factory.mktemp("tiny_export") / "export")
    export_drafter(tiny_run, out)
    return out
