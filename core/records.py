"""The records that carry the capture contract past the dump: a training run's run.json, each checkpoint's
eagle3_checkpoint.json and an export's eagle3_provenance.json, beside `contract.DumpManifest`.

Each is a dataclass whose `to_dict()` is exactly what is on disk (same keys, same order), so runs and exports
written before these classes existed load unchanged; `from_dict(d, where)` checks every key a reader relies on
and raises ContractError naming the file and the key, instead of a KeyError deep inside the export. Keys this
eagle3 does not know are kept (`extra`) and written back, so a newer writer's records survive a round trip.

The file names of a run directory and of an export directory live here too: the trainer writes them, the export
and eval read them, and neither should import the other to learn a name.

So does what the dump reads of a regeneration (`eagle3 regenerate`, which runs before it): the target identity a
regenerate.json records and the check that the dump's own target wrote the data (`data_sources`), so that neither
stage imports the other.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Callable

from eagle3 import dist as D
from eagle3.contract import (HF_INDEX_CONVENTION, STANDARDIZE_VERSION, CaptureSpec, ContractError, TargetInfo,
                             TokenizerInfo, canonical_json, file_sha256, method_of, read_json, sha256_bytes)

# ------------------------------------------------------------------------------------------------ file names

# A training run directory (train/trainer.py writes it).
RUN_FILE = "run.json"
METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
VOCAB_FILE = "vocab.safetensors"
CHECKPOINTS_DIR = "checkpoints"
LATEST = "latest"                      # checkpoints/latest: the tag of the newest complete checkpoint
BEST_DIR = "best"                      # checkpoints/best: the best held-out decoding acceptance so far
CKPT_FILE = "eagle3_checkpoint.json"   # written last in a checkpoint: it is complete exactly when this exists
DRAFTER_WEIGHTS_FILE = "drafter.safetensors"

# An export directory (export/sglang.py writes it; what SGLang / vLLM load, plus our provenance).
EXPORT_CONFIG_FILE = "config.json"
EXPORT_WEIGHTS_FILE = "model.safetensors"
PROVENANCE_FILE = "eagle3_provenance.json"
EXPORT_FILES = (EXPORT_CONFIG_FILE, EXPORT_WEIGHTS_FILE, PROVENANCE_FILE)

# A regeneration's output directory (regenerate/ writes it): its record, which the dump finds beside the data.
REGENERATE_FILE = "regenerate.json"

RUN_FORMAT = "eagle3-run"
EXPORT_FORMAT = "eagle3-export"
EXPORT_FORMAT_VERSION = 1

# ------------------------------------------------------------------------------------------------ checking keys

_REQUIRED = object()
INTS = "list of integers"  # a type spec: a list whose items are all int (not bool)


def _type_ok(value: Any, types: tuple) -> bool:
    for t in types:
        if t is INTS:
            if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
                return True
        elif t is int:  # JSON true is not a step or a size
            if isinstance(value, int) and not isinstance(value, bool):
                return True
        elif t is None:
            if value is None:
                return True
        elif isinstance(value, t):
            return True
    return False


def _type_names(types: tuple) -> str:
    return " or ".join("null" if t is None else t if isinstance(t, str) else t.__name__ for t in types)


def _take(d: dict, spec: list[tuple], where: str, prefix: str = "") -> dict:
    """{key: value} for each (key, types, default) of `spec`: present and of one of `types`, or absent with a
    default (deep-copied: defaults are shared), else ContractError naming `where` and the key."""
    out = {}
    for key, types, default in spec:
        name = prefix + key
        if key not in d:
            if default is _REQUIRED:
                raise ContractError(f"{where}: lacks key {name!r}")
            out[key] = copy.deepcopy(default)
            continue
        if not _type_ok(d[key], types):
            raise ContractError(f"{where}: key {name!r} holds {type(d[key]).__name__} {d[key]!r:.80}, expected "
                                f"{_type_names(types)}")
        out[key] = d[key]
    return out


def _object(d: Any, where: str, name: str = "") -> dict:
    if not isinstance(d, dict):
        raise ContractError(f"{where}: {f'key {name!r}' if name else 'the record'} is not a JSON object")
    return d


def _extra(d: dict, known: list[str]) -> dict:
    return {k: v for k, v in d.items() if k not in known}


_TARGET = [("path", (str,), _REQUIRED), ("architecture", (str,), _REQUIRED), ("num_hidden_layers", (int,), _REQUIRED),
           ("hidden_size", (int,), _REQUIRED), ("vocab_size", (int,), _REQUIRED),
           ("config_sha256", (str,), _REQUIRED), ("model_type", (str,), ""), ("weights_sha256", (str,), ""),
           ("revision", (str,), "")]
_CAPTURE = [("hidden_state_indices", (INTS,), _REQUIRED), ("convention", (str,), HF_INDEX_CONVENTION)]


def _target(d: dict, where: str) -> TargetInfo:
    return TargetInfo(**_take(_object(d.get("target"), where, "target"), _TARGET, where, "target."))


def _capture(d: dict, where: str) -> CaptureSpec:
    return CaptureSpec(**_take(_object(d.get("capture"), where, "capture"), _CAPTURE, where, "capture."))


def _with_nested(d: dict, where: str, spec: list[tuple]) -> dict:
    """The top-level keys of `spec`, with target and capture (required in every record) as contract types."""
    if "target" not in d or "capture" not in d:
        raise ContractError(f"{where}: lacks key {'target' if 'target' not in d else 'capture'!r}")
    return {**_take(d, spec, where), "target": _target(d, where), "capture": _capture(d, where)}


def _capture_dict(c: CaptureSpec) -> dict:
    return {"hidden_state_indices": list(c.hidden_state_indices), "convention": c.convention}


# ------------------------------------------------------------------------------------------------ run.json

# run.json's keys in the order the trainer writes them, with their types and (optional keys) defaults.
_RUN = [("format", (str,), _REQUIRED), ("identity", (dict,), _REQUIRED), ("standardize", (str,), _REQUIRED),
        ("vocab", (str,), VOCAB_FILE), ("vocab_meta", (dict,), {}), ("vocab_sha256", (str, None), None),
        ("drafter", (dict,), _REQUIRED), ("train", (dict,), {}), ("world_size", (int, None), None),
        ("data_sha256", (str, None), None), ("dumps", (list,), []), ("resumes", (list,), [])]
_RUN_ORDER = ["format", "identity", "capture", "target", "standardize", "vocab", "vocab_meta", "vocab_sha256",
              "drafter", "train", "world_size", "data_sha256", "dumps", "resumes"]
MEANING_KEY = "eagle3_meaning_sha256"  # drafter.safetensors metadata: RunRecord.meaning_sha256() when it was saved


@dataclass(kw_only=True)
class RunRecord:
    """run.json: the capture contract of a training run, the data it was trained on (data_sha256), its draft
    vocabulary, drafter and training config, and what each resume changed."""
    identity: dict                 # DumpManifest.identity() of the dumps trained on
    capture: CaptureSpec
    target: TargetInfo
    standardize: str = STANDARDIZE_VERSION
    drafter: dict                  # DrafterConfig.to_dict()
    vocab: str = VOCAB_FILE
    vocab_meta: dict = field(default_factory=dict)
    vocab_sha256: str | None = None
    train: dict = field(default_factory=dict)  # TrainConfig.to_dict()
    world_size: int | None = None
    data_sha256: str | None = None
    dumps: list = field(default_factory=list)
    resumes: list = field(default_factory=list)
    format: str = RUN_FORMAT
    extra: dict = field(default_factory=dict)  # keys this eagle3 does not know, written back as they were

    def to_dict(self) -> dict:
        d = {k: copy.deepcopy(getattr(self, k)) for k in _RUN_ORDER}
        d["capture"], d["target"] = _capture_dict(self.capture), vars(self.target).copy()
        return {**d, **copy.deepcopy(self.extra)}

    def meaning_sha256(self) -> str:
        """sha256 of what a checkpoint's weights mean -- the identity and capture trained on, the target, the
        drafter's config and the standardize version -- stored in the weights file's own metadata when it is
        saved (MEANING_KEY), so that a record edited afterwards (other capture indices in run.json and
        eagle3_checkpoint.json, say) no longer matches the weights it describes."""
        return sha256_bytes(canonical_json({"identity": self.identity, "capture": _capture_dict(self.capture),
                                            "target": vars(self.target), "drafter": self.drafter,
                                            "standardize": self.standardize}))

    @staticmethod
    def _fields(d: dict, where: str) -> dict:
        _object(d, where)
        if d.get("format") != RUN_FORMAT:
            raise ContractError(f"{where}: not an eagle3 training run (format={d.get('format')!r})")
        return _with_nested(d, where, _RUN)

    @classmethod
    def from_dict(cls, d: dict, where: str = RUN_FILE) -> "RunRecord":
        return cls(**cls._fields(d, where), extra=_extra(d, _RUN_ORDER))

    @classmethod
    def read(cls, path: str) -> "RunRecord":
        return cls.from_dict(read_json(path), path)


# ------------------------------------------------------------------------------------------------ checkpoints

# A checkpoint's record is run.json's (as of that save) plus these, in this order.
_CKPT = [("step", (int,), _REQUIRED), ("tag", (str,), ""), ("weights", (str,), DRAFTER_WEIGHTS_FILE),
         ("best", (dict, None), None), ("sha256", (dict, None), None)]


@dataclass(kw_only=True)
class CheckpointRecord(RunRecord):
    """checkpoints/<tag>/eagle3_checkpoint.json: the run's record, the step, and the sha256 of every other file
    of the checkpoint (None only in checkpoints written before they were hashed: check_files refuses those).
    checkpoints/best's also holds `best`, the held-out record it was chosen by."""
    step: int
    tag: str = ""
    weights: str = DRAFTER_WEIGHTS_FILE
    best: dict | None = None
    sha256: dict | None = None

    @classmethod
    def of_run(cls, run: RunRecord, **kw) -> "CheckpointRecord":
        return cls(**{f.name: copy.deepcopy(getattr(run, f.name)) for f in fields(RunRecord)}, **kw)

    def to_dict(self) -> dict:
        d = {k: v for k, v in super().to_dict().items() if k not in self.extra}
        d.update((k, copy.deepcopy(getattr(self, k))) for k, _, _ in _CKPT
                 if getattr(self, k) is not None or k not in ("best", "sha256"))
        return {**d, **copy.deepcopy(self.extra)}

    @classmethod
    def from_dict(cls, d: dict, where: str = CKPT_FILE) -> "CheckpointRecord":
        known = _RUN_ORDER + [k for k, _, _ in _CKPT]
        return cls(**RunRecord._fields(d, where), **_take(d, _CKPT, where), extra=_extra(d, known))

    @classmethod
    def read(cls, path: str) -> "CheckpointRecord":
        return cls.from_dict(read_json(path), path)


def checkpoint_tag(step: int) -> str:
    """checkpoints/<tag> of a step: step00000200 (zero-padded, so tags sort as steps do)."""
    return f"step{step:08d}"


def find_checkpoint(run_dir: str, step: int | str | None = None) -> tuple[str, int]:
    """(checkpoint directory, step): the given step, 'best' (checkpoints/best), else the newest one holding the
    consolidated drafter."""
    root = os.path.join(run_dir, CHECKPOINTS_DIR)
    if not os.path.isdir(root):
        raise FileNotFoundError(f"{run_dir}: no {CHECKPOINTS_DIR}/ (not an eagle3 training run, or no checkpoint yet)")

    def complete(tag: str) -> bool:
        d = os.path.join(root, tag)
        return os.path.isfile(os.path.join(d, CKPT_FILE)) and os.path.isfile(os.path.join(d, DRAFTER_WEIGHTS_FILE))

    tags = sorted(t for t in os.listdir(root) if t.startswith("step") and t[4:].isdigit())
    if step == BEST_DIR:  # the trainer's checkpoints/best: best held-out decoding acceptance
        if not complete(BEST_DIR):
            raise FileNotFoundError(f"{run_dir}: no complete {CHECKPOINTS_DIR}/{BEST_DIR} (it is written at held-out "
                                    "evaluations; a run without a held-out split has none)")
        return os.path.join(root, BEST_DIR), CheckpointRecord.read(os.path.join(root, BEST_DIR, CKPT_FILE)).step
    if step is not None:
        tag = checkpoint_tag(int(step))
        if tag not in tags or not complete(tag):
            raise FileNotFoundError(f"{run_dir}: no complete checkpoint for step {step} (have: "
                                    f"{', '.join(str(int(t[4:])) for t in tags if complete(t)) or 'none'})")
        return os.path.join(root, tag), int(step)
    done = [t for t in tags if complete(t)]
    if not done:
        raise FileNotFoundError(f"{run_dir}: no checkpoint with {DRAFTER_WEIGHTS_FILE} and {CKPT_FILE}")
    if tags[-1] != done[-1]:
        print(f"[export] note: {tags[-1]} is incomplete (no {DRAFTER_WEIGHTS_FILE}/{CKPT_FILE}); using {done[-1]}",
              file=sys.stderr)
    return os.path.join(root, done[-1]), int(done[-1][4:])


# ------------------------------------------------------------------------------------------------ exports

# eagle3_provenance.json's keys in the order export_drafter writes them (target and capture aside).
_PROV = [("format", (str,), _REQUIRED), ("format_version", (int,), _REQUIRED), ("engine", (str,), _REQUIRED),
         ("sglang_release", (str, None), None), ("vllm_release", (str, None), None),
         ("serving_family", (str, None), None), ("architecture", (str, None), None), ("options", (list,), []),
         ("draft_kv_bytes_per_token", (int, None), None),
         ("eagle_aux_hidden_state_layer_ids", (INTS, None), None), ("served_capture_indices", (INTS, None), None),
         ("ids_reproduce_capture_in_sglang", (list, None), None), ("needs_disable_cuda_graph", (bool,), False),
         ("cuda_graph_default_capture", (INTS, None), None), ("server_command", (str,), ""),
         ("identity", (dict,), {}), ("run_dir", (str, None), None), ("step", (int, None), None),
         ("checkpoint", (str, None), None), ("standardize", (str, None), None), ("drafter", (dict,), {}),
         ("vocab", (dict,), {}), ("heldout", (dict, None), None), ("notes", (list,), []), ("created", (str,), ""),
         ("model_safetensors_sha256", (str, None), None)]
_PROV_ORDER = ["format", "format_version", "engine", "sglang_release", "vllm_release", "serving_family",
               "architecture", "options", "draft_kv_bytes_per_token", "capture",
               "eagle_aux_hidden_state_layer_ids", "served_capture_indices", "ids_reproduce_capture_in_sglang",
               "needs_disable_cuda_graph", "cuda_graph_default_capture", "server_command", "target", "identity",
               "run_dir", "step", "checkpoint", "standardize", "drafter", "vocab", "heldout", "notes", "created",
               "model_safetensors_sha256"]
# The provenance lists the target's fields in its own order (not TargetInfo's).
_PROV_TARGET_ORDER = ["architecture", "model_type", "config_sha256", "weights_sha256", "num_hidden_layers",
                      "hidden_size", "vocab_size", "path", "revision"]


@dataclass(kw_only=True)
class ExportProvenance:
    """eagle3_provenance.json: what was exported from which run and checkpoint, the trained capture, the engine
    and SGLang release targeted, what that server captures with the written ids, and model.safetensors' sha256
    (None until the weights are written; a provenance without it is refused by load_export)."""
    engine: str
    capture: CaptureSpec
    target: TargetInfo
    sglang_release: str | None = None
    vllm_release: str | None = None
    serving_family: str | None = None
    architecture: str | None = None          # the serving class (config.json's architectures)
    options: list = field(default_factory=list)  # EAGLE-3.1 options on (model.config.OPTIONS)
    draft_kv_bytes_per_token: int | None = None  # what a speculated token costs in the server's draft KV cache
    eagle_aux_hidden_state_layer_ids: list[int] | None = None
    served_capture_indices: list[int] | None = None
    ids_reproduce_capture_in_sglang: list | None = None
    needs_disable_cuda_graph: bool = False
    cuda_graph_default_capture: list[int] | None = None
    server_command: str = ""
    identity: dict = field(default_factory=dict)
    run_dir: str | None = None
    step: int | None = None
    checkpoint: str | None = None
    standardize: str | None = None
    drafter: dict = field(default_factory=dict)
    vocab: dict = field(default_factory=dict)
    # the held-out record of the exported weights (checkpoints/best: step, acc_j, the decoding replay at every chain
    # length up to training's, decode_by_steps), which `eagle3 eval --draft-steps auto` weighs against measured costs
    heldout: dict | None = None
    notes: list = field(default_factory=list)
    created: str = ""
    model_safetensors_sha256: str | None = None
    format: str = EXPORT_FORMAT
    format_version: int = EXPORT_FORMAT_VERSION
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = {k: copy.deepcopy(getattr(self, k)) for k in _PROV_ORDER}
        d["capture"] = _capture_dict(self.capture)
        d["target"] = {k: getattr(self.target, k) for k in _PROV_TARGET_ORDER}
        if self.model_safetensors_sha256 is None:  # not yet written, or a provenance that never recorded it
            del d["model_safetensors_sha256"]
        return {**d, **copy.deepcopy(self.extra)}

    @classmethod
    def from_dict(cls, d: dict, where: str = PROVENANCE_FILE) -> "ExportProvenance":
        _object(d, where)
        if d.get("format") != EXPORT_FORMAT or d.get("format_version") != EXPORT_FORMAT_VERSION:
            raise ContractError(f"{where}: not an {EXPORT_FORMAT} v{EXPORT_FORMAT_VERSION} provenance")
        return cls(**_with_nested(d, where, _PROV), extra=_extra(d, _PROV_ORDER))

    @classmethod
    def read(cls, path: str) -> "ExportProvenance":
        return cls.from_dict(read_json(path), path)


# ------------------------------------------------------------------------------- reading a checkpoint's files

class CheckpointError(ContractError):
    """A checkpoint that cannot be trusted or used: incomplete, altered, or holding more than plain state."""


def data_files(ckpt_dir: str) -> list[str]:
    """Every file of a checkpoint but its record, as paths relative to it."""
    out = []
    for root, _, files in os.walk(ckpt_dir):
        out += [os.path.relpath(os.path.join(root, f), ckpt_dir) for f in files]
    return sorted(f for f in out if f != CKPT_FILE)


def check_files(ckpt_dir: str, rec: CheckpointRecord, names: list[str] | None = None,
                world: D.World | None = None) -> None:
    """The files `names` (default: all, and no others) hash to what the checkpoint's record says; with `world`,
    the hashing is shared out among the ranks and every rank raises the same error."""
    record_path = os.path.join(ckpt_dir, CKPT_FILE)
    recorded = rec.sha256
    if recorded is None:
        raise CheckpointError(f"{record_path}: records no sha256 of its files (written before checkpoints were "
                              "hashed, or edited): its files cannot be checked")
    problems = []
    rank, size = (world.rank, world.world_size) if world is not None else (0, 1)
    if names is None:
        names = sorted(recorded)
        unknown = sorted(set(data_files(ckpt_dir)) - set(recorded))
        if unknown and rank == 0:  # DeepSpeed globs for its files: one planted beside them would be read too
            problems.append(f"files its record does not list: {unknown}")
    for name in names[rank::size]:
        path = os.path.join(ckpt_dir, name)
        if name not in recorded:
            problems.append(f"{name}: no sha256 recorded")
        elif not os.path.isfile(path):
            problems.append(f"{path}: missing")
        elif file_sha256(path) != recorded[name]:
            problems.append(f"{path}: sha256 differs from the record (the file was altered or corrupted)")
    if world is not None:
        problems = [p for part in D.all_gather_objects(problems) for p in part]
    if problems:
        raise CheckpointError(f"checkpoint {ckpt_dir} fails its check against {record_path}:\n  "
                              + "\n  ".join(problems))


# ------------------------------------------------------------------------------- where regenerated data came from

def identity_of(target: dict | None, tokenizer: dict | None) -> dict | None:
    """The hashes that say whether text was written by a given target (compared by the dump): its config, its
    weights ('' when a --server run's --target copy holds no weights: then nothing can vouch for them), its
    tokenizer and chat template."""
    if not target or not tokenizer:
        return None
    return {"config_sha256": target["config_sha256"], "weights_sha256": target.get("weights_sha256", ""),
            "tokenizer_sha256": tokenizer["sha256"], "chat_template_sha256": tokenizer["chat_template_sha256"]}


def data_sources(paths: list[str], target: TargetInfo, tokenizer: TokenizerInfo, allow_foreign: bool,
                 weights_digest_like: Callable[[str], str]) -> list[dict]:
    """For each data file with a regenerate.json beside it: check that the same target (config, tokenizer and chat
    template hashes) wrote it -- ContractError naming both unless allow_foreign -- and describe the source for
    the dump manifest. Files without a regenerate.json are not listed. weights_digest_like(recorded): the target's
    weights digested by the method of a recorded digest (target_info(..., like=)); called once per method other
    than the target's own, and only when a record used it (a full digest reads every byte of the weights)."""
    ours = identity_of(asdict(target), asdict(tokenizer))
    digests = {method_of(target.weights_sha256 or ""): target.weights_sha256}  # ours, by digest method

    def but_weights(d: dict) -> dict:
        return {k: v for k, v in d.items() if k != "weights_sha256"}
    sources = []
    for p in paths:
        rec_path = os.path.join(os.path.dirname(os.path.abspath(p)), REGENERATE_FILE)
        if not os.path.isfile(rec_path):
            continue
        try:
            with open(rec_path, encoding="utf-8") as f:
                rec = json.load(f)
            theirs = rec.get("identity")
        except (OSError, ValueError, AttributeError) as e:
            raise ContractError(f"{rec_path}: unreadable regenerate record ({e})") from e
        writer = f"{rec.get('backend')} model {rec.get('model')}"
        mine = ours
        if isinstance(theirs, dict) and theirs.get("weights_sha256"):
            method = method_of(theirs["weights_sha256"])
            if method not in digests:  # digested by the other method: ours taken likewise, once for all files
                digests[method] = weights_digest_like(theirs["weights_sha256"])
            mine = dict(ours, weights_sha256=digests[method])
        if theirs != mine and not allow_foreign:
            same_else = isinstance(theirs, dict) and but_weights(theirs) == but_weights(mine)
            if theirs is None:
                why = (f"{p} was regenerated by {writer} with no target identity recorded (a --server run without "
                       f"--target), so it cannot be checked against the target {target.path}")
            elif same_else and not theirs.get("weights_sha256"):
                why = (f"{p} was regenerated by {writer} with no weights recorded (its --target had none, or it was "
                       f"written before eagle3 recorded them), so nothing says the served model is {target.path}, "
                       "whose config and tokenizer it shares")
            elif same_else:
                why = (f"{p} was regenerated by a target with this config and tokenizer but OTHER WEIGHTS ({writer}: "
                       f"weights {theirs.get('weights_sha256')}; this dump's target {target.path}: weights "
                       f"{mine['weights_sha256']}): a fine-tune, another revision or another model")
            else:
                why = (f"{p} was regenerated by another target: {writer} (config {theirs.get('config_sha256')}, "
                       f"tokenizer {theirs.get('tokenizer_sha256')}, chat template "
                       f"{theirs.get('chat_template_sha256')}), but this dump's target is {target.path} (config "
                       f"{mine['config_sha256']}, tokenizer {mine['tokenizer_sha256']}, chat template "
                       f"{mine['chat_template_sha256']})")
            raise ContractError(f"{why}; a drafter learns best from its own target's answers. "
                                "Pass --allow-foreign-data to dump it anyway")
        sources.append({"file": os.path.abspath(p), "sha256": file_sha256(p), "regenerate_json": rec_path,
                        "backend": rec.get("backend"), "model": rec.get("model"), "servers": rec.get("servers"),
                        "sampling": rec.get("sampling"), "reasoning": rec.get("reasoning"), "identity": theirs,
                        "identity_matches_target": theirs == mine, "status": rec.get("status"),
                        "counts": rec.get("counts")})
    return sources
