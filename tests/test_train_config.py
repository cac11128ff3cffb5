"""The training conventions users expect: `eagle3 train` flags with help, presets + flags, the trackers behind
--report-to (TensorBoard files TensorBoard reads), transformers' LR schedule, and the single-process rendezvous port."""

import json
import math
import os
import socket
import subprocess
import sys

import pytest
import torch


def train_subparser():
    from eagle3.cli import build_parser
    sub = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    return sub.choices["train"]


def parse(*argv):
    from eagle3.cli import build_parser
    from eagle3.train.config import from_args
    return from_args(build_parser().parse_args(["train", *argv]))


def test_every_train_flag_has_help():
    import argparse
    p = train_subparser()
    flags = {o: a.help for a in p._actions for o in a.option_strings if a.help != argparse.SUPPRESS}
    assert len(flags) > 50
    assert not [o for o, h in flags.items() if not (h or "").strip()]
    # the flags the README and the tests use are all still there
    for flag in ("--dump", "--target", "--out", "--config", "--drafter", "--draft-vocab-size", "--no-bf16", "--bf16",
                 "--token-budget", "--lr", "--warmup-steps", "--held-out-fraction", "--eval-interval", "--no-progress",
                 "--resume", "--no-resume", "--no-fast-path", "--no-keep-best", "--wandb-mode", "--report-to",
                 "--betas", "--max-steps", "--activation-checkpointing"):
        assert flag in flags, flag
    assert "--stop-after-steps" not in flags  # the tests' aid: hidden from --help
    help_text = p.format_help()
    assert "peak learning rate" in help_text and "(default: 0.0001)" in help_text


def test_a_preset_a_flag_overriding_it_and_a_plain_flag_combine(tmp_path):
    from eagle3 import presets
    preset = presets.load("train", "example")
    cfg = parse("--config", "example", "--dump", "d1", "d2", "--target", "t", "--lr", "2e-3", "--seed", "5",
                "--no-bf16", "--betas", "0.8,0.9", "--report-to", "wandb,tensorboard")
    assert cfg.lr == 2e-3 != preset["lr"]                       # the flag wins over the preset
    assert cfg.warmup_steps == preset["warmup_steps"] == 20     # the preset wins over the default
    assert cfg.drafter == "smollm2-135m" and cfg.epochs == 4
    assert cfg.seed == 5 and cfg.bf16 is False and cfg.betas == (0.8, 0.9) and cfg.dump == ["d1", "d2"]
    assert cfg.keep_checkpoints == 2 and cfg.zero_stage == 2   # neither: the dataclass default
    assert cfg.reporters() == ["wandb", "tensorboard"]
    # a YAML file instead of a preset name; its values are flags' values with underscores
    y = tmp_path / "mine.yaml"
    y.write_text("lr: 2.0e-4\nbf16: false\nbetas: [0.85, 0.9]\nreport_to: none\n")
    cfg = parse("--config", str(y), "--dump", "d", "--target", "t", "--bf16", "--warmup_steps", "7")
    assert (cfg.lr, cfg.bf16, cfg.betas, cfg.warmup_steps, cfg.reporters()) == (2e-4, True, (0.85, 0.9), 7, [])
    y.write_text("lr: 2.0e-4\nlearning_rate: 1\n")
    with pytest.raises(ValueError, match="unknown training options.*learning_rate"):
        parse("--config", str(y), "--dump", "d", "--target", "t")
    with pytest.raises(ValueError, match="--report-to.*unknown"):
        parse("--dump", "d", "--target", "t", "--report-to", "wandb,comet")


def test_the_deepspeed_module_entry_takes_the_same_flags():
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    r = subprocess.run([sys.executable, "-m", "eagle3.train", "--help"], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "--report-to" in r.stdout and "--warmup-steps" in r.stdout and "--no-bf16" in r.stdout


# ------------------------------------------------------------------------------------------------ LR schedule

def closed_form(step, lr, warmup, total, min_ratio):
    if step < warmup:
        return lr * step / warmup
    progress = (step - warmup) / (total - warmup)
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def test_lr_follows_cosine_with_warmup_down_to_the_floor_and_a_resume_continues_it():
    from eagle3.train.config import TrainConfig
    from eagle3.train.setup import lr_schedule
    cfg = TrainConfig(lr=1e-3, warmup_steps=4, min_lr_ratio=0.1)

    def run(total, state=None, steps=0):
        opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=cfg.lr)
        sched = lr_schedule(opt, cfg, total)
        if state is not None:
            sched.load_state_dict(state)
        lrs = {sched.last_epoch: sched.get_last_lr()[0]}
        for _ in range(steps):
            opt.step()
            sched.step()
            lrs[sched.last_epoch] = sched.get_last_lr()[0]
        return sched, lrs

    sched, lrs = run(20, steps=20)
    for s in (0, 1, 3, 4, 5, 12, 19, 20):
        assert lrs[s] == pytest.approx(closed_form(s, 1e-3, 4, 20, 0.1), rel=1e-12, abs=1e-15), s
    assert lrs[0] == 0 and lrs[4] == pytest.approx(1e-3) and lrs[20] == pytest.approx(1e-4)
    # a resume (here to a longer run) restores the step count and the checkpoint's current lr; every later step is
    # on the curve of the new length (30 steps)
    sched, _ = run(20, steps=10)
    _, lrs = run(30, state=sched.state_dict(), steps=5)
    assert lrs[10] == pytest.approx(closed_form(10, 1e-3, 4, 20, 0.1), rel=1e-12)
    for s in range(11, 16):
        assert lrs[s] == pytest.approx(closed_form(s, 1e-3, 4, 30, 0.1), rel=1e-12), s


# ------------------------------------------------------------------------------------------------ trackers

def rows(n, start=1, scale=1.0):
    return [{"step": s, "epoch": 0, "loss": scale * (10.0 - s), "acc_j": [0.1 * s, 0.05 * s], "accept_len": 1.0 + s,
             "lr": 1e-4 * s, "time": 1.7e9} for s in range(start, start + n)]


def read_scalars(logdir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(logdir)
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def test_tensorboard_events_are_read_back_by_tensorboard_and_metrics_jsonl_is_unchanged(tmp_path):
    from eagle3.train.config import TrainConfig
    from eagle3.records import METRICS_FILE, TENSORBOARD_DIR
    from eagle3.train.trackers import MetricsLog
    cfg = TrainConfig(report_to="wandb,tensorboard", wandb_mode="disabled")
    log = MetricsLog(str(tmp_path), cfg, enabled=True)
    assert [t.name for t in log.trackers] == ["tensorboard"], "--wandb-mode disabled drops wandb"
    written = rows(4) + [{"step": 4, "split": "eval", "decode_accept_len": 2.5, "decode_rate_j": [0.9, 0.5]}]
    for r in written:
        log.write(r)
    log.close()
    assert [json.loads(line) for line in open(tmp_path / METRICS_FILE)] == written
    got = read_scalars(str(tmp_path / TENSORBOARD_DIR))
    assert got["train/loss"] == {1: 9.0, 2: 8.0, 3: 7.0, 4: 6.0}
    assert got["train/acc_j/1"] == pytest.approx({s: 0.05 * s for s in range(1, 5)})
    assert got["train/lr"] == pytest.approx({s: 1e-4 * s for s in range(1, 5)})
    assert got["eval/decode_accept_len"] == {4: 2.5} and got["eval/decode_rate_j/0"] == pytest.approx({4: 0.9})

    # a resume from the step-2 checkpoint logs steps 3-4 again: TensorBoard shows the new values, once each
    log = MetricsLog(str(tmp_path), cfg, enabled=True, resume_step=2)
    for r in rows(2, start=3, scale=2.0):
        log.write(r)
    log.close()
    assert read_scalars(str(tmp_path / TENSORBOARD_DIR))["train/loss"] == {1: 9.0, 2: 8.0, 3: 14.0, 4: 12.0}


def test_wandb_logs_offline_unless_logged_in(tmp_path, monkeypatch):
    import wandb
    from eagle3.train.config import TrainConfig
    from eagle3.train.trackers import MetricsLog
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    if wandb.api.api_key:
        pytest.skip("logged in to wandb here: the default would be online")
    log = MetricsLog(str(tmp_path), TrainConfig(report_to="wandb"), enabled=True)  # no --wandb-mode
    assert [t.name for t in log.trackers] == ["wandb"] and log.trackers[0].run.settings.mode == "offline"
    log.write(rows(1)[0])
    log.close()
    assert [d for d in os.listdir(tmp_path / "wandb") if d.startswith("offline-run-")]


def test_mlflow_logs_to_a_local_file_store_and_a_resume_continues_its_run(tmp_path, monkeypatch):
    import mlflow
    from eagle3.train.config import TrainConfig
    from eagle3.train.trackers import MetricsLog
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = TrainConfig(report_to="mlflow")
    log = MetricsLog(str(tmp_path), cfg, enabled=True)
    for r in rows(3):
        log.write(r)
    log.close()
    run_id = (tmp_path / "mlflow_run_id").read_text().strip()
    client = mlflow.tracking.MlflowClient(tracking_uri="file:" + str(tmp_path / "mlruns"))
    loss = {m.step: m.value for m in client.get_metric_history(run_id, "train/loss")}
    assert loss == {1: 9.0, 2: 8.0, 3: 7.0}
    assert client.get_run(run_id).data.params["lr"] == str(cfg.lr)
    log = MetricsLog(str(tmp_path), cfg, enabled=True, resume_step=2)  # the same MLflow run goes on
    log.write(rows(1, start=3, scale=2.0)[0])
    log.close()
    assert (tmp_path / "mlflow_run_id").read_text().strip() == run_id
    # MLflow keeps every value logged at a step: the resumed run's step 3 is there beside the first one
    assert sorted(m.value for m in client.get_metric_history(run_id, "train/loss") if m.step == 3) == [7.0, 14.0]


def test_report_to_none_and_other_ranks_log_only_metrics_jsonl(tmp_path):
    from eagle3.train.config import REPORTERS, TrainConfig
    from eagle3.train.trackers import TRACKERS, MetricsLog
    assert set(TRACKERS) == set(REPORTERS)
    assert TrainConfig().report_to == "none"  # the default: no tracker, metrics.jsonl only
    log = MetricsLog(str(tmp_path / "a"), TrainConfig(report_to="none"), enabled=True)
    assert log.trackers == []
    os.makedirs(tmp_path / "a")
    log.write(rows(1)[0])
    log.close()
    assert os.listdir(tmp_path / "a") == ["metrics.jsonl"]
    log = MetricsLog(str(tmp_path / "b"), TrainConfig(report_to="tensorboard"), enabled=False)
    log.write(rows(1)[0])
    log.close()
    assert not os.path.exists(tmp_path / "b")


# ------------------------------------------------------------------------------------------------ rendezvous

def test_a_process_without_a_launcher_rendezvous_on_a_free_port(monkeypatch):
    from eagle3 import dist as D
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    D.launcher_env()
    port = int(os.environ["MASTER_PORT"])
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["MASTER_ADDR"]) == ("0", "1", "127.0.0.1")
    with socket.socket() as s:  # free: it can be bound
        s.bind(("", port))
    # a launcher's environment is left as it is
    monkeypatch.setenv("MASTER_PORT", "29777")
    monkeypatch.setenv("WORLD_SIZE", "4")
    D.launcher_env()
    assert os.environ["MASTER_PORT"] == "29777" and os.environ["WORLD_SIZE"] == "4"
