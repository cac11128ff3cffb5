"""Conversation files -> normalised messages: every data format the stages read.

Input files (read with HF ``datasets``):

* ``.jsonl`` / ``.json`` (JSON lines, or one JSON array of records) and ``.parquet``;
* a ``datasets`` directory: ``Dataset.save_to_disk`` output (``load_from_disk``) or a directory
  ``load_dataset`` reads (data files, a hub snapshot); split ``train`` or the only one.  A hub dataset id
  already in the local Hugging Face cache becomes its snapshot directory (``resolve_data``, offline);
* each record is ShareGPT ``{"conversations": [{"from": ..., "value": ...}, ...]}`` or OpenAI-style
  ``{"messages": [{"role": ..., "content": ...}, ...]}`` (when a record has both keys, ``messages`` wins);
* roles: human/user -> user; gpt/assistant/chatgpt/bard/bing/model -> assistant; system -> system
  (``bing`` occurs in ShareGPT V3 itself); anything else is a :class:`DataError`;
* content: a string, or a list of ``{"type": "text", "text": ...}`` parts (joined with no separator);
  anything else (image parts, numbers, objects, null) is a :class:`DataError` naming the record and turn;
* an assistant turn's ``reasoning_content`` (a string; what ``eagle3 regenerate`` stores from servers with a
  reasoning parser) is kept on the message, so chat templates that render it (Kimi, DeepSeek, Qwen3) do.

Record locations ("origins") are ``path:LINE`` (1-based line) for JSON lines and ``path:record K`` (0-based
position) for JSON arrays and parquet.

Every stage reads its conversations here (regenerate, the dump, eval's prompts); the dump renders and masks them
with eagle3.conversations.masking.
"""

from __future__ import annotations

import json
import logging
import os
from array import array
from typing import Any, Iterator
from eagle3.contract import canonical_json, file_sha256, sha256_bytes
from eagle3.target.load import hub_snapshot


logger = logging.getLogger(__name__)

ROLE_MAP = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bard": "assistant",
    "bing": "assistant", "model": "assistant",
    "system": "system",
}


class DataError(ValueError):
    """Bad input data; the message names the file and line (JSON lines) or record index (JSON array, parquet)."""


def _as_path_list(paths) -> list[str]:
    if isinstance(paths, (str, os.PathLike)):
        return [os.fspath(paths)]
    return [os.fspath(p) for p in paths]


def _first_nonspace_byte(path: str) -> bytes:
    with open(path, "rb") as f:
        while True:
            chunk = f.read(4096)
            if not chunk:
                return b""
            stripped = chunk.lstrip()
            if stripped:
                return stripped[:1]


def _nonblank_line_numbers(path: str) -> array:
    """1-based numbers of the non-blank lines (the JSON-lines readers skip blank lines)."""
    nums = array("q")
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                nums.append(lineno)
    return nums


def _locate_json_error(path: str) -> None:
    """Raise a DataError naming the first malformed line (JSON lines) or position (JSON array)."""
    if _first_nonspace_byte(path) == b"[":
        with open(path, "rb") as f:
            raw = f.read()
        try:
            data = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            line = raw.count(b"\n", 0, e.start) + 1
            raise DataError(f"{path}:{line}: not valid UTF-8 (byte {e.start}: {e.reason})") from None
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{e.lineno}: invalid JSON: {e.msg} (line {e.lineno}, column {e.colno})") from None
        for k, rec in enumerate(data):
            if not isinstance(rec, dict):
                raise DataError(f"{path}:record {k}: expected a JSON object, got {_describe(rec)}")
        return
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                rec = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError:
                raise DataError(f"{path}:{lineno}: line is not valid UTF-8") from None
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: malformed JSON line: {e.msg} (column {e.colno})") from None
            if not isinstance(rec, dict):
                raise DataError(f"{path}:{lineno}: expected one JSON object per line, got {_describe(rec)}")


def _iter_json_plain(path: str) -> Iterator[tuple[str, Any]]:
    """Read a (valid, see _locate_json_error) JSON file with the json module."""
    if _first_nonspace_byte(path) == b"[":
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        for k, rec in enumerate(data):
            yield f"{path}:record {k}", rec
        return
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if raw.strip():
                yield f"{path}:{lineno}", json.loads(raw.decode("utf-8"))


_DIGESTS: dict = {}


def _content_cache_dir(path: str) -> str:
    """A `datasets` cache directory of this content: `datasets` keys its cache on a file's path, size and mtime, so a
    file replaced by another of the same name and mtime (cp -p, rsync -a, tar) was served from the old cache while
    the manifest recorded the new file's sha256. Keyed on the sha256 the manifest records, the cache can only hold
    what is read now."""
    import datasets
    st = os.stat(path)
    key = (os.path.abspath(path), st.st_size, st.st_mtime_ns, st.st_ino)
    if key not in _DIGESTS:  # once per file and process (data_sha256 reads it whole)
        _DIGESTS[key] = data_sha256(path)
    return os.path.join(datasets.config.HF_DATASETS_CACHE, "eagle3-by-content", _DIGESTS[key][:32])


def _load_hf(kind: str, path: str):
    from datasets import load_dataset
    return load_dataset(kind, data_files=path, split="train", cache_dir=_content_cache_dir(path))


def _load_dataset_dir(path: str):
    """A `datasets` dataset from a directory: `save_to_disk` output (state.json / dataset_dict.json) through
    `load_from_disk`, else whatever `load_dataset(path)` reads (data files, a hub snapshot). Split: the
    Dataset itself, else 'train', else the only split."""
    from datasets import DatasetDict, load_dataset, load_from_disk
    saved = any(os.path.isfile(os.path.join(path, f)) for f in ("state.json", "dataset_dict.json"))
    how = "datasets.load_from_disk" if saved else "datasets.load_dataset"
    try:
        ds = load_from_disk(path) if saved else load_dataset(path, cache_dir=_content_cache_dir(path))
    except Exception as e:  # noqa: BLE001 - any reader failure is bad input
        raise DataError(f"{path}: cannot read it as a dataset directory with {how}: {type(e).__name__}: {e}") from e
    if isinstance(ds, DatasetDict):
        if "train" in ds:
            ds = ds["train"]
        elif len(ds) == 1:
            ds = next(iter(ds.values()))
        else:
            raise DataError(f"{path}: {how} found the splits {sorted(ds)} and none is 'train'; pass one split "
                            f"(for a save_to_disk directory: {path}/<split>)")
    return ds


def data_sha256(path: str) -> str:
    """sha256 of a data file, or of a dataset directory (its files' relative paths and sha256, in order; hidden
    files such as locks are left out): what the manifest's data fingerprint records."""
    if not os.path.isdir(path):
        return file_sha256(path)
    rows = []
    for root, dirs, files in os.walk(path, followlinks=True):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            if not name.startswith("."):
                full = os.path.join(root, name)
                rows.append([os.path.relpath(full, path), file_sha256(full)])
    return sha256_bytes(canonical_json(rows))


def check_distinct_data(paths, digests: list[str] | None = None) -> None:
    """DataError when two --data entries are the same data (the same file twice, or two files of identical bytes):
    each record would be read twice, and one copy may land in the held-out split while the other trains."""
    paths = _as_path_list(paths)
    digests = digests if digests is not None else [data_sha256(p) if os.path.exists(p) else None for p in paths]
    seen: dict = {}
    for p, h in zip(paths, digests):
        if h is None:
            continue
        if h in seen:
            same = os.path.realpath(seen[h]) == os.path.realpath(p)
            raise DataError(f"--data gives {'the same file' if same else 'the same data'} twice: {seen[h]} and {p}"
                            f"{'' if same else ' (identical bytes)'}; every record would be read twice")
        seen[h] = p


def resolve_data(entries) -> list[str]:
    """--data entries: files and dataset directories as given; anything else is a hub dataset id looked up in
    the local Hugging Face cache (offline), giving its snapshot directory. FileNotFoundError naming the entry
    and the cache when it is in neither place."""
    return [p if os.path.exists(p) else hub_snapshot(p, "dataset", "--data") for p in _as_path_list(entries)]


def _iter_records(path: str) -> Iterator[tuple[str, Any]]:
    if os.path.isdir(path):
        for k, rec in enumerate(_load_dataset_dir(path)):
            yield f"{path}:record {k}", rec
        return
    ext = os.path.splitext(path)[1].lower()
    if ext not in (".jsonl", ".json", ".parquet"):
        raise DataError(f"{path}: unsupported file extension {ext or '(none)'!r}; "
                        "expected .jsonl, .json, .parquet or a dataset directory")
    if not os.path.isfile(path):
        raise DataError(f"{path}: no such file")
    if ext == ".parquet":
        try:
            ds = _load_hf("parquet", path)
        except Exception as e:  # noqa: BLE001 - any reader failure is bad input
            raise DataError(f"{path}: cannot read parquet file: {type(e).__name__}: {e}") from e
        for k, rec in enumerate(ds):
            yield f"{path}:record {k}", rec
        return

    try:
        ds = _load_hf("json", path)
    except Exception as e:  # noqa: BLE001
        # datasets' error names neither line nor file position: find the culprit ourselves.
        _locate_json_error(path)
        logger.warning("datasets could not read %s (%s: %s) although it is valid JSON; reading it with the "
                       "json module instead", path, type(e).__name__, e)
        yield from _iter_json_plain(path)
        return

    n = len(ds)
    lines = None
    if _first_nonspace_byte(path) != b"[":
        lines = _nonblank_line_numbers(path)
        if len(lines) != n:  # e.g. one pretty-printed object: no line <-> record correspondence
            lines = None
    try:
        for k, rec in enumerate(ds):
            yield (f"{path}:{lines[k]}" if lines is not None else f"{path}:record {k}"), rec
    except UnicodeDecodeError:
        # datasets (pyarrow) reads bytes that are not UTF-8 and fails only on the row, naming neither file nor
        # line: find the culprit ourselves (raises a DataError naming both).
        _locate_json_error(path)
        raise


def _describe(x: Any) -> str:
    if x is None:
        return "null"
    if isinstance(x, dict):
        if "type" in x:
            return f"a {x['type']!r} part"
        return f"an object with keys {sorted(map(str, x))}"
    text = repr(x)
    return f"{type(x).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):
        parts = []
        for k, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                raise DataError(f"{where}: content part {k} is {_describe(part)}; only text parts "
                                "{'type': 'text', 'text': ...} are supported")
        return "".join(parts)
    raise DataError(f"{where}: content must be a string or a list of text parts, got {_describe(content)}")


def normalize_record(record: Any, origin: str) -> list[dict]:
    """One record -> [{"role": "system"|"user"|"assistant", "content": str}] (assistant turns may also carry
    "reasoning_content": str); DataError on bad input."""
    if not isinstance(record, dict):
        raise DataError(f"{origin}: expected an object with 'conversations' or 'messages', got {_describe(record)}")
    if record.get("messages") is not None:
        key, turns, pairs = "messages", record["messages"], (("role", "content"), ("from", "value"))
    elif record.get("conversations") is not None:
        key, turns, pairs = "conversations", record["conversations"], (("from", "value"), ("role", "content"))
    else:
        raise DataError(f"{origin}: record has neither 'conversations' (ShareGPT) nor 'messages' (OpenAI); "
                        f"keys: {sorted(map(str, record))}")
    if not isinstance(turns, (list, tuple)):
        raise DataError(f"{origin}: '{key}' must be a list of turns, got {_describe(turns)}")
    out = []
    for j, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise DataError(f"{origin}: turn {j} must be an object, got {_describe(turn)}")
        role_key, content_key = pairs[0]
        if turn.get(role_key) is None and turn.get(pairs[1][0]) is not None:
            role_key, content_key = pairs[1]
        raw_role = turn.get(role_key)
        if not isinstance(raw_role, str):
            raise DataError(f"{origin}: turn {j} has no role ('{role_key}' is {_describe(raw_role)})")
        role = ROLE_MAP.get(raw_role.strip().lower())
        if role is None:
            raise DataError(f"{origin}: turn {j} has unknown role {raw_role!r} (known: {', '.join(ROLE_MAP)})")
        content = _content_text(turn.get(content_key), f"{origin}: turn {j} ({raw_role})")
        out.append({"role": role, "content": content})
        reasoning = turn.get("reasoning_content")
        if role == "assistant" and reasoning is not None:
            if not isinstance(reasoning, str):
                raise DataError(f"{origin}: turn {j} ({raw_role}): reasoning_content must be a string, got "
                                f"{_describe(reasoning)}")
            if reasoning:
                out[-1]["reasoning_content"] = reasoning
    return out


def read_conversations(paths: list[str], file_starts: list[int] | None = None
                       ) -> Iterator[tuple[int, str, list[dict]]]:
    """Yield (sample_index, origin, messages) with messages normalised to
    [{"role": "system"|"user"|"assistant", "content": str}].

    sample_index runs over all records of all files in order (records later skipped still use one).
    origin is 'data.jsonl:17' (1-based line) or 'data.parquet:record 17' (0-based record).
    file_starts, if given, receives the sample_index of each file's first record as the file is reached."""
    index = 0
    for path in _as_path_list(paths):
        if file_starts is not None:
            file_starts.append(index)
        for origin, record in _iter_records(path):
            yield index, origin, normalize_record(record, origin)
            index += 1
