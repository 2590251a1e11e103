"""Asynchronous checkpoints: training goes on while DCP writes, with the guarantees of a synchronous save."""

import errno
import threading

import pytest
import torch
from memory_helpers import tiny_llama

from longfit.train import checkpoint
from longfit.train.checkpoint import (
    CheckpointError,
    CheckpointWriter,
    load_checkpoint,
    step_dirs,
    verify_checkpoint,
)


def model_and_optimizer(seed: int = 0):
    model = tiny_llama(seed=seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(input_ids=torch.arange(16).view(1, 16)).logits.sum().backward()
    optimizer.step()  # optimizer state exists
    return model, optimizer


def start(writer, out, step, model, optimizer):
    writer.start(out, step, model, optimizer, {"step": step}, "model: llama-tiny\n", keep=2)


@pytest.fixture
def gated_writes(monkeypatch):
    """DCP's shard writes wait for the returned event; `failure` set to an exception makes them raise it."""
    gate, state = threading.Event(), {"failure": None}
    write = checkpoint._HostStateWriter.write_data

    def gated(self, plan, planner):
        assert threading.current_thread() is not threading.main_thread()  # DCP's writer thread
        gate.wait(timeout=60)
        if state["failure"] is not None:
            raise state["failure"]
        return write(self, plan, planner)

    monkeypatch.setattr(checkpoint._HostStateWriter, "write_data", gated)
    return gate, state


def test_training_goes_on_while_the_checkpoint_is_written_and_it_holds_the_state_at_start(tmp_path, gated_writes):
    gate, _ = gated_writes
    model, optimizer = model_and_optimizer()
    at_start = {name: p.detach().clone() for name, p in model.named_parameters()}
    writer = CheckpointWriter()
    start(writer, tmp_path, 1, model, optimizer)
    # start returned while the shards are still unwritten: nothing is complete, the staging directory exists
    assert step_dirs(tmp_path) == [] and (tmp_path / "checkpoints" / ".tmp-step_00000001").is_dir()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # the next training steps change the weights in place
    gate.set()
    final = writer.wait()
    assert final == tmp_path / "checkpoints" / "step_00000001" and step_dirs(tmp_path) == [final]
    manifest, why = verify_checkpoint(final)
    assert why is None and manifest["step"] == 1
    fresh, fresh_optimizer = model_and_optimizer(seed=1)
    assert load_checkpoint(final, fresh, fresh_optimizer, rank=0) == {"step": 1}
    for name, p in fresh.named_parameters():
        torch.testing.assert_close(p, at_start[name], rtol=0, atol=0, msg=name)
    assert writer.wait() is None


def test_a_failed_background_write_surfaces_as_the_error_and_keeps_the_last_checkpoint(tmp_path, gated_writes):
    gate, state = gated_writes
    gate.set()
    model, optimizer = model_and_optimizer()
    writer = CheckpointWriter()
    start(writer, tmp_path, 1, model, optimizer)
    first = writer.wait()
    state["failure"] = OSError(errno.ENOSPC, "No space left on device")
    start(writer, tmp_path, 2, model, optimizer)  # the failure happens in the background
    with pytest.raises(CheckpointError, match=f"no space left on the disk.*the last complete checkpoint is {first}"):
        start(writer, tmp_path, 3, model, optimizer)  # the next save first waits for the previous one
    assert step_dirs(tmp_path) == [first] and not (tmp_path / "checkpoints" / ".tmp-step_00000002").exists()
    assert verify_checkpoint(first)[1] is None
    state["failure"] = RuntimeError("an I/O error")
    start(writer, tmp_path, 3, model, optimizer)
    with pytest.raises(CheckpointError, match="writing checkpoint step_00000003 .* failed while writing the model"):
        writer.wait()
    assert step_dirs(tmp_path) == [first] and writer.wait() is None
