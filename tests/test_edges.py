"""Edges a newcomer meets first: a mistyped preset, paths in errors, Ctrl-C during the test suite."""

import pytest

from longfit.cli import main


@pytest.mark.parametrize("typo, preset", [("llama-tiy", "llama-tiny"), ("Gemma3-Tiny", "gemma-3-tiny"),
                                          ("smollm2-135", "smollm2-135m")])
def test_a_mistyped_preset_gets_did_you_mean_not_a_download_hint(typo, preset, tmp_path, capfd):
    assert main(["plan", f"model={typo}"]) == 2
    out, err = capfd.readouterr()
    assert out == "" and f"did you mean {preset}?" in err and "hf download" not in err, err


def test_a_hub_id_still_gets_the_download_hint(capfd):
    assert main(["plan", "model=org/llama-tiny"]) == 2
    assert "hf download org/llama-tiny" in capfd.readouterr().err


def test_a_missing_data_file_in_a_config_is_named_by_its_absolute_path(tmp_path, monkeypatch, capfd):
    folder = tmp_path / "configs"
    folder.mkdir()
    (folder / "run.yaml").write_text("seq_len: 128\ntrain:\n  steps: 1\ndata:\n  path: data/missing.jsonl\n"
                                     "output_dir: run\n")
    monkeypatch.chdir(tmp_path)
    assert main(["train", "configs/run.yaml", "train.device=cpu"]) == 2
    _, err = capfd.readouterr()
    assert str(folder / "data" / "missing.jsonl") in err and not (folder / "run").exists(), err


def test_the_trainer_restores_the_handlers_it_set_and_leaves_the_programs_own(capfd):
    import signal

    from longfit.train.signals import StopOnSignal

    suite = signal.getsignal(signal.SIGINT)  # conftest's: the program's own
    try:
        with StopOnSignal() as stop:
            assert signal.getsignal(signal.SIGINT) is suite
            assert signal.getsignal(signal.SIGTERM) == stop._handle
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as in `longfit train`
        with StopOnSignal() as stop:
            assert signal.getsignal(signal.SIGINT) == stop._handle
            signal.raise_signal(signal.SIGINT)
            assert stop.signum == signal.SIGINT
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert "SIGINT received: finishing this step" in capfd.readouterr().err
    finally:
        signal.signal(signal.SIGINT, suite)


SUITE = '''
from pathlib import Path

from longfit.cli import main

RUN = Path({run!r})


def test_a_long_run():
    assert main(["train", "model=llama-tiny", "seq_len=128", "train.steps=100000", "train.device=cpu",
                 "eval.retrieval=false", "memory.tiled_mlp=false", f"output_dir={{RUN}}"]) == 0


def test_after_it():
    (RUN / "test_after_it ran").touch()
'''


@pytest.mark.slow  # moved out of the default suite for its 15 minutes; .ci/run runs it
def test_ctrl_c_stops_the_suite_at_the_first_signal(tmp_path):
    """pytest in a process group of its own, on a copy of the suite's conftest and a test that trains in-process;
    SIGINT to the group (as a terminal's Ctrl-C) once training has steps behind it. pytest must stop there, with
    its "interrupted" status, not fail that test and go on to the next."""
    import os
    import shutil
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    suite, run = tmp_path / "suite", tmp_path / "run"
    suite.mkdir()
    shutil.copy(Path(__file__).with_name("conftest.py"), suite)
    (suite / "test_long.py").write_text(SUITE.format(run=str(run)))
    process = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(suite)],
                               cwd=suite, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (run / "metrics.jsonl").is_file() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert process.poll() is None, process.communicate()[0]
        os.killpg(process.pid, signal.SIGINT)
        output = process.communicate(timeout=60)[0]
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == pytest.ExitCode.INTERRUPTED, output
    assert "KeyboardInterrupt" in output and not (run / "test_after_it ran").exists(), output
