"""How fast can `eagle3 regenerate --engine hf` write answers on this GPU? Times transformers' padded `generate`
(the engine's path) on a random-weight model of the example target's shape (SmolLM2-135M: speed does not depend on
the weights; every row is forced to the full answer length, as most example answers run to the cap), over rows,
dtypes and KV cache kinds. Prints one JSON line per setting; results go to bench/quality.md.

    python bench/regen_throughput.py --rows 512 1024 2048 --dtypes bf16 fp32 --caches dynamic static
"""

from __future__ import annotations

import argparse
import json
import time

# SmolLM2-135M-Instruct's config.json (the example target), so the bench needs no model files.
EXAMPLE_SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                     num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0,
                     rms_norm_eps=1e-5, tie_word_embeddings=True)


def main() -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[512, 1024, 2048])
    ap.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"])
    ap.add_argument("--caches", nargs="+", default=["dynamic"])
    ap.add_argument("--prompt-tokens", type=int, default=256, help="longest prompt; rows are 1/4..1 of it")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--max-rows-tokens", type=int, default=2048 * 512, help="skip settings above rows x length")
    args = ap.parse_args()
    dev = torch.device("cuda")
    for dt in args.dtypes:
        dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dt]
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**EXAMPLE_SHAPE)).to(dev, dtype).eval()
        for cache in args.caches:
            for rows in args.rows:
                if rows * (args.prompt_tokens + args.new_tokens) > args.max_rows_tokens:
                    continue
                g = torch.Generator().manual_seed(rows)
                lens = torch.randint(args.prompt_tokens // 4, args.prompt_tokens + 1, (rows,), generator=g)
                ids = torch.randint(10, EXAMPLE_SHAPE["vocab_size"], (rows, args.prompt_tokens), generator=g)
                mask = (torch.arange(args.prompt_tokens)[None] >= (args.prompt_tokens - lens)[:, None]).long()
                gc = GenerationConfig(do_sample=False, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                                      eos_token_id=2, pad_token_id=2, use_cache=True,
                                      cache_implementation="static" if cache == "static" else None)
                rec = {"rows": rows, "dtype": dt, "cache": cache, "prompt_tokens": args.prompt_tokens,
                       "new_tokens": args.new_tokens}
                try:
                    times = []
                    for _ in range(2):  # the first call pays warm-up (and compilation for the static cache)
                        torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        with torch.no_grad():
                            out = model.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev),
                                                 generation_config=gc)
                        torch.cuda.synchronize()
                        times.append(time.perf_counter() - t0)
                    new = out.shape[1] - args.prompt_tokens
                    rec.update(first_s=round(times[0], 2), s=round(times[1], 2),
                               tok_s=round(rows * new / times[1]), ms_per_step=round(1000 * times[1] / new, 1),
                               peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 1))
                except Exception as e:  # noqa: BLE001 - a setting that fails is a result too
                    rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                torch.cuda.reset_peak_memory_stats()
                torch.cuda.empty_cache()
                print(json.dumps(rec), flush=True)
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
