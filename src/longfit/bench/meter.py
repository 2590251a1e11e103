"""Peak memory of a stretch of work: CUDA allocator statistics on GPU, the process's peak RSS on CPU.

On CPU the kernel's RSS high-water mark is reset at the baseline (/proc/self/clear_refs "5") and glibc's
mmap threshold is pinned (`return_freed_memory_to_os`) so that freed tensors leave the RSS instead of
staying in a malloc arena; the peak then counts live tensors and kernel-internal buffers alike.
"""

from __future__ import annotations

import ctypes
import gc
import os

import torch

MALLOPT_MMAP_THRESHOLD = -3  # glibc's M_MMAP_THRESHOLD


def return_freed_memory_to_os() -> None:
    """Serve every allocation of 64 KiB or more with its own mmap, unmapped when freed (Linux, glibc)."""
    ctypes.CDLL("libc.so.6").mallopt(MALLOPT_MMAP_THRESHOLD, 64 * 1024)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _hwm_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no VmHWM line: CPU peak memory needs Linux")


class MemoryMeter:
    """Peak bytes above the bytes in use at `start`, per phase (see the module docstring)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.base = 0

    def start(self) -> int:
        """Take the baseline (the bytes in use now) and reset the peak; returns the baseline."""
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
            self.base_reserved = torch.cuda.memory_reserved(self.device)
        else:
            self.base = _rss_bytes()
        self.reset_peak()
        return self.base

    def reset_peak(self) -> None:
        """Restart the high-water mark from the bytes in use now (the baseline stays)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset the peak RSS (VmHWM) to the current RSS

    def peak(self) -> int:
        """Highest bytes in use since the last reset, above the baseline."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device) - self.base
        return _hwm_bytes() - self.base

    def peak_reserved(self) -> int | None:
        """CUDA: the highest bytes the caching allocator held since the last reset, above those held at `start`
        (allocated plus cached blocks: what the process takes from the GPU). None off CUDA."""
        if self.device.type != "cuda":
            return None
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_reserved(self.device) - self.base_reserved
