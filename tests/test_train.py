"""The trainer inside the real DeepSpeed engine: launched by the `deepspeed` launcher with 2 CPU processes, and its
one-process runs in the test's own process (run_here)."""

import json
import os
import socket
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from eagle3 import contract as C
from eagle3.model import EXPORT_KEYS


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def _argv(dump, target, out, *extra):
    return ["--dump", dump, "--target", target, "--out", str(out), "--drafter", "tiny", "--draft-vocab-size", "512",
            "--no-bf16", "--token-budget", "256", "--lr", "3e-3", "--warmup-steps", "2", "--held-out-fraction", "0.2",
            "--eval-interval", "4", "--eval-batches", "2", "--num-workers", "1", "--no-progress", "--log-interval",
            "1", *map(str, extra)]


def launch(n, dump, target, out, *extra, check=True):
    cmd = ["deepspeed", "--num_gpus", str(n), "--master_port", str(_port()), "--module", "eagle3.train",
           *_argv(dump, target, out, *extra)]
    r = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600)
    if check:
        assert r.returncode == 0, (r.stdout + r.stderr)[-5000:]
    return r


def run_here(dump, target, out, *extra):
    """launch(1, ...)'s run in this process: the same flags through the CLI's own parser into the same trainer and
    DeepSpeed engine (a world of one), without the launcher's and a fresh interpreter's ~20 s on a 2-core CPU.
    Multi-process runs still go through launch()."""
    from eagle3.train.config import from_args, train_parser
    from eagle3.train.trainer import train
    return train(from_args(train_parser().parse_args(_argv(dump, target, out, *extra))))


def metrics(out, split="train"):
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    return [r for r in rows if r.get("split", "train") == split]


@pytest.fixture(scope="module")
def zero2_run(tiny_dump, tiny_targets, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "zero2"
    launch(2, tiny_dump, tiny_targets["llama"], out, "--zero-stage", "2", "--max-steps", 8, "--save-interval", 4)
    return str(out)


@pytest.mark.slow
def test_zero2_two_processes_learns_and_checkpoints(zero2_run, tiny_dump):
    rows = metrics(zero2_run)
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert rows[-1]["loss"] < rows[0]["loss"]
    assert all(len(r["acc_j"]) == 7 and r["tok_s"] > 0 and r["tokens"] > 0 for r in rows)
    assert metrics(zero2_run, "eval"), "held-out evaluation ran"
    run = json.load(open(os.path.join(zero2_run, "run.json")))
    m = C.load_manifest(tiny_dump)
    assert run["identity"] == m.identity() and run["standardize"] == "v1" and run["world_size"] == 2
    assert run["capture"]["hidden_state_indices"] == [1, 3, 4]
    ck = os.path.join(zero2_run, "checkpoints", "step00000008")
    rec = json.load(open(os.path.join(ck, "eagle3_checkpoint.json")))
    assert rec["step"] == 8 and rec["capture"]["hidden_state_indices"] == [1, 3, 4]
    w = load_file(os.path.join(ck, "drafter.safetensors"))
    assert set(w) == set(EXPORT_KEYS)
    assert w["fc.weight"].shape == (64, 3 * 64) and w["lm_head.weight"].shape == (512, 64)


@pytest.mark.slow
def test_zero3_matches_zero2(zero2_run, tiny_dump, tiny_targets, tmp_path):
    """Same data, same global batch: ZeRO-3 (partitioned parameters) computes the same losses and weights."""
    out = tmp_path / "zero3"
    launch(2, tiny_dump, tiny_targets["llama"], out, "--zero-stage", "3", "--max-steps", 8, "--save-interval", 4)
    a, b = metrics(zero2_run), metrics(out)
    assert [r["step"] for r in b] == list(range(1, 9))
    for ra, rb in zip(a, b):
        assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-4, abs=1e-5)
    wa = load_file(os.path.join(zero2_run, "checkpoints", "step00000008", "drafter.safetensors"))
    wb = load_file(os.path.join(out, "checkpoints", "step00000008", "drafter.safetensors"))
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], atol=1e-4, rtol=1e-3)


@pytest.mark.slow
def test_kill_and_resume_reproduces_the_uninterrupted_run(zero2_run, tiny_dump, tiny_targets, tmp_path):
    out = tmp_path / "resumed"
    r = launch(2, tiny_dump, tiny_targets["llama"], out, "--zero-stage", "2", "--max-steps", 8, "--save-interval", 4,
               "--stop-after-steps", 5, check=False)
    assert r.returncode != 0 and "stopped at step 5" in r.stdout + r.stderr
    # the killed run got past its step-4 checkpoint; steps after it are recomputed on resume
    launch(2, tiny_dump, tiny_targets["llama"], out, "--zero-stage", "2", "--max-steps", 8, "--save-interval", 4,
           "--resume")
    full = {r["step"]: r["loss"] for r in metrics(zero2_run)}
    resumed = {}
    for r in metrics(out):
        resumed[r["step"]] = r["loss"]  # the resumed run's rows for steps 5.. come last and win
    assert sorted(resumed) == list(range(1, 9))
    for s in range(1, 9):
        assert resumed[s] == pytest.approx(full[s], rel=1e-6, abs=1e-7), s


@pytest.mark.slow
def test_refusals(zero2_run, tiny_dump, tiny_targets, convs, tmp_path):
    # the dumps were made with another target
    with pytest.raises(C.ContractError, match="target.config_sha256"):
        run_here(tiny_dump, tiny_targets["deepseek_v3"], tmp_path / "a", "--max-steps", 1)
    # an existing run is not overwritten, and nothing of it is touched
    before = open(os.path.join(zero2_run, "metrics.jsonl")).read()
    with pytest.raises(ValueError, match="already holds a training run"):
        run_here(tiny_dump, tiny_targets["llama"], zero2_run, "--max-steps", 1)
    assert open(os.path.join(zero2_run, "metrics.jsonl")).read() == before
    # resuming with dumps of another capture set
    from eagle3.dump.job import DumpConfig, run_dump
    other = str(tmp_path / "other_dump")
    run_dump(DumpConfig(target=tiny_targets["llama"], data=[convs], out=other, layers=[2, 3, 5], dtype="fp32",
                        progress=False))
    r = launch(2, other, tiny_targets["llama"], zero2_run, "--max-steps", 8, "--resume", check=False)
    assert r.returncode != 0 and "capture.hidden_state_indices" in r.stdout + r.stderr


def test_overfitting_a_tiny_dump_drives_acc0_to_one(tiny_targets, convs, tmp_path):
    """The drafter can learn: on six conversations, draft and teacher argmax agree almost everywhere."""
    from eagle3.dump.job import DumpConfig, run_dump
    from eagle3.train.config import TrainConfig
    from eagle3.train.trainer import train
    dump = str(tmp_path / "dump")
    run_dump(DumpConfig(target=tiny_targets["llama"], data=[convs], out=dump, dtype="fp32", num_samples=6,
                        progress=False))
    res = train(TrainConfig(dump=[dump], target=tiny_targets["llama"], out=str(tmp_path / "run"), drafter="tiny",
                            draft_vocab_size=512, bf16=False, max_steps=160, token_budget=4096, lr=3e-3,
                            warmup_steps=10, held_out_fraction=0.0, save_interval=1000, num_workers=0, log_interval=1,
                            progress=False, wandb_mode="disabled"))
    assert res["acc_j"][0] > 0.9 and res["accept_len"] > 5, res
    first = metrics(str(tmp_path / "run"))[0]
    assert first["acc_j"][0] < 0.2


def test_compiled_pieces_survive_many_shapes_and_the_held_out_eval(tiny_dump, tiny_targets, tmp_path, monkeypatch):
    """The fast path's compiled pieces (here through torch.compile's 'eager' backend on the CPU, with a recompile
    limit of 1 so that the second batch shape already exceeds it) fall back to the uncompiled math instead of ending
    the run with FailOnRecompileLimitHit; the run then checkpoints, evaluates and keeps its best weights, which
    export-sglang --step best exports."""
    import torch._dynamo
    from eagle3.export.sglang import export_drafter
    from eagle3.model import kernels
    from eagle3.train.config import TrainConfig
    from eagle3.train.trainer import train
    monkeypatch.setattr(kernels, "COMPILE_ON_CPU", "eager")
    monkeypatch.setattr(kernels, "_COMPILED", {})
    monkeypatch.setattr(kernels, "_EAGER", set())
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 1)
    out = tmp_path / "run"
    with pytest.warns(RuntimeWarning, match="running it uncompiled"):
        res = train(TrainConfig(dump=[tiny_dump], target=tiny_targets["llama"], out=str(out), drafter="tiny",
                                draft_vocab_size=512, bf16=False, max_steps=12, token_budget=160, lr=3e-3,
                                warmup_steps=2, held_out_fraction=0.25, eval_interval=4, save_interval=5,
                                accept_steps=3, num_workers=0, log_interval=1, progress=False,
                                wandb_mode="disabled"))
    assert kernels._EAGER, "the recompile limit was hit (the test exercised the fallback)"
    lengths = {r["tokens"] for r in metrics(str(out))}
    assert len(lengths) > 3, "batches of many shapes"
    evals = metrics(str(out), "eval")
    assert [e["step"] for e in evals] == [4, 8, 12]
    assert all(e["decode_steps"] == 3 and len(e["decode_rate_j"]) == 3 and e["rounds"] > 0
               and 1.0 <= e["decode_accept_len"] <= 4.0 for e in evals)
    best = max(evals, key=lambda e: e["decode_accept_len"])
    assert res["best"]["step"] == best["step"]
    rec = json.load(open(out / "checkpoints" / "best" / "eagle3_checkpoint.json"))
    assert rec["step"] == best["step"] and rec["best"]["decode_accept_len"] == best["decode_accept_len"]
    assert sorted(t for t in os.listdir(out / "checkpoints") if not t.endswith(".py")) == \
        ["best", "latest", "step00000010", "step00000012"]
    prov = export_drafter(str(out), str(tmp_path / "export"), step="best")
    assert prov.step == best["step"]
    w = load_file(str(tmp_path / "export" / "model.safetensors"))
    b = load_file(str(out / "checkpoints" / "best" / "drafter.safetensors"))
    assert torch.equal(w["fc.weight"].float(), b["fc.weight"].to(torch.bfloat16).float())


def test_an_error_in_the_final_evaluation_keeps_the_final_checkpoint(tiny_dump, tiny_targets, tmp_path, monkeypatch):
    from eagle3.train import trainer
    from eagle3.train.config import TrainConfig
    from eagle3.train.trainer import train

    def broken(*a, **k):
        raise RuntimeError("evaluation blew up")
    monkeypatch.setattr(trainer, "walk", broken)  # the held-out replay
    out = tmp_path / "run"
    with pytest.raises(RuntimeError, match="blew up"):
        train(TrainConfig(dump=[tiny_dump], target=tiny_targets["llama"], out=str(out), drafter="tiny",
                          draft_vocab_size=512, bf16=False, max_steps=3, token_budget=256, held_out_fraction=0.25,
                          eval_interval=100, save_interval=100, num_workers=0, progress=False, wandb_mode="disabled"))
    assert open(out / "checkpoints" / "latest").read().strip() == "step00000003"
    assert os.path.isfile(out / "checkpoints" / "step00000003" / "drafter.safetensors")


def test_last_metrics_reports_what_a_finished_run_recorded(tmp_path):
    # a finished run resumed (the quickstart rerun) trains nothing and reports its last rows instead
    from eagle3.train.trackers import last_metrics
    p = tmp_path / "metrics.jsonl"
    rows = [{"step": 10, "loss": 3.0}, {"step": 10, "split": "eval", "decode_accept_len": 1.5},
            {"step": 20, "loss": 2.0}, {"step": 20, "split": "eval", "decode_accept_len": 1.7}]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 3')  # a torn last row
    got = last_metrics(str(p))
    assert got["step"] == 20 and got["loss"] == 2.0 and got["eval"]["decode_accept_len"] == 1.7
    assert last_metrics(str(tmp_path / "absent.jsonl")) == {}


def test_loss_tokens_all_learns_at_prompt_positions_and_evaluates_on_answers(tiny_dump, tiny_targets, tmp_path):
    """--loss-tokens all: the training loss counts pairs at every real position (more than the dump's loss mask
    gives), while the held-out evaluation still counts the answers' pairs only, the same as the default run's."""
    runs = {}
    for which in ("assistant", "all"):
        out = tmp_path / which
        run_here(tiny_dump, tiny_targets["llama"], out, "--max-steps", 2, "--eval-interval", 2,
                 "--loss-tokens", which)
        runs[which] = (metrics(out), metrics(out, "eval"))
    (ta, ea), (tb, eb) = runs["assistant"], runs["all"]
    assert [r["step"] for r in tb] == [1, 2]
    for ra, rb in zip(ta, tb):
        assert rb["counted"] > ra["counted"] > 0, (ra["counted"], rb["counted"])
    assert ea[-1]["counted"] == eb[-1]["counted"]


def test_noisy_aux_scales_the_noise_by_each_layers_rms():
    """--aux-noise: per captured layer and token, std = scale x that layer's RMS (layers of very different scales
    each get their share), reproducible by seed, in the input's dtype."""
    from eagle3.train.step import noisy_aux
    torch.manual_seed(0)
    H, scales = 64, (1e-2, 1.0, 1e2)
    x = torch.cat([s * torch.randn(2, 400, H, dtype=torch.float64) for s in scales], dim=-1)
    y = noisy_aux(x, 0.1, 3, seed=5)
    noise, layers = (y - x).view(2, 400, 3, H), x.view(2, 400, 3, H)
    rel = noise.pow(2).mean(dim=(0, 1, 3)).sqrt() / layers.pow(2).mean(dim=(0, 1, 3)).sqrt()
    torch.testing.assert_close(rel, torch.full((3,), 0.1, dtype=torch.float64), rtol=0.03, atol=0)
    assert noise.mean().abs() < 0.01 * noise.std()
    assert torch.equal(noisy_aux(x, 0.1, 3, seed=5), y) and not torch.equal(noisy_aux(x, 0.1, 3, seed=6), y)
    assert noisy_aux(x.to(torch.bfloat16), 0.1, 3, seed=5).dtype == torch.bfloat16


def test_aux_noise_reaches_training_batches_only(tiny_dump, tiny_targets, tmp_path):
    """With lr 0 the weights never move: --aux-noise changes the training losses (the noise reaches the drafter)
    but not one digit of the held-out evaluation (which never sees noise)."""
    runs = {}
    for noise in ("0", "0.5"):
        out = tmp_path / noise
        run_here(tiny_dump, tiny_targets["llama"], out, "--max-steps", 2, "--eval-interval", 2, "--lr", 0,
                 "--aux-noise", noise)
        runs[noise] = (metrics(out), metrics(out, "eval"))
    (ta, ea), (tb, eb) = runs["0"], runs["0.5"]
    assert all(ra["loss"] != rb["loss"] for ra, rb in zip(ta, tb))
    for k in ("loss_j", "acc_j", "decode_accept_len"):
        assert ea[-1][k] == eb[-1][k], k
