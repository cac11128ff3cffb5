"""Everything a training run starts from, checked before anything in RUN is written: the dumps (against each
other, the target and a resumed run), the held-out split and the batch plan, the draft vocabulary, the drafter, the
run record, and the DeepSpeed engine (resumed from its checkpoint under --resume). `set_up` returns them as a `Run`;
train/trainer.py runs its loop.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Callable

import deepspeed
import torch

from eagle3 import contract as C
from eagle3 import dist as D
from eagle3 import presets
from eagle3.data.dumps import DumpSet, split
from eagle3.data.loader import BatchPlan
from eagle3.data.stream import Spool, WindowPlan, open_spool
from eagle3.data.vocab import build_vocab, describe_vocab, load_vocab, save_vocab
from eagle3.model import OPTIONS, DrafterConfig, Eagle3Drafter
from eagle3.records import METRICS_FILE, RUN_FILE, VOCAB_FILE, RunRecord
from eagle3.target.load import load_tokenizer, read_config, target_info, text_config_dict, tokenizer_info
from eagle3.target.weights import load_embedding_and_head, load_final_norm
from eagle3.train import checkpoint as CK
from eagle3.train.config import TrainConfig
from eagle3.train.init_from import check_same_vocab, load_into, read_init_from
from eagle3.train.step import DrafterTrainStep, Parallel
from eagle3.train.trackers import truncate_metrics


@dataclass
class Run:
    """A started run: what the training loop and the held-out evaluation read."""
    cfg: TrainConfig
    world: D.World
    parallel: Parallel
    log: Callable[..., None]
    dumps: DumpSet
    train_refs: list
    held_refs: list
    plan: BatchPlan | WindowPlan
    total: int                  # micro-steps of the whole run
    engine: Any                 # deepspeed.DeepSpeedEngine around a DrafterTrainStep
    sched: Any                  # its learning-rate schedule
    drafter_config: DrafterConfig
    run_record: RunRecord
    step: int                   # the step the loop starts after (0, or the resumed checkpoint's)
    resume: CK.Resume | None
    best: dict | None           # checkpoints/best's held-out record (resumed runs)
    dtype: torch.dtype          # what the states are fed to the drafter in
    spool: Spool | None = None  # --follow: the spool being written (data/stream.py)

    @property
    def device(self) -> torch.device:
        return self.world.device


def check_target_matches_dumps(target_dir: str, manifest: C.DumpManifest, trust_remote_code: bool = False) -> None:
    """The target named for training must be the one the dumps were made with. `trust_remote_code`: run the
    tokenizer code the target ships (Kimi-K2.5), refused otherwise (target/load.py load_tokenizer)."""
    info = target_info(target_dir, like=manifest.target.weights_sha256)
    mine = C.target_identity(info, tokenizer_info(load_tokenizer(target_dir, trust_remote_code=trust_remote_code)))
    dumped = {k: v for k, v in manifest.identity().items() if k in mine}
    C.require_same_capture(dumped, mine, "the dumps", f"--target {target_dir}")


def drafter_config(cfg: TrainConfig, target_dir: str, num_aux: int) -> DrafterConfig:
    """Drafter shape: a configs/drafters preset (or the target's own attention/MLP shape for 'auto'), with the
    vocab and target hidden size always taken from the target."""
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
    ds = presets.load("deepspeed", f"zero{cfg.zero_stage}")
    ds["gradient_accumulation_steps"] = cfg.grad_accum
    ds["gradient_clipping"] = cfg.grad_clip
    ds["bf16"] = {"enabled": bool(cfg.bf16)}
    if not on_gpu:
        ds["zero_optimization"]["overlap_comm"] = False
    return ds


def data_sha256(dumps: DumpSet) -> str:
    """What the data order depends on: every shard's sha256, dump by dump, in the order given."""
    return C.sha256_bytes(C.canonical_json([[s.sha256 for s in m.shards] for m in dumps.manifests]))


def vocab_source(cfg: TrainConfig, data_sha: str, size: int, init=None) -> dict:
    """What the draft vocabulary was made from: the --vocab file, the --init-from export's map, or the training
    split of these dumps."""
    if cfg.vocab:
        return {"file": os.path.abspath(cfg.vocab), "sha256": C.file_sha256(cfg.vocab)}
    if init is not None:
        return {"init_from": init.path, "model_safetensors_sha256": init.weights_sha256}
    return {"data_sha256": data_sha, "held_out_fraction": cfg.held_out_fraction, "seed": cfg.seed,
            "draft_vocab_size": size}


def read_checked_init(cfg: TrainConfig, manifest: C.DumpManifest, log):
    """--init-from's export, checked against the dumps (train/init_from.py) and against the EAGLE-3.1 switches given
    (its weights fix the architecture); None without --init-from."""
    if not cfg.init_from:
        return None
    init = read_init_from(cfg.init_from, manifest, cfg.init_from_sglang)
    clash = [f"--{o.replace('_', '-')} {getattr(cfg, o)}" for o in OPTIONS
             if getattr(cfg, o) is not None and bool(getattr(cfg, o)) != getattr(init.config, o)]
    if clash:
        raise ValueError(f"--init-from {init.path}: its drafter has {init.config.options or 'no EAGLE-3.1 option'} "
                         f"on; {', '.join(clash)} would train another architecture than the weights it starts "
                         "from (drop the flag)")
    log(f"[train] starting from {init.path} (served capture HF {init.served_capture}, draft vocab "
        f"{init.config.draft_vocab_size}); the drafter's shape is the export's")
    return init


def make_vocab(cfg: TrainConfig, dumps: DumpSet, train_refs: list, init, data_sha: str, log,
               spool: Spool | None = None) -> None:
    """A fresh run's RUN/vocab.safetensors: --vocab's file, --init-from's map, or built from the training split.
    One a failed start left there is kept only if it was made from the same data and settings."""
    manifest = dumps.manifest
    vocab_path = os.path.join(cfg.out, VOCAB_FILE)
    n = (init.config.draft_vocab_size if init is not None
         else drafter_config(cfg, cfg.target, len(manifest.capture.hidden_state_indices)).draft_vocab_size)
    source = vocab_source(cfg, data_sha, n, init)
    try:
        if load_vocab(vocab_path)["meta"].get("source") == source:
            return
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
        vocab = build_vocab(dumps, train_refs, n, progress=cfg.progress,
                            counts=spool.count_tokens(train_refs) if spool is not None else None)
        log(f"[train] draft vocab {describe_vocab(vocab['meta'])}")
    vocab["meta"]["source"] = source
    save_vocab(vocab_path, vocab)


def set_up(cfg: TrainConfig) -> Run:
    D.launcher_env()
    on_gpu = torch.cuda.is_available()
    # On CPUs, subnormal floats (softmax tails of a peaked teacher) cost 100x per op: flush them to zero.
    torch.set_flush_denormal(True)
    deepspeed.init_distributed(dist_backend="nccl" if on_gpu else "gloo")
    world = D.init_world("cuda" if on_gpu else "cpu")
    log = D.main_log(world.is_main)
    run_dir = cfg.out

    # ---- the contract: dumps agree with each other (DumpSet), with the target, and with a resumed run
    spool = (open_spool(cfg.dump[0], cfg.held_out_fraction, cfg.follow_timeout, log) if cfg.follow
             else None)  # its shards: checked as they come
    if spool is not None:
        dumps = spool.dumps
        if not cfg.delete_consumed and not spool.fits_without_deleting():
            raise ValueError(f"{cfg.dump[0]} is written on a {spool.record['budget_bytes']:,} B budget that does not "
                             "hold the whole dump: without --delete-consumed its writer would stop once the budget "
                             "is full, and this run with it")
    else:
        dumps = D.run_on_main(lambda: DumpSet(cfg.dump, verify=True, progress=cfg.progress), world)
        if dumps is None:
            dumps = DumpSet(cfg.dump, verify=False)
    # An fp8 dump is dequantized where training runs (Batch.to), not by the loader's CPU workers: at the Kimi
    # shape they would feed an H200 at ~1.3x its rate (bench/RESULTS.md, fp8 storage). On a CPU the multiply just
    # moves to the main process, a few ms next to a step there; one path for both.
    dumps.fp8_in_batch = True
    manifest = dumps.manifest
    D.run_on_main(lambda: check_target_matches_dumps(cfg.target, manifest, cfg.trust_remote_code), world)
    if spool is not None:  # the spool's own split: its held-out shards
        train_refs, held_refs, data_sha = spool.train_refs, spool.held_refs, spool.data_sha256
    else:
        train_refs, held_refs = split(dumps.refs, cfg.held_out_fraction, cfg.seed)
        data_sha = data_sha256(dumps)
    if not train_refs:
        raise ValueError("no training samples after the held-out split")
    parallel = Parallel.of(world, cfg.sequence_parallel)  # the data is dealt to sequence-parallel groups
    if spool is not None:
        plan = WindowPlan(spool.windows, spool.window_shards, [r.length for r in train_refs], cfg.token_budget,
                          cfg.seed, parallel.dp_rank, parallel.dp_size)
        spool.check_windows(plan.window_shards)
    else:
        plan = BatchPlan([r.length for r in train_refs], cfg.token_budget, cfg.seed, parallel.dp_rank,
                         parallel.dp_size)
    steps_per_epoch = len(plan.epoch(0))
    total = cfg.max_steps or max(1, int(cfg.epochs * steps_per_epoch))
    if spool is not None:
        total = min(total, steps_per_epoch)  # one pass: the spool ends
    total -= total % cfg.grad_accum

    run_path = os.path.join(run_dir, RUN_FILE)
    vocab_path = os.path.join(run_dir, VOCAB_FILE)
    resume = CK.Resume.latest(run_dir) if cfg.resume else None
    init = read_checked_init(cfg, manifest, log)

    # ---- checks only: nothing in RUN is changed until the run is known to be startable
    def prepare_run_dir() -> dict | None:
        """Fresh: the vocabulary in place. Resume: what run.json's `resumes` records of it."""
        if resume is not None:
            return CK.check_resume(resume, run_path, vocab_path, cfg, manifest.identity(), data_sha,
                                   world.world_size, total, init.weights_sha256 if init is not None else None)
        traces = CK.traces_of_a_run(run_dir)
        if traces:
            raise ValueError(f"{run_dir} already holds a training run ({', '.join(traces)}): pass --resume, or "
                             "choose another --out")
        os.makedirs(run_dir, exist_ok=True)
        make_vocab(cfg, dumps, train_refs, init, data_sha, log, spool)
        return None
    resumed = D.broadcast_object(D.run_on_main(prepare_run_dir, world))
    vocab = load_vocab(vocab_path)
    if resume is not None:  # every file DeepSpeed and we will read, against the checkpoint's record
        CK.check_files(resume.dir, resume.record, world=world)

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
    model = DrafterTrainStep(drafter, head.float(), cfg, parallel)
    old_resumes = RunRecord.read(run_path).resumes if resume is not None and world.is_main else []
    run_record = RunRecord(identity=manifest.identity(), capture=manifest.capture, target=manifest.target,
                           standardize=C.STANDARDIZE_VERSION, vocab=VOCAB_FILE, vocab_meta=vocab["meta"],
                           vocab_sha256=C.file_sha256(vocab_path), drafter=dcfg.to_dict(), train=cfg.to_dict(),
                           world_size=world.world_size, data_sha256=data_sha,
                           dumps=[os.path.abspath(d) for d in cfg.dump],
                           resumes=D.broadcast_object(old_resumes + ([resumed] if resumed else [])),
                           extra={"init_from": init.record()} if init is not None else {})

    def commit_run_dir():
        if resume is not None:
            dropped = truncate_metrics(os.path.join(run_dir, METRICS_FILE), resume.record.step)
            if dropped:
                log(f"[train] {METRICS_FILE}: dropped {dropped} rows past step {resume.record.step} (recomputed now)")
        CK.write_bytes_atomic(run_path, json.dumps(run_record.to_dict(), indent=1).encode())
    D.run_on_main(commit_run_dir, world)

    # ---- the engine
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay,
                            fused=on_gpu or None)
    sched = lr_schedule(opt, cfg, total // cfg.grad_accum)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=sched,
                                           config=deepspeed_config(cfg, on_gpu))
    CK.install_safe_engine(engine)
    step = 0
    if resume is not None:
        step = CK.load_engine_state(engine, run_dir, resume)
        log(f"[train] resumed {run_dir} at step {step} ({resume.tag})"
            + (f"; changed: {resumed['changed']}" if resumed["changed"] else ""))
    n_params = sum(p.numel() for p in trainable)
    sp = parallel.sp
    log(f"[train] drafter {n_params / 1e6:.1f}M trainable params, layout {dcfg.layout}"
        f"{' + ' + ' + '.join(dcfg.options) if dcfg.options else ''}, draft vocab {dcfg.draft_vocab_size}, "
        f"capture HF {manifest.capture.hidden_state_indices}; {len(train_refs)} train / {len(held_refs)} held-out "
        f"samples; {total} micro-steps ({steps_per_epoch}/epoch/rank), world {world.world_size}"
        + (f" (sequence parallel {sp})" if sp > 1 else "") + ", ZeRO "
        f"{cfg.zero_stage}, bf16 {cfg.bf16}")
    return Run(cfg=cfg, world=world, parallel=parallel, log=log, dumps=dumps, train_refs=train_refs,
               held_refs=held_refs, plan=plan, total=total, engine=engine, sched=sched, drafter_config=dcfg,
               run_record=run_record, step=step, resume=resume,
               best=CK.read_best(run_dir) if resume is not None else None,
               dtype=torch.bfloat16 if cfg.bf16 else torch.float32, spool=spool)
