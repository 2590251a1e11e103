"""Experiment trackers (`train.report_to`): TensorBoard, Weights & Biases and MLflow, on rank 0 alone.

Each tracker is driven through its library's own API and takes its own settings from its own environment
(WANDB_PROJECT, WANDB_MODE, WANDB_DIR, MLFLOW_TRACKING_URI, MLFLOW_EXPERIMENT_NAME, ...), as a user of the
library expects. A run sends, once at its start, the resolved config and the run summary with the planned
peak memory; then every metrics.jsonl row (`train/...`, `eval/...`) at its step and the retrieval scores.

A missing package is refused before anything is built (`require_trackers`); a tracker that cannot start
its run (no W&B login, an MLflow store it refuses) is a ConfigError naming the library's message and the fix.
"""

from __future__ import annotations

import importlib.util
import math
import os
from pathlib import Path

from longfit.config import Config, ConfigError
from longfit.train.resume import flat_config

PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}  # tracker -> module (and extra)
START_FIXES = {
    "tensorboard": "check that OUTPUT_DIR/tensorboard can be written",
    "wandb": "run `wandb login`, or set WANDB_MODE=offline to keep the run on this machine (`wandb sync` later)",
    "mlflow": "point MLFLOW_TRACKING_URI at a tracking server, or at file:DIR with MLFLOW_ALLOW_FILE_STORE=true",
}


def require_trackers(names: list[str]) -> None:
    """Every tracker of `train.report_to` has its package: said before the run starts, not at its first step."""
    for name in names:
        if importlib.util.find_spec(PACKAGES[name]) is None:
            raise ConfigError(f"train.report_to=[{name}] needs the {PACKAGES[name]} package: pip install "
                              f"'longfit[{name}]', or remove {name} from train.report_to")


def _markdown_code(text: str) -> str:
    """`text` as a markdown code block (TensorBoard renders its text as markdown): lines kept as they are."""
    return "\n".join("    " + line for line in text.splitlines())


class _TensorBoard:
    def __init__(self, cfg: Config, summary: str, facts: dict):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(Path(cfg.output_dir) / "tensorboard"))
        self.writer.add_text("config", _markdown_code(cfg.to_yaml()))
        self.writer.add_text("run_summary", _markdown_code(summary))
        for key, value in facts.items():
            self.writer.add_scalar(key, value, 0)

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def finish(self, failed: bool) -> None:
        self.writer.close()


class _WandB:
    def __init__(self, cfg: Config, summary: str, facts: dict):
        import wandb

        # The project and run name the user's WANDB_PROJECT / WANDB_NAME give, else longfit's; an argument would
        # override them.
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "longfit"),
                              name=os.environ.get("WANDB_NAME", Path(cfg.output_dir).name),
                              config=cfg.to_dict(), notes=summary)
        self.run.summary.update(facts)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def finish(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)


class _MLflow:
    def __init__(self, cfg: Config, summary: str, facts: dict):
        import mlflow

        self.mlflow = mlflow
        self.run = mlflow.start_run(run_name=Path(cfg.output_dir).name)
        mlflow.log_params(flat_config(cfg.to_dict()))
        mlflow.log_text(cfg.to_yaml(), "config.yaml")
        mlflow.log_text(summary + "\n", "run_summary.txt")
        mlflow.log_metrics(facts, step=0)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.mlflow.log_metrics(metrics, step=step, run_id=self.run.info.run_id)

    def finish(self, failed: bool) -> None:
        self.mlflow.end_run(status="FAILED" if failed else "FINISHED")


TRACKERS = {"tensorboard": _TensorBoard, "wandb": _WandB, "mlflow": _MLflow}


class Trackers:
    """The run's trackers (none on ranks other than 0, and none without train.report_to); a context manager that
    finishes every run it started, marked failed when the training failed."""

    def __init__(self):
        self.started: list = []

    def start(self, cfg: Config, summary: str, facts: dict[str, float]) -> None:
        """Start a run in each tracker of cfg.train.report_to with the resolved config, the run summary and its
        `facts` (planned peak bytes, parameters)."""
        for name in cfg.train.report_to:
            try:
                self.started.append(TRACKERS[name](cfg, summary, facts))
            except ConfigError:
                raise
            except Exception as e:  # the library's own failure to start: its message, and what fixes it
                message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise ConfigError(f"train.report_to=[{name}]: {name} could not start a run ({message}); "
                                  f"{START_FIXES[name]}") from e

    def log(self, metrics: dict[str, float], step: int) -> None:
        """`metrics` at `step`; values that are not finite (the loss of a skipped step) are left out."""
        finite = {key: value for key, value in metrics.items() if math.isfinite(value)}
        if finite:
            for tracker in self.started:
                tracker.log(finite, step)

    def __enter__(self) -> Trackers:
        return self

    def __exit__(self, exc_type, exc, traceback) -> bool:
        started, self.started = self.started, []
        for tracker in started:
            tracker.finish(failed=exc_type is not None)
        return False
