"""What `longfit train` prints: nothing but the error when a check fails, else a short summary (not the
resolved config, which goes to config.yaml), a progress bar with tok/s and an ETA, the outcome, and no
third-party warnings."""

import re

import pytest

from longfit.cli import main

TINY = ["seq_len=128", "train.steps=2", "train.warmup_steps=0", "memory.tiled_mlp=false"]


def bad_runs(tmp_path, model_dir, corpus) -> dict[str, list[str]]:
    malformed = tmp_path / "malformed.jsonl"
    malformed.write_text('{"text": "fine"}\n{"text": "broken\n')
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    return {
        "mistyped key": ["train.stpes=3"],
        "bad value": ["train.lr=0"],
        "layout": ["parallel.cp=2"],
        "missing model": [f"model={tmp_path / 'no-such-model'}"],
        "malformed data": [f"model={model_dir}", f"data.path={malformed}"],
        "output_dir is a file": [f"model={model_dir}", f"data.path={corpus}", f"output_dir={a_file}"],
    }


@pytest.mark.parametrize("case", ["mistyped key", "bad value", "layout", "missing model", "malformed data",
                                  "output_dir is a file"])
def test_a_failed_check_prints_the_error_and_nothing_else(tiny_model_dir, corpus, tmp_path, capfd, case):
    argv = bad_runs(tmp_path, tiny_model_dir, corpus)[case]
    if not any(a.startswith("output_dir=") for a in argv):
        argv = [*argv, f"output_dir={tmp_path / 'run'}"]
    assert main(["train", *argv, *TINY]) == 2
    out, err = capfd.readouterr()
    assert out == ""
    assert re.fullmatch(r"longfit: error: [^\n]+\n", err), err


def test_a_run_prints_a_summary_progress_and_outcome(tiny_model_dir, corpus, tmp_path, capfd):
    out_dir = tmp_path / "run"
    assert main(["train", f"model={tiny_model_dir}", f"data.path={corpus}", f"output_dir={out_dir}", *TINY]) == 0
    out, err = capfd.readouterr()
    kernel = [line for line in out.splitlines() if line.startswith("attention kernel: ")]
    lines = [line for line in out.splitlines() if line not in kernel]
    assert len(kernel) == 1  # the trainer names the attention kernel once, beside the summary
    assert [line.split()[0] for line in lines[:5]] == ["model", "data", "layout", "memory", "output"]
    assert "full fine-tuning" in lines[0] and "1 rank: dp_shard 1 x cp 1 x tp 1" in lines[2]
    assert re.search(r"checkpointing \d/\d layers.*planned peak \d+\.\d\d GiB per rank", lines[3])
    assert "resolved config" not in out and "cp_method" not in out  # config.yaml holds it
    assert (out_dir / "config.yaml").read_text().count("cp_method: ring") == 1
    assert re.search(r"train 2/2 steps .*ETA .*loss \d\.\d{4}, lr .*, [\d,]+ tok/s", err)
    assert "done: steps 1-2" in out
    assert "Warning" not in err and "warn" not in err.lower(), err


def test_the_synthetic_task_is_scored_before_and_after(tmp_path, capfd):
    out_dir = tmp_path / "run"
    assert main(["train", "model=llama-tiny", f"output_dir={out_dir}", "seq_len=256", "train.steps=1",
                 "data.synthetic_samples=4", "eval.samples=1"]) == 0
    out, _ = capfd.readouterr()
    assert re.search(r"retrieval before training: 0\.\d\d at 256 tokens \(5 examples\)", out)
    assert re.search(r"retrieval accuracy at 256 tokens \(5 examples, .*\): \d\.\d\d before training -> \d\.\d\d after",
                     out)


def test_tensorboard_without_its_package_names_the_extra(tiny_model_dir, corpus, tmp_path, capfd, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else find_spec(name, *a))
    argv = [f"model={tiny_model_dir}", f"data.path={corpus}", f"output_dir={tmp_path / 'run'}", "train.tensorboard=true"]
    assert main(["train", *argv, *TINY]) == 2
    out, err = capfd.readouterr()
    assert out == "" and "longfit[tensorboard]" in err and not (tmp_path / "run").exists()
