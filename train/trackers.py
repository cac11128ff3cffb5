"""The training run's metrics: metrics.jsonl (always written; other code reads it) and the --report-to trackers
(wandb, TensorBoard, MLflow), one small interface over each library's own writer."""

from __future__ import annotations

import json
import os
import sys

from eagle3 import contract as C
from eagle3.records import METRICS_FILE, TENSORBOARD_DIR
from eagle3.train import checkpoint as CK
from eagle3.train.config import TrainConfig


class MetricsLog:
    """metrics.jsonl (always: other code reads it) + console + the --report-to trackers (TRACKERS), on rank 0.
    A tracker that fails to start is dropped with a warning: metrics.jsonl has everything."""

    def __init__(self, run_dir: str, cfg: TrainConfig, enabled: bool, resume_step: int | None = None):
        self.enabled = enabled
        self.path = os.path.join(run_dir, METRICS_FILE)
        self.trackers = []
        if not enabled:
            return
        for name in cfg.reporters():
            try:
                tracker = TRACKERS[name](run_dir, cfg, resume_step)
            except Exception as e:  # the tracker absent or broken: the run goes on
                print(f"[train] {name} off ({type(e).__name__}: {e})", file=sys.stderr)
                continue
            if tracker.on:
                self.trackers.append(tracker)

    def write(self, rec: dict) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        prefix = rec.get("split", "train")
        values = {f"{prefix}/{k}": v for k, v in _flatten(rec).items() if isinstance(v, (int, float))}
        for tracker in self.trackers:
            tracker.log(values, rec["step"])

    def close(self):
        for tracker in self.trackers:
            tracker.finish()
        self.trackers = []


# The trackers: one small interface (on, log(values, step), finish()) over each library's own writer. Not
# accelerate.tracking's classes: they log through accelerate's logger, which refuses to work before accelerate's
# PartialState exists, and PartialState set-up next to DeepSpeed's process group changes the environment (thread
# count, MASTER_PORT, device); not transformers' Trainer callbacks either, which need a Trainer. What is left is the
# two maintained writers themselves, behind the same few calls.



class TensorBoardTracker:
    """RUN/tensorboard/ event files, written by torch.utils.tensorboard's SummaryWriter (TensorBoard's format)."""
    name = "tensorboard"

    def __init__(self, run_dir: str, cfg: TrainConfig, resume_step: int | None):
        from torch.utils.tensorboard import SummaryWriter
        # purge_step: TensorBoard hides the killed run's events past the checkpoint, which the resume logs again
        # (as truncate_metrics does for metrics.jsonl)
        self.writer = SummaryWriter(os.path.join(run_dir, TENSORBOARD_DIR),
                                    purge_step=None if resume_step is None else resume_step + 1)
        self.on = True

    def log(self, values: dict, step: int) -> None:
        for k, v in values.items():
            self.writer.add_scalar(k, v, global_step=step)
        self.writer.flush()  # once per metrics line: a killed run's events are on disk up to its last line

    def finish(self) -> None:
        self.writer.close()


class WandbTracker:
    """wandb: offline unless the user is logged in; --wandb-mode (else $WANDB_MODE) as wandb reads it, and
    'disabled' turns it off (--report-to none does too)."""
    name = "wandb"

    def __init__(self, run_dir: str, cfg: TrainConfig, resume_step: int | None):
        mode = cfg.wandb_mode or os.environ.get("WANDB_MODE")
        self.on = mode != "disabled"
        if not self.on:
            return
        import wandb
        if mode is None:
            mode = "online" if (os.environ.get("WANDB_API_KEY") or wandb.api.api_key) else "offline"
        self.run = wandb.init(project=cfg.wandb_project, dir=run_dir, config=cfg.to_dict(), mode=mode,
                              resume="allow", name=os.path.basename(os.path.abspath(run_dir)))

    def log(self, values: dict, step: int) -> None:
        self.run.log(values, step=step)

    def finish(self) -> None:
        self.run.finish()


class MlflowTracker:
    """MLflow: the tracking server in $MLFLOW_TRACKING_URI, else a local file store RUN/mlruns (offline; `mlflow ui
    --backend-store-uri RUN/mlruns` reads it). A resumed run continues the same MLflow run (its id is kept in
    RUN/mlflow_run_id)."""
    name = "mlflow"

    def __init__(self, run_dir: str, cfg: TrainConfig, resume_step: int | None):
        import mlflow
        self.mlflow = mlflow
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            # MLflow 3 keeps its file store in "maintenance mode" behind this switch; it is the store that needs no
            # server and no database package, what an offline run wants
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            mlflow.set_tracking_uri("file:" + os.path.abspath(os.path.join(run_dir, "mlruns")))
        mlflow.set_experiment(cfg.wandb_project)
        id_file = os.path.join(run_dir, "mlflow_run_id")
        run_id = open(id_file).read().strip() if resume_step is not None and os.path.isfile(id_file) else None
        self.run = mlflow.start_run(run_id=run_id, run_name=os.path.basename(os.path.abspath(run_dir)))
        with open(id_file, "w") as f:
            f.write(self.run.info.run_id)
        if run_id is None:
            flat = {k: str(v)[:500] for k, v in cfg.to_dict().items()}
            mlflow.log_params(flat)
        self.on = True

    def log(self, values: dict, step: int) -> None:
        self.mlflow.log_metrics({k: float(v) for k, v in values.items()}, step=step)

    def finish(self) -> None:
        self.mlflow.end_run()


TRACKERS = {"wandb": WandbTracker, "tensorboard": TensorBoardTracker, "mlflow": MlflowTracker}


def last_metrics(path: str) -> dict:
    """The last training row of metrics.jsonl, with the last held-out row under "eval" (what train() returns)."""
    train_row, eval_row = {}, None
    if os.path.isfile(path):
        with open(path) as f:
            for line in f:
                try:
                    row = json.loads(line)
                except ValueError:
                    continue  # a torn last row
                if row.get("split") == "eval":
                    eval_row = row
                else:
                    train_row = row
    return {**train_row, **({"eval": eval_row} if eval_row else {})}


def truncate_metrics(path: str, step: int) -> int:
    """Drop the rows after `step` (the resumed run computes those steps again); returns how many were dropped."""
    if not os.path.isfile(path):
        return 0
    with open(path) as f:
        lines = f.readlines()
    keep = []
    for i, line in enumerate(lines):
        try:
            row_step = int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            if i == len(lines) - 1 and not line.endswith("\n"):
                break  # the last row, torn by the kill that stopped the run
            raise C.ContractError(f"{path}:{i + 1}: not a metrics row (JSON with a step)") from None
        if row_step <= step:
            keep.append(line)
    if len(keep) != len(lines):
        CK.write_bytes_atomic(path, "".join(keep).encode())
    return len(lines) - len(keep)


def _flatten(rec: dict) -> dict:
    out = {}
    for k, v in rec.items():
        if isinstance(v, list):
            out.update({f"{k}/{j}": x for j, x in enumerate(v)})
        else:
            out[k] = v
    return out
