"""The memory planner: analytic per-GPU peak (instant, no torch), traced peak on fake tensors, max context.

`plan_config(cfg, world_size, device_memory_bytes)` -> PlanResult (.peak_bytes, .breakdown, .fits,
.suggest_fix()) is what `longfit train` checks before allocating; `longfit plan` is the CLI
(longfit.plan.command). Importing this package does not import torch.
"""

from longfit.plan.analytic import PlanResult, plan_config

__all__ = ["PlanResult", "plan_config"]
