"""eval: real speculative decoding with a tiny target and its trained, exported drafter."""

import json
import os
import shutil

import pytest
import torch

from eagle3 import contract as C
from eagle3.contract import ContractError
from eagle3.eval.speculative import evaluate
from eagle3.train.acceptance import ChainStats


@pytest.fixture(scope="module")
def word_target(tmp_path_factory):
    """A tiny Llama whose tokenizer has whole-word tokens only (and a vocab of exactly those), so text written
    from its own generations re-tokenizes to the same ids."""
    from tiny import WORDS, make_target
    from tiny_tokenizers import make_word_tokenizer
    tok = make_word_tokenizer(WORDS)
    return make_target(str(tmp_path_factory.mktemp("word_target")), "llama", tokenizer=tok, vocab_size=len(tok),
                       layer_scale=8.0)


@pytest.fixture(scope="module")
def distilled(word_target, convs, tmp_path_factory):
    """The conversations' first user turns answered by the tiny target itself (greedy): the data a drafter is
    trained on to accept well on its target's generations."""
    from tiny import self_distilled_conversations
    return self_distilled_conversations(word_target, convs, str(tmp_path_factory.mktemp("distilled") / "c.jsonl"))


def _train_and_export(word_target, distilled, root, **drafter) -> str:
    """A drafter over-fitted on the tiny Llama target's own answers, exported for SGLang."""
    from eagle3.dump.job import DumpConfig, run_dump
    from eagle3.export.sglang import export_drafter
    from eagle3.train.config import TrainConfig
    from eagle3.train.trainer import train
    dump = str(root / "dump")
    run_dump(DumpConfig(target=word_target, data=[distilled], out=dump, layers=[1, 3, 4], dtype="fp32",
                        progress=False))
    vocab = json.load(open(os.path.join(word_target, "config.json")))["vocab_size"]
    train(TrainConfig(dump=[dump], target=word_target, out=str(root / "run"), **{"drafter": "tiny", **drafter},
                      draft_vocab_size=vocab, bf16=False, max_steps=250, token_budget=4096, lr=3e-3, warmup_steps=10,
                      held_out_fraction=0.0, save_interval=1000, num_workers=0, progress=False,
                      wandb_mode="disabled"))
    export = str(root / "export")
    export_drafter(str(root / "run"), export)
    return export


@pytest.fixture(scope="module")
def trained_export(word_target, distilled, tmp_path_factory):
    return _train_and_export(word_target, distilled, tmp_path_factory.mktemp("e2e"))


@pytest.fixture(scope="module")
def trained_mla_export(word_target, distilled, tmp_path_factory):
    """The MLA layout with the EAGLE-3.1 options, trained and exported the same way."""
    return _train_and_export(word_target, distilled, tmp_path_factory.mktemp("e2e_mla"), drafter="tiny-mla",
                             fc_norm=True, norm_output=True)


def _eval(target, export, prompts, **kw):
    kw = {"draft_steps": 4, "max_new_tokens": 24, "num_prompts": 6, "progress": False, **kw}
    return evaluate(target, export, prompts, **kw)


@pytest.mark.parametrize("export", ["trained_export", "trained_mla_export"])
def test_speculative_decoding_is_lossless_and_accepts(word_target, distilled, export, tmp_path, request):
    trained_export = request.getfixturevalue(export)
    rep = _eval(word_target, trained_export, distilled, out=str(tmp_path / "eval"))
    assert rep["lossless"], rep["mismatches"]
    assert rep["capture_indices"] == [1, 3, 4]     # derived from the export's ids with the SGLang rule
    assert rep["acceptance_length"] > 3.0, rep
    assert rep["tokens_per_target_forward"] > 2.0
    assert len(rep["acceptance_rate_per_position"]) == 4
    assert json.load(open(tmp_path / "eval" / "eval.json"))["acceptance_length"] == rep["acceptance_length"]
    assert (tmp_path / "eval" / "acceptance.png").stat().st_size > 1000
    # per prompt: the greedy answer and its rounds, which add up to the pooled figures
    pp = rep["per_prompt"]
    assert len(pp) == rep["prompts"] and sum(len(p["tokens"]) for p in pp) == rep["generated_tokens"]
    assert sum(p["verify_steps"] for p in pp) == rep["verify_steps"]
    pooled = ChainStats(4, reached=[sum(c) for c in zip(*(p["reached"] for p in pp))],
                        accepted=[sum(c) for c in zip(*(p["accepted"] for p in pp))])
    assert pooled.rates == rep["acceptance_rate_per_position"]
    assert rep["prepacked_linears"] > 0 and rep["spec_tokens_per_s"] > 0  # CPU fp32: oneDNN prepacked weights
    assert 0 <= rep["one_row_plain_linears"] <= rep["prepacked_linears"]
    # the target's one-row path settled by its own one-token step: the kept path is the fastest median
    path = rep["one_row_path"]
    assert path["chosen"] == min(path["median_s"], key=path["median_s"].get) and len(path["median_s"]) == 3


def test_an_export_with_shifted_ids_accepts_clearly_less(word_target, distilled, trained_export, tmp_path):
    """The lesson this project exists for: serve the drafter other hidden states and acceptance collapses."""
    wrong = str(tmp_path / "wrong")
    shutil.copytree(trained_export, wrong)
    cfg_path = os.path.join(wrong, "config.json")
    cfg = json.load(open(cfg_path))
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [
        i + 1 for i in cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]]
    json.dump(cfg, open(cfg_path, "w"))
    with pytest.raises(ContractError, match=r"capture HF \[2, 4, 5\].*trained on HF \[1, 3, 4\]"):
        _eval(word_target, wrong, distilled)        # the provenance in the same folder says otherwise: refused
    right = _eval(word_target, trained_export, distilled)
    shifted = _eval(word_target, wrong, distilled, allow_foreign_export=True)
    assert shifted["capture_indices"] == [2, 4, 5]
    assert shifted["lossless"]                      # still correct output, only slower
    assert shifted["acceptance_length"] < right["acceptance_length"] - 1.0, (shifted, right)


def test_spec_stats_pooling():
    s = ChainStats(3)
    for n in (3, 0, 1, 3):
        s.add_round(n)
    assert s.verify_steps == 4 and s.round_tokens == (3 + 1) + 1 + 2 + 4
    assert s.reached == [4, 3, 2] and s.accepted == [3, 2, 2]   # n=1 reaches draft 2, n=0 only draft 1


@pytest.mark.parametrize("export", ["trained_export", "trained_mla_export"])
def test_held_out_walk_replays_speculative_decoding_exactly(word_target, distilled, export, request):
    """train/acceptance.walk over a TTT unroll of the target's own greedy answer counts exactly the rounds, reached
    and accepted drafts that real speculative decoding (eval) counts on the same prompt (for every layout: the MLA
    drafter with fc_norm and norm_output as well)."""
    trained_export = request.getfixturevalue(export)
    from eagle3.target.capture import HiddenStateCapture
    from eagle3.target.load import find_backbone, load_target, load_tokenizer, target_info
    from eagle3.eval.speculative import SpeculativeDecoder, load_drafter_from_export, read_prompts
    from eagle3.model.checkpoint import capture_indices_of_export
    from eagle3.train.acceptance import ChainStats, draft_hits, walk
    K, max_new = 4, 20
    info = target_info(word_target)
    indices = capture_indices_of_export(trained_export, info.num_hidden_layers)
    target = load_target(word_target, torch.float32, torch.device("cpu"))
    backbone = find_backbone(target, info.num_hidden_layers)
    drafter = load_drafter_from_export(trained_export, target.get_input_embeddings().weight, torch.float32,
                                       torch.device("cpu"))
    dec = SpeculativeDecoder(target, backbone, drafter, indices, set())  # no eos: every answer runs to max_new
    compared = accepted = 0
    for prompt in read_prompts(distilled, load_tokenizer(word_target), 6):
        ref, _ = dec.greedy(prompt, max_new + K + 1)          # room for the last round's drafts
        _, real = dec.generate(prompt, max_new, K)
        ids = torch.tensor([prompt + ref])
        with torch.no_grad(), HiddenStateCapture(backbone, indices) as cap:
            logits = target(input_ids=ids).logits
            aux = torch.cat([cap.states[C.hidden_state_key(k)] for k in indices], dim=-1)
            hits = draft_hits(drafter, drafter.ttt_forward(aux, ids, steps=K), logits.argmax(-1))
        loss_mask = torch.zeros_like(ids)
        loss_mask[0, len(prompt):] = 1
        replay = walk(hits, loss_mask, None, K, max_new_tokens=max_new)
        assert (replay.verify_steps, replay.round_tokens, replay.reached, replay.accepted) == \
               (real.verify_steps, real.round_tokens, real.reached, real.accepted)
        assert replay.verify_steps > 2
        accepted += sum(replay.accepted)
        compared += 1
    # the comparison saw real acceptance (not on every prompt: with no eos, a prompt whose answer ends at once goes
    # on into text past its end that no drafter was trained on, and may accept nothing there)
    assert compared == 6 and accepted > 20


def test_walk_rounds_by_hand():
    """One turn at positions 2..11 (first token 2, drafted positions 3..11), K = 3."""
    from eagle3.train.acceptance import walk
    T, K = 12, 3
    hits = torch.zeros(1, T, K, dtype=torch.bool)
    hits[0, 1] = torch.tensor([True, True, False])    # round at t=1: accepts 2, next round at t=4
    hits[0, 4] = torch.tensor([True, True, True])     # accepts 3 -> t=8
    hits[0, 8] = torch.tensor([True, True, True])     # drafts positions 10, 11 only (checked 2): accepts 2 -> t=11
    mask = torch.zeros(1, T, dtype=torch.long)
    mask[0, 2:] = 1
    s = walk(hits, mask, None, K)
    assert s.verify_steps == 3 and s.round_tokens == 3 + 4 + 3
    assert s.reached == [3, 3, 2] and s.accepted == [3, 3, 1]   # the last round could judge 2 drafts only
    s = walk(hits, mask, None, K, max_new_tokens=4)   # 1 + 3 tokens after the first round: stop
    assert s.verify_steps == 1
    mask[0, 6] = 0                                    # two turns: 2..5 and 7..11
    s = walk(hits, mask, None, K)
    assert s.verify_steps == 1 + 3 and s.accepted == [1 + 1, 1 + 1, 0]   # turn 2: rounds at t = 6, 7 miss, t = 8 takes 2


def test_eval_checks_the_export_shapes_before_decoding(word_target, distilled, trained_export, tmp_path):
    """2 ids for an fc trained on 3 states: a clear error naming the file and tensor, not a matmul traceback."""
    two = str(tmp_path / "two")
    shutil.copytree(trained_export, two)
    cfg_path = os.path.join(two, "config.json")
    cfg = json.load(open(cfg_path))
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [0, 2]
    json.dump(cfg, open(cfg_path, "w"))
    with pytest.raises(ContractError, match=r"two/model\.safetensors .*\n  fc\.weight: shape \(64, 192\), "
                                            r"expected \(64, 128\)"):
        _eval(word_target, two, distilled, allow_foreign_export=True)


# Two records of MT-bench's question.jsonl (FastChat llm_judge), verbatim.
MT_BENCH = [
    {"question_id": 81, "category": "writing", "turns": [
        "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences and "
        "must-see attractions.", "Rewrite your previous response. Start every sentence with the letter A."]},
    {"question_id": 101, "category": "reasoning", "turns": [
        "Imagine you are participating in a race with a group of people. If you have just overtaken the second "
        "person, what's your current position? Where is the person you just overtook?",
        "If the \"second person\" is changed to \"last person\" in the above scenario, what would be the answer?"],
     "reference": ["You are in second place.", "Uncertain."]},
]


def _jsonl(path, records):
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    return str(path)


def test_mt_bench_prompts_are_the_first_turns(word_target, tmp_path):
    from eagle3.conversations.formats import DataError
    from eagle3.target.load import load_tokenizer
    from eagle3.eval.speculative import read_prompts
    tok = load_tokenizer(word_target)
    mt = _jsonl(tmp_path / "mtbench.jsonl", MT_BENCH)
    firsts = _jsonl(tmp_path / "firsts.jsonl", [{"messages": [{"role": "user", "content": r["turns"][0]}]}
                                               for r in MT_BENCH])
    prompts = read_prompts(mt, tok, None)
    assert prompts == read_prompts(firsts, tok, None) and len(prompts) == 2
    bad = _jsonl(tmp_path / "bad.jsonl", [MT_BENCH[0], {"question_id": 1, "turns": "not a list"}])
    with pytest.raises(DataError, match=r"bad\.jsonl:2: 'turns' \(MT-bench\) must be a list of strings"):
        read_prompts(bad, tok, None)


def test_cli_eval_of_a_foreign_export_on_mt_bench(word_target, trained_export, tmp_path, capsys):
    """An export without provenance (a drafter from elsewhere) needs --allow-foreign-export; its ids are then read
    with the latest SGLang release's rule for the target (llama: id + 1)."""
    from eagle3.cli import main
    foreign = str(tmp_path / "foreign")
    shutil.copytree(trained_export, foreign)
    os.remove(os.path.join(foreign, "eagle3_provenance.json"))
    args = ["eval", "--target", word_target, "--drafter", foreign, "--prompts",
            _jsonl(tmp_path / "mtbench.jsonl", MT_BENCH), "--num-prompts", "2", "--max-new-tokens", "8",
            "--draft-steps", "3"]
    with pytest.raises(SystemExit):
        main(args)
    assert "no eagle3_provenance.json" in capsys.readouterr().err
    main(args + ["--allow-foreign-export"])
    rep = json.loads(capsys.readouterr().out)
    assert rep["prompts"] == 2 and rep["capture_indices"] == [1, 3, 4] and rep["lossless"]
