"""The options of one `eagle3 regenerate` run (RegenConfig), their choices and their checks.

Kept free of heavy imports on purpose: the CLI builds its parser from RegenConfig (eagle3.options) at every start of
the `eagle3` command, and the engines (hf_engine.py, server_client.py) import transformers and openai (openai alone
costs ~0.6 s there), which only a regeneration needs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from eagle3.options import FULL_WEIGHTS_DIGEST_HELP, opt

REASONING_MODES = ("keep", "strip", "disable")
ENGINES = ("hf",)
# How the hf engine batches: "padded" = model.generate over left-padded rows; "continuous" = transformers'
# continuous batching (model.generate_batch: paged KV cache, finished rows replaced at once). Measured on the
# H200 (bench/quality.md, transformers 5.24 with SDPA, no flash-attn installed): continuous wrote 2048 first
# answers of up to 512 tokens in ~4 minutes, padded batches of 512 wrote 2634 in 3 -- so "auto" means padded
# everywhere until a faster continuous setup is measured; continuous stays available, token-exact with padded.
BATCHING = ("auto", "padded", "continuous")
# The padded path's KV cache: "dynamic" grows with each step; "static" preallocates (rows, prompt + new tokens) and
# transformers compiles the decode step on a GPU (CUDA graphs). Measured on the H200 (bench/regen_throughput.py):
# 35-39k tokens/s against 20-22k dynamic at 1024-2048 rows in bf16, but every new (rows, length) shape compiles
# again (47-72 s), so static calls come in a few fixed shapes: prompts left-padded to --max-prompt-tokens, rows
# rounded up to a power of two (copies of real rows, answers discarded). "auto": static on a GPU when
# --max-prompt-tokens bounds the prompts, dynamic elsewhere (a CPU gains nothing: no compilation there).
KV_CACHES = ("auto", "dynamic", "static")


BACKEND, SERVER, HF, SAMPLING = ("backend (one of --server / --engine)", "server options", "hf engine options",
                                 "sampling")  # the sections of `eagle3 regenerate --help`


@dataclass
class RegenConfig:
    """`eagle3 regenerate`'s flags, in the order --help lists them."""
    data: list[str] = opt(help="conversation files (.jsonl/.json/.parquet; ShareGPT or messages), datasets "
                               "directories, hub dataset ids already in the local HF cache, or 'example' (ShareGPT)")
    out: str = opt(help="output directory: conversations.jsonl, errors.jsonl, skipped.jsonl, regenerate.json; rerun "
                        "the same command to resume (errors are retried)")
    # ---- backend
    servers: list[str] | None = opt(None, "OpenAI-compatible base URL(s), e.g. http://127.0.0.1:30000/v1 (SGLang, "
                                          "vLLM, llama.cpp)", flag="server", metavar="URL", group=BACKEND)
    engine: str | None = opt(None, "hf: generate with the target through transformers (needs --target; torchrun "
                                   "--nproc-per-node N -m eagle3.regenerate ... for data parallelism)",
                             choices=ENGINES, group=BACKEND)  # "hf" (when no servers are given)
    # hf: the model; server: optional local copy of its config/tokenizer
    target: str | None = opt(None, "target model directory, or 'example'. --engine hf: the model that writes. "
                                   "--server: optional local copy of the served model's config + tokenizer, recorded "
                                   "as the target identity the dump checks (without it the identity is null)",
                             group=BACKEND)
    trust_remote_code: bool = opt(False, "run the tokenizer code the target ships: the module tokenizer_config.json's "
                                         "auto_map names (e.g. Kimi-K2.5's tokenization_kimi.py) and what it imports, "
                                         "nothing else; refused otherwise. Recorded in regenerate.json",
                                  group=BACKEND)  # target/load.py load_tokenizer
    full_weights_digest: bool = opt(False, FULL_WEIGHTS_DIGEST_HELP, group=BACKEND)  # target/fingerprint.py
    max_error_rate: float = opt(0.1, "the run ends non-zero when more than this share of its conversations failed "
                                     "(every one failing always does); the answers kept stay written", group=BACKEND)
    # ---- server
    model: str | None = opt(None, "model name sent to the server (default: first id of GET /models)", group=SERVER)
    api_key: str | None = opt(None, "default: $OPENAI_API_KEY, else 'EMPTY'", group=SERVER)
    concurrency: int = opt(8, "requests in flight per server", group=SERVER)
    timeout: float = opt(600.0, "seconds a whole request may take (its whole answer, however slowly it arrives)",
                         group=SERVER)
    retries: int = opt(3, "retries of a transient failure (connection error, timeout, HTTP 5xx / 429)", group=SERVER)
    retry_backoff: float = opt(1.0, "seconds before the first retry, doubled for each further one", group=SERVER)
    # ---- hf engine
    dtype: str | None = opt(None, "bf16 | fp16 | fp32 (default: bf16 on GPU, fp32 on CPU)", group=HF)
    device: str | None = opt(None, "cpu | cuda (default: cuda if available)", group=HF)
    batch_size: int = opt(64, "conversations per batch (grouped by prompt length inside fixed windows)", group=HF)
    batch_tokens: int = opt(262144, "at most this many (prompt + max-new-tokens) x rows per generate call (rows are "
                                    "also split so that none is padded to more than twice its length); --batching "
                                    "padded only", group=HF)
    batching: str = opt("auto", "padded: model.generate over left-padded rows; continuous: transformers' continuous "
                                "batching (model.generate_batch, paged KV cache; a whole --batch-size per call); "
                                "auto: padded (measured faster on the H200 and the CPU, bench/quality.md)",
                        choices=BATCHING, group=HF)
    kv_cache: str = opt("auto", "padded batching's KV cache. static: preallocated, the decode step compiled on a GPU "
                                "(~1.8x faster on the H200 after one compilation per shape); every prompt is padded "
                                "to --max-prompt-tokens and each turn of a batch is one call of a power-of-two rows. "
                                "auto: static on a GPU when --max-prompt-tokens is given, else dynamic",
                        choices=KV_CACHES, group=HF)
    # ---- sampling
    temperature: float = opt(0.0, "0 = greedy", group=SAMPLING)
    top_p: float = opt(1.0, "nucleus sampling (1 = off)", group=SAMPLING)
    max_new_tokens: int = opt(512, "per assistant turn", group=SAMPLING)
    seed: int = opt(0, "request seeds derive from (seed, sample_index, turn); hf: each generate call's from (seed, "
                       "its first sample_index, turn)", group=SAMPLING)
    num_samples: int | None = opt(None, "at most this many input conversations (the first ones, by sample_index)",
                                  group=SAMPLING)
    max_turns: int | None = opt(None, "regenerate at most this many assistant turns per conversation (later turns "
                                      "are dropped)", group=SAMPLING)  # None: all
    # hf: a turn whose prompt is longer is not answered (an 'answer' error)
    max_prompt_tokens: int | None = opt(None, "hf: do not answer a turn whose prompt is longer (recorded in "
                                              "errors.jsonl)", group=SAMPLING)
    reasoning: str = opt("keep", "keep: store a server's reasoning_content on the message, leave <think> in content "
                                 "as is; strip: drop reasoning_content and a leading <think>...</think> block; "
                                 "disable: ask the chat template for no thinking (enable_thinking=False, "
                                 "thinking=False)", choices=REASONING_MODES, group=SAMPLING)
    progress: bool = opt(True, "no progress bar (the summary is still printed)")  # the help of --no-progress
    stop_after_batches: int | None = opt(None, "testing aid: stop after this many batches per rank (simulates a "
                                               "kill)", hidden=True)

    @property
    def backend(self) -> str:
        return "server" if self.servers else "hf"


def sampling(cfg: RegenConfig) -> dict:
    """The sampling options, as regenerate.json and regenerate_config.json record them."""
    return {"temperature": cfg.temperature, "top_p": cfg.top_p, "max_new_tokens": cfg.max_new_tokens,
            "seed": cfg.seed}


def validate(cfg: RegenConfig) -> None:
    """ValueError naming the flag, for options no run can use (before anything is loaded or written)."""
    if cfg.servers and cfg.engine:
        raise ValueError("give either --server URL ... or --engine hf, not both")
    if not cfg.servers:
        if cfg.engine not in ENGINES:
            raise ValueError(f"give --server URL [URL ...] (an OpenAI-compatible endpoint) or --engine "
                             f"{'|'.join(ENGINES)} with --target DIR (got engine {cfg.engine!r})")
        if not cfg.target:
            raise ValueError("--engine hf needs --target DIR")
    if cfg.reasoning not in REASONING_MODES:
        raise ValueError(f"--reasoning {cfg.reasoning!r}: choose one of {', '.join(REASONING_MODES)}")
    for name, positive in (("timeout", True), ("retry_backoff", False)):
        v = getattr(cfg, name)
        if not (isinstance(v, (int, float)) and math.isfinite(v) and (v > 0 if positive else v >= 0)):
            raise ValueError(f"--{name.replace('_', '-')} {v!r} must be a finite number of seconds "
                             f"{'> 0' if positive else '>= 0'}")
    if not (isinstance(cfg.retries, int) and cfg.retries >= 0):
        raise ValueError(f"--retries {cfg.retries!r} must be >= 0")
    if not (isinstance(cfg.max_error_rate, (int, float)) and 0 <= cfg.max_error_rate <= 1):
        raise ValueError(f"--max-error-rate {cfg.max_error_rate!r} must be in [0, 1]")
    if not cfg.temperature >= 0:
        raise ValueError(f"--temperature {cfg.temperature} must be >= 0 (0 = greedy)")
    if not 0 < cfg.top_p <= 1:
        raise ValueError(f"--top-p {cfg.top_p} must be in (0, 1]")
    for name in ("max_new_tokens", "concurrency", "batch_size", "batch_tokens", "max_turns", "max_prompt_tokens"):
        if getattr(cfg, name) is not None and getattr(cfg, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if cfg.servers and cfg.max_prompt_tokens is not None:
        raise ValueError("--max-prompt-tokens is an --engine hf option (a server refuses prompts longer than its "
                         "context itself: an 'answer' error)")
    if cfg.retries < 0 or cfg.timeout <= 0:
        raise ValueError("--retries must be >= 0 and --timeout > 0")
    if not cfg.data:
        raise ValueError("no --data files given")
