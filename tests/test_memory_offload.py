"""The offload store: GPU-first placement, exact-size host arena, bit-exact disk tier, bf16/fp8 storage."""

from __future__ import annotations

import functools

import pytest
import torch
from memory_helpers import loss_sum, packed_batch
from memory_helpers import tiny_llama as build_tiny_llama

from longfit.memory.checkpointing import (
    ActivationOffloader,
    apply_activation_checkpointing,
)
from longfit.memory.offload import OffloadStore, decode, encode, encoded_bytes
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


def train_step(placement=None, offload_dir=None, checkpoint_dtype=None):
    model = tiny_llama()
    store = OffloadStore(placement, LAYERS, offload_dir, checkpoint_dtype)
    offloader = ActivationOffloader(min_offload_bytes=1024, store=store)
    apply_activation_checkpointing(model, 1.0, offloader=offloader)
    inputs, labels = packed_batch()
    loss = loss_sum(model, labels, None, **inputs) / (labels != -100).sum()
    loss.backward()
    store.close()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, offloader


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
