"""The offload store: where each checkpointed layer's input waits between forward and backward -- GPU, host or disk.

The planner decides the placement (`switches.place_checkpoints`: the last layers stay on the GPU while
its memory lasts, the first go to disk when host memory does not hold them, the rest to host) and the
size of one stored input (`switches.stored_input_bytes`); the store follows both, so what it allocates
is what `longfit plan` reports.

Micro-batches in flight (`placement.in_flight`): a pipeline stage runs several forwards before their backwards
(parallel/pipeline.py), so each layer has a slot per micro-batch in flight, on every tier. A slot is taken from its
tier's free list when a layer input is stored, the stored input (`Stored`, which autograd's saved handle holds)
remembers it, and it goes back when that input dies after its backward: a backward reads its own micro-batch's
input whatever order the schedule runs the backwards in, and an input beyond the planned slots goes to a plain host
tensor (`StoreStats.unplanned_bytes`), never over another.

Host: ONE arena of exactly `placement.host_bytes` -- `in_flight` slots per host layer, plus the disk tier's
staging slots -- allocated at the first use and reused every step. It is an ordinary CPU
allocation registered with CUDA (cudaHostRegister, as torch's own checkpoint stager pins exact sizes),
not torch's pinned allocator: that one rounds every block up to a power of two (a 2.9 GiB layer input
takes 4 GiB) and keeps it cached for the life of the process. Each slot is a whole number of pages
(STORE_ALIGN), so every slot starts at the same alignment as the arena. The arena and the disk file are
given back by `close` (the trainer calls `memory.apply.release_offload_stores` when its steps end, also
on an error) or when the store is garbage collected; the next offloaded input allocates them again.

Disk (`memory.offload_dir`): one preallocated file, unlinked once open (it vanishes with the process),
`in_flight` regions per disk layer. Forward: the layer input is copied into a free staging slot (on CUDA on the
side stream; the writer waits for that copy's event) and a writer thread `pwrite`s it, in large
sequential writes, then drops it from the page cache (the point of the disk tier is host memory). The
copy into the slot is the only thing on the critical path. Backward: when the offloader reaches a layer
it prefetches the previous one. A host layer's bytes are copied to the device then (on CUDA
asynchronously; elsewhere at once, so that a CPU run, and the planner's trace of a GPU run, hold what
the GPU holds); a disk layer's are `preadv`d by a reader thread into a staging slot, and the same thread
starts their copy to the device as soon as the read completes (on CUDA on the side stream, recording an
event), so `load` only makes the compute stream wait for that event. The staging slot goes back to the
free list with that event: the next copy into it runs on the same side stream, after it, and the next
read waits for the event in its reader thread, so no CPU thread of the step blocks on a copy. Both
threads release the GIL in the system calls. Round trips are bit-exact (raw bytes).

Compression (`memory.checkpoint_dtype`, off by default): bf16 stores fp32 inputs in bf16; fp8 stores
e4m3 values with one fp32 scale per token (its absolute maximum / 448, the largest e4m3 value), both
encoded on the device before the copy out and decoded after the copy back, in chunks of tokens so
the fp32 temporaries stay small. The recompute then starts from the decoded input, so gradients are
those of a slightly perturbed layer input: the loss of the step is unchanged, later steps drift
(benchmarks/results/checkpoint_dtype.md measures how much).
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
import queue
import tempfile
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from longfit.memory.switches import DISK_STAGING_SLOTS, CheckpointPlacement, round_up

FP8_MAX = 448.0  # the largest finite float8_e4m3fn value
CODEC_CHUNK_ELEMENTS = 1 << 24  # tokens encoded / decoded at a time: fp32 temporaries of at most 64 MiB


# -- compression ------------------------------------------------------------------------------------------


def encoded_bytes(shape: torch.Size, dtype: torch.dtype, checkpoint_dtype: str | None) -> int:
    """Bytes of one tensor as stored (before rounding to a slot): see `switches.stored_input_bytes`."""
    numel, tokens = shape.numel(), shape.numel() // shape[-1]
    if checkpoint_dtype == "fp8":
        return numel + 4 * tokens
    if checkpoint_dtype == "bf16" and dtype.itemsize > 2:
        return 2 * numel
    return numel * dtype.itemsize


def encode(tensor: torch.Tensor, checkpoint_dtype: str | None) -> torch.Tensor:
    """The stored bytes of `tensor` (uint8, on its device): as is, bf16, or fp8 values then fp32 per-token scales."""
    if checkpoint_dtype is None or (checkpoint_dtype == "bf16" and tensor.element_size() <= 2):
        return tensor.detach().reshape(-1).view(torch.uint8)
    if checkpoint_dtype == "bf16":
        return tensor.detach().to(torch.bfloat16).reshape(-1).view(torch.uint8)
    rows = tensor.detach().reshape(-1, tensor.shape[-1])  # (tokens, H)
    tokens, width = rows.shape
    blob = torch.empty(tokens * width + 4 * tokens, dtype=torch.uint8, device=tensor.device)
    values = blob[: tokens * width].view(torch.float8_e4m3fn).view(tokens, width)
    scales = blob[tokens * width :].view(torch.float32)
    step = max(1, CODEC_CHUNK_ELEMENTS // width)
    for first in range(0, tokens, step):
        chunk = rows[first : first + step].float()
        scale = chunk.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / FP8_MAX
        values[first : first + step] = (chunk / scale[:, None]).to(torch.float8_e4m3fn)
        scales[first : first + step] = scale
    return blob


def decode(blob: torch.Tensor, shape: torch.Size, dtype: torch.dtype, checkpoint_dtype: str | None) -> torch.Tensor:
    """Inverse of `encode` (exact without compression)."""
    if checkpoint_dtype is None or (checkpoint_dtype == "bf16" and dtype.itemsize <= 2):
        return blob.view(dtype).view(shape)
    if checkpoint_dtype == "bf16":
        return blob.view(torch.bfloat16).view(shape).to(dtype)
    width = shape[-1]
    tokens = shape.numel() // width
    values = blob[: tokens * width].view(torch.float8_e4m3fn).view(tokens, width)
    scales = blob[tokens * width :].view(torch.float32)
    out = torch.empty((tokens, width), dtype=dtype, device=blob.device)
    step = max(1, CODEC_CHUNK_ELEMENTS // width)
    for first in range(0, tokens, step):
        out[first : first + step] = values[first : first + step].float() * scales[first : first + step, None]
    return out.view(shape)


# -- host memory ------------------------------------------------------------------------------------------


class HostArena:
    """Exactly `nbytes` of host memory, registered with CUDA on `cuda_device` if given (page-locked: async copies).

    cudaHostRegister pins the pages the range touches and pwrite takes any address, so the CPU
    allocator's alignment suffices and nothing is allocated beyond the planned bytes.
    """

    def __init__(self, nbytes: int, cuda_device: torch.device | None = None):
        self.buffer = torch.empty(nbytes, dtype=torch.uint8)
        self.nbytes = nbytes
        self.cuda_device = cuda_device
        if self.cuda_device is not None:
            with torch.cuda.device(self.cuda_device):
                status = torch.cuda.cudart().cudaHostRegister(self.buffer.data_ptr(), nbytes, 0)
            if int(status) != 0:
                raise RuntimeError(f"cudaHostRegister of {nbytes} bytes of host memory failed with CUDA error {int(status)}")

    def slot(self, offset: int, nbytes: int) -> torch.Tensor:
        assert offset + nbytes <= self.nbytes, (offset, nbytes, self.nbytes)
        return self.buffer[offset : offset + nbytes]

    def close(self) -> None:
        """Unregister, once every copy touching the arena has finished (the copies run on streams of its device,
        so a synchronize of that device waits for all of them), and drop the memory."""
        if self.cuda_device is not None:
            with torch.cuda.device(self.cuda_device):
                torch.cuda.synchronize(self.cuda_device)
                torch.cuda.cudart().cudaHostUnregister(self.buffer.data_ptr())
            self.cuda_device = None
        self.buffer = None


# -- disk -------------------------------------------------------------------------------------------------

DISK_THREADS = "longfit-offload-io"  # the prefix of the disk tier's thread names


def _write_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        written = os.pwrite(fd, data, offset)
        data, offset = data[written:], offset + written


def _read_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        read = os.preadv(fd, [data], offset)
        if read == 0:
            raise OSError(f"offload file ended at byte {offset}")
        data, offset = data[read:], offset + read


class DiskFile:
    """A preallocated, already unlinked file in `directory`, written and read by a small thread pool."""

    def __init__(self, directory: str, nbytes: int):
        os.makedirs(directory, exist_ok=True)
        handle, path = tempfile.mkstemp(prefix="longfit-offload-", suffix=".bin", dir=directory)
        os.unlink(path)  # the space is freed when the process closes the file, however it ends
        self.fd = handle
        try:
            os.posix_fallocate(self.fd, 0, nbytes)
        except OSError as e:
            os.close(self.fd)
            raise RuntimeError(
                f"memory.offload_dir={directory}: could not reserve {nbytes / 2**30:.1f} GiB ({e.strerror}); "
                "free space there or point memory.offload_dir at a larger disk"
            ) from e
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix=DISK_THREADS)

    def write(self, source: torch.Tensor, offset: int, ready=None) -> concurrent.futures.Future:
        """pwrite the uint8 CPU tensor `source` at `offset` once `ready` (a CUDA event) has completed."""

        def job():
            if ready is not None:
                ready.synchronize()
            data = memoryview(source.numpy()).cast("B")
            _write_all(self.fd, data, offset)
            os.fdatasync(self.fd)
            os.posix_fadvise(self.fd, offset, len(data), os.POSIX_FADV_DONTNEED)

        return self.pool.submit(job)

    def read(
        self, target: torch.Tensor, offset: int, after: Callable[[], object] | None = None
    ) -> concurrent.futures.Future:
        """preadv into the uint8 CPU tensor `target` from `offset`, once `after()` has returned in the reader thread
        (it waits for what must come first: the region's write, the last device copy out of `target`)."""

        def job():
            if after is not None:
                after()
            _read_all(self.fd, memoryview(target.numpy()).cast("B"), offset)

        return self.pool.submit(job)

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        os.close(self.fd)


# -- the store --------------------------------------------------------------------------------------------


@dataclass
class StoreStats:
    """Stored bytes per tier since the store's creation."""

    device_bytes: int = 0
    """Inputs the GPU-first policy kept on the device (their encoded size)."""
    host_bytes: int = 0
    """Inputs copied into arena slots."""
    disk_written_bytes: int = 0
    disk_read_bytes: int = 0
    unplanned_bytes: int = 0
    """Inputs beyond the plan (two forwards before one backward, several large inputs per layer): plain host tensors."""


@dataclass(eq=False)
class Stored:
    """One stored layer input; `OffloadStore.load` turns it back into a device tensor of `shape` and `dtype`."""

    tier: str  # "device" | "host" | "disk"
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    nbytes: int  # encoded
    codec: str | None = None  # its checkpoint_dtype: the store's for a layer input, None for kept attention
    blob: torch.Tensor | None = None  # the encoded bytes, on the device or in a host slot (disk: in the file)
    region: int | None = None  # disk tier: the file region
    written: concurrent.futures.Future | None = None
    landing: concurrent.futures.Future | None = None
    """From prefetch to load: the device copy under way, (tensor, its CUDA event or None off CUDA: done)."""
    copies: list | None = None
    """CUDA: (compute stream, copy event) of each device copy made for this input, joined when it dies."""


def _copy_to_device(
    blob: torch.Tensor, device: torch.device, stream, compute=None, copies: list | None = None
) -> tuple[torch.Tensor, object | None]:
    """Start copying the host bytes `blob` to `device`: on CUDA on the side `stream` (with the event that marks its
    end), elsewhere at once. Issued from whichever thread calls it, hence the explicit device: a reader thread's
    current device is the first GPU.

    The destination is allocated on the `compute` stream (the stream that reads it; the current one if None), so
    it comes from, and goes back to, the compute stream's pool: allocated on the side stream it would sit in that
    stream's own pool, which the compute stream's allocations never reuse (issue #33 item 6: reserved memory two
    layer inputs above the plan). The side stream first waits for the compute stream's work so far, which
    includes every earlier user of the block; `load` makes the compute stream wait for the copy's event before
    reading it, so the compute stream frees it only after the copy. The event is appended to `copies` (the
    stored input's list), for an input prefetched but never loaded (`_join_copies`)."""
    if stream is None:
        return blob.clone(), None
    with torch.cuda.device(device):
        compute = compute if compute is not None else torch.cuda.current_stream(device)
        with torch.cuda.stream(compute):
            copied = torch.empty(blob.shape, dtype=blob.dtype, device=device)
        stream.wait_stream(compute)
        with torch.cuda.stream(stream):
            copied.copy_(blob, non_blocking=True)
            done = stream.record_event()
    if copies is not None:
        copies.append((compute, done))
    return copied, done


def _join_copies(copies: list) -> None:
    """A stored input dies: each compute stream waits for the copies made for it, so that a destination prefetched
    but never loaded (an exception in backward), freed into the compute stream's pool, is reused by that stream
    only after its copy has written it (a no-op wait for loaded ones, whose stream already waited)."""
    for compute, done in copies:
        compute.wait_event(done)


def _wait_before_read(written: concurrent.futures.Future, copied_out) -> None:
    written.result()
    if copied_out is not None:
        copied_out.synchronize()  # the staging slot's last device copy has read it


def _land(slot: torch.Tensor, device, stream, compute, copies, staging: int, space: _Space, landing, read) -> None:
    """A prefetch's read into the staging slot `slot` has completed (called in the reader thread, or at once by the
    prefetching thread when the read was already done): start the device copy, hand it to `load` through
    `landing`, and put the slot back with the copy's event, which its next user waits for."""
    try:
        read.result()
        copied, copy_done = _copy_to_device(slot, device, stream, compute, copies)
    except BaseException as error:  # the read's or the copy's: `load` raises it
        space.free_staging.put((staging, None))
        landing.set_exception(error)
        return
    space.free_staging.put((staging, copy_done))
    landing.set_result((copied, copy_done))


def _release_region(free_regions: list[int], region: int, written: concurrent.futures.Future) -> None:
    written.add_done_callback(lambda _done: free_regions.append(region))


class _Space:
    """What a store allocates at its first offloaded input and gives back: the host arena, the disk file, and the
    free lists of their slots and regions (staging slots with the event of their last device copy, or None).

    It refers to no store, so the store's finalizer (`weakref.finalize(store, space.release)`) does not keep
    the store alive; stored inputs give their slots back to these lists, which outlive a closed store.
    """

    def __init__(self, placement: CheckpointPlacement, device: torch.device, offload_dir: str | None, disk_file):
        self.arena: HostArena | None = None
        self.disk = None
        try:
            if placement.host_bytes:
                self.arena = HostArena(placement.host_bytes, device if device.type == "cuda" else None)
            if placement.disk:
                self.disk = disk_file(offload_dir, placement.disk_bytes)
        except BaseException:
            self.release()
            raise
        self.free_slots = list(reversed(range(placement.host_slots)))
        self.free_regions = list(reversed(range(placement.disk_regions)))
        self.free_staging: queue.Queue[tuple[int, object | None]] = queue.Queue()
        for slot in range(DISK_STAGING_SLOTS if placement.disk else 0):
            self.free_staging.put((placement.host_slots + slot, None))

    def release(self) -> None:
        """Close the disk file once its threads have finished their jobs (and so issued their device copies), then
        the arena (unregistered after every copy touching it). The garbage collector may run this finalizer in a
        disk thread, which cannot wait for itself: the release then runs in a thread of its own."""
        if threading.current_thread().name.startswith(DISK_THREADS):
            threading.Thread(target=self.release, name="longfit-offload-release").start()
            return
        if self.disk is not None:
            self.disk.close()
            self.disk = None
        if self.arena is not None:
            self.arena.close()
            self.arena = None


class OffloadStore:
    """Puts layer inputs where `placement` says and gives them back (module docstring).

    Slots and disk regions are taken from free lists and returned when autograd drops the saved input
    (its `Stored` dies), so retained graphs and several forwards before their backwards stay correct; inputs
    beyond the plan go to plain host tensors (`stats.unplanned_bytes`). `placement` None: every layer
    on the host (or with `offload_dir` on disk), the slot size taken from the first input; `layers` is
    then the number of stored inputs (`switches.stored_input_count`: the checkpointed layers, one fewer
    under tiled layers) and `in_flight` the micro-batches stored at once.
    """

    def __init__(
        self,
        placement: CheckpointPlacement | None = None,
        layers: int = 0,
        offload_dir: str | None = None,
        checkpoint_dtype: str | None = None,
        disk_file=DiskFile,
        in_flight: int = 1,
        slot_bytes: int = 0,
    ):
        """`disk_file(directory, nbytes)` opens the disk tier (the planner's trace gives one that counts bytes);
        `slot_bytes`, without a placement, the least slot size (items larger than the first input: kept attention)."""
        if placement is not None and placement.disk and offload_dir is None:
            raise ValueError(f"{placement}: disk layers need an offload_dir")
        self.placement = placement
        self.layers = layers if placement is None else placement.layers
        self.in_flight = in_flight if placement is None else placement.in_flight
        self.offload_dir = offload_dir
        self.checkpoint_dtype = checkpoint_dtype
        self.disk_file = disk_file
        self.min_slot_bytes = slot_bytes
        self.stats = StoreStats()
        self._space: _Space | None = None
        self._release: weakref.finalize | None = None
        self._stream = None

    @property
    def arena(self) -> HostArena | None:
        return self._space.arena if self._space is not None else None

    @property
    def disk(self):
        return self._space.disk if self._space is not None else None

    @property
    def allocated_host_bytes(self) -> int:
        """Host memory the store holds in its arena (0 before the first offloaded input and after `close`)."""
        return self.arena.nbytes if self.arena is not None else 0

    def _plan(self, tensor: torch.Tensor) -> CheckpointPlacement:
        if self.placement is None:
            slot = max(round_up(encoded_bytes(tensor.shape, tensor.dtype, self.checkpoint_dtype)), self.min_slot_bytes)
            disk = self.layers if self.offload_dir else 0
            self.placement = CheckpointPlacement(0, self.layers - disk, disk, slot, self.in_flight)
        if self._space is None:
            self._space = _Space(self.placement, tensor.device, self.offload_dir, self.disk_file)
            self._release = weakref.finalize(self, self._space.release)
            self._release.atexit = False  # the process's end frees both; no CUDA calls while the interpreter exits
        return self.placement

    def _slot(self, index: int, nbytes: int) -> torch.Tensor:
        return self.arena.slot(index * self.placement.slot_bytes, nbytes)

    def _side_stream(self, device: torch.device):
        """The stream of every copy between the device and the host slots (None off CUDA: copies are immediate)."""
        if device.type != "cuda":
            return None
        if self._stream is None or self._stream.device != device:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    # -- forward --------------------------------------------------------------------------------------------
    def put(self, layer: int, tensor: torch.Tensor, exact: bool = False) -> Stored:
        """Store item `layer` (0-based, forward order: a checkpointed layer's input, or its kept attention,
        `switches.stored_items_per_layer`) where the placement says, in a slot of its tier's that no item still stored
        holds. `exact`: never compressed (memory.checkpoint_dtype applies to layer inputs)."""
        placement = self._plan(tensor)
        space = self._space
        codec = None if exact else self.checkpoint_dtype
        nbytes = encoded_bytes(tensor.shape, tensor.dtype, codec)
        tier = placement.tier(layer)
        stored = Stored(tier, tensor.shape, tensor.dtype, tensor.device, nbytes, codec)
        fits = round_up(nbytes) <= placement.slot_bytes
        if tier == "device":
            stored.blob = tensor if codec is None else encode(tensor, codec)
            self.stats.device_bytes += nbytes
        elif tier == "host" and fits and space.free_slots:
            slot = space.free_slots.pop()
            stored.blob = self._slot(slot, nbytes)
            self._copy_out(tensor, stored.blob, codec)
            weakref.finalize(stored, space.free_slots.append, slot)
            self.stats.host_bytes += nbytes
        elif tier == "disk" and fits and space.free_regions:
            # Waits while both staging slots are being written. A device copy out of the slot may still be queued:
            # on the side stream, ahead of the copy into it.
            region, (staging, _copied_out) = space.free_regions.pop(), space.free_staging.get()
            ready = self._copy_out(tensor, self._slot(staging, nbytes), codec)
            stored.region = region
            stored.written = space.disk.write(self._slot(staging, nbytes), region * placement.slot_bytes, ready)
            stored.written.add_done_callback(lambda _done: space.free_staging.put((staging, None)))
            weakref.finalize(stored, _release_region, space.free_regions, region, stored.written)
            self.stats.disk_written_bytes += nbytes
        else:
            stored.tier = "host"
            stored.blob = self._unplanned_buffer(nbytes, pinned=tensor.device.type == "cuda")
            self._copy_out(tensor, stored.blob, codec)
            self.stats.unplanned_bytes += nbytes
        return stored

    def _unplanned_buffer(self, nbytes: int, pinned: bool) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)

    def _copy_out(self, tensor: torch.Tensor, slot: torch.Tensor, codec: str | None):
        """Encode `tensor` into the host `slot`; on CUDA asynchronously on the side stream (returns its event)."""
        stream = self._side_stream(tensor.device)
        if stream is None:
            slot.copy_(encode(tensor, codec))
            return None
        stream.wait_stream(torch.cuda.current_stream(tensor.device))  # the tensor has been produced
        with torch.cuda.stream(stream):
            blob = encode(tensor, codec)
            slot.copy_(blob, non_blocking=True)
            blob.record_stream(stream)
        tensor.record_stream(stream)  # its block is not reused before the copy has run
        return stream.record_event()

    # -- backward -------------------------------------------------------------------------------------------
    def prefetch(self, stored: Stored) -> bool:
        """Start bringing `stored` back: a host input's copy to the device; a disk input's read into a staging slot,
        whose completion starts the copy to the device (`_land`). `load` finishes it. True the first time for
        each load of `stored`.
        """
        if stored.landing is not None or stored.tier == "device":
            return False
        stream = self._side_stream(stored.device)
        compute = None
        if stream is not None:
            compute = torch.cuda.current_stream(stored.device)
            if stored.copies is None:
                stored.copies = []
                weakref.finalize(stored, _join_copies, stored.copies)
        if stored.tier == "host":
            # The side stream also ran the copy into the slot, so this copy reads a finished slot.
            stored.landing = concurrent.futures.Future()
            stored.landing.set_result(_copy_to_device(stored.blob, stored.device, stream, compute, stored.copies))
            return True
        space = self._space
        staging, copied_out = space.free_staging.get()
        slot = self._slot(staging, stored.nbytes)
        before = functools.partial(_wait_before_read, stored.written, copied_out)
        read = space.disk.read(slot, stored.region * self.placement.slot_bytes, before)
        # Neither callback nor read refers to `stored`: a prefetched input that is never loaded (an exception in
        # backward) still dies with autograd's reference, and its staging slot comes back once the copy is issued.
        stored.landing = concurrent.futures.Future()
        read.add_done_callback(
            functools.partial(_land, slot, stored.device, stream, compute, stored.copies, staging, space, stored.landing)
        )
        self.stats.disk_read_bytes += stored.nbytes
        return True

    def load(self, stored: Stored) -> torch.Tensor:
        """The stored input as a device tensor, decoded. A retained graph may load it again.

        Blocks the CPU only while a disk read has not completed; the compute stream waits for the copy's event."""
        if stored.tier == "device":
            if stored.codec is None:
                return stored.blob
            return decode(stored.blob, stored.shape, stored.dtype, stored.codec)
        self.prefetch(stored)
        landing, stored.landing = stored.landing, None
        copied, copy_done = landing.result()
        if copy_done is not None:
            compute = torch.cuda.current_stream(stored.device)
            compute.wait_event(copy_done)
            copied.record_stream(compute)  # a no-op on the stream it was allocated on; another stream: freed after its use
        return decode(copied, stored.shape, stored.dtype, stored.codec)

    def close(self) -> None:
        """Give the arena and the disk file back now (`_Space.release`); garbage collecting the store does the same.
        Call it after the last backward: an input stored before cannot be loaded from the disk after it. The next
        offloaded input allocates a new arena and file."""
        if self._release is not None:
            self._release()
        self._space = self._release = None
