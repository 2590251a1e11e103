"""The offload store: GPU-first placement, exact-size host arena, bit-exact disk tier, bf16/fp8 storage; its
arena and disk file released on close and on drop; a disk input's device copy started by its read."""

from __future__ import annotations

import contextlib

import functools
import gc
import os
import threading
import weakref

import pytest
import torch
from memory_helpers import loss_sum, packed_batch
from memory_helpers import tiny_llama as build_tiny_llama

from longfit.memory import offload
from longfit.memory.checkpointing import (
    ActivationOffloader,
    apply_activation_checkpointing,
)
from longfit.memory.offload import DISK_THREADS, DiskFile, OffloadStore, decode, encode, encoded_bytes
from longfit.memory.switches import (
    DISK_STAGING_SLOTS,
    STORE_ALIGN,
    CheckpointPlacement,
    place_checkpoints,
    stored_input_bytes,
)

B, L, H, LAYERS = 2, 48, 64, 4
INPUT_BYTES = B * L * H * 4  # one fp32 layer input
SLOT = stored_input_bytes(B * L, H, 4, None)
tiny_llama = functools.partial(build_tiny_llama, layers=LAYERS)


def awkward(shape, dtype, seed=0):
    """Random values with NaN (with a payload), +-inf, -0.0 and a subnormal in them."""
    t = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    flat = t.view(-1)
    flat[:4] = torch.tensor([float("nan"), float("inf"), float("-inf"), -0.0], dtype=dtype)
    flat[4] = torch.finfo(dtype).tiny / 4
    bits = flat.view(torch.int16 if dtype.itemsize == 2 else torch.int32)
    bits[5] = {torch.bfloat16: 0x7FC1, torch.float16: 0x7E01, torch.float32: 0x7FC00123}[dtype]  # NaN with a payload
    return t


# The numeric regimes of a step: fp32, and fp32 weights under bf16 autocast (train.dtype=bf16 on one rank).
REGIMES = [pytest.param(None, id="fp32"), pytest.param(torch.bfloat16, id="bf16-autocast")]


def step(model, autocast: torch.dtype | None = None):
    """Loss and gradients of one forward and backward of `model` (gradients cleared first)."""
    model.zero_grad(set_to_none=True)
    inputs, labels = packed_batch()
    with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        loss = loss_sum(model, labels, None, **inputs) / (labels != -100).sum()
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def offloaded_model(store: OffloadStore | None):
    """The tiny Llama with every layer checkpointed, its inputs in `store` (None: checkpointing alone)."""
    model = tiny_llama()
    offloader = ActivationOffloader(min_offload_bytes=1024, store=store) if store is not None else None
    apply_activation_checkpointing(model, 1.0, offloader=offloader)
    return model, offloader


def train_step(placement=None, offload_dir=None, checkpoint_dtype=None, autocast=None):
    model, offloader = offloaded_model(OffloadStore(placement, LAYERS, offload_dir, checkpoint_dtype))
    loss, grads = step(model, autocast)
    offloader.store.close()
    return loss, grads, offloader


def assert_same_step(result, reference):
    assert torch.equal(result[0], reference[0])
    assert result[1].keys() == reference[1].keys()
    for name, grad in reference[1].items():
        assert torch.equal(result[1][name], grad), name


def test_placement_is_gpu_first_then_host_then_disk():
    assert place_checkpoints(6, 100, device_budget=250) == CheckpointPlacement(2, 4, 0, 100)
    # without a disk tier the host takes the rest, over budget or not (preflight refuses that)
    assert place_checkpoints(6, 100, device_budget=0, host_budget=300) == CheckpointPlacement(0, 6, 0, 100)
    # with one: host slots minus the staging slots, the first layers on disk
    assert DISK_STAGING_SLOTS == 2
    placement = place_checkpoints(6, 100, device_budget=100, host_budget=400, disk=True)
    assert placement == CheckpointPlacement(1, 2, 3, 100)
    assert [placement.tier(i) for i in range(6)] == ["disk", "disk", "disk", "host", "host", "device"]
    assert placement.host_bytes == (2 + DISK_STAGING_SLOTS) * 100 <= 400
    assert place_checkpoints(6, 100, host_budget=600, disk=True) == CheckpointPlacement(0, 6, 0, 100)  # all fit


def test_slots_are_exact_sizes_rounded_to_a_page():
    assert SLOT == INPUT_BYTES  # already a multiple of 4 KiB
    assert stored_input_bytes(1000, 3000, 2, None) == -(-1000 * 3000 * 2 // STORE_ALIGN) * STORE_ALIGN
    assert stored_input_bytes(1000, 3000, 4, "bf16") == stored_input_bytes(1000, 3000, 2, None)
    assert stored_input_bytes(1000, 3000, 2, "fp8") == -(-(1000 * 3000 + 4 * 1000) // STORE_ALIGN) * STORE_ALIGN
    for dtype in (torch.float32, torch.bfloat16):
        for kind in (None, "bf16", "fp8"):
            shape = torch.Size((3, 100, 30))
            assert encode(torch.ones(shape, dtype=dtype), kind).numel() == encoded_bytes(shape, dtype, kind)
            assert -(-encoded_bytes(shape, dtype, kind) // STORE_ALIGN) * STORE_ALIGN == stored_input_bytes(
                300, 30, dtype.itemsize, kind)


def test_gpu_first_keeps_the_last_layers_that_fit_the_device_budget():
    """A fake device budget of 2.5 layer inputs: the last two stay on the device, the first two go to the arena."""
    reference = train_step()
    placement = place_checkpoints(LAYERS, SLOT, device_budget=5 * SLOT // 2)
    loss, grads, offloader = train_step(placement)
    torch.testing.assert_close(loss, reference[0], rtol=0, atol=0)
    for name, grad in reference[1].items():
        assert torch.equal(grads[name], grad), name
    stats, store = offloader.stats, offloader.store
    assert (stats.device_tensors, stats.offloaded_tensors) == (2, 2)
    assert store.stats.device_bytes == store.stats.host_bytes == 2 * INPUT_BYTES
    assert store.allocated_host_bytes == 0  # closed after the step; it held exactly the two host slots:
    assert placement.host_bytes == 2 * SLOT


def test_store_allocates_exactly_its_placement(tmp_path):
    placement = CheckpointPlacement(device=0, host=3, disk=1, slot_bytes=SLOT)
    model = tiny_llama()
    store = OffloadStore(placement, offload_dir=str(tmp_path))
    apply_activation_checkpointing(model, 1.0, offloader=ActivationOffloader(min_offload_bytes=1024, store=store))
    inputs, labels = packed_batch()
    loss_sum(model, labels, None, **inputs).backward()
    # three host slots and the disk tier's staging slots: no power-of-two rounding, nothing else
    assert store.allocated_host_bytes == (3 + DISK_STAGING_SLOTS) * SLOT == placement.host_bytes
    assert store.stats.disk_written_bytes == store.stats.disk_read_bytes == INPUT_BYTES
    store.close()


def test_disk_tier_round_trips_bit_exactly(tmp_path):
    """Every layer on disk: the same loss and gradients, bit for bit, as keeping every input on the host."""
    reference = train_step()
    placement = CheckpointPlacement(device=0, host=0, disk=LAYERS, slot_bytes=SLOT)
    loss, grads, offloader = train_step(placement, offload_dir=str(tmp_path))
    assert torch.equal(loss, reference[0])
    for name, grad in reference[1].items():
        assert torch.equal(grads[name], grad), name
    assert offloader.store.stats.disk_written_bytes == offloader.store.stats.disk_read_bytes == LAYERS * INPUT_BYTES
    assert list(tmp_path.iterdir()) == []  # the file was unlinked as soon as it was opened


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_disk_round_trip_keeps_special_values(tmp_path, dtype):
    shape = torch.Size((2, 300, 40))
    placement = CheckpointPlacement(0, 0, 3, stored_input_bytes(600, 40, dtype.itemsize, None))
    store = OffloadStore(placement, offload_dir=str(tmp_path))
    originals = [awkward(shape, dtype, seed) for seed in range(3)]
    stored = [store.put(i, t) for i, t in enumerate(originals)]
    for i in reversed(range(3)):  # backward order, each prefetched first as the offloader does
        store.prefetch(stored[i])
        back = store.load(stored[i])
        assert back.dtype == dtype and back.shape == shape
        assert torch.equal(back.view(torch.uint8), originals[i].view(torch.uint8))
    store.close()


def test_an_abandoned_disk_prefetch_gives_its_staging_slot_back(tmp_path):
    """A backward that fails after prefetching (the input is never loaded) must not keep a staging slot: with
    both slots gone the next forward's put would wait for one forever."""
    import threading

    shape = torch.Size((2, 300, 40))
    placement = CheckpointPlacement(0, 0, 3, stored_input_bytes(600, 40, 4, None))
    store = OffloadStore(placement, offload_dir=str(tmp_path))
    original = awkward(shape, torch.float32, seed=7)
    loaded = []

    def scenario():  # in a thread: a put that waits forever must fail the test, not hang it
        for _ in range(DISK_STAGING_SLOTS + 1):  # more abandoned prefetches than there are slots
            stored = store.put(0, awkward(shape, torch.float32))
            assert store.prefetch(stored)
            del stored  # dropped unloaded, as autograd drops the saved inputs of a failed backward
        loaded.append(store.load(store.put(1, original)))

    worker = threading.Thread(target=scenario, daemon=True)
    worker.start()
    worker.join(timeout=30)
    assert loaded, "put waited for a staging slot that an abandoned prefetch kept"
    assert torch.equal(loaded[0].view(torch.uint8), original.view(torch.uint8))
    store.close()


def test_compressed_storage_error_bounds():
    x = torch.randn(2, 50, 64) * torch.logspace(-3, 3, 50)[None, :, None]  # tokens of very different scales
    bf16 = decode(encode(x, "bf16"), x.shape, x.dtype, "bf16")
    assert bf16.dtype == torch.float32
    torch.testing.assert_close(bf16, x, rtol=2**-8, atol=0)
    fp8 = decode(encode(x, "fp8"), x.shape, x.dtype, "fp8")
    scale = x.abs().amax(dim=-1, keepdim=True)
    # e4m3 keeps 3 mantissa bits; the per-token scale maps each token's maximum to 448
    assert ((fp8 - x).abs() <= 2**-4 * x.abs() + scale * 2**-9 / 448 * 8).all()
    assert torch.equal(decode(encode(x, None), x.shape, x.dtype, None), x)
    half = x.to(torch.bfloat16)
    assert torch.equal(decode(encode(half, "bf16"), half.shape, half.dtype, "bf16"), half)  # already 2 bytes


@pytest.mark.parametrize("checkpoint_dtype", ["bf16", "fp8"])
def test_compressed_checkpoints_change_gradients_slightly_not_the_loss(checkpoint_dtype):
    reference = train_step()
    loss, grads, offloader = train_step(checkpoint_dtype=checkpoint_dtype)
    assert torch.equal(loss, reference[0])  # forward is untouched; only the recompute starts from the stored input
    worst = max(((grads[n] - g).norm() / g.norm()).item() for n, g in reference[1].items())
    assert 0 < worst < (0.01 if checkpoint_dtype == "bf16" else 0.1)
    expected = LAYERS * encoded_bytes(torch.Size((B, L, H)), torch.float32, checkpoint_dtype)
    assert offloader.store.stats.host_bytes == expected


# -- release: close, drop, a second store --------------------------------------------------------------------


def open_offload_files(directory) -> int:
    """This process's open file descriptors on offload files in `directory` (unlinked, still listed by name)."""
    prefix, count = os.path.join(str(directory), "longfit-offload-"), 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith(prefix)
        except OSError:  # the listing's own descriptor, closed since
            pass
    return count


@pytest.mark.parametrize("autocast", REGIMES)
@pytest.mark.parametrize("how", ["close", "drop"])
def test_the_arena_and_the_disk_file_are_released_on_close_and_on_drop(tmp_path, how, autocast):
    """After a step through host and disk layers the store holds its arena and its (unlinked) file; `close`, or
    dropping the model and its store, gives both back: the descriptor is closed, the arena's buffer freed, and
    the store's finalizer does not keep the store alive."""
    placement = CheckpointPlacement(device=0, host=2, disk=2, slot_bytes=SLOT)
    store = OffloadStore(placement, offload_dir=str(tmp_path))
    model, offloader = offloaded_model(store)
    step(model, autocast)
    assert store.stats.host_bytes == store.stats.disk_read_bytes == 2 * INPUT_BYTES
    assert store.allocated_host_bytes == placement.host_bytes and open_offload_files(tmp_path) == 1
    arena, alive = weakref.ref(store.arena.buffer), weakref.ref(store)
    if how == "close":
        store.close()
        assert store.allocated_host_bytes == 0 and store.disk is None
    else:
        del model, offloader, store
        gc.collect()  # the checkpointed layers refer to themselves (their replaced forward)
        assert alive() is None
    assert open_offload_files(tmp_path) == 0
    assert arena() is None


def test_a_store_dropped_in_a_disk_thread_is_released_from_another_thread(tmp_path):
    """The garbage collector may run the store's finalizer in one of the disk tier's own threads, which cannot wait
    for itself to finish: the release then completes in a thread of its own instead of leaking the file."""
    store = OffloadStore(CheckpointPlacement(0, 0, 1, SLOT), offload_dir=str(tmp_path))
    store.put(0, torch.randn(B, L, H)).written.result()
    disk, holder = store.disk, [store]
    del store
    disk.pool.submit(holder.clear).result()  # the last reference dies in a disk thread
    for thread in threading.enumerate():
        if thread.name == "longfit-offload-release":
            thread.join(timeout=30)
    assert open_offload_files(tmp_path) == 0


@pytest.mark.parametrize("checkpoint_dtype", [None, pytest.param("bf16", marks=pytest.mark.slow),
                                              pytest.param("fp8", marks=pytest.mark.slow)])
@pytest.mark.parametrize("autocast", REGIMES)
def test_a_closed_store_and_a_second_store_train_alike(tmp_path, autocast, checkpoint_dtype):
    """Host and disk layers, stored as is (in bf16 or in fp8 under `slow`; the staging path of every storage
    dtype is tested by the next test): a step, `close`, a step on the same store (which allocates again), a step
    of a second store on a new model: the same loss and gradients bit for bit; stored as is, those of
    checkpointing without offload."""
    placement = CheckpointPlacement(0, 2, 2, stored_input_bytes(B * L, H, 4, checkpoint_dtype))

    def new_store():
        return OffloadStore(placement, offload_dir=str(tmp_path), checkpoint_dtype=checkpoint_dtype)

    model, offloader = offloaded_model(new_store())
    first = step(model, autocast)
    offloader.store.close()
    assert_same_step(step(model, autocast), first)
    assert offloader.store.allocated_host_bytes == placement.host_bytes  # allocated again by that step
    offloader.store.close()
    model, offloader = offloaded_model(new_store())
    assert_same_step(step(model, autocast), first)
    assert offloader.store.stats.disk_read_bytes == 2 * encoded_bytes(torch.Size((B, L, H)), torch.float32,
                                                                      checkpoint_dtype)
    offloader.store.close()
    plain = step(offloaded_model(None)[0], autocast)
    if checkpoint_dtype is None:
        assert_same_step(first, plain)
    else:
        assert torch.equal(first[0], plain[0])  # the forward is untouched; the recompute starts from the stored input


# -- a disk input's copy to the device starts when its read completes -----------------------------------------


class GatedDisk(DiskFile):
    """The real disk tier, whose reads wait in their reader thread until `gate` is set."""

    def __init__(self, directory: str, nbytes: int):
        super().__init__(directory, nbytes)
        self.gate = threading.Event()

    def read(self, target, offset, after=None):
        def gated():
            assert self.gate.wait(timeout=30)
            if after is not None:
                after()

        return super().read(target, offset, gated)


@pytest.mark.parametrize("checkpoint_dtype", [None, "bf16", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_disk_input_starts_its_device_copy_when_its_read_completes(tmp_path, monkeypatch, dtype, checkpoint_dtype):
    """The reader thread starts the copy to the device as soon as its read has filled the staging slot, before
    `load` is called: the staging slots may then be overwritten and `load` still gives the stored bytes exactly."""
    shape = torch.Size((2, 300, 40))
    placement = CheckpointPlacement(0, 0, 1, stored_input_bytes(600, 40, dtype.itemsize, checkpoint_dtype))
    store = OffloadStore(placement, offload_dir=str(tmp_path), checkpoint_dtype=checkpoint_dtype, disk_file=GatedDisk)
    copy_to_device, copied_by, copied = offload._copy_to_device, [], threading.Event()

    def recorded(blob, device, stream, *streams_and_copies):
        result = copy_to_device(blob, device, stream, *streams_and_copies)
        copied_by.append(threading.current_thread().name)
        copied.set()
        return result

    monkeypatch.setattr(offload, "_copy_to_device", recorded)
    original = awkward(shape, dtype)
    stored = store.put(0, original)
    assert store.prefetch(stored) and copied_by == []  # the read waits at the gate: nothing to copy yet
    store.disk.gate.set()
    assert copied.wait(timeout=10), "the read completed and no copy to the device started"
    assert len(copied_by) == 1 and copied_by[0].startswith(DISK_THREADS)
    store.arena.buffer.fill_(0x5A)  # the staging slots: what a copy started by load would read from now
    back = store.load(stored)
    expected = decode(encode(original, checkpoint_dtype), shape, dtype, checkpoint_dtype)
    assert back.dtype == dtype and torch.equal(back.view(torch.uint8), expected.view(torch.uint8))
    assert len(copied_by) == 1
    store.close()


class RecordedStream:
    """A CUDA stream's calls, recorded in `log` (the CPU cannot run streams)."""

    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def wait_stream(self, other):
        self.log.append(("wait_stream", self.name, other.name))

    def record_event(self):
        self.log.append(("record_event", self.name))
        return f"copied on {self.name}"

    def wait_event(self, event):
        self.log.append(("wait_event", self.name, event))


def test_a_device_copy_is_allocated_on_the_compute_stream_and_ordered_after_it(monkeypatch):
    """Issue #33 item 6 (an H200 measured reserved memory 2 layer inputs above the plan in the backward): the
    prefetch's destination comes from the compute stream's pool, the side stream waits for the compute stream
    before copying into it, the copy's event is kept for the input, and an input that dies waits for it on the
    compute stream. CUDA's calls recorded on the CPU; the copy itself is real."""
    log, current = [], []
    side, compute = RecordedStream("side", log), RecordedStream("compute", log)
    current.append(compute)

    @contextlib.contextmanager
    def on_stream(stream):
        current.append(stream)
        try:
            yield
        finally:
            current.pop()

    empty = torch.empty

    def recorded_empty(*args, **kwargs):
        log.append(("allocate", current[-1].name))
        return empty(*args, **kwargs)

    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "stream", on_stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[-1])
    monkeypatch.setattr(torch, "empty", recorded_empty)
    blob, copies = torch.arange(1000, dtype=torch.int32).view(torch.uint8), []
    copied, done = offload._copy_to_device(blob, torch.device("cpu"), side, None, copies)
    monkeypatch.setattr(torch, "empty", empty)
    assert torch.equal(copied, blob) and copied.data_ptr() != blob.data_ptr()
    assert log == [("allocate", "compute"), ("wait_stream", "side", "compute"), ("record_event", "side")]
    assert done == "copied on side" and copies == [(compute, done)]
    offload._join_copies(copies)
    assert log[-1] == ("wait_event", "compute", "copied on side")
