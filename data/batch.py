"""The training batch: standardized samples right-padded together, as one typed record with the contract's names.

A standardized sample (data/standardize.py) and a batch name each tensor one way, the way the dump shard does
(core/contract.py): `input_ids`, `loss_mask`, `hidden_state` (the captured states concatenated, ascending HF index:
the drafter's input), `final_hidden` (the target's post-norm state: the teacher's input), `target_argmax` (optional),
and for fp8 states left quantized their float32 scales under `C.scale_key(name)` (`hidden_state.scale` one per
captured state, `final_hidden.scale`). The batch adds `attention_mask` (1 on real tokens).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from eagle3 import contract as C
from eagle3.data.standardize import Sample
from eagle3.dump.shards import dequantize_fp8

HIDDEN_STATE_SCALE = C.scale_key(C.HIDDEN_STATE)
FINAL_HIDDEN_SCALE = C.scale_key(C.FINAL_HIDDEN)


@dataclass
class Batch:
    input_ids: torch.Tensor                        # [B, T] long, right-padded with pad_id
    loss_mask: torch.Tensor                        # [B, T] uint8: 1 on the answer tokens decoding is judged on
    attention_mask: torch.Tensor                   # [B, T] long: 1 on real tokens
    hidden_state: torch.Tensor                     # [B, T, n * H]
    final_hidden: torch.Tensor                     # [B, T, H]
    target_argmax: torch.Tensor | None = None      # [B, T] long: the target's full-vocab argmax (dumps that hold it)
    hidden_state_scale: torch.Tensor | None = None  # [B, T, n] float32: fp8 left quantized (DumpSet fp8_in_batch)
    final_hidden_scale: torch.Tensor | None = None  # [B, T] float32

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors it holds, by name (None fields left out)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}

    def pin_memory(self) -> "Batch":  # DataLoader(pin_memory=True) calls it
        return Batch(**{k: v.pin_memory() for k, v in self.tensors().items()})

    @property
    def quantized(self) -> bool:
        return self.hidden_state_scale is not None

    def dequantized(self, dtype: torch.dtype) -> "Batch":
        """The batch the reader would have dequantized: the reader's own dump.shards.dequantize_fp8 on each state,
        where the batch is (move it to the GPU first). A batch without scales is returned as it is."""
        if not self.quantized:
            return self
        B, T, n = self.hidden_state_scale.shape
        hs = dequantize_fp8(self.hidden_state.view(B, T, n, -1), self.hidden_state_scale, dtype).view(B, T, -1)
        return dataclasses.replace(self, hidden_state=hs,
                                   final_hidden=dequantize_fp8(self.final_hidden, self.final_hidden_scale, dtype),
                                   hidden_state_scale=None, final_hidden_scale=None)

    def to(self, device, dtype: torch.dtype) -> "Batch":
        """On `device`, its states in `dtype`: fp8 states (and their float32 scales) move as stored and are
        multiplied out there; ids and masks keep their dtypes."""
        def move(v: torch.Tensor, state: bool) -> torch.Tensor:
            cast = state and v.dtype != torch.float8_e4m3fn
            return v.to(device, dtype=dtype, non_blocking=True) if cast else v.to(device, non_blocking=True)
        states = {"hidden_state", "final_hidden"}
        return Batch(**{k: move(v, k in states) for k, v in self.tensors().items()}).dequantized(dtype)


def _batch_tensor(shape, dtype) -> torch.Tensor:
    """Uninitialised; in a DataLoader worker, in shared memory already, so handing it over copies nothing."""
    if torch.utils.data.get_worker_info() is None:
        return torch.empty(shape, dtype=dtype)
    n = math.prod(shape)
    storage = torch.empty(0, dtype=dtype)._typed_storage()._new_shared(n)
    return torch.empty(0, dtype=dtype).set_(storage).view(shape)


def collate(samples: list[Sample], pad_id: int = 0) -> Batch:
    """Right-pad standardized samples into a batch with an attention mask. Samples may carry `hidden_state` or
    `hidden_parts` (standardized(concat=False)): the parts are written straight into their columns."""
    B, T = len(samples), max(s[C.INPUT_IDS].shape[0] for s in samples)
    first = samples[0]
    parts0 = first.get("hidden_parts")
    hs_dtype = first[C.HIDDEN_STATE].dtype if parts0 is None else parts0[0].dtype
    hs_width = first[C.HIDDEN_STATE].shape[-1] if parts0 is None else sum(p.shape[-1] for p in parts0)
    fp8 = HIDDEN_STATE_SCALE in first  # fp8_in_batch: q as stored, one float32 scale per (token, state)
    final = first[C.FINAL_HIDDEN]
    out = Batch(input_ids=torch.full((B, T), pad_id, dtype=torch.long),
                loss_mask=torch.zeros((B, T), dtype=torch.uint8),
                attention_mask=torch.zeros((B, T), dtype=torch.long),
                hidden_state=_batch_tensor((B, T, hs_width), hs_dtype),
                final_hidden=_batch_tensor((B, T, final.shape[-1]), final.dtype))
    if fp8:  # padding: scale 0 and q 0 read back as 0, as the padding of a dequantized batch
        out.hidden_state_scale = torch.zeros((B, T, len(first[HIDDEN_STATE_SCALE])), dtype=torch.float32)
        out.final_hidden_scale = torch.zeros((B, T), dtype=torch.float32)
    if all(C.TARGET_ARGMAX in s for s in samples):  # the dump recorded the teacher's argmax (all or nothing)
        out.target_argmax = torch.zeros((B, T), dtype=torch.long)
    for b, s in enumerate(samples):
        n = s[C.INPUT_IDS].shape[0]
        if out.target_argmax is not None:
            out.target_argmax[b, :n] = s[C.TARGET_ARGMAX]
        out.input_ids[b, :n] = s[C.INPUT_IDS]
        out.loss_mask[b, :n] = s[C.LOSS_MASK]
        out.attention_mask[b, :n] = 1
        if "hidden_parts" in s:
            c = 0
            for p in s["hidden_parts"]:
                out.hidden_state[b, :n, c:c + p.shape[-1]] = p
                c += p.shape[-1]
        else:
            out.hidden_state[b, :n] = s[C.HIDDEN_STATE]
        out.final_hidden[b, :n] = s[C.FINAL_HIDDEN]
        if fp8:
            for j, sc in enumerate(s[HIDDEN_STATE_SCALE]):
                out.hidden_state_scale[b, :n, j] = sc
            out.final_hidden_scale[b, :n] = s[FINAL_HIDDEN_SCALE]
        out.hidden_state[b, n:] = 0  # only the padding is zeroed (the rest was just written)
        out.final_hidden[b, n:] = 0
    return out
