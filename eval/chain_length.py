"""The draft chain length chosen by measurement: `eagle3 eval --draft-steps auto`.

A chain of K drafts pays for itself only if what it gains in accepted tokens exceeds what it costs. Both sides are
measured, neither assumed:
- what a chain of k accepts: training's held-out decoding replay walked at every k <= its own chain
  (train/acceptance.py; the export's provenance carries it as `heldout.decode_by_steps`), which reproduces
  `eagle3 eval`'s rounds on greedy target-written data -- tokens per round tau_k and the rate at each position;
- what each piece of a round costs on the machine that runs it (`measure_costs`), timed through the very calls
  `SpeculativeDecoder.generate` makes: the target's verify forward over k + 1 tokens (with the capture hooks and the
  cache crop of a rejected tail), a draft step, the draft head, the drafter's re-read ("extend") of n + 1 accepted
  positions, and the baseline's one-token greedy step.

One round of a chain of k (eval/speculative.py) costs
    round(k) = head + (k - 1) * step + verify(k + 1) + sum_n P_k(n) * extend(n + 1) + overhead(k)
where P_k(n) is the replay's probability that a round accepts n drafts; it yields tau_k tokens. Decoding then runs
at tau_k / round(k) tokens per second against 1 / greedy for the target alone, so the predicted decode speedup is
    speedup(k) = tau_k * greedy / round(k),
and the choice is the k that maximises it. `overhead` (at each k) and `greedy` come from short real runs of each
decoder on the same prompt (`calibrate`): the pieces, timed one by one after the prompt, missed what the loops
themselves cost (their Python, the context growing as they decode): a chain of 2's rounds ran 9% over their pieces
and the greedy loop 4% over its step on the 2-core CPU (bench/quality.md), which made the prediction that much
optimistic.
Prefill (the prompt's forward, and the drafter's over the prompt) is paid once per prompt by both decoders and is
left out of the choice; the whole-run prediction adds it back from the prompts' lengths (`predict_run`), so it is
compared against the same wall clock `eagle3 eval` reports.
"""

from __future__ import annotations

import statistics
import time

import torch
from transformers import DynamicCache

from eagle3.target.capture import HiddenStateCapture


def accepted_distribution(rates: list[float]) -> list[float]:
    """P(n) for n = 0..k: a round accepts exactly n drafts, from the rates by position given the round reached it."""
    probs, reach = [], 1.0
    for r in rates:
        probs.append(reach * (1.0 - r))
        reach *= r
    return probs + [reach]


def replay_by_steps(heldout: dict | None, where: str) -> dict[int, dict]:
    """{k: {"accept_len", "rate_j"}} from an export's provenance `heldout` record; a clear error without one."""
    rows = (heldout or {}).get("decode_by_steps")
    if not rows:
        raise ValueError(f"{where}: --draft-steps auto needs the held-out decoding replay at every chain length that "
                         "eagle3 train records with the best checkpoint (provenance 'heldout.decode_by_steps'); this "
                         "export has none (exported from a checkpoint other than checkpoints/best, from an older "
                         "run, or from elsewhere): give --draft-steps a number")
    return {int(r["steps"]): {"accept_len": float(r["accept_len"]), "rate_j": [float(x) for x in r["rate_j"]]}
            for r in rows}


def _timer(device: torch.device):
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return sync


def _median_times(pieces: dict, sync, repeats: int) -> dict:
    """{name: median seconds} of each callable, timed interleaved: every repeat times each piece once, so that a slow
    spell of a shared machine falls on all of them alike instead of on whichever was being timed then (timed one
    after the other, a 2-core VM once gave a one-token greedy step 107 ms against a 70 ms loop)."""
    for fn in pieces.values():
        fn()  # warm-up: first calls allocate, compile and fill caches
    sync()
    ts: dict = {name: [] for name in pieces}
    for _ in range(repeats):
        for name, fn in pieces.items():
            t0 = time.perf_counter()
            fn()
            sync()
            ts[name].append(time.perf_counter() - t0)
    return {name: statistics.median(v) for name, v in ts.items()}


@torch.no_grad()
def greedy_step_after(target, prompt: list[int], dev: torch.device):
    """(step, tok): the target's prompt in a fresh cache, and a callable taking the baseline's one-token step after
    it as SpeculativeDecoder.greedy does (no capture hooks; the host reads its token), its cache cropped back after
    each call so that every call sees the same context; tok is the prompt's greedy next token."""
    cache = DynamicCache(config=target.config)
    logits = target(input_ids=torch.tensor([prompt], device=dev), cache=cache, use_cache=True).logits
    tok = int(logits[0, -1].argmax())
    one = torch.tensor([[tok]], device=dev)

    def step():
        out = target(input_ids=one, cache=cache, use_cache=True).logits
        int(out[0, -1].argmax())
        cache.crop(-1)
    return step, tok


@torch.no_grad()
def measure_costs(dec, prompt: list[int], max_steps: int, repeats: int = 7) -> dict:
    """Seconds per piece of a round, medians of `repeats` interleaved timings after the prompt is in both caches
    (dec: a SpeculativeDecoder; the calls are generate's own). Returns {"greedy", "head", "step", "verify": [1..K+1
    tokens], "extend": [1..K+1 tokens], "prefill_target", "prefill_drafter", "prompt_tokens"}."""
    dr, dev, target = dec.drafter, dec.device, dec.target
    sync = _timer(dev)
    ids = torch.tensor([prompt], device=dev)
    P = len(prompt)
    greedy_step, tok = greedy_step_after(target, prompt, dev)
    sync()
    one = torch.tensor([[tok]], device=dev)
    costs: dict = {"prompt_tokens": P}
    with HiddenStateCapture(dec.backbone, dec.indices) as cap:
        sync()
        t0 = time.perf_counter()
        y, aux, tcache = dec._target_forward(ids, None, cap)
        int(y[-1])
        sync()
        costs["prefill_target"] = time.perf_counter() - t0
    nxt = torch.tensor([prompt[1:] + [tok]], device=dev)
    t0 = time.perf_counter()
    m, dcache = dr.forward_step(dr.project_aux(aux), nxt, torch.arange(P, device=dev)[None], None)
    sync()
    costs["prefill_drafter"] = time.perf_counter() - t0
    h = m[:, -1:]
    pos = torch.tensor([[P]], device=dev)

    def head():
        int(dr.target_ids(dr.draft_logits(h)[0, -1].argmax()))

    def step():
        h2, _ = dr.forward_step(h, one, pos, dcache)
        int(dr.target_ids(dr.draft_logits(h2)[0, -1].argmax()))

    def verify_n(n: int):  # the forward with generate's capture hooks, the host's read of its tokens, and the crop
        block = torch.tensor([[tok] * n], device=dev)

        def run():
            with HiddenStateCapture(dec.backbone, dec.indices) as c:
                yy, _, _ = dec._target_forward(block, tcache, c)
            yy.tolist()
            tcache.crop(-n)
        return run

    def extend_n(n: int):
        block = torch.tensor([[tok] * n], device=dev)
        a = aux[:, :n] if aux.shape[1] >= n else aux[:, :1].expand(-1, n, -1)
        epos = torch.arange(P, P + n, device=dev)[None]
        return lambda: dr.forward_step(dr.project_aux(a), block, epos, dcache)

    ns = range(1, max_steps + 2)
    pieces = {"greedy": greedy_step, "head": head, "step": step,
              **{f"verify{n}": verify_n(n) for n in ns}, **{f"extend{n}": extend_n(n) for n in ns}}
    med = _median_times(pieces, sync, repeats)
    costs.update(greedy=med["greedy"], head=med["head"], step=med["step"],
                 verify=[med[f"verify{n}"] for n in ns], extend=[med[f"extend{n}"] for n in ns])
    return costs


def accepted_shares(stats) -> list[float]:
    """The share of a decode's rounds (train/acceptance.py ChainStats) that accepted exactly n drafts, n = 0..K."""
    at_least = [stats.verify_steps, *stats.accepted, 0]  # rounds that accepted >= n drafts
    return [(at_least[n] - at_least[n + 1]) / max(stats.verify_steps, 1) for n in range(stats.draft_steps + 1)]


def pieces_seconds(costs: dict, k: int, p: list[float]) -> float:
    """One round of a chain of k from its measured pieces, p[n] the share of rounds accepting n drafts."""
    ext = sum(pn * costs["extend"][n] for n, pn in enumerate(p))  # n accepted -> extend over n + 1 positions
    return costs["head"] + (k - 1) * costs["step"] + costs["verify"][k] + ext


def round_seconds(costs: dict, k: int, rates: list[float]) -> float:
    """Predicted seconds of one round of a chain of k (module docstring): its pieces plus the overhead calibrated at
    that length (`calibrate`; none before calibration)."""
    overhead = costs.get("round_overhead") or [0.0] * k
    return pieces_seconds(costs, k, accepted_distribution(rates[:k])) + overhead[k - 1]


@torch.no_grad()
def calibrate(dec, prompt: list[int], costs: dict, max_k: int, new_tokens: int = 32, repeats: int = 3) -> None:
    """Time short real runs of each decoder on `prompt`, `repeats` of each: greedy, and chain drafting at every
    length 1..max_k, interleaved (every repeat runs each once, so that a slow spell of a shared machine falls on all
    of them alike). Sets costs["greedy"] to the greedy loop's own seconds per token and costs["round_overhead"][k - 1]
    to what a real round of k took beyond its pieces, each the median over the repeats (the pieces' greedy step is
    kept as costs["greedy_step"] and the runs as costs["calibration"]).
    Why every length: what the loop adds to its pieces grows with the chain (a draft step's Python and its host read
    of the token are in the pieces, but not the loop around them); one length's overhead carried to the others made
    rounds of 3-5 drafts cost 10-17% more than predicted on the 2-core Xeon, and put a chain of 1 at 19 ms over its
    pieces where its rounds ran ~10 ms over on the EPYC (bench/quality.md). The overhead is the small difference of
    two large times: one run on a shared 2-core VM put it at 12.9 ms a round where the whole decode ran 7% faster
    than that predicted; a median of three drops such a run."""
    sync = _timer(dec.device)
    ks = range(1, max_k + 1)
    loops, overheads, runs = [], {k: [] for k in ks}, []
    for _ in range(max(1, repeats)):
        sync()
        t0 = time.perf_counter()
        toks, _ = dec.greedy(prompt, new_tokens)
        sync()
        loops.append((time.perf_counter() - t0 - costs["prefill_target"]) / max(len(toks) - 1, 1))
        run = {"greedy_loop_s": loops[-1], "chains": []}
        for k in ks:
            t0 = time.perf_counter()
            _, st = dec.generate(prompt, new_tokens, k)
            sync()
            spec = time.perf_counter() - t0 - costs["prefill_target"] - costs["prefill_drafter"]
            overheads[k].append(spec / max(st.verify_steps, 1) - pieces_seconds(costs, k, accepted_shares(st)))
            run["chains"].append({"draft_steps": k, "rounds": st.verify_steps, "spec_decode_s": spec,
                                  "round_overhead_s": overheads[k][-1]})
        runs.append(run)
    greedy_loop = statistics.median(loops)
    costs["greedy_step"], costs["greedy"] = costs["greedy"], greedy_loop
    costs["round_overhead"] = [statistics.median(overheads[k]) for k in ks]
    costs["calibration"] = {"max_draft_steps": max_k, "new_tokens": new_tokens, "greedy_loop_s": greedy_loop,
                            "round_overhead_s": costs["round_overhead"], "runs": runs}


def predict(costs: dict, replay: dict[int, dict]) -> dict[int, dict]:
    """{k: {"accept_len", "round_s", "tok_s", "decode_speedup"}} for every k the replay and the costs cover."""
    out = {}
    for k, r in sorted(replay.items()):
        if k + 1 > len(costs["verify"]):
            continue
        rs = round_seconds(costs, k, r["rate_j"])
        out[k] = {"accept_len": r["accept_len"], "round_s": rs, "tok_s": r["accept_len"] / rs,
                  "decode_speedup": r["accept_len"] * costs["greedy"] / rs}
    return out


def choose(predictions: dict[int, dict]) -> int:
    """The chain length with the best predicted speedup (the shorter one on a tie: it costs less to serve)."""
    return max(sorted(predictions), key=lambda k: (predictions[k]["decode_speedup"], -k))


def predict_run(costs: dict, prediction: dict, prompt_lengths: list[int], new_tokens: list[int]) -> float:
    """Whole-run speedup as `eagle3 eval` measures it (prefill included): the prompts' prefills scaled by length
    from the measured one, then the new tokens at the greedy and the predicted speculative rate."""
    per_tok_t = costs["prefill_target"] / costs["prompt_tokens"]
    per_tok_d = costs["prefill_drafter"] / costs["prompt_tokens"]
    pre_t = sum(per_tok_t * n for n in prompt_lengths)
    pre_d = sum(per_tok_d * n for n in prompt_lengths)
    decode = sum(max(n - 1, 0) for n in new_tokens)  # the first token comes with the prefill in both
    base = pre_t + decode * costs["greedy"]
    spec = pre_t + pre_d + decode / prediction["tok_s"]
    return base / spec
