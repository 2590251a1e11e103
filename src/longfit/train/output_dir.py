"""Checks of OUTPUT_DIR made before anything expensive: a directory we can write, with room for the run.

The room a run needs is planned from the model states (`longfit.plan.analytic.model_states`): a DCP
checkpoint holds the trainable weights in fp32 and the optimizer state of every rank, that is the
planner's gradients + optimizer state per rank times the ranks that shard them; the export holds the
weights once more. Rotation keeps `train.keep_checkpoints`, and writes the next one before deleting
the oldest, so the peak is one more than kept.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from longfit.config import Config, ConfigError
from longfit.plan.analytic import model_states
from longfit.plan.setup import Setup

GiB = 1 << 30


def existing_ancestor(path: Path) -> Path:
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


def check_output_dir(output_dir: Path) -> None:
    """Refuse an output_dir that is a file, lies below a file, or cannot be created or written."""
    if output_dir.exists() and not output_dir.is_dir():
        raise ConfigError(f"output_dir={output_dir} is a file, not a directory: choose a directory (it is created if missing)")
    existing = existing_ancestor(output_dir)
    if not existing.is_dir():
        raise ConfigError(f"output_dir={output_dir} cannot be created: {existing} is a file")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"output_dir={output_dir} cannot be written: {existing} is not writable by this user; "
                          f"choose a directory you can write to")


@dataclass
class DiskPlan:
    checkpoint_bytes: float
    checkpoints: int  # new checkpoints on disk at the peak
    export_bytes: float

    @property
    def total(self) -> float:
        return self.checkpoint_bytes * self.checkpoints + self.export_bytes


def plan_disk(setup: Setup, cfg: Config, start_step: int, end_step: int, existing_checkpoints: int) -> DiskPlan:
    """Bytes this invocation writes at its peak (steps start_step..end_step). A checkpoint and the export hold the
    whole model: one rank's states times the ranks they are split over, FSDP's and tensor parallelism's (an upper
    bound under tp, which counts what tp replicates, norms and Qwen3.5's fused in_proj_qkv, once a tp rank)."""
    weights, gradients, optimizer = model_states(setup)
    shards = setup.shards * setup.tp
    saves = 1 + sum(1 for s in range(start_step + 1, end_step) if cfg.train.save_every and s % cfg.train.save_every == 0)
    if end_step <= start_step:
        saves = 0
    kept = min(existing_checkpoints, cfg.train.keep_checkpoints)
    new = max(1, min(saves, cfg.train.keep_checkpoints + 1 - kept)) if saves else 0
    exports = cfg.train.export and end_step == cfg.train.steps and saves
    export = (gradients if cfg.lora.enabled and not cfg.lora.merge_on_export else weights) * shards
    return DiskPlan((gradients + optimizer) * shards, new, export if exports else 0.0)


def check_free_space(output_dir: Path, plan: DiskPlan) -> None:
    """Refuse a run whose checkpoints and export will not fit the free space of output_dir's disk."""
    free = shutil.disk_usage(existing_ancestor(output_dir)).free
    if plan.total <= free:
        return
    parts = f"{plan.checkpoints} checkpoint(s) of {plan.checkpoint_bytes / GiB:.2f} GiB"
    if plan.export_bytes:
        parts += f" and an exported model of {plan.export_bytes / GiB:.2f} GiB"
    raise ConfigError(
        f"output_dir={output_dir}: this run writes about {plan.total / GiB:.2f} GiB ({parts}) but its disk has "
        f"{free / GiB:.2f} GiB free. Free space, lower train.keep_checkpoints, or choose another output_dir "
        f"(--force skips this check)."
    )
