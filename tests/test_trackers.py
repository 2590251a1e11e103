"""train.report_to: W&B (offline) and MLflow (a local file store) receive the config, the run summary and every
metrics.jsonl row, read back with each library's own records; a missing package or a tracker that cannot start
is refused before training."""

import json
import struct
from pathlib import Path

import pytest
from test_train import metric_rows
from test_train import run_config as train_run_config

from longfit.cli import main
from longfit.config import ConfigError, load_config
from longfit.train.loop import train


def run_config(model_dir, data, out, *extra):
    """test_train's run, shortened: 3 steps without accumulation, no export."""
    return train_run_config(model_dir, data, out, "train.steps=3", "train.grad_accum=1", "train.export=false", *extra)


def wandb_records(run_file: Path):
    """The protobuf records of a W&B run file (`run-ID.wandb`): wandb-core writes them in the LevelDB log format
    (32 KiB blocks, each record a 7-byte header: crc32c, length, kind) after a 7-byte W&B file header; wandb 0.31
    ships the Record message but no Python reader."""
    from wandb.proto import wandb_internal_pb2

    data, block = run_file.read_bytes(), 32768
    assert data[:4] == b":W&B"
    position, pending = 7, b""
    while position + 7 <= len(data):
        if block - position % block < 7 or data[position:position + 7] == bytes(7):  # a block's zero-filled tail
            position += block - position % block
            continue
        _, length, kind = struct.unpack("<IHB", data[position:position + 7])
        pending += data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


@pytest.fixture
def tracker_env(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_PROJECT", "longfit-test")
    (tmp_path / "wandb").mkdir()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "longfit-test")
    return tmp_path


def test_wandb_mlflow_and_tensorboard_receive_config_summary_and_every_metric(tiny_model_dir, corpus, tracker_env):
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    out = tracker_env / "run"
    logged = []
    train(run_config(tiny_model_dir, corpus, out, "train.report_to=[tensorboard,wandb,mlflow]", f"data.eval_path={corpus}",
                     "data.eval_rows=2"), log=logged.append)
    rows = metric_rows(out)
    losses = {row["step"]: row["loss"] for row in rows if "loss" in row}
    (evaluation,) = [row for row in rows if "eval_loss" in row]
    assert sorted(losses) == [1, 2, 3] and evaluation["step"] == 3

    (run_file,) = (tracker_env / "wandb").glob("wandb/offline-run-*/run-*.wandb")
    history, run = {}, None
    for record in wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            history[items["_step"]] = items
        elif kind == "run":
            run = record.run
    assert run.project == "longfit-test" and run.display_name == "run"
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["seq_len"] == 128 and config["train"]["report_to"] == ["tensorboard", "wandb", "mlflow"]
    assert "planned peak" in run.notes and "layout" in run.notes
    for step, loss in losses.items():
        assert history[step]["train/loss"] == pytest.approx(loss)
        assert history[step]["train/lr"] == pytest.approx(rows[step - 1]["lr"])
    assert history[3]["eval/loss"] == pytest.approx(evaluation["eval_loss"])
    assert history[3]["eval/ppl"] == pytest.approx(evaluation["eval_ppl"])

    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    (mlflow_run,) = client.search_runs([client.get_experiment_by_name("longfit-test").experiment_id])
    assert mlflow_run.info.run_name == "run" and mlflow_run.info.status == "FINISHED"
    assert mlflow_run.data.params["seq_len"] == "128" and mlflow_run.data.params["train.lr"] == "0.01"
    history = client.get_metric_history(mlflow_run.info.run_id, "train/loss")
    assert {m.step: m.value for m in history} == pytest.approx(losses)
    assert client.get_metric_history(mlflow_run.info.run_id, "plan/peak_bytes")[0].value > 0
    (eval_loss,) = client.get_metric_history(mlflow_run.info.run_id, "eval/loss")
    assert (eval_loss.step, eval_loss.value) == (3, pytest.approx(evaluation["eval_loss"]))
    summary = Path(client.download_artifacts(mlflow_run.info.run_id, "run_summary.txt", str(tracker_env)))
    assert summary.read_text().strip() in "\n".join(logged)
    config_file = Path(client.download_artifacts(mlflow_run.info.run_id, "config.yaml", str(tracker_env)))
    assert load_config(config_file).to_dict() == load_config(out / "config.yaml").to_dict()

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert {e.step: e.value for e in events.Scalars("train/loss")} == pytest.approx(losses)
    assert [(e.step, e.value) for e in events.Scalars("eval/loss")] == [(3, pytest.approx(evaluation["eval_loss"]))]
    assert "run_summary/text_summary" in events.Tags()["tensors"]


def test_a_missing_tracker_package_is_refused_before_anything_is_built(tiny_model_dir, corpus, tmp_path, capfd,
                                                                     monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else find_spec(name, *a))
    argv = [f"model={tiny_model_dir}", f"data.path={corpus}", f"output_dir={tmp_path / 'run'}", "train.device=cpu",
            "train.report_to=[mlflow]"]
    assert main(["train", *argv]) == 2
    out, err = capfd.readouterr()
    assert "pip install 'longfit[mlflow]'" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


def test_a_tracker_that_cannot_start_is_refused_naming_the_fix(tiny_model_dir, corpus, tracker_env, monkeypatch):
    """MLflow 3 refuses a file store unless MLFLOW_ALLOW_FILE_STORE is set: its message and the fix come back as
    one ConfigError, before any step, and no metrics are written."""
    pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")
    out = tracker_env / "run"
    with pytest.raises(ConfigError, match=r"train.report_to=\[mlflow\]: mlflow could not start a run .*MLFLOW_TRACKING_URI"):
        train(run_config(tiny_model_dir, corpus, out, "train.report_to=[mlflow]"))
    assert not (out / "metrics.jsonl").exists()


def test_the_retired_tensorboard_key_names_its_replacement(tmp_path):
    config = tmp_path / "old.yaml"
    config.write_text("train:\n  tensorboard: true\n")
    with pytest.raises(ConfigError, match=r"^train.tensorboard is no longer a key: use train.report_to=\[tensorboard\]$"):
        load_config(config)
    with pytest.raises(ConfigError, match="names a tracker twice"):
        load_config(None, ["train.report_to=[wandb,wandb]"])
