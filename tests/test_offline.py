"""longfit never uses the network at run time: training (full and LoRA, with the export), the plan and
the eval run with every connection to, and name lookup of, another machine refused and recorded
(tests/network_guard.py). In this process huggingface_hub is told it is online, so the library must
read local files by itself; the `longfit` command runs in a subprocess of its own with the guard."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from network_guard import GUARDED_MAIN, block_network  # noqa: E402

TINY_RUN = ["seq_len=128", "train.steps=1", "train.warmup_steps=0", "memory.tiled_mlp=false", "data.synthetic_samples=8"]


@pytest.fixture
def attempts(monkeypatch) -> list[str]:
    import huggingface_hub.constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    seen: list[str] = []
    block_network(seen.append, monkeypatch.setattr)
    return seen


def test_the_guard_sees_what_a_hub_lookup_does(attempts):
    """What a LoRA export used to do: peft asked the hub about the base model's name (and hid the failure)."""
    from peft.utils.other import check_file_exists_on_hf_hub

    check_file_exists_on_hf_hub("llama-tiny", "config.json")
    assert any("huggingface.co" in attempt for attempt in attempts)


def test_train_export_eval_and_plan_in_process(attempts, tiny_model_dir, corpus, tmp_path, capsys):
    from longfit.cli import main
    from longfit.config import load_config
    from longfit.eval.command import load_eval_model
    from longfit.eval.retrieval import evaluate_retrieval
    from longfit.train.loop import train

    full = train(load_config(None, [f"model={tiny_model_dir}", f"data.path={corpus}", f"output_dir={tmp_path / 'full'}",
                                    *TINY_RUN]))
    lora = train(load_config(None, ["model=llama-tiny", "lora.enabled=true", "lora.r=2", f"output_dir={tmp_path / 'lora'}",
                                    *TINY_RUN]))
    for final in (full.export_dir, lora.export_dir):
        model, tokenizer = load_eval_model(str(final), torch.float32, "cpu", 0)
        assert len(evaluate_retrieval(model, tokenizer, [128], [0.5], 1)) == 1
    assert main(["plan", f"model={tiny_model_dir}", "seq_len=1024", "--trace"]) == 0
    assert attempts == []


@pytest.mark.slow  # moved out of the default suite for its 15 minutes; .ci/run runs it
def test_the_longfit_command(tiny_model_dir, tmp_path):
    log, out = tmp_path / "network.log", tmp_path / "lora"
    env = {**os.environ, "LONGFIT_TEST_NETWORK_LOG": str(log),
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    env.pop("HF_HUB_OFFLINE", None)

    def longfit(*args: str) -> subprocess.CompletedProcess:
        done = subprocess.run([sys.executable, "-c", GUARDED_MAIN, *args], env=env, capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, done.stderr
        return done

    trained = longfit("train", "model=llama-tiny", "lora.enabled=true", "lora.r=2", f"output_dir={out}", *TINY_RUN)
    evaluated = longfit("eval", "--model", str(out / "final"), "--lengths", "128", "--depths", "0.5", "--samples", "1")
    planned = longfit("plan", f"model={tiny_model_dir}", "seq_len=1024")
    assert not log.exists(), log.read_text()
    for done in (trained, evaluated, planned):
        assert "Warning" not in done.stderr, done.stderr
