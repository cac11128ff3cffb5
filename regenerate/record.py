"""regenerate.json: the target identity (the hashes the dump manifest records), backend, model, sampling,
reasoning mode, inputs with sha256, counts, finish reasons, elapsed time, and a status: ``complete``,
``incomplete`` (server errors or pending conversations: rerun) or ``failed`` (every attempted conversation, or more
than --max-error-rate of them, failed; the CLI exits non-zero for the last two, check_record says why).
What the dump reads of it (the identity, `data_sources`) lives in eagle3.records.
"""

from __future__ import annotations

import collections
import dataclasses
import os

from eagle3.records import identity_of
from eagle3.regenerate.config import RegenConfig, sampling
from eagle3.regenerate.files import CONVERSATIONS, ERRORS, FORMAT, FORMAT_VERSION
from eagle3.target import load as T
from eagle3.target.fingerprint import weight_files


def read_target(target_dir: str | None, trust_remote_code: bool = False, full_weights: bool = False,
                weights_optional: bool = False):
    """(TargetInfo dict, TokenizerInfo dict, tokenizer) of a local target directory, or Nones. weights_optional: a
    --server run's local copy may be config + tokenizer only (weights_sha256 then '')."""
    if not target_dir:
        return None, None, None
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


def summary(rec: dict, out: str) -> str:
    """The two lines a run ends with: the whole of OUT, then this run's share and rates."""
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
