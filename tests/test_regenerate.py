"""eagle3 regenerate: the target rewrites the assistant turns (hf engine, OpenAI-compatible servers), resumably,
and the dump checks that regenerated data comes from its own target."""

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

from eagle3.contract import ContractError, file_sha256, load_manifest
from eagle3.conversations.formats import DataError, read_conversations
from eagle3.conversations.masking import render_and_mask
from eagle3.records import REGENERATE_FILE
from eagle3.regenerate.config import RegenConfig
from eagle3.regenerate.files import CONVERSATIONS, ERRORS, SKIPPED
from eagle3.regenerate.hf_engine import HFEngine, plan_batches
from eagle3.regenerate.items import derive_seed, read_items
from eagle3.regenerate.job import run_regenerate

HERE = os.path.dirname(os.path.abspath(__file__))
FILES = (CONVERSATIONS, ERRORS, SKIPPED)


# ----------------------------------------------------------------------------------------------------------
# Fixtures and helpers
# ----------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def word_target(tmp_path_factory):
    """A tiny Llama whose tokenizer has whole-word tokens, so decoded answers re-tokenize to the same ids."""
    from tiny import WORDS, make_target
    from tiny_tokenizers import make_word_tokenizer
    tok = make_word_tokenizer(WORDS)
    return make_target(str(tmp_path_factory.mktemp("word_target")), "llama", tokenizer=tok, vocab_size=len(tok),
                       layer_scale=8.0)


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    """10 ShareGPT conversations, every other one with two exchanges, some with a system turn."""
    from tiny import write_conversations
    return write_conversations(tmp_path_factory.mktemp("chats") / "chats.jsonl", n=10, seed=1)


# A Qwen3-like template: renders an assistant turn's reasoning_content, and closes the think block in the
# generation prompt when enable_thinking is false.
THINK_TEMPLATE = (
    "{%- for m in messages -%}<|im_start|>{{ m['role'] }}\n"
    "{%- if m['role'] == 'assistant' and m.reasoning_content is defined and m.reasoning_content %}"
    "<think>{{ m.reasoning_content }}</think>{% endif %}{{ m['content'] }}<|im_end|>\n{% endfor -%}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}{% endif %}")
THINK_CHAIN = ["assistant", "<think>", "hmm", "</think>", "Paris"]  # then <|im_end|>


@pytest.fixture(scope="module")
def think_target(tmp_path_factory):
    """A Llama whose next token depends on the current token only: the layers add nothing to the residual stream
    (zero o_proj / down_proj), the embedding is one-hot and lm_head maps token t to its successor. After the
    generation prompt's 'assistant' it says '<think> hmm </think> Paris'; after '</think>' just 'Paris'."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from tiny import WORDS
    from tiny_tokenizers import make_word_tokenizer
    tok = make_word_tokenizer(WORDS + ["hmm", "Paris", "thinking", "inline", "thoughts", "re", "prev", "no",
                                       "think"])
    tok.add_tokens(["<think>", "</think>"])
    tok.chat_template = THINK_TEMPLATE
    V = len(tok)
    H = 16 * ((V + 15) // 16)
    cfg = LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=False,
                      bos_token_id=1, eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    ids = tok.convert_tokens_to_ids(THINK_CHAIN) + [tok.eos_token_id]
    nxt = {a: b for a, b in zip(ids, ids[1:])}
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.zero_()
        model.model.embed_tokens.weight[:, :V] = torch.eye(V)
        model.lm_head.weight.zero_()
        for t in range(V):
            model.lm_head.weight[nxt.get(t, tok.eos_token_id), t] = 1.0
    path = str(tmp_path_factory.mktemp("think_target"))
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def regen(data, out, target=None, **kw):
    kw = {"engine": "hf" if not kw.get("servers") else None, "max_new_tokens": 10, "batch_size": 3,
          "progress": False, **kw}
    return run_regenerate(RegenConfig(data=[str(data)], out=str(out), target=target, **kw))


def read_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def file_bytes(out):
    return {name: open(os.path.join(out, name), "rb").read() for name in FILES}


def write_jsonl(path, records):
    with open(path, "w") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


def naive_greedy(model, prompt: list[int], max_new: int, stops: set[int]) -> list[int]:
    """The definition: a full forward over the whole sequence for every new token, no cache, no batch, argmax."""
    seq, new = list(prompt), []
    with torch.no_grad():
        while len(new) < max_new:
            t = int(model(input_ids=torch.tensor([seq]), use_cache=False).logits[0, -1].argmax())
            seq.append(t)
            new.append(t)
            if t in stops:
                break
    return new


def _stops(tok) -> set[int]:
    # The word tokenizer's end-of-turn tokens (its eos <|im_end|> and <|endoftext|>), which the model's
    # generation config eos (id 2 = <|im_end|>) is one of.
    return {tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")}


# ----------------------------------------------------------------------------------------------------------
# hf engine
# ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("batching,kv_cache", [("padded", "dynamic"), ("padded", "static"), ("continuous", "auto")])
def test_engine_generate_is_token_exact_with_naive_greedy(word_target, batching, kv_cache):
    """Left-padded batch + KV cache (model.generate; dynamic, or static with every prompt padded to
    --max-prompt-tokens and rows to a power of two), and continuous batching with its paged cache
    (model.generate_batch) == unbatched, uncached argmax, token for token."""
    from eagle3.target.load import load_target, load_tokenizer
    cfg = RegenConfig(data=[], out="", max_new_tokens=14, batching=batching, kv_cache=kv_cache,
                      max_prompt_tokens=64)
    engine = HFEngine(word_target, torch.float32, torch.device("cpu"), cfg)
    assert engine.continuous == (batching == "continuous")
    assert engine.static == (kv_cache == "static")
    tok, model = load_tokenizer(word_target), load_target(word_target, torch.float32, torch.device("cpu"))
    assert set(engine.stop_ids) == _stops(tok)
    texts = ["the fox", "quick brown dogs jumps over the lazy wizards while seven", "hum", "a song about code",
             "seven wizards quietly hum a song about the quick brown fox that jumps over lazy dogs"]
    prompts = [engine.prompt_ids([{"role": "user", "content": t}]) for t in texts]
    assert len({len(p) for p in prompts}) == len(prompts)  # all different: left padding is exercised
    got = engine.generate(prompts, seed=0)
    finishes = set()
    for p, (new, finish) in zip(prompts, got):
        ref = naive_greedy(model, p, cfg.max_new_tokens, _stops(tok))
        assert new == ref
        assert finish == ("stop" if ref[-1] in _stops(tok) else "length")
        finishes.add(finish)
    assert finishes == {"stop", "length"}  # both endings occur in this set


def test_generate_calls_bound_budget_and_padding():
    from eagle3.regenerate.hf_engine import generate_calls
    g = torch.Generator().manual_seed(0)
    lengths = [int(x) for x in torch.randint(20, 4000, (300,), generator=g)] + [4000] * 5
    calls = generate_calls(lengths, budget=40000)
    assert sorted(i for c in calls for i in c) == list(range(len(lengths)))
    for c in calls:
        longest = max(lengths[i] for i in c)
        assert len(c) == 1 or len(c) * longest <= 40000
        assert all(2 * lengths[i] >= longest for i in c)
    assert max(len(c) for c in calls) > 10  # short rows do share calls
    assert generate_calls(lengths, budget=40000) == calls


def _naive_conversation(model, tok, messages, max_new):
    """Independent reference: each answer is the naive greedy continuation of the history written so far."""
    history, finishes, counts = [], [], []
    for m in messages:
        if m["role"] != "assistant":
            history.append(dict(m))
            continue
        text = tok.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
        new = naive_greedy(model, tok(text, add_special_tokens=False)["input_ids"], max_new, _stops(tok))
        stop = new[-1] in _stops(tok)
        answer = tok.decode(new[:-1] if stop else new, skip_special_tokens=True)
        if not answer.strip():
            return None
        history.append({"role": "assistant", "content": answer})
        finishes.append("stop" if stop else "length")
        counts.append(len(new))
    return {"messages": history, "finish_reasons": finishes, "completion_tokens": counts}


@pytest.mark.parametrize("batching,kv_cache", [("padded", "dynamic"), ("padded", "static"), ("continuous", "auto")])
def test_hf_multi_turn_greedy_equals_naive_conversations(word_target, chats, tmp_path, batching, kv_cache):
    from eagle3.target.load import load_target, load_tokenizer
    rec = regen(chats, tmp_path / "out", word_target, batch_size=4, max_new_tokens=12, batching=batching,
                kv_cache=kv_cache, max_prompt_tokens=200)
    tok, model = load_tokenizer(word_target), load_target(word_target, torch.float32, torch.device("cpu"))
    items, skipped, read = read_items([chats], None)
    assert read == 10 and not skipped
    # batches mix prompt lengths (left padding) and hold more than one conversation
    batches = plan_batches(items, 4)
    assert max(len(b) for b in batches) > 1
    assert any(len({len(tok.apply_chat_template(it.messages[:2], tokenize=True, add_generation_prompt=True)
                        ["input_ids"]) for it in b}) > 1 for b in batches)
    convs = {c["sample_index"]: c for c in read_jsonl(tmp_path / "out" / CONVERSATIONS)}
    errors = {e["sample_index"]: e for e in read_jsonl(tmp_path / "out" / ERRORS)}
    assert list(convs) == sorted(convs)
    two_turns = 0
    for it in items:
        want = _naive_conversation(model, tok, it.messages, 12)
        if want is None:
            assert errors[it.sample_index]["kind"] == "answer" and "empty answer" in errors[it.sample_index]["error"]
            continue
        got = convs[it.sample_index]
        assert got["messages"] == want["messages"], it.sample_index
        assert (got["finish_reasons"], got["completion_tokens"]) == (want["finish_reasons"], want["completion_tokens"])
        # exactly as many assistant turns as the original, and the user/system turns unchanged
        assert [m["role"] for m in got["messages"]] == [m["role"] for m in it.messages]
        assert [m["content"] for m in got["messages"] if m["role"] != "assistant"] == \
               [m["content"] for m in it.messages if m["role"] != "assistant"]
        two_turns += sum(m["role"] == "assistant" for m in got["messages"]) == 2
    assert two_turns >= 2 and len(convs) >= 7
    assert rec["counts"]["conversations"] == len(convs) and rec["counts"]["errors"] == len(errors)
    assert rec["counts"]["assistant_turns"] == sum(len(c["finish_reasons"]) for c in convs.values())
    assert rec["status"] == "complete" and rec["engine"]["dtype"] == "float32"
    assert rec["engine"]["batching"] == batching
    assert rec["engine"]["kv_cache"] == ("static" if kv_cache == "static" else "dynamic")


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_resume_after_a_kill_is_byte_identical(word_target, chats, tmp_path, temperature):
    kw = dict(temperature=temperature, top_p=0.9 if temperature else 1.0, seed=7, batch_size=3)
    full = regen(chats, tmp_path / "full", word_target, **kw)
    with pytest.raises(SystemExit, match="stopped after 1 batches"):
        regen(chats, tmp_path / "cut", word_target, stop_after_batches=1, **kw)
    written = read_jsonl(tmp_path / "cut" / CONVERSATIONS)
    assert 0 < len(written) < full["counts"]["conversations"]
    with open(tmp_path / "cut" / CONVERSATIONS, "ab") as f:  # a kill in the middle of the next append
        f.write(b'{"sample_index": 9, "messages": [{"role": "user", "con')
    again = regen(chats, tmp_path / "cut", word_target, **kw)
    assert file_bytes(tmp_path / "cut") == file_bytes(tmp_path / "full")
    assert again["this_run"]["conversations"] == full["counts"]["conversations"] - len(written)
    assert again["counts"] == full["counts"]
    # a rerun of a finished OUT does nothing and changes nothing
    assert regen(chats, tmp_path / "cut", word_target, **kw)["this_run"]["conversations"] == 0
    assert file_bytes(tmp_path / "cut") == file_bytes(tmp_path / "full")
    # what bench/quality_device.sh carries to another machine, conversations.jsonl and regenerate.json alone, is a
    # finished OUT there: nothing is generated again and the answers stay as they are
    import shutil
    (tmp_path / "carried").mkdir()
    for name in (CONVERSATIONS, REGENERATE_FILE):
        shutil.copy(tmp_path / "full" / name, tmp_path / "carried" / name)
    carried = regen(chats, tmp_path / "carried", word_target, **kw)
    assert carried["this_run"]["conversations"] == 0 and carried["counts"] == full["counts"]
    assert file_bytes(tmp_path / "carried")[CONVERSATIONS] == file_bytes(tmp_path / "full")[CONVERSATIONS]
    if temperature:  # sampling really samples: another seed writes other answers
        other = regen(chats, tmp_path / "seed8", word_target, **dict(kw, seed=8))
        assert file_bytes(tmp_path / "seed8")[CONVERSATIONS] != file_bytes(tmp_path / "full")[CONVERSATIONS]
        assert other["counts"]["read"] == 10


def test_malformed_input_leaves_out_untouched_and_other_settings_are_refused(word_target, tiny_targets, chats,
                                                                              tmp_path):
    out = tmp_path / "out"
    regen(chats, out, word_target)
    before = {p: open(out / p, "rb").read() for p in sorted(os.listdir(out))}
    lines = open(chats).read().splitlines()
    bad = write_jsonl(tmp_path / "bad.jsonl", lines[:2] + ['{"conversations": [{"from": "human", "value": "x"}'] +
                      lines[2:])
    with pytest.raises(DataError, match=r"bad\.jsonl:3: malformed JSON line"):
        regen(bad, out, word_target)
    with pytest.raises(ContractError, match=r"sampling: .*\"temperature\": 0\.0.*\"temperature\": 0\.5"):
        regen(chats, out, word_target, temperature=0.5)
    with pytest.raises(ContractError, match="identity"):
        regen(chats, out, tiny_targets["llama"])
    other_data = write_jsonl(tmp_path / "other.jsonl", lines[:4])
    with pytest.raises(ContractError, match="inputs"):
        regen(other_data, out, word_target)
    after = {p: open(out / p, "rb").read() for p in sorted(os.listdir(out))}
    assert after == before


# ----------------------------------------------------------------------------------------------------------
# Data parallel (torchrun, gloo)
# ----------------------------------------------------------------------------------------------------------

def _torchrun_regenerate(n, *args, check=True):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n), "--standalone",
           "-m", "eagle3.regenerate", *map(str, args), "--dtype", "fp32", "--no-progress"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    if check:
        assert r.returncode == 0, r.stderr[-4000:]
    return r


@pytest.mark.slow
def test_data_parallel_equals_one_process_also_after_a_kill(word_target, chats, tmp_path):
    ref = regen(chats, tmp_path / "one", word_target, batch_size=2)
    args = ("--engine", "hf", "--target", word_target, "--data", chats, "--out", tmp_path / "dp", "--batch-size", 2,
            "--max-new-tokens", 10)
    r = _torchrun_regenerate(2, *args, "--stop-after-batches", 1, check=False)
    assert r.returncode != 0 and "stopped after 1 batches" in r.stderr
    parts = sorted(p for p in os.listdir(tmp_path / "dp") if ".rank" in p)
    assert parts == ["conversations.rank0.jsonl", "conversations.rank1.jsonl", "errors.rank0.jsonl",
                     "errors.rank1.jsonl"]
    _torchrun_regenerate(2, *args)  # resumes from the part files
    assert file_bytes(tmp_path / "dp") == file_bytes(tmp_path / "one")
    assert not [p for p in os.listdir(tmp_path / "dp") if ".rank" in p]
    rec = json.load(open(tmp_path / "dp" / REGENERATE_FILE))
    assert rec["engine"]["world_size"] == 2 and rec["counts"] == ref["counts"]


# ----------------------------------------------------------------------------------------------------------
# Reasoning
# ----------------------------------------------------------------------------------------------------------

def test_hf_reasoning_modes(think_target, tmp_path):
    data = write_jsonl(tmp_path / "q.jsonl", [
        {"messages": [{"role": "user", "content": "the fox"}, {"role": "assistant", "content": "old"}]},
        {"messages": [{"role": "system", "content": "hum"}, {"role": "user", "content": "a song"},
                      {"role": "assistant", "content": "old", "reasoning_content": "old thoughts"},
                      {"role": "user", "content": "code"}, {"role": "assistant", "content": "old"}]}])
    answers = {}
    for mode in ("keep", "strip", "disable"):
        regen(data, tmp_path / mode, think_target, reasoning=mode, max_new_tokens=8)
        convs = read_jsonl(tmp_path / mode / CONVERSATIONS)
        assert [len(c["messages"]) for c in convs] == [2, 5]
        answers[mode] = {m["content"] for c in convs for m in c["messages"] if m["role"] == "assistant"}
        # the original's reasoning is replaced along with its content
        assert not any("reasoning_content" in m for c in convs for m in c["messages"])
    assert answers == {"keep": {"<think> hmm </think> Paris"}, "strip": {"Paris"}, "disable": {"Paris"}}
    # cut off right after the reasoning: nothing is left to store, an 'answer' error ...
    rec = regen(data, tmp_path / "short", think_target, reasoning="strip", max_new_tokens=3)
    errors = read_jsonl(tmp_path / "short" / ERRORS)
    assert [(e["sample_index"], e["turn"], e["kind"], e["error"]) for e in errors] == [
        (i, 0, "answer", "nothing left after removing the reasoning (finish_reason length)") for i in (0, 1)]
    # every answer unusable: the run failed (issue 30: it used to say 'complete' and exit 0)
    assert rec["counts"]["conversations"] == 0 and rec["status"] == "failed"
    # ... which the deterministic hf engine does not regenerate on a rerun
    again = regen(data, tmp_path / "short", think_target, reasoning="strip", max_new_tokens=3)
    assert again["this_run"]["generated_tokens"] == 0 and read_jsonl(tmp_path / "short" / ERRORS) == errors


def test_normalize_keeps_reasoning_content_for_the_template(think_target, tmp_path):
    from eagle3.target.load import load_tokenizer
    tok = load_tokenizer(think_target)
    data = write_jsonl(tmp_path / "r.jsonl", [
        {"messages": [{"role": "user", "content": "the fox", "reasoning_content": "ignored on a user turn"},
                      {"role": "assistant", "content": "Paris", "reasoning_content": "hmm"}]},
        {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y", "reasoning_content": 3}]}])
    with pytest.raises(DataError, match=r"r\.jsonl:2: turn 1 \(assistant\): reasoning_content must be a string"):
        list(read_conversations([data]))
    _, _, messages = next(read_conversations([data]))
    assert messages == [{"role": "user", "content": "the fox"},
                        {"role": "assistant", "content": "Paris", "reasoning_content": "hmm"}]
    ids, mask = render_and_mask(tok, messages, None)
    assert tok.decode([t for t, m in zip(ids, mask) if m]) == "<think> hmm </think> Paris <|im_end|>"


# ----------------------------------------------------------------------------------------------------------
# Servers: a stdlib fake (real HTTP, its own process) and llama.cpp
# ----------------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def fake_server(*flags):
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, "fake_openai_server.py"), *flags],
                            stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        proc.kill()
        proc.wait()


def server_requests(url):
    with urllib.request.urlopen(url + "/stats", timeout=10) as r:
        return json.load(r)["requests"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "eagle3.cli", "regenerate", *map(str, args), "--no-progress"],
                          capture_output=True, text=True, timeout=timeout)


def test_server_messages_history_seeds_and_reasoning(chats, tmp_path):
    with fake_server("--reasoning") as url:
        rec = regen(chats, tmp_path / "keep", servers=[url], concurrency=3, seed=5, temperature=0.3, top_p=0.7,
                    max_new_tokens=20)
        requests = server_requests(url)
        regen(chats, tmp_path / "strip", servers=[url], reasoning="strip")
        n_before = len(server_requests(url))
        regen(chats, tmp_path / "disable", servers=[url], reasoning="disable", num_samples=2)
        disabled = server_requests(url)[n_before:]
    items, _, _ = read_items([chats], None)
    keep = read_jsonl(tmp_path / "keep" / CONVERSATIONS)
    assert [c["sample_index"] for c in keep] == [it.sample_index for it in items]  # order restored
    assert rec["model"] == "fake-model" and rec["identity"] is None and "identity_note" in rec
    assert rec["counts"]["assistant_turns"] == len(requests) == sum(
        m["role"] == "assistant" for it in items for m in it.messages)
    assert {(r["temperature"], r["top_p"], r["max_tokens"]) for r in requests} == {(0.3, 0.7, 20)}
    assert sorted(r["seed"] for r in requests) == sorted(
        derive_seed(5, it.sample_index, k) for it in items for k in range(sum(m["role"] == "assistant"
                                                                            for m in it.messages)))
    for c, it in zip(keep, items):
        users = [m["content"] for m in it.messages if m["role"] == "user"]
        answers = [m for m in c["messages"] if m["role"] == "assistant"]
        expect = f"re: {users[0]}"
        assert answers[0] == {"role": "assistant", "content": f"<think>inline thoughts</think>\n{expect}",
                              "reasoning_content": f"thinking about {users[0]}"}
        if len(answers) == 2:  # the second answer saw the first regenerated answer, not the original
            assert answers[1]["content"].endswith(f"re: {users[1]} | prev: <think>inline thoughts</think>\n{expect}")
    strip = read_jsonl(tmp_path / "strip" / CONVERSATIONS)
    assert all(m == {"role": "assistant", "content": m["content"]} and m["content"].startswith("re: ")
               for c in strip for m in c["messages"] if m["role"] == "assistant")
    assert all(r["chat_template_kwargs"] == {"enable_thinking": False, "thinking": False} for r in disabled)
    assert all(m["content"].startswith("no-think: ") for c in read_jsonl(tmp_path / "disable" / CONVERSATIONS)
               for m in c["messages"] if m["role"] == "assistant")


def test_skipped_conversations_and_truncation(tmp_path):
    sys_, u, a = ({"role": r, "content": r[0] + str(i)} for i, r in enumerate(("system", "user", "assistant")))
    data = write_jsonl(tmp_path / "s.jsonl", [
        {"messages": [sys_, a, u, a]},       # 0 starts with an assistant turn (after the system turn)
        {"messages": [u]},                   # 1 no assistant turn
        {"messages": []},                    # 2 empty
        {"messages": [u, a, a]},             # 3 an assistant turn after an assistant turn
        {"messages": [sys_, u, a, u]},       # 4 ok: the unanswered last user turn is dropped
        {"messages": [u, u, a]},             # 5 ok: two user turns, one answer
        {"messages": [a, u, a]},             # 6 starts with an assistant turn
    ])
    with fake_server() as url:
        rec = regen(data, tmp_path / "out", servers=[url])
    skipped = read_jsonl(tmp_path / "out" / SKIPPED)
    assert [(s["sample_index"], s["reason"], s["origin"]) for s in skipped] == [
        (0, "starts_with_assistant", f"{data}:1"), (1, "no_assistant", f"{data}:2"), (2, "empty", f"{data}:3"),
        (3, "no_user_before_assistant", f"{data}:4"), (6, "starts_with_assistant", f"{data}:7")]
    convs = read_jsonl(tmp_path / "out" / CONVERSATIONS)
    assert [(c["sample_index"], [m["role"] for m in c["messages"]]) for c in convs] == [
        (4, ["system", "user", "assistant"]), (5, ["user", "user", "assistant"])]
    assert rec["skipped"] == {"empty": 1, "no_assistant": 1, "no_user_before_assistant": 1,
                              "starts_with_assistant": 2}


def test_max_turns_and_max_prompt_tokens(word_target, chats, tmp_path):
    items, _, _ = read_items([chats], None)
    with fake_server() as url:
        regen(chats, tmp_path / "one_turn", servers=[url], max_turns=1)
        with pytest.raises(ValueError, match="--max-prompt-tokens is an --engine hf option"):
            regen(chats, tmp_path / "x", servers=[url], max_prompt_tokens=10)
    convs = read_jsonl(tmp_path / "one_turn" / CONVERSATIONS)
    assert [[m["role"] for m in c["messages"]] for c in convs] == [
        [m["role"] for m in it.messages[:next(j for j, m in enumerate(it.messages) if m["role"] == "assistant") + 1]]
        for it in items]
    with pytest.raises(ValueError, match="--max-turns must be >= 1"):
        regen(chats, tmp_path / "x", word_target, max_turns=0)

    from eagle3.target.load import load_tokenizer
    tok = load_tokenizer(word_target)

    def prompt_len(messages):
        return len(tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)["input_ids"])

    first = sorted(prompt_len(it.messages[:next(j for j, m in enumerate(it.messages) if m["role"] == "assistant")])
                   for it in items)
    limit = first[len(first) // 2]  # about half the first prompts are longer
    rec = regen(chats, tmp_path / "short", word_target, max_prompt_tokens=limit)
    errors = read_jsonl(tmp_path / "short" / ERRORS)
    too_long = [e for e in errors if "exceeds --max-prompt-tokens" in e["error"]]
    assert len(too_long) >= len(first) // 2 - 1 and all(e["kind"] == "too_long" for e in too_long)
    for c in read_jsonl(tmp_path / "short" / CONVERSATIONS):  # every prompt that was answered fits
        for k, m in enumerate(c["messages"]):
            if m["role"] == "assistant":
                assert prompt_len(c["messages"][:k]) <= limit
    assert rec["counts"]["conversations"] + rec["counts"]["errors"] == len(items)
    # prompts too long are the data's, not failures of the run: about half of them here, and the run is complete
    # (with the default --max-error-rate 0.1 it would otherwise have failed)
    from eagle3.regenerate.record import check_record
    assert rec["status"] == "complete" and check_record(rec) is None


def test_server_retries_transient_errors(chats, tmp_path):
    with fake_server("--fail-first", "3") as url:
        rec = regen(chats, tmp_path / "out", servers=[url], concurrency=1, retries=3, retry_backoff=0.05,
                    num_samples=3)
        requests = server_requests(url)
    assert rec["status"] == "complete" and rec["counts"]["errors"] == 0 and rec["counts"]["conversations"] == 3
    assert len(requests) == rec["counts"]["assistant_turns"] + 3


def test_server_that_always_fails(chats, tmp_path):
    with fake_server("--always-fail") as url:
        r = cli("--data", chats, "--out", tmp_path / "out", "--server", url, "--retries", 1, "--retry-backoff", 0.05,
                "--num-samples", 3, "--concurrency", 2)
        requests = server_requests(url)
    assert r.returncode == 1 and "3 of 3 conversations failed (100%" in r.stderr and "3 server" in r.stderr
    errors = read_jsonl(tmp_path / "out" / ERRORS)
    assert [(e["sample_index"], e["kind"], e["turn"]) for e in errors] == [(0, "server", 0), (1, "server", 0),
                                                                            (2, "server", 0)]
    assert all("HTTP 500" in e["error"] and url in e["error"] and "(2 attempts)" in e["error"] for e in errors)
    assert len(requests) == 6 and read_jsonl(tmp_path / "out" / CONVERSATIONS) == []
    rec = json.load(open(tmp_path / "out" / REGENERATE_FILE))
    assert rec["status"] == "failed" and rec["errors"] == {"server": 3}
    with fake_server() as url:  # the server is fixed: a rerun fills the errors in
        r = cli("--data", chats, "--out", tmp_path / "out", "--server", url, "--num-samples", 3)
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(read_jsonl(tmp_path / "out" / CONVERSATIONS)) == 3 and read_jsonl(tmp_path / "out" / ERRORS) == []


def test_server_that_hangs_times_out(chats, tmp_path):
    with fake_server("--hang") as url:
        t0 = time.time()
        rec = regen(chats, tmp_path / "out", servers=[url], timeout=0.5, retries=1, retry_backoff=0.05,
                    num_samples=2)
    assert time.time() - t0 < 30
    errors = read_jsonl(tmp_path / "out" / ERRORS)
    assert [e["sample_index"] for e in errors] == [0, 1]
    assert all(e["kind"] == "server" and "no whole answer within --timeout 0.5 s (2 attempts)" in e["error"]
               for e in errors)
    assert rec["status"] == "failed"  # every conversation failed


def test_empty_answers_are_errors_not_conversations(chats, tmp_path):
    with fake_server("--empty") as url:
        rec = regen(chats, tmp_path / "out", servers=[url], num_samples=3)
    assert read_jsonl(tmp_path / "out" / CONVERSATIONS) == []
    errors = read_jsonl(tmp_path / "out" / ERRORS)
    assert [(e["kind"], e["error"]) for e in errors] == [("answer", "empty answer (finish_reason stop)")] * 3
    assert rec["status"] == "failed" and rec["counts"]["conversations"] == 0  # all failed: not complete


def test_no_server_is_a_clear_error_at_start(chats, tmp_path):
    url = f"http://127.0.0.1:{free_port()}/v1"
    r = cli("--data", chats, "--out", tmp_path / "out", "--server", url, "--timeout", 5)
    assert r.returncode == 1 and "no server answered GET /models" in r.stderr and url in r.stderr
    assert not (tmp_path / "out").exists()
    r = cli("--data", chats, "--out", tmp_path / "out")
    assert r.returncode == 2 and "--server URL" in r.stderr and "--engine" in r.stderr


# llama.cpp: a real inference server over the example target's GGUF -------------------------------------------

def _gguf():
    pytest.importorskip("llama_cpp", reason="llama-cpp-python[server] is not installed (test extras)")
    from eagle3.dump.example import gguf_path
    try:
        return gguf_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))


def start_llama(gguf, log_path):
    port = free_port()
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--host", "127.0.0.1",
                             "--port", str(port), "--n_ctx", "2048", "--n_threads", "1"],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/v1"
    deadline = time.time() + 120
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llama_cpp.server exited: {open(log_path).read()[-3000:]}")
        try:
            urllib.request.urlopen(url + "/models", timeout=2).read()
            return proc, url
        except OSError:
            time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"llama_cpp.server did not start: {open(log_path).read()[-3000:]}")


@pytest.fixture(scope="module")
def llama_data(tmp_path_factory):
    from tiny import write_conversations
    return write_conversations(tmp_path_factory.mktemp("llama") / "c.jsonl", n=10, seed=3)


@pytest.mark.slow
def test_llama_cpp_server_kill_and_resume(llama_data, tmp_path):
    gguf = _gguf()
    args = ("--data", llama_data, "--max-new-tokens", 12, "--concurrency", 1, "--retries", 2, "--retry-backoff",
            0.2, "--timeout", 60)
    servers = []
    try:
        proc, url = start_llama(gguf, tmp_path / "llama1.log")
        servers.append(proc)
        r = cli("--out", tmp_path / "ref", "--server", url, *args)
        assert r.returncode == 0, r.stderr[-3000:]
        ref = json.load(open(tmp_path / "ref" / REGENERATE_FILE))
        items, _, _ = read_items([llama_data], None)
        convs = read_jsonl(tmp_path / "ref" / CONVERSATIONS)
        assert [c["sample_index"] for c in convs] == [it.sample_index for it in items]
        assert [[m["role"] for m in c["messages"]] for c in convs] == [[m["role"] for m in it.messages]
                                                                       for it in items]
        turns = sum(len(c["finish_reasons"]) for c in convs)
        assert ref["model"] == gguf and ref["status"] == "complete" and ref["counts"]["conversations"] == 10
        assert sum(ref["finish_reasons"].values()) == ref["counts"]["assistant_turns"] == turns > 10
        assert 0 < ref["counts"]["generated_tokens"] <= 12 * turns
        assert ref["counts"]["truncated_answers"] == ref["finish_reasons"].get("length", 0)

        # kill the server mid-run: what was written stays, the run says so and exits non-zero
        run = subprocess.Popen([sys.executable, "-m", "eagle3.cli", "regenerate", "--out", str(tmp_path / "cut"),
                                "--server", url, *map(str, args), "--no-progress"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 120
        while time.time() < deadline and run.poll() is None:
            p = tmp_path / "cut" / CONVERSATIONS
            if p.exists() and len(open(p).read().splitlines()) >= 2:
                break
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        _, err = run.communicate(timeout=120)
        assert run.returncode == 1, err[-3000:]
        assert "every server stopped answering" in err and url in err
        kept = read_jsonl(tmp_path / "cut" / CONVERSATIONS)
        assert 2 <= len(kept) < 10
        assert kept == [c for c in convs if c["sample_index"] in {k["sample_index"] for k in kept}]
        cut = json.load(open(tmp_path / "cut" / REGENERATE_FILE))
        assert cut["status"] == "incomplete" and cut["counts"]["pending"] == 10 - len(kept)

        proc, url = start_llama(gguf, tmp_path / "llama2.log")  # back (on another port)
        servers.append(proc)
        r = cli("--out", tmp_path / "cut", "--server", url, *args)
        assert r.returncode == 0, r.stderr[-3000:]
        assert file_bytes(tmp_path / "cut") == file_bytes(tmp_path / "ref")
    finally:
        for p in servers:
            p.kill()
            p.wait()


# ----------------------------------------------------------------------------------------------------------
# Dump provenance
# ----------------------------------------------------------------------------------------------------------

def test_dump_checks_where_regenerated_data_comes_from(word_target, tiny_targets, chats, tmp_path):
    from eagle3.dump.job import DumpConfig, run_dump

    def dump(target, data, out, **kw):
        return run_dump(DumpConfig(target=target, data=[str(data)], out=str(tmp_path / out), layers=[1, 3, 4],
                                   dtype="fp32", progress=False, **kw))

    regen(chats, tmp_path / "regen", word_target)
    data = tmp_path / "regen" / CONVERSATIONS
    m = dump(word_target, data, "same")
    assert len(m.data_sources) == 1
    src = m.data_sources[0]
    assert src["file"] == str(data) and src["sha256"] == file_sha256(str(data))
    assert (src["backend"], src["identity_matches_target"], src["reasoning"]) == ("hf", True, "keep")
    assert src["sampling"]["temperature"] == 0.0
    assert load_manifest(str(tmp_path / "same")).data_sources == m.data_sources

    other = tiny_targets["llama"]
    with pytest.raises(ContractError, match="another target") as e:
        dump(other, data, "other")
    assert word_target in str(e.value) and other in str(e.value) and "--allow-foreign-data" in str(e.value)
    m = dump(other, data, "other", allow_foreign_data=True)
    assert m.data_sources[0]["identity_matches_target"] is False

    assert dump(word_target, chats, "plain").data_sources == []  # no regenerate.json beside it

    with fake_server() as url:  # a server run without --target records no identity
        regen(chats, tmp_path / "served", servers=[url], num_samples=3)
    with pytest.raises(ContractError, match="no target identity recorded"):
        dump(word_target, tmp_path / "served" / CONVERSATIONS, "served")
    assert dump(word_target, tmp_path / "served" / CONVERSATIONS, "served", allow_foreign_data=True).data_sources


def test_server_with_target_records_identity_and_reasoning_reaches_the_dump(think_target, chats, tmp_path):
    """--server with --target DIR: the identity of DIR is recorded, so the dump of that target accepts the data;
    reasoning_content kept from the server is rendered by the template into the loss-masked tokens."""
    from eagle3.dump.job import DumpConfig, run_dump
    from eagle3.target.load import load_tokenizer
    with fake_server("--reasoning") as url:
        rec = regen(chats, tmp_path / "regen", think_target, servers=[url], num_samples=3)
    assert rec["identity"]["config_sha256"] == rec["target"]["config_sha256"]
    data = tmp_path / "regen" / CONVERSATIONS
    m = run_dump(DumpConfig(target=think_target, data=[str(data)], out=str(tmp_path / "dump"), layers=[1],
                            dtype="fp32", progress=False))
    assert m.data_sources[0]["identity_matches_target"] is True and m.totals["samples"] == 3
    tok = load_tokenizer(think_target)
    _, _, messages = next(read_conversations([str(data)]))
    ids, mask = render_and_mask(tok, messages, None)
    assert "<think> thinking about" in tok.decode([t for t, k in zip(ids, mask) if k])


def test_the_hf_engine_and_the_cli_need_no_openai():
    """`--engine hf` (the quickstart; a GPU machine given only the wheels it runs) imports the regenerate job and the
    CLI without the openai package: a machine without it stopped the one-GPU streaming benchmark at import. Asking
    for a server there names what is missing."""
    code = ("import sys; sys.modules['openai'] = None\n"
            "import eagle3.regenerate.job, eagle3.cli.main, eagle3.cli.quickstart\n"
            "from eagle3.regenerate.server_client import _openai\n"
            "try:\n    _openai()\nexcept ImportError as e:\n    print('refused:', e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "refused:" in r.stdout and "openai" in r.stdout
