"""Ring attention over a context-parallel group, zigzag layout, exact for packed documents.

Every rank holds its zigzag shard (see sharding.py) of q, k, v: chunks r and 2cp-1-r of each row,
C = L / (2cp) tokens each. Attention of the local queries over all L keys is assembled block by block
while the K/V shards travel around the ring:

Forward (cp steps). At step s rank r holds the K/V shard of rank (r - s) mod cp. It posts the
exchange for step s+1 (send the shard to r+1, receive the next from r-1; one batch_isend_irecv, K and V
stacked into one message), computes the blocks of step s meanwhile, then waits. Each block runs
`attention_forward`, returning (out_b, lse_b), merged exactly into fp32 accumulators with
`merge_partial` (lse = log sum_b exp(lse_b), out = sum_b exp(lse_b - lse) out_b). Per rank and call:
cp-1 hops of 2 x B x Hkv x L/cp x D elements.

Backward (ring-flash-attention's derivation). For each block the kernel backward is called with the
FINAL merged out and lse, which yields that block's exact share of dq, dk, dv (kernels.py). dq stays
local. dK/dV of a shard are summed by the ranks it visits: the accumulator travels one step behind its
shard. At step s a rank computes its contribution to the shard it holds, adds the accumulator that
arrived from r-1 (everything the earlier ranks contributed), and sends the sum to r+1. After cp sends
the accumulator is back at the shard's owner, complete. K/V rotate again as in the forward; the
accumulators travel in fp32. Per rank: cp-1 K/V hops plus cp dK/dV hops.

Causality from the block structure (global chunk indices; "full" = no mask, kv before q):
- own shard (s = 0): q chunks (r, 2cp-1-r) vs the same chunks: q0|k0 diagonal, q1|k0 full, q1|k1
  diagonal, q0|k1 never visible = exactly a top-left causal mask on the whole 2C x 2C square;
- shard of a rank j < r: both q chunks see chunk j fully, chunk 2cp-1-j not at all (one C-key block);
- shard of a rank j > r: only q chunk 2cp-1-r sees it, fully (one C-query block).
Every step costs the same 2C x C work on every rank: the zigzag's load balance.

Packed documents (GLOBAL cu_seqlens): each (q chunk, kv chunk) pair is intersected with each document of
each row. A document piece in both chunks gives a sub-block that is diagonal-causal (same chunk: the
same tokens on both sides), full (kv chunk earlier) or absent (kv chunk later). No token ever sees
another document, and each document's output equals its unsharded attention. A full sub-block can
only come from the one document spanning both chunks, so off-diagonal pairs cost at most one kernel
call per row; rows with identical sub-blocks are batched. Nothing L x L is ever formed: only per-block
kernels. With one rank the same loop runs one step and the exchanges are no-ops.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch
import torch.distributed as dist

from longfit.parallel.comm import group_rank, group_size
from longfit.parallel.kernels import (
    accumulation_dtype,
    attention_backward,
    attention_forward,
    check_self_attention,
    merge_partial,
)
from longfit.parallel.sharding import document_spans, zigzag_chunks

_KV_TAG = 0
_KV_GRAD_TAG = 1


@dataclass(frozen=True)
class _Block:
    """One kernel call: batch rows x local query positions vs positions in the visiting K/V shard."""

    rows: slice
    q: slice
    kv: slice
    causal: bool


class _RingExchange:
    """Send a tensor to the next rank of the ring and receive an equally shaped one from the previous.

    Peers are GLOBAL ranks (dist.get_global_rank), as the P2P API wants. With one rank (or no group:
    a single process), `wait` returns the tensor itself.
    """

    def __init__(self, tensor: torch.Tensor, group: dist.ProcessGroup | None, tag: int):
        size = group_size(group)
        self._works = []
        self._result = tensor
        if size == 1:
            return
        rank = group_rank(group)
        self._sent = tensor  # kept alive until the send completes
        self._result = torch.empty_like(tensor)
        self._works = dist.batch_isend_irecv(
            [
                dist.P2POp(dist.isend, tensor, dist.get_global_rank(group, (rank + 1) % size), group, tag),
                dist.P2POp(dist.irecv, self._result, dist.get_global_rank(group, (rank - 1) % size), group, tag),
            ]
        )

    def wait(self) -> torch.Tensor:
        for work in self._works:
            work.wait()
        return self._result


def _dense_plan(rank: int, owner: int, local_len: int) -> list[_Block]:
    """One document per row: one block per step (module docstring)."""
    half, every = local_len // 2, slice(None)
    if owner == rank:
        return [_Block(every, slice(0, local_len), slice(0, local_len), True)]
    if owner < rank:
        return [_Block(every, slice(0, local_len), slice(0, half), False)]
    return [_Block(every, slice(half, local_len), slice(0, local_len), False)]


def _packed_plan(rank: int, owner: int, cp: int, chunk: int, rows: list[list[tuple[int, int]]]) -> list[_Block]:
    """Sub-blocks of rank `rank`'s queries against `owner`'s K/V shard, per document (module docstring)."""
    runs: dict[tuple[int, int, int, int, bool], list[list[int]]] = {}
    for b, docs in enumerate(rows):
        doc_ends = [end for _, end in docs]
        for q_half, q_chunk in enumerate(zigzag_chunks(rank, cp)):
            q_lo = q_chunk * chunk
            for kv_half, kv_chunk in enumerate(zigzag_chunks(owner, cp)):
                if kv_chunk > q_chunk:
                    continue
                kv_lo = kv_chunk * chunk
                first = bisect.bisect_right(doc_ends, q_lo)  # first document ending after the q chunk starts
                for start, end in docs[first:]:
                    if start >= q_lo + chunk:
                        break
                    kv_start, kv_end = max(start, kv_lo), min(end, kv_lo + chunk)
                    if kv_start >= kv_end:
                        continue
                    q_start, q_end = max(start, q_lo), min(end, q_lo + chunk)
                    key = (
                        q_half * chunk + q_start - q_lo,
                        q_half * chunk + q_end - q_lo,
                        kv_half * chunk + kv_start - kv_lo,
                        kv_half * chunk + kv_end - kv_lo,
                        kv_chunk == q_chunk,
                    )
                    row_runs = runs.setdefault(key, [])
                    if row_runs and row_runs[-1][1] == b:
                        row_runs[-1][1] = b + 1
                    else:
                        row_runs.append([b, b + 1])
    return [
        _Block(slice(r0, r1), slice(q0, q1), slice(k0, k1), causal)
        for (q0, q1, k0, k1, causal), row_runs in runs.items()
        for r0, r1 in row_runs
    ]


def _ring_plans(
    rank: int, cp: int, batch: int, local_len: int, cu_seqlens: torch.Tensor | None
) -> list[list[_Block]]:
    """The kernel calls of every ring step for `rank` (step s visits the K/V shard of rank (rank - s) mod cp)."""
    owners = [(rank - step) % cp for step in range(cp)]
    rows = None if cu_seqlens is None else document_spans(cu_seqlens, batch, cp * local_len)
    if rows is None or all(docs == [(0, cp * local_len)] for docs in rows):
        return [_dense_plan(rank, owner, local_len) for owner in owners]
    return [_packed_plan(rank, owner, cp, local_len // 2, rows) for owner in owners]


def _ring_forward(q, k, v, group, scale, plans):
    B, H, L, D = q.shape
    acc = accumulation_dtype(q.dtype)
    out = q.new_zeros((B, H, L, D), dtype=acc)
    lse = q.new_full((B, H, L), float("-inf"), dtype=acc)
    kv = torch.stack([k, v])  # (2, B, Hkv, L, D): one message per hop
    for step, plan in enumerate(plans):
        incoming = _RingExchange(kv, group, _KV_TAG) if step + 1 < len(plans) else None
        for block in plan:
            where = (block.rows, slice(None), block.q)
            block_out, block_lse = attention_forward(
                q[where], kv[0, block.rows, :, block.kv], kv[1, block.rows, :, block.kv], block.causal, scale
            )
            out[where], lse[where] = merge_partial(out[where], lse[where], block_out, block_lse)
        if incoming is not None:
            kv = incoming.wait()
    return out.to(q.dtype), lse


def _ring_backward(dout, q, k, v, out, lse, group, scale, plans):
    dq = torch.zeros_like(q, dtype=accumulation_dtype(q.dtype))
    kv = torch.stack([k, v])  # (2, B, Hkv, L, D)
    grad_exchange = None
    for step, plan in enumerate(plans):
        incoming = _RingExchange(kv, group, _KV_TAG) if step + 1 < len(plans) else None
        kv_grad = torch.zeros_like(kv, dtype=dq.dtype)  # this rank's share of the visiting shard's dK/dV
        for block in plan:
            where = (block.rows, slice(None), block.q)
            block_dq, block_dk, block_dv = attention_backward(
                dout[where], q[where], kv[0, block.rows, :, block.kv], kv[1, block.rows, :, block.kv],
                out[where], lse[where], block.causal, scale,
            )
            dq[where] += block_dq
            kv_grad[0, block.rows, :, block.kv] += block_dk
            kv_grad[1, block.rows, :, block.kv] += block_dv
        if grad_exchange is not None:
            kv_grad += grad_exchange.wait()  # the shard's accumulator from the ranks it visited before
        grad_exchange = _RingExchange(kv_grad, group, _KV_GRAD_TAG)
        if incoming is not None:
            kv = incoming.wait()
    kv_grad = grad_exchange.wait()  # this rank's own shard, summed over every rank
    return dq.to(q.dtype), kv_grad[0].to(k.dtype), kv_grad[1].to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, scale, plans):
        out, lse = _ring_forward(q, k, v, group, scale, plans)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.scale, ctx.plans = group, scale, plans
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(dout, q, k, v, out, lse, ctx.group, ctx.scale, ctx.plans)
        return dq, dk, dv, None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup | None,
    scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of zigzag-sharded q (B, H, L/cp, D) over k/v (B, Hkv, L/cp, D) -> (B, H, L/cp, D).

    `group` is the context-parallel group (None: a single process); `cu_seqlens` the GLOBAL document
    starts over the flattened B x L tokens (None: one document per row). Differentiable in q, k, v.
    """
    cp, rank = group_size(group), group_rank(group)
    B, H, L, D = q.shape
    check_self_attention(q, k, v, "ring")
    assert L % 2 == 0, f"zigzag shards hold two equal chunks, got {L} local tokens (ParallelDims.check_sequence)"
    plans = _ring_plans(rank, cp, B, L, cu_seqlens)
    return _RingAttention.apply(q, k, v, group, D**-0.5 if scale is None else scale, plans)
