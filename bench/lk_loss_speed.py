"""Cost of --loss lk / lk-hybrid against kl on the fused loss (train/loss.py eagle3_loss_fused, model/kernels.py):
forward + backward of the loss alone, from the K step outputs to their gradients and the draft head's, at the
quickstart's CPU drafter shape by default (H 576, draft vocab 2048), with the trainer's teacher from the dump's
full-vocab argmax (the draft rows of the target head). The objectives run interleaved, round by round, so that drift
of the machine hits them alike; each reports the median over the rounds.

    python bench/lk_loss_speed.py                       # B 1, T 2048, K 5, fp32, teacher chunks of 4096 tokens
    python bench/lk_loss_speed.py --chunk 1024 --rounds 9
    python bench/lk_loss_speed.py --baseline /tmp/old_loss.py   # also another version's kl, interleaved

Wall time is what a step pays; process CPU time (all threads) is the work, less disturbed by other processes on a
shared machine.

Measured 2026-12-07 on the 2-core CPU dev machine, shared with another job (load 2.4-3.7), with HEAD's loss.py as
kl-baseline (medians of 11 / 15 interleaved rounds):
  2 threads: kl-baseline 1702 ms, kl 1792, lk 1712 (0.96x kl), lk-hybrid 2152 (1.20x)   (min kl 1429)
  1 thread:  kl-baseline  689 ms, kl  640, lk  661 (1.03x kl), lk-hybrid  903 (1.41x)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--draft-vocab", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=8192, help="target vocab (only its draft rows are multiplied)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--chunk", type=int, default=4096, help="teacher_chunk_tokens (the trainer's default 4096)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--baseline", default=None, help="a loss.py file whose eagle3_loss_fused runs too, as "
                                                     "kl-baseline (e.g. `git show HEAD~1:train/loss.py`)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.set_flush_denormal(True)  # as the trainer does on CPUs

    from eagle3.model import DrafterConfig, Eagle3Drafter
    from eagle3.train.loss import KL, Objective, eagle3_loss_fused
    H, B, T, K = a.hidden, a.batch, a.tokens, a.steps
    torch.manual_seed(0)
    d = Eagle3Drafter(DrafterConfig(hidden_size=H, num_attention_heads=9, num_key_value_heads=3, head_dim=H // 9,
                                    intermediate_size=4 * H, vocab_size=a.vocab, draft_vocab_size=a.draft_vocab,
                                    target_hidden_size=H))
    ids = torch.randperm(a.vocab)[:a.draft_vocab].sort().values
    t2d = torch.zeros(a.vocab, dtype=torch.bool)
    t2d[ids] = True
    d.set_vocab_map(ids - torch.arange(a.draft_vocab), t2d)
    with torch.no_grad():
        d.lm_head.weight.normal_(0, H ** -0.5)
    head = torch.randn(a.vocab, H) * H ** -0.5 * 4
    th = torch.randn(B, T, H)
    argmax = (th @ head.T).argmax(-1)
    loss_mask = torch.ones(B, T, dtype=torch.long)
    input_ids = torch.zeros(B, T, dtype=torch.long)
    ms = [torch.randn(B, T, H, requires_grad=True) for _ in range(K)]
    objectives = {"kl": KL, "lk": Objective("lk"), "lk-hybrid": Objective("lk-hybrid")}

    losses = {k: (lambda *args, o=o, **kw: eagle3_loss_fused(*args, objective=o, **kw)) for k, o in objectives.items()}
    if a.baseline:  # another implementation's eagle3_loss_fused (e.g. a previous commit's), as kl-baseline
        import importlib.util
        spec = importlib.util.spec_from_file_location("baseline_loss", a.baseline)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        losses = {"kl-baseline": mod.eagle3_loss_fused, **losses}

    def once(fn) -> tuple[float, float]:
        d.zero_grad()
        for m in ms:
            m.grad = None
        t0, c0 = time.perf_counter(), time.process_time()
        loss, _ = fn(d, ms, th, input_ids, loss_mask, None, 0.8, a.chunk, target_argmax=argmax,
                     draft_head_weight=head[t2d])
        loss.backward()
        return time.perf_counter() - t0, time.process_time() - c0

    for fn in losses.values():  # warm-up (and the allocator's: its first large blocks are fresh pages)
        once(fn)
        once(fn)
    wall, cpu = {k: [] for k in losses}, {k: [] for k in losses}
    for _ in range(a.rounds):
        for k, fn in losses.items():
            w, c = once(fn)
            wall[k].append(w)
            cpu[k].append(c)
    print(f"eagle3_loss_fused fwd+bwd, B {B} T {T} H {H} Dv {a.draft_vocab} K {K} fp32, chunk {a.chunk}, "
          f"{torch.get_num_threads()} threads, median of {a.rounds} interleaved rounds (wall; process CPU time):")
    bw, bc = statistics.median(wall["kl"]), statistics.median(cpu["kl"])
    for k in losses:
        mw, mc = statistics.median(wall[k]), statistics.median(cpu[k])
        print(f"  {k:12s} wall {mw * 1e3:7.1f} ms ({mw / bw:.3f}x kl; min {min(wall[k]) * 1e3:.1f})   "
              f"cpu {mc * 1e3:7.1f} ms ({mc / bc:.3f}x kl)")


if __name__ == "__main__":
    main()
