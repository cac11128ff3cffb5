"""Sequence parallelism (train/sequence_parallel.py): one sample split over 2 and 3 gloo processes gives the unsplit
step's loss and gradients, in float64, under every --loss (kl, lk, lk-hybrid: whose KL weight is the whole
sequence's)."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from eagle3.train.loss import KL, Objective, eagle3_loss
from eagle3.train.pieces import piece_chunks, sequence_pieces_loss
from eagle3.train.sequence_parallel import chunk_of, halo, sequence_parallel_loss

from test_drafter import make_drafter
from test_drafter_layouts import make as make_layout


def drafter(layout="llama"):
    """The Llama-layout test drafter, or the MLA one with fc_norm + norm_output (q/k width 10, v width 5)."""
    return make_drafter() if layout == "llama" else make_layout("mla+fc_norm+norm_output")


T, K, DECAY, CHUNK = 37, 4, 0.8, 8   # CHUNK < tokens per rank: the chunked soft cross-entropy is exercised too
# every objective of train/loss.py, each split run held to its unsplit one (lk-hybrid's weight at mean acceptance
# ~0.1 is ~0.55: far from 0 and 1, so a weight taken from one rank's pairs alone would show)
OBJECTIVES = {"kl": KL, "lk": Objective("lk"), "lk-hybrid": Objective("lk-hybrid", kl_scale=0.7, kl_decay=2.5)}


def sample(seed=1, layout="llama"):
    g = torch.Generator().manual_seed(seed)
    d = drafter(layout)
    Ht, V = d.config.target_hidden_size, d.config.vocab_size
    loss_mask = (torch.rand(1, T, generator=g) > 0.3).long()
    loss_mask[0, :5] = 0                          # a prompt
    return {"hidden_state": torch.randn(1, T, 3 * Ht, generator=g, dtype=torch.float64),
            "input_ids": torch.randint(0, V, (1, T), generator=g),
            "loss_mask": loss_mask,
            "final_hidden": torch.randn(1, T, Ht, generator=g, dtype=torch.float64),
            "lm_head": torch.randn(V, Ht, generator=g, dtype=torch.float64)}


def unsplit(layout="llama", objective=KL):
    s, d = sample(layout=layout), drafter(layout)
    outs = d.ttt_forward(s["hidden_state"], s["input_ids"], None, K)
    loss, m = eagle3_loss(d, outs, s["final_hidden"], s["lm_head"], s["input_ids"], s["loss_mask"], None,
                          decay=DECAY, chunk_tokens=CHUNK, objective=objective)
    loss.backward()
    grads = {n: p.grad for n, p in d.named_parameters() if p.requires_grad}
    return loss.detach(), m, grads


def _worker(rank, size, port, out, fast, checkpointing, layout):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=size)
    try:
        res = {}
        for name, objective in OBJECTIVES.items():
            s, d = sample(layout=layout), drafter(layout)
            d.activation_checkpointing = checkpointing
            loss, m = sequence_parallel_loss(d, s["lm_head"], s["hidden_state"], s["input_ids"], s["loss_mask"],
                                             s["final_hidden"], steps=K, decay=DECAY, chunk_tokens=CHUNK, fast=fast,
                                             objective=objective)
            loss.backward()
            res.update({f"{name}.grad.{n}": p.grad for n, p in d.named_parameters() if p.requires_grad})
            res.update({f"{name}.{k}": v for k, v in dict(loss=loss.detach().reshape(1), ce_sum=m["ce_sum"],
                                                          correct=m["correct"], count=m["count"],
                                                          alpha_sum=m["alpha_sum"]).items()})
        for v in res.values():                    # the group's sums: what the trainer's all-reduce would pool
            dist.all_reduce(v)
        if rank == 0:
            save_file({k: v.contiguous() for k, v in res.items()}, out)
        dist.barrier()  # tear the group down together
    finally:
        dist.destroy_process_group()
    # Success only (an exception above propagates to mp.spawn as usual): leave without the interpreter's teardown.
    # With 3 ranks on 2 cores a child now and then aborted there ("terminate called without an active exception",
    # SIGABRT: a gloo thread still joinable when C++ statics are destroyed), after its work was done and checked.
    os._exit(0)


def _port():
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        return sk.getsockname()[1]


def test_chunks_cover_the_sequence_and_their_halos_reach_every_label():
    for length, size in ((37, 2), (37, 3), (8, 8), (131072, 8)):
        chunks = [chunk_of(length, size, r, K) for r in range(size)]
        assert [c.start for c in chunks] == [0] + [c.end for c in chunks[:-1]] and chunks[-1].end == length
        assert max(c.end - c.start for c in chunks) - min(c.end - c.start for c in chunks) <= 1
        for c in chunks:  # the last pair of a chunk (t = end - 1, j = K - 1) reads its label at t + K + 1
            assert c.window_end == min(c.end - 1 + K + 1 + 1, length) == min(c.end + halo(K), length)
    with pytest.raises(ValueError, match="cannot be split"):
        chunk_of(3, 4, 0, K)


@pytest.mark.parametrize("size,fast,checkpointing,layout", [(2, False, "none", "llama"), (3, False, "mlp", "llama"),
                                                            (2, True, "none", "llama"), (3, True, "step", "llama"),
                                                            (2, True, "step", "mla")])
def test_split_step_equals_the_unsplit_step(size, fast, checkpointing, layout, tmp_path):
    """The plain path and the fused kernels (model/kernels.py, CPU flash attention in float64), the latter also under
    'step' checkpointing, whose recompute must not repeat the group's collective, against the plain unsplit step;
    the MLA drafter (keys and values of different widths through the prefix block) too. Each case runs every
    objective (lk-hybrid's alpha sums pooled over the group, on the fused path before its gradient pass)."""
    out = str(tmp_path / "sp.safetensors")
    mp.spawn(_worker, args=(size, _port(), out, fast, checkpointing, layout), nprocs=size, join=True)
    got = load_file(out)
    for name, objective in OBJECTIVES.items():
        ref_loss, ref_m, ref_grads = unsplit(layout, objective)
        torch.testing.assert_close(got[f"{name}.loss"][0], ref_loss, rtol=1e-12, atol=1e-12, msg=name)
        assert torch.equal(got[f"{name}.count"], ref_m["count"]) and ref_m["count"].min() > 0
        assert torch.equal(got[f"{name}.correct"], ref_m["correct"])
        torch.testing.assert_close(got[f"{name}.ce_sum"], ref_m["ce_sum"], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got[f"{name}.alpha_sum"], ref_m["alpha_sum"], rtol=1e-12, atol=1e-12)
        grads = {k.removeprefix(f"{name}.grad."): v for k, v in got.items() if k.startswith(f"{name}.grad.")}
        assert set(ref_grads) == set(grads)
        for n, g in ref_grads.items():
            assert g.abs().max() > 0, n
            torch.testing.assert_close(grads[n], g, rtol=1e-10, atol=1e-12, msg=f"{name} {n}")


@pytest.mark.parametrize("pieces,fast,checkpointing,argmax,layout,losses", [
    (2, False, "none", False, "llama", "all"), (3, False, "mlp", False, "llama", "kl"),
    (2, True, "step", True, "llama", "all"), (3, True, "step_mlp", False, "llama", "kl"),
    (3, True, "step", True, "mla", "all"), (2, False, "none", False, "mla", "kl")])
def test_pieces_on_one_process_give_the_unsplit_step(pieces, fast, checkpointing, argmax, layout, losses):
    """One process taking the row in 2 or 3 pieces, each with its own backward (the earlier pieces' keys as leaves
    whose gradients reach those pieces later): the unsplit loss, metrics and gradients in float64, on the plain path
    and on the fused kernels with step / step_mlp checkpointing (the dumped full-vocab argmax with the draft rows of
    the head in one case). A piece that lost the gradient later pieces put on its keys would fail the k/v grads.
    Every objective in half the cases (plain, fused with the argmax teacher, MLA): under lk-hybrid the pieces' weight
    is the whole row's (its alpha pre-pass over all pieces)."""
    for name, objective in (OBJECTIVES if losses == "all" else {"kl": KL}).items():
        ref_loss, ref_m, ref_grads = unsplit(layout, objective)
        s, d = sample(layout=layout), drafter(layout)
        d.activation_checkpointing = checkpointing
        extra = {}
        if argmax:
            extra = dict(target_argmax=(s["final_hidden"] @ s["lm_head"].T).argmax(-1),
                         draft_head=s["lm_head"][d.t2d])
        loss, m = sequence_pieces_loss(d, s["lm_head"], s["hidden_state"], s["input_ids"], s["loss_mask"],
                                       s["final_hidden"], pieces=pieces, steps=K, decay=DECAY, chunk_tokens=CHUNK,
                                       fast=fast, objective=objective, **extra)
        assert all(p.grad is None for p in d.parameters())  # the earlier pieces' gradients wait for this backward
        loss.backward()
        torch.testing.assert_close(loss.detach(), ref_loss, rtol=1e-12, atol=1e-12, msg=name)
        assert torch.equal(m["count"], ref_m["count"]) and torch.equal(m["correct"], ref_m["correct"])
        torch.testing.assert_close(m["ce_sum"], ref_m["ce_sum"], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(m["alpha_sum"], ref_m["alpha_sum"], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(m["acceptance_length"], ref_m["acceptance_length"], rtol=1e-12, atol=1e-12)
        for n, p in d.named_parameters():
            if p.requires_grad:
                assert ref_grads[n].abs().max() > 0, n
                torch.testing.assert_close(p.grad, ref_grads[n], rtol=1e-10, atol=1e-12, msg=f"{name} {n}")


def test_pieces_cut_at_multiples_of_128_and_cover_the_row():
    from eagle3.model.kernels import CUDNN_T_MULTIPLE
    for length, pieces in ((131072, 2), (131072, 4), (100_000, 3), (1000, 7), (384, 3), (37, 3)):
        cs = piece_chunks(length, pieces, K)
        assert [c.start for c in cs] == [0] + [c.end for c in cs[:-1]] and cs[-1].end == length
        assert all(c.end > c.start and c.window_end == min(c.end + halo(K), length) for c in cs)
        if length >= pieces * CUDNN_T_MULTIPLE:
            assert all(c.end % CUDNN_T_MULTIPLE == 0 for c in cs[:-1])
            assert max(c.end - c.start for c in cs) - min(c.end - c.start for c in cs) < 2 * CUDNN_T_MULTIPLE
    assert [c.end - c.start for c in piece_chunks(131072, 4, K)] == [32768] * 4


def test_step_counts_are_the_unsplit_denominators():
    from eagle3.train.loss import step_counts
    s, d = sample(), make_drafter()
    _, ref_m, _ = unsplit()
    got = step_counts(d.t2d, (s["final_hidden"] @ s["lm_head"].T).argmax(-1), s["loss_mask"], None, K)
    assert torch.equal(got, ref_m["count"])


@pytest.mark.slow
@pytest.mark.parametrize("path", [("--no-fast-path",), ("--fast-path", "--aux-noise", "0.3")], ids=["plain", "fast+noise"])
def test_training_with_sequence_parallel_2_equals_one_process(tiny_dump, tiny_targets, tmp_path, path):
    """`deepspeed --num_gpus 2 -m eagle3.train --sequence-parallel 2`: both ranks split every batch (one data-parallel
    group), and the run's losses, held-out evaluation and weights are those of one process training unsplit
    (--aux-noise too: the group's ranks draw the same noise for their one batch). So are one process's with
    `--piece-tokens 24`, every batch in pieces of ~24 tokens (its earlier pieces' gradients reach ZeRO-2's buckets
    through the engine's backward)."""
    from test_train import launch, metrics, run_here
    args = ("--zero-stage", "2", "--max-steps", 4, "--save-interval", 4, *path)
    run_here(tiny_dump, tiny_targets["llama"], tmp_path / "one", *args)
    launch(2, tiny_dump, tiny_targets["llama"], tmp_path / "sp2", *args, "--sequence-parallel", 2)
    run_here(tiny_dump, tiny_targets["llama"], tmp_path / "pieces3", *args, "--piece-tokens", 24)
    a, c = metrics(tmp_path / "one"), metrics(tmp_path / "pieces3")
    assert [r["step"] for r in c] == [1, 2, 3, 4]
    for ra, rc in zip(a, c):
        assert rc["loss"] == pytest.approx(ra["loss"], rel=1e-5) and rc["tokens"] == ra["tokens"]
        assert rc["acc_j"] == pytest.approx(ra["acc_j"], abs=1e-12)
    wa = load_file(str(tmp_path / "one" / "checkpoints" / "step00000004" / "drafter.safetensors"))
    wc = load_file(str(tmp_path / "pieces3" / "checkpoints" / "step00000004" / "drafter.safetensors"))
    for k in wa:
        torch.testing.assert_close(wc[k], wa[k], atol=1e-5, rtol=1e-4, msg=k)
    b = metrics(tmp_path / "sp2")
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for ra, rb in zip(a, b):
        assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-5) and rb["tokens"] == ra["tokens"]
        assert rb["acc_j"] == pytest.approx(ra["acc_j"], abs=1e-12)
    ea, eb = metrics(tmp_path / "one", "eval"), metrics(tmp_path / "sp2", "eval")
    assert ea and [r["step"] for r in eb] == [r["step"] for r in ea]
    for ra, rb in zip(ea, eb):
        assert rb["rounds"] == ra["rounds"] and rb["decode_accept_len"] == pytest.approx(ra["decode_accept_len"])
        assert rb["acc_j"] == pytest.approx(ra["acc_j"], abs=1e-12)
    wa = load_file(str(tmp_path / "one" / "checkpoints" / "step00000004" / "drafter.safetensors"))
    wb = load_file(str(tmp_path / "sp2" / "checkpoints" / "step00000004" / "drafter.safetensors"))
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], atol=1e-5, rtol=1e-4, msg=k)
