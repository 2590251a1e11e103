"""What the trainer asks before it builds anything: is this configuration valid here, and does it fit?"""

from __future__ import annotations

import os
import shutil

from longfit.config import Config, ConfigError
from longfit.launch import ranks_on_this_node
from longfit.plan.analytic import plan_run, stage_cut
from longfit.plan.result import GiB, PlanResult
from longfit.plan.search import suggest_fix
from longfit.plan.setup import resolve


def device_memory_bytes(device) -> int | None:
    """Total memory of a CUDA device (what `--gpu` presets describe); None on CPU: nothing to check."""
    if getattr(device, "type", str(device)) != "cuda":
        return None
    import torch

    return torch.cuda.mem_get_info(device)[1]


def host_memory_bytes() -> int:
    """Host memory available on this machine now (what `longfit plan --host-mem` defaults to)."""
    import psutil

    return psutil.virtual_memory().available


def disk_free_bytes(path: str) -> int:
    """Free space of the file system `path` is (or would be created) on."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return shutil.disk_usage(path).free


def tightest_machine(host: int, disk: int | None, ranks_here: int) -> tuple[int, int | None, int]:
    """(host memory, disk, ranks) of the machine whose ranks get the least host memory each; the same on every rank.

    Each rank measures its own node, whose memory and offload disk its node's ranks share (LOCAL_WORLD_SIZE:
    torchrun's --nproc-per-node, which may differ between nodes). The plan is one for all ranks, so it
    takes the tightest node's. The disk is that of the node with the least of it per rank, counted for
    the tightest node's ranks, so that each rank's share is the least any rank has.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return host, disk, ranks_here
    machines: list = [None] * dist.get_world_size()
    dist.all_gather_object(machines, (host, disk, ranks_here))
    host, _, ranks = min(machines, key=lambda m: m[0] / m[2])
    if disk is not None:
        disk = int(min(m[1] / m[2] for m in machines) * ranks)
    return host, disk, ranks


def _size(nbytes: int) -> str:
    return f"{nbytes / GiB:.1f} GiB" if nbytes >= GiB else f"{nbytes / (1 << 20):.1f} MiB"


def preflight(cfg: Config, world_size: int, device=None, check_fit: bool = True, replicated: bool = False) -> PlanResult:
    """Resolve `cfg` for `world_size` ranks on `device` and plan its peak memory.

    Every rule that ties the config to the world size, the model and the device is checked here
    (ConfigError naming the fix) before any model is built. With a known `device` and
    `check_fit`, a plan that does not fit is refused too, naming one change that would fit: the GPU's
    memory (CUDA), this machine's available host memory (the offload store's arena and FSDP2's CPU
    offload) and the free space of memory.offload_dir, each shared by the ranks torchrun started on the same
    node, on the node where a rank gets the least (`tightest_machine`). `device` may also be a device type ("cuda",
    "cpu": the launcher's choice before torchrun starts the ranks); None (not chosen) resolves the
    `auto` switches as on CUDA; either checks no memory: the ranks check once they know their device.
    The result's `setup.dims` are the run's parallel degrees, its `setup.loss_chunk` the chunk derived
    from the memory free on `device` now (on every rank), its `placement` where the offload store keeps
    each layer input. Under parallel.pp it is the heaviest stage's plan, with every stage's (`stages`), and an
    empty parallel.pp_layers is set in `cfg` to the cut balancing their peaks (`stage_cut`); memory.keep_attention=auto
    is set to false in `cfg` where the run fits only without it (`plan_run`). `replicated`: every rank holds the whole
    model (a Trainer under Accelerate's DDP, `Setup.replicated`).
    """
    device_type = "cuda" if device is None else getattr(device, "type", str(device))
    checked = check_fit and device is not None
    offload_dir = cfg.memory.offload_dir
    capacity, host, disk, on_node = None, None, None, 0
    if checked:
        from longfit.memory.loss import least_over_ranks

        # Measured by each rank (a node's free memory and disk move while the ranks start): the least of them.
        (capacity,) = least_over_ranks([device_memory_bytes(device)], device)
        if world_size > 1:
            host, disk, on_node = tightest_machine(
                host_memory_bytes(), disk_free_bytes(offload_dir) if offload_dir else None, ranks_on_this_node())
        else:
            host, disk = host_memory_bytes(), disk_free_bytes(offload_dir) if offload_dir else None
    free = None
    if getattr(device, "type", None) == "cuda":  # a rank's device; a bare type is the launcher's, which stays off the GPU
        from longfit.memory.loss import free_device_bytes

        free = free_device_bytes(device)
    s = resolve(cfg, world_size, device_type, free, on_node, replicated)
    if s.dims.pp > 1:
        # the run's cut from here on (rank 0's config is every rank's); several stages per rank: the even cut
        if not cfg.parallel.pp_layers and s.dims.pp_stages_per_rank == 1:
            cfg.parallel.pp_layers = stage_cut(s)
    result = plan_run(s, capacity, host, disk)
    if s.keep_attention and not result.setup.keep_attention:
        cfg.memory.keep_attention = False  # auto, and only without it does the run fit: the run's choice from here on
    if not result.fits_gpu:
        raise ConfigError(
            f"this configuration needs about {result.peak_bytes / GiB:.1f} GiB per rank but the device has "
            f"{capacity / GiB:.1f} GiB. {suggest_fix(result)} (or pass --force to try anyway)"
        )
    if not result.fits_host:
        raise ConfigError(
            f"this configuration needs {_size(result.host_bytes)} of host memory per rank (offloaded layer inputs "
            f"and model states) but {'this machine' if on_node <= 1 else f'the tightest node ({on_node} ranks)'} has "
            f"{_size(host)} available, {_size(result.host_share)} per rank. "
            f"{suggest_fix(result)} (or pass --force to try anyway)"
        )
    if not result.fits_disk:
        raise ConfigError(
            f"memory.offload_dir={offload_dir}: the offloaded layer inputs need {_size(result.disk_bytes)} per "
            f"rank there but it has {_size(disk)} free, {_size(result.disk_share)} per rank. {suggest_fix(result)} "
            "(or pass --force to try anyway)"
        )
    return result
