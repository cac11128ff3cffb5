"""Typed training configuration: dataclass defaults < configs/train/*.yaml < command-line flags."""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field

import yaml


@dataclass
class TrainConfig:
    dump: list[str] = field(default_factory=list)   # dump directories (same capture contract)
    target: str = ""                                 # target model directory (embedding + lm_head are read)
    out: str = "runs/train"
    drafter: str = "auto"          # configs/drafters preset, or 'auto' (derived from the target)
    draft_vocab_size: int | None = None             # default: the drafter preset's
    vocab: str | None = None       # a vocab file from `eagle3 vocab`; computed from the training split if absent
    zero_stage: int = 2
    bf16: bool = True
    max_steps: int | None = None   # micro-steps; default: epochs x steps per epoch
    epochs: float = 1.0
    token_budget: int = 8192       # padded tokens per micro-batch per rank
    grad_accum: int = 1
    lr: float = 1e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 0.5
    ttt_steps: int = 7
    step_decay: float = 0.8
    held_out_fraction: float = 0.02
    seed: int = 0
    save_interval: int = 500
    keep_checkpoints: int = 2
    eval_interval: int = 250
    eval_batches: int = 20
    accept_steps: int | None = None    # chain length of the held-out decoding replay (default: ttt_steps)
    accept_max_new_tokens: int | None = None  # replay: stop each turn after this many tokens, as eval does
    keep_best: bool = True         # checkpoints/best: the weights with the best held-out decoding acceptance
    log_interval: int = 10         # steps pooled per metrics line (the only host sync of the loop)
    num_workers: int = 2
    activation_checkpointing: str = "none"  # none | mlp (recompute gate/up) | step (recompute whole TTT steps)
    fast_path: bool = True         # train/kernels.py forward + fused loss (ZeRO 0-2; ZeRO-3 uses the plain path)
    attention_kernel: str = "auto"  # fast path CUDA attention: auto | cudnn | flash (kernels.py)
    resume: bool = False
    wandb_project: str = "eagle3"
    wandb_mode: str | None = None  # None: offline unless logged in; 'disabled' turns it off
    teacher_chunk_tokens: int = 4096
    progress: bool = True
    stop_after_steps: int | None = None  # testing aid: exit after this many steps as if killed

    def __post_init__(self):
        from eagle3.train.drafter import checkpointing_mode
        from eagle3.train.kernels import CUDA_ATTENTION_KERNELS
        self.activation_checkpointing = checkpointing_mode(self.activation_checkpointing)
        if self.attention_kernel not in CUDA_ATTENTION_KERNELS:
            raise ValueError(f"attention_kernel {self.attention_kernel!r}: expected one of {CUDA_ATTENTION_KERNELS}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _parse_value(f: dataclasses.Field, text: str):
    t = f.type if isinstance(f.type, str) else str(f.type)
    if "list[str]" in t:
        return text
    if t.startswith("bool"):
        return text
    if "tuple" in t:
        return tuple(float(x) for x in text.split(","))
    if t.startswith("int"):
        return int(text)
    if t.startswith("float"):
        return float(text)
    return text


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--config", default=None, help="configs/train preset name or a YAML file")
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.name == "dump":
            ap.add_argument(flag, nargs="+", default=None)
        elif str(f.type).startswith("bool"):
            ap.add_argument(flag, action=argparse.BooleanOptionalAction, default=None)
        else:
            ap.add_argument(flag, default=None, type=lambda s, f=f: _parse_value(f, s))
    ap.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed


def load_yaml(name_or_path: str) -> dict:
    if os.path.isfile(name_or_path):
        with open(name_or_path) as fh:
            return yaml.safe_load(fh) or {}
    from eagle3 import presets
    return presets.load("train", name_or_path)


def from_args(a: argparse.Namespace) -> TrainConfig:
    values = load_yaml(a.config) if a.config else {}
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = set(values) - known
    if unknown:
        raise ValueError(f"{a.config}: unknown training options {sorted(unknown)}")
    for name in known:
        v = getattr(a, name, None)
        if v is not None:
            values[name] = v
    if "betas" in values:
        values["betas"] = tuple(values["betas"])
    cfg = TrainConfig(**values)
    if not cfg.dump or not cfg.target:
        raise ValueError("--dump and --target are required (on the command line or in --config)")
    return cfg
