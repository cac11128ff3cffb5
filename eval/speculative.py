"""`eagle3 eval`: real speculative decoding with the HF target and an exported drafter, the way SGLang runs it.

The drafter is read ONLY from the export directory (config.json, model.safetensors with d2t); which target hidden
states feed it is derived from the export's `eagle_aux_hidden_state_layer_ids` with the serving rule of the release
its provenance names -- never from the training manifest. The export is verified first (load_export: weights'
sha256, shapes against config.json, ids against the provenance's trained capture): ids that disagree, or an export
without provenance, are refused unless `allow_foreign_export` (--allow-foreign-export), with which an export with
wrong ids shows up here as low acceptance, as it would in production. The token embedding is the target's own, as
in SGLang.

Prompts: the first user turn of each conversation (ShareGPT / messages), or the first question of each MT-bench
record ({"turns": [...]}).

One round (batch size 1, greedy, chain of K):
  the target has processed positions < P and produced token x (position P);
  drafter: K chained steps from its last state -> d1..dK;
  target: one forward over [x, d1..dK] -> its greedy tokens y0..yK; accept d1..dn while d_i == y_{i-1}, plus y_n;
  both KV caches are cropped to the accepted positions; the drafter re-reads the target's aux states at the newly
  accepted positions (step 0, "extend") before drafting again.
The output must equal target-only greedy decoding token for token (checked and reported).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

from eagle3 import contract as C
from eagle3.contract import ContractError
# the dump's reader: .jsonl/.json/.parquet, errors by line
from eagle3.conversations.formats import DataError, _iter_records, normalize_record
from eagle3.eval import chain_length as CL  # --draft-steps auto
from eagle3.model import Eagle3Drafter
from eagle3.model.checkpoint import capture_indices_of_export, export_drafter_config, load_export
from eagle3.options import TRUST_REMOTE_CODE_HELP, opt
from eagle3.target.capture import HiddenStateCapture
from eagle3.target.load import (DTYPES, find_backbone, load_target, load_tokenizer, read_config, target_info,
                                text_config_dict, tokenizer_info)
from eagle3.target.prepack import choose_one_row_path, prepack_linears
from eagle3.train.acceptance import ChainStats  # one round bookkeeping for eval and training's replay


def load_drafter_from_export(export_dir: str, target_embedding: torch.Tensor, dtype: torch.dtype,
                             device: torch.device, allow_foreign: bool = False, export=None):
    """An Eagle3Drafter built from the export alone (plus the target's embedding, which SGLang shares).
    `export`: load_export's result when the caller has it already (read and verified once)."""
    config, tensors, prov = export or load_export(export_dir, allow_foreign=allow_foreign)
    drafter = Eagle3Drafter(export_drafter_config(config, prov, export_dir))
    missing, unexpected = drafter.load_state_dict(tensors, strict=False)
    if set(missing) != {"embed_tokens.weight"} or unexpected:
        raise ValueError(f"{export_dir}: export does not fit the drafter (missing {missing}, unexpected {unexpected})")
    drafter.load_target_embedding(target_embedding.detach().float())
    return drafter.to(device=device, dtype=dtype).eval()


class SpeculativeDecoder:
    def __init__(self, target, backbone, drafter, capture_indices: list[int], eos_ids: set[int]):
        self.target, self.backbone, self.drafter = target, backbone, drafter
        self.indices = list(capture_indices)
        self.eos = set(eos_ids)
        self.device = next(target.parameters()).device

    def _target_forward(self, ids: torch.Tensor, cache, cap: HiddenStateCapture):
        from transformers import DynamicCache
        cache = cache if cache is not None else DynamicCache(config=self.target.config)
        out = self.target(input_ids=ids, cache=cache, use_cache=True)
        aux = torch.cat([cap.states[C.hidden_state_key(k)] for k in self.indices], dim=-1)
        return out.logits[0].argmax(-1), aux, cache

    @torch.no_grad()
    def greedy(self, prompt: list[int], max_new: int) -> tuple[list[int], int]:
        """Target-only greedy decoding with a KV cache (the baseline). Returns (tokens, target forwards)."""
        from transformers import DynamicCache
        ids = torch.tensor([prompt], device=self.device)
        cache, out_tokens, forwards = DynamicCache(config=self.target.config), [], 0
        while len(out_tokens) < max_new:
            logits = self.target(input_ids=ids, cache=cache, use_cache=True).logits
            forwards += 1
            tok = int(logits[0, -1].argmax())
            out_tokens.append(tok)
            if tok in self.eos:
                break
            ids = torch.tensor([[tok]], device=self.device)
        return out_tokens, forwards

    @torch.no_grad()
    def generate(self, prompt: list[int], max_new: int, K: int) -> tuple[list[int], ChainStats]:
        dr, dev = self.drafter, self.device
        stats = ChainStats(K)
        with HiddenStateCapture(self.backbone, self.indices) as cap:
            ids = torch.tensor([prompt], device=dev)
            y, aux, tcache = self._target_forward(ids, None, cap)
            stats.target_forwards += 1
            x = int(y[-1])                     # token at position P
            out_tokens = [x]
            P = len(prompt)
            # drafter step 0 over the prompt: position t reads aux[t] and token t+1
            nxt = torch.tensor([prompt[1:] + [x]], device=dev)
            m, dcache = dr.forward_step(dr.project_aux(aux), nxt, torch.arange(P, device=dev)[None], None)
            committed = P                      # positions whose step-0 drafter K/V is in dcache
            while x not in self.eos and len(out_tokens) < max_new:
                # chain drafting from the last committed position
                h, cache, drafts = m[:, -1:], dcache, []
                for j in range(K):
                    drafts.append(int(dr.target_ids(dr.draft_logits(h)[0, -1].argmax())))
                    if j + 1 < K:
                        pos = torch.tensor([[committed + j]], device=dev)
                        h, cache = dr.forward_step(h, torch.tensor([[drafts[-1]]], device=dev), pos, cache)
                # verify [x, d1..dK] at positions P..P+K in one target forward
                y, aux, tcache = self._target_forward(torch.tensor([[x] + drafts], device=dev), tcache, cap)
                stats.target_forwards += 1
                y = y.tolist()
                n = 0
                while n < K and drafts[n] == y[n]:
                    n += 1
                stats.add_round(n)
                new = drafts[:n] + [y[n]]
                if n < K:  # drop the target K/V of the rejected drafts (transformers' crop takes a count to drop)
                    tcache.crop(-(K - n))
                # drafter: drop the chain's K/V, re-read the accepted positions with the target's aux states
                dcache = tuple(t[:, :, :committed] for t in dcache)
                nxt = torch.tensor([new], device=dev)
                pos = torch.arange(committed, committed + n + 1, device=dev)[None]
                m, dcache = dr.forward_step(dr.project_aux(aux[:, : n + 1]), nxt, pos, dcache)
                committed += n + 1
                P += n + 1
                x = new[-1]
                for t in new:
                    out_tokens.append(t)
                    if t in self.eos or len(out_tokens) >= max_new:
                        break
                if out_tokens[-1] in self.eos or len(out_tokens) >= max_new:
                    break
        out_tokens = out_tokens[:max_new]
        stats.new_tokens = len(out_tokens)
        return out_tokens, stats


def _first_user_turn(record, origin: str) -> str | None:
    """The prompt of one record: MT-bench's {"turns": [question, follow-up, ...]} gives its first question (the
    follow-ups need the target's own first answer in the history, which a one-turn prompt has not); a
    conversation (ShareGPT / messages) its first non-empty user turn. None: no usable turn."""
    if isinstance(record, dict) and record.get("turns") is not None and record.get("messages") is None \
            and record.get("conversations") is None:
        turns = record["turns"]
        if not isinstance(turns, (list, tuple)) or not all(isinstance(t, str) for t in turns):
            raise DataError(f"{origin}: 'turns' (MT-bench) must be a list of strings, got {turns!r:.80}")
        return turns[0] if turns and turns[0].strip() else None
    users = [m for m in normalize_record(record, origin) if m["role"] == "user" and m["content"].strip()]
    return users[0]["content"] if users else None


def read_prompts(path: str, tokenizer, num_prompts: int | None,
                 max_tokens: int | None = None) -> list[list[int]]:
    """One prompt per record (see _first_user_turn), rendered with the chat template and a generation prompt. A
    prompt over max_tokens (what the target's positions leave after the answer and the draft) is refused by name:
    the target would run past the positions it knows, for minutes at a 1M-token prompt."""
    prompts = []
    for origin, record in _iter_records(path):
        text = _first_user_turn(record, origin)
        if text is None:
            continue
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                            add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        if max_tokens is not None and len(ids) > max_tokens:
            raise DataError(f"{origin}: a prompt of {len(ids):,} tokens; the target's max_position_embeddings leave "
                            f"{max_tokens:,} for a prompt with --max-new-tokens and the draft chain: shorten it or "
                            "leave it out")
        prompts.append(list(ids))
        if num_prompts and len(prompts) >= num_prompts:
            break
    if not prompts:
        raise ValueError(f"{path}: no conversation with a user turn (or MT-bench question) to use as a prompt")
    return prompts


def plot_acceptance(report: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rates = report["acceptance_rate_per_position"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(range(1, len(rates) + 1), rates, color="#4472c4")
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate (given reached)")
    ax.set_ylim(0, 1)
    ax.set_title(f"acceptance length {report['acceptance_length']:.2f}, K={report['draft_steps']}, "
                 f"speedup {report['speedup']:.2f}x")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def draft_steps_arg(text: str) -> int | str:
    """--draft-steps: a positive chain length, or 'auto'."""
    if text == "auto":
        return text
    try:
        k = int(text)
    except ValueError:
        k = 0
    if k < 1:
        raise argparse.ArgumentTypeError(f"--draft-steps {text!r}: a positive chain length or 'auto'")
    return k


@dataclass
class EvalConfig:
    """`eagle3 eval`'s flags: evaluate()'s arguments, whose defaults are these."""
    target_dir: str = opt(help="target model directory, or 'example'", flag="target")
    export_dir: str = opt(help="export directory (from export-sglang)", flag="drafter")
    prompts_file: str = opt(help="conversations (ShareGPT / messages: the first user turn of each is a prompt) or "
                                 "MT-bench questions ({\"turns\": [...]}: the first turn of each is a prompt); "
                                 ".jsonl/.json/.parquet", flag="prompts")
    draft_steps: int | str = opt(5, "draft chain length: tokens proposed per round, or 'auto': the length with the "
                                    "best predicted speedup, from the held-out replay at every length that the "
                                    "export's provenance records (eagle3 train's checkpoints/best) and the costs of a "
                                    "target verify forward, a draft step and the rest of a round measured here first; "
                                    "eval.json then holds every length's prediction and the predicted speedup beside "
                                    "the measured one", type=draft_steps_arg)
    max_new_tokens: int = opt(128, "tokens decoded per prompt")
    num_prompts: int | None = opt(20, "prompts decoded (the first ones of --prompts)")
    out: str | None = opt(None, "write eval.json and acceptance.png here")
    dtype: str = opt("fp32", "target and drafter dtype, on a GPU too: fp32 makes the lossless check exact (bf16 "
                             "verification can flip near-ties against bf16 one-token decoding)",
                     choices=["fp32", "bf16", "fp16"])
    device: str | None = opt(None, "cpu | cuda (default: cuda if available)")
    allow_foreign_export: bool = opt(False, "evaluate a drafter from elsewhere: an export without "
                                            "eagle3_provenance.json (its ids are read as the latest known SGLang "
                                            "release reads them for this target) or one whose ids disagree with its "
                                            "provenance (a warning instead of a refusal). Shapes, and the sha256 a "
                                            "provenance records, are checked regardless")
    trust_remote_code: bool = opt(False, TRUST_REMOTE_CODE_HELP)
    prepack: bool = opt(True, "on a CPU, keep PyTorch's plain Linear instead of oneDNN prepacked weights (which make "
                              "a (K+1)-token verify forward cost close to a 1-token one; the baseline uses them "
                              "too)")  # the help of its switch, --no-prepack
    progress: bool = True  # no flag


def evaluate(target_dir: str, export_dir: str, prompts_file: str, draft_steps: int | str = EvalConfig.draft_steps,
             max_new_tokens: int = EvalConfig.max_new_tokens, num_prompts: int | None = EvalConfig.num_prompts,
             out: str | None = EvalConfig.out, dtype: str = EvalConfig.dtype, device: str | None = EvalConfig.device,
             progress: bool = EvalConfig.progress, allow_foreign_export: bool = EvalConfig.allow_foreign_export,
             trust_remote_code: bool = EvalConfig.trust_remote_code, prepack: bool = EvalConfig.prepack) -> dict:
    """`prepack`: on a CPU in fp32, run every Linear of the target and the drafter through oneDNN prepacked
    weights (target/prepack.py says why; both the baseline and speculative decoding use them).
    `allow_foreign_export`: evaluate a drafter from elsewhere -- an export without provenance (served as the
    latest known SGLang release would serve it for this target) or one whose ids disagree with its provenance.
    `trust_remote_code`: run the tokenizer code the target ships (Kimi-K2.5), refused otherwise.
    `draft_steps` "auto": the chain length with the best predicted speedup on this machine, from the held-out replay
    the export records at every length and the costs measured here first (eval/chain_length.py); the report holds
    every length's prediction and, beside the measured speedup, the predicted one."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    tdtype = DTYPES[dtype]
    # Verified (sha256, ids vs provenance, shapes) before the target is loaded: a bad export fails fast.
    export = load_export(export_dir, allow_foreign=allow_foreign_export)
    prov = export[2]
    auto = draft_steps == "auto"
    if auto:  # refused before anything loads when the export cannot say what each length accepts
        replay = CL.replay_by_steps(prov.heldout if prov is not None else None, export_dir)
        draft_steps = max(replay)
    elif not isinstance(draft_steps, int) or draft_steps < 1:
        raise ValueError(f"draft_steps must be a positive integer or 'auto', got {draft_steps!r}")
    info = target_info(target_dir, like=prov.target.weights_sha256 if prov is not None else None)
    indices = capture_indices_of_export(export_dir, info.num_hidden_layers, target_model_type=info.model_type,
                                        allow_foreign=allow_foreign_export)
    tokenizer = load_tokenizer(target_dir, trust_remote_code=trust_remote_code)
    if prov is not None and not allow_foreign_export:  # the drafter was trained for this target, weights included
        mine = C.target_identity(info, tokenizer_info(tokenizer))
        # an export made before provenance recorded the identity: its target's config and weights
        theirs = {k: prov.identity.get(k) for k in mine} if prov.identity else \
            {k: v for k, v in C.target_identity(prov.target).items() if k in ("target.config_sha256",
                                                                          "target.weights_sha256")}
        C.require_same_capture(theirs, {k: mine[k] for k in theirs}, f"the export {export_dir} (trained for)",
                               f"--target {target_dir}")
    drafter_for = export[0]["target_hidden_size"]
    if drafter_for != info.hidden_size:  # fc would not fit the captured states
        raise ContractError(f"{export_dir}/config.json: target_hidden_size {drafter_for}, but the target "
                            f"{target_dir} has hidden_size {info.hidden_size}")
    max_pos = text_config_dict(read_config(target_dir)).get("max_position_embeddings")
    prompts = read_prompts(prompts_file, tokenizer, num_prompts,  # before the target loads: bad input fails fast
                           max_pos - max_new_tokens - draft_steps - 1 if isinstance(max_pos, int) else None)
    target = load_target(target_dir, tdtype, dev)
    backbone = find_backbone(target, info.num_hidden_layers)
    drafter = load_drafter_from_export(export_dir, target.get_input_embeddings().weight, tdtype, dev, export=export)
    packed, one_row = 0, None
    if prepack and dev.type == "cpu" and tdtype == torch.float32:
        packed = prepack_linears(target, rows_hint=draft_steps + 1) + prepack_linears(drafter, rows_hint=1)
        # the baseline's step decides the target's one-row path: greedy must run as fast as it can here
        one_row = choose_one_row_path(target, CL.greedy_step_after(target, prompts[0], dev)[0])
    eos = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    gen_eos = getattr(getattr(target, "generation_config", None), "eos_token_id", None)
    eos |= set(gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else [])
    dec = SpeculativeDecoder(target, backbone, drafter, indices, eos)
    choice = None
    if auto:
        costs = CL.measure_costs(dec, prompts[0], max(replay))
        CL.calibrate(dec, prompts[0], costs, max(replay))
        predictions = CL.predict(costs, replay)
        draft_steps = CL.choose(predictions)
        choice = {"mode": "auto", "costs_s": costs, "chosen": draft_steps,
                  "predicted": [{"steps": k, **v} for k, v in predictions.items()],
                  "predicted_decode_speedup": predictions[draft_steps]["decode_speedup"]}
        if progress:
            print("[eval] --draft-steps auto: predicted decode speedup by chain length "
                  + ", ".join(f"{k}: {v['decode_speedup']:.2f}x" for k, v in predictions.items())
                  + f" -> {draft_steps}", flush=True)

    total = ChainStats(draft_steps)
    spec_time = base_time = 0.0
    base_forwards = base_tokens = 0
    mismatches, per_prompt = [], []
    for i, p in enumerate(tqdm(prompts, desc="eval", unit="prompt", disable=not progress)):
        t0 = time.perf_counter()
        ref, fwd = dec.greedy(p, max_new_tokens)
        base_time += time.perf_counter() - t0
        base_forwards += fwd
        base_tokens += len(ref)
        t0 = time.perf_counter()
        got, st = dec.generate(p, max_new_tokens, draft_steps)
        spec_time += time.perf_counter() - t0
        total.merge(st)
        per_prompt.append({"tokens": ref, "verify_steps": st.verify_steps, "round_tokens": st.round_tokens,
                           "reached": st.reached, "accepted": st.accepted})
        if got != ref:
            first = next((k for k, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
            mismatches.append({"prompt": i, "first_difference_at": first, "spec_len": len(got), "ref_len": len(ref)})
    report = {
        "target": os.path.abspath(target_dir), "export": os.path.abspath(export_dir), "prompts_file": prompts_file,
        "prompts": len(prompts), "draft_steps": draft_steps, "max_new_tokens": max_new_tokens,
        "capture_indices": indices, "dtype": dtype, "device": str(dev),
        "acceptance_length": total.acceptance_length,
        "acceptance_rate_per_position": total.rates,
        "verify_steps": total.verify_steps, "generated_tokens": total.new_tokens,
        "tokens_per_target_forward": total.new_tokens / max(total.target_forwards, 1),
        "baseline_tokens_per_target_forward": base_tokens / max(base_forwards, 1),
        "spec_time_s": spec_time, "baseline_time_s": base_time,
        "speedup": base_time / spec_time if spec_time else 0.0,
        "baseline_tokens_per_s": base_tokens / base_time if base_time else 0.0,
        "spec_tokens_per_s": total.new_tokens / spec_time if spec_time else 0.0,
        "prepacked_linears": packed,
        # the target's one-row path as its one-token step measured it (target/prepack.py choose_one_row_path)
        "one_row_path": one_row,
        # of those, the ones whose one-row calls (the baseline's steps, the drafter's) run plain: faster here
        "one_row_plain_linears": sum(bool(getattr(m, "_plain_single_row", False))
                                     for model in (target, drafter) for m in model.modules()),
        "lossless": not mismatches, "mismatches": mismatches,
        # --draft-steps auto: the measured costs, every length's prediction, the choice, and the whole-run speedup
        # predicted for these prompts and the tokens they produced (acceptance from the replay, not from this run)
        "draft_steps_choice": choice,
        # each prompt's target-only greedy answer and its rounds (bench/replay_vs_eval.py matches them against the
        # answers training replayed)
        "per_prompt": per_prompt,
    }
    if choice is not None:
        choice["predicted_speedup"] = CL.predict_run(choice["costs_s"], predictions[draft_steps],
                                                  [len(p) for p in prompts], [len(p["tokens"]) for p in per_prompt])
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "eval.json"), "w") as f:
            json.dump(report, f, indent=1)
        plot_acceptance(report, os.path.join(out, "acceptance.png"))
    return report
