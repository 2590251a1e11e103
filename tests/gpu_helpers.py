"""Shared by tests/test_gpu_*.py: the device parameter, float64 attention, and tolerances by dtype.

Each comparison is written once and runs on the CPU in the default run (which checks the reference
and the tolerances against the CPU kernels) and on CUDA under `-m gpu`; without a GPU the CUDA cases
skip (tests/conftest.py).

Tolerances are those of the dtype the computation actually ran in, against float64 math on the same
(rounded) inputs, for unit-variance inputs, so that values are O(1) and atol = rtol is meaningful:
- float64: 1e-7, accumulation order only.
- float32: 5e-5. fp32 kernels accumulate in fp32 (relative 6e-8 per operation over at most a few
  hundred terms); the CUDA memory-efficient kernel multiplies with 3xTF32 (near-fp32 products) and
  exponentiates with fast intrinsics, a few ulp each.
- float16: 5e-3. The output and gradients are rounded to 11 significant bits (2^-11 = 4.9e-4
  relative), and FlashAttention-2 rounds the probabilities to fp16 before P V and dS before dS K.
- bfloat16: 2e-2, the same with 8 significant bits (2^-8 = 3.9e-3 relative).
- logsumexp is fp32 for 16- and 32-bit inputs (fp64 for fp64): the scores are exact products of the
  rounded inputs accumulated in fp32, so 1e-4 whatever the input dtype.

Two runs of the same computation that differ only in how a sum is split (MLP tiles, loss chunks, the
order of atomic adds) are compared tensor by tensor in norm, `relative_error` <= NORM_TOLERANCE: fp32
1e-5 (reassociation, about 1e-7); bf16 autocast 1e-2 (each partial product rounded to 8 significant
bits before it is summed: about 2^-9 = 2e-3).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]
TOLERANCE = {torch.float64: 1e-7, torch.float32: 5e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}
NORM_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
LSE_TOLERANCE = {torch.float64: 1e-7, torch.float32: 1e-4, torch.float16: 1e-4, torch.bfloat16: 1e-4}


def randn(*shape: int, seed: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    """Unit-variance values drawn in fp64 on the CPU (the same on every device), then rounded to `dtype`."""
    values = torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return values.to(dtype).to(device)


def visible_pairs(
    length_q: int, length_k: int, causal: str | None = None, documents: list[int] | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """(Lq, Lk) bool: which keys each query sees.

    causal None: every key; "lower": key c <= query r (top-left aligned, as the kernels' is_causal);
    "upper": c >= r. `documents` (lengths summing to L) keep each query within its own document, and
    `window` W keeps the keys r - W < c <= r (transformers' sliding_window, the query counted).
    """
    r, c = torch.arange(length_q).unsqueeze(1), torch.arange(length_k).unsqueeze(0)
    visible = torch.ones(length_q, length_k, dtype=torch.bool)
    if causal == "lower":
        visible &= c <= r
    elif causal == "upper":
        visible &= c >= r
    if documents is not None:
        doc = torch.repeat_interleave(torch.arange(len(documents)), torch.tensor(documents))
        visible &= doc.unsqueeze(1) == doc.unsqueeze(0)
    if window is not None:
        visible &= r - c < window
    return visible


def reference_gradients(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, visible: torch.Tensor, scale: float
) -> tuple[torch.Tensor, ...]:
    """float64 (out, lse, dq, dk, dv) on the CPU of q (B, H, Lq, D) over k/v (B, Hkv, Lk, D), whose K/V heads
    are repeated for GQA, for the upstream gradient `dout` of the output; `visible` is (Lq, Lk) or (B, Lq, Lk)."""
    q, k, v = leaves = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
    groups = q.shape[1] // k.shape[1]
    scores = scale * q @ k.repeat_interleave(groups, 1).transpose(-1, -2)  # (B, H, Lq, Lk)
    scores = scores.masked_fill(~(visible if visible.dim() == 2 else visible.unsqueeze(1)), float("-inf"))
    lse = scores.logsumexp(-1)  # (B, H, Lq)
    out = torch.exp(scores - lse.unsqueeze(-1)) @ v.repeat_interleave(groups, 1)
    grads = torch.autograd.grad(out, leaves, dout.detach().cpu().double())
    return out.detach(), lse.detach(), *grads


def assert_close_to_reference(got: torch.Tensor, want: torch.Tensor, tolerance: float, what: str) -> None:
    torch.testing.assert_close(
        got.detach().cpu().double(), want.detach().cpu().double(), rtol=tolerance, atol=tolerance,
        msg=lambda m: f"{what}: {m}",
    )


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| in fp64: one number per tensor, for comparisons whose rounding is spread out."""
    got, want = got.detach().cpu().double(), want.detach().cpu().double()
    return ((got - want).norm() / want.norm()).item()


@contextlib.contextmanager
def fixed_order_kernels():
    """Two runs of one computation give the same bits: torch's deterministic variants where an op has one, and
    SDPA's math backend. FlashAttention-2 and the memory-efficient kernel add dq up with atomics; their
    fixed-order variants need use_deterministic_algorithms without warn_only, under which every op lacking a
    deterministic variant is an error and cuBLAS wants CUBLAS_WORKSPACE_CONFIG set before its first use."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    enabled, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with sdpa_kernel([SDPBackend.MATH]):
            yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
