"""The capture contract: which hidden states a drafter is trained on, named ONE way, checked at every stage.

A drafter trained on one set of hidden states and served with another silently loses acceptance. So the
indices live here and nowhere else, every artefact (dump manifest, checkpoint, export) records them, and every
stage boundary calls `require_same_capture` / `validate_indices` from this module.

Naming: the HF index k = `model(..., output_hidden_states=True).hidden_states[k]`. k = 0 is the embedding output,
k = i + 1 is the output of decoder layer i (the full, un-normalised residual stream), k = L is the post-final-norm
state. A drafter may capture 0 < k < L: SGLang captures neither the embedding nor the last layer's output.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Sequence

DUMP_FORMAT = "eagle3-dump"
DUMP_FORMAT_VERSION = 1
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
HIDDEN_PREFIX = "hidden_states."


class ContractError(ValueError):
    """Two artefacts disagree about what was captured, or indices break the contract. Always fatal."""


def hidden_state_key(k: int) -> str:
    return f"{HIDDEN_PREFIX}{k}"


def default_capture_indices(num_layers: int) -> list[int]:
    """Outputs of decoder layers (2, L//2, L-3), i.e. HF indices (3, L//2 + 1, L - 2) -- Kimi-K2.5 (L=61): [3, 31, 59]."""
    return sorted({3, num_layers // 2 + 1, num_layers - 2})


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


@dataclass
class TokenizerInfo:
    sha256: str
    chat_template_sha256: str


@dataclass
class CaptureSpec:
    """The contract itself: the HF indices of the residual-stream states the drafter consumes, ascending."""
    hidden_state_indices: list[int]
    convention: str = "hf_hidden_states_index"

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
        if d.get("format_version") != DUMP_FORMAT_VERSION:
            raise ContractError(f"{source}: dump format version {d.get('format_version')} is not supported "
                                f"(this eagle3 reads version {DUMP_FORMAT_VERSION})")
        try:
            m = cls(target=TargetInfo(**d["target"]), capture=CaptureSpec(**d["capture"]),
                    tokenizer=TokenizerInfo(**d["tokenizer"]), dtype=d["dtype"], max_length=d["max_length"],
                    tp_size=d["tp_size"], dp_size=d["dp_size"], shards=[ShardRecord(**s) for s in d["shards"]],
                    skipped=d.get("skipped", {}), data_files=d.get("data_files", []),
                    data_sources=d.get("data_sources", []), data_fingerprint=d.get("data_fingerprint", {}))
        except (KeyError, TypeError) as e:
            raise ContractError(f"{source}: malformed manifest ({e})") from e
        validate_indices(m.capture.hidden_state_indices, m.target.num_hidden_layers)
        if m.capture.hidden_state_indices != sorted(m.capture.hidden_state_indices):
            raise ContractError(f"{source}: capture indices are not ascending: {m.capture.hidden_state_indices}")
        return m

    def identity(self) -> dict:
        """What two dumps must share to be mixed, and a run resumed into the same OUT must match."""
        return {"target.config_sha256": self.target.config_sha256,
                "target.architecture": self.target.architecture,
                "target.hidden_size": self.target.hidden_size,
                "target.vocab_size": self.target.vocab_size,
                "capture.hidden_state_indices": list(self.capture.hidden_state_indices),
                "tokenizer.sha256": self.tokenizer.sha256,
                "tokenizer.chat_template_sha256": self.tokenizer.chat_template_sha256}


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
    ident = {"format": DUMP_FORMAT, "format_version": DUMP_FORMAT_VERSION,
             "hidden_state_indices": list(manifest.capture.hidden_state_indices),
             "target_config_sha256": manifest.target.config_sha256, **manifest.identity(),
             "dtype": manifest.dtype, DATA_SHA256: manifest.data_fingerprint.get("sha256")}
    if plan_sha256 is not None:
        ident[PLAN_SHA256] = plan_sha256
    return ident


def is_legacy_shard(meta: dict) -> bool:
    """A shard written before shards carried their own identity (only LEGACY_SHARD_KEYS)."""
    return DATA_SHA256 not in meta


def check_shard_identity(meta: dict, expected: dict, shard: str, expected_from: str) -> None:
    """ContractError naming every key of `expected` that the shard's metadata does not match."""
    require_same_capture({k: meta.get(k) for k in expected}, expected, shard, expected_from)


def load_manifest(dump_dir: str) -> DumpManifest:
    """The manifest of a finished dump directory (validated), or a clear error."""
    import os
    path = os.path.join(dump_dir, MANIFEST_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{dump_dir}: no {MANIFEST_FILE} (not a finished eagle3 dump)")
    try:
        with open(path) as f:
            d = json.load(f)
    except json.JSONDecodeError as e:
        raise ContractError(f"{path}: not valid JSON ({e})") from e
    return DumpManifest.from_dict(d, source=path)


def require_same_capture(a: dict, b: dict, what_a: str, what_b: str) -> None:
    """Compare two identity dicts (see DumpManifest.identity) and fail loudly, naming every difference."""
    diffs = [f"  {k}: {a.get(k)!r} ({what_a}) != {b.get(k)!r} ({what_b})"
             for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    if diffs:
        raise ContractError(f"capture contract mismatch between {what_a} and {what_b}:\n" + "\n".join(diffs))


def describe(indices: Sequence[int]) -> str:
    return ", ".join(f"HF {k} (output of layer {k - 1})" for k in indices)


# ============================================================================================ serving rules
#
# How a serving engine turns the draft config's `eagle_config.eagle_aux_hidden_state_layer_ids` into the hidden
# states it captures (docs/contract.md §7). ONE table, here; the exporter computes ids with it, the eval stage
# computes what a server will capture with it. A "capture index" c is what ends up in SGLang's
# `layers_to_capture`: the residual stream entering decoder layer c, i.e. HF index c. SGLang appends the captured
# states in layer-loop order, so the concatenation order is ascending capture index whatever the id order.

SGLANG_OLDEST = "0.4.9"
SGLANG_LATEST = "0.5.23"

# Every SGLang release on PyPI from SGLANG_OLDEST to SGLANG_LATEST (the list `pip index versions sglang` gives);
# a version string outside it is refused rather than guessed.
SGLANG_RELEASES: tuple[str, ...] = (
    "0.4.9", "0.4.9.post1", "0.4.9.post2", "0.4.9.post3", "0.4.9.post4", "0.4.9.post5", "0.4.9.post6",
    "0.4.10", "0.4.10.post1", "0.4.10.post2",
    "0.5.1", "0.5.1.post1", "0.5.1.post2", "0.5.1.post3", "0.5.2",
    "0.5.3", "0.5.3.post1", "0.5.3.post2", "0.5.3.post3",
    "0.5.4", "0.5.4.post1", "0.5.4.post2", "0.5.4.post3",
    "0.5.5", "0.5.5.post1", "0.5.5.post2", "0.5.5.post3",
    "0.5.6", "0.5.6.post1", "0.5.6.post2", "0.5.7", "0.5.8", "0.5.8.post1", "0.5.9",
    "0.5.10", "0.5.10.post1", "0.5.11", "0.5.12", "0.5.12.post1",
    "0.5.13", "0.5.13.post1", "0.5.14", "0.5.15", "0.5.15.post1", "0.5.16", "0.5.17", "0.5.18", "0.5.19",
    "0.5.20", "0.5.21", "0.5.22", "0.5.23",
)

# Rules (what a release does with ids -> capture indices c):
RULE_UNSUPPORTED = "unsupported"              # the target's model file has no EAGLE-3 hook: refuse
RULE_PLUS_ONE = "id+1"                        # c = id + 1
RULE_PLUS_ONE_IF_FIRST_IS_1 = "id+1 if ids[0]==1 else id"   # deepseek_v2.py from 0.5.13 (ids[0]: the list as given)
RULE_AS_IS_IF_MAX_IS_L = "id if max(ids)==L else id+1"      # gpt_oss.py from 0.5.17

# family -> [(first_release, last_release, rule)], both ends inclusive, covering SGLANG_OLDEST..SGLANG_LATEST.
SGLANG_RULES: dict[str, list[tuple[str, str, str]]] = {
    # llama.py, qwen2.py, qwen3.py, qwen3_moe.py
    "llama": [("0.4.9", "0.5.23", RULE_PLUS_ONE)],
    # deepseek_v2.py: DeepSeek-V2/V3, Kimi-K2 (AttributeError on EAGLE-3 before 0.5.4.post2)
    "deepseek_v2": [("0.4.9", "0.5.4.post1", RULE_UNSUPPORTED),
                    ("0.5.4.post2", "0.5.12.post1", RULE_PLUS_ONE),
                    ("0.5.13", "0.5.23", RULE_PLUS_ONE_IF_FIRST_IS_1)],
    # kimi_k25.py: no EAGLE-3 before 0.5.10; from 0.5.10 it delegates to deepseek_v2.py (same rows as above)
    "kimi_k25": [("0.4.9", "0.5.9", RULE_UNSUPPORTED),
                 ("0.5.10", "0.5.12.post1", RULE_PLUS_ONE),
                 ("0.5.13", "0.5.23", RULE_PLUS_ONE_IF_FIRST_IS_1)],
    # gpt_oss.py: EAGLE-3 from 0.5.17
    "gpt_oss": [("0.4.9", "0.5.16", RULE_UNSUPPORTED),
                ("0.5.17", "0.5.23", RULE_AS_IS_IF_MAX_IS_L)],
}

SGLANG_MODEL_FILES = {"llama": "llama.py / qwen2.py / qwen3.py / qwen3_moe.py", "deepseek_v2": "deepseek_v2.py",
                      "kimi_k25": "kimi_k25.py (-> deepseek_v2.py)", "gpt_oss": "gpt_oss.py"}

# transformers model_type of the target -> rule family
SERVING_FAMILIES: dict[str, str] = {
    "llama": "llama", "qwen2": "llama", "qwen3": "llama", "qwen3_moe": "llama",
    "deepseek_v2": "deepseek_v2", "deepseek_v3": "deepseek_v2", "kimi_k2": "deepseek_v2",
    "kimi_k25": "kimi_k25",
    "gpt_oss": "gpt_oss",
}

SGLANG_EXACTLY_3_AUX_UNTIL = "0.5.11"           # releases <= this need exactly 3 aux ids (and 1 draft layer)
SGLANG_CUDA_GRAPH_DEFAULT_UNTIL = "0.5.10.post1"  # releases <= this capture the DEFAULT set under CUDA graphs

_RELEASE_RE = re.compile(r"^v?(\d+)\.(\d+)\.(\d+)(?:\.?post(\d+))?(?:\+[0-9A-Za-z.]+)?$")


class Release(tuple):
    """A parsed SGLang release 'X.Y.Z[.postN]' that orders like PEP 440 (0.5.4 < 0.5.4.post1 < 0.5.5)."""

    def __new__(cls, text: str):
        m = _RELEASE_RE.match(str(text).strip())
        if not m:
            raise ContractError(f"SGLang release {text!r} not understood: expected 'X.Y.Z' or 'X.Y.Z.postN' "
                                f"(e.g. 0.5.4.post1, {SGLANG_LATEST})")
        post = -1 if m.group(4) is None else int(m.group(4))
        return super().__new__(cls, (int(m.group(1)), int(m.group(2)), int(m.group(3)), post))

    def __str__(self) -> str:
        base = f"{self[0]}.{self[1]}.{self[2]}"
        return base if self[3] < 0 else f"{base}.post{self[3]}"

    def __repr__(self) -> str:
        return f"Release({str(self)!r})"


def parse_release(text: str | Release) -> Release:
    return text if isinstance(text, Release) else _parse_release_cached(str(text))


@functools.lru_cache(maxsize=512)
def _parse_release_cached(text: str) -> Release:
    return Release(text)


def compare_releases(a: str, b: str) -> int:
    """-1, 0 or 1 as release a is older than, the same as, or newer than b."""
    ra, rb = parse_release(a), parse_release(b)
    return (ra > rb) - (ra < rb)


def check_release(release: str | Release) -> Release:
    """The parsed release, or ContractError when these rules do not know it."""
    r = parse_release(release)
    if r < parse_release(SGLANG_OLDEST) or r > parse_release(SGLANG_LATEST):
        newer = r > parse_release(SGLANG_LATEST)
        raise ContractError(
            f"SGLang {r} is outside the releases whose capture rules are known ({SGLANG_OLDEST} - {SGLANG_LATEST})"
            + ("; a newer release may have changed how eagle_aux_hidden_state_layer_ids map to captured layers: "
               "read set_eagle3_layers_to_capture in sglang/srt/models/ of that release and extend "
               "eagle3.contract.SGLANG_RULES" if newer else "; EAGLE-3 export targets SGLang >= " + SGLANG_OLDEST))
    if str(r) not in SGLANG_RELEASES:
        raise ContractError(f"SGLang {r} is not a published release (known {SGLANG_OLDEST} - {SGLANG_LATEST}; "
                            f"nearby: {', '.join(x for x in SGLANG_RELEASES if parse_release(x)[:3] == r[:3])})")
    return r


def serving_family(model_type: str) -> str:
    """The SGLang rule family of a target's transformers model_type (see SERVING_FAMILIES)."""
    fam = SERVING_FAMILIES.get(model_type or "")
    if fam is None:
        raise ContractError(f"target model_type {model_type!r} has no known SGLang EAGLE-3 capture rule "
                            f"(known: {', '.join(sorted(SERVING_FAMILIES))}); add it to "
                            "eagle3.contract.SERVING_FAMILIES once its set_eagle3_layers_to_capture is read")
    return fam


def sglang_rule(family: str, release: str | Release) -> str:
    """The row of SGLANG_RULES that applies to `family` at `release`."""
    r = check_release(release)
    if family not in SGLANG_RULES:
        raise ContractError(f"no SGLang rules for family {family!r}")
    for first, last, rule in SGLANG_RULES[family]:
        if parse_release(first) <= r <= parse_release(last):
            return rule
    raise ContractError(f"SGLANG_RULES[{family!r}] does not cover release {r}")  # the table has a hole


def supported_ranges(family: str) -> str:
    """The releases (merged into ranges) in which `family` has EAGLE-3 support at all."""
    rels = [r for r in SGLANG_RELEASES if sglang_rule(family, r) != RULE_UNSUPPORTED]
    return _fmt_ranges(_ranges(rels)) or "none"


def sglang_default_capture(num_layers: int) -> list[int]:
    """What SGLang captures when the draft config has no ids (and, <= 0.5.10.post1, under CUDA graphs):
    layers_to_capture = [2, L//2, L-3] (capture index = HF index). NOT the dump default (3, L//2+1, L-2)."""
    return [2, num_layers // 2, num_layers - 3]


def _check_int_list(ids, what: str) -> list[int]:
    ids = list(ids)
    if any(not isinstance(k, int) or isinstance(k, bool) for k in ids):
        raise ContractError(f"{what} must be integers, got {ids!r}")
    return ids


def sglang_capture_indices(ids: Sequence[int] | None, model_type: str, release: str, num_layers: int) -> list[int]:
    """The FORWARD rule: the HF indices (ascending, = concatenation order) that SGLang `release` captures for a
    target of `model_type` with `num_layers` decoder layers, given the draft config's
    eagle_aux_hidden_state_layer_ids (`None`: the key is absent). ContractError when that server would refuse,
    crash, or capture something a drafter cannot have been trained on."""
    family = serving_family(model_type)
    r = check_release(release)
    rule = sglang_rule(family, r)
    L = int(num_layers)
    if rule == RULE_UNSUPPORTED:
        raise ContractError(f"SGLang {r} has no EAGLE-3 support for {model_type} targets "
                            f"({SGLANG_MODEL_FILES[family]}); supported in SGLang {supported_ranges(family)}")
    if ids is None:
        raw = sglang_default_capture(L)
    else:
        ids = _check_int_list(ids, "eagle_aux_hidden_state_layer_ids")
        if not ids:
            raise ContractError("eagle_aux_hidden_state_layer_ids is empty: SGLang would capture nothing")
        if r <= parse_release(SGLANG_EXACTLY_3_AUX_UNTIL) and len(ids) != 3:
            raise ContractError(f"SGLang {r} (<= {SGLANG_EXACTLY_3_AUX_UNTIL}) needs exactly 3 aux hidden-state "
                                f"ids, got {len(ids)}: {ids}")
        if rule == RULE_PLUS_ONE:
            raw = [k + 1 for k in ids]
        elif rule == RULE_PLUS_ONE_IF_FIRST_IS_1:
            raw = [k + 1 for k in ids] if ids[0] == 1 else list(ids)
        elif rule == RULE_AS_IS_IF_MAX_IS_L:
            raw = list(ids) if max(ids) == L else [k + 1 for k in ids]
        else:  # pragma: no cover - a new rule name without an implementation
            raise ContractError(f"unknown rule {rule!r}")
    where = f"SGLang {r}, {model_type} target with {L} layers, ids {ids if ids is not None else '(absent)'}"
    if len(set(raw)) != len(raw):
        raise ContractError(f"{where}: capture indices {raw} repeat, so fewer states than the drafter's fc expects "
                            "would be captured")
    if any(c == 0 for c in raw):
        raise ContractError(f"{where}: capture index 0 (the embedding output) crashes older releases and is never "
                            "a valid EAGLE-3 input")
    if any(c < 0 for c in raw):
        raise ContractError(f"{where}: negative capture index in {raw}")
    if any(c >= L for c in raw):
        raise ContractError(f"{where}: capture index {max(raw)} >= L={L}: SGLang's layer loop ends before it, so "
                            "that state is never captured")
    return sorted(raw)


def _try_forward(ids, family_model_type: str, release: str, num_layers: int) -> list[int] | None:
    try:
        return sglang_capture_indices(ids, family_model_type, release, num_layers)
    except ContractError:
        return None


def _ranges(releases: list[str]) -> list[tuple[str, str]]:
    """Group releases (a subset of SGLANG_RELEASES) into maximal runs of consecutive known releases."""
    pos = {r: i for i, r in enumerate(SGLANG_RELEASES)}
    out: list[list[str]] = []
    for r in sorted(releases, key=pos.__getitem__):
        if out and pos[r] == pos[out[-1][1]] + 1:
            out[-1][1] = r
        else:
            out.append([r, r])
    return [(a, b) for a, b in out]


def _fmt_ranges(rs: list[tuple[str, str]]) -> str:
    return ", ".join(a if a == b else f"{a} - {b}" for a, b in rs)


def _sglang_candidates(capture: list[int]) -> list[list[int]]:
    # Every rule shifts all ids alike by 0 or +1, so these are the only lists that can reproduce `capture`
    # (ascending: the exporter never relies on the order quirk of ids[0]).
    cands = [[c - 1 for c in capture], list(capture)]
    return [c for i, c in enumerate(cands) if min(c) >= 0 and c not in cands[:i]]


def sglang_reproducible_in(capture: Sequence[int], model_type: str, num_layers: int) -> list[tuple[str, str, list[int]]]:
    """[(first, last, ids)]: the release ranges in which some ascending id list reproduces `capture`, and that list."""
    capture = validate_indices(capture, num_layers)
    out: list[tuple[str, str, list[int]]] = []
    by_ids: dict[tuple, list[str]] = {}
    for rel in SGLANG_RELEASES:
        for ids in _sglang_candidates(capture):
            if _try_forward(ids, model_type, rel, num_layers) == capture:
                by_ids.setdefault(tuple(ids), []).append(rel)
                break
    for ids, rels in by_ids.items():
        out += [(a, b, list(ids)) for a, b in _ranges(rels)]
    return sorted(out, key=lambda t: SGLANG_RELEASES.index(t[0]))


def sglang_ids_for(capture: Sequence[int], model_type: str, release: str, num_layers: int) -> list[int]:
    """The INVERSE rule: the ids (ascending) to write into eagle_aux_hidden_state_layer_ids so that SGLang
    `release` captures exactly `capture` (HF indices). Among the lists that work there, the one that also works in
    the most known releases wins (HF [2, 30, 58] on deepseek -> [1, 29, 57], right in every release). Verified by
    the forward rule; ContractError naming the releases where `capture` IS reproducible when none works."""
    capture = validate_indices(capture, num_layers)
    r = check_release(release)
    family = serving_family(model_type)
    if sglang_rule(family, r) == RULE_UNSUPPORTED:
        sglang_capture_indices(capture, model_type, r, num_layers)  # raises the "no EAGLE-3 support" message
    if r <= parse_release(SGLANG_EXACTLY_3_AUX_UNTIL) and len(capture) != 3:
        raise ContractError(f"SGLang {r} (<= {SGLANG_EXACTLY_3_AUX_UNTIL}) serves exactly 3 aux hidden states; "
                            f"the drafter was trained on {len(capture)} ({capture}); SGLang >= 0.5.12 is needed")
    working = [ids for ids in _sglang_candidates(capture) if _try_forward(ids, model_type, r, num_layers) == capture]
    if not working:
        where = sglang_reproducible_in(capture, model_type, num_layers)
        hint = ("; ".join(f"SGLang {a if a == b else f'{a} - {b}'} with ids {ids}" for a, b, ids in where)
                or "no known release")
        raise ContractError(
            f"no eagle_aux_hidden_state_layer_ids make SGLang {r} capture HF {capture} on a {model_type} target "
            f"({SGLANG_MODEL_FILES[family]}: rule '{sglang_rule(family, r)}'). This capture set is reproducible in: "
            f"{hint}. Target one of those releases, or retrain on a capture set this release can serve")

    def reach(ids):
        return sum(_try_forward(ids, model_type, rel, num_layers) == capture for rel in SGLANG_RELEASES)

    best = max(working, key=reach)  # ties: the first candidate (ids = capture - 1)
    if sglang_capture_indices(best, model_type, r, num_layers) != capture:  # verify, always
        raise ContractError(f"internal: ids {best} do not reproduce {capture} in SGLang {r}")
    return best


def needs_disable_cuda_graph(capture: Sequence[int], release: str, num_layers: int) -> bool:
    """True when SGLang `release` would capture the DEFAULT set [2, L//2, L-3] in its CUDA-graph passes while the
    drafter was trained on another `capture` (releases <= 0.5.10.post1): serve with --disable-cuda-graph."""
    r = check_release(release)
    return (r <= parse_release(SGLANG_CUDA_GRAPH_DEFAULT_UNTIL)
            and sorted(capture) != sorted(sglang_default_capture(num_layers)))


def vllm_capture_indices(ids: Sequence[int] | None, num_layers: int | None = None) -> list[int]:
    """vLLM reads eagle_aux_hidden_state_layer_ids as HF indices directly (no +1). Absent: its default
    (2, L//2, L-3), which needs num_layers."""
    if ids is None:
        if num_layers is None:
            raise ContractError("vLLM: no eagle_aux_hidden_state_layer_ids and no num_layers for the default")
        ids = sglang_default_capture(num_layers)
    ids = _check_int_list(ids, "eagle_aux_hidden_state_layer_ids")
    if num_layers is not None:
        return validate_indices(ids, num_layers)
    if not ids or len(set(ids)) != len(ids) or min(ids) <= 0:
        raise ContractError(f"vLLM: invalid eagle_aux_hidden_state_layer_ids {ids}")
    return sorted(ids)


def vllm_ids_for(capture: Sequence[int], num_layers: int | None = None) -> list[int]:
    """The ids vLLM needs to capture `capture` (HF indices): the indices themselves. Not portable to SGLang."""
    return vllm_capture_indices(list(capture), num_layers)


def sglang_releases_reproducing(ids: Sequence[int] | None, capture: Sequence[int], model_type: str,
                                num_layers: int) -> list[tuple[str, str]]:
    """The known release ranges in which these exact ids make SGLang capture exactly `capture`."""
    capture = sorted(capture)
    rels = [r for r in SGLANG_RELEASES if _try_forward(ids, model_type, r, num_layers) == capture]
    return _ranges(rels)
