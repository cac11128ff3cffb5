"""--draft-steps auto: the replay at every chain length, the cost model, the choice, and eval with it."""

import json
import math
import os

import pytest

from eagle3.eval import chain_length as CL


def test_accepted_distribution_by_hand():
    # rates given reached 0.5, 0.4: P(0) = 0.5, P(1) = 0.5 * 0.6, P(2) = 0.5 * 0.4
    assert CL.accepted_distribution([0.5, 0.4]) == pytest.approx([0.5, 0.3, 0.2])
    assert sum(CL.accepted_distribution([0.9, 0.1, 0.7])) == pytest.approx(1.0)
    # tokens per round = sum (n + 1) P(n) = 1 + r1 + r1 r2: the replay's tau for the same rates
    p = CL.accepted_distribution([0.5, 0.4])
    assert sum((n + 1) * x for n, x in enumerate(p)) == pytest.approx(1 + 0.5 + 0.5 * 0.4)


COSTS = {"greedy": 10.0, "head": 0.5, "step": 1.5, "verify": [10.0, 10.5, 11.0, 12.0], "extend": [1.0, 1.2, 1.4, 1.6],
         "prefill_target": 50.0, "prefill_drafter": 5.0, "prompt_tokens": 100}


def test_round_seconds_and_prediction_by_hand():
    rates = [0.5, 0.4, 0.3]
    # k = 2: head + 1 step + verify over 3 tokens + extend over n + 1 with P(n) = 0.5, 0.3, 0.2
    want = 0.5 + 1.5 + 11.0 + (0.5 * 1.0 + 0.3 * 1.2 + 0.2 * 1.4)
    assert CL.round_seconds(COSTS, 2, rates) == pytest.approx(want)
    replay = {1: {"accept_len": 1.5, "rate_j": [0.5]}, 2: {"accept_len": 1.7, "rate_j": [0.5, 0.4]},
              3: {"accept_len": 1.76, "rate_j": rates}}
    pred = CL.predict(COSTS, replay)
    assert set(pred) == {1, 2, 3}
    r1 = 0.5 + 10.5 + 0.5 * 1.0 + 0.5 * 1.2
    assert pred[1]["round_s"] == pytest.approx(r1)
    assert pred[1]["decode_speedup"] == pytest.approx(1.5 * 10.0 / r1)
    assert pred[2]["decode_speedup"] == pytest.approx(1.7 * 10.0 / want)
    best = max(pred, key=lambda k: pred[k]["decode_speedup"])
    assert CL.choose(pred) == best
    # a replay longer than the costs measured is left out, not extrapolated
    assert 4 not in CL.predict(COSTS, {**replay, 4: {"accept_len": 1.8, "rate_j": rates + [0.2]}})


def test_calibration_terms_by_hand():
    from eagle3.train.acceptance import ChainStats
    st = ChainStats(3)
    for n in [0, 2, 3, 0, 1, 0, 3]:  # rounds accepting n drafts
        st.add_round(n)
    assert CL.accepted_shares(st) == pytest.approx([3 / 7, 1 / 7, 1 / 7, 2 / 7])
    # a measured loop overhead is paid by every round, on top of its pieces
    rates = [0.5, 0.4, 0.3]
    assert CL.round_seconds({**COSTS, "round_overhead": [1.0, 2.5, 4.0]}, 2, rates) == pytest.approx(
        CL.round_seconds(COSTS, 2, rates) + 2.5)          # the overhead calibrated at that chain length
    assert CL.round_seconds({**COSTS, "round_overhead": [1.0, 2.5, 4.0]}, 3, rates) == pytest.approx(
        CL.round_seconds(COSTS, 3, rates) + 4.0)
    assert CL.pieces_seconds(COSTS, 2, [0.5, 0.3, 0.2]) == pytest.approx(CL.round_seconds(COSTS, 2, rates))


def test_calibration_takes_the_median_run_at_every_length(monkeypatch):
    """Three short runs of greedy and of chains of 1 and 2 on a scripted clock, interleaved, the second repeat slow (a
    busy neighbour): the greedy loop and each length's round overhead are the median run's, worked out by hand."""
    import torch
    from eagle3.train.acceptance import ChainStats
    clock = [0.0]
    monkeypatch.setattr(CL.time, "perf_counter", lambda: clock[0])
    calls = []

    class Dec:  # each call advances the clock by its scripted seconds (prefills: 50 target, 5 drafter)
        device = torch.device("cpu")
        greedy_s = [60.0 + 50.0, 90.0 + 50.0, 62.0 + 50.0]
        spec_s = {1: [30.0 + 55.0, 70.0 + 55.0, 33.0 + 55.0], 2: [80.0 + 55.0, 200.0 + 55.0, 84.0 + 55.0]}

        def greedy(self, prompt, n):
            calls.append("greedy")
            clock[0] += self.greedy_s.pop(0)
            return [1] * 7, 7                     # 7 tokens: 6 after the prefill's
        def generate(self, prompt, n, k):
            calls.append(k)
            clock[0] += self.spec_s[k].pop(0)
            st = ChainStats(k)
            for acc in ((0, 2, 1, 2) if k == 2 else (0, 1, 1)):  # 4 rounds at 2, 3 rounds at 1
                st.add_round(acc)
            return [1] * 7, st

    costs = dict(COSTS)
    CL.calibrate(Dec(), [1, 2, 3], costs, 2)
    assert calls == ["greedy", 1, 2] * 3                                                  # interleaved
    pieces1, pieces2 = CL.pieces_seconds(COSTS, 1, [1 / 3, 2 / 3]), CL.pieces_seconds(COSTS, 2, [0.25, 0.25, 0.5])
    assert costs["greedy_step"] == 10.0 and costs["greedy"] == pytest.approx(62.0 / 6)  # runs: 10, 15, 10.33
    # runs: 10, 23.3, 11 s a round at 1 and 20, 50, 21 at 2
    assert costs["round_overhead"] == pytest.approx([33.0 / 3 - pieces1, 84.0 / 4 - pieces2])
    assert [r["chains"][1]["round_overhead_s"] for r in costs["calibration"]["runs"]] == pytest.approx(
        [80.0 / 4 - pieces2, 200.0 / 4 - pieces2, 84.0 / 4 - pieces2])
    # the prediction at each length adds that length's overhead
    rates = [0.5, 0.4]
    assert CL.round_seconds(costs, 1, rates) == pytest.approx(CL.round_seconds(COSTS, 1, rates) + 33.0 / 3 - pieces1)


def test_choose_prefers_the_shorter_chain_on_a_tie():
    assert CL.choose({1: {"decode_speedup": 1.2}, 2: {"decode_speedup": 1.2}, 3: {"decode_speedup": 1.1}}) == 1


def test_whole_run_prediction_by_hand():
    pred = {"tok_s": 0.15}
    # two prompts of 100 and 300 tokens, 11 and 21 new tokens: prefill 0.5 s/token target, 0.05 drafter
    base = 0.5 * 400 + (10 + 20) * 10.0
    spec = 0.5 * 400 + 0.05 * 400 + (10 + 20) / 0.15
    assert CL.predict_run(COSTS, pred, [100, 300], [11, 21]) == pytest.approx(base / spec)


def test_replay_by_steps_refuses_an_export_without_it():
    with pytest.raises(ValueError, match="--draft-steps auto needs the held-out decoding replay"):
        CL.replay_by_steps(None, "/x/export")
    got = CL.replay_by_steps({"decode_by_steps": [{"steps": 1, "accept_len": 1.4, "rate_j": [0.4]}]}, "x")
    assert got == {1: {"accept_len": 1.4, "rate_j": [0.4]}}


def test_cli_draft_steps_argument():
    import argparse
    from eagle3.eval.speculative import draft_steps_arg as _draft_steps_arg
    assert _draft_steps_arg("auto") == "auto" and _draft_steps_arg("3") == 3
    for bad in ("0", "-1", "three"):
        with pytest.raises(argparse.ArgumentTypeError, match="positive chain length or 'auto'"):
            _draft_steps_arg(bad)


@pytest.fixture(scope="module")
def best_export(tmp_path_factory, convs):
    """A tiny drafter trained with a held-out split and checkpoints/best, exported from best: its provenance
    carries the replay at every chain length up to training's."""
    from eagle3.dump.job import DumpConfig, run_dump
    from eagle3.export.sglang import export_drafter
    from eagle3.train.config import TrainConfig
    from eagle3.train.trainer import train
    from tiny import WORDS, make_target, self_distilled_conversations
    from tiny_tokenizers import make_word_tokenizer
    root = tmp_path_factory.mktemp("auto")
    tok = make_word_tokenizer(WORDS)
    target = make_target(str(root / "target"), "llama", tokenizer=tok, vocab_size=len(tok), layer_scale=8.0)
    data = self_distilled_conversations(target, convs, str(root / "c.jsonl"))
    run_dump(DumpConfig(target=target, data=[data], out=str(root / "dump"), layers=[1, 3, 4], dtype="fp32",
                        progress=False))
    result = train(TrainConfig(dump=[str(root / "dump")], target=target, out=str(root / "run"), drafter="tiny",
                               draft_vocab_size=len(tok), bf16=False, max_steps=120, token_budget=4096, lr=3e-3,
                               warmup_steps=10, held_out_fraction=0.2, eval_interval=40, save_interval=1000,
                               keep_best=True, ttt_steps=4, accept_steps=4, num_workers=0, progress=False,
                               wandb_mode="disabled"))
    export_drafter(str(root / "run"), str(root / "export"), step="best")
    return target, data, str(root / "export"), result


def test_training_replays_every_chain_length_and_the_export_carries_it(best_export):
    _, _, export, result = best_export
    best = result["best"]
    rows = best["decode_by_steps"]
    assert [r["steps"] for r in rows] == [1, 2, 3, 4]
    # the longest is the replay training reports (the pooled split of the per-length tensors is the right one)
    assert rows[-1]["accept_len"] == best["decode_accept_len"] and rows[-1]["rate_j"] == best["decode_rate_j"]
    for r in rows:  # tau of a chain of k never exceeds k + 1, and is 1 + the rates' running products at most
        assert 1.0 <= r["accept_len"] <= r["steps"] + 1 and len(r["rate_j"]) == r["steps"]
    # a chain of 1 accepts its draft at the first position's rate: tau_1 = 1 + rate_1
    assert rows[0]["accept_len"] == pytest.approx(1 + rows[0]["rate_j"][0])
    prov = json.load(open(os.path.join(export, "eagle3_provenance.json")))
    assert prov["heldout"]["step"] == best["step"] and prov["heldout"]["decode_by_steps"] == rows


def test_eval_auto_measures_predicts_and_chooses(best_export, tmp_path):
    from eagle3.eval.speculative import evaluate
    target, data, export, _ = best_export
    rep = evaluate(target, export, data, draft_steps="auto", max_new_tokens=24, num_prompts=4, progress=False,
                   out=str(tmp_path / "eval"))
    c = rep["draft_steps_choice"]
    assert rep["lossless"]
    assert c["mode"] == "auto" and rep["draft_steps"] == c["chosen"] in (1, 2, 3, 4)
    assert [v["steps"] for v in c["predicted"]] == [1, 2, 3, 4]
    assert c["chosen"] == CL.choose({v["steps"]: v for v in c["predicted"]})
    costs = c["costs_s"]
    assert len(costs["verify"]) == len(costs["extend"]) == 5
    assert all(x > 0 for x in [costs["greedy"], costs["head"], costs["step"], *costs["verify"], *costs["extend"]])
    cal = costs["calibration"]  # a short real run of each decoder set the greedy step and the rounds' overhead
    assert costs["greedy"] == cal["greedy_loop_s"] > 0 and costs["greedy_step"] > 0
    assert costs["round_overhead"] == cal["round_overhead_s"] and len(cal["round_overhead_s"]) == 4  # every length
    assert all(math.isfinite(x) for x in cal["round_overhead_s"])
    assert [c["draft_steps"] for c in cal["runs"][0]["chains"]] == [1, 2, 3, 4]
    assert all(c["rounds"] > 0 for r in cal["runs"] for c in r["chains"])
    assert math.isfinite(c["predicted_speedup"]) and c["predicted_speedup"] > 0
    assert len(rep["acceptance_rate_per_position"]) == c["chosen"]
    written = json.load(open(tmp_path / "eval" / "eval.json"))
    assert written["draft_steps_choice"]["chosen"] == c["chosen"]


def test_eval_auto_on_an_export_without_the_replay_is_refused_before_loading(best_export, tmp_path):
    import shutil
    from eagle3.eval.speculative import evaluate
    target, data, export, _ = best_export
    other = str(tmp_path / "export")
    shutil.copytree(export, other)
    path = os.path.join(other, "eagle3_provenance.json")
    prov = json.load(open(path))
    prov["heldout"] = None
    json.dump(prov, open(path, "w"))
    with pytest.raises(ValueError, match="give --draft-steps a number"):
        evaluate(target, other, data, draft_steps="auto", progress=False)


def _report(speedup, predicted=None, chosen=1):
    rep = {"speedup": speedup, "device": "cpu", "spec_tokens_per_s": 20.0 * speedup, "baseline_tokens_per_s": 20.0,
           "tokens_per_target_forward": 1.3, "draft_steps": chosen, "draft_steps_choice": None}
    if predicted is not None:
        rep["draft_steps_choice"] = {"chosen": chosen, "predicted_speedup": predicted[chosen - 1],
                                     "predicted": [{"steps": k + 1, "decode_speedup": s}
                                                   for k, s in enumerate(predicted)]}
    return rep


def test_the_quickstart_summary_never_hides_a_slowdown():
    from eagle3.cli.quickstart import chain_length_rows, speedup_line
    fast = speedup_line(_report(1.12, [1.10, 1.05], chosen=1))
    assert fast.startswith("1.12x wall clock") and "predicted 1.10x" in fast and "SLOWER" not in fast
    # measured below 1 while a length was predicted to pay: said plainly, with the numbers
    slow = speedup_line(_report(0.93, [1.04, 0.98], chosen=1))
    assert slow.startswith("SLOWER: speculative decoding ran at 0.93x") and "18.6 vs 20.0 tok/s" in slow
    # no length predicted to pay on this machine: said so, with the best prediction
    none = speedup_line(_report(0.88, [0.91, 0.85], chosen=1))
    assert "no chain length is predicted to pay on this machine (best 0.91x)" in none
    # a fixed length: no prediction, still never a bare number under 1
    assert speedup_line(_report(0.80)).startswith("SLOWER")
    (name, text), = chain_length_rows(_report(1.12, [1.10, 1.05], chosen=1))
    assert name == "chain length" and text.startswith("1, chosen by measurement") and "2: 1.05x" in text
    assert chain_length_rows(_report(1.0)) == [("chain length", "1 (fixed)")]
