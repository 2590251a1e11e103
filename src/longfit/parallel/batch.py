"""Cutting a packed batch into this rank's context-parallel shard, and the global token count.

Token ids are sharded BEFORE the embedding, so no rank ever holds a full-length activation. What
stays global: cu_seqlens and the batch's document layout on the host (attention needs the documents
of the whole row, and every rank holds the same copy) and the positions themselves -- position_ids
are sharded like the tokens, so rotary embeddings of a local token use its global in-document position.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from longfit.data.packing import IGNORE_INDEX, PackedBatch
from longfit.parallel.comm import all_reduce_sum
from longfit.parallel.sharding import Layout, shard_sequence

if TYPE_CHECKING:
    import torch.distributed as dist


def cp_layout(cp_method: str) -> Layout:
    """The sequence layout of a context-parallel method: "zigzag" (ring) or "contiguous" (ulysses)."""
    from longfit.parallel.context import ContextParallelAttention

    # The layout belongs to the method, not to a group: no group is needed to read it.
    return ContextParallelAttention(None, cp_method).layout


def shard_batch(batch: PackedBatch, cp_rank: int, cp_size: int, layout: Layout) -> PackedBatch:
    """This cp rank's tokens of every row: input_ids, labels, position_ids (B, L) -> (B, L / cp_size).

    cu_seqlens and documents are kept whole (global); num_label_tokens becomes the shard's count. Shard on the host,
    before `.to(device)`: the count then costs no device synchronisation and only the shard moves. The rows' images
    (#54) stay whole, their per-token index and positions are cut with the tokens (`MediaBatch.sharded`), so each
    shard takes exactly its own image embeddings.
    """
    if cp_size == 1:
        return batch

    def local(x: torch.Tensor) -> torch.Tensor:  # (B, L) -> (B, L / cp_size)
        return shard_sequence(x, 1, cp_rank, cp_size, layout).contiguous()

    # Every per-token (B, L) tensor: the tokens, labels and positions, and a preference batch's second targets and
    # answer indices (longfit.data.preferences.PairBatch); the rows' images cut their own (MediaBatch.sharded).
    per_token = {field.name: local(value) for field in dataclasses.fields(batch)
                 if isinstance(value := getattr(batch, field.name), torch.Tensor) and value.shape == batch.input_ids.shape}
    media = None if batch.media is None else batch.media.sharded(local)
    return dataclasses.replace(batch, **per_token, media=media,
                               num_label_tokens=int((per_token["labels"] != IGNORE_INDEX).sum()))


def global_valid_tokens(
    labels: torch.Tensor | Sequence[torch.Tensor], group: "dist.ProcessGroup | None"
) -> torch.Tensor:
    """Number of labels != -100 summed over every rank of `group` (all dp_shard x cp ranks: `ParallelMesh.world_group`).

    Under tensor parallelism the tp ranks of one (dp_shard, cp) coordinate hold the same tokens: they are not
    in `group`, so nothing is counted tp times (and their identical loss sums are not added up either).

    `labels` is one shard's labels or a list of them (the micro-batches of one optimizer step).
    Returns an int64 scalar tensor on the labels' device (no host synchronisation). A rank whose shard
    has no valid label contributes 0 here and a loss SUM of exactly 0 (never a NaN mean), so dividing
    every rank's sum by this global count is always well defined as long as the batch has a label.
    """
    pieces = [labels] if isinstance(labels, torch.Tensor) else list(labels)
    count = sum((piece != IGNORE_INDEX).sum() for piece in pieces)
    return all_reduce_sum(count, group)
