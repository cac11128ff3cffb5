"""Routed experts kept INT4-packed, as Kimi-K2.5 ships them (compressed-tensors `pack-quantized`, int4 symmetric,
group 32), dequantized one expert at a time during the forward.

Why not transformers' own path (5.24): it dequantizes the fused experts while loading, whatever `run_compressed`
says, into a full bf16 copy (~2 TB for Kimi-K2.5, more than 8 x H200 hold), and its TP loading fails on the 1-D
`weight_shape` companions (/work/shared/KIMI_K25.md). So the MoE layers are built with `PackedInt4Experts` in place
of `DeepseekV3Experts` (no dense expert parameter ever exists), transformers loads everything else as usual, and
`load_packed_experts` then reads this rank's share of the packed tensors straight from the safetensors files.

Semantics are transformers' `DeepseekV3Experts.forward` (modeling_deepseek_v3.py): the router (`mlp.gate`) and the
shared experts stay transformers' modules; for each hit expert, `act(x @ gate^T) * (x @ up^T) @ down^T` times its
routing weight, summed per token. Under TP each rank holds experts [r*E/tp, (r+1)*E/tp) of every MoE layer and the
partial sums are all-reduced over the TP group, which is what transformers' `moe_tp_experts` style does for its
(intermediate-sharded) experts.
"""

from __future__ import annotations

import contextlib
import re

import torch
from torch import nn

from eagle3.target.files import tensor_files

PACKED_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\."
                        r"weight_(packed|scale|shape)$")
MODULE_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.experts$")


# Text models whose MoE is transformers' DeepseekV3MoE (Kimi-K2.5's text_config says kimi_k2; transformers maps it).
MODEL_TYPES = ("deepseek_v3", "kimi_k2")


class PackedExpertsError(ValueError):
    pass


def packed_int4_config(cfg: dict) -> dict | None:
    """The compressed-tensors quantization_config (top level, else in text_config, where Kimi-K2.5 has it) when it
    is the scheme this module implements (pack-quantized, one weight-only int4 symmetric group config) on a
    DeepseekV3-style text model. None for anything else (unquantized, fp8, other schemes or architectures), which
    loads through transformers as before."""
    text: dict = cfg["text_config"] if isinstance(cfg.get("text_config"), dict) else {}
    if (text or cfg).get("model_type") not in MODEL_TYPES:
        return None
    qc = cfg.get("quantization_config") or text.get("quantization_config")
    if not qc or qc.get("quant_method") != "compressed-tensors" or qc.get("format") != "pack-quantized":
        return None
    groups = list((qc.get("config_groups") or {}).values())
    if len(groups) != 1:
        return None
    g = groups[0]
    w = g.get("weights") or {}
    ok = (w.get("num_bits") == 4 and w.get("type") == "int" and w.get("symmetric") is True
          and w.get("strategy") == "group" and isinstance(w.get("group_size"), int)
          and not g.get("input_activations") and not g.get("output_activations"))
    return qc if ok else None


def _require_compressed_tensors() -> None:
    try:
        import compressed_tensors  # noqa: F401
    except ImportError:
        raise ImportError("this target's experts are compressed-tensors INT4 (Kimi-K2.5 as shipped): install the "
                          "kimi extra, pip install 'eagle3[kimi]' (compressed-tensors==0.20.1, tiktoken)") from None


def weight_args(qc: dict):
    """compressed-tensors' own QuantizationArgs for the weights (drives its unpack/dequantize)."""
    _require_compressed_tensors()
    from compressed_tensors.quantization import QuantizationArgs
    return QuantizationArgs(**next(iter(qc["config_groups"].values()))["weights"])


def dequantize_weight(packed: torch.Tensor, scale: torch.Tensor, shape: tuple[int, int], args,
                      dtype: torch.dtype) -> torch.Tensor:
    """One expert matrix [out, in] in `dtype`, with compressed-tensors' own unpack and dequantize. The scale is cast
    first: compressed-tensors multiplies in the scale's dtype, and q * s (4 bits x bf16) is exact only in fp32."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from compressed_tensors.quantization.lifecycle.forward import dequantize
    q = unpack_from_int32(packed, args.num_bits, torch.Size(shape))
    return dequantize(q, scale.to(dtype), args=args, dtype=dtype)


class PackedInt4Experts(nn.Module):
    """Drop-in for transformers' DeepseekV3Experts: same constructor and forward signature, packed buffers instead
    of the dense [E, 2I, H] / [E, H, I] parameters. Empty until `load_packed_experts` fills it."""

    gate_up_packed: torch.Tensor  # int32 [E_local, 2I, H/8]: gate rows then up rows, as transformers fuses them
    gate_up_scale: torch.Tensor   # the checkpoint's dtype (bf16) [E_local, 2I, H/group]
    down_packed: torch.Tensor     # int32 [E_local, H, I/8]
    down_scale: torch.Tensor      # [E_local, H, I/group]

    def __init__(self, config):
        super().__init__()
        from transformers.activations import ACT2FN
        self.num_experts = config.num_local_experts
        self.hidden_dim = config.hidden_size
        self.intermediate_dim = config.moe_intermediate_size
        self.act_fn = ACT2FN[config.hidden_act]
        self.start, self.stop = 0, self.num_experts  # the experts this rank holds
        self.args = None
        self.group = None  # the TP process group the partial sums are all-reduced over (None: one process)
        # Not persistent: transformers neither looks for them in the checkpoint nor reports them missing.
        for name in ("gate_up_packed", "gate_up_scale", "down_packed", "down_scale"):
            self.register_buffer(name, torch.empty(0, dtype=torch.int32), persistent=False)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        if self.args is None:
            raise RuntimeError("PackedInt4Experts: forward before load_packed_experts filled the packed weights")
        final_hidden_states = torch.zeros_like(hidden_states)
        dtype = hidden_states.dtype
        with torch.no_grad():
            expert_mask = torch.nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1)
            expert_mask = expert_mask.permute(2, 1, 0)
            expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
        for expert_idx in expert_hit.flatten().tolist():
            if not self.start <= expert_idx < self.stop:  # another rank's expert (or the "no expert" slot)
                continue
            e = expert_idx - self.start
            top_k_pos, token_idx = torch.where(expert_mask[expert_idx])
            current_state = hidden_states[token_idx]
            # Transient: this expert's matrices exist dense only for these two lines.
            gate_up = dequantize_weight(self.gate_up_packed[e], self.gate_up_scale[e],
                                        (2 * self.intermediate_dim, self.hidden_dim), self.args, dtype)
            gate, up = nn.functional.linear(current_state, gate_up).chunk(2, dim=-1)
            del gate_up
            current_hidden_states = self.act_fn(gate) * up
            down = dequantize_weight(self.down_packed[e], self.down_scale[e],
                                     (self.hidden_dim, self.intermediate_dim), self.args, dtype)
            current_hidden_states = nn.functional.linear(current_hidden_states, down)
            del down
            current_hidden_states = current_hidden_states * top_k_weights[token_idx, top_k_pos, None]
            final_hidden_states.index_add_(0, token_idx, current_hidden_states.to(final_hidden_states.dtype))
        if self.group is not None:
            torch.distributed.all_reduce(final_hidden_states, group=self.group)
        return final_hidden_states


@contextlib.contextmanager
def packed_experts_construction():
    """While transformers builds the model, every DeepseekV3MoE gets a PackedInt4Experts in place of its
    DeepseekV3Experts. from_pretrained builds on the meta device, so the dense experts made first by the original
    __init__ never hold memory; replacing them before loading means transformers never materializes them either.
    (Swapping the class name in the module instead would also catch transformers' `_init_weights`, which then
    initializes `gate_up_proj` on our module.) transformers is pinned (5.24): this is its layout."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as M
    original = M.DeepseekV3MoE.__init__
    ignored = M.DeepseekV3PreTrainedModel._keys_to_ignore_on_load_unexpected

    def init(self, config):
        original(self, config)
        self.experts = PackedInt4Experts(config)

    M.DeepseekV3MoE.__init__ = init
    # The packed tensors are read by load_packed_experts, not by transformers: keep them out of its load report (a
    # table of "UNEXPECTED" keys on every rank). Read at construction (post_init), so patched only meanwhile.
    M.DeepseekV3PreTrainedModel._keys_to_ignore_on_load_unexpected = [*(ignored or []), PACKED_KEY.pattern]
    try:
        yield
    finally:
        M.DeepseekV3MoE.__init__ = original
        M.DeepseekV3PreTrainedModel._keys_to_ignore_on_load_unexpected = ignored


def strip_for_packed_loading(config) -> None:
    """Prepare a transformers config for loading with packed experts: no quantizer (it would dequantize every
    expert), and no TP plan entries for the experts (PackedInt4Experts shards by expert and all-reduces itself;
    the `moe_tp_experts` hook would all-reduce a second time)."""
    for c in (config, config.get_text_config(decoder=True)):
        if getattr(c, "quantization_config", None) is not None:
            c.quantization_config = None
            with contextlib.suppress(AttributeError):
                del c.quantization_config
        plan = getattr(c, "base_model_tp_plan", None)
        if plan:
            c.base_model_tp_plan = {k: v for k, v in plan.items() if ".mlp.experts" not in k}


def packed_keys(target_dir: str) -> dict[tuple[int, int, str, str], tuple[str, str]]:
    """(layer, expert, proj, part) -> (key, file) for every routed-expert packed tensor of the checkpoint."""
    out = {}
    for key, path in tensor_files(target_dir).items():
        m = PACKED_KEY.search(key)
        if m:
            out[(int(m[1]), int(m[2]), m[3], m[4])] = (key, path)
        elif key.endswith(("weight_packed", "weight_scale", "weight_shape", "weight_zero_point")):
            raise PackedExpertsError(f"{target_dir}: {key} is quantized but not a routed expert; only routed "
                                     "experts are kept packed (Kimi-K2.5's ignore list leaves everything else bf16)")
    return out


def tp_group(tp_size: int):
    """This rank's TP process group: ranks [d*tp, (d+1)*tp), as dump/job.py lays out DP x TP. Every rank creates
    every group (torch.distributed requires it), in the same order."""
    import torch.distributed as dist
    if tp_size <= 1:
        return None
    world, rank = dist.get_world_size(), dist.get_rank()
    mine = None
    for d in range(world // tp_size):
        g = dist.new_group(list(range(d * tp_size, (d + 1) * tp_size)))
        if rank // tp_size == d:
            mine = g
    return mine


def load_packed_experts(model: nn.Module, target_dir: str, qc: dict, tp_size: int = 1) -> int:
    """Fill every PackedInt4Experts of `model` with this rank's share of the checkpoint's packed experts.
    Returns the number of layers filled. Every packed tensor of the checkpoint must belong to one of them."""
    from safetensors import safe_open
    args = weight_args(qc)
    keys = packed_keys(target_dir)
    group = tp_group(tp_size)
    tp_rank = torch.distributed.get_rank(group) if group is not None else 0
    handles: dict[str, object] = {}

    def read(layer, e, proj, part):
        try:
            key, path = keys.pop((layer, e, proj, part))
        except KeyError:
            raise PackedExpertsError(f"{target_dir}: no {part} tensor for layer {layer} expert {e} {proj}_proj") \
                from None
        if path not in handles:
            handles[path] = stack.enter_context(safe_open(path, "pt"))
        return handles[path].get_tensor(key)

    def expert_proj(layer, e, proj, out_f, in_f):
        packed, scale, shape = (read(layer, e, proj, p) for p in ("packed", "scale", "shape"))
        want = {"packed": (out_f, in_f * args.num_bits // 32), "scale": (out_f, in_f // args.group_size)}
        if shape.tolist() != [out_f, in_f] or tuple(packed.shape) != want["packed"] \
                or tuple(scale.shape) != want["scale"] or packed.dtype != torch.int32:
            raise PackedExpertsError(
                f"{target_dir}: layer {layer} expert {e} {proj}_proj: weight_shape {shape.tolist()}, packed "
                f"{tuple(packed.shape)} {packed.dtype}, scale {tuple(scale.shape)}; expected [{out_f}, {in_f}], "
                f"{want['packed']} int32, {want['scale']} (int{args.num_bits}, group {args.group_size})")
        return packed, scale

    n = 0
    with contextlib.ExitStack() as stack:
        for name, mod in model.named_modules():
            if not isinstance(mod, PackedInt4Experts):
                continue
            m = MODULE_NAME.search(name)
            if m is None:
                raise PackedExpertsError(f"cannot tell the decoder layer of {name}")
            layer, E, H, II = int(m[1]), mod.num_experts, mod.hidden_dim, mod.intermediate_dim
            if E % tp_size:
                raise PackedExpertsError(f"--tp {tp_size} does not divide the {E} routed experts")
            if H % args.group_size or II % args.group_size:
                raise PackedExpertsError(f"group size {args.group_size} does not divide hidden {H} / expert "
                                         f"intermediate {II}")
            per = E // tp_size
            start, stop = tp_rank * per, (tp_rank + 1) * per
            gu_p, gu_s, d_p, d_s = [], [], [], []
            for e in range(E):
                if not start <= e < stop:
                    for proj in ("gate", "up", "down"):  # another rank's: accounted for, not read
                        for part in ("packed", "scale", "shape"):
                            keys.pop((layer, e, proj, part), None)
                    continue
                g, u, d = (expert_proj(layer, e, "gate", II, H), expert_proj(layer, e, "up", II, H),
                           expert_proj(layer, e, "down", H, II))
                gu_p.append(torch.cat([g[0], u[0]]))  # rows: gate then up, transformers' fused gate_up_proj order
                gu_s.append(torch.cat([g[1], u[1]]))
                d_p.append(d[0])
                d_s.append(d[1])
            device = next(model.parameters()).device
            mod.gate_up_packed, mod.gate_up_scale = torch.stack(gu_p).to(device), torch.stack(gu_s).to(device)
            mod.down_packed, mod.down_scale = torch.stack(d_p).to(device), torch.stack(d_s).to(device)
            mod.start, mod.stop, mod.args, mod.group = start, stop, args, group
            n += 1
    if keys:
        raise PackedExpertsError(f"{target_dir}: packed expert tensors of layers {sorted({k[0] for k in keys})} have "
                                 "no MoE layer in the model")
    return n
