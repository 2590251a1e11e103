"""Attention of one query tile for longfit.memory.tiled_layers: one rank, Ulysses and ring, exact, packed
documents and sliding windows.

A tiled decoder layer (memory/tiled_layers.py owns the schedule) asks a backend, per query tile
[s, e) of its local shard, for the tile's attention over every key it may see, and later for the
gradient. This module owns that attention and, under context parallelism, its communication.

Blocks. The kernel calls are models/blockwise.py's `plan_blocks`: queries and keys are given as
segments (runs of consecutive row positions held from some index of the query and key buffers), and
the blocks cover exactly the visible pairs -- per document, causal, within the layer's sliding window
(None on global layers) -- with FULL, LOWER and UPPER block masks; nothing outside the window is
computed. The key buffer is cut into segments at the edges of the query tiles (a tile against its own
keys is then one self-attention block: causal, or blockwise.py's batched sliding window) and into pieces
of at most `max_keys` keys elsewhere, because a kernel's backward returns dK/dV for every key of its call:
max(tile, L / 8) keys bound those temporaries. Blocks are merged by their log-sum-exp into fp32
accumulators (`blocks_forward`); in backward each block's kernel gets the FINAL out and lse of its
queries and returns exactly its share of dq, dk, dv (`blocks_backward`, kernels.py), which are summed.

Backends (the protocol is documented on `LocalTileAttention`):
- `LocalTileAttention`, one rank: K/V buffers of the whole row, filled tile by tile in the one forward
  pass; dK/dV of a tile's keys are complete once the tiles after it are done (the layer's backward
  runs tiles in reverse).
- `UlyssesTileAttention` (contiguous layout): once every local tile has stored its k, v, one
  all-to-all per tensor turns the local K/V (B, Hkv, L/cp, D) into a head split of the whole row
  (B, Hkv'/cp, L, D) (Hkv' = K/V heads repeated up to a multiple of cp, as ulysses.py does): same bytes.
  A query tile (B, H, t, D) goes to the head split by one all-to-all, which concatenates tile [s, e)
  of every rank j: rows [j t, (j+1) t) are the queries at j L/cp + [s, e), attended to the keys
  they see (a segment per rank); the output comes back by the reverse all-to-all. Backward: dout goes
  to heads, dq comes back, dK/dV accumulate in fp32 in the head split; `finish_gradients` returns them
  to the sequence split (and sums the repeated heads). Per tile and pass: the q/out (dout/dq)
  exchanges of a tile; per layer: K/V out and dK/dV back once.
- `RingTileAttention` (zigzag layout; tiles never cross the two local chunks): for every query tile
  the local K/V shard travels once around the ring (cp-1 hops of one stacked message, ring.py's
  exchange), each visiting shard's chunks giving blocks (none from a shard the window does not reach:
  its K/V still travel, as in ring.py when the window is wider than a chunk). Backward: the same pass
  plus the fp32 dK/dV accumulator of each visiting shard travelling one step behind it, exactly
  ring.py's backward for one query tile; after cp hops the accumulator of this rank's own shard
  arrives with every rank's share of this tile index and is added into the local dK/dV. Memory stays
  local (K/V shards, no whole-row buffer); communication is that of a ring attention per tile.
Bidirectional spans (Gemma 3's images, `DocumentLayout.bidirectional`): a span's queries also see its later keys,
planned by models/blockwise.py beside the causal blocks. One rank's one pass holds a key only once its tile has run,
so its tiles never cut a span (`whole_spans`); the context-parallel backends share every key before any query attends
and finish dK/dV after the last one, so their tiles may cut a span: Ulysses' keys reach to the end of the span its
last query falls in, the ring's visiting shards hold every key of the row.
Every call is made by every rank of the group in the same order: tiles are cut alike on all ranks
(equal local lengths), and the layer's schedule visits them in the same order everywhere.
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.distributed as dist

from longfit.data.packing import DocumentLayout, Spans, document_rows
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
from longfit.models.kernels import accumulation_dtype
from longfit.parallel.comm import group_rank, group_size
from longfit.parallel.ring import _KV_GRAD_TAG, _KV_TAG, _ring_exchange, pack_kv, unpack_kv
from longfit.parallel.sharding import zigzag_chunks
from longfit.parallel.ulysses import _heads_to_sequence, _sequence_to_heads

KEY_BLOCKS_PER_ROW = 8  # key blocks of at most max(tile, L / 8) keys bound the backward's dK/dV temporaries


def key_segments(spans: list[Segment], tiles: set[tuple[int, int]], max_keys: int) -> list[Segment]:
    """The key buffer's `spans` cut at the edges of the query `tiles` (row positions) and into pieces of
    at most `max_keys` keys, except that a query tile's own keys stay one segment (a self-attention block)."""
    segments = []
    for span in spans:
        edges = {span.start, span.stop} | {p for tile in tiles for p in tile if span.start < p < span.stop}
        for first, stop in itertools.pairwise(sorted(edges)):
            step = stop - first if (first, stop) in tiles else max_keys
            segments += [
                Segment(k, min(k + step, stop), span.local + k - span.start) for k in range(first, stop, step)
            ]
    return segments


def whole_spans(tiles: list[tuple[int, int]], bidirectional: tuple | None) -> list[tuple[int, int]]:
    """`tiles` with every edge inside a bidirectional span (`DocumentLayout.bidirectional`, any row's: Gemma 3's
    images) moved to the span's end: a span's queries see its later keys, which the one-pass schedule holds only when
    they lie in the query's own tile or an earlier one. Edges that meet are merged (fewer, longer tiles)."""
    spans = sorted_spans(bidirectional)
    if not spans:
        return tiles
    edges = sorted({0, *(past_spans(edge, spans) for _, edge in tiles[:-1]), tiles[-1][1]})
    return list(itertools.pairwise(edges))


def sorted_spans(bidirectional: tuple | None) -> list[tuple[int, int]]:
    """The bidirectional spans of every row (`DocumentLayout.bidirectional`), in order of start."""
    return sorted(span for row in bidirectional or () for span in row)


def past_spans(edge: int, spans: list[tuple[int, int]]) -> int:
    """`edge` (a row position) moved to the end of the span it falls inside, and again while the moved edge falls
    inside a later one (`spans` in order of start: `sorted_spans`); itself when it cuts none."""
    for start, stop in spans:
        if start < edge < stop:
            edge = stop
    return edge


def even_tiles(start: int, end: int, count: int) -> list[tuple[int, int]]:
    """[start, end) cut into `count` tiles whose sizes differ by at most one token."""
    base, extra = divmod(end - start, count)
    tiles, position = [], start
    for index in range(count):
        size = base + (index < extra)
        tiles.append((position, position + size))
        position += size
    return tiles


class LocalTileAttention:
    """Tile attention with the whole row on this rank (no context parallelism).

    Protocol of every backend, as `longfit.memory.tiled_layers` calls it (`window`: the layer's sliding
    window, None on global layers):
      one_pass                      True: keys are stored while attending, one forward pass suffices and a
                                    tile's key gradient is complete when backward reaches it
      tiles(count)                  the local [start, end) tiles
      store(k, v, start, end)       a tile's rotated keys (B, Hkv, t, D) and values
      share_keys()                  after every tile has stored (context parallelism: the exchange)
      attend(q, start, end, scale, window, softcap, sinks)
                                    -> (out (B, H, t, Dv), saved: what attend_backward needs); `softcap` the
                                    attention-logit cap, `sinks` (H,) the attention sinks (models/kernels.py),
                                    merged into the tile's final out and lse
      start_gradients()             before the first attend_backward
      attend_backward(dout, saved, start, end, scale, window, softcap, sinks)
                                    -> (dq (B, H, t, D), the sinks' gradient from the tile's queries or None)
      finish_gradients()            after the last attend_backward
      key_gradients(start, end)     -> (dk, dv) of the local keys [start, end), complete
    """

    one_pass = True

    def __init__(self, rows: Spans, length: int, bidirectional: tuple | None = None):
        self.rows = rows
        self.length = length
        self.bidirectional = bidirectional  # per row, the spans whose queries also see their later keys (Gemma 3)
        self.max_keys = length
        self.keys: torch.Tensor | None = None  # (B, Hkv, L, D); values (B, Hkv, L, Dv)
        self.values: torch.Tensor | None = None
        self.dkeys: torch.Tensor | None = None  # (B, Hkv, L, D) fp32
        self.dvalues: torch.Tensor | None = None

    @classmethod
    def for_sequence(cls, batch: int, local_length: int, documents: DocumentLayout | None) -> "LocalTileAttention":
        # Bidirectional spans planned here (`_blocks`), shared prompts refused by document_rows as before
        planned = documents is not None and documents.prefixes is None
        return cls(document_rows(documents, batch, local_length, shared_prompts=planned), local_length,
                   documents.bidirectional if documents is not None else None)

    def tiles(self, count: int) -> list[tuple[int, int]]:
        tiles = whole_spans(even_tiles(0, self.length, min(count, self.length)), self.bidirectional)
        self.max_keys = max(tiles[0][1], math.ceil(self.length / KEY_BLOCKS_PER_ROW))
        return tiles

    def store(self, k: torch.Tensor, v: torch.Tensor, start: int, end: int) -> None:
        if self.keys is None:
            B, Hkv, _, D = k.shape
            self.keys = k.new_empty((B, Hkv, self.length, D))
            self.values = v.new_empty((B, Hkv, self.length, v.shape[-1]))
        self.keys[:, :, start:end] = k
        self.values[:, :, start:end] = v

    def share_keys(self) -> None:
        pass

    def _blocks(self, start: int, end: int, window: int | None) -> list[Block]:
        """Queries [start, end) (query buffer from 0) against the keys [0, end) they may see."""
        keys = key_segments([Segment(0, end, 0)], {(start, end)}, self.max_keys)
        return plan_blocks([Segment(start, end, 0)], keys, self.rows, window, bidirectional=self.bidirectional)

    def attend(self, q: torch.Tensor, start: int, end: int, scale: float, window: int | None = None,
               softcap: float | None = None, sinks: torch.Tensor | None = None):
        out, lse = attention_output(q, self.values)
        blocks_forward(self._blocks(start, end, window), q, self.keys, self.values, scale, out, lse, softcap)
        out, lse = finish_output(q, out, lse, sinks)
        return out, (q, out, lse)

    def start_gradients(self) -> None:
        acc = accumulation_dtype(self.keys.dtype)
        self.dkeys = torch.zeros_like(self.keys, dtype=acc)
        self.dvalues = torch.zeros_like(self.values, dtype=acc)

    def attend_backward(
        self, dout: torch.Tensor, saved, start: int, end: int, scale: float, window: int | None = None,
        softcap: float | None = None, sinks: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        q, out, lse = saved
        dq = torch.zeros_like(q, dtype=accumulation_dtype(q.dtype))
        blocks = self._blocks(start, end, window)
        blocks_backward(blocks, dout, q, self.keys, self.values, out, lse, scale, dq, self.dkeys, self.dvalues,
                        softcap)
        return dq.to(q.dtype), sinks_gradient(dout, out, lse, sinks)

    def finish_gradients(self) -> None:
        pass

    def key_gradients(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (
            self.dkeys[:, :, start:end].to(self.keys.dtype, copy=True),
            self.dvalues[:, :, start:end].to(self.values.dtype, copy=True),
        )


class UlyssesTileAttention(LocalTileAttention):
    """Tile attention over a contiguous context-parallel shard, keys in a head split (module docstring)."""

    one_pass = False

    def __init__(self, group: dist.ProcessGroup | None, rows: Spans, local_length: int,
                 bidirectional: tuple | None = None):
        super().__init__(rows, local_length, bidirectional)
        self.group = group
        self.cp = group_size(group)
        self.row_length = self.cp * local_length
        self.repeats = 1
        self.local_dkeys: torch.Tensor | None = None  # (B, Hkv, L/cp, D) fp32, after finish_gradients
        self.local_dvalues: torch.Tensor | None = None

    def tiles(self, count: int) -> list[tuple[int, int]]:
        tiles = even_tiles(0, self.length, min(count, self.length))
        self.max_keys = max(tiles[0][1], math.ceil(self.row_length / KEY_BLOCKS_PER_ROW))
        return tiles

    def share_keys(self) -> None:
        Hkv = self.keys.shape[1]
        self.repeats = math.lcm(Hkv, self.cp) // Hkv
        keys, values = self.keys, self.values
        if self.repeats > 1:
            keys, values = keys.repeat_interleave(self.repeats, dim=1), values.repeat_interleave(self.repeats, dim=1)
        self.keys, self.values = _sequence_to_heads(keys, self.group), _sequence_to_heads(values, self.group)

    def _blocks(self, start: int, end: int, window: int | None) -> list[Block]:
        """The head-split query tile: rows [j t, (j+1) t) are rank j's tile, at row positions j L/cp + [start, end)."""
        t = end - start
        queries = [Segment(j * self.length + start, j * self.length + end, j * t) for j in range(self.cp)]
        # A bidirectional span's queries also see its later keys: to the end of the span the last query falls in.
        last = past_spans(queries[-1].stop, sorted_spans(self.bidirectional))
        keys = key_segments([Segment(0, last, 0)], {(q.start, q.stop) for q in queries}, self.max_keys)
        return plan_blocks(queries, keys, self.rows, window, bidirectional=self.bidirectional)

    def _local_sinks(self, sinks: torch.Tensor | None, heads: int) -> torch.Tensor | None:
        """The sinks of this rank's `heads` query heads of the head split."""
        rank = group_rank(self.group)
        return None if sinks is None else sinks[rank * heads : (rank + 1) * heads]

    def attend(self, q: torch.Tensor, start: int, end: int, scale: float, window: int | None = None,
               softcap: float | None = None, sinks: torch.Tensor | None = None):
        heads = _sequence_to_heads(q, self.group)  # (B, H/cp, cp t, D)
        out, lse = attention_output(heads, self.values)
        blocks_forward(self._blocks(start, end, window), heads, self.keys, self.values, scale, out, lse, softcap)
        out, lse = finish_output(heads, out, lse, self._local_sinks(sinks, heads.shape[1]))
        return _heads_to_sequence(out, self.group), (heads, out, lse)

    def attend_backward(
        self, dout: torch.Tensor, saved, start: int, end: int, scale: float, window: int | None = None,
        softcap: float | None = None, sinks: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        heads, out, lse = saved
        dheads = torch.zeros_like(heads, dtype=accumulation_dtype(heads.dtype))
        blocks = self._blocks(start, end, window)
        dout = _sequence_to_heads(dout.contiguous(), self.group)
        blocks_backward(blocks, dout, heads, self.keys, self.values, out, lse, scale, dheads, self.dkeys, self.dvalues,
                        softcap)
        dsinks = None
        if sinks is not None:  # this rank's heads' share, in place in a gradient of every head
            dsinks = torch.zeros_like(sinks)
            local = self._local_sinks(dsinks, heads.shape[1])
            local += sinks_gradient(dout, out, lse, self._local_sinks(sinks, heads.shape[1]))
        return _heads_to_sequence(dheads.to(heads.dtype), self.group), dsinks

    def finish_gradients(self) -> None:
        def to_local(grad: torch.Tensor) -> torch.Tensor:
            grad = _heads_to_sequence(grad, self.group)  # (B, Hkv', L/cp, D)
            B, heads, L, D = grad.shape
            return grad.view(B, heads // self.repeats, self.repeats, L, D).sum(dim=2) if self.repeats > 1 else grad

        self.local_dkeys, self.local_dvalues = to_local(self.dkeys), to_local(self.dvalues)
        self.dkeys = self.dvalues = None

    def key_gradients(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = self.keys.dtype
        return (
            self.local_dkeys[:, :, start:end].to(dtype, copy=True),
            self.local_dvalues[:, :, start:end].to(dtype, copy=True),
        )


class RingTileAttention(LocalTileAttention):
    """Tile attention over a zigzag context-parallel shard: the K/V shards travel the ring per tile (module docstring)."""

    one_pass = False

    def __init__(self, group: dist.ProcessGroup | None, rows: Spans, local_length: int,
                 bidirectional: tuple | None = None):
        super().__init__(rows, local_length, bidirectional)
        self.group = group
        self.cp, self.rank = group_size(group), group_rank(group)
        self.chunk = local_length // 2
        self.kv: torch.Tensor | None = None  # (B, Hkv, L/cp, D + Dv): one message per hop (ring.pack_kv)
        self.dkv: torch.Tensor | None = None  # fp32, the local shard's complete gradient as tiles finish

    def tiles(self, count: int) -> list[tuple[int, int]]:
        per_chunk = max(1, min(math.ceil(count / 2), self.chunk))
        tiles = even_tiles(0, self.chunk, per_chunk) + even_tiles(self.chunk, 2 * self.chunk, per_chunk)
        self.max_keys = max(tiles[0][1] - tiles[0][0], math.ceil(2 * self.cp * self.chunk / KEY_BLOCKS_PER_ROW))
        return tiles

    def store(self, k: torch.Tensor, v: torch.Tensor, start: int, end: int) -> None:
        if self.kv is None:
            B, Hkv, _, D = k.shape
            self.kv = k.new_empty((B, Hkv, self.length, D + v.shape[-1]))
            self.keys, self.values = unpack_kv(self.kv, D)
        self.kv[:, :, start:end] = pack_kv(k, v)

    def _queries(self, start: int, end: int) -> tuple[int, int]:
        """Row positions of the local tile [start, end), which lies in one of the two zigzag chunks."""
        half = start // self.chunk
        base = zigzag_chunks(self.rank, self.cp)[half] * self.chunk - half * self.chunk
        return base + start, base + end

    def _shard_blocks(self, queries: tuple[int, int], owner: int, window: int | None) -> list[Block]:
        """The query tile against `owner`'s shard, whose zigzag chunk h sits at shard indices [h C, (h+1) C)."""
        chunks = [
            Segment(chunk * self.chunk, (chunk + 1) * self.chunk, half * self.chunk)
            for half, chunk in enumerate(zigzag_chunks(owner, self.cp))
        ]
        keys = key_segments(chunks, {queries}, self.max_keys)
        return plan_blocks([Segment(*queries, 0)], keys, self.rows, window, bidirectional=self.bidirectional)

    def attend(self, q: torch.Tensor, start: int, end: int, scale: float, window: int | None = None,
               softcap: float | None = None, sinks: torch.Tensor | None = None):
        queries = self._queries(start, end)
        out, lse = attention_output(q, self.values)
        kv, width = self.kv, q.shape[-1]
        for step in range(self.cp):
            incoming = _ring_exchange(kv, self.group, _KV_TAG) if step + 1 < self.cp else None
            blocks = self._shard_blocks(queries, (self.rank - step) % self.cp, window)
            blocks_forward(blocks, q, *unpack_kv(kv, width), scale, out, lse, softcap)
            if incoming is not None:
                kv = incoming.wait()
        out, lse = finish_output(q, out, lse, sinks)
        return out, (q, out, lse)

    def start_gradients(self) -> None:
        self.dkv = torch.zeros_like(self.kv, dtype=accumulation_dtype(self.kv.dtype))

    def attend_backward(
        self, dout: torch.Tensor, saved, start: int, end: int, scale: float, window: int | None = None,
        softcap: float | None = None, sinks: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        q, out, lse = saved
        queries = self._queries(start, end)
        dq = torch.zeros_like(q, dtype=accumulation_dtype(q.dtype))
        kv, grad_exchange, width = self.kv, None, q.shape[-1]
        for step in range(self.cp):
            incoming = _ring_exchange(kv, self.group, _KV_TAG) if step + 1 < self.cp else None
            kv_grad = torch.zeros_like(kv, dtype=dq.dtype)  # this rank's share of the visiting shard's dK/dV
            blocks = self._shard_blocks(queries, (self.rank - step) % self.cp, window)
            blocks_backward(blocks, dout, q, *unpack_kv(kv, width), out, lse, scale, dq, *unpack_kv(kv_grad, width),
                            softcap)
            if grad_exchange is not None:
                kv_grad += grad_exchange.wait()  # the shard's accumulator from the ranks it visited before
            grad_exchange = _ring_exchange(kv_grad, self.group, _KV_GRAD_TAG)
            if incoming is not None:
                kv = incoming.wait()
        self.dkv += grad_exchange.wait()  # this rank's own shard: every rank's share for this tile index
        return dq.to(q.dtype), sinks_gradient(dout, out, lse, sinks)

    def key_gradients(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        dk, dv = unpack_kv(self.dkv[:, :, start:end], self.keys.shape[-1])
        return dk.to(self.kv.dtype, copy=True), dv.to(self.kv.dtype, copy=True)


def context_parallel_tile_attention(
    method: str, group: dist.ProcessGroup | None, batch: int, local_length: int, documents: DocumentLayout | None
) -> LocalTileAttention:
    """The tile backend of a context-parallel method over `group`; `documents` the GLOBAL layout of the rows.
    Bidirectional spans planned by the backend's blocks (its two passes hold every key before any query attends, so a
    tile may cut an image), shared prompts refused by document_rows as before."""
    planned = documents is not None and documents.prefixes is None
    rows = document_rows(documents, batch, group_size(group) * local_length, shared_prompts=planned)
    backend = {"ring": RingTileAttention, "ulysses": UlyssesTileAttention}[method]
    return backend(group, rows, local_length, documents.bidirectional if documents is not None else None)
