#!/usr/bin/env python3
"""An eagle3 export against SGLang 0.5.23's own drafter classes on the CPU: its loader, then its decode.

    bash bench/sglang_check.sh EXPORT_DIR [EXPORT_DIR ...]      (builds/uses ../shared/sglang_cpu_env.sh's venv)

For each export directory:
1. SGLang builds the drafter class from the export's config.json exactly as its server does (ModelConfig with
   is_draft_model=True, get_model_architecture, _initialize_model) and its `load_weights` takes model.safetensors.
   Checked: every exported tensor reaches a parameter (none dropped, none "skipping unexpected weight"), every
   parameter but the embedding (SGLang serves the target's) holds exactly the exported values after SGLang's own
   fusing (qkv_proj, gate_up_proj, fused_qkv_a_proj_with_mqa) and splitting (kv_b_proj -> w_kc / w_vc), and the
   options SGLang read from config.json (fc_norm, input_norm, norm_output) are the ones the provenance records.
2. A chain decode written from SGLang's semantics, on SGLang's loaded parameters and its own modules where they run
   on the CPU (RMSNorm.forward_native with its fused residual, the rotary embedding's forward_native, SiluAndMul;
   for MLA the absorbed attention over the latent cache with w_kc / w_vc, as SGLang decodes), reproduces eagle3's
   forward_step (the function training's TTT is tested against) step for step: the same logits and drafts.
Prints one JSON line per export and exits 1 if any check fails.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

import torch
import torch.nn.functional as F

from engine_check import (PREFIX, STEPS, Expected, causal, compare_parameters, export_tensors, gqa_attention,
                          options_read, reference_drafter, run)


class _Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


_READY = False


def _sglang_runtime(path: str) -> None:
    """Once per process: server args, a 1-rank gloo world, every parallel rank 0 / size 1 (../shared notes)."""
    global _READY
    from sglang.srt.runtime_context import get_context, get_parallel
    from sglang.srt.server_args import ServerArgs
    get_context().set_server_args(ServerArgs(model_path=path, device="cpu", dtype="float32", skip_tokenizer_init=True))
    if _READY:
        return
    from sglang.srt import distributed as D
    from sglang.srt.runtime_context import _parallel_fields
    D.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                   distributed_init_method=f"tcp://127.0.0.1:{29500 + os.getpid() % 1000}")
    get_parallel().override_permanently(**{k: (0 if k.endswith("rank") else 1) for k in _parallel_fields()
                                            if k.endswith("_rank") or k.endswith("_size")})
    D.initialize_model_parallel(backend="gloo")
    _READY = True


def build_sglang(path: str):
    _sglang_runtime(path)
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.loader import _initialize_model
    from sglang.srt.model_loader.utils import get_model_architecture
    torch.set_default_dtype(torch.float32)
    mc = ModelConfig(path, is_draft_model=True)
    cls, arch = get_model_architecture(mc)
    return _initialize_model(mc, LoadConfig()), arch


def expected_params(tensors: dict[str, torch.Tensor], layout: str) -> dict[str, tuple[torch.Tensor, list[str]]]:
    """{SGLang parameter name: (the value it must hold, the export tensors it is made of)}: SGLang's own fusings."""
    layer = "model.layers.0." if layout == "llama" else "model.midlayer."
    out = Expected(tensors)
    put, used = out.put, out.used
    for k in tensors:
        if k in ("d2t", "t2d") or k in used:
            continue
        if k == "lm_head.weight":
            put("lm_head.weight", [k])
        elif not k.startswith("midlayer."):
            put("model." + k, [k])
        elif k.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")) and layout == "llama":
            put(layer + "self_attn.qkv_proj.weight", [f"midlayer.self_attn.{x}_proj.weight" for x in "qkv"])
        elif k.endswith(("gate_proj.weight", "up_proj.weight")):
            put(layer + "mlp.gate_up_proj.weight", ["midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight"])
        elif k.endswith(("q_a_proj.weight", "kv_a_proj_with_mqa.weight")):
            put(layer + "self_attn.fused_qkv_a_proj_with_mqa.weight",
                ["midlayer.self_attn.q_a_proj.weight", "midlayer.self_attn.kv_a_proj_with_mqa.weight"])
        else:
            put(layer + k[len("midlayer."):], [k])
    return out


def check_load(model, tensors: dict[str, torch.Tensor], layout: str) -> dict:
    """SGLang's load_weights on the export; what reached which parameter, what did not."""
    handler = _Warnings()
    logging.getLogger("sglang").addHandler(handler)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for p in params.values():
            p.fill_(float("nan"))  # a parameter the loader never writes stays NaN
    try:
        model.load_weights(list(tensors.items()))
    finally:
        logging.getLogger("sglang").removeHandler(handler)
    problems = [m for m in handler.messages if "skipping" in m or "unexpected" in m]
    expect = expected_params(tensors, layout)
    problems += compare_parameters(params, expect, "SGLang")
    hot = getattr(model, "hot_token_id", None)
    if hot is None or not torch.equal(hot.cpu(), tensors["d2t"] + torch.arange(tensors["d2t"].numel())):
        problems.append("hot_token_id != d2t + arange (the draft -> target id map)")
    return {"parameters": len(params), "loaded": len(expect), "problems": problems}


# ------------------------------------------------------------------------------------------ SGLang's decode

def sglang_attention_llama(sa, x, pos, cache):
    q, k, v = F.linear(x, sa.qkv_proj.weight).split([sa.q_size, sa.kv_size, sa.kv_size], dim=-1)
    q, k = sa.rotary_emb.forward_native(pos, q, k)
    o = gqa_attention(q, k, v, cache, sa.num_heads, sa.num_kv_heads, sa.head_dim, sa.scaling)
    return F.linear(o, sa.o_proj.weight)


def sglang_attention_mla(sa, x, pos, cache):
    """SGLang's absorbed MLA decode: scores over the latent cache [kv_a_layernorm(c_kv) | rope(k_pe)], q_nope taken
    into the latent space by w_kc, the latent output out of it by w_vc."""
    Lq, Lkv, dn, dr = sa.q_lora_rank, sa.kv_lora_rank, sa.qk_nope_head_dim, sa.qk_rope_head_dim
    S, h = x.shape[0], sa.num_local_heads
    q, latent = F.linear(x, sa.fused_qkv_a_proj_with_mqa.weight).split([Lq, Lkv + dr], dim=-1)
    q = F.linear(sa.q_a_layernorm.forward_native(q), sa.q_b_proj.weight).view(S, h, dn + dr)
    c_kv = sa.kv_a_layernorm.forward_native(latent[:, :Lkv].contiguous())
    q_nope, q_pe = q.split([dn, dr], dim=-1)
    q_pe, k_pe = sa.rotary_emb.forward_native(pos, q_pe.contiguous(), latent[:, None, Lkv:].contiguous())
    cache["c"] = torch.cat([cache.get("c", c_kv[:0]), c_kv])
    cache["pe"] = torch.cat([cache.get("pe", k_pe[:0, 0]), k_pe[:, 0]])
    q_lat = torch.bmm(q_nope.transpose(0, 1), sa.w_kc)                           # [h, S, Lkv]
    scores = (q_lat @ cache["c"].T + q_pe.transpose(0, 1) @ cache["pe"].T) * sa.scaling
    o_lat = torch.softmax(causal(scores), -1) @ cache["c"]                   # [h, S, Lkv]
    o = torch.bmm(o_lat, sa.w_vc)                                                 # [h, S, dv]
    return F.linear(o.transpose(0, 1).reshape(S, -1), sa.o_proj.weight)


def sglang_step(model, layout, emb, h, tok, pos, cache, draft_vocab):
    """LlamaForCausalLMEagle3 / Eagle3DeepseekV2ForCausalLM forward, as its model.forward reads (docs/drafters.md)."""
    M = model.model
    if h.shape[-1] != emb.shape[-1]:                     # target features: the fc path
        if getattr(M, "input_norm", None) is not None:
            h = M.input_norm.forward_native(h)
        if getattr(M, "fc_norm", None) is not None:
            h = torch.cat([n.forward_native(c.contiguous()) for n, c in zip(M.fc_norm, h.chunk(len(M.fc_norm), -1))],
                          -1)
        h = F.linear(h, M.fc.weight)
    layer = M.layers[0] if layout == "llama" else M.midlayer
    residual = h
    x = torch.cat([layer.input_layernorm.forward_native(emb[tok]), layer.hidden_norm.forward_native(h)], -1)
    attend = sglang_attention_llama if layout == "llama" else sglang_attention_mla
    a = attend(layer.self_attn, x, pos, cache)
    a, residual = layer.post_attention_layernorm.forward_native(a, residual)
    mlp = layer.mlp
    m = F.linear(mlp.act_fn.forward_native(F.linear(a, mlp.gate_up_proj.weight)), mlp.down_proj.weight)
    to_logits, to_aux = M.norm.forward_native(m, residual)
    aux = to_logits if M.norm_output else to_aux
    return F.linear(to_logits, model.lm_head.weight)[:, :draft_vocab], aux


def check_decode(model, layout, export_dir: str) -> dict:
    dcfg, ours, emb, aux, ids = reference_drafter(export_dir)
    hot = model.hot_token_id
    cache: dict = {}
    worst, drafts_s, drafts_o = 0.0, [], []
    with torch.no_grad():
        pos = torch.arange(PREFIX)
        logits_s, h_s = sglang_step(model, layout, emb, aux, ids[1:], pos, cache, dcfg.draft_vocab_size)
        out_o, kv = ours.forward_step(ours.project_aux(aux[None]), ids[None, 1:], pos[None])
        for j in range(STEPS):
            lo = ours.draft_logits(out_o)[0]
            worst = max(worst, float((lo[-1] - logits_s[-1]).abs().max() / logits_s[-1].abs().max()))
            d_s, d_o = int(hot[logits_s[-1].argmax()]), int(ours.target_ids(lo[-1].argmax()))
            drafts_s.append(d_s)
            drafts_o.append(d_o)
            p = torch.tensor([PREFIX + j])
            logits_s, h_s = sglang_step(model, layout, emb, h_s[-1:], torch.tensor([d_s]), p, cache,
                                        dcfg.draft_vocab_size)
            out_o, kv = ours.forward_step(out_o[:, -1:], torch.tensor([[d_s]]), p[None], kv)
    return {"max_rel_logit_diff": worst, "drafts_sglang": drafts_s, "drafts_eagle3": drafts_o,
            "decode_ok": worst < 1e-4 and drafts_s == drafts_o}


def check(export_dir: str) -> dict:
    prov = json.load(open(os.path.join(export_dir, "eagle3_provenance.json")))
    model, arch = build_sglang(export_dir)
    from eagle3.model.checkpoint import ARCHITECTURES
    layout = ARCHITECTURES[arch]
    tensors = export_tensors(export_dir)
    res = {"export": export_dir, "sglang_class": arch, "type": type(model).__name__,
           "options_recorded": prov.get("options", [])}
    res.update(check_load(model, tensors, layout))
    res["options_sglang_read"], problems = options_read(model.model, res["options_recorded"], "SGLang")
    res["problems"] += problems
    res.update(check_decode(model, layout, export_dir))
    res["ok"] = not res["problems"] and res["decode_ok"]
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("exports", nargs="+")
    return run(ap.parse_args(argv).exports, check)


if __name__ == "__main__":
    sys.exit(main())
