"""The serving engines' id rules: how SGLang (per release) and vLLM turn a draft config's
`eagle_config.eagle_aux_hidden_state_layer_ids` into the hidden states they capture (docs/contract.md §7).

Only export (which writes the ids) and eval (which checks what a server would capture) use them; the capture
contract itself -- HF indices, validation, the records -- is `eagle3.contract`.
"""

from __future__ import annotations

import functools
import re
from typing import Sequence

from eagle3 import contract as C
from eagle3.contract import ContractError, validate_indices


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
               "eagle3.serving.SGLANG_RULES" if newer else "; EAGLE-3 export targets SGLang >= " + SGLANG_OLDEST))
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
                            "eagle3.serving.SERVING_FAMILIES once its set_eagle3_layers_to_capture is read")
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
    return C.eagle3_default_layers(num_layers)


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


# ============================================================================================ drafter features
#
# Which serving releases honour each drafter architecture and EAGLE-3.1 option (docs/drafters.md, "Serving releases";
# read from each release's sglang/srt/models/llama_eagle3.py / kimi_k25_eagle3.py and vLLM's llama_eagle3.py /
# deepseek_eagle3.py). A release that predates a feature ignores its config key and drops (SGLang's Llama class:
# silently) its tensors, which serves a drafter other than the one trained: the export refuses it. None: no known
# release honours it.

VLLM_LATEST = "0.34.0"  # the newest vLLM whose drafter files these rows were read from

SGLANG_FEATURES: dict[str, dict[str, str | None]] = {
    "llama": {"layout": SGLANG_OLDEST, "fc_norm": "0.5.12", "norm_output": "0.5.12", "norm_before_fc": "0.5.17"},
    # kimi_k25_eagle3.py: the class from 0.5.12, fc_norm / norm_output from 0.5.13; norm_before_fc never read
    "mla": {"layout": "0.5.12", "fc_norm": "0.5.13", "norm_output": "0.5.13", "norm_before_fc": None},
}
VLLM_FEATURES: dict[str, dict[str, str | None]] = {
    "llama": {"layout": "0.10.0", "fc_norm": "0.22.0", "norm_output": "0.22.0", "norm_before_fc": "0.18.0"},
    # deepseek_eagle3.py from 0.18.0; fc_norm built in 0.22.x but applied only from 0.23.0; norm_before_fc never (0.32.0
    # fails to load an input_norm tensor: bench/vllm_check.py)
    "mla": {"layout": "0.18.0", "fc_norm": "0.23.0", "norm_output": "0.22.0", "norm_before_fc": None},
}
FEATURE_WHAT = {"layout": "the architecture", "fc_norm": "fc_norm (fc_norm.{i} tensors)",
                "norm_output": "norm_output", "norm_before_fc": "norm_before_fc (input_norm tensor)"}


def _features(engine: str, layout: str) -> dict[str, str | None]:
    return (SGLANG_FEATURES if engine == "sglang" else VLLM_FEATURES)[layout]


def first_release_serving(engine: str, layout: str, options: Sequence[str]) -> str | None:
    """The oldest release of `engine` that honours this architecture and every option; None when none does."""
    table = _features(engine, layout)
    firsts = [table[f] for f in ("layout", *options)]
    if any(f is None for f in firsts):
        return None
    return max(firsts, key=parse_release)


def check_drafter_served(engine: str, release: str | None, layout: str, options: Sequence[str],
                         architecture: str, q_lora_rank: int | None = None) -> None:
    """ContractError, naming the release and each option, when `engine` `release` (None for vLLM: VLLM_LATEST)
    would not serve this drafter as trained: its class absent, an option's key ignored or its tensors dropped."""
    name = "SGLang" if engine == "sglang" else "vLLM"
    if release is None:
        release = VLLM_LATEST if engine == "vllm" else SGLANG_LATEST
    r = check_release(release) if engine == "sglang" else parse_release(release)
    if engine == "vllm" and r > parse_release(VLLM_LATEST):
        raise ContractError(f"vLLM {r} is newer than the releases whose drafter files were read (<= {VLLM_LATEST}); "
                            "extend eagle3.serving.VLLM_FEATURES after reading its llama_eagle3.py / "
                            "deepseek_eagle3.py")
    table = _features(engine, layout)
    problems = []
    for f in ("layout", *options):
        first = table[f]
        what = architecture if f == "layout" else FEATURE_WHAT[f]
        if first is None:
            problems.append(f"no {name} release serves {what} on {architecture} (the key is ignored and its tensor "
                            "dropped, or the load fails on it)")
        elif r < parse_release(first):
            problems.append(f"{what} on {architecture} is served from {first} on")
    if problems:
        first = first_release_serving(engine, layout, options)
        hint = (f"; this drafter needs {name} >= {first}" if first else
                "; retrain without that option (eagle3 train --no-<option>)")
        problems[-1] += hint
    if layout == "mla" and not q_lora_rank:
        problems.append(f"{architecture} in {name} needs q_lora_rank (it builds q_a_proj -> q_b_proj; a drafter "
                        "with q_proj straight from the input cannot be loaded): retrain with a q_lora_rank")
    if problems:
        raise ContractError(f"{name} {r} would not serve this drafter as trained: " + "; ".join(problems))
