"""The context-parallel attention callable that `parallelize` puts on each attention module.

longfit's attention function (models/attention.py) routes a call to `module.longfit_context_parallel`
when that attribute is set, with the module's local q (B, H, L/cp, D), k/v (B, Hkv, L/cp, D), the
softmax scale, the GLOBAL document layout of the rows (longfit.data.packing.DocumentLayout, on the host) and
the layer's sliding window (None on global layers), the attention-logit cap and the attention sinks (None
where the model has none).
`ContextParallelAttention` binds the cp process group and the method; its `layout` tells the trainer
how to shard input_ids, labels and position_ids (sharding.shard_sequence) so that the tokens each rank
feeds the model are the ones the method expects:
- "ring": ring.py, zigzag layout, K/V rotated around the group with P2P;
- "ulysses": ulysses.py, contiguous layout, all-to-all between sequence and head splits.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from longfit.data.packing import DocumentLayout
from longfit.parallel.comm import group_rank, group_size
from longfit.parallel.ring import ring_attention
from longfit.parallel.sharding import Layout
from longfit.parallel.ulysses import ulysses_attention

_METHODS = {"ring": (ring_attention, "zigzag"), "ulysses": (ulysses_attention, "contiguous")}


class ContextParallelAttention:
    """`(q, k, v, scale=None, documents=None, window=None, softcap=None, sinks=None) -> out (B, H, L_local, Dv)`
    over the cp `group`.

    group None means a single process (longfit.parallel.comm's convention): the same code, no communication.
    """

    def __init__(self, group: dist.ProcessGroup | None, method: str):
        if method not in _METHODS:
            raise ValueError(f"parallel.cp_method={method!r}: use one of {', '.join(map(repr, _METHODS))}")
        self.group = group
        self.method = method
        self._attention, self._layout = _METHODS[method]

    @property
    def layout(self) -> Layout:
        """The sequence layout inputs must be sharded with: "zigzag" (ring) or "contiguous" (ulysses)."""
        return self._layout

    @property
    def cp_rank(self) -> int:
        return group_rank(self.group)

    @property
    def cp_size(self) -> int:
        return group_size(self.group)

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float | None = None,
        documents: DocumentLayout | None = None,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self._attention(
            q, k, v, self.group, scale=scale, documents=documents, window=window, softcap=softcap, sinks=sinks
        )

    def gather_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's (B, L / cp, ...) tokens -> the whole rows, differentiable (sparse indexed attention's
        exchange: parallel/gathered_keys.py)."""
        from longfit.parallel.gathered_keys import gather_tokens

        return gather_tokens(x, self.group, self._layout)

    def token_spans(self, seq_len: int) -> list[tuple[int, int]]:
        """The global [start, end) spans of a row of `seq_len` tokens this rank holds, in local order."""
        from longfit.parallel.sharding import shard_spans

        return shard_spans(seq_len, self.cp_rank, self.cp_size, self._layout)

    def tile_attention(self, batch: int, local_length: int, documents: DocumentLayout | None = None):
        """The per-tile attention of this method for a tiled decoder layer (longfit.parallel.tiled_attention)."""
        from longfit.parallel.tiled_attention import context_parallel_tile_attention

        return context_parallel_tile_attention(self.method, self.group, batch, local_length, documents)

    def __deepcopy__(self, memo: dict) -> "ContextParallelAttention":
        # A process group is a handle on live communicators and cannot be copied: a deep-copied model
        # shares the group (and so this callable) with the original.
        return self

    def __repr__(self) -> str:
        return f"ContextParallelAttention(method={self.method!r}, cp={self.cp_size})"
