#!/usr/bin/env python3
"""One EAGLE-3 training step of one long sequence at the Kimi-K2.5 drafter shape, split over N GPUs by sequence
parallelism (train/sequence_parallel.py, fused path), against the same length on one GPU where it fits.

  torchrun --nproc-per-node N bench/train_step_sp.py --out DIR [--tokens 65536,131072] [--iters 3] [--pieces 1,2]

Shape, synthetic batch, timing and MFU as bench/train_step.py (the same flops_per_token: model FLOPs of the whole
sequence, so a split run and an unsplit one are compared on the same work), the GPU peak being N x the bf16 matmul
rate measured here. Each rank runs its chunk; the step time is the slowest rank's. --checkpointing (default step,
what fits 65,536 tokens on one H200) is not retried on running out of memory: a rank that fails mid-step would leave
the others waiting in the group's collective. N = 1 runs the same code unsplit (a group of one). Writes
DIR/train_step_sp.jsonl and prints a table, a row as each length finishes. --pieces (one value, or one per length):
each GPU takes its share in that many pieces one after another (sequence_pieces_loss: the memory of one piece,
the same gradient); 1 = whole. With N = 1 a length that runs out of memory is recorded as such and the next runs.
"""
import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_step  # noqa: E402
from train_step import batch, build, flops_per_token, matmul_peak, timed  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", default="65536,131072")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--checkpointing", default="step", choices=["none", "mlp", "step", "step_mlp"])
    ap.add_argument("--pieces", default="1", help="pieces per GPU share: one value, or one per --tokens entry")
    ap.add_argument("--layout", default="llama", choices=["llama", "mla"], help="the drafter layout timed")
    ap.add_argument("--options", default="", help="EAGLE-3.1 options on, comma-separated (fc_norm,norm_output)")
    a = ap.parse_args()
    train_step.set_drafter(a.layout, a.options)
    lengths = list(map(int, a.tokens.split(",")))
    pieces = list(map(int, a.pieces.split(",")))
    pieces = pieces * len(lengths) if len(pieces) == 1 else pieces
    if len(pieces) != len(lengths):
        raise SystemExit("--pieces: one value, or one per --tokens entry")
    rank, local = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    n = dist.get_world_size()
    from eagle3.train.pieces import sequence_pieces_loss
    from eagle3.train.sequence_parallel import sequence_parallel_loss
    drafter, head = build()
    draft_head = head[drafter.t2d.to(head.device)].clone()
    peak = matmul_peak() * n
    rows = []
    for T, P in zip(lengths, pieces):
        b = batch(T, head)
        row = {"tokens": T, "gpus": n, "tokens_per_gpu": T // n, "K": a.steps, "pieces": P}
        drafter.activation_checkpointing = a.checkpointing
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()

        def step(ev=None):
            args = (drafter, head, b["hidden_state"], b["input_ids"], b["loss_mask"], b["final_hidden"])
            kw = dict(steps=a.steps, decay=0.8, chunk_tokens=4096, attention_mask=b["attention_mask"], fast=True,
                      target_argmax=b["target_argmax"], draft_head=draft_head)
            if P > 1:
                if n > 1:
                    raise SystemExit("--pieces > 1 is for one GPU (the split over a group is sequence_parallel_loss)")
                loss, _ = sequence_pieces_loss(*args, pieces=P, **kw)
            else:
                loss, _ = sequence_parallel_loss(*args, **kw)
            loss.backward()
            for p in drafter.parameters():
                p.grad = None
        try:
            (ms,), _ = timed(step, a.iters)
        except torch.OutOfMemoryError as e:
            if n > 1:
                raise
            row.update(checkpointing=a.checkpointing, error="out of memory", detail=str(e).split(". ")[:3],
                       max_allocated_gib=round(torch.cuda.max_memory_allocated() / 2 ** 30, 1))
            print(json.dumps(row), flush=True)
            rows.append(row)
            del b
            for p in drafter.parameters():
                p.grad = None
            torch.cuda.empty_cache()
            continue
        t = torch.tensor([ms, torch.cuda.max_memory_allocated() / 2 ** 30], device="cuda")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        ms, mem = t.tolist()
        fl = flops_per_token(T, a.steps)
        row.update(checkpointing=a.checkpointing, ms=round(ms, 1), tokens_per_s=round(T / (ms / 1e3)),
                   mfu=round(T * fl / (ms / 1e3) / peak, 3), peak_mem_gib_max_rank=round(mem, 1))
        if rank == 0:
            print(json.dumps(row), flush=True)
        rows.append(row)
        del b
    if rank == 0:
        os.makedirs(a.out, exist_ok=True)
        meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "gpus": n,
                "layout": train_step.LAYOUT, "options": list(train_step.OPTIONS),
                "bf16_matmul_peak_tflops_per_gpu": round(peak / n / 1e12, 1), "time": time.strftime("%F %T")}
        with open(os.path.join(a.out, "train_step_sp.jsonl"), "a") as f:
            for r in rows:
                f.write(json.dumps({**meta, **r}) + "\n")
        print(f"{'tokens':>8}{'gpus':>5}{'pieces':>7}{'ckpt':>9}{'ms':>10}{'tok/s':>9}{'MFU':>7}{'GiB':>7}")
        for r in rows:
            if "error" in r:
                print(f"{r['tokens']:>8}{r['gpus']:>5}{r['pieces']:>7}{r['checkpointing']:>9}  {r['error']}")
                continue
            print(f"{r['tokens']:>8}{r['gpus']:>5}{r['pieces']:>7}{r['checkpointing']:>9}{r['ms']:>10}"
                  f"{r['tokens_per_s']:>9}{r['mfu']:>7}{r['peak_mem_gib_max_rank']:>7}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
