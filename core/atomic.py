"""Writes a reader never sees half done: a file, or a whole directory, written aside and renamed into place.

Every stage writes this way (dump shards and sidecars, regeneration records, checkpoints, checkpoints/best, exports,
the converted example target), so a killed process leaves either the old thing or the whole new one, plus at most a
temporary name that the next writer or `remove_stale_tmp`-style cleanups recognise. One owner, below every stage.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from typing import Iterator


def tmp_name(path: str) -> str:
    """The temporary name a file is written under before its rename (one per process: writers never share it)."""
    return f"{path}.tmp-{os.getpid()}"


def atomic_write_bytes(path: str, data: bytes) -> None:
    """Write to a temporary name, fsync, rename: a reader sees the old file or the whole new one, and a failed
    write leaves no temporary file behind."""
    tmp = tmp_name(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def atomic_write_text(path: str, text: str) -> None:
    atomic_write_bytes(path, text.encode())


@contextmanager
def replaced_dir(final: str) -> Iterator[str]:
    """Yields a fresh directory beside `final` to fill; when the block ends without an error it becomes `final` (an
    existing `final` is moved aside first and removed after), and on any error it is removed and `final` is left as
    it was. Between the two renames `final` is briefly absent, never partial."""
    final = os.path.abspath(final)
    parent, name = os.path.dirname(final), os.path.basename(final)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=parent)
    try:
        yield tmp
        if os.path.lexists(final):
            old = tempfile.mkdtemp(prefix=f".{name}.old-", dir=parent)
            os.rename(final, os.path.join(old, name))
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
