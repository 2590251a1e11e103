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
