"""What the trainer asks before it builds anything: is this configuration valid here, and does it fit?"""

from __future__ import annotations

from longfit.config import Config, ConfigError
from longfit.plan.analytic import plan_setup
from longfit.plan.result import GiB, PlanResult
from longfit.plan.search import suggest_fix
from longfit.plan.setup import resolve


def device_memory_bytes(device) -> int | None:
    """Total memory of a CUDA device (what `--gpu` presets describe); None on CPU: nothing to check."""
    if getattr(device, "type", str(device)) != "cuda":
        return None
    import torch

    return torch.cuda.mem_get_info(device)[1]


def preflight(cfg: Config, world_size: int, device=None, check_fit: bool = True) -> PlanResult:
    """Resolve `cfg` for `world_size` ranks on `device` and plan its peak memory.

    Every rule that ties the config to the world size, the model and the device is checked here
    (ConfigError naming the fix), torch-free and before any model is built. With a CUDA `device` and
    `check_fit`, a plan that does not fit the device's memory is refused too, naming one change that
    would fit. `device` may also be a device type ("cuda", "cpu": the launcher's choice before torchrun
    starts the ranks); None (not chosen) resolves the `auto` switches as on CUDA and checks no memory.
    The result's `setup.dims` are the run's parallel degrees, its `setup.loss_chunk` the chunk derived
    from the memory free on `device` now (on every rank).
    """
    device_type = "cuda" if device is None else getattr(device, "type", str(device))
    capacity = device_memory_bytes(device) if check_fit and device is not None else None
    free = None
    if getattr(device, "type", None) == "cuda":  # a rank's device; a bare type is the launcher's, which stays off the GPU
        from longfit.memory.loss import free_device_bytes

        free = free_device_bytes(device)
    result = plan_setup(resolve(cfg, world_size, device_type, free), capacity)
    if not result.fits:
        raise ConfigError(
            f"this configuration needs about {result.peak_bytes / GiB:.1f} GiB per rank but the device has "
            f"{capacity / GiB:.1f} GiB. {suggest_fix(result)} (or pass --force to try anyway)"
        )
    return result
