"""`eagle3 quickstart`: the whole pipeline on the embedded default (SmolLM2-135M-Instruct + ShareGPT).

regenerate (the target writes the answers, `--engine hf`) -> dump -> vocab -> train (DeepSpeed) -> export (SGLang)
-> eval (real speculative decoding on held-out prompts the drafter never saw), each stage with its progress bar, then
one summary table. Sized to finish in about 15 minutes on a 2-core CPU; on a GPU it uses bf16, more data and the
same code. Every default below was chosen by measurement (bench/quality.md).
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass

from eagle3.eval.speculative import draft_steps_arg
from eagle3.options import opt
from eagle3.train.config import INIT_HEADS, LOSS_TOKENS
from eagle3.train.loss import LOSSES


@dataclass
class QuickstartConfig:
    """`eagle3 quickstart`'s flags. None: chosen for the machine (below, run_quickstart) or left to the stage."""
    out: str = opt("runs/quickstart", "directory of every stage's output (rerun to resume)")
    num_samples: int | None = opt(None, "input conversations the target answers (those it can): default 8000 on a GPU; "
                                        "on a CPU 1000 where its bf16 GEMMs are fast (AMX), else 500")  # core/cpu.py
    max_length: int = opt(512, "dump: tokens per conversation (GPU: 1024)")
    regen_max_new_tokens: int | None = opt(None, "regenerate: tokens per answer (default 96 on a CPU, 512 on a GPU)")
    temperature: float = opt(0.0, "regenerate: 0 = greedy")  # greedy, as greedy serving decodes
    dtype: str | None = opt(None, "regenerate and dump dtype (default: regenerate bf16 on a GPU, fp32 on a CPU; dump "
                                  "fp32, the eval's)", choices=["bf16", "fp32"])
    regen_batch_size: int | None = opt(None, "regenerate: conversations per generate call (default 128 on a CPU, 1024 "
                                             "on a GPU)")
    init_head: str | None = opt(None, "train: start the draft head from the target's lm_head rows and final norm, or "
                                      "at random", choices=INIT_HEADS)  # default: the trainer's
    aux_noise: float | None = opt(None, "train: Gaussian noise on the captured states, std relative to each layer's "
                                        "per-token RMS (default: off)")
    train_dtype: str | None = opt(None, "train dtype (default: bf16 on a GPU and on a CPU with fast bf16 GEMMs, else "
                                        "fp32)", choices=["bf16", "fp32"])  # core/cpu.py
    loss_tokens: str | None = opt(None, "train: learn at the assistant's tokens only (the trainer's default) or at "
                                        "every real token", choices=LOSS_TOKENS)
    loss: str | None = opt(None, "train: the objective, soft cross-entropy (kl, the trainer's default) or the LK "
                                 "losses on the expected acceptance (lk, lk-hybrid with the trainer's default "
                                 "weights; eagle3 train --help)", choices=LOSSES)
    max_turns: int | None = opt(1, "regenerate: assistant turns per conversation")  # None = all
    train_steps: int | None = opt(None, "default: 2000 on a GPU; on a CPU 700 with fast bf16 GEMMs, else 500")
    token_budget: int | None = opt(None, "padded tokens per training step")  # 1024 on a CPU, 8192 on a GPU
    # 2048 on a CPU (a cheaper head), the drafter preset's on a GPU
    draft_vocab_size: int | None = opt(None, "default: 2048 on a CPU, the preset's on a GPU")
    lr: float | None = opt(None, "default: the example training preset's")
    drafter: str | None = opt(None, "train: a configs/drafters preset (default: the example training preset's, "
                                    "smollm2-135m)")
    # the EAGLE-3.1 options (None: the drafter preset's)
    fc_norm: bool | None = opt(None, "train: EAGLE-3.1: one RMSNorm per captured state before fc (default: on, the "
                                     "example training preset's)")
    norm_before_fc: bool | None = opt(None, "train: one RMSNorm over the concatenated captured states before fc "
                                            "(default: off, the example training preset's)")
    norm_output: bool | None = opt(None, "train: EAGLE-3.1: lm_head reads, and the next draft step receives, the "
                                         "post-norm hidden (default: on, the example training preset's)")
    ttt_steps: int | None = opt(None, "training-time-test unroll (default: --draft-steps on a CPU, the preset's on a "
                                      "GPU)")
    draft_steps: int | str = opt("auto", "chain length in the eval, or 'auto' (the default): training replays every "
                                         "length up to --max-draft-steps on held-out answers, the eval measures what "
                                         "each costs on this machine and decodes at the fastest (eval --draft-steps "
                                         "auto)", type=draft_steps_arg)  # eval/chain_length.py
    # it is training's held-out replay length (and the CPU's TTT unroll)
    max_draft_steps: int | None = opt(None, "with --draft-steps auto: the longest chain considered (default: 2 on a "
                                            "CPU, 7 on a GPU)")
    eval_prompts: int = opt(8, "eval: held-out prompts decoded")
    max_new_tokens: int = opt(64, "eval: tokens per prompt")
    held_out_fraction: float = opt(0.05, "share of conversations kept out of training (the eval's prompts come from "
                                         "them)")
    device: str | None = opt(None, "cpu | cuda (default: cuda if available)")
    data: str | None = opt(None, "a .jsonl of conversations instead of the packaged ShareGPT")  # a record a line
    progress: bool = True  # no flag


def _stage(i: int, n: int, what: str) -> None:
    print(f"\n=== [{i}/{n}] {what} ===", file=sys.stderr, flush=True)


def held_out_prompts(data_file: str, held_indices: set[int], after: int, n: int, out_path: str) -> str:
    """Prompts the drafter never trained on: held-out conversations, then conversations past the dumped range.
    The example jsonl holds one record per line, and sample_index is the record's position."""
    picked = []
    with open(data_file) as f:
        for i, line in enumerate(f):
            if i in held_indices or i > after:
                picked.append(line)
            if len(picked) >= n:
                break
    with open(out_path, "w") as f:
        f.writelines(picked)
    return out_path


def chain_length_rows(report: dict) -> list[tuple[str, str]]:
    """The summary's account of --draft-steps auto: each length's predicted speedup and the one chosen."""
    c = report.get("draft_steps_choice")
    if not c:
        return [("chain length", f"{report['draft_steps']} (fixed)")]
    preds = " ".join(f"{v['steps']}: {v['decode_speedup']:.2f}x" for v in c["predicted"])
    return [("chain length", f"{c['chosen']}, chosen by measurement: predicted decode speedup by length {preds} "
                             "(held-out replay x costs measured on this machine)")]


def speedup_line(report: dict) -> str:
    """The measured speedup, said plainly when it is a slowdown (never a number to be misread as a gain)."""
    s = report["speedup"]
    rates = (f"{report['spec_tokens_per_s']:.1f} vs {report['baseline_tokens_per_s']:.1f} tok/s, "
             f"{report['tokens_per_target_forward']:.2f} tokens per target forward")
    c = report.get("draft_steps_choice")
    pred = f"; predicted {c['predicted_speedup']:.2f}x" if c else ""
    line = f"{s:.2f}x wall clock vs target-only greedy ({report['device']}, fp32); {rates}{pred}"
    if s < 1.0:
        best = max((v["decode_speedup"] for v in c["predicted"]), default=None) if c else None
        why = (f"no chain length is predicted to pay on this machine (best {best:.2f}x)" if best is not None
               and best < 1.0 else "the measured rounds cost more than the replay and the measured costs predicted")
        line = (f"SLOWER: speculative decoding ran at {s:.2f}x the target alone on this machine ({rates}{pred}): "
                f"{why}. The drafter's acceptance is what a GPU server gains from; see the README, 'Chain length'")
    return line


def _evaluate_child(kwargs: dict) -> None:
    from eagle3.eval.speculative import evaluate
    evaluate(**kwargs)


def evaluate_in_fresh_process(target_dir: str, export_dir: str, prompts: str, out: str, **kwargs) -> dict:
    """`eagle3 eval` in a fresh (spawned) process, as a user runs it after the quickstart. Why: in the process that
    had just trained for minutes, the same eval of the same drafter measured both decoders slower and unevenly --
    20.7 vs 18.0 tok/s (0.87x) against 24.5 vs 23.3 (0.95x) from the standalone command (2-core Xeon,
    2026-12-05) -- and the speedup is the figure it exists to report. Returns the eval.json it wrote."""
    import multiprocessing as mp
    path = os.path.join(out, "eval.json")
    if os.path.exists(path):
        os.remove(path)  # a report left by an earlier run must not stand in for this one
    child = mp.get_context("spawn").Process(target=_evaluate_child, args=(dict(
        target_dir=target_dir, export_dir=export_dir, prompts_file=prompts, out=out, **kwargs),))
    child.start()
    child.join()
    if child.exitcode != 0 or not os.path.exists(path):
        raise RuntimeError(f"eval: the evaluation process exited with code {child.exitcode} (its error is above); "
                           f"rerun it alone: eagle3 eval --target {target_dir} --drafter {export_dir} "
                           f"--prompts {prompts} --out {out}")
    with open(path) as f:
        return json.load(f)


def run_quickstart(q: QuickstartConfig) -> dict:
    import torch

    from eagle3.data.dumps import DumpSet, split
    from eagle3.data.vocab import build_vocab, describe_vocab, save_vocab
    from eagle3.cpu import bf16_gemm_speedup, cpu_prefers_bf16
    from eagle3.dump.example import example_sharegpt_jsonl
    from eagle3.dump.example import example_target_dir
    from eagle3.dump.job import DumpConfig, run_dump
    from eagle3.export.sglang import export_drafter, server_command
    from eagle3.regenerate.config import RegenConfig
    from eagle3.regenerate.files import CONVERSATIONS
    from eagle3.regenerate.job import run_regenerate
    from eagle3.train.config import TrainConfig, load_yaml
    from eagle3.train.setup import drafter_config
    from eagle3.train.trainer import train

    on_gpu = q.device != "cpu" and torch.cuda.is_available()
    # The eval checks losslessness token for token, so it runs the target in fp32 (a K+1-token verify forward and
    # one-token decode steps round differently in bf16 and can flip near-ties). The dump runs fp32 too, so that the
    # drafter trains on the very states the eval feeds it: a drafter trained on bf16 states accepted ~7% less under
    # the fp32 eval than under a bf16 one (bench/quality.md, run G). Regeneration only writes text: bf16 on a GPU
    # (2.4x faster than fp32 there), fp32 on a CPU: without bf16 instructions (a 2-core EPYC) bf16 GEMMs ran at a
    # quarter of fp32's rate, and even with AMX bf16 regeneration wrote only ~10% faster (decode steps of 64-128 rows
    # are bound by more than their GEMMs; 2026-12-05), while fp32 text is exactly what the fp32 eval decodes, so
    # training's held-out replay predicts it round for round. --dtype sets both.
    # Training's dtype never reaches decoding (the eval runs the exported weights in fp32), so it goes by speed alone:
    # bf16 on a GPU and on a CPU whose bf16 GEMMs are fast (AMX: the fp32 training step's 443 s took 277 s, at a
    # held-out replay of 1.41 against 1.45; bench/quality.md rows L); fp32 on a CPU without them.
    fast_cpu_bf16 = not on_gpu and cpu_prefers_bf16()
    train_dtype = q.train_dtype or ("bf16" if on_gpu or fast_cpu_bf16 else "fp32")
    # CPU sizes for about 15 minutes on 2 cores: the time bf16 training saves goes into twice the data (held-out
    # replay 1.45 -> 1.52 at the same total time, rows L)
    num_samples = q.num_samples or (8000 if on_gpu else 1000 if fast_cpu_bf16 else 500)
    regen_new = q.regen_max_new_tokens or (512 if on_gpu else 96)
    max_length = q.max_length if not on_gpu or q.max_length != QuickstartConfig.max_length else 1024
    train_steps = q.train_steps or (2000 if on_gpu else 700 if fast_cpu_bf16 else 500)
    token_budget = q.token_budget or (8192 if on_gpu else 1024)
    regen_dtype = q.dtype or ("bf16" if on_gpu else "fp32")
    dump_dtype = q.dtype or "fp32"
    # 128 rows a call on a CPU: 218 tok/s against 186 at 64 and 166 at 32, the same greedy answers (2-core Xeon)
    regen_rows = q.regen_batch_size or (1024 if on_gpu else 128)
    os.makedirs(q.out, exist_ok=True)
    t_start, times = time.perf_counter(), {}
    N = 7
    # the longest chain training replays (at every length up to it) and, on a CPU, unrolls
    # On a CPU 2: every 2-core run chose 1 or 2 when lengths up to 5 were weighed (3-5 measured 7-30% slower than the
    # best, a verify of 4-6 tokens costing 1.2-1.6x a one-token forward there), and an unroll of 2 instead of 5 trains
    # as good a drafter at those lengths in about half the time: held-out replay 1.32 / 1.40 at 1 / 2 against
    # 1.30 / 1.38, 428 s against 838 s of training steps on a 2-core EPYC (bench/quality.md, "Two draft steps on a
    # CPU").
    K = q.draft_steps if q.draft_steps != "auto" else (q.max_draft_steps or (7 if on_gpu else 2))

    _stage(1, N, "regenerate: SmolLM2-135M-Instruct writes the answers of ShareGPT conversations (--engine hf)")
    t0 = time.perf_counter()
    target = example_target_dir()
    source = q.data or example_sharegpt_jsonl()[0]
    regen_dir = os.path.join(q.out, "regen")
    regen = run_regenerate(RegenConfig(data=[source], out=regen_dir, target=target, engine="hf",
                                       temperature=q.temperature, max_new_tokens=regen_new, num_samples=num_samples,
                                       max_turns=q.max_turns, max_prompt_tokens=max_length // 2, device=q.device,
                                       dtype=regen_dtype,
                                       batch_size=regen_rows, batch_tokens=regen_rows * (max_length // 2 + regen_new),
                                       progress=q.progress))
    data = os.path.join(regen_dir, CONVERSATIONS)
    times["regenerate"] = time.perf_counter() - t0

    _stage(2, N, "dump: run the target over its own answers, capture the aux hidden states")
    t0 = time.perf_counter()
    dump_dir = os.path.join(q.out, "dump")
    manifest = run_dump(DumpConfig(target=target, data=[data], out=dump_dir, max_length=max_length,
                                   dtype=dump_dtype,
                                   device=q.device, progress=q.progress))
    times["dump"] = time.perf_counter() - t0

    _stage(3, N, "vocab: the draft vocabulary from the training split")
    t0 = time.perf_counter()
    preset = load_yaml("example")
    dumps = DumpSet(dump_dir, verify=False)
    train_refs, held_refs = split(dumps.refs, q.held_out_fraction, seed=0)
    # the size the trainer itself would pick (drafter preset, capped at the target's vocab); 2048 on a CPU, whose
    # draft head then costs less per draft step
    drafter = q.drafter or preset["drafter"]
    n_vocab = drafter_config(TrainConfig(drafter=drafter,
                                         draft_vocab_size=q.draft_vocab_size or (None if on_gpu else 2048)),
                             target, len(manifest.capture.hidden_state_indices)).draft_vocab_size
    vocab = build_vocab(dumps, train_refs, n_vocab, progress=q.progress)
    vocab_path = os.path.join(q.out, "vocab.safetensors")
    save_vocab(vocab_path, vocab)
    times["vocab"] = time.perf_counter() - t0

    _stage(4, N, "train: the EAGLE-3 drafter inside DeepSpeed")
    t0 = time.perf_counter()
    run_dir = os.path.join(q.out, "run")
    fields = {k: v for k, v in preset.items()}
    fields.update(drafter=drafter, dump=[dump_dir], target=target, out=run_dir, vocab=vocab_path, max_steps=train_steps,
                  draft_vocab_size=n_vocab, token_budget=token_budget, bf16=train_dtype == "bf16",
                  held_out_fraction=q.held_out_fraction, warmup_steps=min(20, train_steps // 10 + 1),
                  # checkpoints along the way (a run never ends with nothing saved), held-out decoding replays
                  # at the eval's chain length and answer length, and the best of them kept for the export
                  save_interval=max(1, train_steps // 4), eval_interval=max(1, train_steps // 10),
                  accept_steps=K, accept_max_new_tokens=q.max_new_tokens, keep_best=True,
                  num_workers=1, progress=q.progress,
                  resume=os.path.isfile(os.path.join(run_dir, "checkpoints", "latest")))
    if q.lr:
        fields["lr"] = q.lr
    if q.init_head:
        fields["init_head"] = q.init_head
    if q.loss_tokens:
        fields["loss_tokens"] = q.loss_tokens
    if q.aux_noise is not None:
        fields["aux_noise"] = q.aux_noise
    if q.loss:
        fields["loss"] = q.loss
    from eagle3.model.config import OPTIONS
    for option in OPTIONS:
        if getattr(q, option) is not None:
            fields[option] = getattr(q, option)
    if q.norm_before_fc and q.fc_norm is None:  # exclusive with the example preset's fc_norm: asking for one is
        fields["fc_norm"] = False                # asking for it instead of the other
    fields["ttt_steps"] = q.ttt_steps or (fields.get("ttt_steps", 7) if on_gpu else K)
    if fields["resume"]:
        print("[quickstart] a training run is already there; resuming it (nothing left to do if done)",
              file=sys.stderr)
    elif os.path.isdir(run_dir):
        # A run killed before its first checkpoint: `eagle3 train` refuses a fresh run into a used folder (its
        # metrics would mix), and this folder is the quickstart's own with nothing resumable in it.
        import shutil
        print(f"[quickstart] {run_dir} holds no checkpoint: starting its training afresh", file=sys.stderr)
        shutil.rmtree(run_dir)
    train_result = train(TrainConfig(**fields))
    times["train"] = time.perf_counter() - t0

    _stage(5, N, "export: an SGLang-loadable drafter (the checkpoint with the best held-out acceptance)")
    t0 = time.perf_counter()
    export_dir = os.path.join(q.out, "sglang-drafter")
    if os.path.isdir(export_dir):
        import shutil
        shutil.rmtree(export_dir)
    prov = export_drafter(run_dir, export_dir, step="best" if train_result.get("best") else None)
    times["export"] = time.perf_counter() - t0

    _stage(6, N, "eval: speculative decoding on held-out prompts, checked against target-only greedy")
    t0 = time.perf_counter()
    held = {r.sample_index for r in held_refs}
    last = max(r.sample_index for r in dumps.refs)
    prompts = held_out_prompts(data, held, last, q.eval_prompts, os.path.join(q.out, "heldout_prompts.jsonl"))
    # "auto" weighs the export's held-out replay at every length (checkpoints/best records it) against the costs the
    # eval measures first; a run without a held-out split has no replay, and decodes at the longest chain
    eval_steps = q.draft_steps if q.draft_steps != "auto" or (prov.heldout or {}).get("decode_by_steps") else K
    report = evaluate_in_fresh_process(target, export_dir, prompts, draft_steps=eval_steps,
                                       max_new_tokens=q.max_new_tokens, num_prompts=q.eval_prompts,
                                       out=os.path.join(q.out, "eval"), dtype="fp32", device=q.device,
                                       progress=q.progress)
    times["eval"] = time.perf_counter() - t0

    _stage(7, N, "summary")
    tot = manifest.totals
    ev = train_result.get("best") or train_result.get("eval", {})  # the held-out record of the exported weights
    server = server_command("sglang", os.path.abspath(target), os.path.abspath(export_dir),
                            prov.target.model_type, prov.needs_disable_cuda_graph, steps=report["draft_steps"])
    counts = regen.get("counts", {})
    rows = [
        ("regenerated", f"{counts.get('conversations', '?')} conversations, {counts.get('generated_tokens', 0):,} "
                        f"answer tokens by the target ({regen.get('sampling', {}).get('temperature', 0)} temperature, "
                        f"{times['regenerate']:.0f}s)"),
        ("tokens dumped", f"{tot['tokens']:,} in {tot['samples']} conversations ({tot['bytes'] / 2**20:,.0f} MiB), "
                          f"capture HF {manifest.capture.hidden_state_indices}"),
        ("draft vocab", describe_vocab(vocab["meta"])),
        ("training", f"{train_result.get('step')} steps in {train_dtype}, final loss "
                     f"{train_result.get('loss', float('nan')):.3f}"
                     + ("" if on_gpu else f" (this CPU's bf16 GEMMs: {bf16_gemm_speedup():.1f}x fp32's rate)")),
        ("train acc_j", " ".join(f"{a:.2f}" for a in train_result.get("acc_j", []))),
        ("held-out acc_j", " ".join(f"{a:.2f}" for a in ev.get("acc_j", [])) or "n/a"),
        ("held-out replay", (f"acceptance length {ev['decode_accept_len']:.2f}, by position "
                             + " ".join(f"{a:.2f}" for a in ev["decode_rate_j"])
                             + f" (step {ev['step']}, exported)") if "decode_accept_len" in ev else "n/a"),
        *chain_length_rows(report),
        ("acceptance length", f"{report['acceptance_length']:.2f} (chain of {report['draft_steps']}, "
                              f"{report['prompts']} held-out prompts)"),
        ("accept rate by pos", " ".join(f"{a:.2f}" for a in report["acceptance_rate_per_position"])),
        ("speedup", speedup_line(report)),
        ("lossless", "yes: identical to target-only greedy" if report["lossless"]
         else f"NO: {len(report['mismatches'])} prompts differ"),
        ("SGLang drafter", os.path.abspath(export_dir)),
        ("serve it", server),
        ("stage times", ", ".join(f"{k} {v:.0f}s" for k, v in times.items())
         + f"; total {time.perf_counter() - t_start:.0f}s"),
    ]
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k:<{width}}  {v}" for k, v in rows))
    summary = {"times": times, "dtypes": {"regenerate": regen_dtype, "dump": dump_dtype, "train": train_dtype,
                                          "eval": "fp32"},
               "cpu_bf16_gemm_speedup": None if on_gpu else bf16_gemm_speedup(), "eval": report,
               "train": train_result, "heldout_replay": ev, "export": prov.to_dict(), "serve": server,
               "dump_totals": tot, "regenerate": regen}
    with open(os.path.join(q.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1, default=str)
    return summary

