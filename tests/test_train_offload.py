"""The trainer gives the offload store's host arena and disk file back when its steps end, finished or failed."""

import functools

import pytest
from test_memory_offload import open_offload_files

from longfit.config import load_config
from longfit.memory import apply
from longfit.memory.checkpointing import ActivationOffloader
from longfit.memory.offload import OffloadStore
from longfit.memory.switches import DISK_STAGING_SLOTS
from longfit.train import loop
from longfit.train.loop import train


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])  # bf16 on a CPU: fp32 weights under bf16 autocast
@pytest.mark.parametrize("ending", ["finished", "failed"])
def test_the_trainer_releases_the_offload_stores_when_its_steps_end(tiny_model_dir, corpus, tmp_path, monkeypatch,
                                                                     ending, dtype):
    stores, held = [], []

    class EveryInputOnDisk(OffloadStore):  # so that the step holds a file as well as the arena's staging slots
        def __init__(self, placement, layers, offload_dir, checkpoint_dtype, **kwargs):
            super().__init__(None, layers, offload_dir, checkpoint_dtype, **kwargs)
            stores.append(self)

    def step_then_look(run, step, factor):
        result = run_step(run, step, factor)
        held.append((stores[0].allocated_host_bytes, open_offload_files(offload_dir)))
        if ending == "failed":
            raise RuntimeError("the step failed")
        return result

    run_step, offload_dir = loop._Run.step, tmp_path / "offload"
    monkeypatch.setattr(apply, "OffloadStore", EveryInputOnDisk)
    # the tiny model's layer inputs (2 x 128 x 64 fp32) are below the 1 MiB default threshold
    monkeypatch.setattr(apply, "ActivationOffloader", functools.partial(ActivationOffloader, min_offload_bytes=1024))
    monkeypatch.setattr(loop._Run, "step", step_then_look)
    cfg = load_config(None, [
        f"model={tiny_model_dir}", f"data.path={corpus}", f"output_dir={tmp_path / 'run'}", "seq_len=128",
        "train.device=cpu", "train.steps=2", "train.micro_batch=2", f"train.dtype={dtype}", "memory.tiled_mlp=false",
        "memory.activation_checkpointing=true", "memory.offload_activations=true", f"memory.offload_dir={offload_dir}",
    ])
    if ending == "failed":
        with pytest.raises(RuntimeError, match="the step failed"):
            train(cfg)
    else:
        assert train(cfg).steps == 2
    slot = stores[0].placement.slot_bytes
    assert held and held[0] == (DISK_STAGING_SLOTS * slot, 1)  # during the steps: the staging slots and the file
    assert len(stores) == 1 and stores[0].stats.disk_read_bytes > 0
    assert stores[0].allocated_host_bytes == 0 and open_offload_files(offload_dir) == 0
