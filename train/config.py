"""Typed training configuration: dataclass defaults < configs/train/*.yaml (--config) < command-line flags.

The flags are made from the dataclass by eagle3.options (each field's `help` is its help text), spelled as
transformers' HfArgumentParser made them, so a new option is one field here. Every flag's parsed default is None: a
value is taken from the command line only when it was given there, so a --config preset fills whatever the command
line leaves out.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass

import yaml

from eagle3 import presets
from eagle3.heldout import HELD_OUT_FRACTION, SPLIT_SEED
from eagle3.model.kernels import CUDA_ATTENTION_KERNELS
from eagle3.model.layers import checkpointing_mode
from eagle3.options import add_options, given, opt
from eagle3.train.loss import LOSSES  # --loss: train/loss.py Objective

INIT_HEADS = ("target", "random")  # how the draft head (norm + lm_head) starts: train/trainer.py
# Which positions the loss learns from: the assistant's tokens (the loss mask the dump recorded), or every real
# token. The teacher is the target's own distribution at each position whoever wrote the text, so the prompt's
# positions are supervision too, at no dump cost; the held-out replay walks the assistant's answers either way.
LOSS_TOKENS = ("assistant", "all")
REPORTERS = ("wandb", "tensorboard", "mlflow")  # --report-to names: train/trackers.py's TRACKERS


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(","))


@dataclass
class TrainConfig:
    # ---- data, target, output
    dump: list[str] = opt(default_factory=list, help="dump directories (eagle3 dump --out); several must share one "
                                                     "capture contract (target, indices, tokenizer)")
    target: str = opt("", "target model directory (only its embedding and lm_head are read)")
    trust_remote_code: bool = opt(False, "run the tokenizer code the target ships (tokenizer_config.json auto_map, "
                                         "e.g. Kimi-K2.5's tokenization_kimi.py) to check the target's tokenizer "
                                         "against the dumps', as eagle3 dump --trust-remote-code did; refused "
                                         "otherwise")
    out: str = opt("runs/train", "run directory: run.json, metrics.jsonl, checkpoints/, tensorboard/")
    drafter: str = opt("auto", "configs/drafters preset, or 'auto' (the target's own attention/MLP shape)")
    draft_vocab_size: int | None = opt(None, "draft vocabulary size (default: the drafter preset's)")
    # EAGLE-3.1 (docs/drafters.md); None = the drafter preset's (off unless the preset turns it on)
    fc_norm: bool | None = opt(None, "EAGLE-3.1: one RMSNorm per captured state before fc (tensors fc_norm.{i}); "
                                     "exclusive with --norm-before-fc (default: the drafter preset's, else off)")
    norm_before_fc: bool | None = opt(None, "one RMSNorm over the whole concatenation of captured states before fc "
                                            "(tensor input_norm; gpt-oss drafters) (default: the drafter preset's, "
                                            "else off)")
    norm_output: bool | None = opt(None, "EAGLE-3.1: the post-norm hidden is what lm_head reads and what the next "
                                         "draft step receives (default: the drafter preset's, else off)")
    vocab: str | None = opt(None, "a vocab file from `eagle3 vocab` (default: computed from the training split)")
    # ---- optimisation
    zero_stage: int = opt(2, "DeepSpeed ZeRO stage 0-3 (configs/deepspeed/zeroN.json; 3 uses the plain path)")
    bf16: bool = opt(True, "train in bf16 (--no-bf16: fp32)")
    max_steps: int | None = opt(None, "micro-steps to train (default: --epochs x steps per epoch)")
    epochs: float = opt(1.0, "passes over the training split (when --max-steps is not given)")
    token_budget: int = opt(8192, "padded tokens per micro-batch per rank (samples are length-grouped)")
    grad_accum: int = opt(1, "micro-batches per optimizer step")
    lr: float = opt(1e-4, "peak learning rate (AdamW)")
    min_lr_ratio: float = opt(0.1, "the cosine schedule ends at lr x this")
    warmup_steps: int = opt(50, "optimizer steps of linear warm-up before the cosine decay")
    weight_decay: float = opt(0.0, "AdamW weight decay")
    betas: tuple[float, float] = opt((0.9, 0.95), "AdamW betas, e.g. 0.9,0.95", type=_floats)  # one argument
    grad_clip: float = opt(0.5, "gradient-norm clipping")
    ttt_steps: int = opt(7, "training-time-test unroll: draft steps K trained per position")
    step_decay: float = opt(0.8, "loss weight of draft step j is step_decay**j")
    held_out_fraction: float = opt(HELD_OUT_FRACTION, "share of samples (by sample_index) kept out of training for evaluation")
    seed: int = opt(SPLIT_SEED, "seed of the split, the batch order and the initial weights")
    init_from: str | None = opt(None, "warm start: an export directory (eagle3 export-sglang, or a published SGLang "
                                      "EAGLE-3 drafter) whose weights, shape and vocab map the drafter starts from; "
                                      "refused unless its served capture, hidden size and vocab fit the dumps")
    init_from_sglang: str | None = opt(None, "SGLang release whose id rule reads --init-from's ids when it has no "
                                             "eagle3 provenance (default: the latest known)")
    init_head: str = opt("random", "initial draft head: 'random', or 'target' (the target's lm_head rows of the "
                                   "draft vocab and its final norm; measured worse, bench/quality.md)")
    loss_tokens: str = opt("assistant", "positions the loss learns from: 'assistant' (the dump's loss mask) or "
                                        "'all' real tokens, the prompt's included (the teacher is the target's "
                                        "distribution everywhere)")
    loss: str = opt("kl", "training objective per draft step (docs/contract.md §9): 'kl', the soft cross-entropy "
                          "against the target's distribution over the draft vocab; 'lk', -log of the expected "
                          "acceptance rate alpha = sum_v min(p_v, q_v) (the LK loss, arXiv 2602.23881); "
                          "'lk-hybrid', w * KL + (1 - w) * (1 - mean alpha) with w = --lk-kl-scale x "
                          "exp(-(--lk-kl-decay) x mean alpha), the step's mean over its pairs. metrics.jsonl's "
                          "alpha_j is the mean alpha under every loss", choices=LOSSES)
    lk_kl_scale: float = opt(1.0, "--loss lk-hybrid: the KL weight's scale (w at mean acceptance 0), >= 0")
    lk_kl_decay: float = opt(1.0, "--loss lk-hybrid: how fast the KL weight falls as the mean acceptance rises, "
                                  ">= 0 (0: a fixed weight --lk-kl-scale)")
    aux_noise: float = opt(0.0, "training only: Gaussian noise on the captured states fed to the drafter, its std "
                                "this times each captured layer's per-token RMS (EAGLE-1's feature noise, a "
                                "regulariser for small data); 0 = off")
    # ---- checkpoints and evaluation
    save_interval: int = opt(500, "save a checkpoint every this many micro-steps (and at the end)")
    keep_checkpoints: int = opt(2, "interval checkpoints kept (older ones are deleted)")
    eval_interval: int = opt(250, "held-out evaluation every this many micro-steps (and at the end)")
    eval_batches: int = opt(20, "held-out batches per evaluation")
    accept_steps: int | None = opt(None, "chain length of the held-out decoding replay (default: --ttt-steps)")
    accept_max_new_tokens: int | None = opt(None, "replay: stop each turn after this many tokens, as eval does")
    keep_best: bool = opt(True, "keep checkpoints/best: the weights with the best held-out decoding acceptance")
    # ---- speed and memory
    log_interval: int = opt(10, "steps pooled per metrics line (the only host sync of the loop)")
    num_workers: int = opt(2, "data-loader worker processes")
    activation_checkpointing: str = opt("none", "none | mlp (recompute gate/up) | step (recompute whole TTT "
                                                "steps; needs the fast path) | step_mlp (both: least memory)")
    fast_path: bool = opt(True, "model/kernels.py forward + fused loss (ZeRO 0-2; ZeRO-3 uses the plain path)")
    sequence_parallel: int = opt(1, "ranks that split every batch's positions between them (contiguous chunks, "
                                    "train/sequence_parallel.py): for samples longer than one GPU holds. Groups of "
                                    "this many consecutive ranks share each batch (the world size must be a "
                                    "multiple); --token-budget counts the whole batch")
    piece_tokens: int = opt(0, "take every batch wider than this many tokens in contiguous pieces of about this "
                               "many, one after another, each with its own backward (train/sequence_parallel.py "
                               "sequence_pieces_loss): one GPU then holds one piece's activations, for samples "
                               "longer than it holds whole; the same gradient. 0: whole rows. Not with "
                               "--sequence-parallel or ZeRO-3")
    attention_kernel: str = opt("auto", "fast path CUDA attention: auto | cudnn | flash | efficient (model/kernels.py)")
    teacher_chunk_tokens: int = opt(4096, "tokens per chunk of the teacher's lm_head (bounds its memory)")
    # ---- streaming (data/stream.py)
    follow: bool = opt(False, "train on a spool (eagle3 dump --spool-budget) while it is written: one pass, window "
                              "by window in a fixed order, each shard verified before use; --dump names the spool")
    delete_consumed: bool = opt(False, "--follow: free each window's shards once trained on and covered by a "
                                       "checkpoint (saved at every window's end), so the dump can go on")
    follow_timeout: float | None = opt(None, "--follow: stop with an error when a shard has not appeared after this "
                                             "many seconds (default: wait as long as the dump takes)")
    # ---- run control and logging
    resume: bool = opt(False, "continue the run in --out from checkpoints/latest (same data order and split)")
    report_to: str = opt("none", "trackers, comma-separated: wandb, tensorboard (RUN/tensorboard/), mlflow "
                                 "($MLFLOW_TRACKING_URI, else RUN/mlruns), or none; "
                                  "metrics.jsonl is always written")
    wandb_project: str = opt("eagle3", "wandb project (and MLflow experiment)")
    wandb_mode: str | None = opt(None, "wandb mode: online | offline | disabled (default: $WANDB_MODE, else "
                                       "offline unless logged in); disabled drops wandb from --report-to")
    progress: bool = opt(True, "progress bar (--no-progress: off)")
    stop_after_steps: int | None = opt(None, "testing aid: exit after this many steps as if killed", hidden=True)

    def __post_init__(self):
        import math

        def flag(name):
            return "--" + name.replace("_", "-")
        # Counts that divide or bound a loop: 0 or less is a ZeroDivisionError, an empty run or the preset's value
        # silently -- each is refused by name (optional ones only when given).
        for name, optional in (("max_steps", True), ("draft_vocab_size", True), ("accept_steps", True),
                               ("accept_max_new_tokens", True), ("token_budget", False), ("grad_accum", False),
                               ("ttt_steps", False), ("save_interval", False), ("eval_interval", False),
                               ("eval_batches", False), ("log_interval", False), ("teacher_chunk_tokens", False),
                               ("keep_checkpoints", False), ("sequence_parallel", False)):
            v = getattr(self, name)
            if optional and v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{flag(name)} {v!r} must be an integer >= 1")
        for name in ("warmup_steps", "num_workers"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{flag(name)} {v!r} must be an integer >= 0")
        for name, lo, lo_ok in (("lr", 0.0, True), ("epochs", 0.0, False), ("min_lr_ratio", 0.0, True),
                                ("weight_decay", 0.0, True), ("grad_clip", 0.0, True), ("step_decay", 0.0, False)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or \
                    not (v >= lo if lo_ok else v > lo):
                raise ValueError(f"{flag(name)} {v!r} must be a finite number {'>=' if lo_ok else '>'} {lo:g}")
        if not (isinstance(self.held_out_fraction, (int, float)) and 0 <= self.held_out_fraction < 1):
            raise ValueError(f"--held-out-fraction {self.held_out_fraction!r} must be in [0, 1)")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"--zero-stage {self.zero_stage!r} must be 0, 1, 2 or 3")
        self.activation_checkpointing = checkpointing_mode(self.activation_checkpointing)
        if self.attention_kernel not in CUDA_ATTENTION_KERNELS:
            raise ValueError(f"attention_kernel {self.attention_kernel!r}: expected one of {CUDA_ATTENTION_KERNELS}")
        if self.init_head not in INIT_HEADS:
            raise ValueError(f"init_head {self.init_head!r}: expected one of {INIT_HEADS}")
        if self.piece_tokens < 0:
            raise ValueError(f"piece_tokens must be >= 0, got {self.piece_tokens}")
        if self.piece_tokens and (self.sequence_parallel > 1 or self.zero_stage >= 3):
            raise ValueError("--piece-tokens splits rows on one process: not with --sequence-parallel (which "
                             "splits them over ranks) or ZeRO-3 (its gradients are taken outside the engine's "
                             "backward, which partitioned parameters do not allow)")
        if not self.aux_noise >= 0:
            raise ValueError(f"aux_noise must be >= 0, got {self.aux_noise}")
        if self.loss_tokens not in LOSS_TOKENS:
            raise ValueError(f"loss_tokens {self.loss_tokens!r}: expected one of {LOSS_TOKENS}")
        if self.loss not in LOSSES:
            raise ValueError(f"--loss {self.loss!r}: expected one of {', '.join(LOSSES)}")
        for name in ("lk_kl_scale", "lk_kl_decay"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"{flag(name)} {v!r} must be a finite number >= 0")
        if self.loss != "lk-hybrid" and (self.lk_kl_scale, self.lk_kl_decay) != (1.0, 1.0):
            # they would be recorded in run.json as if they had shaped the run
            raise ValueError(f"--lk-kl-scale / --lk-kl-decay set the KL weight of --loss lk-hybrid; --loss "
                             f"{self.loss} has none (scale {self.lk_kl_scale}, decay {self.lk_kl_decay} given)")
        if self.follow:  # one pass over a spool: its windows fix the order (data/stream.py)
            if len(self.dump) != 1:
                raise ValueError(f"--follow trains on one spool: --dump names {len(self.dump)} directories")
            if self.epochs != 1.0:
                raise ValueError(f"--follow trains one pass over the spool as it is written: --epochs {self.epochs} "
                                 "(for several passes, train on the finished dump without --follow)")
            if self.delete_consumed and self.grad_accum > 1:
                raise ValueError("--delete-consumed checkpoints at every window's end, which can fall between the "
                                 f"{self.grad_accum} micro-batches of an optimizer step (--grad-accum): a resume would "
                                 "lose the partial gradient; raise --token-budget instead")
        elif self.delete_consumed or self.follow_timeout is not None:
            raise ValueError("--delete-consumed and --follow-timeout go with --follow")
        if self.follow_timeout is not None and not self.follow_timeout > 0:
            raise ValueError(f"--follow-timeout {self.follow_timeout!r} must be > 0")
        self.reporters()  # refuse an unknown tracker before anything starts

    def reporters(self) -> list[str]:
        """--report-to as a list of tracker names ([] for 'none')."""
        names = [n.strip() for n in str(self.report_to).split(",") if n.strip() and n.strip() != "none"]
        bad = [n for n in names if n not in REPORTERS]
        if bad:
            raise ValueError(f"--report-to {self.report_to!r}: unknown {bad}; expected a comma-separated subset of "
                             f"{', '.join(REPORTERS)}, or none")
        return names

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def train_parser() -> argparse.ArgumentParser:
    """The train flags, as a parent parser for `eagle3 train` (and through it `deepspeed --module eagle3.train`)."""
    ap = argparse.ArgumentParser(add_help=False)
    add_options(ap, TrainConfig, hf_style=True)
    ap.add_argument("--config", default=None, help="configs/train preset name or a YAML file (its keys are the "
                                                   "options below, with underscores); flags override it")
    ap.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed
    return ap


_YAML_TYPES = {"int": (int,), "float": (int, float), "bool": (bool,), "str": (str,), "None": (type(None),),
               "list": (list,), "tuple": (list, tuple), "dict": (dict,)}


def _check_types(values: dict, source: str) -> None:
    """Each --config value against its TrainConfig field's annotation (a YAML `lr: fast` or `zero_stage: [2]` is
    refused by name here, not as a TypeError deep in the run)."""
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    for name, v in values.items():
        ann = fields[name].type if isinstance(fields[name].type, str) else getattr(fields[name].type, "__name__", "")
        allowed = tuple(t for part in ann.split("|") for t in _YAML_TYPES.get(part.strip().split("[")[0], ()))
        if not allowed:
            continue
        if isinstance(v, bool) and bool not in allowed or not isinstance(v, allowed):
            raise ValueError(f"{source}: {name}: {v!r} is a {type(v).__name__}, expected {ann}")


def load_yaml(name_or_path: str) -> dict:
    """A --config preset or YAML file as a dict; a file that is not YAML, not a mapping, or asks for Python objects
    (`!!python/...` tags, refused by the safe loader) is a ValueError naming it."""
    if os.path.isfile(name_or_path):
        try:
            with open(name_or_path, encoding="utf-8") as fh:
                values = yaml.safe_load(fh)
        except (yaml.YAMLError, UnicodeDecodeError) as e:
            raise ValueError(f"--config {name_or_path}: not a YAML file this loader reads "
                             f"({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None
    else:
        values = presets.load("train", name_or_path)
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ValueError(f"--config {name_or_path}: expected a mapping of training options, got a "
                         f"{type(values).__name__}")
    return values


def from_args(a: argparse.Namespace) -> TrainConfig:
    values = load_yaml(a.config) if a.config else {}
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = set(values) - known
    if unknown:
        raise ValueError(f"{a.config}: unknown training options {sorted(unknown)}")
    _check_types(values, f"--config {a.config}")
    values.update(given(TrainConfig, a, hf_style=True))
    if "betas" in values:
        values["betas"] = tuple(values["betas"])
    cfg = TrainConfig(**values)
    if not cfg.dump or not cfg.target:
        raise ValueError("--dump and --target are required (on the command line or in --config)")
    return cfg
