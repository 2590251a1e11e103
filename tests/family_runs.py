"""`longfit train` of a family's checkpoint on one process and under `--nproc 2`, shared by the family tests
(tests/test_families_attention.py, tests/test_families_moe.py; test modules import the fixtures below by name)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

TRAIN_ROW = 128  # rows of several short documents (short_documents: 17 to 60 tokens each)


@pytest.fixture(scope="module")
def short_documents(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("short-documents") / "corpus.jsonl"
    documents = (json.dumps({"text": f"doc {i}: " + "a quick fox. " * (i % 4 + 1)}) for i in range(48))
    path.write_text("".join(f"{document}\n" for document in documents))
    return path


def train_argv(checkpoint: Path, corpus: Path, out: Path) -> list[str]:
    return [f"model={checkpoint}", f"data.path={corpus}", f"output_dir={out}", f"seq_len={TRAIN_ROW}",
            "train.device=cpu", "train.steps=3", "train.micro_batch=2", "train.lr=1e-2", "train.warmup_steps=0"]


def logged_losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]


@pytest.fixture(scope="module")
def one_rank_losses(checkpoints, short_documents, tmp_path_factory):
    """name -> the losses `longfit train` logs on one process for checkpoints[name] (run in this process, once)."""
    from longfit.cli import main

    runs: dict[str, list[float]] = {}

    def losses(name: str) -> list[float]:
        if name not in runs:
            out = tmp_path_factory.mktemp(f"train-{name}") / "run"
            assert main(["train", *train_argv(checkpoints[name], short_documents, out)]) == 0
            runs[name] = logged_losses(out)
        return runs[name]

    return losses


def cp2_losses(checkpoint: Path, corpus: Path, out: Path, method: str, *settings: str) -> list[float]:
    """The losses `longfit train --nproc 2 parallel.cp=2` logs with `method` (and the run's other `settings`), on the
    rows of `train_argv`."""
    argv = [*train_argv(checkpoint, corpus, out), *settings, "parallel.cp=2", f"parallel.cp_method={method}"]
    done = subprocess.run([sys.executable, "-m", "longfit", "train", "--nproc", "2", *argv], capture_output=True,
                          text=True, timeout=800)
    assert done.returncode == 0, done.stderr[-3000:]
    return logged_losses(out)
