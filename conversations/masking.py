"""Chat-template rendering -> token ids + the assistant-token loss mask (and load_samples: read + tokenize).

The messages come normalised from eagle3.conversations.formats (read_conversations): roles system/user/assistant,
string content, an assistant turn's ``reasoning_content`` kept for the templates that render it.

Loss mask (any chat template, no per-template rules).  A template that marks the assistant's output with
``{% generation %}`` blocks gives it in one rendering: ``apply_chat_template(..., return_dict=True,
return_assistant_tokens_mask=True)``.  Those masks are brought to the semantics below (one block per
assistant turn, else the prefix method is used; a leading assistant turn stays unmasked; each block ends right
after its last end-of-turn token, or takes the end-of-turn token right after it), see ``_generation_mask``.
Every other template (most shipped ones) uses prefix rendering:

1. ``T = apply_chat_template(messages)``; tokenize ``T`` once with ``add_special_tokens=False`` (templates
   write BOS themselves), with ``return_offsets_mapping=True`` for a fast tokenizer.  A slow (Python) tokenizer
   has no offsets (Kimi-K2.5's tiktoken-based ``TikTokenTokenizer``, shipped as code): its token boundaries are
   found without them, see step 4.
2. For each assistant turn ``i``: ``P = render(messages[:i], add_generation_prompt=True)`` and
   ``F = render(messages[:i+1])``.  When ``T`` starts with ``F`` the assistant span is ``[len(P), len(F))``.
   (If ``F`` does not start with ``P`` -- a generation prompt that differs from the header written for a
   finished turn, e.g. DeepSeek-R1's ``<｜Assistant｜><think>\\n`` -- the span starts where ``P`` and ``F``
   diverge.)
3. Fallback when ``T`` does not start with ``F`` (the template rewrites a turn once later turns exist, e.g.
   Qwen3 drops the ``<think>`` block of earlier turns): the part of ``F`` shared with ``P`` must still be a
   prefix of ``T``; the turn's content (as is, else stripped) is searched in ``T`` right there (no further
   away than it sits in ``F``), the span runs from the divergence point through the content plus whatever
   ``T`` shares with the text ``F`` writes after the content (the end-of-turn marker).  If that fails too,
   the turn stays unmasked (counted, logged); a record with no alignable assistant turn is skipped as
   ``mask_alignment_failed``.  An assistant turn with no preceding message has no prompt and is never
   masked.
4. A token is an assistant token when its first character lies inside a span (a token starting inside a
   multi-byte character starts at that character).  Fast tokenizers: from the offsets.  Slow tokenizers
   (``_first_token_at``): the first token starting at or after a span boundary ``c`` is ``len(ids(T[:c]))``
   when ``ids(T[:c])`` is a prefix of ``ids(T)`` (one more tokenization per boundary, two per turn), else it
   is found by decoding growing prefixes of ``ids(T)`` from where the two diverge (a token straddles ``c``,
   e.g. a header's trailing space merged into the answer's first word); a boundary found neither way leaves
   the turn unmasked (counted, logged).  Both give the offsets' answer for a tokenizer whose ids decode back
   to the text they encode (byte-level BPE, tiktoken).  Within each span the mask
   then ends right after the last end-of-turn token (``eos_token_id`` plus whichever of ``<|im_end|>``,
   ``<|eot_id|>``, ``<|eom_id|>``, ``<|end_of_text|>``, ``<｜end▁of▁sentence｜>``, ``<|endoftext|>``, ``</s>``,
   ``<end_of_turn>``, ``<|end|>``, ``<|return|>`` exist in the vocab), so ChatML's ``content<|im_end|>`` is
   masked and the ``\\n`` after it is not.
5. ``max_length`` keeps the head; a sample left with no loss token is skipped.

Skipped records (``load_samples``' Counter): ``empty``, ``no_assistant``, ``template_rejected`` (the template
raised, e.g. role alternation), ``mask_alignment_failed``, ``no_loss_tokens_after_truncation``.
"""

from __future__ import annotations

import bisect
import collections
import logging
import re
import weakref
from dataclasses import dataclass
from typing import Any

from eagle3.conversations.formats import DataError, _as_path_list, read_conversations


logger = logging.getLogger(__name__)

END_OF_TURN_TOKENS = (
    "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<｜end▁of▁sentence｜>", "<|endoftext|>",
    "</s>", "<end_of_turn>", "<|end|>", "<|return|>",
)

SKIP_REASONS = ("empty", "no_assistant", "template_rejected", "mask_alignment_failed",
                "no_loss_tokens_after_truncation")


class SkipSample(Exception):
    """A well-formed record that yields no training sample; ``reason`` is one of ``SKIP_REASONS``."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


@dataclass
class TokenizedSample:
    sample_index: int        # global running index over all records of all files, in file order
    input_ids: list[int]
    loss_mask: list[int]     # 0/1, same length


_END_IDS: "weakref.WeakKeyDictionary[Any, tuple]" = weakref.WeakKeyDictionary()


def _is_fast(tokenizer) -> bool:
    return bool(getattr(tokenizer, "is_fast", False))


def _check_tokenizer(tokenizer) -> None:
    # Fast and slow tokenizers both work: a slow one (no offsets) takes the offset-free path of _prefix_mask.
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat_template; conversations are rendered with it")


def end_of_turn_ids(tokenizer) -> frozenset[int]:
    """eos_token_id plus the ids of the known end-of-turn tokens present in the vocab (cached per tokenizer)."""
    signature = (tokenizer.eos_token_id if not isinstance(tokenizer.eos_token_id, list)
                 else tuple(tokenizer.eos_token_id), len(tokenizer))
    try:
        cached = _END_IDS.get(tokenizer)
    except TypeError:  # not weak-referenceable / not hashable
        cached = None
    if cached is not None and cached[0] == signature:
        return cached[1]
    vocab = tokenizer.get_vocab()
    ids = {vocab[t] for t in END_OF_TURN_TOKENS if t in vocab}
    eos = tokenizer.eos_token_id
    if isinstance(eos, int):
        ids.add(eos)
    elif isinstance(eos, (list, tuple)):
        ids.update(i for i in eos if isinstance(i, int))
    result = frozenset(ids)
    try:
        _END_IDS[tokenizer] = (signature, result)
    except TypeError:
        pass
    return result


def _render(tokenizer, messages: list[dict], add_generation_prompt: bool) -> str:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    if not isinstance(text, str):
        raise TypeError(f"apply_chat_template returned {type(text).__name__}, expected str")
    return text


def _common_prefix_len(a: str, b: str) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _assistant_span(tokenizer, text: str, messages: list[dict], i: int) -> tuple[int, int] | str:
    """Char span of assistant turn i in ``text``, or a string saying why it cannot be located."""
    if i == 0:
        return "leading assistant turn (no prompt)"
    try:
        prompt = _render(tokenizer, messages[:i], True)
        full = _render(tokenizer, messages[:i + 1], False)
    except Exception as e:  # noqa: BLE001 - templates raise anything
        return f"template raised on the partial conversation ({type(e).__name__}: {e})"
    start = _common_prefix_len(prompt, full)
    if text.startswith(full):
        return (start, len(full)) if len(full) > start else "empty assistant span"
    # Fallback: the template rewrote this turn once later turns exist.
    if not text.startswith(full[:start]):
        return "the conversation so far is not a prefix of the full rendering"
    content = messages[i]["content"]
    for c in ((content, content.strip()) if content.strip() != content else (content,)):
        at_full = full.find(c, start)
        if at_full < 0:
            continue
        pos = text.find(c, start)
        if pos < 0 or pos - start > at_full - start:
            continue
        end = pos + len(c)
        tail = full[at_full + len(c):]
        end += _common_prefix_len(tail, text[end:end + len(tail)])
        if end > start:
            return start, end
    return "assistant content not found where the partial rendering puts it"


# transformers' own test for "this template marks the assistant's tokens" (render_jinja_template)
_GENERATION_TAG = re.compile(r"\{\%-?\s*generation\s*-?\%\}")
MASK_METHODS = ("auto", "generation", "prefix")


def has_generation_blocks(tokenizer) -> bool:
    """Whether the chat template wraps assistant output in ``{% generation %}`` blocks (then transformers'
    ``return_assistant_tokens_mask`` gives the assistant tokens in one rendering, no prefix rendering needed)."""
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and bool(_GENERATION_TAG.search(template))


def _generation_mask(tokenizer, messages: list[dict], turns: list[int],
                     stats: collections.Counter | None) -> tuple[list[int], list[int]] | str:
    """(input_ids, full mask) from the template's generation blocks, or a string saying why they cannot be used.

    Normalised to the prefix method's semantics: one block per assistant turn (else unusable: we could not tell
    which block is which turn), a leading assistant turn (no prompt) is not masked, and each block's mask ends
    right after its last end-of-turn token -- or takes the end-of-turn token right after the block when the
    template leaves it outside. One difference is accepted: transformers masks a token that merely overlaps a
    block, the prefix method only one that starts in the span. They differ only for a token straddling the
    header and the content (a header ending in a space BPE merges with the first word: ' Hello'), which the
    prefix method leaves out and this one masks (the model does predict it); the golden templates have none."""
    try:
        enc = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True, add_generation_prompt=False)
    except Exception as e:  # noqa: BLE001 - jinja TemplateError from raise_exception, TypeError, ...
        raise SkipSample("template_rejected", f"{type(e).__name__}: {e}") from None
    ids, raw = list(enc["input_ids"]), list(enc["assistant_masks"])
    blocks, lo = [], None  # maximal runs of masked tokens, [lo, hi)
    for t, m in enumerate(raw + [0]):
        if m and lo is None:
            lo = t
        elif not m and lo is not None:
            blocks.append((lo, t))
            lo = None
    if len(blocks) != len(turns):
        return f"{len(blocks)} generation blocks for {len(turns)} assistant turns"
    end_ids = end_of_turn_ids(tokenizer)
    mask = [0] * len(ids)
    for (lo, hi), i in zip(blocks, turns):
        if i == 0:
            continue  # no prompt before it: never masked (as in the prefix method)
        ends = [t for t in range(lo, hi) if ids[t] in end_ids]
        if ends:
            hi = ends[-1] + 1
        elif hi < len(ids) and ids[hi] in end_ids:
            hi += 1
        mask[lo:hi] = [1] * (hi - lo)
    if stats is not None:
        stats["assistant_turns"] += len(turns)
        if turns[0] == 0:
            stats["assistant_turns_unmasked"] += 1
            stats["unmasked: leading assistant turn"] += 1
    if not any(mask):
        raise SkipSample("mask_alignment_failed", "no generation block after a prompt")
    return ids, mask


# How far the slow path's decode walk may go past the point where ids(T[:c]) and ids(T) diverge: one token
# straddles c in practice; a boundary not found within this many tokens leaves the turn unmasked.
_MAX_DECODE_STEPS = 32


def _decoded_chars(tokenizer, text: str, ids: list[int]) -> int | None:
    """How many characters of ``text`` the tokens ``ids`` (a prefix of text's tokens) fully cover: the decoded
    string when it is a prefix of ``text``; when the last token ends inside a multi-byte character, decode
    writes U+FFFD for that partial character and the covered part is what precedes it. None when the decoding
    is not a prefix of ``text`` at all (a tokenizer whose ids do not decode back to the text)."""
    decoded = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    if text.startswith(decoded):
        return len(decoded)
    whole = decoded.rstrip("\ufffd")
    if len(whole) < len(decoded) and text.startswith(whole):
        return len(whole)
    return None


def _first_token_at(tokenizer, text: str, ids: list[int], c: int) -> int | str:
    """Slow tokenizers (no offsets): the index of the first token of ``ids = ids(text)`` whose first character is
    at or after character ``c`` (``len(ids)`` if none) -- what bisecting a fast tokenizer's offset starts gives --
    or a string saying why it cannot be found.

    Why this is right, for a tokenizer whose ids decode back to the text they encode (byte-level BPE,
    tiktoken; the fast tokenizer's offsets assume the same): a token's first character is the one holding its
    first byte (a token may start inside a multi-byte character), so the answer is the first token whose bytes
    start at or after byte ``len(text[:c].encode())``, i.e. the smallest ``t`` whose tokens ``ids[:t]`` cover
    at least ``text[:c]``.
    1. If ``p = ids(text[:c])`` is a prefix of ``ids``, then ``ids[:len(p)]`` covers exactly ``text[:c]`` and
       every shorter prefix less (tokens are never empty): the answer is ``len(p)``.
    2. Otherwise let ``j`` be the length of their common prefix: ``ids[:j]`` covers part of ``text[:c]`` only,
       so the answer is at least ``j``; walk ``t = j, j+1, ...`` and return the first ``t`` whose decoded
       ``ids[:t]`` covers ``c`` characters or more (``_decoded_chars``: a trailing partial character does not
       count, as the offsets put a token starting inside it at that character, before ``c``)."""
    if c <= 0:
        return 0
    if c >= len(text):
        return len(ids)
    head = tokenizer(text[:c], add_special_tokens=False)["input_ids"]
    j = 0
    for x, y in zip(head, ids):
        if x != y:
            break
        j += 1
    if j == len(head):
        return j  # prefix-stable at c: the usual case (template text around a span ends or starts a token)
    for t in range(j, min(len(ids), j + _MAX_DECODE_STEPS) + 1):
        covered = _decoded_chars(tokenizer, text, ids[:t])
        if covered is None:
            return "the tokenizer's decoding does not give back the text (no offsets to place the span)"
        if covered >= c:
            return t
    return f"no token boundary within {_MAX_DECODE_STEPS} tokens of a span boundary (no offsets to place the span)"


def _prefix_mask(tokenizer, messages: list[dict], turns: list[int],
                 stats: collections.Counter | None) -> tuple[list[int], list[int]]:
    """(input_ids, full mask) by rendering prefixes of the conversation (module docstring, steps 1-4)."""
    try:
        text = _render(tokenizer, messages, False)
    except Exception as e:  # noqa: BLE001 - jinja TemplateError from raise_exception, TypeError, ...
        raise SkipSample("template_rejected", f"{type(e).__name__}: {e}") from None

    spans, why = [], []
    for i in turns:
        span = _assistant_span(tokenizer, text, messages, i)
        if isinstance(span, str):
            why.append(f"turn {i}: {span}")
        else:
            spans.append((span, i))

    # Token range [lo, hi) of each span: the tokens whose first character lies in it.
    ranges = []
    if _is_fast(tokenizer) and spans:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        input_ids = list(enc["input_ids"])
        starts = [a for a, _b in enc["offset_mapping"]]  # non-decreasing
        ranges = [(bisect.bisect_left(starts, a), bisect.bisect_left(starts, b)) for (a, b), _i in spans]
    elif spans:
        input_ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        for (a, b), i in spans:
            lo = _first_token_at(tokenizer, text, input_ids, a)
            hi = _first_token_at(tokenizer, text, input_ids, b) if not isinstance(lo, str) else lo
            if isinstance(hi, str):
                why.append(f"turn {i}: {hi}")
            else:
                ranges.append((lo, hi))
    if stats is not None:
        stats["assistant_turns"] += len(turns)
        stats["assistant_turns_unmasked"] += len(why)
        for w in why:
            stats["unmasked: " + w.split(": ", 1)[1].split(" (")[0]] += 1
    if not ranges:
        raise SkipSample("mask_alignment_failed", "; ".join(why))

    mask = [0] * len(input_ids)
    end_ids = end_of_turn_ids(tokenizer)
    any_token = False
    for lo, hi in sorted(ranges):
        if lo >= hi:
            continue
        any_token = True
        for t in range(hi - 1, lo - 1, -1):  # the mask ends right after the span's last end-of-turn token
            if input_ids[t] in end_ids:
                hi = t + 1
                break
        mask[lo:hi] = [1] * (hi - lo)
    if not any_token:
        raise SkipSample("mask_alignment_failed", "no token starts inside an assistant span")
    return input_ids, mask


def _render_and_mask(tokenizer, messages: list[dict], max_length: int | None,
                     stats: collections.Counter | None = None, method: str = "auto") -> tuple[list[int], list[int]]:
    if method not in MASK_METHODS:
        raise ValueError(f"mask method {method!r}: choose one of {MASK_METHODS}")
    if not messages:
        raise SkipSample("empty")
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not turns:
        raise SkipSample("no_assistant")
    # transformers' return_assistant_tokens_mask reads the encoding's offsets: fast tokenizers only. A slow one
    # (Kimi-K2.5's) always takes prefix rendering, which has an offset-free path.
    generation = _is_fast(tokenizer) and has_generation_blocks(tokenizer)
    if method == "generation" and not _is_fast(tokenizer):
        raise ValueError(f"mask method 'generation' needs a fast tokenizer (offsets); {type(tokenizer).__name__} "
                         "is a slow one: use 'prefix' or 'auto'")
    got: tuple[list[int], list[int]] | str = "the template has no {% generation %} blocks"
    if method != "prefix" and generation:
        got = _generation_mask(tokenizer, messages, turns, stats)
    if isinstance(got, str):
        if method == "generation":
            raise SkipSample("mask_alignment_failed", got)
        if stats is not None and generation:
            stats["masks_generation_unusable"] += 1  # e.g. a template marking only some turns
        got = _prefix_mask(tokenizer, messages, turns, stats)
        if stats is not None:
            stats["masks_by_prefix"] += 1
    elif stats is not None:
        stats["masks_by_generation"] += 1
    input_ids, mask = got
    if max_length is not None and len(input_ids) > max_length:  # keep the head
        input_ids, mask = input_ids[:max_length], mask[:max_length]
    if not any(mask):
        raise SkipSample("no_loss_tokens_after_truncation")
    return input_ids, mask


def render_and_mask(tokenizer, messages: list[dict], max_length: int | None, method: str = "auto"
                    ) -> tuple[list[int], list[int]]:
    """Render with the tokenizer's chat template; loss mask = 1 exactly on assistant-produced tokens.

    method: "auto" (generation blocks where the template has them and they line up with the assistant turns,
    else prefix rendering), "generation" or "prefix" (one method only; tests compare them).
    Fast and slow tokenizers alike (a slow one has no offsets: prefix rendering places the spans without them,
    module docstring step 4; "generation" needs a fast one).
    Raises SkipSample (with .reason) when the conversation yields no trainable token, ValueError when the
    tokenizer has no chat template (or method is "generation" with a slow tokenizer)."""
    _check_tokenizer(tokenizer)
    return _render_and_mask(tokenizer, messages, max_length, method=method)


def load_samples(paths, tokenizer, max_length=None, num_samples=None, progress=True, file_starts=None,
                 max_positions: int | None = None) -> tuple[list[TokenizedSample], collections.Counter]:
    """Read + tokenize. Returns the kept samples in source order and a Counter of skipped records by reason
    (see SKIP_REASONS). num_samples caps the number of kept samples. DataError on malformed input, and on a sample
    (after the max_length cut) longer than max_positions (the target's max_position_embeddings: positions the
    target never saw, whose states a drafter should not learn from). file_starts: as in read_conversations (files
    never reached get no entry)."""
    from tqdm.auto import tqdm

    _check_tokenizer(tokenizer)
    paths = _as_path_list(paths)
    samples: list[TokenizedSample] = []
    skipped: collections.Counter = collections.Counter()
    stats: collections.Counter = collections.Counter()
    if num_samples is not None and num_samples <= 0:
        return samples, skipped
    first_detail: dict[str, str] = {}
    bar = tqdm(total=num_samples, unit="conv", desc="tokenizing", disable=not progress, dynamic_ncols=True)
    try:
        for index, origin, messages in read_conversations(paths, file_starts):
            try:
                input_ids, loss_mask = _render_and_mask(tokenizer, messages, max_length, stats)
            except SkipSample as e:
                skipped[e.reason] += 1
                if e.reason not in first_detail:
                    first_detail[e.reason] = f"{origin}: {e}"
                    logger.debug("skipping %s: %s", origin, e)
                continue
            if max_positions is not None and len(input_ids) > max_positions:
                raise DataError(f"{origin}: {len(input_ids):,} tokens, more than the target's "
                                f"max_position_embeddings {max_positions:,}; pass --max-length {max_positions} (or "
                                "less) to cut such samples there")
            samples.append(TokenizedSample(index, input_ids, loss_mask))
            bar.update(1)
            if sum(skipped.values()) and len(samples) % 256 == 0:
                bar.set_postfix(skipped=sum(skipped.values()), refresh=False)
            if num_samples is not None and len(samples) >= num_samples:
                break
    finally:
        bar.close()
    for reason in ("template_rejected", "mask_alignment_failed"):
        if skipped[reason]:
            logger.warning("%d records skipped as %s; first: %s", skipped[reason], reason, first_detail[reason])
    # Which method made the masks (the manifest has no field for it; the log says it).
    logger.info("loss masks: %d from the chat template's {%% generation %%} blocks, %d by prefix rendering%s",
                stats["masks_by_generation"], stats["masks_by_prefix"],
                f" ({stats['masks_generation_unusable']} where the generation blocks did not match the assistant "
                "turns)" if stats["masks_generation_unusable"] else "")
    if stats["assistant_turns_unmasked"]:
        detail = {k[len("unmasked: "):]: v for k, v in stats.items() if k.startswith("unmasked: ")}
        logger.info("%d of %d assistant turns left unmasked: %s", stats["assistant_turns_unmasked"],
                    stats["assistant_turns"], detail)
    logger.info("%d samples from %s; skipped %s", len(samples), paths, dict(skipped))
    return samples, skipped
