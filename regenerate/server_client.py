"""``--server URL [URL ...]``: any OpenAI-compatible chat-completions server (SGLang, vLLM, llama.cpp, ...) through
the async OpenAI client; ``--concurrency`` requests in flight per server, retries with exponential backoff on
transient failures, every request bounded as a whole by --timeout, every answer checked before it is stored.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time

from tqdm import tqdm

from eagle3.regenerate.config import RegenConfig
from eagle3.regenerate.files import CONVERSATIONS, ERRORS, Appender
from eagle3.regenerate.items import Item, Progress, answer_message, derive_seed, error_record, template_kwargs


def _openai():
    """The client library, imported when a server is used: `--engine hf` (the quickstart, a GPU machine given only
    the wheels it runs) imports this module but needs no openai."""
    import openai
    return openai


class ServerError(RuntimeError):
    """No server answers (at the start), or every server stopped answering during the run."""



class _ServerDown(Exception):
    """The server refused connections through all retries."""


class _RequestFailed(Exception):
    def __init__(self, kind: str, text: str):
        super().__init__(text)
        self.kind = kind


class _Malformed(Exception):
    """A 200 answer that is not a chat completion this run can store."""


def _read_answer(resp, url: str) -> tuple[str, str | None, str | None, int | None]:
    """(content, reasoning, finish_reason, completion_tokens) of a chat completion, every field checked: the client
    builds its response objects without validating them, so a server's list or number where text belongs would
    otherwise travel on into the conversation (or kill the worker that reads it)."""
    def bad(why):
        raise _Malformed(f"{url}: malformed answer: {why}")
    choices = getattr(resp, "choices", None)
    if not isinstance(choices, list) or not choices:
        bad(f"no choices (got {type(choices).__name__})")
    choice = choices[0]
    message = getattr(choice, "message", None)
    if message is None:
        bad("a choice without a message")
    content = getattr(message, "content", None)
    if content is not None and not isinstance(content, str):
        bad(f"message content is a {type(content).__name__}, not text")
    finish = getattr(choice, "finish_reason", None)
    if finish is not None and not isinstance(finish, str):
        bad(f"finish_reason is a {type(finish).__name__}")
    usage = getattr(resp, "usage", None)
    n = getattr(usage, "completion_tokens", None) if usage is not None else None
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
        bad(f"usage.completion_tokens is {n!r}, not a count")
    reasoning = _reasoning_of(message)
    if content and finish == "length":  # cut inside a multi-byte character: keep the text before it
        content = content.rstrip("\ufffd")
    return content or "", reasoning, finish, n


def _api_key(cfg: RegenConfig) -> str:
    return cfg.api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY"


def probe_servers(cfg: RegenConfig) -> tuple[list[str], str]:
    """GET /models on every server: (the answering URLs, the model name). ServerError when none answers. Each probe
    is bounded as a whole (min(--timeout, 30) s), so a server that trickles its answer cannot hold the start."""
    limit = min(cfg.timeout, 30.0)

    AsyncOpenAI = _openai().AsyncOpenAI

    async def models_of(url: str) -> list[str]:
        async with AsyncOpenAI(base_url=url, api_key=_api_key(cfg), max_retries=1, timeout=limit) as c:
            page = await asyncio.wait_for(c.models.list(), timeout=limit)
        ids = [getattr(m, "id", None) for m in (getattr(page, "data", None) or [])]
        if not all(isinstance(i, str) for i in ids):
            raise _Malformed(f"model ids that are not text: {ids!r}")
        return ids

    alive, models, why = [], {}, []
    for url in cfg.servers:
        try:
            ids = asyncio.run(models_of(url))
        except asyncio.TimeoutError:
            why.append(f"{url}: no whole answer within {limit:g} s")
            continue
        except Exception as e:  # noqa: BLE001 - whatever it is, this server is not usable
            why.append(f"{url}: {type(e).__name__}: {e}")
            continue
        alive.append(url)
        models[url] = ids
    if not alive:
        raise ServerError("no server answered GET /models:\n  " + "\n  ".join(why)
                          + "\n(--server takes the OpenAI base URL, e.g. http://127.0.0.1:30000/v1)")
    for w in why:
        print(f"[regenerate] warning: leaving out {w}", file=sys.stderr)
    model = cfg.model
    if model is None:
        first = models[alive[0]]
        if not first:
            raise ServerError(f"{alive[0]}/models lists no model; pass --model")
        model = first[0]
    return alive, model


def _reasoning_of(message) -> str | None:
    """SGLang/vLLM reasoning parsers return it as `reasoning_content` (newer vLLM: `reasoning`)."""
    for key in ("reasoning_content", "reasoning"):
        value = getattr(message, key, None)  # declared field or an extra one (the client's models allow extras)
        if isinstance(value, str) and value:
            return value
    return None


async def _request(client, url: str, cfg: RegenConfig, model: str, messages: list[dict], seed: int):
    """One chat completion with retries and exponential backoff on transient failures."""
    openai = _openai()
    last = None
    for attempt in range(cfg.retries + 1):
        if attempt:
            await asyncio.sleep(cfg.retry_backoff * 2 ** (attempt - 1))
        try:
            # wait_for bounds the WHOLE request: the client's own timeout is per read, so a server trickling a
            # byte a second would keep one request alive for ever
            resp = await asyncio.wait_for(client.chat.completions.create(
                model=model, messages=messages, temperature=cfg.temperature, top_p=cfg.top_p,
                max_tokens=cfg.max_new_tokens, seed=seed, timeout=cfg.timeout,
                extra_body={"chat_template_kwargs": template_kwargs(cfg.reasoning)} if cfg.reasoning == "disable"
                else None), timeout=cfg.timeout)
            return _read_answer(resp, url)
        except (openai.APITimeoutError, asyncio.TimeoutError):
            last = ("timeout", f"no whole answer within --timeout {cfg.timeout:g} s")
        except _Malformed as e:  # a proxy's or a server's glitch may pass: retried like a 5xx
            last = ("malformed", str(e))
        except openai.APIConnectionError as e:
            last = ("connection", f"{type(e).__name__}: {e.__cause__ or e}")
        except openai.APIStatusError as e:
            text = f"HTTP {e.status_code}: {str(e)[:500]}"
            if e.status_code != 429 and e.status_code < 500:
                raise _RequestFailed("answer", f"{url} rejected the request: {text}") from None  # retrying can't help
            last = ("status", text)
        except openai.APIError as e:  # an answer the client cannot read
            last = ("status", f"{type(e).__name__}: {e}")
        except ValueError as e:  # a body that is not JSON (json.JSONDecodeError), as the client raises it
            last = ("malformed", f"{url}: an answer that is not JSON ({type(e).__name__}: {str(e)[:200]})")
    if last[0] == "connection":
        raise _ServerDown(f"{url}: {last[1]}")
    raise _RequestFailed("server", f"{url}: {last[1]} ({cfg.retries + 1} attempts)")


async def _converse(client, url: str, cfg: RegenConfig, model: str, item: Item) -> tuple[dict, int]:
    """All assistant turns of one conversation on one server: (conversation or error record, tokens)."""
    conv, tokens = Progress(item), 0
    while (history := conv.next_prompt()) is not None:
        try:
            content, reasoning, finish, n = await _request(client, url, cfg, model, history,
                                                           derive_seed(cfg.seed, item.sample_index, conv.turn))
        except _RequestFailed as e:
            return error_record(item, conv.turn, e.kind, str(e)), tokens
        tokens += n or 0
        msg, why = answer_message(content, reasoning, cfg.reasoning, finish)
        if msg is None:
            return error_record(item, conv.turn, "answer", why), tokens
        conv.answer(msg, finish, n)
    return conv.record(), tokens


async def _serve(cfg: RegenConfig, urls: list[str], model: str, items: list[Item], on_result
                 ) -> tuple[dict[str, str], bool]:
    """Work through items with --concurrency workers per server pulling from one queue (workers start in
    round-robin order over the servers, so the first requests go round-robin; later a free worker takes the next
    conversation, so a faster server does more). A server that refuses connections through its retries is
    dropped and its conversation goes back to the queue. Returns ({url: why} of the dropped servers, whether
    all of them dropped out, leaving conversations undone)."""
    queue: asyncio.Queue = asyncio.Queue()
    for it in items:
        queue.put_nowait(it)
    down: dict[str, str] = {}
    all_down = asyncio.Event()
    AsyncOpenAI = _openai().AsyncOpenAI
    clients = {url: AsyncOpenAI(base_url=url, api_key=_api_key(cfg), max_retries=0, timeout=cfg.timeout)
               for url in urls}

    async def worker(url: str):
        while url not in down:
            item = await queue.get()
            try:
                rec, tokens = await _converse(clients[url], url, cfg, model, item)
            except _ServerDown as e:
                down.setdefault(url, str(e))
                queue.put_nowait(item)
                if len(down) == len(urls):
                    all_down.set()
                return
            except Exception as e:  # noqa: BLE001 - whatever broke, it is this conversation's error, and the
                # worker lives on: a dead worker leaves queue.join() waiting for ever
                rec, tokens = error_record(item, 0, "server", f"{url}: {type(e).__name__}: {str(e)[:300]}"), 0
            finally:
                queue.task_done()
            on_result(rec, tokens)

    workers = [asyncio.create_task(worker(url)) for _ in range(cfg.concurrency) for url in urls]
    finished = asyncio.create_task(queue.join())
    stopped = asyncio.create_task(all_down.wait())
    await asyncio.wait([finished, stopped], return_when=asyncio.FIRST_COMPLETED)
    for t in [*workers, finished, stopped]:
        t.cancel()
    await asyncio.gather(*workers, finished, stopped, return_exceptions=True)
    for c in clients.values():
        await c.close()
    return down, all_down.is_set()


def run_server(cfg: RegenConfig, urls: list[str], model: str, items: list[Item], done: set[int], log
               ) -> tuple[int, int, float, dict]:
    """Returns (conversations written, tokens generated, seconds, {url: why} when every server stopped
    answering)."""
    todo = [it for it in items if it.sample_index not in done]
    log(f"[regenerate] {len(items)} conversations, {len(todo)} to do on {len(urls)} server(s) x "
        f"{cfg.concurrency} concurrent requests, model {model}")
    if not todo:
        return 0, 0, 0.0, {}
    convs_out = Appender(os.path.join(cfg.out, CONVERSATIONS))
    errs_out = Appender(os.path.join(cfg.out, ERRORS))
    bar = tqdm(total=len(todo), unit="conv", desc="regenerate", dynamic_ncols=True, disable=not cfg.progress)
    buf_c, buf_e = [], []
    state = {"written": 0, "tokens": 0, "errors": 0, "flushed": time.perf_counter()}
    t0 = time.perf_counter()
    flush_every = cfg.concurrency * len(urls)  # about one append per round of requests

    def flush():
        convs_out.write(buf_c)
        errs_out.write(buf_e)
        buf_c.clear()
        buf_e.clear()
        state["flushed"] = time.perf_counter()

    def on_result(rec: dict, tokens: int):
        (buf_e if "error" in rec else buf_c).append(rec)
        state["written" if "error" not in rec else "errors"] += 1
        state["tokens"] += tokens
        bar.update(1)
        dt = time.perf_counter() - t0
        bar.set_postfix(tok_s=f"{state['tokens'] / dt:,.1f}", conv_s=f"{state['written'] / dt:.2f}",
                        errors=state["errors"], refresh=False)
        if len(buf_c) + len(buf_e) >= flush_every or time.perf_counter() - state["flushed"] > 5.0:
            flush()  # batched appends: few fsyncs, and a kill loses at most these few seconds

    try:
        down, all_down = asyncio.run(_serve(cfg, urls, model, todo, on_result))
    finally:
        flush()
        bar.close()
        convs_out.close()
        errs_out.close()
    for why in down.values() if not all_down else ():
        log(f"[regenerate] warning: a server stopped answering, the others took over: {why}")
    return state["written"], state["tokens"], time.perf_counter() - t0, down if all_down else {}
