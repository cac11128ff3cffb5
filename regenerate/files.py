"""The files in --out, but for the record itself (record.py): conversations.jsonl, errors.jsonl, skipped.jsonl,
the ranks' part files, and regenerate_config.json.

* ``conversations.jsonl``: ``{"sample_index", "messages", "finish_reasons", "completion_tokens"}`` per
  regenerated conversation, sorted by sample_index when the run ends (``messages`` is what the dump reads);
* ``errors.jsonl`` (sample_index, origin, turn, kind, error) and ``skipped.jsonl`` (sample_index, origin, reason);
  error kind ``server``: the request failed after its retries, or the server's answer was malformed (not JSON, no
  message, content that is not text, a token count that is not a number) through its retries (a rerun may
  succeed); ``answer``: the target's answer is unusable (empty, or the prompt does not fit the context) or the
  server rejected the request (HTTP 4xx); ``too_long``: the prompt (with its answer budget) does not fit
  --max-prompt-tokens or the context, a property of the data (never retried, not counted as a failure);
* ``regenerate_config.json``: written at the start; a rerun with other sampling/target/backend/inputs is refused.

Resume: rerunning the same command regenerates exactly the samples that have no line in conversations.jsonl (read
by sample_index), so errors are retried -- except the hf engine's ``answer`` errors: its generation is
deterministic, so they would only come back, at the cost of their whole batch. Lines are appended one batch at a
time (one write, then fsync); a partial last line left by a kill is dropped on restart. Each rank of a data-parallel
run appends to its own part files, merged into the final files by rank 0 at the end.
"""

from __future__ import annotations

import glob
import json
import os
import sys

from eagle3.contract import ContractError
from eagle3.atomic import atomic_write_text
from eagle3.regenerate.config import RegenConfig, sampling

# What --out holds, named in regenerate_config.json and regenerate.json (record.py)
FORMAT = "eagle3-regenerate"
FORMAT_VERSION = 1
CONVERSATIONS, ERRORS, SKIPPED = "conversations.jsonl", "errors.jsonl", "skipped.jsonl"
CONFIG_FILE = "regenerate_config.json"


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


def rank_file(out: str, name: str, rank: int, world: int) -> str:
    """Where a rank appends: the final file itself in a world of one, else its own part file."""
    if world == 1:
        return os.path.join(out, name)
    stem = name.removesuffix(".jsonl")
    return os.path.join(out, f"{stem}.rank{rank}.jsonl")


def _part_files(out: str, name: str) -> list[str]:
    stem = name.removesuffix(".jsonl")
    return sorted(glob.glob(os.path.join(glob.escape(out), f"{stem}.rank*.jsonl")))


class Appender:
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
    atomic_write_text(path, "".join(line + "\n" for line in lines))


def run_config(cfg: RegenConfig, identity: dict | None, model: str | None, inputs: list[dict]) -> dict:
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


def prepare_out(cfg: RegenConfig, current: dict, skipped: list[dict]) -> set[int]:
    """Rank 0: make OUT, refuse other settings, repair cut-off lines, write skipped.jsonl. Returns the samples
    not to regenerate: those written, and with the hf engine those whose answer was unusable (it is
    deterministic, so the same answer would come back, at the price of regenerating the whole batch)."""
    msg = _check_config(cfg.out, current) if os.path.isdir(cfg.out) else None
    if msg:
        raise ContractError(msg)
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


def merge_out(out: str) -> tuple[list[dict], list[dict], list[dict]]:
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
