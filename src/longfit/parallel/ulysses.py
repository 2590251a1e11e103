"""DeepSpeed-Ulysses attention (Jacobs et al. 2023) over a context-parallel group, contiguous layout.

Rank r holds tokens [r L/cp, (r+1) L/cp) of every row for all H heads. One all-to-all per tensor trades
the sequence split for a head split: afterwards rank r holds heads [r H/cp, (r+1) H/cp) for the whole
sequence, runs ordinary attention locally (longfit.models.attention.local_attention: causal SDPA,
per-document attention from the GLOBAL document layout, whose documents a chunked-attention layer has cut into
its chunks (models.attention.layer_documents), and the exact sliding window of a local layer, which then sees
whole rows as on one device) and a second all-to-all returns the output to the sequence split.
Attention is independent per head, so the result is exact, with every variant of the scores on the
local call (softcapping; the attention sinks of the rank's query heads, whose gradient flows back to those
entries of the sinks parameter; K and V of their own head sizes, each moved by its own all-to-all).

Communication per call and rank (dist.all_to_all_single over the group; gloo supports it on CPU):
forward q, k, v in and out back: 4 all-to-alls, each moving (cp-1)/cp of the tensor; backward the
reverse all-to-all of each gradient (autograd Functions whose backward is the opposite exchange).
With one rank (or no group: a single process) the exchanges are skipped and the same code runs locally.

GQA: the K/V heads must split evenly too. With Hkv % cp != 0, each K/V head is repeated
rep = lcm(Hkv, cp) / Hkv times (repeat_interleave, whose backward sums the copies back exactly), so
query head h still meets K/V head h // (H / Hkv): cp % Hkv == 0 gives one K/V head per rank. H itself
must be divisible by cp; otherwise use more heads per rank or the ring (parallel.cp_method=ring).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from longfit.data.packing import DocumentLayout, document_rows
from longfit.models.attention import local_attention
from longfit.models.kernels import check_self_attention
from longfit.parallel.comm import group_rank, group_size


def _sequence_to_heads(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """(B, h, L/cp, D) sequence shard -> (B, h/cp, L, D) head shard."""
    cp = group_size(group)
    if cp == 1:
        return x
    B, h, chunk, D = x.shape
    send = x.reshape(B, cp, h // cp, chunk, D).transpose(0, 1).contiguous()  # (cp, B, h/cp, L/cp, D): [j] -> rank j
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)  # [j] = rank j's tokens of our heads
    return received.permute(1, 2, 0, 3, 4).reshape(B, h // cp, cp * chunk, D)


def _heads_to_sequence(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """(B, h/cp, L, D) head shard -> (B, h, L/cp, D) sequence shard."""
    cp = group_size(group)
    if cp == 1:
        return x
    B, heads, L, D = x.shape
    send = x.reshape(B, heads, cp, L // cp, D).permute(2, 0, 1, 3, 4).contiguous()  # (cp, B, h/cp, L/cp, D)
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)  # [j] = our tokens of rank j's heads
    return received.transpose(0, 1).reshape(B, cp * heads, L // cp, D)


class _SequenceToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _sequence_to_heads(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_sequence(grad, ctx.group), None


class _HeadsToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _heads_to_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _sequence_to_heads(grad, ctx.group), None


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup | None,
    scale: float | None = None,
    documents: DocumentLayout | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of contiguous shards q (B, H, L/cp, D), k (B, Hkv, L/cp, D), v (B, Hkv, L/cp, Dv)
    -> (B, H, L/cp, Dv).

    `group` is the context-parallel group (None: a single process); `documents` the GLOBAL layout of the
    B whole rows (None: one document per row); `window` the layer's sliding window (None: a global layer);
    `softcap` the attention-logit cap and `sinks` (H,) the attention sinks (models/kernels.py).
    Differentiable in q, k, v and the sinks.
    """
    cp = group_size(group)
    B, H, chunk, D = q.shape
    Hkv = k.shape[1]
    check_self_attention(q, k, v, "Ulysses")
    assert H % cp == 0, f"Ulysses needs the {H} heads divisible by cp={cp} (ParallelDims.check_heads)"
    document_rows(documents, B, cp * chunk, shared_prompts=True)  # validates before any communication
    repeats = math.lcm(Hkv, cp) // Hkv
    if repeats > 1:
        k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
    q, k, v = (_SequenceToHeads.apply(t, group) for t in (q, k, v))  # (B, heads/cp, L, D or Dv)
    if sinks is not None:
        heads = H // cp
        sinks = sinks[group_rank(group) * heads : (group_rank(group) + 1) * heads]  # this rank's query heads
    out = local_attention(q, k, v, scale, documents, window, softcap, sinks)
    return _HeadsToSequence.apply(out, group)  # (B, H, L/cp, Dv)
