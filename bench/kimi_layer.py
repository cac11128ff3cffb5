#!/usr/bin/env python3
"""Kimi-K2.5 at its real layer shapes, in the shipped INT4 format, under the dump's forward on one GPU (issue 15
part 2; bench/RESULTS.md):

  python bench/kimi_layer.py --out DIR [--work DIR] [--tokens 4096,16384,65536] [--long 131072]

1. Writes a checkpoint exactly as Kimi-K2.5 ships (tests/kimi_int4.py: the kimi_k25 wrapper config, text_config
   with the real quantization_config, `language_model.model.layers.N...` keys, routed experts as weight_packed int32
   / weight_scale bf16 / weight_shape int32, bf16 elsewhere, an index.json) with the real text shapes (hidden 7168,
   MLA q_lora 1536 / kv_lora 512 / rope 64 / nope 128 / v 128, 64 heads, dense intermediate 18432, 384 routed experts
   of intermediate 2048 + 1 shared, top-8, vocab 163840) but two decoder layers: layer 0 dense (first_k_dense_replace
   1, as shipped), layer 1 MoE. Random weights (packed nibbles uniform, scales so weights have std ~0.02). The vision
   tower is the tests' tiny one: the dump never runs it.
2. Loads it with the dump's loader (eagle3.target.load.load_target: experts stay packed) and runs the dump's forward
   (HiddenStateCapture with the lm_head argmax) on rows of 2048 tokens, timing each piece with CUDA events: the
   embedding, both attentions, the dense MLP, the router, the routed experts, the shared expert, the final norm +
   full-vocab argmax. Routed experts twice: holding all 384 (one GPU, TP 1) and holding 48 (what one rank of TP 8
   holds: experts outside [0, 48) are skipped, the routing unchanged). Dequantization twice: compressed-tensors'
   functions as they are (eager) and the same functions under torch.compile.
3. run_dump end to end (the CLI's path, minus weight loading) on ~2000-token conversations (--batch-tokens 16384)
   and on one conversation truncated to --max-length 131072. Peak GPU memory of each.
Rows go to DIR/kimi_layer.jsonl (one per measurement) and the projection inputs to DIR/kimi_layer_summary.json.
"""
import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

TEXT = dict(  # Kimi-K2.5's text_config shapes (../shared/KIMI_K25.md), two layers
    vocab_size=163840, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=2,
    num_attention_heads=64, num_key_value_heads=64, n_shared_experts=1, n_routed_experts=384, num_experts_per_tok=8,
    n_group=1, topk_group=1, first_k_dense_replace=1, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
    qk_nope_head_dim=128, v_head_dim=128, routed_scaling_factor=2.827, norm_topk_prob=True,
    max_position_embeddings=262144, rms_norm_eps=1e-5, rope_theta=50000.0, tie_word_embeddings=False,
    scoring_func="sigmoid", topk_method="noaux_tc")
SMALL = dict(TEXT, vocab_size=4096, hidden_size=256, intermediate_size=512, moe_intermediate_size=64,
             num_attention_heads=4, num_key_value_heads=4, n_routed_experts=16, num_experts_per_tok=4,
             kv_lora_rank=64, q_lora_rank=96, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32)
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def write_checkpoint(path: str, text: dict, seed: int = 0) -> str:
    """The shipped layout at `text`'s shapes (see the module docstring), written shard by shard."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForImageTextToText
    from kimi_int4 import GROUP, QUANTIZATION_CONFIG, SHIPPED_TEXT, SHIPPED_TOP, _shipped_key
    from tiny import KIMI_K25
    from tiny_tokenizers import make_tokenizer
    from eagle3.target import int4_experts as I
    cfg_dict = json.loads(json.dumps(dict(KIMI_K25, text_config=dict(KIMI_K25["text_config"], **text))))
    cfg_dict["vision_config"]["text_hidden_size"] = text["hidden_size"]
    config = AutoConfig.for_model(cfg_dict.pop("model_type"), **cfg_dict)
    torch.manual_seed(seed)
    os.makedirs(path, exist_ok=True)
    # Everything but the routed experts: transformers' own init and writer (keys as it writes them), on the GPU.
    with tempfile.TemporaryDirectory(dir=os.path.dirname(os.path.abspath(path))) as tmp:
        with I.packed_experts_construction(), torch.device(DEV):
            model = AutoModelForImageTextToText.from_config(config, dtype=torch.bfloat16)
        model.save_pretrained(tmp, max_shard_size="4GB")
        del model
        weight_map = {}
        for name in sorted(os.listdir(tmp)):
            if name.endswith(".safetensors"):
                part = {_shipped_key(k): v for k, v in load_file(os.path.join(tmp, name)).items()}
                save_file(part, os.path.join(path, name), metadata={"format": "pt"})
                weight_map.update({k: name for k in part})
        with open(os.path.join(tmp, "config.json")) as f:
            cfg = json.load(f)
    # The routed experts of every MoE layer: int4 nibbles uniform in [-8, 7] (packed as compressed-tensors packs:
    # value + 8, eight per int32, low nibble first), one bf16 scale per 32 inputs.
    H, II, E = text["hidden_size"], text["moe_intermediate_size"], text["n_routed_experts"]
    g = torch.Generator(device=DEV).manual_seed(seed + 1)
    scale_value = 0.02 / 4.6  # std of uniform ints in [-8, 7] is ~4.6: weights of std ~0.02
    for layer in range(text["first_k_dense_replace"], text["num_hidden_layers"]):
        name = f"experts-layer{layer}.safetensors"
        part = {}
        for e in range(E):
            for proj, (out_f, in_f) in (("gate", (II, H)), ("up", (II, H)), ("down", (H, II))):
                key = f"language_model.model.layers.{layer}.mlp.experts.{e}.{proj}_proj"
                packed = torch.randint(-2**31, 2**31 - 1, (out_f, in_f // 8), generator=g, device=DEV,
                                       dtype=torch.int64).to(torch.int32)
                scale = (torch.rand((out_f, in_f // GROUP), generator=g, device=DEV) * 0.5 + 0.75) * scale_value
                part[key + ".weight_packed"] = packed.cpu()
                part[key + ".weight_scale"] = scale.to(torch.bfloat16).cpu()
                part[key + ".weight_shape"] = torch.tensor([out_f, in_f], dtype=torch.int32)
        save_file(part, os.path.join(path, name), metadata={"format": "pt"})
        weight_map.update({k: name for k in part})
        del part
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}, f)
    cfg.update(SHIPPED_TOP, dtype="bfloat16")
    cfg["text_config"].update(SHIPPED_TEXT, dtype="bfloat16", quantization_config=QUANTIZATION_CONFIG)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    make_tokenizer("kimi").save_pretrained(path)
    return path


class PieceTimer:
    """CUDA events around named modules' forwards; `ms()` sums each name's calls since `reset()`."""

    def __init__(self, modules: dict):
        self.events: dict[str, list] = {}
        self.handles = []
        for name, mod in modules.items():
            self.handles.append(mod.register_forward_pre_hook(self._pre(name)))
            self.handles.append(mod.register_forward_hook(self._post(name)))

    def _pre(self, name):
        def hook(mod, args):
            if DEV == "cuda":
                ev = torch.cuda.Event(enable_timing=True)
                ev.record()
                self.events.setdefault(name, []).append([ev, None])
        return hook

    def _post(self, name):
        def hook(mod, args, out):
            if DEV == "cuda":
                ev = torch.cuda.Event(enable_timing=True)
                ev.record()
                self.events[name][-1][1] = ev
        return hook

    def reset(self):
        self.events = {}

    def ms(self) -> dict:
        sync()
        return {k: sum(a.elapsed_time(b) for a, b in v) for k, v in self.events.items()}

    def remove(self):
        for h in self.handles:
            h.remove()


def time_forward(cap, bb, timer, B, T, vocab, iters):
    """Median over `iters` (after one warm-up) of the whole capture forward and of each timed piece, in ms; and the
    peak memory of one forward over what was allocated before it."""
    ids = torch.randint(0, vocab, (B, T), device=DEV)
    mask = torch.ones_like(ids)
    totals, pieces = [], []
    for i in range(iters + 1):
        torch.cuda.reset_peak_memory_stats() if DEV == "cuda" else None
        base = torch.cuda.memory_allocated() if DEV == "cuda" else 0
        timer.reset()
        sync()
        t0 = time.perf_counter()
        cap.run(ids, mask)
        sync()
        if i:
            totals.append((time.perf_counter() - t0) * 1e3)
            pieces.append(timer.ms())
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if DEV == "cuda" else 0.0
        cap.states = {}
    med = {k: round(statistics.median(p[k] for p in pieces), 2) for k in pieces[0]} if pieces and pieces[0] else {}
    return round(statistics.median(totals), 2), med, round(peak, 2)


@contextlib.contextmanager
def experts_held(model, stop: int):
    """Every PackedInt4Experts holds experts [0, stop) only, as rank 0 of TP = E/stop does (the others skipped)."""
    from eagle3.target.int4_experts import PackedInt4Experts
    mods = [m for m in model.modules() if isinstance(m, PackedInt4Experts)]
    saved = [(m.start, m.stop) for m in mods]
    for m in mods:
        m.start, m.stop = 0, stop
    try:
        yield
    finally:
        for m, (a, b) in zip(mods, saved):
            m.start, m.stop = a, b


@contextlib.contextmanager
def dequant_mode(mode: str):
    """'eager': compressed-tensors' unpack + dequantize as they are; 'compiled': the same under torch.compile."""
    from eagle3.target import int4_experts as I
    original = I.dequantize_weight
    if mode == "compiled":
        I.dequantize_weight = torch.compile(original, dynamic=False)
    try:
        yield
    finally:
        I.dequantize_weight = original


def write_conversations(path, tokenizer, n, tokens_per_turn, seed=0):
    """n conversations of one user + one assistant turn of ~tokens_per_turn tokens each (random words)."""
    from tiny import WORDS
    per_word = len(tokenizer(" ".join(WORDS * 20))["input_ids"]) / (len(WORDS) * 20)
    words = max(1, int(tokens_per_turn / per_word))
    g = torch.Generator().manual_seed(seed)

    def text():
        return " ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (words,), generator=g))
    with open(path, "w") as f:
        for _ in range(n):
            f.write(json.dumps({"messages": [{"role": "user", "content": text()},
                                             {"role": "assistant", "content": text()}]}) + "\n")
    return path


def dump_end_to_end(ckpt, model, root, name, n, tokens_per_turn, max_length, batch_tokens, layers):
    from eagle3.contract import load_manifest
    from eagle3.dump.job import DumpConfig, run_dump
    from eagle3.target import load as targets
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(ckpt)
    data = write_conversations(os.path.join(root, f"{name}.jsonl"), tok, n, tokens_per_turn)
    out = os.path.join(root, f"dump-{name}")
    shutil.rmtree(out, ignore_errors=True)
    original = targets.load_target
    targets.load_target = lambda *a, **k: model  # loaded once above: this times the dump, not the weight I/O
    try:
        if DEV == "cuda":
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if DEV == "cuda" else 0
        t0 = time.perf_counter()
        run_dump(DumpConfig(target=ckpt, data=[data], out=out, layers=layers, max_length=max_length,
                            batch_tokens=batch_tokens, dtype="bf16", progress=False))
        wall = time.perf_counter() - t0
    finally:
        targets.load_target = original
    m = load_manifest(out)
    row = {"what": "dump", "name": name, "conversations": n, "max_length": max_length, "batch_tokens": batch_tokens,
           "tokens": m.totals["tokens"], "bytes": m.totals["bytes"],
           "bytes_per_token": round(m.totals["bytes"] / m.totals["tokens"], 1), "wall_s": round(wall, 2),
           "tokens_per_s_incl_setup": round(m.totals["tokens"] / wall),
           "peak_gib_over_weights": round((torch.cuda.max_memory_allocated() - base) / 2**30, 2) if DEV == "cuda"
           else None}
    shutil.rmtree(out, ignore_errors=True)
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default=None, help="where the checkpoint and dumps go (default: a temp dir)")
    ap.add_argument("--tokens", default="4096,16384,65536", help="tokens per forward, as rows of 2048")
    ap.add_argument("--long", type=int, default=131072, help="one sample of this many tokens (0: skip)")
    ap.add_argument("--tp-sim", default="1,8", help="hold E/tp experts, as one rank of TP tp")
    ap.add_argument("--dequant", default="eager,compiled")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--small", action="store_true", help="a small shape (a CPU smoke test of this script)")
    ap.add_argument("--skip-dump", action="store_true")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    text = SMALL if a.small else TEXT
    work = a.work or tempfile.mkdtemp(prefix="eagle3-kimi-layer-")
    ckpt = os.path.join(work, "kimi-2layer-int4")
    env = {"gpu": torch.cuda.get_device_name() if DEV == "cuda" else "cpu", "torch": torch.__version__,
           "cmd": " ".join(sys.argv), "time": time.strftime("%F %T"), "shape": "small" if a.small else "kimi-k2.5"}
    rows = []

    def emit(row):
        row = {**env, **row}
        rows.append(row)
        print(json.dumps(row), flush=True)
        with open(os.path.join(a.out, "kimi_layer.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")

    t0 = time.perf_counter()
    if not os.path.isfile(os.path.join(ckpt, "config.json")):
        write_checkpoint(ckpt, text)
    files = [os.path.join(ckpt, n) for n in os.listdir(ckpt) if n.endswith(".safetensors")]
    experts_bytes = sum(os.path.getsize(p) for p in files if "experts-layer" in os.path.basename(p))
    emit({"what": "checkpoint", "seconds": round(time.perf_counter() - t0, 1),
          "bytes_total": sum(os.path.getsize(p) for p in files), "bytes_routed_experts_per_moe_layer": experts_bytes})

    from eagle3.target.capture import HiddenStateCapture
    from eagle3.target.load import find_backbone, load_target
    t0 = time.perf_counter()
    if DEV == "cuda":
        torch.cuda.reset_peak_memory_stats()
    model = load_target(ckpt, torch.bfloat16, torch.device(DEV))
    weights_gib = torch.cuda.memory_allocated() / 2**30 if DEV == "cuda" else 0.0
    emit({"what": "load", "seconds": round(time.perf_counter() - t0, 1), "weights_gib": round(weights_gib, 2),
          "peak_gib_while_loading": round(torch.cuda.max_memory_allocated() / 2**30, 2) if DEV == "cuda" else None})
    bb = find_backbone(model, text["num_hidden_layers"])
    params = {n: sum(p.numel() * p.element_size() for p in m.parameters()) +
              sum(b.numel() * b.element_size() for b in m.buffers())
              for n, m in {"embed": bb.embed_tokens, "layer0": bb.layers[0], "layer1": bb.layers[1],
                           "layer1.experts": bb.layers[1].mlp.experts, "lm_head": model.get_output_embeddings(),
                           "layer0.self_attn": bb.layers[0].self_attn, "layer0.mlp": bb.layers[0].mlp,
                           "layer1.shared_experts": bb.layers[1].mlp.shared_experts,
                           "layer1.gate": bb.layers[1].mlp.gate}.items()}
    emit({"what": "bytes_in_gpu_memory", **params})
    pieces = {"embed": bb.embed_tokens, "attn0": bb.layers[0].self_attn, "mlp0": bb.layers[0].mlp,
              "attn1": bb.layers[1].self_attn, "router1": bb.layers[1].mlp.gate,
              "experts1": bb.layers[1].mlp.experts, "shared1": bb.layers[1].mlp.shared_experts,
              "norm": bb.norm, "head": model.get_output_embeddings()}
    timer = PieceTimer(pieces)
    cap = HiddenStateCapture(bb, [1], head=model.get_output_embeddings())
    E = text["n_routed_experts"]
    shapes = [(n // 2048, 2048) for n in map(int, a.tokens.split(",")) if n]
    if a.long:
        shapes.append((1, a.long))
    if a.small:
        shapes = [(max(1, B // 16), min(T, 512)) for B, T in shapes]

    def forwards(mode):
        with cap:
            for tp in map(int, a.tp_sim.split(",")):
                for B, T in shapes:
                    if mode == "compiled" and B == 1 and tp != 8:
                        continue  # the long row: once, with the rank-of-TP-8 share
                    with dequant_mode(mode), experts_held(model, E // tp):
                        try:
                            total, med, peak = time_forward(cap, bb, timer, B, T, text["vocab_size"], a.iters)
                            r = {"forward_ms": total, "pieces_ms": med, "peak_gib_over_weights": peak,
                                 "tokens_per_s": round(B * T / total * 1e3)}
                        except torch.OutOfMemoryError as e:
                            r = {"error": f"out of memory: {str(e)[:200]}"}
                        except Exception as e:  # a compile failure is a result too
                            r = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                    emit({"what": "forward", "dequant": mode, "tp_sim": tp, "experts_held": E // tp, "rows": B,
                          "row_tokens": T, "tokens": B * T, **r})
                    if DEV == "cuda":
                        torch.cuda.empty_cache()

    modes = a.dequant.split(",")
    forwards(modes[0])
    timer.remove()
    if not a.skip_dump:  # before the other dequant modes: the dump at 131,072 tokens is the figure the issue asks
        scale = 16 if a.small else 1
        emit(dump_end_to_end(ckpt, model, work, "chat2k", n=max(2, 64 // scale), tokens_per_turn=1000 // scale,
                             max_length=2048, batch_tokens=16384 // scale, layers=[1]))
        if a.long:
            n = a.long if not a.small else 1024
            emit(dump_end_to_end(ckpt, model, work, f"long{n}", n=1, tokens_per_turn=n * 6 // 10, max_length=n,
                                 batch_tokens=16384 // scale, layers=[1]))
    timer = PieceTimer(pieces)
    for mode in modes[1:]:
        forwards(mode)
    timer.remove()
    if not a.work:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
