"""Streamed against sequential on the example target (issue 34): the same target-written answers dumped and trained
on one machine, (a) one after the other: `eagle3 dump`, then `eagle3 train` (one pass), and (b) at once: `eagle3
dump --spool-budget B` beside `eagle3 train --follow --delete-consumed`. Reports wall time to the last checkpoint,
the shard files' high-water mark against the budget, and the held-out decoding replay (the same held-out samples
in both: the trainer's split with seed 0 is the spool's), as JSON lines.

    python3 bench/streaming_example.py --data answers.jsonl --out /tmp/stream_bench [--samples 800] [--budget 256MiB]

`--data` defaults to the target's own answers to the packaged ShareGPT (bench/results/
quality_i_h200_regen_conversations.jsonl.gz, written by `eagle3 regenerate` on an H100, 2026-12-06).
`--regenerate PROMPTS`: the target first writes the answers of the first `--samples` + `--eval-prompts` records of
PROMPTS (`eagle3 regenerate --engine hf`, timed once: both modes start from it, so its seconds are added to both
walls; a later call with the same --out, e.g. one mode per call, resumes it and counts the first call's time).
`--eval-prompts N` (> 0): each mode's last checkpoint is exported (`eagle3 export-sglang`) and decoded by
`eagle3 eval` on the N records after the trained ones (answers no run trained on), `--eval-steps` drafts a round;
the wall then runs to the evaluated export.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import subprocess
import sys
import time

from eagle3.dump.spool import HighWater

HERE = os.path.dirname(os.path.abspath(__file__))
ANSWERS = os.path.join(HERE, "results", "quality_i_h200_regen_conversations.jsonl.gz")


def last_eval(run: str) -> dict:
    rows = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    ev = [r for r in rows if r.get("split") == "eval"]
    return {"step": ev[-1]["step"], "heldout_accept_len": ev[-1]["decode_accept_len"],
            "acc_0": ev[-1]["acc_j"][0]} if ev else {}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=ANSWERS)
    ap.add_argument("--out", required=True)
    ap.add_argument("--samples", type=int, default=800)
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--budget", default="256MiB", help="the spool's --spool-budget")
    ap.add_argument("--shard-size-mb", type=float, default=16.0)
    ap.add_argument("--token-budget", type=int, default=2048)
    ap.add_argument("--modes", default="sequential,streamed")
    ap.add_argument("--regenerate", metavar="PROMPTS", help="conversations whose answers the target writes first")
    ap.add_argument("--regen-max-new-tokens", type=int, default=256)
    ap.add_argument("--regen-batch-size", type=int, default=64, help="rows per generate call (the quickstart: 1024 "
                    "on a GPU)")
    ap.add_argument("--regen-read", type=int, help="records of PROMPTS read (default 3 x (samples + eval prompts): "
                    "some are skipped or too long, as in the quickstart)")
    ap.add_argument("--eval-prompts", type=int, default=0)
    ap.add_argument("--eval-steps", type=int, default=3)
    ap.add_argument("--eval-max-new-tokens", type=int, default=64)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    env = dict(os.environ, WANDB_MODE="disabled")
    eagle3 = [sys.executable, "-m", "eagle3.cli"]
    t_regen = 0.0
    if a.regenerate:  # one regeneration, timed, that both modes start from
        regen = os.path.join(a.out, "regen")
        timed = os.path.join(a.out, "regenerate_s.json")  # a later call (--modes streamed) reuses the first's time
        t0 = time.perf_counter()
        read = a.regen_read or 3 * (a.samples + a.eval_prompts)
        subprocess.run(eagle3 + ["regenerate", "--engine", "hf", "--target", "example", "--data", a.regenerate,
                                 "--out", regen, "--num-samples", str(read), "--max-turns", "1", "--max-new-tokens",
                                 str(a.regen_max_new_tokens), "--max-prompt-tokens", str(a.max_length // 2),
                                 "--batch-size", str(a.regen_batch_size), "--batch-tokens",
                                 str(a.regen_batch_size * (a.max_length // 2 + a.regen_max_new_tokens)),
                                 "--no-progress"], env=env, check=True)
        t_regen = time.perf_counter() - t0
        if os.path.exists(timed):  # the regeneration was finished by an earlier call: its own time counts
            t_regen = json.load(open(timed))["regenerate_s"]
        else:
            with open(timed, "w") as f:
                json.dump({"regenerate_s": t_regen}, f)
        a.data = os.path.join(regen, "conversations.jsonl")
    data = a.data
    if data.endswith(".gz"):
        data = os.path.join(a.out, "answers.jsonl")
        if not os.path.exists(data):
            with gzip.open(a.data, "rt") as f, open(data, "w") as g:
                shutil.copyfileobj(f, g)
    heldout = None
    if a.eval_prompts:  # the records after the trained ones: answers no run trained on
        heldout = os.path.join(a.out, "heldout_prompts.jsonl")
        with open(data) as f, open(heldout, "w") as g:
            rows = [line for line in f if line.strip()]
            g.writelines(rows[a.samples:a.samples + a.eval_prompts])
        if not rows[a.samples:]:
            raise SystemExit(f"{data}: no records after the first {a.samples} to evaluate on")
        if len(rows) < a.samples + a.eval_prompts:  # the rows record how many were decoded (eval_prompts)
            print(f"[streaming_example] {data}: only {len(rows) - a.samples} records after the first {a.samples}, "
                  f"so {len(rows) - a.samples} of the {a.eval_prompts} evaluation prompts asked for (read more "
                  "records: --regen-read)", file=sys.stderr, flush=True)
    from eagle3.dump.example import example_target_dir
    target = example_target_dir()
    dump_args = ["--target", target, "--data", data, "--num-samples", str(a.samples), "--max-length",
                 str(a.max_length), "--shard-size-mb", str(a.shard_size_mb), "--no-progress"]
    train_args = ["--target", target, "--config", "example", "--epochs", "1", "--token-budget", str(a.token_budget),
                  "--eval-interval", "100000", "--save-interval", "100000", "--no-progress", "--num-workers", "1"]
    import torch
    from eagle3.cpu import cpu_prefers_bf16
    if not torch.cuda.is_available() and not cpu_prefers_bf16():
        # a CPU without bf16 instructions (an AMD EPYC here) runs bf16 training many times slower than fp32: the
        # quickstart's rule (cli/quickstart.py)
        train_args.append("--no-bf16")
    for mode in a.modes.split(","):
        root = os.path.join(a.out, mode)
        shutil.rmtree(root, ignore_errors=True)
        dump_dir, run = os.path.join(root, "dump"), os.path.join(root, "run")
        os.makedirs(root)
        t0 = time.perf_counter()
        if mode == "sequential":
            hw = HighWater(dump_dir, every=0.05)
            subprocess.run(eagle3 + ["dump", "--out", dump_dir, *dump_args], env=env, check=True)
            t_dump = time.perf_counter() - t0
            subprocess.run(eagle3 + ["train", "--dump", dump_dir, "--out", run, *train_args], env=env, check=True)
        else:
            dump = subprocess.Popen(eagle3 + ["dump", "--out", dump_dir, "--spool-budget", a.budget, *dump_args],
                                    env=env)
            while not os.path.exists(os.path.join(dump_dir, "spool.json")):
                if dump.poll() is not None:
                    raise SystemExit(f"the dump stopped (rc {dump.returncode}) before it wrote spool.json")
                time.sleep(0.2)
            hw = HighWater(dump_dir, every=0.05)
            subprocess.run(eagle3 + ["train", "--dump", dump_dir, "--out", run, "--follow", "--delete-consumed",
                                     *train_args], env=env, check=True)
            if dump.wait() != 0:
                raise SystemExit(f"the dump failed (rc {dump.returncode})")
            t_dump = None
        t_train_end = time.perf_counter() - t0
        decoded = {}
        if heldout:
            export = os.path.join(root, "export")
            subprocess.run(eagle3 + ["export-sglang", "--run", run, "--out", export], env=env, check=True,
                           stdout=subprocess.DEVNULL)
            subprocess.run(eagle3 + ["eval", "--target", "example", "--drafter", export, "--prompts", heldout,
                                     "--draft-steps", str(a.eval_steps), "--max-new-tokens",
                                     str(a.eval_max_new_tokens), "--num-prompts", str(a.eval_prompts), "--out",
                                     os.path.join(root, "eval")], env=env, check=True)
            ev = json.load(open(os.path.join(root, "eval", "eval.json")))
            decoded = {"eval_accept_len": ev.get("acceptance_length"), "eval_lossless": ev.get("lossless"),
                       "eval_speedup": ev.get("speedup"), "eval_draft_steps": a.eval_steps,
                       "eval_prompts": ev.get("prompts")}
        wall = time.perf_counter() - t0 + t_regen
        hw.stop()
        row = {"mode": mode, "wall_s": round(wall, 1), "regenerate_s": round(t_regen, 1) if a.regenerate else None,
               "to_last_checkpoint_s": round(t_train_end, 1), **decoded,
               "dump_s": None if t_dump is None else round(t_dump, 1),
               "shard_bytes_high_water": hw.high, "budget": a.budget if mode == "streamed" else None,
               **last_eval(run), "samples": a.samples, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        print(json.dumps(row), flush=True)
        with open(os.path.join(a.out, "streaming_example.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
