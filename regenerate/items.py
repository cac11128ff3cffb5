"""The conversations to regenerate and the answers that replace their assistant turns.

Conversations are read with eagle3.conversations.formats.read_conversations, so the dump's formats and errors apply:
system turns are kept, every assistant turn is rewritten in order, and each answer is generated from the history
the target wrote itself (earlier assistant turns replaced by its own answers). Turns after the last assistant turn
are dropped, so exactly as many assistant turns are generated as the original had. Conversations that hold no
assistant turn, start with one, or have an assistant turn with no user turn before it are skipped.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from eagle3 import contract as C
from eagle3.conversations.formats import read_conversations


@dataclass
class Item:
    """A conversation to regenerate: its messages up to the last assistant turn (whose contents get replaced)."""
    sample_index: int
    origin: str
    messages: list[dict]

    @property
    def prompt_chars(self) -> int:  # planning proxy for the first prompt's length (no tokenizer needed)
        n = 0
        for m in self.messages:
            if m["role"] == "assistant":
                break
            n += len(m["content"])
        return n


@dataclass
class Progress:
    """One conversation being regenerated: the history written so far and where the next answer goes."""
    item: Item
    messages: list[dict] = field(default_factory=list)
    finish_reasons: list[str | None] = field(default_factory=list)
    completion_tokens: list[int | None] = field(default_factory=list)
    pos: int = 0
    error: dict | None = None

    def next_prompt(self) -> list[dict] | None:
        """Copy non-assistant turns up to the next assistant turn; that history, or None when all are done."""
        msgs = self.item.messages
        while self.pos < len(msgs) and msgs[self.pos]["role"] != "assistant":
            self.messages.append(dict(msgs[self.pos]))
            self.pos += 1
        return list(self.messages) if self.pos < len(msgs) and self.error is None else None

    @property
    def turn(self) -> int:
        return len(self.finish_reasons)

    def answer(self, message: dict, finish: str | None, tokens: int | None) -> None:
        self.messages.append(message)
        self.finish_reasons.append(finish)
        self.completion_tokens.append(tokens)
        self.pos += 1

    def fail(self, kind: str, text: str) -> None:
        self.error = error_record(self.item, self.turn, kind, text)

    def record(self) -> dict:
        return {"sample_index": self.item.sample_index, "messages": self.messages,
                "finish_reasons": self.finish_reasons, "completion_tokens": self.completion_tokens}


def error_record(item: Item, turn: int, kind: str, text: str) -> dict:
    return {"sample_index": item.sample_index, "origin": item.origin, "turn": turn, "kind": kind, "error": text}


# ----------------------------------------------------------------------------------------------------------
# Conversations -> items
# ----------------------------------------------------------------------------------------------------------

def plan_conversation(messages: list[dict], max_turns: int | None = None) -> list[dict] | tuple[str, str]:
    """The messages to regenerate (through the last assistant turn, or the max_turns-th), or (skip reason,
    detail)."""
    if not messages:
        return "empty", "no turns"
    roles = [m["role"] for m in messages]
    if "assistant" not in roles:
        return "no_assistant", "no assistant turn"
    first = next((j for j, r in enumerate(roles) if r != "system"), None)
    if roles[first] == "assistant":
        return "starts_with_assistant", f"turn {first} is an assistant turn with no user turn before it"
    answers = [j for j, r in enumerate(roles) if r == "assistant"]
    last = answers[-1] if max_turns is None else answers[:max_turns][-1]
    prev = None
    for j, r in enumerate(roles[:last + 1]):  # only the turns kept need to alternate
        if r == "assistant" and prev != "user":
            return "no_user_before_assistant", f"assistant turn {j} follows a {prev} turn, not a user turn"
        if r != "system":
            prev = r
    # The originals' reasoning is replaced along with their content.
    return [{"role": m["role"], "content": m["content"]} for m in messages[:last + 1]]


def read_items(paths: list[str], num_samples: int | None, max_turns: int | None = None
               ) -> tuple[list[Item], list[dict], int]:
    """(items to regenerate, skipped records, conversations read); DataError (file:line) on malformed input."""
    items, skipped, n = [], [], 0
    if num_samples is not None and num_samples <= 0:
        return items, skipped, n
    for index, origin, messages in read_conversations(paths):
        n += 1
        plan = plan_conversation(messages, max_turns)
        if isinstance(plan, tuple):
            skipped.append({"sample_index": index, "origin": origin, "reason": plan[0], "detail": plan[1]})
        else:
            items.append(Item(index, origin, plan))
        if num_samples is not None and n >= num_samples:
            break
    return items, skipped, n


# ----------------------------------------------------------------------------------------------------------
# Answers, reasoning, seeds
# ----------------------------------------------------------------------------------------------------------

_THINK_OPEN, _THINK_CLOSE = "<think>", "</think>"


def strip_reasoning(text: str) -> str:
    """Remove a leading <think>...</think> block. Also the form without the opening tag, which templates that open
    the block in the generation prompt produce (DeepSeek-R1: '...reasoning</think>answer'). An answer cut off
    inside its reasoning (an opening tag, no closing one) leaves nothing."""
    s = text.lstrip()
    end = s.find(_THINK_CLOSE)
    if end < 0:
        return "" if s.startswith(_THINK_OPEN) else text
    if s.startswith(_THINK_OPEN) or _THINK_OPEN not in s[:end]:
        return s[end + len(_THINK_CLOSE):].lstrip()
    return text


def answer_message(content: str | None, reasoning: str | None, mode: str, finish: str | None
                   ) -> tuple[dict | None, str | None]:
    """The assistant message to store, or (None, why the answer is unusable)."""
    content = content or ""
    if mode == "strip":
        stripped = strip_reasoning(content)
        if not stripped.strip():
            why = "nothing left after removing the reasoning" if content.strip() else "empty answer"
            return None, f"{why} (finish_reason {finish})"
        return {"role": "assistant", "content": stripped}, None
    if not content.strip():
        what = "empty answer (reasoning only)" if reasoning else "empty answer"
        return None, f"{what} (finish_reason {finish})"
    msg = {"role": "assistant", "content": content}
    if reasoning:  # keep, and disable when a server reasons anyway: store what the target produced
        msg["reasoning_content"] = reasoning
    return msg, None


def derive_seed(seed: int, *keys: int) -> int:
    """A 31-bit seed from (seed, keys): the same for the same sample/turn whatever the run or world size."""
    h = hashlib.sha256(C.canonical_json([seed, *keys])).digest()
    return int.from_bytes(h[:4], "little") & 0x7FFFFFFF


def template_kwargs(mode: str) -> dict:
    """Chat-template variables that ask a reasoning model not to think (Qwen3: enable_thinking; DeepSeek-V3.1 and
    Kimi: thinking). Templates that do not read them ignore them."""
    return {"enable_thinking": False, "thinking": False} if mode == "disable" else {}
