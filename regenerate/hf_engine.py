"""``--engine hf``: the target through transformers, batched ``model.generate`` with a KV cache and left padding
(or transformers' continuous batching); data parallel under ``torchrun --nproc-per-node N -m eagle3.regenerate``.

The batches are planned over the whole input, independent of what is already done and of the world size, so a
resumed or data-parallel run writes the same files as one uninterrupted process (exactly, for greedy decoding; with
sampling, each generate call is seeded from (seed, first sample_index of the call, turn)).
"""

from __future__ import annotations

import time

import torch
from tqdm import tqdm
from transformers import ContinuousBatchingConfig, GenerationConfig
from transformers.utils import logging as hf_logging

from eagle3.conversations.masking import end_of_turn_ids
from eagle3.regenerate.config import BATCHING, KV_CACHES, RegenConfig
from eagle3.regenerate.files import CONVERSATIONS, ERRORS, Appender, rank_file
from eagle3.regenerate.items import Item, Progress, answer_message, derive_seed, template_kwargs
from eagle3.target import load as T

# Conversations per planning window of the hf engine: sorted by prompt length inside it, then cut into batches.
WINDOW_BATCHES = 8


class HFEngine:
    """The target through transformers: left-padded batches, model.generate with its KV cache."""

    def __init__(self, target_dir: str, dtype, device, cfg: RegenConfig, tokenizer=None):
        self.cfg = cfg
        self.tokenizer = tokenizer if tokenizer is not None else T.load_tokenizer(
            target_dir, trust_remote_code=cfg.trust_remote_code)
        self.model = T.load_target(target_dir, dtype, device)
        self.device = device
        text_cfg = T.text_config_dict(T.read_config(target_dir))
        self.max_positions = text_cfg.get("max_position_embeddings")
        # An answer ends at the first end-of-turn token: the generation config's eos ids (what servers stop on),
        # the tokenizer's eos and the known end-of-turn tokens (Kimi's eos is not its end of turn).
        gen_eos = getattr(self.model.generation_config, "eos_token_id", None)
        gen_eos = [gen_eos] if isinstance(gen_eos, int) else list(gen_eos or [])
        self.stop_ids = sorted(set(end_of_turn_ids(self.tokenizer)) | set(gen_eos))
        if not self.stop_ids:
            raise ValueError(f"{target_dir}: no end-of-turn token known (no eos in the tokenizer or generation "
                             "config); answers would never stop")
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else self.stop_ids[0]
        self.continuous = resolve_batching(cfg.batching, device) == "continuous"
        self.static = not self.continuous and resolve_kv_cache(cfg.kv_cache, device, cfg.max_prompt_tokens)

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """Rendered like the dump renders (the template writes BOS itself), plus the generation prompt."""
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                  **template_kwargs(self.cfg.reasoning))
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def generation_config(self):
        common = dict(max_new_tokens=self.cfg.max_new_tokens, num_beams=1, min_new_tokens=0, repetition_penalty=1.0,
                      no_repeat_ngram_size=0, eos_token_id=self.stop_ids, pad_token_id=self.pad_id, use_cache=True,
                      cache_implementation="static" if self.static else None)
        if self.cfg.temperature == 0:
            return GenerationConfig(do_sample=False, **common)
        # Every sampling processor spelled out: unset fields are filled from the model's generation_config.json
        # and transformers' defaults (top_k=50!), and the answer must follow --temperature/--top-p alone.
        return GenerationConfig(do_sample=True, temperature=self.cfg.temperature, top_p=self.cfg.top_p, top_k=0,
                                min_p=0.0, typical_p=1.0, epsilon_cutoff=0.0, eta_cutoff=0.0, **common)

    def generate(self, prompts: list[list[int]], seed: int) -> list[tuple[list[int], str]]:
        """New tokens of each prompt (through its end-of-turn token) and "stop" or "length"."""
        rows = self._generate_continuous(prompts, seed) if self.continuous else self._generate_padded(prompts, seed)
        stops = set(self.stop_ids)
        results = []
        for row in rows:
            end = next((j for j, t in enumerate(row) if t in stops), None)
            results.append((row[:end + 1], "stop") if end is not None else (row[:self.cfg.max_new_tokens], "length"))
        return results

    def _generate_continuous(self, prompts: list[list[int]], seed: int) -> list[list[int]]:
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # its per-call warm-up and cache-sizing notes would flood the log
        try:
            if self.device.type == "cuda":  # cache sized from free GPU memory, CUDA graphs: transformers decides
                cb = ContinuousBatchingConfig(seed=seed)
            else:  # sized from the host's memory it would allocate (and zero) gigabytes: give it what the rows need
                page = 32
                blocks = sum(-(-(len(p) + self.cfg.max_new_tokens) // page) for p in prompts)
                cb = ContinuousBatchingConfig(seed=seed, page_size=page, num_blocks=blocks + len(prompts),
                                              max_batch_tokens=1024)
            out = self.model.generate_batch(prompts, generation_config=self.generation_config(),
                                            continuous_batching_config=cb, progress_bar=False)
        finally:
            hf_logging.set_verbosity(verbosity)
        rows = list(out.values())
        failed = [r for r in rows if r.error is not None]
        if len(rows) != len(prompts) or failed:
            # generate_batch logs and returns what it has; a lost row would silently become a missing sample
            raise RuntimeError(f"continuous batching returned {len(rows)} of {len(prompts)} answers"
                               + (f"; first error: {failed[0].error}" if failed else "")
                               + " (--batching padded avoids it)")
        return [list(r.generated_tokens) for r in rows]

    def _generate_padded(self, prompts: list[list[int]], seed: int) -> list[list[int]]:
        real = len(prompts)
        if self.static:  # one of a few fixed shapes (KV_CACHES): extra rows repeat real ones and end with them
            prompts = [prompts[b % real] for b in range(static_rows(real))]
            n = self.cfg.max_prompt_tokens
        else:
            n = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), n), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), n), dtype=torch.long)
        for b, p in enumerate(prompts):  # left padding: every row's next token is at position n
            ids[b, n - len(p):] = torch.as_tensor(p)
            mask[b, n - len(p):] = 1
        cuda = [self.device] if self.device.type == "cuda" else []
        with torch.no_grad(), torch.random.fork_rng(devices=cuda):
            torch.manual_seed(seed)
            out = self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                      generation_config=self.generation_config())
        return out[:real, n:].tolist()

    def text(self, new_ids: list[int], finish: str) -> str:
        body = new_ids[:-1] if finish == "stop" else new_ids
        text = self.tokenizer.decode(body, skip_special_tokens=True)
        # An answer cut by --max-new-tokens inside a multi-byte character decodes its partial bytes as U+FFFD, a
        # character the target never wrote (the dump would train on it): end at the last token boundary that
        # decodes cleanly instead.
        while finish == "length" and body and text.endswith("\ufffd"):
            body = body[:-1]
            text = self.tokenizer.decode(body, skip_special_tokens=True)
        return text


def resolve_batching(batching: str, device) -> str:
    if batching not in BATCHING:
        raise ValueError(f"--batching {batching!r}: choose one of {', '.join(BATCHING)}")
    if batching == "auto":
        return "padded"
    return batching


def resolve_kv_cache(kv_cache: str, device, max_prompt_tokens: int | None) -> bool:
    """Whether the padded path runs a static KV cache (KV_CACHES)."""
    if kv_cache not in KV_CACHES:
        raise ValueError(f"--kv-cache {kv_cache!r}: choose one of {', '.join(KV_CACHES)}")
    if kv_cache == "static" and not max_prompt_tokens:
        raise ValueError("--kv-cache static pads every prompt to --max-prompt-tokens: give it")
    if kv_cache == "auto":
        return device.type == "cuda" and bool(max_prompt_tokens)
    return kv_cache == "static"


def static_rows(n: int) -> int:
    """Rows of a static-cache call holding n real rows: the next power of two (at least 8), so that a run
    compiles for a handful of shapes."""
    return max(8, 1 << (n - 1).bit_length())


def plan_batches(items: list[Item], batch_size: int) -> list[list[Item]]:
    """Fixed windows of consecutive items, each sorted by first-prompt length (ties: sample_index) and cut into
    batches: depends on the input only, never on what is done or on the world size."""
    batches = []
    window = batch_size * WINDOW_BATCHES
    for w in range(0, len(items), window):
        chunk = sorted(items[w:w + window], key=lambda it: (it.prompt_chars, it.sample_index))
        batches += [chunk[b:b + batch_size] for b in range(0, len(chunk), batch_size)]
    return batches


def generate_calls(lengths: list[int], budget: int, max_padding: float = 2.0) -> list[list[int]]:
    """Rows (indices into lengths) per generate call: longest first, each call within `budget` padded tokens and
    no row padded to more than `max_padding` x its own length -- one 3,500-token prompt among 30-token ones would
    otherwise make every row of the call pay for 3,500 positions (prefill and KV cache). Depends on the lengths
    only, so calls (and their seeds) are the same in every run."""
    calls: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):  # stable: ties keep row order
        if calls and (len(calls[-1]) + 1) * lengths[calls[-1][0]] <= budget \
                and lengths[i] * max_padding >= lengths[calls[-1][0]]:
            calls[-1].append(i)
        else:
            calls.append([i])
    return [sorted(c) for c in calls]


def regenerate_batch(engine: HFEngine, batch: list[Item], cfg: RegenConfig, on_tokens=None
                     ) -> tuple[list[dict], list[dict], int]:
    """All assistant turns of a batch of conversations, turn by turn (answer k needs answer k-1):
    (conversation records, error records, generated tokens). on_tokens(n) after each generate call."""
    rows = [Progress(it) for it in batch]
    tokens = 0
    for turn in range(max(sum(m["role"] == "assistant" for m in it.messages) for it in batch)):
        active, prompts = [], []
        for r in rows:
            history = r.next_prompt()
            if history is None:
                continue
            try:
                ids = engine.prompt_ids(history)
            except Exception as e:  # noqa: BLE001 - jinja raises anything (role alternation, ...)
                r.fail("answer", f"the chat template failed: {type(e).__name__}: {e}")
                continue
            if cfg.max_prompt_tokens and len(ids) > cfg.max_prompt_tokens:
                r.fail("too_long", f"prompt of {len(ids)} tokens exceeds --max-prompt-tokens {cfg.max_prompt_tokens}")
                continue
            if engine.max_positions and len(ids) + cfg.max_new_tokens > engine.max_positions:
                r.fail("too_long", f"prompt of {len(ids)} tokens + --max-new-tokens {cfg.max_new_tokens} exceeds the "
                                 f"target's {engine.max_positions} positions")
                continue
            active.append(r)
            prompts.append(ids)
        lengths = [len(p) + cfg.max_new_tokens for p in prompts]
        # continuous batching packs rows itself (no padding) and a static cache pads every call to a fixed shape:
        # the whole turn is one call
        calls = [list(range(len(prompts)))] if (engine.continuous or engine.static) and prompts else \
            generate_calls(lengths, cfg.batch_tokens)
        for call in calls:
            first = min(active[i].item.sample_index for i in call)
            outs = engine.generate([prompts[i] for i in call], derive_seed(cfg.seed, first, turn))
            if on_tokens is not None:
                on_tokens(sum(len(new) for new, _ in outs))
            for i, (new, finish) in zip(call, outs):
                tokens += len(new)
                msg, why = answer_message(engine.text(new, finish), None, cfg.reasoning, finish)
                if msg is None:
                    active[i].fail("answer", why)
                else:
                    active[i].answer(msg, finish, len(new))
    done = [r.record() for r in rows if r.error is None]
    return done, [r.error for r in rows if r.error is not None], tokens


def run_hf(cfg: RegenConfig, items: list[Item], done: set[int], world, tokenizer, log) -> tuple[int, int, float]:
    """This rank's share of the pending batches. Returns (conversations written, tokens generated, seconds spent
    generating)."""
    batches = plan_batches(items, cfg.batch_size)
    pending = [b for b in batches if any(it.sample_index not in done for it in b)]
    mine = pending[world.rank::world.world_size]
    todo_convs = sum(it.sample_index not in done for b in mine for it in b)
    log(f"[regenerate] {len(items)} conversations in {len(batches)} batches of <= {cfg.batch_size}; "
        f"{len(pending)} batches pending, {len(mine)} on this rank")
    if not mine:
        return 0, 0, 0.0
    dtype = T.DTYPES[cfg.dtype]
    torch.manual_seed(cfg.seed)
    engine = HFEngine(cfg.target, dtype, world.device, cfg, tokenizer=tokenizer)
    convs_out = Appender(rank_file(cfg.out, CONVERSATIONS, world.rank, world.world_size))
    errs_out = Appender(rank_file(cfg.out, ERRORS, world.rank, world.world_size))
    bar = tqdm(total=todo_convs, unit="conv", desc=f"regenerate rank {world.rank}", dynamic_ncols=True,
               disable=not (cfg.progress and world.is_main))
    t0, written, tokens, n_errors = time.perf_counter(), 0, 0, 0

    def show(new_tokens: int = 0):  # a batch of long conversations takes a while: show tokens as they come
        nonlocal tokens
        tokens += new_tokens
        dt = time.perf_counter() - t0
        bar.set_postfix(tok_s=f"{tokens / dt:,.1f}", conv_s=f"{written / dt:.2f}", errors=n_errors)

    try:
        for n_batches, batch in enumerate(mine):
            if cfg.stop_after_batches is not None and n_batches >= cfg.stop_after_batches:
                break
            recs, errs, _ = regenerate_batch(engine, batch, cfg, on_tokens=show)
            recs = [r for r in recs if r["sample_index"] not in done]
            convs_out.write(recs)
            errs_out.write(errs)
            written += len(recs)
            n_errors += len(errs)
            bar.update(sum(it.sample_index not in done for it in batch))
            show()
    finally:
        bar.close()
        convs_out.close()
        errs_out.close()
    return written, tokens, time.perf_counter() - t0
