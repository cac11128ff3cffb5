#!/usr/bin/env python3
"""Teacher-forced top-k coverage of a quickstart's held-out answers by its exported drafter, per draft step.

  python bench/topk_coverage.py --quickstart runs/quickstart [--k 1,2,4,8] [--steps 5]

At draft step j and position t the drafter (chained over its own states, as in training) predicts token t+2+j; it
is covered at k when the target's greedy token there (the dump's target_argmax) is among the drafter's k best
draft-vocab tokens. Counted over loss-masked (answer) positions of the held-out split the quickstart trained
with (held_out_fraction 0.05, seed 0). What a tree of k candidates per step could accept at most, per step.
"""
import argparse
import json
import os

import torch


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--quickstart", required=True)
    p.add_argument("--k", default="1,2,4,8")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--held-out-fraction", type=float, default=0.05)
    a = p.parse_args()
    from eagle3.data.dumps import DumpSet, split
    from eagle3.dump.example import example_target_dir
    from eagle3.eval.speculative import load_drafter_from_export
    from eagle3.target.load import load_target
    ks = [int(k) for k in a.k.split(",")]
    target = load_target(example_target_dir(), torch.float32, torch.device("cpu"))
    d = load_drafter_from_export(os.path.join(a.quickstart, "sglang-drafter"), target.get_input_embeddings().weight,
                                 torch.float32, torch.device("cpu"))
    ds = DumpSet(os.path.join(a.quickstart, "dump"), verify=False)
    _, held = split(ds.refs, a.held_out_fraction, seed=0)
    hits, n = torch.zeros(a.steps, len(ks)), torch.zeros(a.steps)
    with torch.no_grad():
        for r in held:
            s = ds.standardized(r)
            ids, T = s["input_ids"][None], s["input_ids"].shape[0]
            ta, lm = s["target_argmax"], s["loss_mask"].bool()
            for j, m in enumerate(d.ttt_forward(s["hidden_state"][None].float(), ids, None, steps=a.steps)):
                L = T - 2 - j
                if L <= 0:
                    continue
                top = d.target_ids(d.draft_logits(m)[0, :L].topk(max(ks), dim=-1).indices)
                eq, ok = top == ta[1 + j:1 + j + L, None], lm[2 + j:2 + j + L]
                for i, k in enumerate(ks):
                    hits[j, i] += (eq[:, :k].any(-1) & ok).sum()
                n[j] += ok.sum()
    cov = (hits / n[:, None]).tolist()
    for j in range(a.steps):
        print(f"step {j}: " + " ".join(f"@{k} {c:.2f}" for k, c in zip(ks, cov[j])))
    print(json.dumps({"k": ks, "coverage": cov, "positions": n.tolist(), "held_out_samples": len(held)}))


if __name__ == "__main__":
    main()
