#!/usr/bin/env python3
"""What identifying a target by its weights costs (target/fingerprint.py): the sampled digest (the default) and the
full one (`--full-weights-digest`) over weight files written here, and over a real target directory if given.

    python bench/weights_fingerprint.py --files 8 --gib 2 [--target example]

The files are written with random bytes, then read back: the sampled digest reads ~2 MiB a file whatever its size;
the full one reads every byte (page cache warm right after writing: the full figure is then a lower bound of a cold
read, and the sampled one's reads are seeks on a cold disk). Prints one JSON line per measurement, and the
projection to Kimi-K2.5's INT4 checkpoint (~590 GB; its file count given by --kimi-files).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import time

from eagle3.contract import method_of
from eagle3.target.fingerprint import weights_fingerprint


def timed(path: str, full: bool, repeats: int = 3) -> tuple[float, dict]:
    best, out = float("inf"), None
    for _ in range(repeats if not full else 1):
        t0 = time.perf_counter()
        out = weights_fingerprint(path, full=full)
        best = min(best, time.perf_counter() - t0)
    return best, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--gib", type=float, default=2.0, help="size of each written file")
    ap.add_argument("--dir", default=None, help="where to write them (default: a temp dir)")
    ap.add_argument("--target", default=None, help="also a real target directory ('example')")
    ap.add_argument("--kimi-files", type=int, default=64)
    ap.add_argument("--kimi-gb", type=float, default=590.0)
    a = ap.parse_args()
    machine = f"{platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    rows = []
    d = tempfile.mkdtemp(dir=a.dir, prefix="fingerprint_")
    try:
        size = int(a.gib * 2 ** 30)
        t0 = time.perf_counter()
        for i in range(a.files):
            with open(os.path.join(d, f"model-{i:05d}.safetensors"), "wb") as f:
                left = size
                while left:
                    n = min(left, 64 << 20)
                    f.write(os.urandom(n))
                    left -= n
        write_s = time.perf_counter() - t0
        total = a.files * size
        for full in (False, True):
            s, out = timed(d, full)
            rows.append({"what": f"{a.files} files x {a.gib} GiB written here", "method": method_of(out["sha256"]),
                         "seconds": round(s, 4), "bytes": total, "read_gb_per_s": round(total / s / 1e9, 2)
                         if full else None, "per_file_ms": round(1000 * s / a.files, 2)})
    finally:
        shutil.rmtree(d, ignore_errors=True)
    if a.target:
        path = a.target
        if path == "example":
            from eagle3.dump.example import example_target_dir
            path = example_target_dir(log=lambda *x: None)
        for full in (False, True):
            s, out = timed(path, full)
            rows.append({"what": f"target {a.target}", "method": method_of(out["sha256"]), "seconds": round(s, 4),
                         "bytes": out["bytes"], "files": out["files"]})
    sampled = next(r for r in rows if r["method"] == "sampled-v1")
    full = next(r for r in rows if r["method"] == "full-v1")
    rows.append({"what": f"projection: Kimi-K2.5 INT4, {a.kimi_gb:.0f} GB in {a.kimi_files} files",
                 "sampled_seconds": round(sampled["per_file_ms"] * a.kimi_files / 1000, 2),
                 "full_seconds_at_measured_rate": round(a.kimi_gb * 1e9 / (full["read_gb_per_s"] * 1e9), 1)})
    for r in rows:
        print(json.dumps({"machine": machine, "write_s": round(write_s, 1), **r}))


if __name__ == "__main__":
    main()
