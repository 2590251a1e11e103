"""Per-step metrics: one JSON object per line in OUTPUT_DIR/metrics.jsonl, optional TensorBoard, peak memory."""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path

import torch


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA allocator peak on GPU; the process's peak resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB


class MetricsLogger:
    """Appends metrics rows on rank 0; every other rank keeps quiet."""

    def __init__(self, output_dir: Path, enabled: bool, tensorboard: bool):
        self.enabled = enabled
        self.path = output_dir / "metrics.jsonl"
        self.writer = None
        if enabled and tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(output_dir / "tensorboard"))

    def log(self, row: dict) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if self.writer is not None:
            for key, value in row.items():
                if key != "step" and isinstance(value, (int, float)):
                    self.writer.add_scalar(f"train/{key}", value, row["step"])
            self.writer.flush()

    def truncate_after(self, step: int) -> None:
        """Drop rows past `step` (written by a run that crashed after its last checkpoint)."""
        if not self.enabled or not self.path.exists():
            return
        rows = [line for line in self.path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
        self.path.write_text("".join(line + "\n" for line in rows))

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
