"""Named presets shipped in configs/ (targets/*.yaml, later drafters/ and train/)."""

from __future__ import annotations

from importlib import resources

import yaml


def _dir(kind: str):
    return resources.files("eagle3.configs").joinpath(kind)


def available(kind: str) -> list[str]:
    return sorted(p.name.rsplit(".", 1)[0] for p in _dir(kind).iterdir() if p.name.endswith((".yaml", ".json")))


def load(kind: str, name: str) -> dict:
    """configs/<kind>/<name>.yaml (or .json; YAML parses JSON too)."""
    for ext in (".yaml", ".json"):
        path = _dir(kind).joinpath(name + ext)
        if path.is_file():
            return yaml.safe_load(path.read_text())
    raise ValueError(f"unknown {kind} preset {name!r}; available: {', '.join(available(kind))}")


def check_target_expectations(preset_name: str, preset: dict, text_config: dict, model_type: str) -> None:
    """A preset names a model family; refuse a target directory that is something else."""
    exp = dict(preset.get("expect", {}))
    got = dict(text_config, model_type=model_type)
    bad = {k: (v, got.get(k)) for k, v in exp.items() if got.get(k) != v}
    if bad:
        raise ValueError(f"target does not match preset {preset_name!r}: "
                         + ", ".join(f"{k} expected {v!r}, found {g!r}" for k, (v, g) in bad.items()))
