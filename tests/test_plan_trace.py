"""The live-bytes tracker, and the fake-tensor trace against the same step on real CPU tensors."""

import pytest
import torch

from longfit.config import load_config
from longfit.plan.trace import TraceUnsupported, trace_step
from longfit.plan.tracker import HOST, LiveBytes

MiB = 1 << 20


def test_tracker_counts_storages_once_and_frees():
    tracker = LiveBytes()
    with tracker:
        x = torch.empty(MiB, dtype=torch.uint8)
        view = x[10:]  # a view: no new storage
        y = x.float()  # 4 MiB
        assert tracker.live == 5 * MiB
        del y
        assert tracker.live == MiB and tracker.peak == 5 * MiB
        with tracker.region("backward"):
            z = torch.ones(2 * MiB, dtype=torch.uint8)
        assert tracker.by_tag["backward"] == 2 * MiB
        with tracker.region(HOST):
            host = torch.empty(8 * MiB, dtype=torch.uint8)
        assert tracker.live == 3 * MiB and tracker.host_live == 8 * MiB
        del x, view, z, host
    assert tracker.live == 0 and tracker.host_live == 0 and tracker.host_peak == 8 * MiB



def test_an_operator_on_meta_tensors_runs_once_for_the_metadata_of_its_inputs():
    """#52: on meta tensors the tracker remembers an operator's outputs by its inputs' shapes, strides and dtypes
    (`MetaResults`): a second tanh of a tensor like the first, at another offset, is made, not run, and the live
    bytes are those of running every operator; `aten._unsafe_view`, which returns its input's storage without its
    schema saying so, and views run every time and hold no new bytes; outputs of another shape run again."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from longfit.plan.tracker import MetaResults

    class Runs(TorchDispatchMode):  # below the tracker: what reaches the operators' meta kernels
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func)
            return func(*args, **(kwargs or {}))

    def traced(meta_results):
        x = torch.empty(4, 64, 32, device="meta")
        with Runs() as runs, LiveBytes(on_meta=True, meta_results=meta_results) as tracker:
            y = [torch.tanh(x[i]) for i in range(4)]  # (64, 32) each, at four offsets
            z = torch.ops.aten._unsafe_view(y[0], (32, 64))
            w = torch.tanh(x[:, :16])  # another shape
            del y[1:]
            live, peak = tracker.live, tracker.peak
        del z, w
        return [op for op in runs.ops if op is not torch.ops.aten.empty_strided.default], live, peak

    every, live, peak = traced(None)
    remembered, live_remembered, peak_remembered = traced(MetaResults())
    assert every.count(torch.ops.aten.tanh.default) == 5 and remembered.count(torch.ops.aten.tanh.default) == 2
    assert remembered.count(torch.ops.aten._unsafe_view.default) == 1
    # x (32,768 bytes, counted as its views are taken), and 8,192-byte outputs: y[0] and w held, five at the peak
    assert (live_remembered, peak_remembered) == (live, peak) == (32768 + 2 * 8192, 32768 + 5 * 8192)

def test_tracker_follows_storage_resize_and_adopted_tensors():
    weights = torch.empty(3 * MiB, dtype=torch.uint8)
    tracker = LiveBytes()
    with tracker:
        tracker.adopt([weights], "weights")
        buffer = torch.empty(MiB, dtype=torch.uint8)
        buffer.untyped_storage().resize_(0)  # how FSDP2 frees an unsharded parameter
        assert tracker.live == 3 * MiB
        buffer.untyped_storage().resize_(2 * MiB)  # ... and gathers it again
        assert tracker.live == 5 * MiB and tracker.peak_by_tag["weights"] == 3 * MiB
        tracker.retag([weights], "gradients")
        assert tracker.by_tag["gradients"] == 3 * MiB and tracker.by_tag["weights"] == 0


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "overrides",
    [
        ["seq_len=2048", "train.dtype=fp32"],
        ["seq_len=2048", "train.dtype=fp32", "lora.enabled=true", "memory.offload_activations=true",
         "memory.tiled_mlp=true"],
        ["seq_len=512"],
    ],
)
def test_fake_trace_equals_real_cpu_step(overrides):
    """The same step on real tensors (llama-tiny, on this CPU) allocates exactly what the fake trace counts.

    Mostly in fp32: a CPU without bf16 matrix instructions multiplies bf16 some 25 times slower (a minute
    for one 2048-token step); the bf16 row (the GPU default: bf16 weights, fp32 upcasts) is short."""
    cfg = load_config(None, ["model=llama-tiny", *overrides])
    fake = trace_step(cfg, 1, fake=True)
    real = trace_step(cfg, 1, fake=False)
    assert fake.peak_bytes == pytest.approx(real.peak_bytes, rel=0.01)
    assert fake.host_peak_bytes == pytest.approx(real.host_peak_bytes, rel=0.01)
    assert fake.peak_phase == real.peak_phase


def test_trace_shards_over_fake_ranks():
    cfg = load_config(None, ["model=llama-tiny", "seq_len=4096", "lora.enabled=false"])
    one = trace_step(cfg, 1)
    four = trace_step(load_config(None, ["model=llama-tiny", "seq_len=4096", "parallel.cp=4"]), 4)
    assert four.world_size == 4 and four.local_tokens == 1024
    assert four.breakdown["optimizer state"] == pytest.approx(one.breakdown["optimizer state"] / 4, rel=0.01)
    assert four.peak_bytes < one.peak_bytes


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["lora.enabled=true", "lora.quantize_base=true"], "QLoRA"),
        (["memory.optimizer=adamw8bit"], "adamw8bit"),
        (["parallel.cpu_offload=true"], "cpu_offload"),
    ],
)
def test_untraceable_configs_say_why(overrides, message):
    with pytest.raises(TraceUnsupported, match=message):
        trace_step(load_config(None, ["model=llama-tiny", "seq_len=1024", *overrides]), 1)


def test_auto_dtype_is_traced_as_the_plan_resolves_it():
    """train.dtype=auto: the trace takes its dtype from the plan's Setup.regime, fp32 on a CPU rank (before: bf16
    whatever the device, while the plan said fp32)."""
    from longfit.plan.setup import resolve

    auto, fp32 = (load_config(None, ["model=llama-tiny", "seq_len=512", f"train.dtype={d}"]) for d in ("auto", "fp32"))
    assert resolve(auto, 1, "cpu").regime == "fp32"
    assert trace_step(auto, 1, device_type="cpu").peak_bytes == trace_step(fp32, 1).peak_bytes
