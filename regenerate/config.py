"""The options of one `eagle3 regenerate` run (RegenConfig), their choices and their checks.

Kept free of heavy imports on purpose: the CLI reads RegenConfig's defaults to build its parser at every start of
the `eagle3` command, and the engines (hf_engine.py, server_client.py) import transformers and openai (openai alone
costs ~0.6 s there), which only a regeneration needs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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


@dataclass
class RegenConfig:
    data: list[str]
    out: str
    target: str | None = None            # hf: the model; server: optional local copy of its config/tokenizer
    servers: list[str] | None = None     # OpenAI-compatible base URLs (http://host:port/v1)
    engine: str | None = None            # "hf" (when no servers are given)
    model: str | None = None             # server: model name (default: the first id of GET /models)
    api_key: str | None = None           # server: default $OPENAI_API_KEY, else "EMPTY"
    concurrency: int = 8                 # server: requests in flight per server
    timeout: float = 600.0               # server: seconds per request
    retries: int = 3                     # server: retries of a transient failure (connection, timeout, 5xx, 429)
    retry_backoff: float = 1.0           # server: first wait in seconds, doubled on each retry
    temperature: float = 0.0
    top_p: float = 1.0
    max_new_tokens: int = 512
    seed: int = 0
    num_samples: int | None = None       # at most this many input conversations (by sample_index)
    max_turns: int | None = None         # regenerate at most this many assistant turns per conversation (None: all)
    max_prompt_tokens: int | None = None  # hf: a turn whose prompt is longer is not answered (an 'answer' error)
    reasoning: str = "keep"              # keep | strip | disable
    dtype: str | None = None             # hf: default bf16 on GPU, fp32 on CPU
    device: str | None = None            # hf: default cuda if available
    batch_size: int = 64                 # hf: conversations per batch
    batch_tokens: int = 262144           # hf padded: (prompt + max_new_tokens) x rows per generate call, at most
    batching: str = "auto"               # hf: auto | padded | continuous (see BATCHING)
    kv_cache: str = "auto"               # hf padded: auto | dynamic | static (see KV_CACHES)
    trust_remote_code: bool = False      # run the tokenizer code the target ships (target/load.py load_tokenizer)
    full_weights_digest: bool = False    # hash every byte of the target's weights (target/fingerprint.py)
    max_error_rate: float = 0.1          # a run whose failed conversations exceed this share ends non-zero
    progress: bool = True
    stop_after_batches: int | None = None  # testing aid: stop after this many batches per rank (simulates a kill)

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
