"""Is the measured chain length right? `eagle3 eval --draft-steps auto` against every fixed length, one machine.

For a finished quickstart (or any export with the held-out replay in its provenance): one eval with
`--draft-steps auto` (its measured costs and every length's predicted speedup), then one eval at each fixed length
1..K on the same prompts, each in a fresh process as a user runs it. For each length the table gives the prediction
(the auto run's costs and the replay, with that run's prompts and produced tokens: eval/chain_length.predict_run)
beside the measured wall-clock speedup, and which length auto chose against the best fixed one.

  python3 bench/chain_length.py --quickstart runs/quickstart [--prompts N] [--max-new-tokens M] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quickstart", required=True, help="a quickstart --out directory")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", default=None, help="write the table as JSON here")
    a = ap.parse_args()
    from eagle3.cli.quickstart import evaluate_in_fresh_process
    from eagle3.dump.example import example_target_dir
    from eagle3.eval.chain_length import predict_run
    q = a.quickstart
    export, prompts, target = os.path.join(q, "sglang-drafter"), os.path.join(q, "heldout_prompts.jsonl"), \
        example_target_dir()
    kw = dict(max_new_tokens=a.max_new_tokens, num_prompts=a.prompts, dtype="fp32", device=a.device, progress=False)
    auto = evaluate_in_fresh_process(target, export, prompts, os.path.join(q, "bench_k_auto"), draft_steps="auto",
                                     **kw)
    c = auto["draft_steps_choice"]
    lengths = [len(p) for p in _prompt_lengths(auto)]
    rows = []
    by_k = {v["steps"]: v for v in c["predicted"]}
    for k in sorted(by_k):
        rep = evaluate_in_fresh_process(target, export, prompts, os.path.join(q, f"bench_k{k}"), draft_steps=k, **kw)
        produced = [len(p["tokens"]) for p in rep["per_prompt"]]
        pred = predict_run(c["costs_s"], by_k[k], lengths, produced)
        rows.append({"k": k, "predicted_speedup": pred, "measured_speedup": rep["speedup"],
                     "error": pred / rep["speedup"] - 1, "acceptance_length": rep["acceptance_length"],
                     "replay_accept_len": by_k[k]["accept_len"],
                     "spec_tok_s": rep["spec_tokens_per_s"], "baseline_tok_s": rep["baseline_tokens_per_s"],
                     "lossless": rep["lossless"]})
    best = max(rows, key=lambda r: r["measured_speedup"])
    out = {"chosen": c["chosen"], "auto_measured_speedup": auto["speedup"],
           "auto_predicted_speedup": c["predicted_speedup"], "best_fixed": best["k"],
           "best_fixed_speedup": best["measured_speedup"], "costs_s": c["costs_s"], "rows": rows}
    for r in rows:
        print(f"k={r['k']}: predicted {r['predicted_speedup']:.3f}x measured {r['measured_speedup']:.3f}x "
              f"({100 * r['error']:+.1f}%), tau {r['acceptance_length']:.2f} (replay {r['replay_accept_len']:.2f}), "
              f"{r['spec_tok_s']:.1f} vs {r['baseline_tok_s']:.1f} tok/s")
    print(f"auto chose {c['chosen']}: measured {auto['speedup']:.3f}x, predicted {c['predicted_speedup']:.3f}x; "
          f"best fixed {best['k']} at {best['measured_speedup']:.3f}x", file=sys.stderr)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


def _prompt_lengths(report: dict) -> list[list[int]]:
    """The prompts' token ids as the eval read them (the same file, tokenizer and count)."""
    from eagle3.eval.speculative import read_prompts
    from eagle3.target.load import load_tokenizer
    return read_prompts(report["prompts_file"], load_tokenizer(report["target"]), report["prompts"])


if __name__ == "__main__":
    main()
