"""How a row of L tokens is split across the cp ranks of a context-parallel group.

- "zigzag" (ring attention): the row is cut into 2*cp chunks of C = L / (2*cp) tokens and rank r holds
  chunks r and 2*cp-1-r, in that order. Under a causal mask the work of a query chunk grows with its
  index, so pairing an early chunk with a late one gives every rank the same amount of attention work
  (the load-balanced split of the Llama 3 report, Dubey et al. 2024, and zhuzilin/ring-flash-attention's
  zigzag).
  Example L=8, cp=2: rank 0 holds tokens [0 1 | 6 7], rank 1 holds [2 3 | 4 5].
- "contiguous" (Ulysses): rank r holds tokens [r*L/cp, (r+1)*L/cp); the all-to-all regathers the
  full sequence per head group, so no balancing is needed.

Packed documents never change the layout: they are described by the GLOBAL layout of the batch's rows
(longfit.data.packing.DocumentLayout, identical on every rank), which is not sharded. Nothing here
communicates except `gather_sequence` (an all_gather, for tests/export).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist

from longfit.parallel.comm import group_size

Layout = Literal["zigzag", "contiguous"]
LAYOUTS: tuple[str, ...] = ("zigzag", "contiguous")


def _pieces(cp_size: int, layout: Layout) -> int:
    """Equal pieces a row is cut into (ParallelDims.check_sequence guarantees seq_len divides by them)."""
    assert layout in LAYOUTS, f"unknown sequence layout {layout!r}"
    return 2 * cp_size if layout == "zigzag" else cp_size


def zigzag_chunks(cp_rank: int, cp_size: int) -> tuple[int, int]:
    """Indices (among 2*cp_size) of the two chunks rank `cp_rank` holds under the zigzag layout."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def shard_spans(seq_len: int, cp_rank: int, cp_size: int, layout: Layout) -> list[tuple[int, int]]:
    """Global [start, end) token spans of one row held by `cp_rank`, in local order."""
    pieces = _pieces(cp_size, layout)
    assert seq_len % pieces == 0 and 0 <= cp_rank < cp_size, (seq_len, cp_rank, cp_size, layout)
    if layout == "zigzag":
        chunk = seq_len // pieces
        return [(c * chunk, (c + 1) * chunk) for c in zigzag_chunks(cp_rank, cp_size)]
    part = seq_len // cp_size
    return [(cp_rank * part, (cp_rank + 1) * part)]


def shard_positions(
    seq_len: int, cp_rank: int, cp_size: int, layout: Layout, device: torch.device | str | None = None
) -> torch.Tensor:
    """(seq_len / cp_size,) long: the global position of each local token."""
    spans = shard_spans(seq_len, cp_rank, cp_size, layout)
    return torch.cat([torch.arange(start, end, device=device) for start, end in spans])


def shard_sequence(x: torch.Tensor, dim: int, cp_rank: int, cp_size: int, layout: Layout) -> torch.Tensor:
    """The part of `x` (the full row length along `dim`) that `cp_rank` holds.

    contiguous: a view (narrow); zigzag: a new tensor (the two chunks concatenated).
    """
    spans = shard_spans(x.shape[dim], cp_rank, cp_size, layout)
    pieces = [x.narrow(dim, start, end - start) for start, end in spans]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)


def unshard_sequence(shards: list[torch.Tensor] | tuple[torch.Tensor, ...], dim: int, layout: Layout) -> torch.Tensor:
    """Inverse of `shard_sequence`: `shards[r]` is rank r's local tensor; returns the full sequence."""
    if layout == "contiguous":
        return torch.cat(list(shards), dim=dim)
    halves = [shard.chunk(2, dim=dim) for shard in shards]
    # Global chunk order: first halves of ranks 0..cp-1, then second halves of ranks cp-1..0.
    return torch.cat([h[0] for h in halves] + [h[1] for h in reversed(halves)], dim=dim)


def gather_sequence(x: torch.Tensor, dim: int, group: dist.ProcessGroup | None, layout: Layout) -> torch.Tensor:
    """All-gather every rank's shard over `group` and unshard (no autograd; for tests and export)."""
    if group_size(group) == 1:
        return x
    shards = [torch.empty_like(x) for _ in range(group_size(group))]
    dist.all_gather(shards, x.contiguous(), group=group)
    return unshard_sequence(shards, dim, layout)
