"""The published configs of popular checkpoints (tests/data/checkpoint_configs, #52) and their sweep
(benchmarks/checkpoint_sweep.py): each folder is a config transformers loads, its source is listed, the recorded
results cover every folder; (slow) the sweep checks, copies and trains two of them and writes the results files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "tests" / "data" / "checkpoint_configs"
RESULTS = ROOT / "benchmarks" / "results" / "checkpoint_sweep.json"
FOLDERS = sorted(path.parent.name for path in CONFIGS.glob("*/config.json"))

def test_every_folder_is_a_config_transformers_loads() -> None:
    from transformers import AutoConfig

    assert len(FOLDERS) >= 40
    for name in FOLDERS:
        assert [path.name for path in (CONFIGS / name).iterdir()] == ["config.json"], name  # no weights, no tokenizer
        config = AutoConfig.from_pretrained(CONFIGS / name)
        assert config.get_text_config().num_hidden_layers > 0, name


def test_the_readme_names_the_source_of_every_folder() -> None:
    readme = (CONFIGS / "README.md").read_text()
    assert {name for name in FOLDERS if f"| {name} |" not in readme} == set()


def test_the_recorded_sweep_covers_every_folder() -> None:
    """Every folder checked in both regimes, none "cannot shrink" (LongRoPE's Phi-3.5 and Phi-4-mini were, #52), and
    its copy trained or its failure recorded; a plan, where it ran, answered or ran past its time limit (#52: a rerun once planning is
    fast fills in the rest)."""
    rows = {row["name"]: row for row in json.loads(RESULTS.read_text())["rows"]}
    assert set(rows) == set(FOLDERS)
    cannot_shrink = {name for name, row in rows.items() if row["gpu"]["verdict"] == "cannot shrink"}
    assert cannot_shrink == set(), cannot_shrink
    for name, row in rows.items():
        assert {"fp32", "gpu", "train"} <= set(row), name
        plans = [row[key]["verdict"] for key in ("plan_32k", "plan_128k") if key in row]
        assert set(plans) <= {"fits", "does not fit", "timed out", "fails"}, name


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_the_sweep_checks_copies_and_trains(tmp_path) -> None:
    names = ["HuggingFaceTB--SmolLM2-135M", "google--gemma-2-2b-it"]  # plain Llama; softcaps and sliding windows
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    argv = [sys.executable, str(ROOT / "benchmarks" / "checkpoint_sweep.py"), "--out", str(tmp_path), "--only", *names,
            "--parts", "check", "train"]
    subprocess.run(argv, env=env, check=True, timeout=1100)
    rows = {row["name"]: row for row in json.loads((tmp_path / "checkpoint_sweep.json").read_text())["rows"]}
    assert set(rows) == set(names)
    for row in rows.values():
        assert row["fp32"] == row["gpu"] == {"verdict": "exact", "detail": ""}
        assert row["train"]["verdict"] == "trained" and row["train"]["loss"] > 0
    assert rows["google--gemma-2-2b-it"]["model_type"] == "gemma2"
    from transformers import AutoConfig

    copy = AutoConfig.from_pretrained(tmp_path / "copies" / "google--gemma-2-2b-it")
    assert (copy.attn_logit_softcapping, copy.final_logit_softcapping) == (50.0, 30.0)  # the checkpoint's caps
    assert copy.hidden_size == 64 and "sliding_attention" in copy.layer_types  # tiny width, its windowed layers
    table = (tmp_path / "checkpoint_sweep.md").read_text()
    assert "| google--gemma-2-2b-it | gemma2 | exact | exact | trained: loss" in table
    again = subprocess.run(argv, env=env, check=True, timeout=300, capture_output=True, text=True)
    assert json.loads((tmp_path / "checkpoint_sweep.json").read_text())["rows"] == list(rows.values())  # resumed
    assert "train trained" in again.stdout
