"""`eagle3 inspect PATH`: what an artefact holds and whether it verifies (dump directories; runs and exports later)."""

from __future__ import annotations

import json
import os

from eagle3 import contract as C


def inspect_dump(path: str, verify: bool = True, vocab_sizes=(8192, 16384, 32000)) -> dict:
    from eagle3.data.dumps import DumpSet
    from eagle3.data.vocab import count_tokens, coverage, select_draft_vocab, vocab_map
    m = C.load_manifest(path)
    report: dict = {"kind": "dump", "path": os.path.abspath(path), "format": f"{m.format} v{m.format_version}",
                    "target": vars(m.target), "capture": {"hidden_state_indices": m.capture.hidden_state_indices,
                                                          "meaning": C.describe(m.capture.hidden_state_indices)},
                    "dtype": m.dtype, "max_length": m.max_length, "tp_size": m.tp_size, "dp_size": m.dp_size,
                    "totals": m.totals, "skipped": m.skipped,
                    "bytes_per_token": m.totals["bytes"] / max(m.totals["tokens"], 1)}
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
        from eagle3.data.vocab import load_vocab
        report["vocab_file"] = {"path": vocab_file, "coverage": coverage(counts, load_vocab(vocab_file)["t2d"])}
    return report


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
        f"capture     HF indices {report['capture']['hidden_state_indices']} = {report['capture']['meaning']}",
        f"data        {tot['samples']:,} samples, {tot['tokens']:,} tokens, {tot['bytes'] / 2**30:,.2f} GiB in "
        f"{tot['shards']} shards; {report['bytes_per_token']:,.0f} B/token; dtype {report['dtype']}",
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
