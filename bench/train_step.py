#!/usr/bin/env python3
"""One EAGLE-3 training step at the Kimi-K2.5 drafter shape on one GPU, ours against SpecForge's, in one run.

  python bench/train_step.py --out DIR [--tokens 2048,4096,...] [--variants fast,eager,engine] [--peer PEER.py]

Shape (docs/contract.md §10 and ../shared/bench/peer_specforge_step.py): hidden 7168, 64 heads, 64 kv heads,
head_dim 128, intermediate 18432, draft vocab 32000, target vocab 163840, 3 aux layers, K = 7, bf16, synthetic
hidden states, loss mask all ones, one sequence of T tokens per micro-batch.

Variants (each: forward + backward of the whole step, timed with CUDA events, median of --iters after 2 warm-ups):
  fast        Eagle3Drafter.ttt_forward(fast=True) + eagle3_loss_fused with the dump-time argmax (draft-row teacher)
  fast_full   the same, but the teacher multiplies the full target head (no dump-time argmax)
  fast_fa2    `fast` with the causal block on PyTorch's FlashAttention-2 kernel (values zero-padded to the key width
              where narrower) instead of the 'auto' choice (cuDNN on
              Hopper): the attention-kernel lever measured alone
  eager       the plain reference path used in the tests (ttt_forward + eagle3_loss)
  engine      `fast` inside the DeepSpeed engine (ZeRO-2, bf16, fused AdamW): engine(...), backward, step
  specforge   the peer script in a subprocess of this run (its flex_attention backend), same sizes
For each size that runs out of memory without activation checkpointing, `fast` retries with 'mlp', then 'step'.
MFU uses the peer's flops_per_token (model FLOPs, same count for every variant) over a bf16 matmul measured here.
Writes DIR/train_step.jsonl (one row per run) and prints a table.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

H, NH, NKV, HD, I, VD, VT, NAUX = 7168, 64, 64, 128, 18432, 32000, 163840, 3
# --layout mla: TorchSpec's Kimi-K2.5 MLA drafter (configs/drafters/kimi-k2.5-mla.yaml) with the peer's draft vocab
MLA = dict(layout="mla", q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
           v_head_dim=128, rope_theta=50000.0, rms_norm_eps=1e-5,
           rope_scaling={"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096, "beta_fast": 1.0,
                         "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0})
LAYOUT, OPTIONS = "llama", ()  # set by --layout / --options (bench/train_step_sp.py too)


def flops_per_token(T, K):
    """Identical to the peers' (peer_specforge_step.py, and peer_torchspec_mla_step.py for MLA): fc once; per step
    the attention projections (input 2H), o, MLP, draft lm_head, causal attention (QK over the q/k width, PV over
    the v width, T/2 keys on average); x3 for forward + backward; plus the teacher's full-vocab lm_head forward.
    The EAGLE-3.1 norms are not counted (elementwise), so an option's cost shows as lower MFU."""
    if LAYOUT == "mla":
        ql, kl, n, r, v = (MLA[k] for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                            "v_head_dim"))
        qk = n + r
        per_step = 2 * (2 * H) * ql + 2 * ql * NH * qk + 2 * (2 * H) * (kl + r) + 2 * kl * NH * (n + v)
        per_step += 2 * NH * v * H + 2 * 3 * H * I + 2 * H * VD + 2 * NH * (qk + v) * (T / 2)
    else:
        per_step = 2 * (2 * H) * (NH * HD + 2 * NKV * HD) + 2 * (NH * HD) * H + 2 * 3 * H * I + 2 * H * VD
        per_step += 2 * 2 * (NH * HD) * (T / 2)
    return 3 * (2 * NAUX * H * H + K * per_step) + 2 * H * VT


def matmul_peak():
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn_like(a)
    for _ in range(3):
        a @ b
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    s.record()
    for _ in range(20):
        a @ b
    e.record()
    torch.cuda.synchronize()
    return 20 * 2 * 8192 ** 3 / (s.elapsed_time(e) / 1e3)


def drafter_config():
    from eagle3.model import DrafterConfig
    shape = dict(head_dim=HD, rms_norm_eps=1e-6, rope_theta=1e6) if LAYOUT == "llama" else MLA
    return DrafterConfig(hidden_size=H, num_attention_heads=NH, num_key_value_heads=NKV, intermediate_size=I,
                         vocab_size=VT, draft_vocab_size=VD, target_hidden_size=H, max_position_embeddings=262144,
                         num_aux_layers=NAUX, **shape, **{o: True for o in OPTIONS})


def set_drafter(layout: str, options: str) -> None:
    global LAYOUT, OPTIONS
    LAYOUT, OPTIONS = layout, tuple(o for o in options.split(",") if o)


def build(seed=0):
    """Drafter (bf16, on the GPU, random weights), vocab map, target head [VT, H] bf16."""
    from eagle3.model import Eagle3Drafter
    torch.manual_seed(seed)
    with torch.device("cuda"):
        d = Eagle3Drafter(drafter_config()).to(torch.bfloat16)
        for name, p in d.named_parameters():
            if p.dim() == 2:
                torch.nn.init.normal_(p, std=0.02 if name != "embed_tokens.weight" else 1.0)
        t2d = torch.zeros(VT, dtype=torch.bool)
        t2d[torch.randperm(VT)[:VD]] = True
        d2t = t2d.nonzero().squeeze(-1) - torch.arange(VD)
    d.set_vocab_map(d2t.cpu(), t2d.cpu())
    head = torch.randn(VT, H, device="cuda", dtype=torch.bfloat16) * 0.02
    return d, head


def batch(T, head, seed=1):
    g = torch.Generator(device="cuda").manual_seed(seed)
    b = {"hidden_state": torch.randn(1, T, NAUX * H, device="cuda", dtype=torch.bfloat16, generator=g),
         "input_ids": torch.randint(0, VT, (1, T), device="cuda", generator=g),
         "attention_mask": torch.ones(1, T, dtype=torch.long, device="cuda"),
         "loss_mask": torch.ones(1, T, dtype=torch.long, device="cuda"),
         "final_hidden": torch.randn(1, T, H, device="cuda", dtype=torch.bfloat16, generator=g)}
    with torch.no_grad():  # what the dump records: the target's full-vocab argmax per token
        b["target_argmax"] = torch.cat([(c @ head.T).argmax(-1) for c in b["final_hidden"][0].split(4096)])[None]
    return b


def timed(fn, iters, marks=1):
    """Median ms of fn() over iters runs after 2 warm-ups; fn(ev) may record intermediate events in ev."""
    for _ in range(2):
        fn([])
    times = []
    for _ in range(iters):
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(marks + 1)]
        ev[0].record()
        fn(ev)
        ev[-1].record()
        torch.cuda.synchronize()
        times.append([ev[0].elapsed_time(e) for e in ev[1:]])
    return [statistics.median(t[i] for t in times) for i in range(marks)], times


def make_step(variant, K, drafter, head, draft_head, b):
    """One forward + backward of `variant` ('fast', 'fast_fa2', 'fast_full' or 'eager') on batch b; grads dropped
    after. The attention kernel of the fast variants is whatever kernels.set_cuda_attention_kernel last pinned."""
    from eagle3.train.loss import eagle3_loss, eagle3_loss_fused

    def step(ev=None):
        outs = drafter(b["hidden_state"], b["input_ids"], b["attention_mask"], steps=K, fast=variant != "eager")
        if variant == "eager":
            loss, _ = eagle3_loss(drafter, outs, b["final_hidden"], head, b["input_ids"], b["loss_mask"],
                                  b["attention_mask"], chunk_tokens=4096)
        else:
            loss, _ = eagle3_loss_fused(drafter, outs, b["final_hidden"], b["input_ids"], b["loss_mask"],
                                        b["attention_mask"], chunk_tokens=4096, lm_head_weight=head,
                                        target_argmax=None if variant == "fast_full" else b["target_argmax"],
                                        draft_head_weight=draft_head)
        loss.backward()
        for p in drafter.parameters():
            p.grad = None
    return step


def run_plain(variant, T, K, iters, ckpt, drafter, head, draft_head):
    drafter.activation_checkpointing = ckpt
    (ms,), all_t = timed(make_step(variant, K, drafter, head, draft_head, batch(T, head)), iters)
    return {"ms": ms, "ms_all": [round(t[0], 1) for t in all_t]}


def run_engine(T, K, iters, ckpt):
    import deepspeed
    from eagle3.train.config import TrainConfig
    from eagle3.train.step import DrafterTrainStep
    from eagle3.train.setup import deepspeed_config
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": "29611"}.items():
        os.environ.setdefault(k, v)
    if not torch.distributed.is_initialized():
        deepspeed.init_distributed(dist_backend="nccl")
    cfg = TrainConfig(ttt_steps=K, zero_stage=2, bf16=True, activation_checkpointing=ckpt, teacher_chunk_tokens=4096)
    drafter, head = build()
    model = DrafterTrainStep(drafter, head, cfg)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-5, fused=True)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=deepspeed_config(cfg, True))
    b = batch(T, head)

    def step(ev):
        loss, stats = engine(b["hidden_state"], b["input_ids"], b["attention_mask"], b["loss_mask"],
                             b["final_hidden"], b["target_argmax"])
        engine.backward(loss)
        if ev:
            ev[1].record()  # forward + backward done; ev[-1] (after the optimizer) is recorded by timed()
        engine.step()

    (fb, total), all_t = timed(step, iters, marks=2)
    out = {"ms": total, "fwd_bwd_ms": fb, "optimizer_ms": total - fb, "ms_all": [round(t[1], 1) for t in all_t]}
    engine.destroy() if hasattr(engine, "destroy") else None
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    ap.add_argument("--tokens", default="2048,4096,8192,16384,32768,65536")
    ap.add_argument("--variants", default="fast,fast_fa2,fast_full,eager,engine,specforge")
    ap.add_argument("--engine-tokens", default="4096,8192")
    ap.add_argument("--eager-tokens", default="2048,4096,8192,16384,32768,65536")
    ap.add_argument("--full-tokens", default="4096,8192")
    ap.add_argument("--fa2-tokens", default="8192,32768")
    ap.add_argument("--peer", default=None, help="path of peer_specforge_step.py (for the specforge variant)")
    ap.add_argument("--peer-tokens", default="4096,8192,32768")
    ap.add_argument("--ttt", type=int, default=7)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--layout", default="llama", choices=["llama", "mla"], help="the drafter layout timed")
    ap.add_argument("--options", default="", help="EAGLE-3.1 options on, comma-separated (fc_norm,norm_output)")
    a = ap.parse_args()
    set_drafter(a.layout, a.options)
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "train_step.jsonl")
    variants = a.variants.split(",")
    K = a.ttt
    peak = matmul_peak()
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cmd": " ".join(sys.argv),
           "layout": LAYOUT, "options": list(OPTIONS),
           "bf16_matmul_peak_tflops": round(peak / 1e12, 1), "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    rows = []

    def emit(row):
        row.update(tokens_per_s=round(row["tokens"] / (row["ms"] / 1e3)) if "ms" in row else None)
        if "ms" in row:
            fl = flops_per_token(row["tokens"], K)
            row.update(gflop_per_token=round(fl / 1e9, 2), mfu=round(row["tokens"] * fl / (row["ms"] / 1e3) / peak, 3))
        rows.append(row)
        with open(path, "a") as f:
            f.write(json.dumps({**env, **row}) + "\n")
        print(json.dumps(row), flush=True)

    print(json.dumps(env), flush=True)
    # the peer first, in its own process, while this one holds nothing on the GPU
    if "specforge" in variants and a.peer:
        cmd = [sys.executable, a.peer, "--seqs", a.peer_tokens, "--backends", "flex_attention", "--ttt", str(K),
               "--iters", str(a.iters)]
        p = subprocess.run(cmd, capture_output=True, text=True)
        for line in p.stdout.splitlines():
            if line.startswith("{") and '"impl"' in line:
                r = json.loads(line)
                row = {"impl": "specforge-0.2.0", "variant": "specforge_" + r["backend"], "tokens": r["tokens"],
                       "ttt": K}
                if "ms" in r:
                    row.update(ms=r["ms"], peak_mem_gib=r["peak_mem_gib"], peer_mfu_own_peak=r["mfu"])
                else:
                    row["error"] = r.get("error")
                emit(row)
        if p.returncode:
            print(p.stderr[-3000:], file=sys.stderr)
    sizes = [int(x) for x in a.tokens.split(",")]
    plain = [v for v in ("fast", "fast_fa2", "fast_full", "eager") if v in variants]
    if plain:
        from eagle3.model import kernels
        drafter, head = build()
        draft_head = head[drafter.t2d].clone()
        for v in plain:
            allowed = {"fast": sizes, "eager": [int(x) for x in a.eager_tokens.split(",")],
                       "fast_full": [int(x) for x in a.full_tokens.split(",")],
                       "fast_fa2": [int(x) for x in a.fa2_tokens.split(",")]}[v]
            kernels.set_cuda_attention_kernel("flash" if v == "fast_fa2" else "auto")
            attn = "sdpa" if v == "eager" else kernels.cuda_attention_kernel(
                torch.empty(1, NH, 1, drafter.midlayer.self_attn.qk_dim, device="cuda", dtype=torch.bfloat16))
            for T in allowed:
                for ckpt in (["none", "mlp", "step"] if v.startswith("fast") else ["none"]):
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                    row = {"impl": "eagle3", "variant": v, "tokens": T, "ttt": K, "checkpointing": ckpt,
                           "attention_kernel": attn}
                    try:
                        row.update(run_plain(v, T, K, a.iters, ckpt, drafter, head, draft_head))
                        row["peak_mem_gib"] = round(torch.cuda.max_memory_allocated() / 2 ** 30, 1)
                        emit(row)
                        break
                    except torch.OutOfMemoryError as e:
                        row["error"] = f"OutOfMemoryError: {str(e)[:120]}"
                        emit(row)
                    for p in drafter.parameters():
                        p.grad = None
        kernels.set_cuda_attention_kernel("auto")
        del drafter, head, draft_head
    if "engine" in variants:
        for T in [int(x) for x in a.engine_tokens.split(",")]:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            row = {"impl": "eagle3", "variant": "engine", "tokens": T, "ttt": K, "checkpointing": "none",
                   "zero_stage": 2}
            try:
                row.update(run_engine(T, K, a.iters, "none"))
                row["peak_mem_gib"] = round(torch.cuda.max_memory_allocated() / 2 ** 30, 1)
            except torch.OutOfMemoryError as e:
                row["error"] = f"OutOfMemoryError: {str(e)[:120]}"
            emit(row)
    # the table
    print(f"\n{'variant':<18}{'tokens':>7}{'ckpt':>6}{'ms':>9}{'tok/s':>9}{'MFU':>7}{'GiB':>7}")
    for r in rows:
        if "ms" in r:
            print(f"{r['variant']:<18}{r['tokens']:>7}{r.get('checkpointing', '-'):>6}{r['ms']:>9.1f}"
                  f"{r['tokens_per_s']:>9}{r['mfu']:>7.3f}{r['peak_mem_gib']:>7.1f}")
        else:
            print(f"{r['variant']:<18}{r['tokens']:>7}{r.get('checkpointing', '-'):>6}  {r['error'][:40]}")


if __name__ == "__main__":
    main()
