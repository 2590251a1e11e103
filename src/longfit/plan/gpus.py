"""GPU memory presets and `--gpu-mem` sizes.

Capacities are the totals `nvidia-smi` reports (what `torch.cuda.mem_get_info()[1]` sees), not the
marketing numbers: an "80GB" H100 has 81559 MiB. The CUDA context, NCCL and the caching allocator's
slack come out of that total; the planner counts them as its `reserve` term.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from longfit.config import ConfigError

MiB = 1 << 20
GiB = 1 << 30
TiB = 1 << 40

GPU_PRESETS: dict[str, tuple[int, str]] = {
    "a40-48gb": (46068 * MiB, "NVIDIA A40 48 GB (ECC on)"),
    "a100-80gb": (81920 * MiB, "NVIDIA A100 80 GB"),
    "h100-80gb": (81559 * MiB, "NVIDIA H100 80 GB HBM3"),
    "h200-141gb": (143771 * MiB, "NVIDIA H200 141 GB HBM3e"),
}

@dataclass(frozen=True)
class Node:
    """The machine a GPU preset typically sits in: what `longfit plan --gpu` plans host memory and disk with."""

    name: str
    gpus: int
    host_bytes: int
    disk_bytes: int
    source: str

    def describe(self) -> str:
        return (f"a {self.name} node: {self.host_bytes / TiB:g} TiB host memory and {self.disk_bytes / 1e12:.1f} TB "
                f"NVMe for {self.gpus} GPUs ({self.source})")


# Each figure is the vendor's datasheet: 2 TB of system memory is 32 x 64 GB DIMMs (2 TiB); the data disk is the
# internal NVMe cache, 8 x 3.84 TB U.2. The A40 is sold in many vendors' servers, none of them typical.
GPU_NODES: dict[str, Node] = {
    "a100-80gb": Node("DGX A100 640GB", 8, 2 * TiB, 8 * 3_840 * 10**9,
                      "NVIDIA DGX A100 datasheet: 2 TB system memory, 30 TB (8 x 3.84 TB) U.2 NVMe"),
    "h100-80gb": Node("DGX H100", 8, 2 * TiB, 8 * 3_840 * 10**9,
                      "NVIDIA DGX H100 datasheet: 2 TB system memory, 8 x 3.84 TB NVMe U.2 internal storage"),
    "h200-141gb": Node("DGX H200", 8, 2 * TiB, 8 * 3_840 * 10**9,
                       "NVIDIA DGX H200 datasheet: 2 TB system memory, 8 x 3.84 TB NVMe U.2 internal storage"),
}


_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 1 << 10,
    "mib": MiB,
    "gib": GiB,
    "tib": TiB,
}


def parse_size(text: str, flag: str = "--gpu-mem") -> int:
    """'80GiB', '80GB', '81559MiB', '85e9' -> bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ConfigError(f"{flag} {text!r}: write a size such as 80GiB, 48GB or 81559MiB")
    value = float(match.group(1)) * _UNITS[unit]
    if not 1 <= value < 2**63:
        raise ConfigError(f"{flag} {text!r}: write a finite size of at least one byte, such as 80GiB, 48GB or 81559MiB")
    return int(value)


def gpu_capacity(name: str | None, size: str | None) -> tuple[int, str] | None:
    """(bytes, label) from --gpu NAME or --gpu-mem SIZE (exactly one may be given); None without either."""
    if name and size:
        raise ConfigError("give either --gpu or --gpu-mem, not both")
    if size:
        capacity = parse_size(size)
        return capacity, f"{capacity / GiB:.1f} GiB GPU"
    if name:
        key = name.lower()
        if key not in GPU_PRESETS:
            raise ConfigError(f"--gpu {name!r} is not a preset ({', '.join(GPU_PRESETS)}); or give --gpu-mem 80GiB")
        capacity, label = GPU_PRESETS[key]
        return capacity, f"{label} ({capacity / GiB:.1f} GiB)"
    return None
