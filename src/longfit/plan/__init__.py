"""The memory planner: analytic per-GPU peak (layer costs traced, then cached), traced whole step, max context.

This package's one public entry. Importing it does not import torch (a plan does, when it traces a layer kind it has
not cached, plan/layer_trace.py; `trace_step` does):
    plan_config(cfg, world_size, device_memory_bytes) -> PlanResult (.peak_bytes, .breakdown, .fits)
    preflight(cfg, world_size, device)   what `longfit train` asks before building anything
    suggest_fix(result)                  one config change that makes a plan fit
    max_seq_len / max_context_table      the longest context per strategy and GPU count
    trace_step(cfg, world_size)          one real training step on fake tensors
`longfit plan` is the CLI (longfit.plan.command).
"""

from longfit.plan.analytic import plan_config
from longfit.plan.preflight import device_memory_bytes, preflight
from longfit.plan.result import PlanResult
from longfit.plan.search import (
    STRATEGIES,
    Strategy,
    max_context_table,
    max_seq_len,
    suggest_fix,
)

__all__ = [
    "STRATEGIES",
    "PlanResult",
    "Strategy",
    "device_memory_bytes",
    "max_context_table",
    "max_seq_len",
    "plan_config",
    "preflight",
    "suggest_fix",
    "trace_step",
]


def __getattr__(name: str):
    if name == "trace_step":
        from longfit.plan.trace import trace_step

        return trace_step
    raise AttributeError(f"module 'longfit.plan' has no attribute {name!r}")
