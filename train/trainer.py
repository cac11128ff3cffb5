"""The DeepSpeed trainer: fit an EAGLE-3 drafter on standardized dump data.

    deepspeed --num_gpus N --module eagle3.train --dump DIR... --target DIR --out RUN [--config kimi-k2.5] ...
    eagle3 train ...                                   (one process)

RUN/ holds run.json (the capture contract, the data's sha256, vocab, standardize version, drafter and training
config, and what each resume changed), vocab.safetensors, metrics.jsonl, and checkpoints/stepNNNNNNNN/ (DeepSpeed's
own files for exact resume, drafter.safetensors with the consolidated weights, and eagle3_checkpoint.json, written
last, with every file's sha256: see checkpoint.py).

--resume continues the run from checkpoints/latest with the same data order and held-out split: it refuses any
option whose change would alter them or the run the checkpoint continues, and allows only RESUMABLE ones (the
training length, checkpoint/eval/log cadence, speed-only switches), recorded in run.json's `resumes`.
"""

from __future__ import annotations

import json
import math
import os
import time

import torch
from torch import nn
from tqdm import tqdm

from eagle3 import contract as C
from eagle3 import dist as D
from eagle3.atomic import replaced_dir
from eagle3.records import (BEST_DIR, CHECKPOINTS_DIR, CKPT_FILE, DRAFTER_WEIGHTS_FILE, METRICS_FILE, RUN_FILE,
                            VOCAB_FILE, CheckpointRecord, RunRecord, checkpoint_tag)
from eagle3.train import checkpoint as CK
from eagle3.model import kernels
from eagle3.train.config import TrainConfig
from eagle3.train.trackers import MetricsLog, last_metrics, truncate_metrics

# Options a resume may change. None of them moves a sample between the training and held-out sets, reorders or
# rebatches the data, or changes the optimizer, loss or held-out measure the checkpoint continues with. The training
# length (max_steps, epochs) may change as long as the run does not end before its checkpoint; the cosine LR
# schedule then continues on the curve of the new length. Dumps and target may be given by other paths: their
# contents are compared (data_sha256, the target identity).
RESUMABLE = frozenset({"max_steps", "epochs", "save_interval", "keep_checkpoints", "eval_interval", "keep_best",
                       "log_interval", "num_workers", "activation_checkpointing", "piece_tokens", "fast_path",
                       "attention_kernel", "teacher_chunk_tokens", "report_to", "wandb_project", "wandb_mode",
                       "progress", "stop_after_steps", "resume", "dump", "target", "out", "trust_remote_code"})


# The per-step sums a training step reports (the loss metrics' own names), summed over tokens, ranks and log
# intervals as they are, then turned into means by `pooled`.
STATS = ("ce_sum", "correct", "count", "alpha_sum")


class DrafterTrainStep(nn.Module):
    """What DeepSpeed wraps: the drafter and its loss, so that under ZeRO-3 every parameter the loss touches
    (norm, lm_head) is gathered inside forward. The target's lm_head is a frozen buffer (the teacher); its draft-vocab
    rows are a second one, enough for the teacher when the dump recorded the full-vocab argmax (`target_argmax`).
    fast: kernels.py's forward and fused loss (they read weights directly, so ZeRO-3 keeps the plain path)."""

    def __init__(self, drafter: nn.Module, target_lm_head: torch.Tensor, cfg: TrainConfig):
        from eagle3.train.loss import Objective
        super().__init__()
        self.drafter = drafter
        self.steps, self.decay, self.chunk = cfg.ttt_steps, cfg.step_decay, cfg.teacher_chunk_tokens
        self.objective = Objective(cfg.loss, cfg.lk_kl_scale, cfg.lk_kl_decay)
        self.fast = bool(cfg.fast_path) and cfg.zero_stage < 3
        self.sp_group = None  # sequence parallel: this rank's group (set by train())
        self.piece_tokens = cfg.piece_tokens
        kernels.set_cuda_attention_kernel(cfg.attention_kernel)
        if not self.fast and cfg.activation_checkpointing in ("step", "step_mlp"):
            raise ValueError(f"--activation-checkpointing {cfg.activation_checkpointing} needs the fast path "
                             "(--fast-path, ZeRO 0-2); the plain path recomputes the MLP only ('mlp')")
        self.register_buffer("target_lm_head", target_lm_head, persistent=False)
        draft_rows = target_lm_head[drafter.t2d.to(target_lm_head.device)].clone() if self.fast else None
        self.register_buffer("draft_head", draft_rows, persistent=False)

    def forward(self, hidden_state, input_ids, attention_mask, loss_mask, target_hidden, target_argmax=None,
                with_hits: bool = False):
        """(loss, stats [len(STATS), K]: the STATS sums); with_hits (held-out evaluation, no grad) also the
        [B, T, K] draft hits that acceptance.walk replays as decoding would."""
        from eagle3.train.loss import eagle3_loss, eagle3_loss_fused, full_vocab_argmax
        if self.sp_group is not None:  # this rank's chunk of every row (train/sequence_parallel.py)
            from eagle3.train.sequence_parallel import sequence_parallel_loss
            r = sequence_parallel_loss(self.drafter, self.target_lm_head, hidden_state, input_ids, loss_mask,
                                       target_hidden, steps=self.steps, decay=self.decay, chunk_tokens=self.chunk,
                                       attention_mask=attention_mask, group=self.sp_group,
                                       target_argmax=target_argmax, with_hits=with_hits, fast=self.fast,
                                       draft_head=self.draft_head, objective=self.objective)
            stats = torch.stack([r[1][k] for k in STATS])
            return (r[0], stats, r[2]) if with_hits else (r[0], stats)
        pieces = -(-input_ids.shape[1] // self.piece_tokens) if self.piece_tokens else 1
        if pieces > 1 and torch.is_grad_enabled() and not with_hits:  # one piece's activations at a time
            from eagle3.train.sequence_parallel import sequence_pieces_loss
            loss, m = sequence_pieces_loss(self.drafter, self.target_lm_head, hidden_state, input_ids, loss_mask,
                                           target_hidden, pieces=pieces, steps=self.steps, decay=self.decay,
                                           chunk_tokens=self.chunk, attention_mask=attention_mask,
                                           target_argmax=target_argmax, fast=self.fast, draft_head=self.draft_head,
                                           objective=self.objective)
            return loss, torch.stack([m[k] for k in STATS])
        outs = self.drafter(hidden_state, input_ids, attention_mask, steps=self.steps, fast=self.fast)
        if with_hits:
            from eagle3.train.acceptance import draft_hits
            targ = target_argmax if target_argmax is not None else \
                full_vocab_argmax(target_hidden, self.target_lm_head, self.chunk)
            hits = draft_hits(self.drafter, outs, targ.long(), self.chunk)
        if self.fast:
            loss, m = eagle3_loss_fused(self.drafter, outs, target_hidden, input_ids, loss_mask, attention_mask,
                                        self.decay, self.chunk, lm_head_weight=self.target_lm_head,
                                        target_argmax=target_argmax, draft_head_weight=self.draft_head,
                                        objective=self.objective)
        else:
            loss, m = eagle3_loss(self.drafter, outs, target_hidden, self.target_lm_head, input_ids, loss_mask,
                                  attention_mask, decay=self.decay, chunk_tokens=self.chunk, objective=self.objective)
        stats = torch.stack([m[k] for k in STATS])
        return (loss, stats, hits) if with_hits else (loss, stats)


def noisy_aux(hidden_state: torch.Tensor, scale: float, num_aux: int, seed: int) -> torch.Tensor:
    """hidden_state [B, T, num_aux * H] plus Gaussian noise whose std is `scale` times each captured layer's RMS at
    that token (the layers' scales differ by orders of magnitude; one absolute std would drown the low one and
    miss the high one). `seed` fixes the draw (the trainer derives it from the run's seed, data-parallel rank and
    step, so a resumed run draws what an uninterrupted one would)."""
    B, T, D = hidden_state.shape
    x = hidden_state.view(B, T, num_aux, D // num_aux)
    acc = torch.promote_types(x.dtype, torch.float32)
    rms = x.to(acc).pow(2).mean(-1, keepdim=True).sqrt()
    g = torch.Generator(device=x.device).manual_seed(seed)
    noise = torch.randn(x.shape, generator=g, device=x.device, dtype=acc)
    return (x.to(acc) + scale * rms * noise).to(x.dtype).view(B, T, D)


# ----------------------------------------------------------------------------------------------- set-up pieces

def check_target_matches_dumps(target_dir: str, manifest: C.DumpManifest, trust_remote_code: bool = False) -> None:
    """The target named for training must be the one the dumps were made with. `trust_remote_code`: run the
    tokenizer code the target ships (Kimi-K2.5), refused otherwise (target/load.py load_tokenizer)."""
    from eagle3.target.load import load_tokenizer, target_identity, target_info, tokenizer_info
    info = target_info(target_dir, like=manifest.target.weights_sha256)
    mine = target_identity(info, tokenizer_info(load_tokenizer(target_dir, trust_remote_code=trust_remote_code)))
    dumped = {k: v for k, v in manifest.identity().items() if k in mine}
    C.require_same_capture(dumped, mine, "the dumps", f"--target {target_dir}")


def drafter_config(cfg: TrainConfig, target_dir: str, num_aux: int):
    """Drafter shape: a configs/drafters preset (or the target's own attention/MLP shape for 'auto'), with the
    vocab and target hidden size always taken from the target."""
    from eagle3 import presets
    from eagle3.target.load import read_config, text_config_dict
    from eagle3.model import OPTIONS, DrafterConfig
    t = text_config_dict(read_config(target_dir))
    rope = t.get("rope_parameters") or {}
    derived = dict(hidden_size=t["hidden_size"], num_attention_heads=t["num_attention_heads"],
                   num_key_value_heads=t.get("num_key_value_heads") or t["num_attention_heads"],
                   head_dim=t.get("head_dim") or t["hidden_size"] // t["num_attention_heads"],
                   intermediate_size=t["intermediate_size"], rms_norm_eps=t.get("rms_norm_eps", 1e-6),
                   rope_theta=float(rope.get("rope_theta", t.get("rope_theta", 10000.0))),
                   max_position_embeddings=t.get("max_position_embeddings", 4096), draft_vocab_size=32000)
    if cfg.drafter != "auto":
        preset = presets.load("drafters", cfg.drafter)
        if preset.get("layout") == "mla":
            derived.pop("head_dim")  # MLA's is qk_nope + qk_rope, not the target's
        derived.update(preset)
    if cfg.draft_vocab_size:
        derived["draft_vocab_size"] = cfg.draft_vocab_size
    for option in OPTIONS:  # --fc-norm / --norm-before-fc / --norm-output over the preset's
        if getattr(cfg, option) is not None:
            derived[option] = bool(getattr(cfg, option))
    derived["draft_vocab_size"] = min(derived["draft_vocab_size"], t["vocab_size"])
    if derived["hidden_size"] != t["hidden_size"]:
        raise ValueError(f"drafter hidden_size {derived['hidden_size']} != target hidden_size {t['hidden_size']}: "
                         "SGLang feeds the drafter the target's own token embedding")
    return DrafterConfig(vocab_size=t["vocab_size"], target_hidden_size=t["hidden_size"], num_aux_layers=num_aux,
                         **derived)


def lr_schedule(opt: torch.optim.Optimizer, cfg: TrainConfig, optimizer_steps: int):
    """Linear warm-up over --warmup-steps (from 0 at the first step), then a half cosine from --lr down to
    --lr x --min-lr-ratio at the last step: transformers' own schedule. Its lambda is rebuilt from the config on
    every start and only the step count is restored from a checkpoint, so a resume continues on the curve of the
    run's (possibly new) length."""
    from transformers import get_cosine_with_min_lr_schedule_with_warmup
    return get_cosine_with_min_lr_schedule_with_warmup(opt, num_warmup_steps=cfg.warmup_steps,
                                                       num_training_steps=optimizer_steps,
                                                       min_lr_rate=cfg.min_lr_ratio)


def deepspeed_config(cfg: TrainConfig, on_gpu: bool) -> dict:
    from eagle3 import presets
    ds = presets.load("deepspeed", f"zero{cfg.zero_stage}")
    ds["gradient_accumulation_steps"] = cfg.grad_accum
    ds["gradient_clipping"] = cfg.grad_clip
    ds["bf16"] = {"enabled": bool(cfg.bf16)}
    if not on_gpu:
        ds["zero_optimization"]["overlap_comm"] = False
    return ds


def pooled(stats: torch.Tensor) -> dict:
    """stats [len(STATS), K] = (ce_sum, correct, count, alpha_sum) summed over tokens (and ranks) -> per-step
    metrics: loss_j the soft cross-entropy (whatever --loss is), acc_j, alpha_j the mean expected acceptance."""
    from eagle3.train.loss import summarize
    ce, correct, count, alpha = stats.double().cpu()
    s = summarize(ce, correct, count, alpha)
    return {"loss_j": s["loss_per_step"].tolist(), "acc_j": s["acc_per_step"].tolist(),
            "alpha_j": s["alpha_per_step"].tolist(), "accept_len": float(s["acceptance_length"]),
            "counted": int(count[0])}


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(t)
    return t


def consolidated_state_dict(engine) -> dict[str, torch.Tensor]:
    """The drafter's full weights on every rank (ZeRO-3 gathers its partitions), as exported to SGLang."""
    import deepspeed
    drafter = engine.module.drafter
    params = list(drafter.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None, enabled=engine.zero_optimization_stage() == 3):
        return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in drafter.export_state_dict().items()}


def _drafter_bytes(weights: dict[str, torch.Tensor], step: int, run_record: RunRecord) -> bytes:
    """The consolidated drafter as safetensors, its metadata holding the step and what the weights mean
    (records.MEANING_KEY): export checks the checkpoint's record against it."""
    from safetensors.torch import save
    from eagle3.records import MEANING_KEY
    return save(weights, metadata={"eagle3_step": str(step), MEANING_KEY: run_record.meaning_sha256()})


def save_checkpoint(engine, run_dir: str, step: int, cfg: TrainConfig, world: D.World, run_record: RunRecord) -> str:
    """checkpoints/stepN: DeepSpeed's state, the consolidated drafter, then the record with every file's sha256
    (complete from then on), then `latest`, and only then the deletion of older checkpoints."""
    root = os.path.join(run_dir, CHECKPOINTS_DIR)
    tag = checkpoint_tag(step)
    path = os.path.join(root, tag)
    if world.is_main and CK.is_complete(path):
        # left by an abandoned attempt that got this far: incomplete until this save has rewritten and recorded it
        os.remove(os.path.join(path, CKPT_FILE))
    rng = {"torch": torch.get_rng_state().tolist()}
    engine.save_checkpoint(root, tag=tag, client_state={"step": step, "rng": rng}, save_latest=False)
    weights = consolidated_state_dict(engine)
    D.run_on_main(lambda: CK.write_bytes_atomic(os.path.join(path, DRAFTER_WEIGHTS_FILE),
                                                _drafter_bytes(weights, step, run_record)), world)
    sha256 = CK.hash_files(path, world)

    def complete():
        CK.write_record(path, CheckpointRecord.of_run(run_record, step=step, tag=tag, weights=DRAFTER_WEIGHTS_FILE,
                                                      sha256=sha256))
        CK.set_latest(root, tag)
        CK.rotate(root, tag, cfg.keep_checkpoints)
    D.run_on_main(complete, world)
    return path


def save_best(engine, run_dir: str, step: int, world: D.World, run_record: RunRecord, best: dict) -> None:
    """checkpoints/best/: the consolidated drafter with the best held-out decoding acceptance so far (for export:
    `export-sglang --step best`); replaced atomically (written aside, then renamed over)."""
    weights = consolidated_state_dict(engine)

    def write():
        data = _drafter_bytes(weights, step, run_record)
        with replaced_dir(os.path.join(run_dir, CHECKPOINTS_DIR, BEST_DIR)) as tmp:
            CK.write_bytes_atomic(os.path.join(tmp, DRAFTER_WEIGHTS_FILE), data)
            CK.write_record(tmp, CheckpointRecord.of_run(run_record, step=step, tag=BEST_DIR,
                                                         weights=DRAFTER_WEIGHTS_FILE, best=best,
                                                         sha256={DRAFTER_WEIGHTS_FILE: C.sha256_bytes(data)}))
    D.run_on_main(write, world)


def _read_best(run_dir: str) -> dict | None:
    path = os.path.join(run_dir, CHECKPOINTS_DIR, BEST_DIR, CKPT_FILE)
    if not os.path.isfile(path):
        return None
    return CheckpointRecord.read(path).best


def data_sha256(dumps) -> str:
    """What the data order depends on: every shard's sha256, dump by dump, in the order given."""
    return C.sha256_bytes(C.canonical_json([[s.sha256 for s in m.shards] for m in dumps.manifests]))


def resume_changes(run_path: str, old: RunRecord, cfg: TrainConfig, identity: dict, data_sha: str,
                   world_size: int) -> dict:
    """{option: [before, now]} for the RESUMABLE options changed since the run was started (or last resumed);
    a difference in anything else is refused, naming every one."""
    C.require_same_capture(old.identity, identity, f"the run being resumed ({run_path})",
                           "the dumps given now")
    problems = []
    if old.data_sha256 != data_sha:
        problems.append(f"the dumps hold other data (shard sha256s: {old.data_sha256} -> {data_sha})")
    if old.world_size != world_size:
        problems.append(f"world size {old.world_size} -> {world_size} (it sets the batches)")
    now = json.loads(json.dumps(cfg.to_dict()))
    # An option added since the run was recorded ran as its default then (e.g. --loss: kl): compare it as such.
    defaults = json.loads(json.dumps(TrainConfig().to_dict()))
    before = {**{k: v for k, v in defaults.items() if k not in old.train}, **old.train}
    changed = {k: [before.get(k), v] for k, v in now.items() if before.get(k) != v}
    problems += [f"--{k.replace('_', '-')}: {a!r} -> {b!r}" for k, (a, b) in changed.items() if k not in RESUMABLE]
    if problems:
        raise ValueError(f"--resume: {run_path} was trained otherwise; a resume keeps the data order, the held-out "
                         "split and the run its checkpoint continues (start a new run with another --out to change "
                         "them):\n  " + "\n  ".join(problems))
    return {k: c for k, c in changed.items() if k != "resume"}


def vocab_source(cfg: TrainConfig, data_sha: str, size: int, init=None) -> dict:
    """What the draft vocabulary was made from: the --vocab file, the --init-from export's map, or the training
    split of these dumps."""
    if cfg.vocab:
        return {"file": os.path.abspath(cfg.vocab), "sha256": C.file_sha256(cfg.vocab)}
    if init is not None:
        return {"init_from": init.path, "model_safetensors_sha256": init.weights_sha256}
    return {"data_sha256": data_sha, "held_out_fraction": cfg.held_out_fraction, "seed": cfg.seed,
            "draft_vocab_size": size}


def traces_of_a_run(run_dir: str) -> list[str]:
    """What a fresh run would mix with or overwrite: metrics rows, checkpoints."""
    found = []
    metrics = os.path.join(run_dir, METRICS_FILE)
    if os.path.isfile(metrics) and os.path.getsize(metrics):
        found.append(metrics)
    root = os.path.join(run_dir, CHECKPOINTS_DIR)
    if os.path.isdir(root) and os.listdir(root):
        found.append(root)
    return found


# ------------------------------------------------------------------------------------------------- the job

def train(cfg: TrainConfig) -> dict:
    import deepspeed

    from eagle3.data.dumps import BATCH_SCALES, DumpSet, dequantize_batch, split
    from eagle3.data.loader import BatchPlan, make_loader
    from eagle3.data.vocab import build_vocab, describe_vocab, load_vocab, save_vocab
    from eagle3.model import Eagle3Drafter
    from eagle3.train.init_from import check_same_vocab, load_into, read_init_from
    from eagle3.target.weights import load_embedding_and_head, load_final_norm

    D.launcher_env()
    on_gpu = torch.cuda.is_available()
    # On CPUs, subnormal floats (softmax tails of a peaked teacher) cost 100x per op: flush them to zero.
    torch.set_flush_denormal(True)
    deepspeed.init_distributed(dist_backend="nccl" if on_gpu else "gloo")
    world = D.init_world("cuda" if on_gpu else "cpu")
    log = D.main_log(world.is_main)
    run_dir = cfg.out

    # ---- the contract: dumps agree with each other (DumpSet), with the target, and with a resumed run
    dumps = D.run_on_main(lambda: DumpSet(cfg.dump, verify=True, progress=cfg.progress), world)
    if dumps is None:
        dumps = DumpSet(cfg.dump, verify=False)
    # An fp8 dump is dequantized where training runs (to_device), not by the loader's CPU workers: at the Kimi
    # shape they would feed an H200 at ~1.3x its rate (bench/RESULTS.md, fp8 storage). On a CPU the multiply just
    # moves to the main process, a few ms next to a step there; one path for both.
    dumps.fp8_in_batch = True
    manifest = dumps.manifest
    D.run_on_main(lambda: check_target_matches_dumps(cfg.target, manifest, cfg.trust_remote_code), world)
    train_refs, held_refs = split(dumps.refs, cfg.held_out_fraction, cfg.seed)
    if not train_refs:
        raise ValueError("no training samples after the held-out split")

    data_sha = data_sha256(dumps)
    # Sequence parallel: groups of `sp` consecutive ranks split each batch's positions; the data is dealt to groups.
    sp = cfg.sequence_parallel
    if sp < 1 or world.world_size % sp:
        raise ValueError(f"--sequence-parallel {sp}: the world size ({world.world_size}) must be a multiple of it")
    sp_group = D.sequence_parallel_group(world, sp)
    dp_rank, dp_size = world.rank // sp, world.world_size // sp
    plan = BatchPlan([r.length for r in train_refs], cfg.token_budget, cfg.seed, dp_rank, dp_size)
    steps_per_epoch = len(plan.epoch(0))
    total = cfg.max_steps or max(1, int(cfg.epochs * steps_per_epoch))
    total -= total % cfg.grad_accum

    ckpt_root = os.path.join(run_dir, CHECKPOINTS_DIR)
    run_path = os.path.join(run_dir, RUN_FILE)
    vocab_path = os.path.join(run_dir, VOCAB_FILE)
    resume_tag = CK.resume_tag(ckpt_root) if cfg.resume else None
    if cfg.resume and resume_tag is None:
        raise FileNotFoundError(f"--resume: no checkpoint in {ckpt_root}")
    resume_dir = os.path.join(ckpt_root, resume_tag) if resume_tag else None
    resume_rec = CK.read_record(resume_dir) if resume_dir else None
    # --init-from: the export is checked against the dumps before anything is written (train/init_from.py)
    init = read_init_from(cfg.init_from, manifest, cfg.init_from_sglang) if cfg.init_from else None
    if init is not None:
        from eagle3.model import OPTIONS
        clash = [f"--{o.replace('_', '-')} {getattr(cfg, o)}" for o in OPTIONS
                 if getattr(cfg, o) is not None and bool(getattr(cfg, o)) != getattr(init.config, o)]
        if clash:
            raise ValueError(f"--init-from {init.path}: its drafter has {init.config.options or 'no EAGLE-3.1 option'} "
                             f"on; {', '.join(clash)} would train another architecture than the weights it starts "
                             "from (drop the flag)")
        log(f"[train] starting from {init.path} (served capture HF {init.served_capture}, draft vocab "
            f"{init.config.draft_vocab_size}); the drafter's shape is the export's")

    # ---- checks only: nothing in RUN is changed until the run is known to be startable
    def prepare_run_dir() -> dict | None:
        """Fresh: the vocabulary in place. Resume: {option: [before, now]} of the allowed changes."""
        if resume_tag is not None:
            old = RunRecord.read(run_path)
            changes = resume_changes(run_path, old, cfg, manifest.identity(), data_sha, world.world_size)
            if total < resume_rec.step:
                raise ValueError(f"--resume: the run would end at step {total}, before its checkpoint {resume_dir} "
                                 f"(step {resume_rec.step}): give a --max-steps of at least that")
            if C.file_sha256(vocab_path) != old.vocab_sha256:
                raise CK.CheckpointError(f"{vocab_path}: sha256 differs from the one {run_path} records "
                                         f"({old.vocab_sha256}): the draft vocabulary the checkpoints were "
                                         "trained with was replaced or altered")
            started = (old.extra.get("init_from") or {}).get("model_safetensors_sha256")
            if init is not None and started != init.weights_sha256:
                raise CK.CheckpointError(f"--init-from {init.path}: its weights are not the ones {run_path} started "
                                         "from (the export was replaced since)")
            return {"step": resume_rec.step, "from": resume_tag, "changed": changes}
        traces = traces_of_a_run(run_dir)
        if traces:
            raise ValueError(f"{run_dir} already holds a training run ({', '.join(traces)}): pass --resume, or "
                             "choose another --out")
        os.makedirs(run_dir, exist_ok=True)
        n = (init.config.draft_vocab_size if init is not None
             else drafter_config(cfg, cfg.target, len(manifest.capture.hidden_state_indices)).draft_vocab_size)
        source = vocab_source(cfg, data_sha, n, init)
        try:  # one a failed start left here is kept only if it was made from the same data and settings
            if load_vocab(vocab_path)["meta"].get("source") == source:
                return None
        except Exception:  # absent, or unreadable: made anew below
            pass
        if cfg.vocab:
            vocab = load_vocab(cfg.vocab)
            ident = vocab["meta"].get("identity")
            if not isinstance(ident, dict):  # nothing says which target's dumps it counts
                raise C.ContractError(f"--vocab {cfg.vocab}: records no identity of the dumps it was built from; "
                                      "build it with `eagle3 vocab --dump ...` of these dumps")
            C.require_same_capture(ident, manifest.identity(), f"vocab {cfg.vocab}", "the dumps")
            if init is not None:
                check_same_vocab(init, vocab, cfg.vocab)
        elif init is not None:  # the export's lm_head rows are its map's tokens: train with that map
            vocab = init.vocab(manifest.identity())
        else:
            vocab = build_vocab(dumps, train_refs, n, progress=cfg.progress)
            log(f"[train] draft vocab {describe_vocab(vocab['meta'])}")
        vocab["meta"]["source"] = source
        save_vocab(vocab_path, vocab)
        return None
    resumed = D.broadcast_object(D.run_on_main(prepare_run_dir, world))
    vocab = load_vocab(vocab_path)
    if resume_dir is not None:  # every file DeepSpeed and we will read, against the checkpoint's record
        CK.check_files(resume_dir, resume_rec, world=world)

    # ---- the model
    dcfg = init.config if init is not None else drafter_config(cfg, cfg.target,
                                                               len(manifest.capture.hidden_state_indices))
    if vocab["d2t"].numel() != dcfg.draft_vocab_size:
        dcfg.draft_vocab_size = vocab["d2t"].numel()
    torch.manual_seed(cfg.seed)
    drafter = Eagle3Drafter(dcfg)
    embed, head = load_embedding_and_head(cfg.target)
    drafter.load_target_embedding(embed.float())
    drafter.set_vocab_map(vocab["d2t"], vocab["t2d"])
    if init is not None:
        load_into(drafter, init)
    elif cfg.init_head == "target":
        drafter.load_target_head(head.float(), load_final_norm(cfg.target).float())
    drafter.activation_checkpointing = cfg.activation_checkpointing
    model = DrafterTrainStep(drafter, head.float(), cfg)
    model.sp_group = sp_group
    old_resumes = RunRecord.read(run_path).resumes if resume_tag and world.is_main else []
    run_record = RunRecord(identity=manifest.identity(), capture=manifest.capture, target=manifest.target,
                           standardize=C.STANDARDIZE_VERSION, vocab=VOCAB_FILE, vocab_meta=vocab["meta"],
                           vocab_sha256=C.file_sha256(vocab_path), drafter=dcfg.to_dict(), train=cfg.to_dict(),
                           world_size=world.world_size, data_sha256=data_sha,
                           dumps=[os.path.abspath(d) for d in cfg.dump],
                           resumes=D.broadcast_object(old_resumes + ([resumed] if resumed else [])),
                           extra={"init_from": init.record()} if init is not None else {})

    def commit_run_dir():
        if resume_tag is not None:
            dropped = truncate_metrics(os.path.join(run_dir, METRICS_FILE), resume_rec.step)
            if dropped:
                log(f"[train] {METRICS_FILE}: dropped {dropped} rows past step {resume_rec.step} (recomputed now)")
        CK.write_bytes_atomic(run_path, json.dumps(run_record.to_dict(), indent=1).encode())
    D.run_on_main(commit_run_dir, world)

    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay,
                            fused=on_gpu or None)
    sched = lr_schedule(opt, cfg, total // cfg.grad_accum)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=sched,
                                           config=deepspeed_config(cfg, on_gpu))
    CK.install_safe_engine(engine)
    step = 0
    if resume_tag is not None:
        _, client = engine.load_checkpoint(ckpt_root, tag=resume_tag)
        if client is None or client.get("step") != resume_rec.step:
            raise CK.CheckpointError(f"{resume_dir}: DeepSpeed's state holds step "
                                     f"{None if client is None else client.get('step')}, the record "
                                     f"{resume_rec.step}")
        step = client["step"]
        torch.set_rng_state(torch.tensor(client["rng"]["torch"], dtype=torch.uint8))
        log(f"[train] resumed {run_dir} at step {step} ({resume_tag})"
            + (f"; changed: {resumed['changed']}" if resumed["changed"] else ""))
    n_params = sum(p.numel() for p in trainable)
    log(f"[train] drafter {n_params / 1e6:.1f}M trainable params, layout {dcfg.layout}"
        f"{' + ' + ' + '.join(dcfg.options) if dcfg.options else ''}, draft vocab {dcfg.draft_vocab_size}, "
        f"capture HF {manifest.capture.hidden_state_indices}; {len(train_refs)} train / {len(held_refs)} held-out "
        f"samples; {total} micro-steps ({steps_per_epoch}/epoch/rank), world {world.world_size}"
        + (f" (sequence parallel {sp})" if sp > 1 else "") + ", ZeRO "
        f"{cfg.zero_stage}, bf16 {cfg.bf16}")

    dtype = torch.bfloat16 if cfg.bf16 else torch.float32
    device = world.device
    metrics = MetricsLog(run_dir, cfg, world.is_main, resume_step=step if resume_tag is not None else None)

    def to_device(b):
        # fp8 states (and their float32 scales) move as stored; dequantize_batch multiplies them out there
        return dequantize_batch({k: (v.to(device, dtype=dtype, non_blocking=True)
                                     if v.is_floating_point() and v.dtype != torch.float8_e4m3fn
                                     and k not in BATCH_SCALES
                                     else v.to(device, non_blocking=True)) for k, v in b.items()}, dtype)

    def model_inputs(b, train_step: bool = False):
        # --loss-tokens all: training learns at every real position; the held-out evaluation keeps the dump's mask
        # (the answers decoding is judged on)
        mask = b["attention_mask"] if train_step and cfg.loss_tokens == "all" else b["loss_mask"]
        hs = b["hidden_state"]
        if train_step and cfg.aux_noise > 0:  # --aux-noise: training batches only, never the held-out evaluation
            # by data-parallel rank: a sequence-parallel group holds one batch, and its ranks must see one draw
            seed = (cfg.seed * 1_000_003 + dp_rank) * 1_000_003 + step
            hs = noisy_aux(hs, cfg.aux_noise, dcfg.num_aux_layers, seed)
        return (hs, b["input_ids"], b["attention_mask"], mask, b["target_hidden"], b.get(C.TARGET_ARGMAX))

    accept_k = min(cfg.accept_steps or cfg.ttt_steps, cfg.ttt_steps)

    def evaluate() -> dict:
        """Held-out: teacher-forced acc_j as in training, and the decoding replay (acceptance.walk): what greedy
        chain drafting with `accept_k` steps accepts on these (target-written) answers."""
        from eagle3.train.acceptance import ChainStats, walk
        eval_plan = BatchPlan([r.length for r in held_refs], cfg.token_budget, cfg.seed, dp_rank, dp_size,
                              shuffle=False)
        stats = torch.zeros(len(STATS), cfg.ttt_steps, dtype=torch.float64, device=device)
        # one replay per chain length 1..accept_k (the same hits, walked with each k): what `eagle3 eval
        # --draft-steps auto` weighs against the measured costs of each length (eval/chain_length.py)
        chains = [ChainStats(k) for k in range(1, accept_k + 1)]
        engine.eval()
        n = min(cfg.eval_batches, len(eval_plan.epoch(0)))
        with torch.no_grad():
            for b in make_loader(dumps, held_refs, eval_plan, 0, n, num_workers=0):
                b = to_device(b)
                _, s, hits = engine(*model_inputs(b), with_hits=True)
                stats += s
                if world.rank % sp == 0:  # a sequence-parallel group holds the same hits on every rank: walk once
                    for c in chains:
                        walk(hits, b["loss_mask"], b["attention_mask"], c.draft_steps, cfg.accept_max_new_tokens,
                             stats=c)
        engine.train()
        pooled_chains = all_reduce_sum(torch.cat([c.as_tensor() for c in chains]).to(device)).cpu()
        sizes = [2 + 2 * c.draft_steps for c in chains]
        chains = [ChainStats.from_tensor(t, c.draft_steps) for t, c in zip(pooled_chains.split(sizes), chains)]
        chain = chains[-1]
        return {**pooled(all_reduce_sum(stats)), "decode_steps": accept_k, "rounds": chain.verify_steps,
                "decode_accept_len": chain.acceptance_length, "decode_rate_j": chain.rates,
                "decode_by_steps": [{"steps": c.draft_steps, "accept_len": c.acceptance_length, "rate_j": c.rates}
                                    for c in chains]}

    best = _read_best(run_dir) if resume_tag is not None else None

    loader = make_loader(dumps, train_refs, plan, start_step=step, num_steps=total - step,
                         num_workers=cfg.num_workers, pin_memory=on_gpu)
    bar = tqdm(total=total, initial=step, desc="train", unit="step", disable=not (cfg.progress and world.is_main),
               dynamic_ncols=True)
    engine.train()
    t_last, tokens_since, n_since = time.perf_counter(), 0, 0
    since = torch.zeros(len(STATS) * cfg.ttt_steps + 1, dtype=torch.float64, device=device)  # stats + loss
    result: dict = {}
    postfix: dict = {}
    for batch in loader:
        loss, stats = engine(*model_inputs(to_device(batch), train_step=True))
        # DeepSpeed averages gradients over every rank; a sequence-parallel group's shares add up to one batch's
        engine.backward(loss * sp if sp > 1 else loss)
        engine.step()
        step += 1
        # pooled on the device between log lines: the step itself never waits for the host
        since += torch.cat([stats.reshape(-1), loss.detach().double().reshape(1)])
        tokens_since += int(batch["attention_mask"].sum()) / sp  # a group's ranks count the same batch
        n_since += 1
        if step % cfg.log_interval == 0 or step == total:
            red = all_reduce_sum(torch.cat([since, torch.tensor([float(tokens_since)], dtype=torch.float64,
                                                                device=device)]))
            dt = time.perf_counter() - t_last
            rec = {"step": step, "epoch": plan.position(step - 1)[0],
                   "loss": float(red[-2]) / dp_size / n_since,  # a group's loss shares add up to its batch's
                   **pooled(red[:-2].reshape(len(STATS), -1)), "tokens": int(red[-1]), "tok_s": float(red[-1]) / dt,
                   "lr": sched.get_last_lr()[0], "time": time.time()}
            metrics.write(rec)
            if not math.isfinite(rec["loss"]):  # stop here: no later step or checkpoint can mean anything
                bad = [j for j, v in enumerate(rec.get("loss_j") or []) if not math.isfinite(v)]
                raise FloatingPointError(
                    f"training turned non-finite between steps {step - n_since + 1} and {step}: loss {rec['loss']}"
                    f"{f' (draft steps {bad})' if bad else ''}, lr {rec['lr']:.3g}; the last checkpoint before it "
                    f"is in {os.path.join(run_dir, CHECKPOINTS_DIR)} (check the data, --lr, the drafter config)")
            postfix.update(loss=f"{rec['loss']:.3f}", acc0=f"{rec['acc_j'][0]:.2f}", tau=f"{rec['accept_len']:.2f}",
                           tok_s=f"{rec['tok_s']:,.0f}")
            bar.set_postfix(postfix)
            result = rec
            t_last, tokens_since, n_since = time.perf_counter(), 0, 0
            since.zero_()
        bar.update(1)
        # save first: whatever happens in the evaluation below, the step's weights are on disk
        if step % cfg.save_interval == 0 or step == total:
            bad = [n for n, p in engine.module.named_parameters() if not bool(torch.isfinite(p).all())]
            if bad:  # never saved: a checkpoint of NaN weights would be resumed or exported as if it were one
                raise FloatingPointError(f"training turned non-finite by step {step}: parameters {bad[:6]}"
                                         f"{' ...' if len(bad) > 6 else ''} are not finite; the last checkpoint "
                                         f"before it is in {os.path.join(run_dir, CHECKPOINTS_DIR)}")
            save_checkpoint(engine, run_dir, step, cfg, world, run_record)
        if held_refs and (step % cfg.eval_interval == 0 or step == total):
            ev = {"step": step, "split": "eval", **evaluate()}
            metrics.write(ev)
            result["eval"] = ev
            log(f"\n[eval] step {step}: acc_j {[round(a, 3) for a in ev['acc_j']]}; decoding replay (K={accept_k}): "
                f"acceptance length {ev['decode_accept_len']:.3f}, rate by position "
                f"{[round(a, 2) for a in ev['decode_rate_j']]}")
            if cfg.keep_best and (best is None or ev["decode_accept_len"] > best["decode_accept_len"]):
                best = ev  # the whole held-out record (step, acc_j, decode_*): what the export is judged by
                save_best(engine, run_dir, step, world, run_record, best)
            postfix["heldout_tau"] = f"{ev['decode_accept_len']:.2f}"  # the figure decoding will see
            bar.set_postfix(postfix)
        if cfg.stop_after_steps is not None and step >= cfg.stop_after_steps and step < total:
            bar.close()
            metrics.close()
            raise SystemExit(f"stopped at step {step} (--stop-after-steps)")
    bar.close()
    metrics.close()
    log(f"[train] done: {step} steps -> {run_dir}/checkpoints (latest: {CK.resume_tag(ckpt_root)}"
        + (f", best: step {best['step']}, held-out acceptance length {best['decode_accept_len']:.3f})" if best else ")"))
    if "step" not in result:  # resumed a finished run: nothing trained now, so report what the run recorded
        result = last_metrics(os.path.join(run_dir, METRICS_FILE)) if world.is_main else {}
    if best:
        result["best"] = best
    return result
