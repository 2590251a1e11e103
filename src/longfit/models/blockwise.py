"""Exact attention assembled from kernel blocks: causal and sliding-window masks without any mask tensor.

The mask. transformers' `sliding_window = W` lets query i see key j iff i - W < j <= i: W keys counting
itself (flash-attn's window_size = (W - 1, 0) with causal=True); W = None is plain causal attention.
Positions are global positions in a row, and a query only ever sees keys of its own document. The
visible pairs of one document are the strip between two diagonals,

    lower edge  j <= i              (causality)
    far edge    j >= i - W + 1      (the window)

and every kernel call below covers a rectangle of that strip with one of kernels.py's three block
masks: FULL, LOWER (c <= r on a square whose rows and columns are the same positions: the lower edge)
or UPPER (c >= r on a square whose keys start W - 1 positions before its queries: the far edge, since
query a + r and key a - W + 1 + c satisfy i - j <= W - 1 iff c >= r). Nothing L x L is ever formed,
and no pair outside the strip is computed.

Geometry (`visible_pieces`): queries [q0, q1) against keys [k0, k1) of one document.
- Only the lower edge cuts the rectangle (no pair is W or more apart): queries before the first key and
  keys after the last query are trimmed; the LOWER square on the positions both sides share holds the
  edge; keys before it are FULL for every query, queries after it see its keys FULL.
- Only the far edge cuts (every key precedes every query): queries more than W - 1 past the last key and
  keys more than W - 1 before the first query are trimmed; the UPPER square whose diagonal is the edge
  j = i - W + 1 holds it; the queries before it see every remaining key FULL, the keys after it are
  FULL for its queries.
- Both cut: queries are cut into tiles of W; in a tile [s, s + W) the keys before s are only cut by
  the far edge, the keys from s on only by the lower edge.
At most three calls per rectangle with one edge.

Sliding-window self-attention (`window_forward`, a block with `window`): a segment of L > W tokens
whose queries and keys are the same. Tile it into W tokens; query tile t sees its own tile (LOWER)
and, from the previous tile, the W - 1 keys after that tile's first one, which it sees as an UPPER
(W - 1)-square (its last query sees none of them). Both kinds are the same shape in every tile, so each
is ONE batched kernel call over strided views of all tiles; a last, shorter tile goes through
`visible_pieces`. That is L W / 2 + L (W - 1) / 2 = about L x W scores, the minimum. On CUDA with a
FlashAttention-2 dtype the kernel's own window argument does the whole segment in one call
(kernels.window_kernel_forward).

The engine (`blocks_forward`, `blocks_backward`): each block's (out, lse) is merged into fp32
accumulators with the exact lse merge, and backward calls each block's kernel backward with the FINAL
out and lse, which gives that block's exact share of dq, dk, dv (kernels.py). `block_attention` wraps
one list of blocks in an autograd Function (the single-process sliding window); the ring runs one list
per step with the K/V it holds (parallel/ring.py).

Blocks are planned per document by `plan_blocks` from segments (runs of consecutive global positions
held at some local index): the single process has one segment per side, a ring rank its zigzag
chunks on the query side and the visiting chunks, or the window's halo, on the key side.

Shared prompts (preference pairs, #56: `DocumentLayout.prefixes`). A row holds prompt P, chosen answer C and rejected
answer R as P + C (one causal document) then R (a document whose prefix is P). R's queries see its own keys causally
(its LOWER block, as any document) and every key of P: one more rectangle of blocks, R's queries against P's keys,
planned as if P ended right before R (`_prefix_pieces`: the keys shifted by the gap C between them), so that a
sliding window counts positions, which continue from P's end in R, not row offsets. Without a window that rectangle
is one FULL block. Its (out, lse) merges with R's own block by logsumexp like any two blocks, and the backward gives
P's keys and values R's share of their gradient; so R's output, and every gradient, are those of P + R alone. The
rectangle costs |R| x |P| scores, what P + R run alone spends on R's queries; P's own |P|^2 / 2 are computed once.

Bidirectional spans (Gemma 3's images, #54: `DocumentLayout.bidirectional`). transformers' Gemma 3 masks a
conversation with images as OR(causal, same image) on global layers and AND(window, OR(causal, same image)) on
sliding ones (`create_masks_for_vision_model`: `blockwise_overlay` of the image runs' block ids), so query i of an
image span [a, b) sees

    its causal keys (j <= i, and i - j < W on a sliding layer)   plus   the LATER keys of its own span, i < j < b.

The two key sets are disjoint (j <= i against j > i), and the second is never cut by the window (j > i > i - W), so
the mask is exactly their union: the causal blocks every layer plans anyway, and, per span, the strict upper triangle
{(i, j): a <= i < j < b} (`_later_keys`), whose (out, lse) merges with the causal blocks' by logsumexp and whose
backward, given the final out and lse, is its share of the gradient (kernels.py), as for any two blocks. On one device
that triangle is ONE block: queries [a, b - 1) against keys [a + 1, b) under UPPER (query a + r sees key a + 1 + c iff
c >= r, i.e. j > i); a ring rank gets the part of it that each (query segment, key segment) pair holds. Its cost is
|span|^2 / 2 scores per span, what the dense mask's extra pairs are; nothing L x L is formed.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from longfit.models.kept_attention import kept_or_computed
from longfit.models.kernels import (
    FULL,
    LOWER,
    UPPER,
    accumulation_dtype,
    attention_backward,
    attention_forward,
    has_window_kernel,
    merge_partial,
    merge_sinks,
    sink_gradient,
    window_kernel_backward,
    window_kernel_forward,
)

Piece = tuple[int, int, int, int, str]  # queries [i0, i1), keys [j0, j1), mask


@dataclass(frozen=True)
class Block:
    """One kernel call: rows x local query positions vs local positions of the K/V tensor at hand.

    With `window` the block is a sliding-window self-attention (`window_forward`): its queries and keys
    are the same tokens and `mask` is LOWER.
    """

    rows: slice
    q: slice
    kv: slice
    mask: str
    window: int | None = None


@dataclass(frozen=True)
class Segment:
    """Consecutive tokens of a row: global positions [start, stop), held from index `local` of a local tensor."""

    start: int
    stop: int
    local: int


def visible_pieces(q0: int, q1: int, k0: int, k1: int, window: int | None) -> list[Piece]:
    """Blocks covering exactly the pairs j <= i, i - j < window of queries [q0, q1), keys [k0, k1) of one document."""
    if q0 >= q1 or k0 >= k1:
        return []
    if window is None or q1 - 1 - k0 < window:
        return _below_lower_edge(q0, q1, k0, k1)
    if k1 - 1 <= q0:
        return _within_far_edge(q0, q1, k0, k1, window)
    pieces = []
    for start in range(q0, q1, window):
        stop = min(start + window, q1)
        pieces += visible_pieces(start, stop, k0, min(k1, start), window)
        pieces += visible_pieces(start, stop, max(k0, start), k1, window)
    return pieces


def _below_lower_edge(q0: int, q1: int, k0: int, k1: int) -> list[Piece]:
    """The pairs j <= i: no pair of the rectangle is a window apart."""
    q0, k1 = max(q0, k0), min(k1, q1)
    if q0 >= q1 or k0 >= k1:
        return []
    if k1 - 1 <= q0:
        return [(q0, q1, k0, k1, FULL)]
    pieces = [(q0, k1, q0, k1, LOWER)]
    if k0 < q0:
        pieces.append((q0, q1, k0, q0, FULL))
    if k1 < q1:
        pieces.append((k1, q1, q0, k1, FULL))
    return pieces


def _within_far_edge(q0: int, q1: int, k0: int, k1: int, window: int) -> list[Piece]:
    """The pairs i - j < window: every key of the rectangle precedes (or is) every query."""
    q1, k0 = min(q1, k1 + window - 1), max(k0, q0 - window + 1)
    if q0 >= q1 or k0 >= k1:
        return []
    if q1 - 1 - k0 < window:
        return [(q0, q1, k0, k1, FULL)]
    first = max(q0, k0 + window - 1)  # the first query whose earliest visible key is inside [k0, k1)
    edge_stop = q1 - window + 1
    pieces = [(first, q1, first - window + 1, edge_stop, UPPER)]
    if first > q0:
        pieces.append((q0, first, k0, k1, FULL))
    if edge_stop < k1:
        pieces.append((first, q1, edge_stop, k1, FULL))
    return pieces


def _later_keys(q0: int, q1: int, k0: int, k1: int) -> list[Piece]:
    """Blocks covering exactly the pairs j > i of queries [q0, q1), keys [k0, k1) (a bidirectional span's part beyond
    the causal one, module docstring)."""
    q1, k0 = min(q1, k1 - 1), max(k0, q0 + 1)  # a query needs a later key, a key an earlier query
    if q0 >= q1 or k0 >= k1:
        return []
    if q1 <= k0:
        return [(q0, q1, k0, k1, FULL)]  # every key after every query
    # The UPPER square of queries [k0 - 1, q1) against keys [k0, q1 + 1) holds the edge j = i + 1 (query k0 - 1 + r
    # sees key k0 + c iff c >= r); the queries before it see every key, its queries every key after it.
    pieces = [(k0 - 1, q1, k0, q1 + 1, UPPER)]
    if q0 < k0 - 1:
        pieces.append((q0, k0 - 1, k0, k1, FULL))
    if q1 + 1 < k1:
        pieces.append((k0 - 1, q1, q1 + 1, k1, FULL))
    return pieces


def _bidirectional_pieces(q_segments, kv_segments, spans):
    """(local q start, stop, local kv start, stop, mask, None) of the row's spans' queries against the later keys of
    their own span (module docstring)."""
    pieces = []
    for start, end in spans:
        for qs in q_segments:
            q0, q1 = max(start, qs.start), min(end, qs.stop)
            for ks in kv_segments:
                k0, k1 = max(start, ks.start), min(end, ks.stop)
                if q0 >= q1 or k0 >= k1:
                    continue
                for i0, i1, j0, j1, mask in _later_keys(q0, q1, k0, k1):
                    pieces.append((i0 - qs.start + qs.local, i1 - qs.start + qs.local,
                                   j0 - ks.start + ks.local, j1 - ks.start + ks.local, mask, None))
    return pieces


def plan_blocks(
    q_segments: list[Segment],
    kv_segments: list[Segment],
    documents: list[list[tuple[int, int]]],
    window: int | None,
    prefixes: tuple | None = None,
    bidirectional: tuple | None = None,
) -> list[Block]:
    """The blocks of local queries against a local K/V tensor: exactly the visible pairs, per document.

    documents[b]: row b's documents as sorted [start, end) global positions; prefixes[b] (None: none) per document
    None or the [start, end) of the shared prompt it also sees (`DocumentLayout.prefixes`, module docstring);
    bidirectional[b] (None: none) the row's spans whose queries also see the later keys of their span
    (`DocumentLayout.bidirectional`). A query segment and a key segment over the same positions are self-attention
    (a LOWER block, or a sliding-window block); other pairs go through `visible_pieces`. Rows with identical blocks
    share one batched block.
    """
    runs: dict[tuple, list[list[int]]] = {}
    for b, docs in enumerate(documents):
        pieces = list(_row_pieces(q_segments, kv_segments, docs, window))
        if prefixes is not None:
            pieces += _prefix_pieces(q_segments, kv_segments, docs, prefixes[b], window)
        if bidirectional is not None:
            pieces += _bidirectional_pieces(q_segments, kv_segments, bidirectional[b])
        for key in pieces:
            row_runs = runs.setdefault(key, [])
            if row_runs and row_runs[-1][1] == b:
                row_runs[-1][1] = b + 1
            else:
                row_runs.append([b, b + 1])
    return [
        Block(slice(r0, r1), slice(q0, q1), slice(k0, k1), mask, block_window)
        for (q0, q1, k0, k1, mask, block_window), row_runs in runs.items()
        for r0, r1 in row_runs
    ]


def _row_pieces(q_segments, kv_segments, docs, window):
    """(local q start, stop, local kv start, stop, mask, window) of one row."""
    ends = [end for _, end in docs]
    for qs in q_segments:
        for ks in kv_segments:
            if ks.start >= qs.stop:
                continue  # every key after every query
            first = bisect.bisect_right(ends, max(qs.start, ks.start))
            for start, end in docs[first:]:
                if start >= min(qs.stop, ks.stop):
                    break
                q0, q1 = max(start, qs.start), min(end, qs.stop)
                k0, k1 = max(start, ks.start), min(end, ks.stop)
                if (qs.start, qs.stop) == (ks.start, ks.stop):
                    windowed = window is not None and window < q1 - q0
                    pieces = [(q0, q1, q0, q1, LOWER, window if windowed else None)]
                else:
                    pieces = [(*piece, None) for piece in visible_pieces(q0, q1, k0, k1, window)]
                for i0, i1, j0, j1, mask, piece_window in pieces:
                    yield (
                        i0 - qs.start + qs.local, i1 - qs.start + qs.local,
                        j0 - ks.start + ks.local, j1 - ks.start + ks.local,
                        mask, piece_window,
                    )


def _prefix_pieces(q_segments, kv_segments, docs, prefixes, window):
    """(local q start, stop, local kv start, stop, mask, None) of the row's documents' queries against their shared
    prompts' keys: `visible_pieces` with the keys moved up to end where the document starts (module docstring)."""
    pieces = []
    for (start, end), prefix in zip(docs, prefixes):
        if prefix is None:
            continue
        gap = start - prefix[1]
        for qs in q_segments:
            q0, q1 = max(start, qs.start), min(end, qs.stop)
            for ks in kv_segments:
                k0, k1 = max(prefix[0], ks.start), min(prefix[1], ks.stop)
                if q0 >= q1 or k0 >= k1:
                    continue
                for i0, i1, j0, j1, mask in visible_pieces(q0, q1, k0 + gap, k1 + gap, window):
                    pieces.append((i0 - qs.start + qs.local, i1 - qs.start + qs.local,
                                   j0 - gap - ks.start + ks.local, j1 - gap - ks.start + ks.local, mask, None))
    return pieces


# -- sliding-window self-attention of one segment ---------------------------------------------------


@dataclass(frozen=True)
class _Tiles:
    """`count` blocks batched into one kernel call: queries [q + t stride, + q_len) against keys
    [kv + t stride, + kv_len), t = 0 .. count - 1."""

    q: int
    q_len: int
    kv: int
    kv_len: int
    mask: str
    count: int = 1
    stride: int = 0


def _window_tiles(length: int, window: int) -> list[_Tiles]:
    """The batched calls of a sliding-window self-attention over `length` tokens (module docstring)."""
    if length <= window:
        return [_Tiles(0, length, 0, length, LOWER)]
    full = length // window
    tiles = [_Tiles(0, window, 0, window, LOWER, full, window)]
    if full > 1 and window > 1:
        tiles.append(_Tiles(window, window - 1, 1, window - 1, UPPER, full - 1, window))
    tail = full * window
    tiles += [
        _Tiles(i0, i1 - i0, j0, j1 - j0, mask)
        for i0, i1, j0, j1, mask in visible_pieces(tail, length, tail - window + 1, length, window)
    ]
    return tiles


def _tile_view(t: torch.Tensor, start: int, length: int, count: int, stride: int) -> torch.Tensor:
    """(B, h, L, ...) -> view (B, count, h, length, ...) of the positions [start + i stride, + length)."""
    if count == 1:
        return t[:, :, start : start + length].unsqueeze(1)
    span = t[:, :, start : start + (count - 1) * stride + length]
    return span.unfold(2, length, stride).movedim(-1, 3).transpose(1, 2)


def _tile_operands(tiles: _Tiles, *tensors: torch.Tensor, keys: int = 0) -> list[torch.Tensor]:
    """The tiles of each tensor as (B * count, h, length, ...) kernel operands; the last `keys` are K/V."""
    views = []
    for i, t in enumerate(tensors):
        start, length = (tiles.kv, tiles.kv_len) if i >= len(tensors) - keys else (tiles.q, tiles.q_len)
        views.append(_tile_view(t, start, length, tiles.count, tiles.stride))
    return views


def _merge_into(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    merged_out, merged_lse = merge_partial(out, lse, block_out, block_lse)
    out.copy_(merged_out)
    lse.copy_(merged_lse)


def _window_kernel_serves(q: torch.Tensor, v: torch.Tensor, softcap: float | None) -> bool:
    """The CUDA window kernel takes one head size and no cap: other calls go through the block kernels."""
    return softcap is None and q.shape[-1] == v.shape[-1] and has_window_kernel(q)


def window_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, scale: float, out: torch.Tensor, lse: torch.Tensor,
    softcap: float | None = None,
) -> None:
    """Merge the sliding-window self-attention of q (B, H, L, D) over k (B, Hkv, L, D), v (B, Hkv, L, Dv) into
    out, lse (in place); `softcap` caps the scores (kernels.py)."""
    if _window_kernel_serves(q, v, softcap):
        _merge_into(out, lse, *window_kernel_forward(q, k, v, window, scale))
        return
    for tiles in _window_tiles(q.shape[2], window):
        out_t, lse_t, q_t, k_t, v_t = _tile_operands(tiles, out, lse, q, k, v, keys=2)
        block_out, block_lse = attention_forward(
            *(t.flatten(0, 1) for t in (q_t, k_t, v_t)), tiles.mask, scale, softcap
        )
        _merge_into(out_t, lse_t, block_out.unflatten(0, q_t.shape[:2]), block_lse.unflatten(0, q_t.shape[:2]))


def window_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    window: int,
    scale: float,
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    softcap: float | None = None,
) -> None:
    """Add the gradients of `window_forward`, given the final out and lse, into dq, dk, dv (in place)."""
    if _window_kernel_serves(q, v, softcap):
        for acc, grad in zip((dq, dk, dv), window_kernel_backward(dout, q, k, v, out, lse, window, scale)):
            acc += grad
        return
    for tiles in _window_tiles(q.shape[2], window):
        operands = _tile_operands(tiles, dout, q, out, lse, dq, k, v, dk, dv, keys=4)
        dout_t, q_t, out_t, lse_t, dq_t, k_t, v_t, dk_t, dv_t = operands
        grads = attention_backward(
            *(t.flatten(0, 1) for t in (dout_t, q_t, k_t, v_t, out_t, lse_t)), tiles.mask, scale, softcap
        )
        for acc, grad in zip((dq_t, dk_t, dv_t), grads):
            acc += grad.unflatten(0, acc.shape[:2])


# -- the engine --------------------------------------------------------------------------------------


def blocks_forward(
    blocks: list[Block], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, out: torch.Tensor,
    lse: torch.Tensor, softcap: float | None = None,
) -> None:
    """Merge every block of q (B, H, Lq, D) against k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv) into out (B, H, Lq, Dv),
    lse (B, H, Lq); `softcap` caps every score (kernels.py)."""
    for block in blocks:
        where, keys = (block.rows, slice(None), block.q), (block.rows, slice(None), block.kv)
        if block.window is None:
            block_result = attention_forward(q[where], k[keys], v[keys], block.mask, scale, softcap)
            _merge_into(out[where], lse[where], *block_result)
        else:
            window_forward(q[where], k[keys], v[keys], block.window, scale, out[where], lse[where], softcap)


def blocks_backward(
    blocks: list[Block],
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    softcap: float | None = None,
) -> None:
    """Add every block's share of the gradient (given the final out, lse) into dq, dk, dv (in place)."""
    for block in blocks:
        where, keys = (block.rows, slice(None), block.q), (block.rows, slice(None), block.kv)
        operands = (dout[where], q[where], k[keys], v[keys], out[where], lse[where])
        if block.window is None:
            grads = attention_backward(*operands, block.mask, scale, softcap)
            for acc, grad in zip((dq[where], dk[keys], dv[keys]), grads):
                acc += grad
        else:
            window_backward(*operands, block.window, scale, dq[where], dk[keys], dv[keys], softcap)


def attention_output(q: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Running (out (B, H, Lq, Dv), lse (B, H, Lq)) of queries q (B, H, Lq, D) that have seen no key yet, against
    values like v (..., Dv), in the accumulation dtype."""
    acc = accumulation_dtype(q.dtype)
    return q.new_zeros((*q.shape[:-1], v.shape[-1]), dtype=acc), q.new_full(q.shape[:-1], float("-inf"), dtype=acc)


def finish_output(
    q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The FINAL (out in q's dtype, lse) of accumulated attention: the sinks merged in (kernels.merge_sinks)."""
    if sinks is not None:
        out, lse = merge_sinks(out, lse, sinks)
    return out.to(q.dtype), lse


def sinks_gradient(
    dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor | None
) -> torch.Tensor | None:
    """The sinks' gradient from these queries (None without sinks)."""
    return None if sinks is None else sink_gradient(dout, out, lse, sinks)


class _BlockAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, blocks, scale, softcap):
        def compute():
            out, lse = attention_output(q, v)
            blocks_forward(blocks, q, k, v, scale, out, lse, softcap)
            return finish_output(q, out, lse, sinks)

        out, lse = kept_or_computed(compute)  # a kept layer's recompute takes them back (kept_attention.py)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.blocks, ctx.scale, ctx.softcap = blocks, scale, softcap
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        acc = accumulation_dtype(q.dtype)
        dq, dk, dv = (torch.zeros_like(t, dtype=acc) for t in (q, k, v))
        blocks_backward(ctx.blocks, dout, q, k, v, out, lse, ctx.scale, dq, dk, dv, ctx.softcap)
        dsinks = sinks_gradient(dout, out, lse, sinks)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsinks, None, None, None


def block_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: list[Block], scale: float,
    softcap: float | None = None, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Differentiable attention of q (B, H, Lq, D) over k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv) made of `blocks`
    -> (B, H, Lq, Dv), scores capped at `softcap`, with the attention `sinks` (H,) of kernels.py.

    Rows or positions no block covers get an output of 0 (the sinks scale a 0).
    """
    return _BlockAttention.apply(q, k, v, sinks, blocks, scale, softcap)
