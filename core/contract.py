"""The capture contract: which hidden states a drafter is trained on, named ONE way, checked at every stage.

A drafter trained on one set of hidden states and served with another silently loses acceptance. So the
indices live here and nowhere else, every artefact (dump manifest, checkpoint, export) records them, and every
stage boundary calls `require_same_capture` / `validate_indices` from this module.

Naming: the HF index k = `model(..., output_hidden_states=True).hidden_states[k]`. k = 0 is the embedding output,
k = i + 1 is the output of decoder layer i (the full, un-normalised residual stream), k = L is the post-final-norm
state. A drafter may capture 0 < k < L: SGLang captures neither the embedding nor the last layer's output.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Sequence

DUMP_FORMAT = "eagle3-dump"
DUMP_FORMAT_VERSION = 1  # a dump whose states are stored in its dtype (DUMP_FORMAT_VERSIONS)
STANDARDIZE_VERSION = "v1"

# Tensor names inside a dump shard (format v1).
INPUT_IDS = "input_ids"
LOSS_MASK = "loss_mask"
FINAL_HIDDEN = "final_hidden"
SAMPLE_OFFSETS = "sample_offsets"
SAMPLE_INDEX = "sample_index"
# Optional (dumps since the fast trainer): the target's full-vocab argmax at each token, int32. With it the
# trainer's teacher multiplies only the draft-vocab rows of the target head (docs/contract.md §9 needs nothing else).
TARGET_ARGMAX = "target_argmax"
# The captured states concatenated in ascending HF index (standardize_data_v1): the drafter's input, in a
# standardized sample and a training batch (data/batch.py), never in a shard.
HIDDEN_STATE = "hidden_state"
HF_INDEX_CONVENTION = "hf_hidden_states_index"  # CaptureSpec.convention: the one naming of captured states (§1)
HIDDEN_PREFIX = "hidden_states."

# How a dump stores its states (docs/contract.md §3). "dtype": hidden_states.<k> and final_hidden in the dump's
# --dtype. "fp8": each of them as float8 e4m3 with one float32 scale per token row in `<name>.scale` [N]
# (value = q * scale; scale = row amax / FP8_MAX, 1 for an all-zero row): 4 B/token per state instead of 16 (fp32).
STORAGE_DTYPE = "dtype"
STORAGE_FP8 = "fp8"
STORAGES = (STORAGE_DTYPE, STORAGE_FP8)
# The format version a dump is written with says who can read it. Version 1 holds the states in `dtype`; every
# eagle3 reads it. Version 2 holds them as fp8 + per-token scales: a reader from before fp8 storage accepts version 1
# only, so it refuses such a dump by its version instead of misreading the fp8 bytes as states.
DUMP_FORMAT_VERSIONS = {STORAGE_DTYPE: DUMP_FORMAT_VERSION, STORAGE_FP8: 2}
SCALE_SUFFIX = ".scale"
FP8_MAX = 448.0  # the largest finite float8 e4m3fn value


class ContractError(ValueError):
    """Two artefacts disagree about what was captured, or indices break the contract. Always fatal."""


def hidden_state_key(k: int) -> str:
    return f"{HIDDEN_PREFIX}{k}"


def scale_key(name: str) -> str:
    """The companion tensor holding the per-token scales of an fp8-stored state `name`."""
    return f"{name}{SCALE_SUFFIX}"


def captured_index(name: str) -> int | None:
    """k of a tensor named hidden_states.<k> (not its scale), else None."""
    if not name.startswith(HIDDEN_PREFIX) or name.endswith(SCALE_SUFFIX):
        return None
    return int(name[len(HIDDEN_PREFIX):])


def bytes_per_token(num_states: int, hidden_size: int, itemsize: int, storage: str = STORAGE_DTYPE,
                    argmax: bool = True) -> int:
    """Shard bytes per token (headers aside): `num_states` [N, H] states (the captured ones and final_hidden),
    input_ids 4 + loss_mask 1 + target_argmax 4. fp8 stores 1 byte per value plus a 4-byte scale per state."""
    per_state = hidden_size + 4 if storage == STORAGE_FP8 else hidden_size * itemsize
    return num_states * per_state + 4 + 1 + 4 * argmax


def layer_for_index(k: int) -> int:
    """The decoder layer whose output is HF index k (docs/contract.md §1): layer k - 1. The capture hooks attach
    there, and every message that names a layer says it through this one function."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ContractError(f"HF index {k!r} is not the output of a decoder layer (k >= 1; k = 0 is the embedding)")
    return k - 1


def eagle3_default_layers(num_layers: int) -> list[int]:
    """EAGLE-3's default triple of decoder layers (2, L//2, L-3): one low, one middle, one high. Our default capture
    takes their outputs; SGLang's own default (serving.sglang_default_capture) takes these numbers as capture
    indices, one layer earlier -- the same triple, read two ways, which is why both derive from here."""
    return [2, num_layers // 2, num_layers - 3]


def default_capture_indices(num_layers: int) -> list[int]:
    """Outputs of decoder layers (2, L//2, L-3), i.e. HF indices (3, L//2 + 1, L - 2) -- Kimi-K2.5 (L=61): [3, 31, 59]."""
    return sorted({layer + 1 for layer in eagle3_default_layers(num_layers)})


def validate_indices(indices: Iterable[int], num_layers: int) -> list[int]:
    """Return the indices sorted ascending (the concatenation order SGLang uses), or raise ContractError."""
    idx = list(indices)
    if not idx:
        raise ContractError("no capture indices given")
    if any(not isinstance(k, int) or isinstance(k, bool) for k in idx):
        raise ContractError(f"capture indices must be integers, got {idx!r}")
    if len(set(idx)) != len(idx):
        raise ContractError(f"capture indices repeat: {idx}")
    bad = [k for k in idx if not 0 < k < num_layers]
    if bad:
        raise ContractError(
            f"capture indices {bad} out of range for a {num_layers}-layer target: HF indices must satisfy "
            f"0 < k < {num_layers} (k=0 is the embedding, k={num_layers} the post-norm output; SGLang captures neither)"
        )
    return sorted(idx)


def parse_indices(text: str) -> list[int]:
    """'3,31,59' -> [3, 31, 59] (order as given; validate_indices sorts)."""
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise ContractError(f"--layers expects comma-separated integers (HF hidden_states indices), got {text!r}")


def canonical_json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()


def sha256_bytes(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def file_sha256(path: str, chunk: int = 1 << 24) -> str:
    """sha256 of a file, streamed (shards are GiB-sized); what manifests and provenance record."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()


# Keys of a transformers config that describe where/how it was saved, not the model.
_VOLATILE_CONFIG_KEYS = {"_name_or_path", "transformers_version", "torch_dtype", "dtype", "_attn_implementation",
                         "_attn_implementation_autoset", "quantization_config", "tp_plan", "pp_plan",
                         "base_model_tp_plan", "base_model_pp_plan", "base_model_ep_plan", "_commit_hash",
                         "use_cache", "output_hidden_states", "return_dict", "_experts_implementation"}


def read_json(path: str) -> dict:
    """A JSON record file, or an error naming it (missing: FileNotFoundError; malformed: ContractError)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: not found")
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ContractError(f"{path}: not valid JSON ({e})") from e


def config_hash(config_dict: dict) -> str:
    """Hash of the architecture-defining part of a target config (stable across save location and dtype)."""
    def clean(d):
        if isinstance(d, dict):
            return {k: clean(v) for k, v in d.items() if k not in _VOLATILE_CONFIG_KEYS}
        return d
    return sha256_bytes(canonical_json(clean(config_dict)))


@dataclass
class TargetInfo:
    """What a stage needs to know about the target, as recorded in every artefact."""
    path: str
    architecture: str
    num_hidden_layers: int
    hidden_size: int
    vocab_size: int
    config_sha256: str
    model_type: str = ""
    # target/fingerprint.py: "<method>:<sha256>" of the weight files; "" in artefacts written before it was recorded
    # (they then match no target: re-make them). `revision`: the hub snapshot it came from, provenance only.
    weights_sha256: str = ""
    revision: str = ""


@dataclass
class TokenizerInfo:
    sha256: str
    chat_template_sha256: str
    # The tokenizer class the target ships as code and the dump ran (--trust-remote-code), e.g. Kimi-K2.5's
    # tokenization_kimi.TikTokenTokenizer; None when transformers loaded the tokenizer by itself.
    remote_code: str | None = None


@dataclass
class CaptureSpec:
    """The contract itself: the HF indices of the residual-stream states the drafter consumes, ascending."""
    hidden_state_indices: list[int]
    convention: str = HF_INDEX_CONVENTION

    def keys(self) -> list[str]:
        return [hidden_state_key(k) for k in self.hidden_state_indices]


@dataclass
class ShardRecord:
    file: str
    samples: int
    tokens: int
    bytes: int
    sha256: str


@dataclass
class DumpManifest:
    target: TargetInfo
    capture: CaptureSpec
    tokenizer: TokenizerInfo
    dtype: str
    max_length: int | None
    tp_size: int
    dp_size: int
    shards: list[ShardRecord] = field(default_factory=list)
    skipped: dict[str, int] = field(default_factory=dict)
    data_files: list[str] = field(default_factory=list)
    # Data files written by `eagle3 regenerate`: file, sha256, and who wrote them (backend, model, sampling,
    # target identity). Provenance only: not part of identity(), so such dumps mix with others.
    data_sources: list[dict] = field(default_factory=list)
    # What the dump read (see data_fingerprint): {"sha256", "files": [{"file", "sha256", "first_sample_index"}]}.
    # Not part of identity() either: dumps of different data mix; {} in dumps made before it was recorded.
    data_fingerprint: dict = field(default_factory=dict)
    format: str = DUMP_FORMAT
    format_version: int = DUMP_FORMAT_VERSION
    # STORAGES: how the states are stored ("dtype": in `dtype`; "fp8": e4m3 + per-token scales, read back in
    # `dtype`). Manifests written before it existed are "dtype".
    storage: str = STORAGE_DTYPE

    def __post_init__(self):
        if self.storage in DUMP_FORMAT_VERSIONS:  # from_dict names an unknown storage itself
            self.format_version = DUMP_FORMAT_VERSIONS[self.storage]

    @property
    def totals(self) -> dict:
        return {"shards": len(self.shards), "samples": sum(s.samples for s in self.shards),
                "tokens": sum(s.tokens for s in self.shards), "bytes": sum(s.bytes for s in self.shards),
                "skipped": sum(self.skipped.values())}

    def to_dict(self) -> dict:
        d = asdict(self)
        d["totals"] = self.totals
        return d

    @classmethod
    def from_dict(cls, d: dict, source: str = "manifest") -> "DumpManifest":
        if d.get("format") != DUMP_FORMAT:
            raise ContractError(f"{source}: not an {DUMP_FORMAT} manifest (format={d.get('format')!r})")
        known = sorted(set(DUMP_FORMAT_VERSIONS.values()))
        if d.get("format_version") not in known:
            raise ContractError(f"{source}: dump format version {d.get('format_version')} is not supported "
                                f"(this eagle3 reads versions {known})")
        try:
            m = cls(target=TargetInfo(**d["target"]), capture=CaptureSpec(**d["capture"]),
                    tokenizer=TokenizerInfo(**d["tokenizer"]), dtype=d["dtype"], max_length=d["max_length"],
                    tp_size=d["tp_size"], dp_size=d["dp_size"], shards=[ShardRecord(**s) for s in d["shards"]],
                    skipped=d.get("skipped", {}), data_files=d.get("data_files", []),
                    data_sources=d.get("data_sources", []), data_fingerprint=d.get("data_fingerprint", {}),
                    storage=d.get("storage", STORAGE_DTYPE))
        except (KeyError, TypeError) as e:
            raise ContractError(f"{source}: malformed manifest ({e})") from e
        if m.storage not in STORAGES:
            raise ContractError(f"{source}: storage {m.storage!r} is not one this eagle3 reads {STORAGES}")
        if d["format_version"] != m.format_version:
            raise ContractError(f"{source}: format version {d['format_version']} with storage {m.storage!r} "
                                f"(that storage is written as version {m.format_version}): a malformed manifest")
        def typed(where, value, types, optional=False):
            if (value is None and optional) or (isinstance(value, types) and not isinstance(value, bool)):
                return
            raise ContractError(f"{source}: {where} is {value!r}, expected "
                                f"{' or '.join(t.__name__ for t in types)}{' or null' if optional else ''}")
        for i, sh in enumerate(m.shards):
            typed(f"shards[{i}].file", sh.file, (str,))
            typed(f"shards[{i}].sha256", sh.sha256, (str,))
            for k in ("samples", "tokens", "bytes"):
                typed(f"shards[{i}].{k}", getattr(sh, k), (int,))
        for k in ("tp_size", "dp_size"):
            typed(k, getattr(m, k), (int,))
        typed("max_length", m.max_length, (int,), optional=True)
        typed("dtype", m.dtype, (str,))
        for k in ("num_hidden_layers", "hidden_size", "vocab_size"):
            typed(f"target.{k}", getattr(m.target, k), (int,))
        for k in ("config_sha256", "architecture", "weights_sha256"):
            typed(f"target.{k}", getattr(m.target, k), (str,))
        if not isinstance(m.capture.hidden_state_indices, list) or not all(
                isinstance(k, int) and not isinstance(k, bool) for k in m.capture.hidden_state_indices):
            raise ContractError(f"{source}: capture.hidden_state_indices {m.capture.hidden_state_indices!r} is not a "
                                "list of integers")
        for sh in m.shards:  # shards live in the dump directory itself: nothing is read from elsewhere
            if not isinstance(sh.file, str) or sh.file in ("", ".", "..") or "/" in sh.file or "\\" in sh.file:
                raise ContractError(f"{source}: shard file {sh.file!r} is not a file name inside the dump directory")
        if "totals" in d and d["totals"] != m.totals:
            diff = {k: (d["totals"].get(k) if isinstance(d["totals"], dict) else None, v)
                    for k, v in m.totals.items()
                    if not isinstance(d["totals"], dict) or d["totals"].get(k) != v}
            raise ContractError(f"{source}: its totals disagree with its shard list (recorded, counted): {diff}; "
                                "shards were removed from or added to the list")
        validate_indices(m.capture.hidden_state_indices, m.target.num_hidden_layers)
        if m.capture.hidden_state_indices != sorted(m.capture.hidden_state_indices):
            raise ContractError(f"{source}: capture indices are not ascending: {m.capture.hidden_state_indices}")
        return m

    def identity(self) -> dict:
        """What two dumps must share to be mixed, and a run resumed into the same OUT must match."""
        return {**target_identity(self.target, self.tokenizer),
                "capture.hidden_state_indices": list(self.capture.hidden_state_indices)}


def target_identity(target: TargetInfo, tokenizer: TokenizerInfo | None = None) -> dict:
    """The target's part of DumpManifest.identity() (the keys a manifest, run or export records): what stages
    compare with what they were made from."""
    ident = {"target.config_sha256": target.config_sha256, "target.weights_sha256": target.weights_sha256,
             "target.architecture": target.architecture, "target.hidden_size": target.hidden_size,
             "target.vocab_size": target.vocab_size}
    if tokenizer is not None:
        ident.update({"tokenizer.sha256": tokenizer.sha256,
                      "tokenizer.chat_template_sha256": tokenizer.chat_template_sha256})
    return ident


MANIFEST_FILE = "manifest.json"

# ------------------------------------------------------------------------------------ what a shard says it is
#
# Each shard carries its own identity in its safetensors metadata (one JSON string under SHARD_METADATA_KEY), so
# a shard can be checked against the run resuming into its directory and against the manifest that lists it,
# without trusting either. Shards written before these keys existed hold only the LEGACY_SHARD_KEYS.

SHARD_METADATA_KEY = "eagle3"
LEGACY_SHARD_KEYS = ("format", "format_version", "hidden_state_indices", "target_config_sha256")
DATA_SHA256 = "data.sha256"   # data_fingerprint()["sha256"] of the dump's input
PLAN_SHA256 = "plan.sha256"   # the shard plan (which samples in which shard): same data + arguments
SHARD_INDEX = "shard"         # j of shard-<j>
STORAGE = "storage"           # STORAGES; shards written before it existed lack the key and are "dtype"


def data_fingerprint(files: Sequence[tuple[str, str, int | None]]) -> dict:
    """(path, sha256, first sample_index or None when never read) per data file, in --data order -> the
    manifest's data_fingerprint. Its sha256 ignores paths: the same bytes moved elsewhere are the same data.
    A sample's identity across dumps is (its file's sha256, sample_index - that file's first_sample_index)."""
    rows = [{"file": f, "sha256": h, "first_sample_index": k} for f, h, k in files]
    return {"sha256": sha256_bytes(canonical_json([[r["sha256"], r["first_sample_index"]] for r in rows])),
            "files": rows}


def shard_identity(manifest: "DumpManifest", plan_sha256: str | None = None) -> dict:
    """The metadata every shard of this dump must carry (less SHARD_INDEX, which differs per shard). Without
    plan_sha256 (a reader: the manifest does not record the plan) that key is left out."""
    ident = {"format": DUMP_FORMAT, "format_version": manifest.format_version,
             "hidden_state_indices": list(manifest.capture.hidden_state_indices),
             "target_config_sha256": manifest.target.config_sha256, **manifest.identity(),
             "dtype": manifest.dtype, STORAGE: manifest.storage,
             DATA_SHA256: manifest.data_fingerprint.get("sha256")}
    if plan_sha256 is not None:
        ident[PLAN_SHA256] = plan_sha256
    return ident


def is_legacy_shard(meta: dict) -> bool:
    """A shard written before shards carried their own identity (only LEGACY_SHARD_KEYS)."""
    return DATA_SHA256 not in meta


def check_shard_identity(meta: dict, expected: dict, shard: str, expected_from: str) -> None:
    """ContractError naming every key of `expected` that the shard's metadata does not match. A shard without a
    storage key predates it, and stored its states in its dtype."""
    got = {k: meta.get(k, STORAGE_DTYPE if k == STORAGE else None) for k in expected}
    require_same_capture(got, expected, shard, expected_from)


def load_manifest(dump_dir: str) -> DumpManifest:
    """The manifest of a finished dump directory (validated), or a clear error."""
    import os
    path = os.path.join(dump_dir, MANIFEST_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{dump_dir}: no {MANIFEST_FILE} (not a finished eagle3 dump)")
    try:
        with open(path) as f:
            d = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ContractError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(d, dict):
        raise ContractError(f"{path}: not a manifest (a JSON {type(d).__name__}, not an object)")
    m = DumpManifest.from_dict(d, source=path)
    import re
    listed = {sh.file for sh in m.shards}
    unlisted = sorted(f for f in os.listdir(dump_dir) if re.fullmatch(r"shard-\d{5}\.safetensors", f) and f not in listed)
    if unlisted:
        raise ContractError(f"{path}: the directory holds shards its manifest does not list ({', '.join(unlisted[:4])}"
                            f"{' ...' if len(unlisted) > 4 else ''}): a manifest cut short, or shards of another dump")
    return m


def method_of(weights_sha256: str) -> str:
    """The digest method of a recorded weights_sha256 ("<method>:<sha256>", target/fingerprint.py): two digests
    compare only when taken by the same method."""
    return weights_sha256.split(":")[0]


def require_same_capture(a: dict, b: dict, what_a: str, what_b: str) -> None:
    """Compare two identity dicts (see DumpManifest.identity) and fail loudly, naming every difference."""
    diffs = [f"  {k}: {a.get(k)!r} ({what_a}) != {b.get(k)!r} ({what_b})"
             for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    if any(k.endswith("weights_sha256") and not (a.get(k) and b.get(k)) for k in set(a) | set(b)
           if a.get(k) != b.get(k)):
        diffs.append("  (an empty weights_sha256: written before eagle3 made a target's weights part of its "
                     "identity, or by a --server regeneration whose --target copy held no weights; what it was made "
                     "from cannot be checked: make it again with this eagle3 and the target's weights)")
    elif any(k.endswith("weights_sha256") and a.get(k) and b.get(k) and method_of(a[k]) != method_of(b[k])
             for k in set(a) | set(b)):
        diffs.append("  (the two weights digests were taken by different methods, sampled and full: give the "
                     "same --full-weights-digest choice to both)")
    if diffs:
        raise ContractError(f"capture contract mismatch between {what_a} and {what_b}:\n" + "\n".join(diffs))


def describe(indices: Sequence[int]) -> str:
    return ", ".join(f"HF {k} (output of layer {layer_for_index(k)})" for k in indices)
