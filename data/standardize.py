"""standardize_data_v1: one dumped sample -> what the drafter consumes.

The version is part of the contract (checkpoints record `standardize: v1`): the drafter's `fc` was trained on
`cat(hidden_states.<k> for k in manifest indices, ascending)`, low -> mid -> high, the order SGLang appends its
captured states in. The indices come from the manifest, never from a literal.
"""

from __future__ import annotations

from typing import TypedDict

import torch

from eagle3 import contract as C
from eagle3.contract import ContractError, DumpManifest

VERSION = C.STANDARDIZE_VERSION

# A standardized sample: the typed record standardize_data_v1 returns and data/batch.py's collate pads into a Batch.
# Its keys are the contract's tensor names (core/contract.py), as in the shard and the batch: one name per tensor.
Sample = TypedDict("Sample", {
    C.INPUT_IDS: torch.Tensor,                      # [T]
    C.LOSS_MASK: torch.Tensor,                      # [T]
    C.HIDDEN_STATE: torch.Tensor,                   # [T, n * H] (concat=True)
    "hidden_parts": list,                           # n x [T, H] (concat=False: collate writes them in place)
    C.FINAL_HIDDEN: torch.Tensor,                   # [T, H]
    C.TARGET_ARGMAX: torch.Tensor,                  # [T] (dumps that record it)
    C.scale_key(C.HIDDEN_STATE): list,              # n x [T] float32 (fp8 states left quantized)
    C.scale_key(C.FINAL_HIDDEN): torch.Tensor,      # [T] float32
}, total=False)


def standardize_data_v1(sample: dict, manifest: DumpManifest, source: str = "sample", concat: bool = True) -> Sample:
    """sample: `input_ids [T]`, `loss_mask [T]`, `hidden_states.<k> [T, H]` per captured k, `final_hidden [T, H]`.

    Returns `input_ids [T]`, `loss_mask [T]`, `hidden_state [T, n*H]` (ascending HF index), `final_hidden [T, H]`
    (the contract's names: data/batch.py), and what the sample has of `target_argmax [T]` and, for fp8 states left
    quantized, their scales (`hidden_state.scale`: a list, one [T] per captured state; `final_hidden.scale` [T]).
    `source` names the shard and sample in errors. concat=False returns `hidden_parts` (the list that
    hidden_state concatenates, ascending HF index) instead, for `data.batch.collate` to write in place."""
    indices = sorted(manifest.capture.hidden_state_indices)
    H = manifest.target.hidden_size
    missing = [C.hidden_state_key(k) for k in indices if C.hidden_state_key(k) not in sample]
    for key in (C.INPUT_IDS, C.LOSS_MASK, C.FINAL_HIDDEN):
        if key not in sample:
            missing.append(key)
    if missing:
        raise ContractError(f"{source}: missing {missing} required by the manifest "
                            f"(capture indices {indices})")
    T = sample[C.INPUT_IDS].shape[0]
    parts = [sample[C.hidden_state_key(k)] for k in indices]
    for name, t in [(C.hidden_state_key(k), p) for k, p in zip(indices, parts)] + [
            (C.FINAL_HIDDEN, sample[C.FINAL_HIDDEN])]:
        if tuple(t.shape) != (T, H):
            raise ContractError(f"{source}: {name} has shape {tuple(t.shape)}, expected ({T}, {H}) "
                                f"(hidden size {H} from the manifest)")
        if t.dtype == torch.float8_e4m3fn:  # fp8 left quantized: e4m3fn has no Inf, its NaN is the byte x1111111
            # (a byte test: torch's CPU float8 sum converts value by value, 5x slower, and it was the reader's limit)
            bad = bool((t.view(torch.uint8) | 0x80).eq(0xFF).any())
        else:  # one reduction pass (a NaN/Inf anywhere makes the fp32 sum non-finite); the exact test only to confirm
            bad = not torch.isfinite(t.sum(dtype=torch.float32)) and not torch.isfinite(t).all()
        if bad:
            raise ContractError(f"{source}: {name} contains NaN or Inf")
        scale = sample.get(C.scale_key(name))
        if scale is not None and (tuple(scale.shape) != (T,) or not torch.isfinite(scale).all()):
            raise ContractError(f"{source}: {C.scale_key(name)} has shape {tuple(scale.shape)} or non-finite "
                                f"values, expected ({T},) finite (the fp8 scale of each token)")
    if sample[C.LOSS_MASK].shape[0] != T:
        raise ContractError(f"{source}: loss_mask has {sample[C.LOSS_MASK].shape[0]} tokens, input_ids {T}")
    out = {C.INPUT_IDS: sample[C.INPUT_IDS], C.LOSS_MASK: sample[C.LOSS_MASK], C.FINAL_HIDDEN: sample[C.FINAL_HIDDEN]}
    if concat:
        out[C.HIDDEN_STATE] = torch.cat(parts, dim=-1)
    else:  # the same columns, left for the batch collate to place (saves a copy of every sample)
        out["hidden_parts"] = parts
    if C.scale_key(C.FINAL_HIDDEN) in sample:  # fp8 states left quantized: their scales, in the same order
        out[C.scale_key(C.HIDDEN_STATE)] = [sample[C.scale_key(C.hidden_state_key(k))] for k in indices]
        out[C.scale_key(C.FINAL_HIDDEN)] = sample[C.scale_key(C.FINAL_HIDDEN)]
    if C.TARGET_ARGMAX in sample:  # optional: the target's full-vocab argmax per token (the fast teacher)
        am = sample[C.TARGET_ARGMAX]
        if am.shape != (T,):
            raise ContractError(f"{source}: {C.TARGET_ARGMAX} has shape {tuple(am.shape)}, expected ({T},)")
        vocab = manifest.target.vocab_size
        if T and (int(am.min()) < 0 or int(am.max()) >= vocab):
            raise ContractError(f"{source}: {C.TARGET_ARGMAX} holds ids outside the target vocab ({vocab})")
        out[C.TARGET_ARGMAX] = am
    return out
