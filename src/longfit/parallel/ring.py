"""Ring attention over a context-parallel group, zigzag layout, exact for packed documents.

Every rank holds its zigzag shard (see sharding.py) of q, k, v: chunks r and 2cp-1-r of each row,
C = L / (2cp) tokens each. Attention of the local queries over all L keys is assembled block by block
while the K/V shards travel around the ring:

Forward (cp steps). At step s rank r holds the K/V shard of rank (r - s) mod cp. It posts the
exchange for step s+1 (send the shard to r+1, receive the next from r-1; one batch_isend_irecv, K and V
concatenated into one message), computes the blocks of step s meanwhile, then waits. Each block runs
`attention_forward`, returning (out_b, lse_b), merged exactly into fp32 accumulators with
`merge_partial` (lse = log sum_b exp(lse_b), out = sum_b exp(lse_b - lse) out_b). Per rank and call:
cp-1 hops of B x Hkv x L/cp x (D + Dv) elements.

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

Packed documents (the GLOBAL layout of the rows, longfit.data.packing.DocumentLayout, on the host): each
(q chunk, kv chunk) pair is intersected with each document of each row (models/blockwise.plan_blocks). A
document piece in both chunks gives a sub-block that is diagonal-causal (same chunk: the same tokens on
both sides), full (kv chunk earlier) or absent (kv chunk later). No token ever sees another document, and each document's output equals its unsharded attention. A full sub-block can
only come from the one document spanning both chunks, so off-diagonal pairs cost at most one kernel
call per row; rows with identical sub-blocks are batched. Nothing L x L is ever formed: only per-block
kernels. With one rank the same loop runs one step and the exchanges are no-ops.

Sliding-window layers (window W: query i sees keys i - W < j <= i, models/blockwise.py). The blocks of
each (q chunk, kv chunk, document) come from blockwise.plan_blocks: a chunk against itself is a
sliding-window self block, an earlier chunk is cut by the far edge of the window and a chunk whose every
key is W or more before every query gives no block at all, so nothing outside the window is computed.
- W - 1 <= C (the usual case: Gemma 3's W = 1024 against chunks of thousands of tokens): a query chunk
  c needs, besides itself, only the last W - 1 keys of chunk c - 1. Under zigzag, chunk r - 1 is the first
  chunk of rank r - 1 and chunk 2cp - 2 - r the second chunk of rank r + 1 (chunk cp's predecessor, cp - 1,
  is rank cp - 1's own first chunk). So instead of cp - 1 ring hops each rank sends the tail (W - 1
  tokens) of its first chunk to rank + 1 and of its second chunk to rank - 1, posted before its own
  blocks run; backward returns the halo's dK/dV the same way. Per rank and call: at most two messages
  of B x Hkv x (W - 1) x (D + Dv) elements, instead of cp - 1 hops of B x Hkv x L/cp x (D + Dv).
- W - 1 > C: the ring runs as for global layers, skipping the blocks that no window reaches (the K/V
  still travel, so that the ranks that need them get them).

Chunked-attention layers (Llama 4, chunk S: query i sees key j iff j <= i and both lie in the same S tokens
of their document, counted from the document's start as its position_ids are). Causal attention restricted to a
chunk is the attention of a document that is that chunk, so the layer's layout cuts every document of the GLOBAL
rows into its chunks (models.attention.layer_documents, `DocumentLayout.chunked`) and the document intersection
above does the rest: a (q chunk, kv chunk) pair meets only where one attention chunk spans both, an earlier zigzag
chunk outside the query's attention chunk gives no block, and nothing across a chunk boundary is computed.

Short documents (chunks included) need only the halo. In a layout whose longest document has S tokens no query
sees a key S or more positions before it, which is all a window of W = S would keep: planned with the window
min(W, S) -- which cuts no pair inside any document -- the layer gets the sliding window's halo exchange whenever
min(W, S) - 1 <= C, instead of cp - 1 hops of the whole shards. Llama 4's chunked layers (S = attention_chunk_size,
8192, against chunks of L / 2cp) are the case; packed rows of short documents profit alike.

Bidirectional spans (Gemma 3's images, `DocumentLayout.bidirectional`: a span's queries also see its later keys,
models/blockwise.py). Each (q chunk, kv chunk) pair adds the part of every span's strict upper triangle it holds, so
a query of a span cut by a chunk edge meets the later keys of its span when their chunk visits; the halo schedule
(which brings earlier keys only) is kept where no span crosses a chunk edge, else every hop runs.

Variants of the scores (derivations in models/kernels.py):
- K and V of different head sizes D and Dv (multi-head latent attention): one message per hop holds both,
  concatenated on the last axis ((B, Hkv, L/cp, D + Dv), `pack_kv`), so each hop moves B x Hkv x L/cp x
  (D + Dv) elements instead of padding V to D; the accumulators are (B, H, L/cp, Dv).
- attention-logit softcapping: each block's own kernel caps its scores; the merge, the schedule and the
  backward's use of the final out and lse are unchanged.
- attention sinks: a query's sinks are one more key of value 0, merged once into its FINAL (out, lse) on the
  rank that owns the query, after its last block (`finish_output`); the backward of every block then runs
  with that final out and lse as before, and the sinks' gradient of a rank's queries (`sinks_gradient`) is
  a partial sum that the gradient reduction over the ranks completes, as for every replicated parameter.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from longfit.data.packing import DocumentLayout, document_rows
from longfit.models.blockwise import (
    Block,
    Segment,
    attention_output,
    blocks_backward,
    blocks_forward,
    finish_output,
    plan_blocks,
    sinks_gradient,
)
from longfit.models.kept_attention import kept_or_computed, replaying_now
from longfit.models.kernels import FULL, LOWER, accumulation_dtype, check_self_attention
from longfit.parallel.comm import group_rank, group_size
from longfit.parallel.dims import window_fits_chunk
from longfit.parallel.sharding import zigzag_chunks

_KV_TAG = 0
_KV_GRAD_TAG = 1
_HALO_TAG = 2
_HALO_GRAD_TAG = 3


def _post(group: dist.ProcessGroup | None, tag: int, sends: list, receives: list) -> list:
    """Post (tensor, peer's rank in `group`) sends and receives as one batch; peers become GLOBAL ranks."""
    ops = [dist.P2POp(dist.isend, t, dist.get_global_rank(group, peer), group, tag) for t, peer in sends]
    ops += [dist.P2POp(dist.irecv, t, dist.get_global_rank(group, peer), group, tag) for t, peer in receives]
    return dist.batch_isend_irecv(ops) if ops else []


class _Pending:
    """Posted messages: `wait` completes them and returns `result()`. Sent tensors are kept alive until then."""

    def __init__(self, works: list, sends: list, result: Callable[[], object]):
        self._works, self._sends, self._result = works, sends, result

    def wait(self):
        for work in self._works:
            work.wait()
        return self._result()


def _ring_exchange(tensor: torch.Tensor, group: dist.ProcessGroup | None, tag: int) -> _Pending:
    """Send `tensor` to the next rank of the ring and receive an equally shaped one from the previous.

    With one rank (or no group: a single process), `wait` returns the tensor itself.
    """
    size = group_size(group)
    if size == 1:
        return _Pending([], [], lambda: tensor)
    rank = group_rank(group)
    received = torch.empty_like(tensor)
    works = _post(group, tag, [(tensor, (rank + 1) % size)], [(received, (rank - 1) % size)])
    return _Pending(works, [tensor], lambda: received)


def pack_kv(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """k (B, Hkv, L, D) and v (B, Hkv, L, Dv) as one message (B, Hkv, L, D + Dv): K and V travel together at
    their own widths (multi-head latent attention has Dv < D)."""
    return torch.cat([k, v], dim=-1)


def unpack_kv(kv: torch.Tensor, key_width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (k, v) views of a `pack_kv` message (or of its gradient) whose keys are `key_width` wide."""
    return kv[..., :key_width], kv[..., key_width:]


def _send_tails(kv: torch.Tensor, group: dist.ProcessGroup | None, width: int) -> _Pending:
    """The halo exchange (module docstring): kv (B, Hkv, 2C, D + Dv) -> (B, Hkv, 2 width, D + Dv) halo,
    [rank - 1's first-chunk tail | rank + 1's second-chunk tail], zeros where there is no such neighbour."""
    rank, cp = group_rank(group), group_size(group)
    chunk = kv.shape[2] // 2
    shape = (*kv.shape[:2], width, kv.shape[3])
    from_previous, from_next = kv.new_zeros(shape), kv.new_zeros(shape)
    sends, receives = [], []
    if width and rank + 1 < cp:
        sends.append((kv[:, :, chunk - width : chunk].contiguous(), rank + 1))
        receives.append((from_next, rank + 1))
    if width and rank > 0:
        sends.append((kv[:, :, 2 * chunk - width :].contiguous(), rank - 1))
        receives.append((from_previous, rank - 1))
    works = _post(group, _HALO_TAG, sends, receives)
    return _Pending(works, sends, lambda: torch.cat([from_previous, from_next], dim=2))


def _return_tail_grads(halo_grad: torch.Tensor, group: dist.ProcessGroup | None, width: int) -> _Pending:
    """The reverse of `_send_tails`: each part of the halo's gradient goes back to the rank it came from.

    Returns (dK/dV of this rank's first-chunk tail, of its second-chunk tail), each (B, Hkv, width, D + Dv).
    """
    rank, cp = group_rank(group), group_size(group)
    shape = (*halo_grad.shape[:2], width, halo_grad.shape[3])
    first_tail, second_tail = halo_grad.new_zeros(shape), halo_grad.new_zeros(shape)
    sends, receives = [], []
    if width and rank > 0:
        sends.append((halo_grad[:, :, :width].contiguous(), rank - 1))
        receives.append((second_tail, rank - 1))
    if width and rank + 1 < cp:
        sends.append((halo_grad[:, :, width:].contiguous(), rank + 1))
        receives.append((first_tail, rank + 1))
    works = _post(group, _HALO_GRAD_TAG, sends, receives)
    return _Pending(works, sends, lambda: (first_tail, second_tail))


@dataclass(frozen=True)
class _Schedule:
    """What one rank computes: steps[s] are the blocks against the K/V of step s.

    halo None: ring hops, step s holds the shard of rank (rank - s) mod cp. Otherwise (a reach R = min(W, longest
    document) with R - 1 <= C): step 0 is the own shard, step 1 the halo of `halo` = R - 1 tokens per neighbour.
    """

    steps: list[list[Block]]
    halo: int | None = None


def _dense_plan(rank: int, owner: int, local_len: int) -> list[Block]:
    """One document per row: one block per step (module docstring)."""
    half, every = local_len // 2, slice(None)
    if owner == rank:
        return [Block(every, slice(0, local_len), slice(0, local_len), LOWER)]
    if owner < rank:
        return [Block(every, slice(0, local_len), slice(0, half), FULL)]
    return [Block(every, slice(half, local_len), slice(0, local_len), FULL)]


def _zigzag_segments(rank: int, cp: int, chunk: int) -> list[Segment]:
    return [Segment(c * chunk, (c + 1) * chunk, half * chunk) for half, c in enumerate(zigzag_chunks(rank, cp))]


def _halo_segments(rank: int, cp: int, chunk: int, width: int) -> list[Segment]:
    """The halo's global positions: the `width` keys before each of this rank's chunks that another rank holds."""
    first, second = zigzag_chunks(rank, cp)
    segments = []
    if rank > 0:
        segments.append(Segment(first * chunk - width, first * chunk, 0))
    if rank + 1 < cp:
        segments.append(Segment(second * chunk - width, second * chunk, width))
    return segments


def _ring_schedule(
    rank: int, cp: int, batch: int, local_len: int, documents: DocumentLayout | None, window: int | None
) -> _Schedule:
    """The kernel calls of every step for `rank` (module docstring)."""
    chunk, global_len = local_len // 2, cp * local_len
    owners = [(rank - step) % cp for step in range(cp)]
    rows = document_rows(documents, batch, global_len, shared_prompts=True)
    prefixes, bidirectional = (documents.prefixes, documents.bidirectional) if documents is not None else (None, None)
    if window is None and bidirectional is None and (documents is None or documents.one_per_row):
        return _Schedule([_dense_plan(rank, owner, local_len) for owner in owners])
    own = _zigzag_segments(rank, cp, chunk)
    longest = documents.longest if documents is not None else global_len  # from a shared prompt's start (#56)
    reach = longest if window is None else min(window, longest)  # no visible key is `reach` or more positions back
    # A window counts positions, which a shared prompt's answer continues past another answer: rows hold no bound.
    # The halo brings earlier keys only: a bidirectional span across two chunks needs the ring's every hop.
    if (not window_fits_chunk(reach, chunk) or (prefixes is not None and window is not None)
            or _crosses_chunks(bidirectional, chunk)):
        return _Schedule([plan_blocks(own, _zigzag_segments(owner, cp, chunk), rows, window, prefixes, bidirectional)
                          for owner in owners])
    halo = _halo_segments(rank, cp, chunk, reach - 1)
    return _Schedule([plan_blocks(own, own, rows, reach, prefixes, bidirectional),
                      plan_blocks(own, halo, rows, reach, prefixes)], reach - 1)


def _crosses_chunks(bidirectional, chunk: int) -> bool:
    """Whether a bidirectional span (`DocumentLayout.bidirectional`) has tokens in two zigzag chunks of `chunk` tokens
    (the same answer on every rank: the layout is global)."""
    return bidirectional is not None and any(start // chunk != (end - 1) // chunk
                                             for spans in bidirectional for start, end in spans)


@dataclass(frozen=True)
class _Scores:
    """How a block turns q . k into a logit, and the sinks merged after the last block (kernels.py)."""

    scale: float
    softcap: float | None
    key_width: int


def _ring_forward(q, k, v, group, scores, steps):
    out, lse = attention_output(q, v)
    kv = pack_kv(k, v)  # (B, Hkv, L, D + Dv): one message per hop
    for step, blocks in enumerate(steps):
        incoming = _ring_exchange(kv, group, _KV_TAG) if step + 1 < len(steps) else None
        blocks_forward(blocks, q, *unpack_kv(kv, scores.key_width), scores.scale, out, lse, scores.softcap)
        if incoming is not None:
            kv = incoming.wait()
    return out, lse


def _ring_backward(dout, q, k, v, out, lse, group, scores, steps):
    dq = torch.zeros_like(q, dtype=accumulation_dtype(q.dtype))
    kv = pack_kv(k, v)
    grad_exchange = None
    for step, blocks in enumerate(steps):
        incoming = _ring_exchange(kv, group, _KV_TAG) if step + 1 < len(steps) else None
        kv_grad = torch.zeros_like(kv, dtype=dq.dtype)  # this rank's share of the visiting shard's dK/dV
        keys, values = unpack_kv(kv, scores.key_width)
        blocks_backward(blocks, dout, q, keys, values, out, lse, scores.scale, dq,
                        *unpack_kv(kv_grad, scores.key_width), scores.softcap)
        if grad_exchange is not None:
            kv_grad += grad_exchange.wait()  # the shard's accumulator from the ranks it visited before
        grad_exchange = _ring_exchange(kv_grad, group, _KV_GRAD_TAG)
        if incoming is not None:
            kv = incoming.wait()
    dk, dv = unpack_kv(grad_exchange.wait(), scores.key_width)  # this rank's own shard, summed over every rank
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _halo_forward(q, k, v, group, scores, schedule):
    out, lse = attention_output(q, v)
    kv = pack_kv(k, v)  # (B, Hkv, L, D + Dv)
    pending = _send_tails(kv, group, schedule.halo)
    own, neighbours = schedule.steps
    blocks_forward(own, q, k, v, scores.scale, out, lse, scores.softcap)
    halo = pending.wait()  # (B, Hkv, 2 (W - 1), D + Dv)
    blocks_forward(neighbours, q, *unpack_kv(halo, scores.key_width), scores.scale, out, lse, scores.softcap)
    return out, lse, halo


def _halo_backward(dout, q, k, v, out, lse, halo, group, scores, schedule):
    acc = accumulation_dtype(q.dtype)
    dq = torch.zeros_like(q, dtype=acc)
    own, neighbours = schedule.steps
    halo_grad = torch.zeros_like(halo, dtype=acc)
    blocks_backward(neighbours, dout, q, *unpack_kv(halo, scores.key_width), out, lse, scores.scale, dq,
                    *unpack_kv(halo_grad, scores.key_width), scores.softcap)
    pending = _return_tail_grads(halo_grad, group, schedule.halo)
    kv_grad = torch.zeros_like(pack_kv(k, v), dtype=acc)
    blocks_backward(own, dout, q, k, v, out, lse, scores.scale, dq, *unpack_kv(kv_grad, scores.key_width),
                    scores.softcap)
    first_tail, second_tail = pending.wait()
    chunk, width = kv_grad.shape[2] // 2, schedule.halo
    kv_grad[:, :, chunk - width : chunk] += first_tail
    kv_grad[:, :, 2 * chunk - width :] += second_tail
    dk, dv = unpack_kv(kv_grad, scores.key_width)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, group, scores, schedule):
        halo = None
        if schedule.halo is not None and replaying_now():
            # A kept layer's recompute: the output comes back from the keeper, the neighbours' K/V tails (which the
            # backward reads) from the neighbours again.
            halo = _send_tails(pack_kv(k, v), group, schedule.halo).wait()

        def compute():
            nonlocal halo
            if schedule.halo is not None:
                out, lse, halo = _halo_forward(q, k, v, group, scores, schedule)
            else:
                out, lse = _ring_forward(q, k, v, group, scores, schedule.steps)
            return finish_output(q, out, lse, sinks)  # each query's sinks, once, after its last block

        out, lse = kept_or_computed(compute)  # a kept layer's recompute takes them back (models/kept_attention.py)
        ctx.save_for_backward(q, k, v, out, lse, sinks, halo)
        ctx.group, ctx.scores, ctx.schedule = group, scores, schedule
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks, halo = ctx.saved_tensors
        if ctx.schedule.halo is not None:
            grads = _halo_backward(dout, q, k, v, out, lse, halo, ctx.group, ctx.scores, ctx.schedule)
        else:
            grads = _ring_backward(dout, q, k, v, out, lse, ctx.group, ctx.scores, ctx.schedule.steps)
        return *grads, sinks_gradient(dout, out, lse, sinks), None, None, None


def ring_attention(
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
    """Causal attention of zigzag-sharded q (B, H, L/cp, D) over k (B, Hkv, L/cp, D), v (B, Hkv, L/cp, Dv)
    -> (B, H, L/cp, Dv).

    `group` is the context-parallel group (None: a single process); `documents` the GLOBAL layout of the
    B whole rows (None: one document per row); `window` the layer's sliding window (None: a global layer);
    `softcap` the attention-logit cap and `sinks` (H,) the attention sinks (models/kernels.py).
    Differentiable in q, k, v and the sinks.
    """
    cp, rank = group_size(group), group_rank(group)
    B, H, L, D = q.shape
    check_self_attention(q, k, v, "ring")
    assert L % 2 == 0, f"zigzag shards hold two equal chunks, got {L} local tokens (ParallelDims.check_sequence)"
    schedule = _ring_schedule(rank, cp, B, L, documents, window)
    scores = _Scores(D**-0.5 if scale is None else scale, softcap, D)
    return _RingAttention.apply(q, k, v, sinks, group, scores, schedule)
