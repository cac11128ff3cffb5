"""What bench/sglang_check.py and bench/vllm_check.py share: an export checked against a serving engine's own drafter
classes, each in that engine's environment (so only torch and eagle3 here, nothing of either engine).

- `export_tensors`, `Expected` / `compare_parameters`: every parameter the engine's loader wrote against the value it
  must hold; `options_read`: the options the engine built;
- `causal` and `gqa_attention`: the attention written out over a plain list cache (an engine's attention layer needs
  its server's paged KV cache);
- `reference_drafter`: eagle3's own drafter from the export and the random decode inputs both checks feed it;
- `run`: one JSON line per export, exit status 1 if any check failed.
"""

from __future__ import annotations

import json
import os
import traceback

import torch

PREFIX = 9     # prefix positions (step 0 "extend")
STEPS = 4      # draft steps after the prefix


def compare_parameters(params: dict[str, torch.Tensor], expect: dict[str, tuple[torch.Tensor, list[str]]],
                       engine: str) -> list[str]:
    """Problems: an expected parameter the engine lacks or holds other values in (its vocab rows may be padded),
    and an engine parameter with no exported tensor (the embedding excepted: the engine serves the target's)."""
    problems = []
    for name, (value, parts) in expect.items():
        p = params.get(name)
        if p is None:
            problems.append(f"{parts} -> {name}: no such {engine} parameter ({engine} dropped the tensor)")
            continue
        got = p.detach()[: value.shape[0]]
        if got.shape != value.shape or not torch.equal(got, value.to(got.dtype)):
            problems.append(f"{parts} -> {name}: values differ after load_weights")
    unwritten = [n for n in params if n not in expect and "embed_tokens" not in n]
    return problems + [f"{engine} parameter {n} has no exported tensor" for n in unwritten]


class Expected(dict):
    """{engine parameter: (the value it must hold, the export tensors it is made of)}, built tensor by tensor as an
    engine's loader fuses them: `put(name, parts)` concatenates the parts (q/k/v, gate/up, ...) into one value."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        super().__init__()
        self.tensors, self.used = tensors, set()

    def put(self, name: str, parts: list[str]) -> None:
        self[name] = (torch.cat([self.tensors[p] for p in parts]), parts)
        self.used.update(parts)


def export_tensors(export_dir: str) -> dict[str, torch.Tensor]:
    """The export's model.safetensors, floats in fp32 (the checks run fp32)."""
    from safetensors.torch import load_file
    return {k: (v.float() if v.is_floating_point() else v) for k, v in
            load_file(os.path.join(export_dir, "model.safetensors")).items()}


def options_read(model, recorded: list[str], engine: str) -> tuple[list[str], list[str]]:
    """(the EAGLE-3.1 options the engine's built drafter module `model` (its inner .model) has, problems): both
    engines build fc_norm / input_norm modules and a norm_output flag only when they read the option."""
    read = [o for o, on in (("fc_norm", getattr(model, "fc_norm", None) is not None),
                            ("norm_before_fc", getattr(model, "input_norm", None) is not None),
                            ("norm_output", bool(model.norm_output))) if on]
    return read, ([] if sorted(read) == sorted(recorded) else
                  [f"{engine} read options {read}, the export records {recorded}"])


def causal(scores: torch.Tensor) -> torch.Tensor:
    """Scores [..., S, T] of the last S of T positions, masked causally."""
    S, T = scores.shape[-2], scores.shape[-1]
    mask = torch.ones(S, T, dtype=torch.bool).tril(diagonal=T - S)
    return scores.masked_fill(~mask, float("-inf"))


def gqa_attention(q, k, v, cache: dict, num_heads: int, num_kv_heads: int, head_dim: int, scaling: float):
    """Grouped-query attention of the new positions' q [S, heads * d] over the cache extended by k, v; returns
    [S, heads * d]."""
    cache["k"] = torch.cat([cache.get("k", k[:0]), k])
    cache["v"] = torch.cat([cache.get("v", v[:0]), v])
    S, T = q.shape[0], cache["k"].shape[0]
    qh = q.reshape(S, num_heads, head_dim).transpose(0, 1)
    rep = num_heads // num_kv_heads
    kh = cache["k"].view(T, num_kv_heads, head_dim).transpose(0, 1).repeat_interleave(rep, 0)
    vh = cache["v"].view(T, num_kv_heads, head_dim).transpose(0, 1).repeat_interleave(rep, 0)
    o = torch.softmax(causal(qh @ kh.transpose(1, 2) * scaling), -1) @ vh
    return o.transpose(0, 1).reshape(S, -1).contiguous()


def reference_drafter(export_dir: str):
    """(DrafterConfig, eagle3's drafter in fp32 with the export's weights, a random target embedding, random aux
    states of PREFIX positions at three scales, PREFIX + 1 random token ids): what forward_step decodes beside the
    engine's modules."""
    from eagle3.model import Eagle3Drafter
    from eagle3.model.checkpoint import export_drafter_config, load_export
    config, tensors, prov = load_export(export_dir)
    dcfg = export_drafter_config(config, prov)
    ours = Eagle3Drafter(dcfg).float()
    ours.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in tensors.items()}, strict=False)
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(dcfg.vocab_size, dcfg.hidden_size, generator=g)
    ours.load_target_embedding(emb)
    aux = torch.randn(PREFIX, dcfg.num_aux_layers * dcfg.target_hidden_size, generator=g) * torch.tensor(
        [1.0, 8.0, 40.0][:dcfg.num_aux_layers]).repeat_interleave(dcfg.target_hidden_size)
    ids = torch.randint(0, dcfg.vocab_size, (PREFIX + 1,), generator=g)
    return dcfg, ours, emb, aux, ids


def run(exports: list[str], check) -> int:
    """check(export_dir) -> result dict with "ok" for each export; an exception is that export's failure (printed,
    then the next export). One JSON line each on stdout; 0 if every one passed, else 1."""
    ok = True
    for e in exports:
        try:
            r = check(os.path.abspath(e))
        except Exception as ex:
            traceback.print_exc()
            r = {"export": e, "ok": False, "error": f"{type(ex).__name__}: {ex}"}
        ok &= bool(r["ok"])
        print(json.dumps(r), flush=True)
    return 0 if ok else 1
