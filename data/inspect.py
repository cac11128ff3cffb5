"""`eagle3 inspect PATH`: what an artefact holds and whether it verifies (dump directories; runs and exports later)."""

from __future__ import annotations

import json
import os

from eagle3 import contract as C
from eagle3.data.dumps import DumpSet
from eagle3.data.vocab import count_tokens, coverage, load_vocab, select_draft_vocab
from eagle3.vocab_map import vocab_map


def inspect_dump(path: str, verify: bool = True, vocab_sizes=(8192, 16384, 32000)) -> dict:
    m = C.load_manifest(path)
    report: dict = {"kind": "dump", "path": os.path.abspath(path), "format": f"{m.format} v{m.format_version}",
                    "target": vars(m.target), "capture": {"hidden_state_indices": m.capture.hidden_state_indices,
                                                          "meaning": C.describe(m.capture.hidden_state_indices)},
                    "dtype": m.dtype, "max_length": m.max_length, "tp_size": m.tp_size, "dp_size": m.dp_size,
                    "totals": m.totals, "skipped": m.skipped,
                    "bytes_per_token": m.totals["bytes"] / max(m.totals["tokens"], 1)}
    report["storage"], report["projection"] = storage_report(m, _has_argmax(path, m))
    try:
        ds = DumpSet(path, verify=verify)  # also checks every shard's own metadata against the manifest
        report["verified"] = "sha256 ok" if verify else "not checked (--no-verify)"
        report["shard_identity"] = ("legacy: shards predate per-shard identity (capture indices and target "
                                    "checked; tokenizer, dtype and data not)" if ds.legacy else "ok")
    except C.ContractError as e:
        report["verified"] = f"FAILED: {e}"
        return report
    counts = count_tokens(ds, ds.refs)
    V = counts.numel()
    report["loss_tokens"] = int(counts.sum())
    report["draft_vocab_coverage"] = {
        str(n): coverage(counts, vocab_map(select_draft_vocab(counts, n), V)[1]) for n in vocab_sizes if n <= V}
    vocab_file = os.path.join(path, "vocab.safetensors")
    if os.path.isfile(vocab_file):
        report["vocab_file"] = {"path": vocab_file, "coverage": coverage(counts, load_vocab(vocab_file)["t2d"])}
    return report


def _has_argmax(path: str, m: C.DumpManifest) -> bool:
    """Whether the dump recorded target_argmax (its first shard's tensor names; True if it cannot be read)."""
    from safetensors import safe_open
    try:
        with safe_open(os.path.join(path, m.shards[0].file), "pt") as f:
            return C.TARGET_ARGMAX in f.keys()
    except Exception:  # no shard, or an unreadable one: the verification reports it
        return True


def storage_report(m: C.DumpManifest, argmax: bool) -> tuple[dict, dict]:
    """How the states are stored and their nominal bytes per token (docs/contract.md §3); and what a full dump
    would take, per storage: per million conversations at this dump's mean length, and for this dump's totals."""
    import torch
    n, H = len(m.capture.hidden_state_indices) + 1, m.target.hidden_size
    itemsize = getattr(torch, m.dtype).itemsize
    fp8 = m.storage == C.STORAGE_FP8
    storage = {"storage": m.storage, "read_as": m.dtype,
               "states": "float8_e4m3fn + float32 scale per token row" if fp8 else m.dtype,
               "bytes_per_token": C.bytes_per_token(n, H, itemsize, m.storage, argmax)}
    options = {"this dump": storage["bytes_per_token"],
               "bf16": C.bytes_per_token(n, H, 2, C.STORAGE_DTYPE, argmax),
               "fp8": C.bytes_per_token(n, H, 1, C.STORAGE_FP8, argmax)}
    tot = m.totals
    mean = tot["tokens"] / max(tot["samples"], 1)
    projection = {"mean_tokens_per_conversation": mean,
                  "bytes_per_million_conversations": {k: bpt * mean * 1e6 for k, bpt in options.items()},
                  "bytes_for_this_dumps_totals": {k: bpt * tot["tokens"] for k, bpt in options.items()}}
    return storage, projection


def inspect_path(path: str, verify: bool = True) -> dict:
    if os.path.isfile(os.path.join(path, C.MANIFEST_FILE)):
        return inspect_dump(path, verify=verify)
    raise ValueError(f"{path}: not something eagle3 can inspect (expected a dump directory with {C.MANIFEST_FILE})")


def render(report: dict) -> str:
    if report["kind"] != "dump":
        return json.dumps(report, indent=1)
    t, tot = report["target"], report["totals"]
    lines = [
        f"dump        {report['path']}  ({report['format']})",
        f"target      {t['architecture']} ({t['model_type']}), {t['num_hidden_layers']} layers, hidden "
        f"{t['hidden_size']}, vocab {t['vocab_size']}, config sha256 {t['config_sha256'][:12]}",
        f"weights     {t.get('weights_sha256') or 'not recorded (made before eagle3 recorded weights)'}"
        f"{'  from ' + t['revision'] if t.get('revision') else ''}",
        f"capture     HF indices {report['capture']['hidden_state_indices']} = {report['capture']['meaning']}",
        f"data        {tot['samples']:,} samples, {tot['tokens']:,} tokens, {tot['bytes'] / 2**30:,.2f} GiB in "
        f"{tot['shards']} shards; {report['bytes_per_token']:,.0f} B/token; dtype {report['dtype']}",
        f"storage     {_storage_line(report)}",
        f"projected   {_projection_line(report)}",
        f"skipped     {tot['skipped']:,} {report['skipped'] or ''}",
        f"verified    {report['verified']}",
    ]
    if "shard_identity" in report:
        lines.append(f"shards      identity {report['shard_identity']}")
    if "draft_vocab_coverage" in report:
        cov = ", ".join(f"{n}: {c:.1%}" for n, c in report["draft_vocab_coverage"].items())
        lines.append(f"draft vocab coverage of {report['loss_tokens']:,} loss tokens  {cov}")
    if "vocab_file" in report:
        lines.append(f"vocab file  {report['vocab_file']['path']}: coverage {report['vocab_file']['coverage']:.1%}")
    return "\n".join(lines)


def _storage_line(report: dict) -> str:
    st = report["storage"]
    return f"{st['storage']}: states {st['states']}, read as {st['read_as']}; {st['bytes_per_token']:,} B/token"


def _projection_line(report: dict) -> str:
    p = report["projection"]
    per_m, here = p["bytes_per_million_conversations"], p["bytes_for_this_dumps_totals"]
    return (f"per 1M conversations of {p['mean_tokens_per_conversation']:,.0f} tokens: "
            + ", ".join(f"{k} {v / 2**40:,.2f} TiB" for k, v in per_m.items())
            + f"; this dump's {report['totals']['tokens']:,} tokens: "
            + ", ".join(f"{k} {v / 2**30:,.2f} GiB" for k, v in here.items()))
