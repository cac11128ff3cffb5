#!/usr/bin/env python3
"""The dump on one GPU against its two bounds, in one run (bench/RESULTS.md):

  python bench/dump_bench.py --out DIR [--targets llama8b,dsv3moe] [--tokens 327680] [--disk DIR]

For each target (random init, bf16, built straight on the GPU; only config + tokenizer are on disk):
  forward_bound  the plain CausalLM forward (logits included) on 8 x 2048-token batches, tokens/s (median of 5)
  disk_bound     bytes/token of the dump over the disk's measured write rate (4 GiB written + fsync, median of 2)
  dump           `run_dump` end to end minus sample loading and model construction: forwards with the capture
                 hooks and the argmax, async device->host copies, shard writes with sha256, sidecars, manifest
Conversations are synthetic (random words, ~2000 tokens each, one per 2048-token row). Writes DIR/dump_bench.jsonl.
"""
import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

TARGETS = {
    # Llama-3-8B's shape (vocab 128256)
    "llama8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
                    max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=False),
    # DeepseekV3's layer types (MLA, first dense layer, routed + shared experts), sized to fit one GPU: ~9B params
    "dsv3moe": dict(model_type="deepseek_v3", hidden_size=4096, intermediate_size=11264, moe_intermediate_size=1408,
                    num_hidden_layers=12, num_attention_heads=32, num_key_value_heads=32, n_routed_experts=64,
                    num_experts_per_tok=6, n_shared_experts=2, first_k_dense_replace=1, n_group=8, topk_group=4,
                    q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                    vocab_size=129280, max_position_embeddings=8192, rms_norm_eps=1e-6, tie_word_embeddings=False,
                    rope_scaling=None),
    # a smoke test of this script on a CPU
    "tiny": dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=600, max_position_embeddings=4096, tie_word_embeddings=False),
}
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def make_target_dir(name: str, root: str) -> str:
    from transformers import AutoConfig
    from tiny_tokenizers import make_word_tokenizer
    spec = dict(TARGETS[name])
    cfg = AutoConfig.for_model(spec.pop("model_type"), **spec)
    path = os.path.join(root, name)
    cfg.save_pretrained(path)
    make_word_tokenizer().save_pretrained(path)
    return path


def write_conversations(path: str, n: int, words_per_turn: int = 980, seed: int = 0) -> str:
    from tiny import WORDS
    g = torch.Generator().manual_seed(seed)

    def text(k):
        return " ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (k,), generator=g))
    with open(path, "w") as f:
        for _ in range(n):
            f.write(json.dumps({"conversations": [{"from": "human", "value": text(words_per_turn)},
                                                  {"from": "gpt", "value": text(words_per_turn)}]}) + "\n")
    return path


def random_model(path: str):
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.from_pretrained(path)
    torch.manual_seed(0)
    with torch.device(DEV):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    return model.eval()


def forward_bound(model, vocab: int, B=8, T=2048, iters=5) -> float:
    ids = torch.randint(0, vocab, (B, T), device=DEV)
    mask = torch.ones_like(ids)
    times = []
    with torch.no_grad():
        for i in range(iters + 2):
            sync()
            t0 = time.perf_counter()
            model(input_ids=ids, attention_mask=mask, use_cache=False)
            sync()
            if i >= 2:
                times.append(time.perf_counter() - t0)
    return B * T / statistics.median(times)


def disk_rate(d: str, gib: int = 4) -> float:
    buf = torch.randint(0, 255, (256 << 20,), dtype=torch.uint8).numpy()  # 256 MiB of non-zero bytes
    rates = []
    for r in range(2):
        p = os.path.join(d, f".disk-probe-{r}")
        t0 = time.perf_counter()
        with open(p, "wb", buffering=0) as f:
            for _ in range(gib * 4):
                f.write(buf)
            os.fsync(f.fileno())
        rates.append(gib * 2**30 / (time.perf_counter() - t0))
        os.remove(p)
    return statistics.median(rates)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    ap.add_argument("--targets", default="llama8b,dsv3moe")
    ap.add_argument("--tokens", type=int, default=327680, help="tokens to dump per target (~160 conversations)")
    ap.add_argument("--probe-gib", type=int, default=4)
    ap.add_argument("--disk", default=None, help="where the dump and disk probe write (default: a temp dir)")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    from eagle3.conversations import masking
    from eagle3.target import load as targets
    from eagle3.conversations.masking import load_samples
    from eagle3.dump.job import DumpConfig, run_dump
    from eagle3.contract import load_manifest
    root = a.disk or tempfile.mkdtemp(prefix="eagle3-dump-bench-")
    os.makedirs(root, exist_ok=True)
    rate = disk_rate(root, gib=a.probe_gib)
    env = {"gpu": torch.cuda.get_device_name() if DEV == "cuda" else "cpu", "torch": torch.__version__, "cmd": " ".join(sys.argv),
           "disk_write_gb_s": round(rate / 1e9, 3), "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    print(json.dumps(env), flush=True)
    for name in a.targets.split(","):
        tdir = make_target_dir(name, root)
        model = random_model(tdir)
        fwd = forward_bound(model, TARGETS[name]["vocab_size"], T=2048 if DEV == "cuda" else 256)
        setup = {}
        targets.load_target = lambda *args, **kw: model  # built above: the bench times the dump, not weight I/O

        def timed_samples(*args, **kw):
            t0 = time.perf_counter()
            r = load_samples(*args, **kw)
            setup["samples_s"] = time.perf_counter() - t0
            return r
        masking.load_samples = timed_samples
        data = write_conversations(os.path.join(root, f"{name}.jsonl"), n=max(1, a.tokens // 1990))
        out = os.path.join(root, f"dump-{name}")
        t0 = time.perf_counter()
        run_dump(DumpConfig(target=tdir, data=[data], out=out, max_length=2048, batch_tokens=16384,
                            dtype="bf16", progress=False))
        total = time.perf_counter() - t0
        m = load_manifest(out)
        toks, nbytes = m.totals["tokens"], m.totals["bytes"]
        dump_s = total - setup["samples_s"]
        bpt = nbytes / toks
        H = TARGETS[name]["hidden_size"]
        row = {"target": name, "hidden": H, "tokens": toks, "bytes_per_token": round(bpt, 1),
               "bytes_per_token_8H": 8 * H, "forward_bound_tok_s": round(fwd), "disk_bound_tok_s": round(rate / bpt),
               "dump_tok_s": round(toks / dump_s), "dump_s": round(dump_s, 2),
               "setup_samples_s": round(setup["samples_s"], 2)}
        row["ratio_to_min_bound"] = round(row["dump_tok_s"] / min(row["forward_bound_tok_s"], row["disk_bound_tok_s"]), 3)
        print(json.dumps(row), flush=True)
        with open(os.path.join(a.out, "dump_bench.jsonl"), "a") as f:
            f.write(json.dumps({**env, **row}) + "\n")
        del model
        torch.cuda.empty_cache()
        shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
