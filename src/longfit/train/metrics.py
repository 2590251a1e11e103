"""Per-step metrics: one JSON object per line in OUTPUT_DIR/metrics.jsonl, sent on to the trackers; peak memory.

Every line is strict JSON: a value that is not finite (the loss of a skipped step) is written as null,
never as NaN. Besides step rows, a row with an "event" key records something that happened at that
step (a config change applied on resume).
"""

from __future__ import annotations

import json
import math
import resource
import sys
from pathlib import Path

import torch

from longfit.config import ConfigError


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA allocator peak on GPU; the process's peak resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB


def _step_of(line: str) -> int | None:
    try:
        step = json.loads(line).get("step")
    except (ValueError, AttributeError):
        return None
    return step if isinstance(step, int) else None


def tracker_name(key: str) -> str:
    """The name a tracker shows a metrics.jsonl value under: `eval_loss` -> `eval/loss`, `loss` -> `train/loss`."""
    return f"eval/{key[len('eval_'):]}" if key.startswith("eval_") else f"train/{key}"


class MetricsLogger:
    """Appends metrics rows on rank 0, and sends their numbers to the run's trackers; every other rank keeps quiet."""

    def __init__(self, output_dir: Path, enabled: bool, trackers):
        self.enabled = enabled
        self.path = output_dir / "metrics.jsonl"
        self.trackers = trackers

    def log(self, row: dict) -> None:
        if not self.enabled:
            return
        row = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()}
        try:
            with self.path.open("a") as f:
                f.write(json.dumps(row, allow_nan=False) + "\n")
        except OSError as e:
            raise ConfigError(f"cannot append to {self.path} ({e.strerror}): fix that (free disk space), then run the "
                              f"same command to resume from the last checkpoint") from e
        if "event" not in row:
            self.trackers.log({tracker_name(key): value for key, value in row.items() if key != "step"
                               and isinstance(value, (int, float)) and not isinstance(value, bool)}, row["step"])

    def truncate_after(self, step: int) -> int:
        """Drop rows past `step` (written by a run that stopped after its last checkpoint) and lines that are
        not JSON (the last one, torn by a crash mid-write); returns how many lines were dropped."""
        if not self.enabled or not self.path.exists():
            return 0
        lines = self.path.read_text().splitlines()
        kept = [line for line in lines if _step_of(line) is not None and _step_of(line) <= step]
        self.path.write_text("".join(line + "\n" for line in kept))
        return len([line for line in lines if line.strip()]) - len(kept)
