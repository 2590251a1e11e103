"""Attention kept through a checkpointed layer's recompute (#53): its forward runs once per step.

A checkpointed decoder layer (longfit.memory.checkpointing) runs its forward twice, the second time in backward to
rebuild what its backward needs. Attention's backward (kernels.py, FlashAttention-2 Alg. 2) needs q, k, v, which the
recompute rebuilds from the layer input at the cost of the projections, and the FINAL output and logsumexp, which
only the attention kernel itself produces. So the layer hands its attention a `keeper` (`keeping` in forward,
`replaying` in the recompute); `kept_or_computed` then records each attention call's (out, lse) in forward and, in
the recompute, returns the recorded pair instead of running the kernel, in the same order. Where the pair waits in
between is the keeper's business (the offload store, beside the layer input).

The attention paths that produce (out, lse) and run their backward from them call `kept_or_computed`: the block
engine (blockwise.py: windows, softcap, sinks, latent widths, chunked layers as documents) and the ring (both on
one process and inside Ulysses, which calls the local attention). While a keeper is active the fused one-kernel
paths of `attention.local_attention` (causal SDPA, SDPA per packed document) take the block engine instead, with
the same aten kernel on CPU and FlashAttention-2 on CUDA. flash-attn's varlen kernels (CUDA, packed documents or
FlashAttention-3, softcap capped by flash-attn) keep no logsumexp longfit can run a backward from: those calls are
recomputed as before. Linear-attention (Gated DeltaNet) and the other token mixers (document_mixers.py) never call
`kept_or_computed`: their kernels keep other state (a recurrent state per chunk), so they are recomputed as before.
Tiled layers (memory/tiled_layers.py) run no layer-wide checkpoint and recompute attention tile by tile: no keeper is
active there (memory.keep_attention resolves off under them). A pipeline stage's checkpointed layers keep it like any
checkpointed layer, one keeper per layer call and micro-batch; every recompute of a layer replays from its first call
(zero bubble recomputes a layer for its input gradient and again for its weight gradients).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Protocol

import torch


class AttentionKeeper(Protocol):
    """Where one checkpointed layer call keeps its attention results between forward and backward."""

    def keep(self, out: torch.Tensor, lse: torch.Tensor) -> None:
        """Record one attention call's final out (B, H, L, Dv) and lse (B, H, L), in call order."""

    def take(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next recorded (out, lse), in call order, on the device they were recorded on."""


class _Active(threading.local):
    """The keeper of the layer running on this thread and whether it records or replays (the recompute runs in the
    autograd engine's thread, where the checkpoint enters its recompute context)."""

    keeper: AttentionKeeper | None = None
    replay: bool = False


_ACTIVE = _Active()


@contextlib.contextmanager
def _active(keeper: AttentionKeeper, replay: bool):
    saved = _ACTIVE.keeper, _ACTIVE.replay
    _ACTIVE.keeper, _ACTIVE.replay = keeper, replay
    try:
        yield
    finally:
        _ACTIVE.keeper, _ACTIVE.replay = saved


def keeping(keeper: AttentionKeeper):
    """Context of a checkpointed layer's forward: attention calls record their (out, lse) with `keeper`."""
    return _active(keeper, replay=False)


def replaying(keeper: AttentionKeeper):
    """Context of the same layer's recompute: attention calls take their (out, lse) back from `keeper`."""
    return _active(keeper, replay=True)


def keeper_active() -> bool:
    """Whether attention called now is kept (records or replays): the fused paths then take the block engine."""
    return _ACTIVE.keeper is not None


def replaying_now() -> bool:
    """Whether attention called now takes its result from the keeper (the recompute of a kept layer)."""
    return _ACTIVE.keeper is not None and _ACTIVE.replay


def kept_or_computed(
    compute: Callable[[], tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The final (out, lse) of an attention call: `compute()`, recorded with the active keeper; in a recompute, the
    recorded pair instead (the kernel does not run)."""
    keeper = _ACTIVE.keeper
    if keeper is None:
        return compute()
    if _ACTIVE.replay:
        return keeper.take()
    out, lse = compute()
    keeper.keep(out, lse)
    return out, lse
