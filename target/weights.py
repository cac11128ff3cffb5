"""The two target tensors a drafter needs -- the token embedding and the lm_head -- read straight from the
target's safetensors files (through `model.safetensors.index.json` when sharded). A Kimi-sized target is never
loaded to train its drafter. A target with tied embeddings has one tensor for both.
"""

from __future__ import annotations

import torch
from safetensors import safe_open

from eagle3.target.files import tensor_files
from eagle3.target.load import read_config, text_config_dict

# Checkpoint names, most specific first: plain causal LMs, transformers' VLM layout, Kimi-K2.5's original layout.
EMBED_KEYS = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight",
              "language_model.model.embed_tokens.weight")
HEAD_KEYS = ("lm_head.weight", "language_model.lm_head.weight")
NORM_KEYS = ("model.norm.weight", "model.language_model.norm.weight", "language_model.model.norm.weight")


def _read(files: dict[str, str], candidates: tuple[str, ...], what: str, target_dir: str) -> torch.Tensor | None:
    for k in candidates:
        if k in files:
            with safe_open(files[k], "pt") as f:
                return f.get_tensor(k)
    return None


def load_embedding_and_head(target_dir: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(embed_tokens.weight [V, H], lm_head.weight [V, H]) of the target, in the checkpoint's dtype."""
    files = tensor_files(target_dir)
    embed = _read(files, EMBED_KEYS, "embedding", target_dir)
    if embed is None:
        raise KeyError(f"{target_dir}: no token embedding among {EMBED_KEYS}")
    head = _read(files, HEAD_KEYS, "lm_head", target_dir)
    if head is None:
        cfg = read_config(target_dir)
        tied = cfg.get("tie_word_embeddings", text_config_dict(cfg).get("tie_word_embeddings", False))
        if not tied:
            raise KeyError(f"{target_dir}: no lm_head among {HEAD_KEYS} and the config does not tie embeddings")
        head = embed
    return embed, head


def load_final_norm(target_dir: str) -> torch.Tensor:
    """The target's final RMSNorm weight [H] (the norm in front of its lm_head), in the checkpoint's dtype."""
    norm = _read(tensor_files(target_dir), NORM_KEYS, "final norm", target_dir)
    if norm is None:
        raise KeyError(f"{target_dir}: no final norm among {NORM_KEYS}")
    return norm
