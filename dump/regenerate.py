"""`eagle3 regenerate`: let the target write the assistant turns of a conversation dataset.

A drafter accepts best on the text its target actually produces, so the answers of a public dataset are rewritten
by the target (as SpecForge's scripts/regenerate_train_data.py does) before the dump. Two backends:

* ``--server URL [URL ...]``: any OpenAI-compatible chat-completions server (SGLang, vLLM, llama.cpp, ...);
  ``--concurrency`` requests in flight per server, retries with exponential backoff on transient failures.
* ``--engine hf --target DIR``: the target through transformers, batched ``model.generate`` with a KV cache and
  left padding; data parallel under ``torchrun --nproc-per-node N -m eagle3.dump.regenerate ...``.

Conversations (read with eagle3.dump.conversations.read_conversations, so the dump's formats and errors apply):
system turns are kept, every assistant turn is rewritten in order, and each answer is generated from the history
the target wrote itself (earlier assistant turns replaced by its own answers). Turns after the last assistant turn
are dropped, so exactly as many assistant turns are generated as the original had. Conversations that hold no
assistant turn, start with one, or have an assistant turn with no user turn before it are skipped.

Output (--out):

* ``conversations.jsonl``: ``{"sample_index", "messages", "finish_reasons", "completion_tokens"}`` per
  regenerated conversation, sorted by sample_index when the run ends (``messages`` is what the dump reads);
* ``errors.jsonl`` (sample_index, origin, turn, kind, error) and ``skipped.jsonl`` (sample_index, origin, reason);
  error kind ``server``: the request failed after its retries, or the server's answer was malformed (not JSON, no
  message, content that is not text, a token count that is not a number) through its retries (a rerun may
  succeed); ``answer``: the target's answer is unusable (empty, or the prompt does not fit the context) or the
  server rejected the request (HTTP 4xx); ``too_long``: the prompt (with its answer budget) does not fit
  --max-prompt-tokens or the context, a property of the data (never retried, not counted as a failure);
* ``regenerate.json``: target identity (the hashes the dump manifest records), backend, model, sampling,
  reasoning mode, inputs with sha256, counts, finish reasons, elapsed time, and a status: ``complete``,
  ``incomplete`` (server errors or pending conversations: rerun) or ``failed`` (every attempted conversation, or
  more than --max-error-rate of them, failed; the CLI exits non-zero for the last two);
* ``regenerate_config.json``: written at the start; a rerun with other sampling/target/backend/inputs is refused.

Resume: rerunning the same command regenerates exactly the samples that have no line in conversations.jsonl (read
by sample_index), so errors are retried -- except the hf engine's ``answer`` errors: its generation is
deterministic, so they would only come back, at the cost of their whole batch. Lines are appended one batch at a
time (one write, then fsync); a partial last line left by a kill is dropped on restart. The hf engine's batches
are planned over the whole input, independent of what is already done and of the world size, so a resumed or
data-parallel run writes the same files as one uninterrupted process (exactly, for greedy decoding; with
sampling, each generate call is seeded from (seed, first sample_index of the call, turn)).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import glob
import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass, field

from eagle3 import contract as C

FORMAT = "eagle3-regenerate"
FORMAT_VERSION = 1
CONVERSATIONS, ERRORS, SKIPPED = "conversations.jsonl", "errors.jsonl", "skipped.jsonl"
RECORD_FILE = "regenerate.json"
CONFIG_FILE = "regenerate_config.json"
REASONING_MODES = ("keep", "strip", "disable")
ENGINES = ("hf",)
# How the hf engine batches: "padded" = model.generate over left-padded rows; "continuous" = transformers'
# continuous batching (model.generate_batch: paged KV cache, finished rows replaced at once). Measured on the
# H200 (bench/quality.md, transformers 5.24 with SDPA, no flash-attn installed): continuous wrote 2048 first
# answers of up to 512 tokens in ~4 minutes, padded batches of 512 wrote 2634 in 3 -- so "auto" means padded
# everywhere until a faster continuous setup is measured; continuous stays available, token-exact with padded.
BATCHING = ("auto", "padded", "continuous")
# The padded path's KV cache: "dynamic" grows with each step; "static" preallocates (rows, prompt + new tokens) and
# transformers compiles the decode step on a GPU (CUDA graphs). Measured on the H200 (bench/regen_throughput.py):
# 35-39k tokens/s against 20-22k dynamic at 1024-2048 rows in bf16, but every new (rows, length) shape compiles
# again (47-72 s), so static calls come in a few fixed shapes: prompts left-padded to --max-prompt-tokens, rows
# rounded up to a power of two (copies of real rows, answers discarded). "auto": static on a GPU when
# --max-prompt-tokens bounds the prompts, dynamic elsewhere (a CPU gains nothing: no compilation there).
KV_CACHES = ("auto", "dynamic", "static")
# Conversations per planning window of the hf engine: sorted by prompt length inside it, then cut into batches.
WINDOW_BATCHES = 8


class ServerError(RuntimeError):
    """No server answers (at the start), or every server stopped answering during the run."""


@dataclass
class RegenConfig:
    data: list[str]
    out: str
    target: str | None = None            # hf: the model; server: optional local copy of its config/tokenizer
    servers: list[str] | None = None     # OpenAI-compatible base URLs (http://host:port/v1)
    engine: str | None = None            # "hf" (when no servers are given)
    model: str | None = None             # server: model name (default: the first id of GET /models)
    api_key: str | None = None           # server: default $OPENAI_API_KEY, else "EMPTY"
    concurrency: int = 8                 # server: requests in flight per server
    timeout: float = 600.0               # server: seconds per request
    retries: int = 3                     # server: retries of a transient failure (connection, timeout, 5xx, 429)
    retry_backoff: float = 1.0           # server: first wait in seconds, doubled on each retry
    temperature: float = 0.0
    top_p: float = 1.0
    max_new_tokens: int = 512
    seed: int = 0
    num_samples: int | None = None       # at most this many input conversations (by sample_index)
    max_turns: int | None = None         # regenerate at most this many assistant turns per conversation (None: all)
    max_prompt_tokens: int | None = None  # hf: a turn whose prompt is longer is not answered (an 'answer' error)
    reasoning: str = "keep"              # keep | strip | disable
    dtype: str | None = None             # hf: default bf16 on GPU, fp32 on CPU
    device: str | None = None            # hf: default cuda if available
    batch_size: int = 64                 # hf: conversations per batch
    batch_tokens: int = 262144           # hf padded: (prompt + max_new_tokens) x rows per generate call, at most
    batching: str = "auto"               # hf: auto | padded | continuous (see BATCHING)
    kv_cache: str = "auto"               # hf padded: auto | dynamic | static (see KV_CACHES)
    trust_remote_code: bool = False      # run the tokenizer code the target ships (target/load.py load_tokenizer)
    full_weights_digest: bool = False    # hash every byte of the target's weights (target/fingerprint.py)
    max_error_rate: float = 0.1          # a run whose failed conversations exceed this share ends non-zero
    progress: bool = True
    stop_after_batches: int | None = None  # testing aid: stop after this many batches per rank (simulates a kill)

    @property
    def backend(self) -> str:
        return "server" if self.servers else "hf"


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
    from eagle3.dump.conversations import read_conversations
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


# ----------------------------------------------------------------------------------------------------------
# Files in --out
# ----------------------------------------------------------------------------------------------------------

def _drop_partial_line(path: str) -> int:
    """Truncate a trailing line without its newline (a write cut short by a kill). Returns bytes dropped."""
    if not os.path.isfile(path):
        return 0
    with open(path, "rb+") as f:
        size = f.seek(0, os.SEEK_END)
        pos = size
        while pos > 0:
            step = min(pos, 1 << 16)
            f.seek(pos - step)
            chunk = f.read(step)
            if pos == size and chunk.endswith(b"\n"):
                return 0
            nl = chunk.rfind(b"\n")
            if nl >= 0:
                pos = pos - step + nl + 1
                break
            pos -= step
        f.truncate(pos)
        return size - pos


def _read_lines(path: str, partial_tail_ok: bool = False) -> list[tuple[int, str]]:
    """(sample_index, raw line) of every line; a line that is not a record is an error naming path:line.
    partial_tail_ok: a last line without its newline (a write cut by a kill, dropped on resume) is left out
    unread."""
    out = []
    if not os.path.isfile(path):
        return out
    with open(path, encoding="utf-8", errors="strict") as f:
        for lineno, line in enumerate(f, 1):
            if partial_tail_ok and not line.endswith("\n"):
                break
            line = line.rstrip("\n")
            if not line.strip():
                continue
            try:
                si = json.loads(line)["sample_index"]
                if not isinstance(si, int):
                    raise TypeError
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"{path}:{lineno}: not a regenerate record (was the file edited?); "
                                 "fix or remove that line, or use a new --out") from None
            out.append((si, line))
    return out


def _rank_file(out: str, name: str, rank: int, world: int) -> str:
    """Where a rank appends: the final file itself in a world of one, else its own part file."""
    if world == 1:
        return os.path.join(out, name)
    stem = name.removesuffix(".jsonl")
    return os.path.join(out, f"{stem}.rank{rank}.jsonl")


def _part_files(out: str, name: str) -> list[str]:
    stem = name.removesuffix(".jsonl")
    return sorted(glob.glob(os.path.join(glob.escape(out), f"{stem}.rank*.jsonl")))


class _Appender:
    """Appends whole lines: one write per batch, then fsync, so a kill leaves at most one partial last line."""

    def __init__(self, path: str):
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, records: list[dict]) -> None:
        if not records:
            return
        data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode("utf-8")
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view):]
        os.fsync(self.fd)

    def close(self) -> None:
        os.close(self.fd)


def _atomic_write_lines(path: str, lines: list[str]) -> None:
    from eagle3.dump.shards import atomic_write_text
    atomic_write_text(path, "".join(line + "\n" for line in lines))


def _run_config(cfg: RegenConfig, identity: dict | None, model: str | None, inputs: list[dict]) -> dict:
    """What a resumed run must share with the run that started OUT (num_samples and batch sizes may change)."""
    return {"format": FORMAT, "backend": cfg.backend,
            "model": model if cfg.backend == "server" else None,  # hf: the identity hashes name the model
            "identity": identity, "dtype": cfg.dtype if cfg.backend == "hf" else None,
            "sampling": sampling(cfg), "reasoning": cfg.reasoning, "max_turns": cfg.max_turns,
            "max_prompt_tokens": cfg.max_prompt_tokens, "inputs": [d["sha256"] for d in inputs]}


def _check_config(out: str, current: dict) -> str | None:
    """Why OUT's recorded settings refuse this run, or None (nothing is written here)."""
    path = os.path.join(out, CONFIG_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            old = json.load(f)
        if not isinstance(old, dict):
            raise ValueError("not a JSON object")
    except (ValueError, UnicodeDecodeError) as e:
        return f"{path}: not a regenerate config ({e}); use a new --out"
    diff = [f"{k}: {json.dumps(old.get(k))} there, {json.dumps(current[k])} now"
            for k in current if old.get(k) != current[k]]
    if diff:
        return (f"{out} holds a regeneration made with other settings, refusing to mix them:\n  " + "\n  ".join(diff)
                + "\nrerun with the same arguments to resume, or use a new --out")
    return None


def _prepare_out(cfg: RegenConfig, current: dict, skipped: list[dict]) -> set[int]:
    """Rank 0: make OUT, refuse other settings, repair cut-off lines, write skipped.jsonl. Returns the samples
    not to regenerate: those written, and with the hf engine those whose answer was unusable (it is
    deterministic, so the same answer would come back, at the price of regenerating the whole batch)."""
    msg = _check_config(cfg.out, current) if os.path.isdir(cfg.out) else None
    if msg:
        raise C.ContractError(msg)
    # Every complete line is read before anything is written or repaired: a directory holding files that are not
    # this tool's is refused exactly as it was found (a cut-off last line is repaired only after this passes).
    for name in (CONVERSATIONS, ERRORS, SKIPPED):
        for path in [os.path.join(cfg.out, name), *_part_files(cfg.out, name)]:
            try:
                _read_lines(path, partial_tail_ok=True)
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}: not UTF-8 text ({e}); not this tool's file: use a new --out") from None
    os.makedirs(cfg.out, exist_ok=True)
    if not os.path.isfile(os.path.join(cfg.out, CONFIG_FILE)):
        from eagle3.dump.shards import atomic_write_text
        atomic_write_text(os.path.join(cfg.out, CONFIG_FILE), json.dumps(current, indent=1))
    done: set[int] = set()
    for name in (CONVERSATIONS, ERRORS):
        for path in [os.path.join(cfg.out, name), *_part_files(cfg.out, name)]:
            dropped = _drop_partial_line(path)
            if dropped:
                print(f"[regenerate] {path}: dropped a cut-off last line ({dropped} bytes)", file=sys.stderr)
            for si, line in _read_lines(path):
                kind = json.loads(line)["kind"] if name == ERRORS else None
                if name == CONVERSATIONS or kind == "too_long" or (cfg.backend == "hf" and kind == "answer"):
                    done.add(si)
    # Skipped conversations follow from the input alone: rewritten whole, merged with earlier runs' (num_samples).
    old = dict(_read_lines(os.path.join(cfg.out, SKIPPED)))
    old.update((r["sample_index"], json.dumps(r, ensure_ascii=False)) for r in skipped)
    _atomic_write_lines(os.path.join(cfg.out, SKIPPED), [old[k] for k in sorted(old)])
    return done


def _merge(out: str) -> tuple[list[dict], list[dict], list[dict]]:
    """Rank 0 at the end: part files + final files -> sorted, de-duplicated final files. Returns what the record
    counts: per conversation its sample_index, finish_reasons and completion_tokens (not the messages), the error
    and the skipped records."""
    convs: dict[int, str] = {}
    for path in [os.path.join(out, CONVERSATIONS), *_part_files(out, CONVERSATIONS)]:
        for si, line in _read_lines(path):
            convs.setdefault(si, line)
    errs: dict[int, str] = {}
    for path in [os.path.join(out, ERRORS), *_part_files(out, ERRORS)]:
        for si, line in _read_lines(path):
            if si not in convs:
                errs[si] = line  # a later attempt's error replaces an earlier one
    _atomic_write_lines(os.path.join(out, CONVERSATIONS), [convs[k] for k in sorted(convs)])
    _atomic_write_lines(os.path.join(out, ERRORS), [errs[k] for k in sorted(errs)])
    for path in _part_files(out, CONVERSATIONS) + _part_files(out, ERRORS):
        os.remove(path)
    skipped = [json.loads(line) for _, line in _read_lines(os.path.join(out, SKIPPED))]
    keys = ("sample_index", "finish_reasons", "completion_tokens")
    stats = [{k: rec.get(k) for k in keys} for rec in (json.loads(convs[i]) for i in sorted(convs))]
    return stats, [json.loads(errs[k]) for k in sorted(errs)], skipped


# ----------------------------------------------------------------------------------------------------------
# Identity and the record
# ----------------------------------------------------------------------------------------------------------

def sampling(cfg: RegenConfig) -> dict:
    return {"temperature": cfg.temperature, "top_p": cfg.top_p, "max_new_tokens": cfg.max_new_tokens,
            "seed": cfg.seed}


def identity_of(target: dict | None, tokenizer: dict | None) -> dict | None:
    """The hashes that say whether text was written by a given target (compared by the dump): its config, its
    weights ('' when a --server run's --target copy holds no weights: then nothing can vouch for them), its
    tokenizer and chat template."""
    if not target or not tokenizer:
        return None
    return {"config_sha256": target["config_sha256"], "weights_sha256": target.get("weights_sha256", ""),
            "tokenizer_sha256": tokenizer["sha256"], "chat_template_sha256": tokenizer["chat_template_sha256"]}


def _target_identity(target_dir: str | None, trust_remote_code: bool = False, full_weights: bool = False,
                     weights_optional: bool = False):
    """(TargetInfo dict, TokenizerInfo dict, tokenizer) of a local target directory, or Nones. weights_optional: a
    --server run's local copy may be config + tokenizer only (weights_sha256 then '')."""
    if not target_dir:
        return None, None, None
    from eagle3.target import load as T
    from eagle3.target.fingerprint import weight_files
    if weights_optional and not weight_files(target_dir):
        info = T.target_info(target_dir, weights=False)
    else:
        info = T.target_info(target_dir, full_weights=full_weights)
    tok = T.load_tokenizer(target_dir, trust_remote_code=trust_remote_code)
    remote = T.remote_code_tokenizer(target_dir) if trust_remote_code else None  # recorded, as the dump does
    return dataclasses.asdict(info), dataclasses.asdict(T.tokenizer_info(tok, remote)), tok


def _histogram(values) -> dict:
    return dict(sorted(collections.Counter(str(v) for v in values).items()))


def build_record(cfg: RegenConfig, *, target: dict | None, tokenizer: dict | None, model: str | None,
                 servers: list[str] | None, inputs: list[dict], read: int, convs: list[dict], errors: list[dict],
                 skipped: list[dict], pending: int, elapsed: float, gen_s: float, run_tokens: int,
                 run_convs: int, engine: dict | None) -> dict:
    finishes = [f for c in convs for f in c.get("finish_reasons") or []]
    tokens = [t for c in convs for t in c.get("completion_tokens") or []]
    record = {
        "format": FORMAT, "format_version": FORMAT_VERSION,
        # incomplete: a rerun has work to do (conversations not attempted, or failed on the server)
        "status": ("failed" if _over_error_rate(len(convs), sum(e["kind"] != "too_long" for e in errors),
                                                cfg.max_error_rate)
                   else "complete" if not pending and not any(e["kind"] == "server" for e in errors)
                   else "incomplete"),
        "max_error_rate": cfg.max_error_rate,
        "backend": cfg.backend, "model": model, "servers": servers, "engine": engine,
        "target": target, "tokenizer": tokenizer, "identity": identity_of(target, tokenizer),
        "sampling": sampling(cfg), "reasoning": cfg.reasoning,
        "inputs": inputs, "num_samples": cfg.num_samples,
        "counts": {"read": read, "conversations": len(convs), "errors": len(errors), "skipped": len(skipped),
                   "pending": pending, "assistant_turns": len(finishes),
                   "generated_tokens": sum(t for t in tokens if t is not None),
                   "truncated_answers": sum(f == "length" for f in finishes)},
        "finish_reasons": _histogram(finishes),
        "errors": _histogram(e["kind"] for e in errors),
        "skipped": _histogram(s["reason"] for s in skipped),
        # Rates over the generation only (the hf engine's model loading is in elapsed_s, not in generation_s).
        "this_run": {"elapsed_s": round(elapsed, 3), "generation_s": round(gen_s, 3), "conversations": run_convs,
                     "generated_tokens": run_tokens,
                     "conversations_per_s": round(run_convs / gen_s, 4) if gen_s > 0 else None,
                     "generated_tokens_per_s": round(run_tokens / gen_s, 2) if gen_s > 0 else None},
    }
    if record["identity"] is None:
        record["identity_note"] = ("no --target given with --server: the served model's config and tokenizer are "
                                   "unknown, so the dump cannot check that this data comes from its target "
                                   "(it refuses such data unless --allow-foreign-data)")
    return record


def _summary(rec: dict, out: str) -> str:
    c, r = rec["counts"], rec["this_run"]
    rate = f"{r['generated_tokens_per_s']:,.1f} tok/s, {r['conversations_per_s']:.3f} conv/s" \
        if r["generated_tokens_per_s"] is not None else "-"
    def detail(d):
        return f" {d}" if d else ""
    lines = [f"[regenerate] {rec['status']}: {c['conversations']} conversations ({c['assistant_turns']} answers, "
             f"{c['generated_tokens']:,} tokens), {c['errors']} errors{detail(rec['errors'])}, {c['skipped']} "
             f"skipped{detail(rec['skipped'])}, {c['pending']} pending -> {os.path.join(out, CONVERSATIONS)}",
             f"[regenerate] this run: {r['conversations']} conversations, {r['generated_tokens']:,} tokens in "
             f"{r['elapsed_s']:.1f} s (generating {r['generation_s']:.1f} s: {rate}); finish reasons "
             f"{rec['finish_reasons'] or '{}'}, {c['truncated_answers']} truncated at --max-new-tokens"]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------
# The hf engine
# ----------------------------------------------------------------------------------------------------------

class HFEngine:
    """The target through transformers: left-padded batches, model.generate with its KV cache."""

    def __init__(self, target_dir: str, dtype, device, cfg: RegenConfig, tokenizer=None):
        from eagle3.target import load as T
        from eagle3.dump.conversations import end_of_turn_ids
        self.cfg = cfg
        self.tokenizer = tokenizer if tokenizer is not None else T.load_tokenizer(
            target_dir, trust_remote_code=cfg.trust_remote_code)
        self.model = T.load_target(target_dir, dtype, device)
        self.device = device
        text_cfg = T.text_config_dict(T.read_config(target_dir))
        self.max_positions = text_cfg.get("max_position_embeddings")
        # An answer ends at the first end-of-turn token: the generation config's eos ids (what servers stop on),
        # the tokenizer's eos and the known end-of-turn tokens (Kimi's eos is not its end of turn).
        gen_eos = getattr(self.model.generation_config, "eos_token_id", None)
        gen_eos = [gen_eos] if isinstance(gen_eos, int) else list(gen_eos or [])
        self.stop_ids = sorted(set(end_of_turn_ids(self.tokenizer)) | set(gen_eos))
        if not self.stop_ids:
            raise ValueError(f"{target_dir}: no end-of-turn token known (no eos in the tokenizer or generation "
                             "config); answers would never stop")
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else self.stop_ids[0]
        self.continuous = resolve_batching(cfg.batching, device) == "continuous"
        self.static = not self.continuous and resolve_kv_cache(cfg.kv_cache, device, cfg.max_prompt_tokens)

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """Rendered like the dump renders (the template writes BOS itself), plus the generation prompt."""
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                  **template_kwargs(self.cfg.reasoning))
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def generation_config(self):
        from transformers import GenerationConfig
        common = dict(max_new_tokens=self.cfg.max_new_tokens, num_beams=1, min_new_tokens=0, repetition_penalty=1.0,
                      no_repeat_ngram_size=0, eos_token_id=self.stop_ids, pad_token_id=self.pad_id, use_cache=True,
                      cache_implementation="static" if self.static else None)
        if self.cfg.temperature == 0:
            return GenerationConfig(do_sample=False, **common)
        # Every sampling processor spelled out: unset fields are filled from the model's generation_config.json
        # and transformers' defaults (top_k=50!), and the answer must follow --temperature/--top-p alone.
        return GenerationConfig(do_sample=True, temperature=self.cfg.temperature, top_p=self.cfg.top_p, top_k=0,
                                min_p=0.0, typical_p=1.0, epsilon_cutoff=0.0, eta_cutoff=0.0, **common)

    def generate(self, prompts: list[list[int]], seed: int) -> list[tuple[list[int], str]]:
        """New tokens of each prompt (through its end-of-turn token) and "stop" or "length"."""
        rows = self._generate_continuous(prompts, seed) if self.continuous else self._generate_padded(prompts, seed)
        stops = set(self.stop_ids)
        results = []
        for row in rows:
            end = next((j for j, t in enumerate(row) if t in stops), None)
            results.append((row[:end + 1], "stop") if end is not None else (row[:self.cfg.max_new_tokens], "length"))
        return results

    def _generate_continuous(self, prompts: list[list[int]], seed: int) -> list[list[int]]:
        from transformers import ContinuousBatchingConfig
        from transformers.utils import logging as hf_logging
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # its per-call warm-up and cache-sizing notes would flood the log
        try:
            if self.device.type == "cuda":  # cache sized from free GPU memory, CUDA graphs: transformers decides
                cb = ContinuousBatchingConfig(seed=seed)
            else:  # sized from the host's memory it would allocate (and zero) gigabytes: give it what the rows need
                page = 32
                blocks = sum(-(-(len(p) + self.cfg.max_new_tokens) // page) for p in prompts)
                cb = ContinuousBatchingConfig(seed=seed, page_size=page, num_blocks=blocks + len(prompts),
                                              max_batch_tokens=1024)
            out = self.model.generate_batch(prompts, generation_config=self.generation_config(),
                                            continuous_batching_config=cb, progress_bar=False)
        finally:
            hf_logging.set_verbosity(verbosity)
        rows = list(out.values())
        failed = [r for r in rows if r.error is not None]
        if len(rows) != len(prompts) or failed:
            # generate_batch logs and returns what it has; a lost row would silently become a missing sample
            raise RuntimeError(f"continuous batching returned {len(rows)} of {len(prompts)} answers"
                               + (f"; first error: {failed[0].error}" if failed else "")
                               + " (--batching padded avoids it)")
        return [list(r.generated_tokens) for r in rows]

    def _generate_padded(self, prompts: list[list[int]], seed: int) -> list[list[int]]:
        import torch
        real = len(prompts)
        if self.static:  # one of a few fixed shapes (KV_CACHES): extra rows repeat real ones and end with them
            prompts = [prompts[b % real] for b in range(static_rows(real))]
            n = self.cfg.max_prompt_tokens
        else:
            n = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), n), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), n), dtype=torch.long)
        for b, p in enumerate(prompts):  # left padding: every row's next token is at position n
            ids[b, n - len(p):] = torch.as_tensor(p)
            mask[b, n - len(p):] = 1
        cuda = [self.device] if self.device.type == "cuda" else []
        with torch.no_grad(), torch.random.fork_rng(devices=cuda):
            torch.manual_seed(seed)
            out = self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                      generation_config=self.generation_config())
        return out[:real, n:].tolist()

    def text(self, new_ids: list[int], finish: str) -> str:
        body = new_ids[:-1] if finish == "stop" else new_ids
        text = self.tokenizer.decode(body, skip_special_tokens=True)
        # An answer cut by --max-new-tokens inside a multi-byte character decodes its partial bytes as U+FFFD, a
        # character the target never wrote (the dump would train on it): end at the last token boundary that
        # decodes cleanly instead.
        while finish == "length" and body and text.endswith("\ufffd"):
            body = body[:-1]
            text = self.tokenizer.decode(body, skip_special_tokens=True)
        return text


def resolve_batching(batching: str, device) -> str:
    if batching not in BATCHING:
        raise ValueError(f"--batching {batching!r}: choose one of {', '.join(BATCHING)}")
    if batching == "auto":
        return "padded"
    return batching


def resolve_kv_cache(kv_cache: str, device, max_prompt_tokens: int | None) -> bool:
    """Whether the padded path runs a static KV cache (KV_CACHES)."""
    if kv_cache not in KV_CACHES:
        raise ValueError(f"--kv-cache {kv_cache!r}: choose one of {', '.join(KV_CACHES)}")
    if kv_cache == "static" and not max_prompt_tokens:
        raise ValueError("--kv-cache static pads every prompt to --max-prompt-tokens: give it")
    if kv_cache == "auto":
        return device.type == "cuda" and bool(max_prompt_tokens)
    return kv_cache == "static"


def static_rows(n: int) -> int:
    """Rows of a static-cache call holding n real rows: the next power of two (at least 8), so that a run
    compiles for a handful of shapes."""
    return max(8, 1 << (n - 1).bit_length())


def plan_batches(items: list[Item], batch_size: int) -> list[list[Item]]:
    """Fixed windows of consecutive items, each sorted by first-prompt length (ties: sample_index) and cut into
    batches: depends on the input only, never on what is done or on the world size."""
    batches = []
    window = batch_size * WINDOW_BATCHES
    for w in range(0, len(items), window):
        chunk = sorted(items[w:w + window], key=lambda it: (it.prompt_chars, it.sample_index))
        batches += [chunk[b:b + batch_size] for b in range(0, len(chunk), batch_size)]
    return batches


def generate_calls(lengths: list[int], budget: int, max_padding: float = 2.0) -> list[list[int]]:
    """Rows (indices into lengths) per generate call: longest first, each call within `budget` padded tokens and
    no row padded to more than `max_padding` x its own length -- one 3,500-token prompt among 30-token ones would
    otherwise make every row of the call pay for 3,500 positions (prefill and KV cache). Depends on the lengths
    only, so calls (and their seeds) are the same in every run."""
    calls: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):  # stable: ties keep row order
        if calls and (len(calls[-1]) + 1) * lengths[calls[-1][0]] <= budget \
                and lengths[i] * max_padding >= lengths[calls[-1][0]]:
            calls[-1].append(i)
        else:
            calls.append([i])
    return [sorted(c) for c in calls]


def regenerate_batch(engine: HFEngine, batch: list[Item], cfg: RegenConfig, on_tokens=None
                     ) -> tuple[list[dict], list[dict], int]:
    """All assistant turns of a batch of conversations, turn by turn (answer k needs answer k-1):
    (conversation records, error records, generated tokens). on_tokens(n) after each generate call."""
    rows = [Progress(it) for it in batch]
    tokens = 0
    for turn in range(max(sum(m["role"] == "assistant" for m in it.messages) for it in batch)):
        active, prompts = [], []
        for r in rows:
            history = r.next_prompt()
            if history is None:
                continue
            try:
                ids = engine.prompt_ids(history)
            except Exception as e:  # noqa: BLE001 - jinja raises anything (role alternation, ...)
                r.fail("answer", f"the chat template failed: {type(e).__name__}: {e}")
                continue
            if cfg.max_prompt_tokens and len(ids) > cfg.max_prompt_tokens:
                r.fail("too_long", f"prompt of {len(ids)} tokens exceeds --max-prompt-tokens {cfg.max_prompt_tokens}")
                continue
            if engine.max_positions and len(ids) + cfg.max_new_tokens > engine.max_positions:
                r.fail("too_long", f"prompt of {len(ids)} tokens + --max-new-tokens {cfg.max_new_tokens} exceeds the "
                                 f"target's {engine.max_positions} positions")
                continue
            active.append(r)
            prompts.append(ids)
        lengths = [len(p) + cfg.max_new_tokens for p in prompts]
        # continuous batching packs rows itself (no padding) and a static cache pads every call to a fixed shape:
        # the whole turn is one call
        calls = [list(range(len(prompts)))] if (engine.continuous or engine.static) and prompts else \
            generate_calls(lengths, cfg.batch_tokens)
        for call in calls:
            first = min(active[i].item.sample_index for i in call)
            outs = engine.generate([prompts[i] for i in call], derive_seed(cfg.seed, first, turn))
            if on_tokens is not None:
                on_tokens(sum(len(new) for new, _ in outs))
            for i, (new, finish) in zip(call, outs):
                tokens += len(new)
                msg, why = answer_message(engine.text(new, finish), None, cfg.reasoning, finish)
                if msg is None:
                    active[i].fail("answer", why)
                else:
                    active[i].answer(msg, finish, len(new))
    done = [r.record() for r in rows if r.error is None]
    return done, [r.error for r in rows if r.error is not None], tokens


def _run_hf(cfg: RegenConfig, items: list[Item], done: set[int], world, tokenizer, log) -> tuple[int, int, float]:
    """This rank's share of the pending batches. Returns (conversations written, tokens generated, seconds spent
    generating)."""
    import torch
    from tqdm import tqdm

    from eagle3.target import load as T
    batches = plan_batches(items, cfg.batch_size)
    pending = [b for b in batches if any(it.sample_index not in done for it in b)]
    mine = pending[world.rank::world.world_size]
    todo_convs = sum(it.sample_index not in done for b in mine for it in b)
    log(f"[regenerate] {len(items)} conversations in {len(batches)} batches of <= {cfg.batch_size}; "
        f"{len(pending)} batches pending, {len(mine)} on this rank")
    if not mine:
        return 0, 0, 0.0
    dtype = T.DTYPES[cfg.dtype]
    torch.manual_seed(cfg.seed)
    engine = HFEngine(cfg.target, dtype, world.device, cfg, tokenizer=tokenizer)
    convs_out = _Appender(_rank_file(cfg.out, CONVERSATIONS, world.rank, world.world_size))
    errs_out = _Appender(_rank_file(cfg.out, ERRORS, world.rank, world.world_size))
    bar = tqdm(total=todo_convs, unit="conv", desc=f"regenerate rank {world.rank}", dynamic_ncols=True,
               disable=not (cfg.progress and world.is_main))
    t0, written, tokens, n_errors = time.perf_counter(), 0, 0, 0

    def show(new_tokens: int = 0):  # a batch of long conversations takes a while: show tokens as they come
        nonlocal tokens
        tokens += new_tokens
        dt = time.perf_counter() - t0
        bar.set_postfix(tok_s=f"{tokens / dt:,.1f}", conv_s=f"{written / dt:.2f}", errors=n_errors)

    try:
        for n_batches, batch in enumerate(mine):
            if cfg.stop_after_batches is not None and n_batches >= cfg.stop_after_batches:
                break
            recs, errs, _ = regenerate_batch(engine, batch, cfg, on_tokens=show)
            recs = [r for r in recs if r["sample_index"] not in done]
            convs_out.write(recs)
            errs_out.write(errs)
            written += len(recs)
            n_errors += len(errs)
            bar.update(sum(it.sample_index not in done for it in batch))
            show()
    finally:
        bar.close()
        convs_out.close()
        errs_out.close()
    return written, tokens, time.perf_counter() - t0


# ----------------------------------------------------------------------------------------------------------
# The server backend
# ----------------------------------------------------------------------------------------------------------

class _ServerDown(Exception):
    """The server refused connections through all retries."""


class _RequestFailed(Exception):
    def __init__(self, kind: str, text: str):
        super().__init__(text)
        self.kind = kind


class _Malformed(Exception):
    """A 200 answer that is not a chat completion this run can store."""


def _read_answer(resp, url: str) -> tuple[str, str | None, str | None, int | None]:
    """(content, reasoning, finish_reason, completion_tokens) of a chat completion, every field checked: the client
    builds its response objects without validating them, so a server's list or number where text belongs would
    otherwise travel on into the conversation (or kill the worker that reads it)."""
    def bad(why):
        raise _Malformed(f"{url}: malformed answer: {why}")
    choices = getattr(resp, "choices", None)
    if not isinstance(choices, list) or not choices:
        bad(f"no choices (got {type(choices).__name__})")
    choice = choices[0]
    message = getattr(choice, "message", None)
    if message is None:
        bad("a choice without a message")
    content = getattr(message, "content", None)
    if content is not None and not isinstance(content, str):
        bad(f"message content is a {type(content).__name__}, not text")
    finish = getattr(choice, "finish_reason", None)
    if finish is not None and not isinstance(finish, str):
        bad(f"finish_reason is a {type(finish).__name__}")
    usage = getattr(resp, "usage", None)
    n = getattr(usage, "completion_tokens", None) if usage is not None else None
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
        bad(f"usage.completion_tokens is {n!r}, not a count")
    reasoning = _reasoning_of(message)
    if content and finish == "length":  # cut inside a multi-byte character: keep the text before it
        content = content.rstrip("\ufffd")
    return content or "", reasoning, finish, n


def _api_key(cfg: RegenConfig) -> str:
    return cfg.api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY"


def probe_servers(cfg: RegenConfig) -> tuple[list[str], str]:
    """GET /models on every server: (the answering URLs, the model name). ServerError when none answers. Each probe
    is bounded as a whole (min(--timeout, 30) s), so a server that trickles its answer cannot hold the start."""
    from openai import AsyncOpenAI
    limit = min(cfg.timeout, 30.0)

    async def models_of(url: str) -> list[str]:
        async with AsyncOpenAI(base_url=url, api_key=_api_key(cfg), max_retries=1, timeout=limit) as c:
            page = await asyncio.wait_for(c.models.list(), timeout=limit)
        ids = [getattr(m, "id", None) for m in (getattr(page, "data", None) or [])]
        if not all(isinstance(i, str) for i in ids):
            raise _Malformed(f"model ids that are not text: {ids!r}")
        return ids

    alive, models, why = [], {}, []
    for url in cfg.servers:
        try:
            ids = asyncio.run(models_of(url))
        except asyncio.TimeoutError:
            why.append(f"{url}: no whole answer within {limit:g} s")
            continue
        except Exception as e:  # noqa: BLE001 - whatever it is, this server is not usable
            why.append(f"{url}: {type(e).__name__}: {e}")
            continue
        alive.append(url)
        models[url] = ids
    if not alive:
        raise ServerError("no server answered GET /models:\n  " + "\n  ".join(why)
                          + "\n(--server takes the OpenAI base URL, e.g. http://127.0.0.1:30000/v1)")
    for w in why:
        print(f"[regenerate] warning: leaving out {w}", file=sys.stderr)
    model = cfg.model
    if model is None:
        first = models[alive[0]]
        if not first:
            raise ServerError(f"{alive[0]}/models lists no model; pass --model")
        model = first[0]
    return alive, model


def _reasoning_of(message) -> str | None:
    """SGLang/vLLM reasoning parsers return it as `reasoning_content` (newer vLLM: `reasoning`)."""
    for key in ("reasoning_content", "reasoning"):
        value = getattr(message, key, None)  # declared field or an extra one (the client's models allow extras)
        if isinstance(value, str) and value:
            return value
    return None


async def _request(client, url: str, cfg: RegenConfig, model: str, messages: list[dict], seed: int):
    """One chat completion with retries and exponential backoff on transient failures."""
    import openai
    last = None
    for attempt in range(cfg.retries + 1):
        if attempt:
            await asyncio.sleep(cfg.retry_backoff * 2 ** (attempt - 1))
        try:
            # wait_for bounds the WHOLE request: the client's own timeout is per read, so a server trickling a
            # byte a second would keep one request alive for ever
            resp = await asyncio.wait_for(client.chat.completions.create(
                model=model, messages=messages, temperature=cfg.temperature, top_p=cfg.top_p,
                max_tokens=cfg.max_new_tokens, seed=seed, timeout=cfg.timeout,
                extra_body={"chat_template_kwargs": template_kwargs(cfg.reasoning)} if cfg.reasoning == "disable"
                else None), timeout=cfg.timeout)
            return _read_answer(resp, url)
        except (openai.APITimeoutError, asyncio.TimeoutError):
            last = ("timeout", f"no whole answer within --timeout {cfg.timeout:g} s")
        except _Malformed as e:  # a proxy's or a server's glitch may pass: retried like a 5xx
            last = ("malformed", str(e))
        except openai.APIConnectionError as e:
            last = ("connection", f"{type(e).__name__}: {e.__cause__ or e}")
        except openai.APIStatusError as e:
            text = f"HTTP {e.status_code}: {str(e)[:500]}"
            if e.status_code != 429 and e.status_code < 500:
                raise _RequestFailed("answer", f"{url} rejected the request: {text}") from None  # retrying can't help
            last = ("status", text)
        except openai.APIError as e:  # an answer the client cannot read
            last = ("status", f"{type(e).__name__}: {e}")
        except ValueError as e:  # a body that is not JSON (json.JSONDecodeError), as the client raises it
            last = ("malformed", f"{url}: an answer that is not JSON ({type(e).__name__}: {str(e)[:200]})")
    if last[0] == "connection":
        raise _ServerDown(f"{url}: {last[1]}")
    raise _RequestFailed("server", f"{url}: {last[1]} ({cfg.retries + 1} attempts)")


async def _converse(client, url: str, cfg: RegenConfig, model: str, item: Item) -> tuple[dict, int]:
    """All assistant turns of one conversation on one server: (conversation or error record, tokens)."""
    conv, tokens = Progress(item), 0
    while (history := conv.next_prompt()) is not None:
        try:
            content, reasoning, finish, n = await _request(client, url, cfg, model, history,
                                                           derive_seed(cfg.seed, item.sample_index, conv.turn))
        except _RequestFailed as e:
            return error_record(item, conv.turn, e.kind, str(e)), tokens
        tokens += n or 0
        msg, why = answer_message(content, reasoning, cfg.reasoning, finish)
        if msg is None:
            return error_record(item, conv.turn, "answer", why), tokens
        conv.answer(msg, finish, n)
    return conv.record(), tokens


async def _serve(cfg: RegenConfig, urls: list[str], model: str, items: list[Item], on_result
                 ) -> tuple[dict[str, str], bool]:
    """Work through items with --concurrency workers per server pulling from one queue (workers start in
    round-robin order over the servers, so the first requests go round-robin; later a free worker takes the next
    conversation, so a faster server does more). A server that refuses connections through its retries is
    dropped and its conversation goes back to the queue. Returns ({url: why} of the dropped servers, whether
    all of them dropped out, leaving conversations undone)."""
    from openai import AsyncOpenAI
    queue: asyncio.Queue = asyncio.Queue()
    for it in items:
        queue.put_nowait(it)
    down: dict[str, str] = {}
    all_down = asyncio.Event()
    clients = {url: AsyncOpenAI(base_url=url, api_key=_api_key(cfg), max_retries=0, timeout=cfg.timeout)
               for url in urls}

    async def worker(url: str):
        while url not in down:
            item = await queue.get()
            try:
                rec, tokens = await _converse(clients[url], url, cfg, model, item)
            except _ServerDown as e:
                down.setdefault(url, str(e))
                queue.put_nowait(item)
                if len(down) == len(urls):
                    all_down.set()
                return
            except Exception as e:  # noqa: BLE001 - whatever broke, it is this conversation's error, and the
                # worker lives on: a dead worker leaves queue.join() waiting for ever
                rec, tokens = error_record(item, 0, "server", f"{url}: {type(e).__name__}: {str(e)[:300]}"), 0
            finally:
                queue.task_done()
            on_result(rec, tokens)

    workers = [asyncio.create_task(worker(url)) for _ in range(cfg.concurrency) for url in urls]
    finished = asyncio.create_task(queue.join())
    stopped = asyncio.create_task(all_down.wait())
    await asyncio.wait([finished, stopped], return_when=asyncio.FIRST_COMPLETED)
    for t in [*workers, finished, stopped]:
        t.cancel()
    await asyncio.gather(*workers, finished, stopped, return_exceptions=True)
    for c in clients.values():
        await c.close()
    return down, all_down.is_set()


def _run_server(cfg: RegenConfig, urls: list[str], model: str, items: list[Item], done: set[int], log
                ) -> tuple[int, int, float, dict]:
    """Returns (conversations written, tokens generated, seconds, {url: why} when every server stopped
    answering)."""
    from tqdm import tqdm
    todo = [it for it in items if it.sample_index not in done]
    log(f"[regenerate] {len(items)} conversations, {len(todo)} to do on {len(urls)} server(s) x "
        f"{cfg.concurrency} concurrent requests, model {model}")
    if not todo:
        return 0, 0, 0.0, {}
    convs_out = _Appender(os.path.join(cfg.out, CONVERSATIONS))
    errs_out = _Appender(os.path.join(cfg.out, ERRORS))
    bar = tqdm(total=len(todo), unit="conv", desc="regenerate", dynamic_ncols=True, disable=not cfg.progress)
    buf_c, buf_e = [], []
    state = {"written": 0, "tokens": 0, "errors": 0, "flushed": time.perf_counter()}
    t0 = time.perf_counter()
    flush_every = cfg.concurrency * len(urls)  # about one append per round of requests

    def flush():
        convs_out.write(buf_c)
        errs_out.write(buf_e)
        buf_c.clear()
        buf_e.clear()
        state["flushed"] = time.perf_counter()

    def on_result(rec: dict, tokens: int):
        (buf_e if "error" in rec else buf_c).append(rec)
        state["written" if "error" not in rec else "errors"] += 1
        state["tokens"] += tokens
        bar.update(1)
        dt = time.perf_counter() - t0
        bar.set_postfix(tok_s=f"{state['tokens'] / dt:,.1f}", conv_s=f"{state['written'] / dt:.2f}",
                        errors=state["errors"], refresh=False)
        if len(buf_c) + len(buf_e) >= flush_every or time.perf_counter() - state["flushed"] > 5.0:
            flush()  # batched appends: few fsyncs, and a kill loses at most these few seconds

    try:
        down, all_down = asyncio.run(_serve(cfg, urls, model, todo, on_result))
    finally:
        flush()
        bar.close()
        convs_out.close()
        errs_out.close()
    for why in down.values() if not all_down else ():
        log(f"[regenerate] warning: a server stopped answering, the others took over: {why}")
    return state["written"], state["tokens"], time.perf_counter() - t0, down if all_down else {}


# ----------------------------------------------------------------------------------------------------------
# The job
# ----------------------------------------------------------------------------------------------------------

def _validate(cfg: RegenConfig) -> None:
    if cfg.servers and cfg.engine:
        raise ValueError("give either --server URL ... or --engine hf, not both")
    if not cfg.servers:
        if cfg.engine not in ENGINES:
            raise ValueError(f"give --server URL [URL ...] (an OpenAI-compatible endpoint) or --engine "
                             f"{'|'.join(ENGINES)} with --target DIR (got engine {cfg.engine!r})")
        if not cfg.target:
            raise ValueError("--engine hf needs --target DIR")
    if cfg.reasoning not in REASONING_MODES:
        raise ValueError(f"--reasoning {cfg.reasoning!r}: choose one of {', '.join(REASONING_MODES)}")
    import math
    for name, positive in (("timeout", True), ("retry_backoff", False)):
        v = getattr(cfg, name)
        if not (isinstance(v, (int, float)) and math.isfinite(v) and (v > 0 if positive else v >= 0)):
            raise ValueError(f"--{name.replace('_', '-')} {v!r} must be a finite number of seconds "
                             f"{'> 0' if positive else '>= 0'}")
    if not (isinstance(cfg.retries, int) and cfg.retries >= 0):
        raise ValueError(f"--retries {cfg.retries!r} must be >= 0")
    if not (isinstance(cfg.max_error_rate, (int, float)) and 0 <= cfg.max_error_rate <= 1):
        raise ValueError(f"--max-error-rate {cfg.max_error_rate!r} must be in [0, 1]")
    if not cfg.temperature >= 0:
        raise ValueError(f"--temperature {cfg.temperature} must be >= 0 (0 = greedy)")
    if not 0 < cfg.top_p <= 1:
        raise ValueError(f"--top-p {cfg.top_p} must be in (0, 1]")
    for name in ("max_new_tokens", "concurrency", "batch_size", "batch_tokens", "max_turns", "max_prompt_tokens"):
        if getattr(cfg, name) is not None and getattr(cfg, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if cfg.servers and cfg.max_prompt_tokens is not None:
        raise ValueError("--max-prompt-tokens is an --engine hf option (a server refuses prompts longer than its "
                         "context itself: an 'answer' error)")
    if cfg.retries < 0 or cfg.timeout <= 0:
        raise ValueError("--retries must be >= 0 and --timeout > 0")
    if not cfg.data:
        raise ValueError("no --data files given")


def run_regenerate(cfg: RegenConfig) -> dict:
    """Regenerate the assistant turns of cfg.data into cfg.out; returns the regenerate.json record (also when
    servers stopped answering: then its status is 'incomplete' and a rerun continues)."""
    from eagle3 import dist as D
    from eagle3.target import load as T

    t0 = time.perf_counter()
    cfg = dataclasses.replace(cfg, data=list(cfg.data), servers=list(cfg.servers) if cfg.servers else None)
    _validate(cfg)
    # Everything that can be refused is refused before OUT is touched.
    target, tokenizer, tok = _target_identity(cfg.target, cfg.trust_remote_code, cfg.full_weights_digest,
                                              weights_optional=cfg.backend == "server")
    urls, model, engine_info = None, None, None
    if cfg.backend == "server":
        if int(os.environ.get("WORLD_SIZE", 1)) > 1:
            raise ValueError("--server runs in one process (its parallelism is --concurrency per server); "
                             "torchrun is for --engine hf")
        world = None
        urls, model = probe_servers(cfg)
    else:
        world = D.init_world(cfg.device)
        if cfg.dtype is None:
            cfg.dtype = "bf16" if world.device.type == "cuda" else "fp32"
        if cfg.dtype not in T.DTYPES:
            raise ValueError(f"--dtype {cfg.dtype!r}: choose one of {sorted(T.DTYPES)}")
        cfg.dtype = str(T.DTYPES[cfg.dtype]).removeprefix("torch.")
        model = target["path"]
        engine_info = {"name": "hf", "dtype": cfg.dtype, "device": world.device.type, "batch_size": cfg.batch_size,
                       "batching": resolve_batching(cfg.batching, world.device),
                       "kv_cache": "static" if resolve_batching(cfg.batching, world.device) == "padded"
                       and resolve_kv_cache(cfg.kv_cache, world.device, cfg.max_prompt_tokens) else "dynamic",
                       "world_size": world.world_size}
    is_main = world is None or world.is_main
    log = D.main_log(is_main)
    from eagle3.dump.conversations import data_sha256  # a file or a dataset directory
    inputs = [{"file": os.path.abspath(p), "sha256": data_sha256(p) if os.path.exists(p) else None}
              for p in cfg.data]
    from eagle3.dump.conversations import check_distinct_data
    check_distinct_data(cfg.data, [i["sha256"] for i in inputs])
    items, skipped, read = read_items(cfg.data, cfg.num_samples, cfg.max_turns)
    if target is None:
        log("[regenerate] note: no --target: regenerate.json records no target identity, and the dump will refuse "
            "this data unless --allow-foreign-data")

    current = _run_config(cfg, identity_of(target, tokenizer), model, inputs)
    if world is None:
        done = _prepare_out(cfg, current, skipped)
    else:  # rank 0's error is raised on every rank, so none waits in a collective
        done = D.broadcast_object(D.run_on_main(lambda: _prepare_out(cfg, current, skipped), world))
    n_done = len(done & {i.sample_index for i in items})
    log(f"[regenerate] {read} conversations read: {len(items)} to regenerate ({n_done} already done), "
        f"{len(skipped)} skipped; {cfg.backend} backend, model {model}, temperature "
        f"{cfg.temperature:g}, top_p {cfg.top_p:g}, max_new_tokens {cfg.max_new_tokens}, reasoning {cfg.reasoning}")

    down: dict = {}
    if cfg.backend == "server":
        written, tokens, gen_s, down = _run_server(cfg, urls, model, items, done, log)
    else:
        written, tokens, gen_s = _run_hf(cfg, items, done, world, tok, log)
        if cfg.stop_after_batches is not None:
            D.barrier()
            left = sum(1 for b in plan_batches(items, cfg.batch_size) if any(i.sample_index not in done for i in b))
            if left > cfg.stop_after_batches * world.world_size:
                raise SystemExit(f"stopped after {cfg.stop_after_batches} batches (--stop-after-batches)")
        D.barrier()
        written = sum(D.all_gather_objects(written))
        tokens = sum(D.all_gather_objects(tokens))
        gen_s = max(D.all_gather_objects(gen_s))

    def finish() -> dict:
        convs, errors, skipped_all = _merge(cfg.out)
        have = {c["sample_index"] for c in convs} | {e["sample_index"] for e in errors}
        pending = sum(it.sample_index not in have for it in items)  # not attempted (all servers went away)
        rec = build_record(cfg, target=target, tokenizer=tokenizer, model=model, servers=urls, inputs=inputs,
                           read=read, convs=convs, errors=errors, skipped=skipped_all, pending=pending,
                           elapsed=time.perf_counter() - t0, gen_s=gen_s, run_tokens=tokens, run_convs=written,
                           engine=engine_info)
        if down:
            rec["servers_down"] = down
        from eagle3.dump.shards import atomic_write_text
        atomic_write_text(os.path.join(cfg.out, RECORD_FILE), json.dumps(rec, indent=1, ensure_ascii=False))
        log(_summary(rec, cfg.out))
        return rec

    if world is None:
        record = finish()
    else:
        record = D.broadcast_object(D.run_on_main(finish, world))
        D.barrier()
    return record


def _over_error_rate(convs: int, errors: int, max_rate: float) -> bool:
    """Every attempted conversation failed, or more than max_rate of them (errors: the failed ones, prompts too long
    for the context left out: those are the data's, not the run's)."""
    return errors > 0 and (convs == 0 or errors / (convs + errors) > max_rate)


def check_record(record: dict) -> str | None:
    """What the CLI reports as a failure (non-zero exit): servers that stopped answering, too many failed
    conversations (every one, or over --max-error-rate), or server errors left."""
    down = record.get("servers_down")
    c = record["counts"]
    rate = record.get("max_error_rate", 1.0)
    failed = sum(n for k, n in record["errors"].items() if k != "too_long")
    if not down and _over_error_rate(c["conversations"], failed, rate):
        kinds = ", ".join(f"{n} {k}" for k, n in record["errors"].items() if k != "too_long")
        share = failed / (c["conversations"] + failed)
        return (f"{failed} of {c['conversations'] + failed} conversations failed ({share:.0%}; "
                f"--max-error-rate {rate:g}): {kinds}; see {ERRORS} for each one's reason. The answers kept are "
                "in place; fix the cause (model name, server, prompts) and rerun the same command to retry them")
    if down:
        return ("every server stopped answering:\n  " + "\n  ".join(down.values())
                + f"\n{c['conversations']} conversations are written; {c['pending']} are not done. Restart the "
                  "server(s) and rerun the same command to continue")
    server_errors = record["errors"].get("server", 0)
    if server_errors:
        return (f"{server_errors} conversations failed on the server after their retries (see "
                f"{ERRORS}); rerun the same command to retry them")
    return None


# ----------------------------------------------------------------------------------------------------------
# Dump side: where the data came from
# ----------------------------------------------------------------------------------------------------------

def data_sources(paths: list[str], target, tokenizer, allow_foreign: bool = False) -> list[dict]:
    """For each data file with a regenerate.json beside it: check that the same target (config, tokenizer and chat
    template hashes) wrote it -- ContractError naming both unless allow_foreign -- and describe the source for
    the dump manifest. Files without a regenerate.json are not listed."""
    ours = identity_of(dataclasses.asdict(target), dataclasses.asdict(tokenizer))
    digests = {(target.weights_sha256 or "").split(":")[0]: target.weights_sha256}  # ours, by digest method

    def but_weights(d: dict) -> dict:
        return {k: v for k, v in d.items() if k != "weights_sha256"}
    sources = []
    for p in paths:
        rec_path = os.path.join(os.path.dirname(os.path.abspath(p)), RECORD_FILE)
        if not os.path.isfile(rec_path):
            continue
        try:
            with open(rec_path, encoding="utf-8") as f:
                rec = json.load(f)
            theirs = rec.get("identity")
        except (OSError, ValueError, AttributeError) as e:
            raise C.ContractError(f"{rec_path}: unreadable regenerate record ({e})") from e
        writer = f"{rec.get('backend')} model {rec.get('model')}"
        mine = ours
        if isinstance(theirs, dict) and theirs.get("weights_sha256"):
            method = theirs["weights_sha256"].split(":")[0]
            if method not in digests:  # digested by the other method: ours taken likewise, once for all files
                from eagle3.target.load import target_info
                digests[method] = target_info(target.path, like=theirs["weights_sha256"]).weights_sha256
            mine = dict(ours, weights_sha256=digests[method])
        if theirs != mine and not allow_foreign:
            same_else = isinstance(theirs, dict) and but_weights(theirs) == but_weights(mine)
            if theirs is None:
                why = (f"{p} was regenerated by {writer} with no target identity recorded (a --server run without "
                       f"--target), so it cannot be checked against the target {target.path}")
            elif same_else and not theirs.get("weights_sha256"):
                why = (f"{p} was regenerated by {writer} with no weights recorded (its --target had none, or it was "
                       f"written before eagle3 recorded them), so nothing says the served model is {target.path}, "
                       "whose config and tokenizer it shares")
            elif same_else:
                why = (f"{p} was regenerated by a target with this config and tokenizer but OTHER WEIGHTS ({writer}: "
                       f"weights {theirs.get('weights_sha256')}; this dump's target {target.path}: weights "
                       f"{mine['weights_sha256']}): a fine-tune, another revision or another model")
            else:
                why = (f"{p} was regenerated by another target: {writer} (config {theirs.get('config_sha256')}, "
                       f"tokenizer {theirs.get('tokenizer_sha256')}, chat template "
                       f"{theirs.get('chat_template_sha256')}), but this dump's target is {target.path} (config "
                       f"{mine['config_sha256']}, tokenizer {mine['tokenizer_sha256']}, chat template "
                       f"{mine['chat_template_sha256']})")
            raise C.ContractError(f"{why}; a drafter learns best from its own target's answers. "
                                  "Pass --allow-foreign-data to dump it anyway")
        sources.append({"file": os.path.abspath(p), "sha256": C.file_sha256(p), "regenerate_json": rec_path,
                        "backend": rec.get("backend"), "model": rec.get("model"), "servers": rec.get("servers"),
                        "sampling": rec.get("sampling"), "reasoning": rec.get("reasoning"), "identity": theirs,
                        "identity_matches_target": theirs == mine, "status": rec.get("status"),
                        "counts": rec.get("counts")})
    return sources


if __name__ == "__main__":
    from eagle3.cli import main
    main(["regenerate", *sys.argv[1:]], process_entry=True)
