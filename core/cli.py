"""The `eagle3` command: one subcommand per pipeline stage (dump -> vocab -> train -> export -> eval)."""

from __future__ import annotations

import argparse
import sys

from eagle3.contract import ContractError, parse_indices

EXAMPLE = "example"


def _add_dump(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, help="target model directory, or 'example' (SmolLM2-135M-Instruct)")
    p.add_argument("--data", nargs="+", required=True,
                   help="conversation files (.jsonl/.json/.parquet; ShareGPT or messages), or 'example' (ShareGPT)")
    p.add_argument("--out", required=True, help="output directory (shards + manifest.json); rerun to resume")
    p.add_argument("--preset", default=None,
                   help="configs/targets preset (e.g. kimi-k2.5): checks the target and supplies defaults")
    p.add_argument("--layers", type=parse_indices, default=None,
                   help="HF hidden_states indices to capture, e.g. 3,31,59 (default: preset, else 3, L//2+1, L-2)")
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel size (world = dp x tp under torchrun)")
    p.add_argument("--max-length", type=int, default=None, help="truncate conversations (default 2048)")
    p.add_argument("--batch-tokens", type=int, default=16384, help="padded tokens per forward")
    p.add_argument("--num-samples", type=int, default=None, help="dump at most this many conversations")
    p.add_argument("--dtype", default=None, help="bf16 | fp16 | fp32 (model and stored dtype; default bf16)")
    p.add_argument("--shard-size-mb", type=float, default=1024.0)
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda if available)")
    p.add_argument("--no-record-argmax", action="store_true",
                   help="do not store the target's full-vocab argmax per token (4 B/token; lets training multiply "
                        "only the draft-vocab rows of the target head)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--stop-after-shards", type=int, default=None, help=argparse.SUPPRESS)


def resolve_example(target: str, data: list[str]) -> tuple[str, list[str]]:
    """'example' stands for the embedded default target/data; anything else is a path."""
    if target == EXAMPLE:
        from eagle3.dump.example import example_target_dir
        target = example_target_dir()
    if data == [EXAMPLE]:
        from eagle3.dump.conversations import example_sharegpt_jsonl
        data = [example_sharegpt_jsonl()[0]]
    return target, data


def cmd_dump(a: argparse.Namespace) -> None:
    from eagle3 import presets
    from eagle3.dump.job import DumpConfig, run_dump
    from eagle3.dump.targets import read_config, text_config_dict
    target, data = resolve_example(a.target, a.data)
    defaults = {"layers": None, "tp": 1, "max_length": 2048, "dtype": "bf16"}
    if a.preset:
        preset = presets.load("targets", a.preset)
        cfg = read_config(target)
        presets.check_target_expectations(a.preset, preset, text_config_dict(cfg), cfg.get("model_type", ""))
        defaults.update(preset.get("dump", {}))
    opt = {k: getattr(a, k) if getattr(a, k) is not None else v for k, v in defaults.items()}
    run_dump(DumpConfig(target=target, data=data, out=a.out, layers=opt["layers"], tp=opt["tp"],
                        max_length=opt["max_length"], batch_tokens=a.batch_tokens, num_samples=a.num_samples,
                        dtype=opt["dtype"],
                        shard_size_mb=a.shard_size_mb, device=a.device, progress=not a.no_progress,
                        record_argmax=not a.no_record_argmax, stop_after_shards=a.stop_after_shards))


def cmd_example_target(a: argparse.Namespace) -> None:
    from eagle3.dump.example import example_target_dir
    print(example_target_dir())


def cmd_quickstart(a: argparse.Namespace) -> None:
    """The main job on the embedded default: dump -> vocab -> train -> export -> eval, then a summary."""
    from eagle3.quickstart import QuickstartConfig, run_quickstart
    run_quickstart(QuickstartConfig(out=a.out, num_samples=a.num_samples, max_length=a.max_length,
                                    train_steps=a.train_steps, token_budget=a.token_budget,
                                    draft_steps=a.draft_steps, eval_prompts=a.eval_prompts,
                                    max_new_tokens=a.max_new_tokens, device=a.device, data=a.data))


def cmd_eval(a: argparse.Namespace) -> None:
    import json
    from eagle3.eval.speculative import evaluate
    target, _ = resolve_example(a.target, [])
    rep = evaluate(target, a.drafter, a.prompts, draft_steps=a.draft_steps, max_new_tokens=a.max_new_tokens,
                   num_prompts=a.num_prompts, out=a.out, dtype=a.dtype, device=a.device)
    keys = ("acceptance_length", "acceptance_rate_per_position", "tokens_per_target_forward", "speedup", "lossless",
            "capture_indices", "prompts", "generated_tokens")
    print(json.dumps({k: rep[k] for k in keys}, indent=1))
    if not rep["lossless"]:
        raise SystemExit(f"speculative output differs from target-only greedy on {len(rep['mismatches'])} prompts")


def cmd_vocab(a: argparse.Namespace) -> None:
    from eagle3.data.dumps import DumpSet, split
    from eagle3.data.vocab import build_vocab, save_vocab
    ds = DumpSet(a.dump, verify=not a.no_verify, progress=True)
    train, _ = split(ds.refs, a.held_out_fraction, a.seed)
    vocab = build_vocab(ds, train, a.draft_vocab_size, progress=True)
    save_vocab(a.out, vocab)
    m = vocab["meta"]
    print(f"draft vocab {m['draft_vocab_size']} of {m['vocab_size']} ids: coverage {m['coverage']:.2%} of "
          f"{m['counted_tokens']:,} loss-masked tokens in {m['samples']:,} training samples "
          f"({m['distinct_tokens']:,} distinct) -> {a.out}")


def cmd_inspect(a: argparse.Namespace) -> None:
    import json
    from eagle3.data.inspect import inspect_path, render
    report = inspect_path(a.path, verify=not a.no_verify)
    print(json.dumps(report, indent=1) if a.json else render(report))
    if str(report.get("verified", "")).startswith("FAILED"):
        raise SystemExit(1)


def cmd_train(a: argparse.Namespace) -> None:
    from eagle3.train.config import from_args
    from eagle3.train.trainer import train
    train(from_args(a))


def add_split_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--held-out-fraction", type=float, default=0.02,
                   help="share of samples (by sample_index) kept out of training for evaluation")
    p.add_argument("--seed", type=int, default=0)


def cmd_export_sglang(a: argparse.Namespace) -> None:
    from eagle3.export.sglang import export_drafter
    prov = export_drafter(a.run, a.out, step=a.step, engine=a.engine, sglang_version=a.sglang_version,
                          allow_cuda_graph_mismatch=a.allow_cuda_graph_mismatch)
    where = f"SGLang {prov['sglang_release']}" if prov["engine"] == "sglang" else "vLLM"
    print(f"exported step {prov['step']} of {a.run} -> {a.out}")
    print(f"eagle_aux_hidden_state_layer_ids: {prov['eagle_aux_hidden_state_layer_ids']}")
    print(f"{where} will capture HF {prov['served_capture_indices']} (trained on HF "
          f"{prov['capture']['hidden_state_indices']})")
    for note in prov["notes"]:
        print(f"note: {note}")
    print(prov["server_command"])


def _step_arg(text: str) -> int | str:
    if text == "best":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--step {text!r}: a step number or 'best'") from None


def _add_export_sglang(sub) -> None:
    from eagle3.contract import SGLANG_LATEST
    p = sub.add_parser("export-sglang", help="export a trained drafter for SGLang (LlamaForCausalLMEagle3) or vLLM")
    p.add_argument("--run", required=True, help="training run directory (eagle3 train --out)")
    p.add_argument("--step", type=_step_arg, default=None,
                   help="checkpoint step, or 'best' (best held-out decoding acceptance; default: the latest)")
    p.add_argument("--out", required=True, help="output directory (config.json, model.safetensors, provenance)")
    p.add_argument("--sglang-version", default=SGLANG_LATEST,
                   help=f"SGLang release the ids are computed for (default {SGLANG_LATEST})")
    p.add_argument("--engine", choices=["sglang", "vllm"], default="sglang")
    p.add_argument("--allow-cuda-graph-mismatch", action="store_true",
                   help="SGLang <= 0.5.10.post1 with a non-default capture set: export anyway (serve with "
                        "--disable-cuda-graph)")
    p.set_defaults(fn=cmd_export_sglang)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="eagle3", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("dump", help="capture the target's hidden states into sharded safetensors")
    _add_dump(p)
    p.set_defaults(fn=cmd_dump)
    p = sub.add_parser("vocab", help="draft vocabulary (d2t/t2d) from the training split of dumps")
    p.add_argument("--dump", nargs="+", required=True)
    p.add_argument("--draft-vocab-size", type=int, required=True)
    p.add_argument("--out", required=True, help="output .safetensors file")
    p.add_argument("--no-verify", action="store_true", help="skip the shard sha256 check")
    add_split_args(p)
    p.set_defaults(fn=cmd_vocab)
    p = sub.add_parser("train", help="fit the drafter with DeepSpeed (launch with `deepspeed --module eagle3.train`)")
    from eagle3.train.config import add_arguments
    add_arguments(p)
    p.set_defaults(fn=cmd_train)
    p = sub.add_parser("inspect", help="describe and verify a dump directory")
    p.add_argument("path")
    p.add_argument("--json", action="store_true")
    p.add_argument("--no-verify", action="store_true")
    p.set_defaults(fn=cmd_inspect)
    p = sub.add_parser("example-target", help="convert (once) and print the example target directory")
    p.set_defaults(fn=cmd_example_target)
    from eagle3.quickstart import QuickstartConfig
    q = QuickstartConfig()
    p = sub.add_parser("quickstart", help="the whole pipeline on the embedded default (SmolLM2-135M + ShareGPT)")
    p.add_argument("--out", default=q.out)
    p.add_argument("--num-samples", type=int, default=q.num_samples, help="conversations to dump")
    p.add_argument("--max-length", type=int, default=q.max_length)
    p.add_argument("--train-steps", type=int, default=None, help="default: 160 on a CPU, 600 on a GPU")
    p.add_argument("--token-budget", type=int, default=None, help="padded tokens per training step")
    p.add_argument("--draft-steps", type=int, default=q.draft_steps, help="chain length in the eval")
    p.add_argument("--eval-prompts", type=int, default=q.eval_prompts)
    p.add_argument("--max-new-tokens", type=int, default=q.max_new_tokens)
    p.add_argument("--device", default=None)
    p.add_argument("--data", default=None, help="a .jsonl of conversations instead of the packaged ShareGPT")
    p.set_defaults(fn=cmd_quickstart)
    p = sub.add_parser("eval", help="speculative decoding with the target and an exported drafter, as SGLang runs it")
    p.add_argument("--target", required=True, help="target model directory, or 'example'")
    p.add_argument("--drafter", required=True, help="export directory (from export-sglang)")
    p.add_argument("--prompts", required=True, help="conversation file; the first user turn of each is a prompt")
    p.add_argument("--draft-steps", type=int, default=5)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=20)
    p.add_argument("--out", default=None, help="write eval.json and acceptance.png here")
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--device", default=None)
    p.set_defaults(fn=cmd_eval)
    _add_export_sglang(sub)
    return ap


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        args.fn(args)
    except (ContractError, ValueError, FileNotFoundError) as e:
        print(f"eagle3 {args.cmd}: error: {e}", file=sys.stderr)
        raise SystemExit(2)


if __name__ == "__main__":
    main()
