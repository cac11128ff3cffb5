"""The DeepSpeed trainer: fit an EAGLE-3 drafter on standardized dump data.

    deepspeed --num_gpus N --module eagle3.train --dump DIR... --target DIR --out RUN [--config kimi-k2.5] ...
    eagle3 train ...                                   (one process)

RUN/ holds run.json (the capture contract, the data's sha256, vocab, standardize version, drafter and training
config, and what each resume changed), vocab.safetensors, metrics.jsonl, and checkpoints/stepNNNNNNNN/ (DeepSpeed's
own files for exact resume, drafter.safetensors with the consolidated weights, and eagle3_checkpoint.json, written
last, with every file's sha256: see checkpoint.py).

`train` is the set-up (train/setup.py: everything checked before RUN is written, the engine, a resume) and the loop
below; one step and its parallel layout are train/step.py, saving and resuming train/checkpoint.py.
"""

from __future__ import annotations

import math
import os
import time

import torch
from tqdm import tqdm

from eagle3.data.batch import Batch
from eagle3.data.loader import BatchPlan, make_loader
from eagle3.data.stream import follow
from eagle3.records import CHECKPOINTS_DIR, METRICS_FILE
from eagle3.train import checkpoint as CK
from eagle3.train.acceptance import ChainStats, walk
from eagle3.train.config import TrainConfig
from eagle3.train.setup import Run, set_up
from eagle3.train.step import STATS, all_reduce_sum, noisy_aux, pooled
from eagle3.train.trackers import MetricsLog, last_metrics


def step_inputs(run: Run, b: Batch, step: int | None = None) -> dict:
    """DrafterTrainStep's arguments for a batch on the device; `step` given: a training step's (--loss-tokens all
    learns at every real position and --aux-noise perturbs the states), else the held-out evaluation's, which keeps
    the dump's mask (the answers decoding is judged on) and the states as captured."""
    cfg = run.cfg
    mask = b.attention_mask if step is not None and cfg.loss_tokens == "all" else b.loss_mask
    hs = b.hidden_state
    if step is not None and cfg.aux_noise > 0:
        # by data-parallel rank: a sequence-parallel group holds one batch, and its ranks must see one draw
        seed = (cfg.seed * 1_000_003 + run.parallel.dp_rank) * 1_000_003 + step
        hs = noisy_aux(hs, cfg.aux_noise, run.drafter_config.num_aux_layers, seed)
    return dict(hidden_state=hs, input_ids=b.input_ids, attention_mask=b.attention_mask, loss_mask=mask,
                final_hidden=b.final_hidden, target_argmax=b.target_argmax)


def evaluate(run: Run) -> dict:
    """Held-out: teacher-forced acc_j as in training, and the decoding replay (acceptance.walk): what greedy chain
    drafting with `accept_k` steps accepts on these (target-written) answers, and with every shorter chain (what
    `eagle3 eval --draft-steps auto` weighs against the measured cost of each length: eval/chain_length.py)."""
    cfg, engine, p = run.cfg, run.engine, run.parallel
    accept_k = min(cfg.accept_steps or cfg.ttt_steps, cfg.ttt_steps)
    eval_plan = BatchPlan([r.length for r in run.held_refs], cfg.token_budget, cfg.seed, p.dp_rank, p.dp_size,
                          shuffle=False)
    stats = torch.zeros(len(STATS), cfg.ttt_steps, dtype=torch.float64, device=run.device)
    chains = [ChainStats(k) for k in range(1, accept_k + 1)]  # the same hits, walked with each k
    engine.eval()
    n = min(cfg.eval_batches, len(eval_plan.epoch(0)))
    with torch.no_grad():
        for b in make_loader(run.dumps, run.held_refs, eval_plan, 0, n, num_workers=0):
            b = b.to(run.device, run.dtype)
            _, s, hits = engine(**step_inputs(run, b), with_hits=True)
            stats += s
            if p.walks_hits:
                for c in chains:
                    walk(hits, b.loss_mask, b.attention_mask, c.draft_steps, cfg.accept_max_new_tokens, stats=c)
    engine.train()
    pooled_chains = all_reduce_sum(torch.cat([c.as_tensor() for c in chains]).to(run.device)).cpu()
    sizes = [2 + 2 * c.draft_steps for c in chains]
    chains = [ChainStats.from_tensor(t, c.draft_steps) for t, c in zip(pooled_chains.split(sizes), chains)]
    chain = chains[-1]
    return {**pooled(all_reduce_sum(stats)), "decode_steps": accept_k, "rounds": chain.verify_steps,
            "decode_accept_len": chain.acceptance_length, "decode_rate_j": chain.rates,
            "decode_by_steps": [{"steps": c.draft_steps, "accept_len": c.acceptance_length, "rate_j": c.rates}
                                for c in chains]}


def _non_finite(what: str, run: Run) -> FloatingPointError:
    return FloatingPointError(f"training turned non-finite {what}; the last checkpoint before it is in "
                              f"{os.path.join(run.cfg.out, CHECKPOINTS_DIR)} (check the data, --lr, the drafter config)")


def train(cfg: TrainConfig) -> dict:
    run = set_up(cfg)
    engine, world, p, step, total, best = run.engine, run.world, run.parallel, run.step, run.total, run.best
    metrics = MetricsLog(cfg.out, cfg, world.is_main, resume_step=step if run.resume is not None else None)
    def loader_of(plan, start, n):
        return make_loader(run.dumps, run.train_refs, plan, start_step=start, num_steps=n,
                           num_workers=cfg.num_workers, pin_memory=run.device.type == "cuda")
    # --follow --delete-consumed: a window's end saves a checkpoint and frees the window's shards
    window_ends = set(run.plan.window_end) if run.spool is not None and cfg.delete_consumed else set()
    if run.spool is None:
        loader = loader_of(run.plan, step, total - step)
    else:  # --follow: window by window as the dump writes them
        if window_ends and world.is_main:  # what a run killed between its checkpoint and the deletes left
            for w, end in enumerate(run.plan.window_end):
                if end <= step:
                    run.spool.consume(run.plan.window_shards[w], step)
        loader = follow(run.spool, run.plan, step, total - step, world, loader_of, run.log, cfg.follow_timeout)
    bar = tqdm(total=total, initial=step, desc="train", unit="step", disable=not (cfg.progress and world.is_main),
               dynamic_ncols=True)
    engine.train()
    t_last, tokens_since, n_since = time.perf_counter(), 0.0, 0
    since = torch.zeros(len(STATS) * cfg.ttt_steps + 1, dtype=torch.float64, device=run.device)  # stats + loss
    result: dict = {}
    postfix: dict = {}
    for batch in loader:
        loss, stats = engine(**step_inputs(run, batch.to(run.device, run.dtype), step))
        engine.backward(p.loss_for_backward(loss))
        engine.step()
        step += 1
        # pooled on the device between log lines: the step itself never waits for the host
        since += torch.cat([stats.reshape(-1), loss.detach().double().reshape(1)])
        tokens_since += p.tokens(batch.attention_mask)
        n_since += 1
        if step % cfg.log_interval == 0 or step == total:
            red = all_reduce_sum(torch.cat([since, torch.tensor([tokens_since], dtype=torch.float64,
                                                                device=run.device)]))
            rec = {"step": step, "epoch": run.plan.position(step - 1)[0],
                   "loss": p.mean_loss(float(red[-2]), n_since), **pooled(red[:-2].reshape(len(STATS), -1)),
                   "tokens": int(red[-1]), "tok_s": float(red[-1]) / (time.perf_counter() - t_last),
                   "lr": run.sched.get_last_lr()[0], "time": time.time()}
            metrics.write(rec)
            if not math.isfinite(rec["loss"]):  # stop here: no later step or checkpoint can mean anything
                bad = [j for j, v in enumerate(rec.get("loss_j") or []) if not math.isfinite(v)]
                raise _non_finite(f"between steps {step - n_since + 1} and {step}: loss {rec['loss']}"
                                  f"{f' (draft steps {bad})' if bad else ''}, lr {rec['lr']:.3g}", run)
            postfix.update(loss=f"{rec['loss']:.3f}", acc0=f"{rec['acc_j'][0]:.2f}", tau=f"{rec['accept_len']:.2f}",
                           tok_s=f"{rec['tok_s']:,.0f}")
            bar.set_postfix(postfix)
            result = rec
            t_last, tokens_since, n_since = time.perf_counter(), 0.0, 0
            since.zero_()
        bar.update(1)
        # save first: whatever happens in the evaluation below, the step's weights are on disk
        window_done = step in window_ends
        if step % cfg.save_interval == 0 or step == total or window_done:
            bad = [n for n, q in engine.module.named_parameters() if not bool(torch.isfinite(q).all())]
            if bad:  # never saved: a checkpoint of NaN weights would be resumed or exported as if it were one
                raise _non_finite(f"by step {step}: parameters {bad[:6]}{' ...' if len(bad) > 6 else ''} are not "
                                  "finite", run)
            CK.save_checkpoint(engine, cfg.out, step, cfg.keep_checkpoints, world, run.run_record)
            if window_done and world.is_main:  # covered by the checkpoint just saved: the dump may go on
                run.spool.consume(run.plan.window_shards[run.plan.window_of(step - 1)], step)
        if run.held_refs and (step % cfg.eval_interval == 0 or step == total):
            ev = {"step": step, "split": "eval", **evaluate(run)}
            metrics.write(ev)
            result["eval"] = ev
            run.log(f"\n[eval] step {step}: acc_j {[round(a, 3) for a in ev['acc_j']]}; decoding replay "
                    f"(K={ev['decode_steps']}): acceptance length {ev['decode_accept_len']:.3f}, rate by position "
                    f"{[round(a, 2) for a in ev['decode_rate_j']]}")
            if cfg.keep_best and (best is None or ev["decode_accept_len"] > best["decode_accept_len"]):
                best = ev  # the whole held-out record (step, acc_j, decode_*): what the export is judged by
                CK.save_best(engine, cfg.out, step, world, run.run_record, best)
            postfix["heldout_tau"] = f"{ev['decode_accept_len']:.2f}"  # the figure decoding will see
            bar.set_postfix(postfix)
        if cfg.stop_after_steps is not None and step >= cfg.stop_after_steps and step < total:
            bar.close()
            metrics.close()
            raise SystemExit(f"stopped at step {step} (--stop-after-steps)")
    bar.close()
    metrics.close()
    run.log(f"[train] done: {step} steps -> {cfg.out}/checkpoints (latest: "
            f"{CK.resume_tag(os.path.join(cfg.out, CHECKPOINTS_DIR))}"
            + (f", best: step {best['step']}, held-out acceptance length {best['decode_accept_len']:.3f})"
               if best else ")"))
    if "step" not in result:  # resumed a finished run: nothing trained now, so report what the run recorded
        result = last_metrics(os.path.join(cfg.out, METRICS_FILE)) if world.is_main else {}
    if best:
        result["best"] = best
    return result
