"""`eagle3 quickstart`: the whole pipeline on the embedded default (SmolLM2-135M-Instruct + ShareGPT).

dump -> vocab -> train (DeepSpeed) -> export (SGLang) -> eval (real speculative decoding on prompts the drafter
never saw), each stage with its progress bar, then one summary table. Sized to finish in about 15 minutes on a
2-core CPU; on a GPU it uses bf16 and the same code.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass


@dataclass
class QuickstartConfig:
    out: str = "runs/quickstart"
    num_samples: int = 240           # conversations dumped
    max_length: int = 512
    train_steps: int | None = None   # default: 160 on a CPU (about 7 minutes on 2 cores), 600 on a GPU
    token_budget: int | None = None  # padded tokens per step; default 1024 on a CPU, 8192 on a GPU
    draft_vocab_size: int | None = None  # default: 2048 on a CPU (cheaper head), the drafter preset's on a GPU
    draft_steps: int = 5             # chain length in eval
    eval_prompts: int = 8
    max_new_tokens: int = 64
    held_out_fraction: float = 0.05
    device: str | None = None
    data: str | None = None          # a ShareGPT/messages .jsonl instead of the packaged ShareGPT (one record a line)
    progress: bool = True


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


def run_quickstart(q: QuickstartConfig) -> dict:
    import torch

    from eagle3.data.dumps import DumpSet, split
    from eagle3.data.vocab import build_vocab, save_vocab
    from eagle3.dump.conversations import example_sharegpt_jsonl
    from eagle3.dump.example import example_target_dir
    from eagle3.dump.job import DumpConfig, run_dump
    from eagle3.eval.speculative import evaluate
    from eagle3.export.sglang import export_drafter
    from eagle3.train.config import TrainConfig, load_yaml
    from eagle3.train.trainer import train

    on_gpu = q.device != "cpu" and torch.cuda.is_available()
    # The dump runs the target in bf16 (on these CPUs too: bf16 matmuls ran ~1.8x faster than fp32 here); the
    # eval checks losslessness token for token, so it runs in fp32 (a K+1-token verify forward and one-token decode
    # steps round differently in bf16 and can flip near-ties).
    train_steps = q.train_steps or (600 if on_gpu else 160)
    token_budget = q.token_budget or (8192 if on_gpu else 1024)
    os.makedirs(q.out, exist_ok=True)
    t_start, times = time.perf_counter(), {}
    N = 6

    _stage(1, N, "dump: SmolLM2-135M-Instruct over ShareGPT, capture the aux hidden states")
    t0 = time.perf_counter()
    target = example_target_dir()
    data = q.data or example_sharegpt_jsonl()[0]
    dump_dir = os.path.join(q.out, "dump")
    manifest = run_dump(DumpConfig(target=target, data=[data], out=dump_dir, num_samples=q.num_samples,
                                   max_length=q.max_length, dtype="bf16", device=q.device, progress=q.progress))
    times["dump"] = time.perf_counter() - t0

    _stage(2, N, "vocab: the draft vocabulary from the training split")
    t0 = time.perf_counter()
    preset = load_yaml("example")
    dumps = DumpSet(dump_dir, verify=False)
    train_refs, held_refs = split(dumps.refs, q.held_out_fraction, seed=0)
    from eagle3 import presets
    n_vocab = q.draft_vocab_size or (presets.load("drafters", preset["drafter"])["draft_vocab_size"] if on_gpu
                                     else 2048)
    vocab = build_vocab(dumps, train_refs, n_vocab, progress=q.progress)
    vocab_path = os.path.join(q.out, "vocab.safetensors")
    save_vocab(vocab_path, vocab)
    times["vocab"] = time.perf_counter() - t0

    _stage(3, N, "train: the EAGLE-3 drafter inside DeepSpeed")
    t0 = time.perf_counter()
    run_dir = os.path.join(q.out, "run")
    fields = {k: v for k, v in preset.items()}
    fields.update(dump=[dump_dir], target=target, out=run_dir, vocab=vocab_path, max_steps=train_steps,
                  draft_vocab_size=n_vocab, token_budget=token_budget, bf16=on_gpu,
                  held_out_fraction=q.held_out_fraction, warmup_steps=min(20, train_steps // 10 + 1),
                  save_interval=train_steps, eval_interval=train_steps, num_workers=1, progress=q.progress,
                  resume=os.path.isfile(os.path.join(run_dir, "checkpoints", "latest")))
    if fields["resume"]:
        print("[quickstart] a finished training run is already there; resuming it (nothing left to do if done)",
              file=sys.stderr)
    train_result = train(TrainConfig(**fields))
    times["train"] = time.perf_counter() - t0

    _stage(4, N, "export: an SGLang-loadable drafter")
    t0 = time.perf_counter()
    export_dir = os.path.join(q.out, "sglang-drafter")
    if os.path.isdir(export_dir):
        import shutil
        shutil.rmtree(export_dir)
    prov = export_drafter(run_dir, export_dir)
    times["export"] = time.perf_counter() - t0

    _stage(5, N, "eval: speculative decoding on held-out prompts, checked against target-only greedy")
    t0 = time.perf_counter()
    held = {r.sample_index for r in held_refs}
    last = max(r.sample_index for r in dumps.refs)
    prompts = held_out_prompts(data, held, last, q.eval_prompts, os.path.join(q.out, "heldout_prompts.jsonl"))
    report = evaluate(target, export_dir, prompts, draft_steps=q.draft_steps, max_new_tokens=q.max_new_tokens,
                      num_prompts=q.eval_prompts, out=os.path.join(q.out, "eval"), dtype="fp32",
                      device=q.device, progress=q.progress)
    times["eval"] = time.perf_counter() - t0

    _stage(6, N, "summary")
    tot = manifest.totals
    ev = train_result.get("eval", {})
    server = (f"python -m sglang.launch_server --model-path {os.path.abspath(target)} --speculative-algorithm EAGLE3 "
              f"--speculative-draft-model-path {os.path.abspath(export_dir)} --speculative-num-steps "
              f"{q.draft_steps} --speculative-eagle-topk 1 --speculative-num-draft-tokens {q.draft_steps + 1}"
              + (" --disable-cuda-graph" if prov.get("needs_disable_cuda_graph") else ""))
    rows = [
        ("tokens dumped", f"{tot['tokens']:,} in {tot['samples']} conversations ({tot['bytes'] / 2**20:,.0f} MiB), "
                          f"capture HF {manifest.capture.hidden_state_indices}"),
        ("draft vocab", f"{n_vocab} ids, coverage {vocab['meta']['coverage']:.1%}"),
        ("training", f"{train_result.get('step')} steps, final loss {train_result.get('loss', float('nan')):.3f}"),
        ("train acc_j", " ".join(f"{a:.2f}" for a in train_result.get("acc_j", []))),
        ("held-out acc_j", " ".join(f"{a:.2f}" for a in ev.get("acc_j", [])) or "n/a"),
        ("acceptance length", f"{report['acceptance_length']:.2f} (chain of {q.draft_steps}, "
                              f"{report['prompts']} held-out prompts)"),
        ("accept rate by pos", " ".join(f"{a:.2f}" for a in report["acceptance_rate_per_position"])),
        ("speedup", f"{report['speedup']:.2f}x wall clock vs target-only greedy ({report['device']}, fp32); "
                    f"{report['tokens_per_target_forward']:.2f} tokens per target forward"),
        ("lossless", "yes: identical to target-only greedy" if report["lossless"]
         else f"NO: {len(report['mismatches'])} prompts differ"),
        ("SGLang drafter", os.path.abspath(export_dir)),
        ("serve it", server),
        ("stage times", ", ".join(f"{k} {v:.0f}s" for k, v in times.items())
         + f"; total {time.perf_counter() - t_start:.0f}s"),
    ]
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k:<{width}}  {v}" for k, v in rows))
    summary = {"times": times, "eval": report, "train": train_result, "export": prov, "serve": server,
               "dump_totals": tot}
    with open(os.path.join(q.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1, default=str)
    return summary
