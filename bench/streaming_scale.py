"""Kimi-K2.5 at the published drafters' scale (issue 34): disk offline and streamed, dump GPUs per trainer GPU,
GPU-hours against TorchSpec's recipe. Arithmetic only: every input is a figure measured in bench/RESULTS.md (cited
beside it) or the contract's byte formula, and every output says whether it is measured or projected.

    python3 bench/streaming_scale.py [--samples 600000] [--spool-budget-tb 2]
"""

from __future__ import annotations

import argparse

from eagle3 import contract as C

H, AUX = 7168, 3  # Kimi-K2.5's hidden size; the default capture (HF 3/31/59) plus final_hidden = 4 states
# Measured on one H200 (bench/RESULTS.md): the training step at the Kimi drafter shape, tokens per second
TRAIN_TOK_S = {  # (layout, sample tokens) -> tok/s
    ("llama + fc_norm + norm_output", 2048): 12_738,  # "Training step ... ours vs SpecForge", 2048 row (plain layout)
    ("llama + fc_norm + norm_output", 4096): 12_656,  # "MLA drafter's training step", Llama + options, 4,096
    ("mla + fc_norm + norm_output", 2048): 13_962,    # the MLA + options row at 4,096 (not measured at 2,048)
    ("mla + fc_norm + norm_output", 4096): 13_962,
}
# The dump of the whole INT4 model, projected from pieces measured on one H200 ("Kimi-K2.5 as shipped", 8 x H200,
# TP 8, 65,536-token forwards in rows of 2048): attention 2,372 ms, MoE layers 3,534 ms, all-reduce 497 ms (assumed
# 400 GB/s). Rows of 4096 tokens: the same tokens per forward, attention quadratic per row, so twice its time.
DUMP_FORWARD_MS = {2048: 2372 + 3534 + 497, 4096: 2 * 2372 + 3534 + 497}
DUMP_FORWARD_TOKENS, NODE_GPUS = 65_536, 8
TORCHSPEC_GPU_H = 32 * 28  # lightseekorg's Kimi recipe: 16 + 16 H200 for ~28 hours (the figures)


HEADER = ["sample tokens", "tokens (all samples)", "offline disk bf16 / fp8 (formula)", "streamed disk (fp8)",
          "dump tok/s per 8-GPU node (projected)", "dump GPUs per trainer GPU", "dump GPU-h (projected)",
          "train GPU-h, one pass (from measured tok/s)", "total GPU-h vs TorchSpec's 896"]
LAYOUTS = ("llama + fc_norm + norm_output", "mla + fc_norm + norm_output")


def table(samples: int, spool_tb: float, held_out: float = 0.001) -> list[str]:
    rows = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    for L in (2048, 4096):
        tokens = samples * L
        bf16 = tokens * C.bytes_per_token(AUX + 1, H, 2) / 1e12
        fp8 = tokens * C.bytes_per_token(AUX + 1, H, 2, C.STORAGE_FP8) / 1e12
        node = DUMP_FORWARD_TOKENS / (DUMP_FORWARD_MS[L] / 1e3)
        per_gpu = node / NODE_GPUS
        dump_h = tokens / per_gpu / 3600
        ratio, train_h, total = [], [], []
        for layout in LAYOUTS:
            name, rate = layout.split()[0], TRAIN_TOK_S[(layout, L)]
            h = tokens / rate / 3600
            ratio.append(f"{rate / per_gpu:.1f} ({name})")
            train_h.append(f"{h:,.0f} ({name})")
            total.append(f"{dump_h + h:,.0f} ({(dump_h + h) / TORCHSPEC_GPU_H:.2f}x) ({name})")
        cells = [f"{L:,}", f"{tokens / 1e9:.2f} B", f"{bf16:,.1f} TB / {fp8:,.1f} TB",
                 f"<= {spool_tb:g} TB (the budget; {fp8 * held_out:,.2f} TB of it held-out shards at "
                 f"--held-out-fraction {held_out:g})", f"{node:,.0f}", " / ".join(ratio),
                 f"{dump_h:,.0f}", " / ".join(train_h), " / ".join(total)]
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=600_000, help="target-written samples (two phases of ~300k)")
    ap.add_argument("--spool-budget-tb", type=float, default=2.0)
    ap.add_argument("--held-out-fraction", type=float, default=0.001,
                    help="the spool keeps its held-out shards on disk: at this scale a small fraction (600 samples)")
    a = ap.parse_args()
    print("\n".join(table(a.samples, a.spool_budget_tb, a.held_out_fraction)))


if __name__ == "__main__":
    main()
