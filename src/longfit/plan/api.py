"""What the trainer calls before allocating anything: `plan_config` and the device's memory."""

from __future__ import annotations

from longfit.plan.analytic import PlanResult, plan_config

__all__ = ["PlanResult", "device_memory_bytes", "plan_config"]


def device_memory_bytes(device) -> int | None:
    """Total memory of a CUDA device (what `--gpu` presets describe); None on CPU: nothing to check."""
    if getattr(device, "type", str(device)) != "cuda":
        return None
    import torch

    return torch.cuda.mem_get_info(device)[1]
