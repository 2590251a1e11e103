"""The offload store: where each checkpointed layer's input waits between forward and backward -- GPU, host or disk.

The planner decides the placement (`switches.place_checkpoints`: the last layers stay on the GPU while
its memory lasts, the first go to disk when host memory does not hold them, the rest to host) and the
size of one stored input (`switches.stored_input_bytes`); the store follows both, so what it allocates
is what `longfit plan` reports.

Host: ONE arena of exactly `placement.host_bytes` -- a slot per host layer at a fixed offset, plus the
disk tier's staging slots -- allocated at the first use and reused every step. It is an ordinary CPU
allocation registered with CUDA (cudaHostRegister, as torch's own checkpoint stager pins exact sizes),
not torch's pinned allocator: that one rounds every block up to a power of two (a 2.9 GiB layer input
takes 4 GiB) and keeps it cached for the life of the process. Each slot is a whole number of pages
(STORE_ALIGN), so every slot starts at the same alignment as the arena.

Disk (`memory.offload_dir`): one preallocated file, unlinked once open (it vanishes with the process),
a region per disk layer. Forward: the layer input is copied into a free staging slot (on CUDA on the
side stream; the writer waits for that copy's event) and a writer thread `pwrite`s it, in large
sequential writes, then drops it from the page cache (the point of the disk tier is host memory). The
copy into the slot is the only thing on the critical path. Backward: when the offloader reaches a layer
it prefetches the previous one. A host layer's bytes are copied to the device then (on CUDA
asynchronously; elsewhere at once, so that a CPU run, and the planner's trace of a GPU run, hold what
the GPU holds); a disk layer's are `preadv`d by a reader thread into a staging slot and copied to the
device when the layer is needed, after the read. Both threads release the GIL in the system calls.
Round trips are bit-exact (raw bytes).

Compression (`memory.checkpoint_dtype`, off by default): bf16 stores fp32 inputs in bf16; fp8 stores
e4m3 values with one fp32 scale per token (its absolute maximum / 448, the largest e4m3 value), both
encoded on the device before the copy out and decoded after the copy back, in chunks of tokens so
the fp32 temporaries stay small. The recompute then starts from the decoded input, so gradients are
those of a slightly perturbed layer input: the loss of the step is unchanged, later steps drift
(benchmarks/results/checkpoint_dtype.md measures how much).
"""

from __future__ import annotations

import concurrent.futures
import os
import queue
import tempfile
import weakref
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
    """Exactly `nbytes` of host memory, registered with CUDA when `pin` (page-locked: real async copies).

    cudaHostRegister pins the pages the range touches and pwrite takes any address, so the CPU
    allocator's alignment suffices and nothing is allocated beyond the planned bytes.
    """

    def __init__(self, nbytes: int, pin: bool):
        self.buffer = torch.empty(nbytes, dtype=torch.uint8)
        self.nbytes = nbytes
        self._registered = False
        if pin and nbytes:
            status = torch.cuda.cudart().cudaHostRegister(self.buffer.data_ptr(), nbytes, 0)
            if int(status) != 0:
                raise RuntimeError(f"cudaHostRegister of {nbytes} bytes of host memory failed with CUDA error {int(status)}")
            self._registered = True

    def slot(self, offset: int, nbytes: int) -> torch.Tensor:
        assert offset + nbytes <= self.nbytes, (offset, nbytes, self.nbytes)
        return self.buffer[offset : offset + nbytes]

    def close(self) -> None:
        """Unregister (after every copy touching the arena has finished) and drop the memory."""
        if self._registered:
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaHostUnregister(self.buffer.data_ptr())
            self._registered = False
        self.buffer = None


# -- disk -------------------------------------------------------------------------------------------------


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
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="longfit-offload")

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

    def read(self, target: torch.Tensor, offset: int, after: concurrent.futures.Future | None) -> concurrent.futures.Future:
        """preadv into the uint8 CPU tensor `target` from `offset`, after the write `after` has finished."""

        def job():
            if after is not None:
                after.result()
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
    blob: torch.Tensor | None = None  # the encoded bytes: on the device, in a host slot, or in a staging slot
    region: int | None = None  # disk tier: the file region
    written: concurrent.futures.Future | None = None
    staging: int | None = None  # disk tier: the staging slot a read went to
    read: concurrent.futures.Future | None = None
    copied: torch.Tensor | None = None  # device copy, started by prefetch (host) or load (disk)
    copy_done: object | None = None  # its CUDA event (None off CUDA: the copy is done)
    prefetched: bool = False
    release_staging: weakref.finalize | None = None  # disk tier: returns the staging slot of a prefetch


class OffloadStore:
    """Puts layer inputs where `placement` says and gives them back (module docstring).

    Slots and disk regions are taken from free lists and returned when autograd drops the saved input
    (its `Stored` dies), so retained graphs and a second forward before a backward stay correct; inputs
    beyond the plan go to plain host tensors (`stats.unplanned_bytes`). `placement` None: every layer
    on the host (or with `offload_dir` on disk), the slot size taken from the first input; `layers` is
    then the number of stored inputs (`switches.stored_input_count`: the checkpointed layers, one fewer
    under tiled layers).
    """

    def __init__(
        self,
        placement: CheckpointPlacement | None = None,
        layers: int = 0,
        offload_dir: str | None = None,
        checkpoint_dtype: str | None = None,
        disk_file=DiskFile,
    ):
        """`disk_file(directory, nbytes)` opens the disk tier (the planner's trace gives one that counts bytes)."""
        if placement is not None and placement.disk and offload_dir is None:
            raise ValueError(f"{placement}: disk layers need an offload_dir")
        self.placement = placement
        self.layers = layers if placement is None else placement.layers
        self.offload_dir = offload_dir
        self.checkpoint_dtype = checkpoint_dtype
        self.disk_file = disk_file
        self.stats = StoreStats()
        self.arena: HostArena | None = None
        self.disk: DiskFile | None = None
        self._stream = None
        self._free_slots: list[int] = []
        self._free_regions: list[int] = []
        self._free_staging: queue.Queue[int] = queue.Queue()

    @property
    def allocated_host_bytes(self) -> int:
        """Host memory the store holds in its arena (0 before the first offloaded input)."""
        return self.arena.nbytes if self.arena is not None else 0

    def _plan(self, tensor: torch.Tensor) -> CheckpointPlacement:
        if self.placement is None:
            slot = round_up(encoded_bytes(tensor.shape, tensor.dtype, self.checkpoint_dtype))
            disk = self.layers if self.offload_dir else 0
            self.placement = CheckpointPlacement(0, self.layers - disk, disk, slot)
        placement = self.placement
        if self.arena is None and placement.host_bytes:
            self.arena = HostArena(placement.host_bytes, pin=tensor.device.type == "cuda")
            self._free_slots = list(reversed(range(placement.host)))
            for slot in range(DISK_STAGING_SLOTS if placement.disk else 0):
                self._free_staging.put(placement.host + slot)
        if self.disk is None and placement.disk:
            self.disk = self.disk_file(self.offload_dir, placement.disk_bytes)
            self._free_regions = list(reversed(range(placement.disk)))
        return placement

    def _slot(self, index: int, nbytes: int) -> torch.Tensor:
        return self.arena.slot(index * self.placement.slot_bytes, nbytes)

    def _side_stream(self, device: torch.device):
        if self._stream is None or self._stream.device != device:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    # -- forward --------------------------------------------------------------------------------------------
    def put(self, layer: int, tensor: torch.Tensor) -> Stored:
        """Store an input of checkpointed layer `layer` (0-based, forward order) where the placement says."""
        placement = self._plan(tensor)
        nbytes = encoded_bytes(tensor.shape, tensor.dtype, self.checkpoint_dtype)
        tier = placement.tier(layer)
        stored = Stored(tier, tensor.shape, tensor.dtype, tensor.device, nbytes)
        fits = round_up(nbytes) <= placement.slot_bytes
        if tier == "device":
            stored.blob = tensor if self.checkpoint_dtype is None else encode(tensor, self.checkpoint_dtype)
            self.stats.device_bytes += nbytes
        elif tier == "host" and fits and self._free_slots:
            slot = self._free_slots.pop()
            stored.blob = self._slot(slot, nbytes)
            self._copy_out(tensor, stored.blob)
            weakref.finalize(stored, self._free_slots.append, slot)
            self.stats.host_bytes += nbytes
        elif tier == "disk" and fits and self._free_regions:
            region, staging = self._free_regions.pop(), self._free_staging.get()  # waits while both are written
            ready = self._copy_out(tensor, self._slot(staging, nbytes))
            stored.region = region
            stored.written = self.disk.write(self._slot(staging, nbytes), region * placement.slot_bytes, ready)
            stored.written.add_done_callback(lambda _done: self._free_staging.put(staging))
            weakref.finalize(stored, self._release_region, region, stored.written)
            self.stats.disk_written_bytes += nbytes
        else:
            stored.tier = "host"
            stored.blob = self._unplanned_buffer(nbytes, pinned=tensor.device.type == "cuda")
            self._copy_out(tensor, stored.blob)
            self.stats.unplanned_bytes += nbytes
        return stored

    def _unplanned_buffer(self, nbytes: int, pinned: bool) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)

    def _release_region(self, region: int, written: concurrent.futures.Future) -> None:
        written.add_done_callback(lambda _done: self._free_regions.append(region))

    def _release_staging(self, staging: int, read: concurrent.futures.Future) -> None:
        read.add_done_callback(lambda _done: self._free_staging.put(staging))

    def _copy_out(self, tensor: torch.Tensor, slot: torch.Tensor):
        """Encode `tensor` into the host `slot`; on CUDA asynchronously on the side stream (returns its event)."""
        if tensor.device.type != "cuda":
            slot.copy_(encode(tensor, self.checkpoint_dtype))
            return None
        stream = self._side_stream(tensor.device)
        stream.wait_stream(torch.cuda.current_stream(tensor.device))  # the tensor has been produced
        with torch.cuda.stream(stream):
            blob = encode(tensor, self.checkpoint_dtype)
            slot.copy_(blob, non_blocking=True)
            blob.record_stream(stream)
        tensor.record_stream(stream)  # its block is not reused before the copy has run
        return stream.record_event()

    # -- backward -------------------------------------------------------------------------------------------
    def prefetch(self, stored: Stored) -> bool:
        """Start bringing `stored` back (disk: the read into a staging slot; host: the copy to the device);
        `load` finishes it. True the first time for each load of `stored`.
        """
        if stored.prefetched or stored.tier == "device":
            return False
        stored.prefetched = True
        if stored.tier == "disk":
            stored.staging = self._free_staging.get()
            stored.blob = self._slot(stored.staging, stored.nbytes)
            stored.read = self.disk.read(stored.blob, stored.region * self.placement.slot_bytes, stored.written)
            # A prefetched input that is never loaded (an exception in backward) returns its slot when it dies.
            stored.release_staging = weakref.finalize(stored, self._release_staging, stored.staging, stored.read)
            self.stats.disk_read_bytes += stored.nbytes
        else:
            self._copy_in(stored)
        return True

    def _copy_in(self, stored: Stored) -> None:
        """Start the copy of the stored bytes to the device: on CUDA asynchronously on the side stream (a host
        slot: the same stream as its copy out, so it reads a finished slot; a staging slot: the caller has waited
        for the read; allocated there, so no compute-stream work can still be using the block); elsewhere at once."""
        if stored.device.type != "cuda":
            stored.copied = stored.blob.clone()
            return
        stream = self._side_stream(stored.device)
        with torch.cuda.stream(stream):
            stored.copied = stored.blob.to(stored.device, non_blocking=True)
            stored.copy_done = stream.record_event()

    def load(self, stored: Stored) -> torch.Tensor:
        """The stored input as a device tensor, decoded. A retained graph may load it again."""
        if stored.tier == "device":
            if self.checkpoint_dtype is None:
                return stored.blob
            return decode(stored.blob, stored.shape, stored.dtype, self.checkpoint_dtype)
        self.prefetch(stored)
        if stored.tier == "disk":
            stored.read.result()
            self._copy_in(stored)  # from the staging slot, now that the read has filled it
        stored.prefetched = False
        blob, stored.copied = stored.copied, None
        if stored.copy_done is not None:
            compute = torch.cuda.current_stream(stored.device)
            compute.wait_event(stored.copy_done)
            blob.record_stream(compute)  # freed by the compute stream once the recompute is done with it
            if stored.tier == "disk":
                stored.copy_done.synchronize()  # the staging slot is free once its copy has run
            stored.copy_done = None
        if stored.tier == "disk":
            stored.release_staging()
            stored.blob = stored.read = stored.staging = stored.release_staging = None
        return decode(blob, stored.shape, stored.dtype, self.checkpoint_dtype)

    def close(self) -> None:
        """Wait for the disk threads, close the file and unregister the arena."""
        if self.disk is not None:
            self.disk.close()
            self.disk = None
        if self.arena is not None:
            self.arena.close()
            self.arena = None
