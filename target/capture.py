"""The capture patch: forward hooks on the decoder layers record the residual stream at the contract's indices.

HF index k is the output of decoder layer k-1; the post-final-norm state (what the teacher's lm_head reads) is the
output of the backbone's `norm`. Hooks keep only what the contract names, instead of all `output_hidden_states`.
"""

from __future__ import annotations

import torch

from eagle3 import contract as C
from eagle3.contract import ContractError
from eagle3.target.load import Backbone


def _tensor_of(output):
    t = output[0] if isinstance(output, (tuple, list)) else output
    # A TP-sharded DTensor would be a silent 1/tp slice after to_local(); the layer outputs must be full replicas.
    if hasattr(t, "full_tensor") and hasattr(t, "placements"):
        t = t.full_tensor()
    return t




class HiddenStateCapture:
    """`with HiddenStateCapture(backbone, [3, 31, 59]) as cap: cap.run(ids, mask)` -> the states by their shard
    names (core/contract.py): {'hidden_states.3': [B,T,H], ..., 'final_hidden': [B,T,H]} and, with the target's
    head, 'target_argmax' [B, T] int32."""

    def __init__(self, backbone: Backbone, indices: list[int], head: torch.nn.Module | None = None,
                 head_chunk: int = 4096):
        self.backbone = backbone
        self.head, self.head_chunk = head, head_chunk  # head: the target's lm_head -> states[C.TARGET_ARGMAX]
        self.indices = list(indices)
        self.states: dict = {}
        self._handles = []

    def __enter__(self):
        for k in self.indices:
            self._handles.append(self.backbone.layers[C.layer_for_index(k)].register_forward_hook(self._hook(C.hidden_state_key(k))))
        self._handles.append(self.backbone.norm.register_forward_hook(self._hook(C.FINAL_HIDDEN)))
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _hook(self, key):
        def hook(module, args, output):
            self.states[key] = _tensor_of(output)
        return hook

    @torch.no_grad()
    def run(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict:
        self.states = {}
        self.backbone.module(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        missing = [k for k in [*map(C.hidden_state_key, self.indices), C.FINAL_HIDDEN] if k not in self.states]
        if missing:
            raise ContractError(f"capture hooks did not fire for {missing}")
        if self.head is not None:
            # The teacher's full-vocab argmax, in row chunks so [rows, vocab] logits stay small (docs/contract.md §9).
            final = self.states[C.FINAL_HIDDEN]
            rows = final.reshape(-1, final.shape[-1])
            am = torch.cat([_tensor_of(self.head(c)).argmax(-1) for c in rows.split(self.head_chunk)])
            self.states[C.TARGET_ARGMAX] = am.to(torch.int32).view(final.shape[:-1])
        return self.states


def verify_full_width(states: dict, hidden_size: int, batch_shape: tuple) -> None:
    """Stop before writing anything if a captured tensor is not the full residual stream (e.g. a TP shard)."""
    for k, t in states.items():
        if k == C.TARGET_ARGMAX:  # one id per token, over the whole vocab (a TP head returns gathered logits)
            if tuple(t.shape) != tuple(batch_shape):
                raise ContractError(f"captured argmax has shape {tuple(t.shape)}, expected {tuple(batch_shape)}")
            continue
        if tuple(t.shape) != (*batch_shape, hidden_size):
            raise ContractError(f"captured tensor {k} has shape {tuple(t.shape)}, expected {(*batch_shape, hidden_size)}: "
                                "not the full hidden size (a tensor-parallel shard?); refusing to dump")
