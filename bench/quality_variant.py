#!/usr/bin/env python3
"""One training change against a finished `eagle3 quickstart`, everything else held: the same dump, draft vocab,
split, steps, schedule and seed (its run.json's training config, with only the given fields changed), then the export
of the best held-out checkpoint and `eagle3 eval` on the same held-out prompts with the same settings.

  python bench/quality_variant.py --quickstart QS_DIR --out DIR [--set fc_norm=true --set drafter=smollm2-135m-mla ...]

Writes DIR/summary.json: the changes, the training's best held-out replay, the eval report's figures.
"""
import argparse
import json
import os
import sys

import yaml


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quickstart", required=True, help="a finished quickstart's --out")
    ap.add_argument("--out", required=True)
    ap.add_argument("--set", action="append", default=[], help="KEY=VALUE of the training config (YAML value)")
    a = ap.parse_args(argv)
    from eagle3.eval.speculative import evaluate
    from eagle3.export.sglang import export_drafter
    from eagle3.train.config import TrainConfig
    from eagle3.train.trainer import train
    base = json.load(open(os.path.join(a.quickstart, "run", "run.json")))["train"]
    changes = {k: yaml.safe_load(v) for k, v in (s.split("=", 1) for s in a.set)}
    unknown = set(changes) - set(base)
    if unknown:
        raise SystemExit(f"unknown training fields {sorted(unknown)}")
    cfg = {**base, **changes, "out": os.path.join(a.out, "run"), "resume": False, "progress": False,
           "report_to": "none", "betas": tuple(base["betas"])}
    result = train(TrainConfig(**cfg))
    export = os.path.join(a.out, "sglang-drafter")
    export_drafter(cfg["out"], export, step="best" if result.get("best") else None)
    ev = json.load(open(os.path.join(a.quickstart, "summary.json")))["eval"]
    rep = evaluate(ev["target"], export, ev["prompts_file"], draft_steps=ev["draft_steps"],
                   max_new_tokens=ev["max_new_tokens"], num_prompts=ev["prompts"], out=os.path.join(a.out, "eval"),
                   dtype=ev["dtype"], progress=False)
    keys = ("acceptance_length", "acceptance_rate_per_position", "tokens_per_target_forward", "speedup", "lossless",
            "verify_steps", "generated_tokens")
    summary = {"quickstart": os.path.abspath(a.quickstart), "changes": changes, "best": result.get("best"),
               "eval": {k: rep[k] for k in keys}, "cmd": " ".join(sys.argv)}
    with open(os.path.join(a.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps({"changes": changes, "best_replay": (result.get("best") or {}).get("decode_accept_len"),
                      **summary["eval"]}))


if __name__ == "__main__":
    main()
