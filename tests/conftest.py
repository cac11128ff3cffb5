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
