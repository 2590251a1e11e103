"""Optimizers by state precision, and the CUDA caching-allocator setting for long sequences.

- `adamw`: torch AdamW, fp32 state (fused kernel when every parameter is on CUDA, else torch's default
  foreach/for-loop choice).
- `adamw_bf16`: `BF16StateAdamW`, exp_avg and exp_avg_sq stored in bf16 (half of fp32 AdamW's 8 bytes per
  parameter), every update computed in fp32 and rounded to nearest when stored back. Our own class: torchao's
  AdamW keeps its state in the parameter's dtype, so it has no bf16 state for fp32 parameters.
- `adamw8bit`: block-wise 8-bit state (2 bytes per parameter) from torchao (`torchao.optim.AdamW8bit`) or
  bitsandbytes (`bitsandbytes.optim.AdamW8bit`); CUDA only.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
import warnings
from collections.abc import Iterable

import torch

from longfit.config import ConfigError

OPTIMIZER_KINDS = ("adamw", "adamw_bf16", "adamw8bit")


class BF16StateAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, bias-corrected moments) with both moments stored in bf16.

    Each step loads the moments to fp32, applies the standard AdamW update in fp32 against the fp32 view of
    the parameter, and stores the moments back rounded to nearest (no stochastic rounding: the moments are
    running averages, so rounding errors do not accumulate the way they would in bf16 weights).
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
    ):
        if lr <= 0 or eps <= 0 or weight_decay < 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"BF16StateAdamW: invalid lr={lr}, betas={betas}, eps={eps}, weight_decay={weight_decay}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    def load_state_dict(self, state_dict) -> None:
        # torch.optim.Optimizer casts loaded state to the parameter dtype; bf16 -> fp32 -> bf16 is lossless.
        super().load_state_dict(state_dict)
        for state in self.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state:
                    state[key] = state[key].to(torch.bfloat16)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(param, dtype=torch.bfloat16, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(param, dtype=torch.bfloat16, memory_format=torch.preserve_format)
                state["step"] += 1
                step = state["step"].item()
                grad = param.grad.float()
                exp_avg = state["exp_avg"].float().lerp_(grad, 1 - beta1)
                exp_avg_sq = state["exp_avg_sq"].float().mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                state["exp_avg"].copy_(exp_avg)
                state["exp_avg_sq"].copy_(exp_avg_sq)
                # p <- p (1 - lr wd) - lr m_hat / (sqrt(v_hat) + eps), with m_hat = m / (1 - b1^t), v_hat = v / (1 - b2^t)
                denom = exp_avg_sq.sqrt_().div_(math.sqrt(1 - beta2**step)).add_(eps)
                update = exp_avg.div_(denom).mul_(lr / (1 - beta1**step))
                weights = param.float()
                weights.mul_(1 - lr * weight_decay).sub_(update)
                param.copy_(weights)
        return loss


def _all_cuda(params: list) -> bool:
    tensors = [p for group in params for p in (group["params"] if isinstance(group, dict) else [group])]
    return bool(tensors) and all(t.device.type == "cuda" for t in tensors)


def _eight_bit_adamw():
    """The 8-bit AdamW class of torchao (either import path) or bitsandbytes, or None."""
    for module_name in ("torchao.optim", "torchao.prototype.low_bit_optim", "bitsandbytes.optim"):
        if importlib.util.find_spec(module_name.split(".")[0]) is None:
            continue
        try:
            return getattr(importlib.import_module(module_name), "AdamW8bit")
        except (ImportError, AttributeError):
            continue
    return None


def build_optimizer(
    params: Iterable, lr: float, weight_decay: float, kind: str = "adamw"
) -> torch.optim.Optimizer:
    """An AdamW over `params` (tensors or param-group dicts) with the state precision of `kind`."""
    params = list(params)
    if kind == "adamw":
        if _all_cuda(params):
            return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=True)
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    if kind == "adamw_bf16":
        return BF16StateAdamW(params, lr=lr, weight_decay=weight_decay)
    if kind == "adamw8bit":
        optimizer_class = _eight_bit_adamw() if _all_cuda(params) else None
        if optimizer_class is None:
            where = "parameters on CUDA and " if not _all_cuda(params) else ""
            raise ConfigError(
                f"memory.optimizer=adamw8bit needs {where}an 8-bit AdamW implementation: `pip install torchao` "
                "(or `pip install bitsandbytes`) on a CUDA machine, or set memory.optimizer=adamw_bf16 "
                "(bf16 state, any device)"
            )
        return optimizer_class(params, lr=lr, weight_decay=weight_decay)
    raise ConfigError(f"memory.optimizer={kind!r} is not one of {', '.join(OPTIMIZER_KINDS)}")


ALLOC_CONF_VARIABLES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")  # torch >= 2.9's name, then the older one


def configure_cuda_allocator() -> bool:
    """Use expandable segments in the CUDA caching allocator unless the user chose otherwise; call before CUDA init.

    Long-context steps allocate and free tensors of many different large sizes; expandable segments stop that
    from fragmenting memory into blocks too small to reuse. A user's own allocator settings are kept; only one
    that names `expandable_segments` (or another `backend`) leaves it off. The setting goes into the variable the
    user wrote (torch < 2.9 reads it at CUDA init) and through the allocator API where torch has one: torch
    2.9.x ignored the option under PYTORCH_ALLOC_CONF, so with the variable alone it was silently off (issue #33).
    Returns whether longfit turned it on; `allocator_settings` says what is in force.
    """
    name = next((n for n in ALLOC_CONF_VARIABLES if os.environ.get(n)), "PYTORCH_CUDA_ALLOC_CONF")
    user = os.environ.get(name, "")
    if "expandable_segments" in user or "backend" in user:
        return False
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if torch.cuda.is_initialized() and setter is None:
        warnings.warn(
            "configure_cuda_allocator() ran after CUDA was initialised: expandable segments are not enabled",
            stacklevel=2,
        )
        return False
    os.environ[name] = ",".join(filter(None, [user, "expandable_segments:True"]))
    if setter is not None:
        setter("expandable_segments:True")
    return True


def allocator_settings() -> str:
    """The caching allocator's settings in force, for the run summary: the variables, and the API's view."""
    settings = [f"{n}={os.environ[n]}" for n in ALLOC_CONF_VARIABLES if os.environ.get(n)]
    getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    if getter is not None and getter():
        settings.append(f"allocator API: {getter()}")
    return "; ".join(settings) or "torch defaults"
