"""Training's held-out decoding replay against `eagle3 eval`, on the same prompts, position by position.

The quickstart evaluates the first N held-out conversations (heldout_prompts.jsonl). This script replays greedy
chain drafting (train/acceptance.walk, the trainer's own estimate) with the exported drafter over exactly those
conversations' dumped answers, cut at the eval's --max-new-tokens, and prints both per-position acceptance rates
beside each other. What can still differ: the replay walks the answers the regeneration wrote (bf16 on a GPU,
padded batches), the eval decodes with the fp32 target one prompt at a time, and the two greedy texts part at
near-ties. So it also matches each eval answer (eval.json per_prompt) against the dumped one and gives both
figures over the prompts whose answers are identical: there the replay must equal the eval exactly (the walk is
proven to reproduce decoding on the same text, tests/test_eval.py); any gap is then the texts', not the estimate's.

    python bench/replay_vs_eval.py --quickstart runs/quickstart [--out replay_vs_eval.json]
"""

from __future__ import annotations

import argparse
import json
import os

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quickstart", required=True, help="an `eagle3 quickstart --out` folder (summary.json in it)")
    p.add_argument("--out", default=None, help="write the comparison as JSON here")
    p.add_argument("--eval", default=None, help="an eval.json of the quickstart's drafter on its held-out prompts "
                                                "(default: the quickstart's own eval/eval.json)")
    a = p.parse_args()

    from eagle3.data.dumps import DumpSet, split
    from eagle3.data.batch import collate
    from eagle3.eval.speculative import load_drafter_from_export
    from eagle3.train.acceptance import ChainStats, walk
    from eagle3.train.config import TrainConfig
    from eagle3.target.weights import load_embedding_and_head
    from eagle3.train.step import DrafterTrainStep

    q = a.quickstart
    summary = json.load(open(os.path.join(q, "summary.json")))
    # the eval's whole report: --eval, else the quickstart's own eval.json, else the copy in summary.json
    eval_json = a.eval or os.path.join(q, "eval", "eval.json")
    ev = json.load(open(eval_json)) if os.path.isfile(eval_json) else summary["eval"]
    run = json.load(open(os.path.join(q, "run", "run.json")))
    tcfg = run["train"]
    K, max_new = ev["draft_steps"], ev["max_new_tokens"]

    dumps = DumpSet(tcfg["dump"], verify=False)
    _, held = split(dumps.refs, tcfg["held_out_fraction"], seed=0)
    held = sorted(held, key=lambda r: r.sample_index)
    # the quickstart's eval prompts: held-out conversations in file order, the first `prompts` of them
    refs = held[:ev["prompts"]]
    if len(refs) < ev["prompts"]:
        raise SystemExit(f"only {len(refs)} held-out conversations; the eval used {ev['prompts']} prompts (some "
                         "came from past the dumped range, which the replay cannot see)")

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    embed, head = load_embedding_and_head(summary["eval"]["target"])
    drafter = load_drafter_from_export(ev["export"], embed, torch.float32, device)
    cfg = TrainConfig(**{**{k: v for k, v in tcfg.items() if k in TrainConfig.__dataclass_fields__},
                         "ttt_steps": K, "fast_path": False, "zero_stage": 0})
    step = DrafterTrainStep(drafter, head.float().to(device), cfg).to(device).eval()
    from eagle3.train.acceptance import assistant_turns
    chain, same_replay, same_eval = ChainStats(K), ChainStats(K), ChainStats(K)
    per_prompt = ev.get("per_prompt")
    identical = []
    with torch.no_grad():
        for i, r in enumerate(refs):
            b = collate([dumps.standardized(r, concat=False)])
            b = {k: (v.to(device, torch.float32) if v.is_floating_point() else v.to(device)) for k, v in b.items()}
            _, _, hits = step(b.hidden_state, b.input_ids, b.attention_mask, b.loss_mask, b.final_hidden,
                              b.target_argmax, with_hits=True)
            # the eval answers each prompt's first user turn only
            mine = walk(hits, b.loss_mask, b.attention_mask, K, max_new, first_turn_only=True)
            chain.merge(mine)
            if per_prompt:  # the dumped answer (its first max_new tokens) against the eval's greedy answer
                s0, e0 = assistant_turns(b.loss_mask[0], b.attention_mask[0])[0]
                answer = b.input_ids[0, s0:e0].tolist()[:max_new]
                got = per_prompt[i]["tokens"][:max_new]
                if got == answer:
                    identical.append(i)
                    same_replay.merge(mine)
                    pe = per_prompt[i]
                    same_eval.merge(ChainStats(K, verify_steps=pe["verify_steps"], round_tokens=pe["round_tokens"],
                                               reached=pe["reached"], accepted=pe["accepted"]))
    rows = {"prompts": len(refs), "draft_steps": K, "max_new_tokens": max_new,
            "replay": {"acceptance_length": chain.acceptance_length, "rates": chain.rates,
                       "rounds": chain.verify_steps},
            "eval": {"acceptance_length": ev["acceptance_length"], "rates": ev["acceptance_rate_per_position"],
                     "rounds": ev["verify_steps"]}}
    rel = [(x - y) / y if y else float("nan") for x, y in zip(rows["replay"]["rates"], rows["eval"]["rates"])]
    rows["relative_difference"] = rel
    if per_prompt:
        rows["identical_answers"] = {
            "prompts": identical,
            "replay": {"acceptance_length": same_replay.acceptance_length, "rates": same_replay.rates,
                       "rounds": same_replay.verify_steps},
            "eval": {"acceptance_length": same_eval.acceptance_length, "rates": same_eval.rates,
                     "rounds": same_eval.verify_steps}}
    print(f"{len(refs)} held-out prompts, K={K}, {max_new} new tokens")
    print(f"{'':10}{'tau':>7}" + "".join(f"{'pos' + str(j):>7}" for j in range(K)) + f"{'rounds':>8}")
    for name in ("replay", "eval"):
        r = rows[name]
        print(f"{name:10}{r['acceptance_length']:7.3f}" + "".join(f"{x:7.3f}" for x in r["rates"])
              + f"{r['rounds']:8d}")
    tau_rel = (rows["replay"]["acceptance_length"] - ev["acceptance_length"]) / ev["acceptance_length"]
    print(f"{'rel diff':10}{tau_rel:7.1%}" + "".join(f"{x:7.1%}" for x in rel))
    if per_prompt:
        same = rows["identical_answers"]
        print(f"{len(identical)} of {len(refs)} eval answers are identical to the dumped ones (first {max_new} "
              "tokens); over those prompts:")
        for name in ("replay", "eval"):
            r = same[name]
            print(f"{name:10}{r['acceptance_length']:7.3f}" + "".join(f"{x:7.3f}" for x in r["rates"])
                  + f"{r['rounds']:8d}")
    else:
        print("(eval.json has no per_prompt answers: an eval from before 2026-12-04 -- rerun eagle3 eval to match "
              "answers)")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
