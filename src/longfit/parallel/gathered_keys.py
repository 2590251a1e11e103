"""The exchange of sparse indexed attention under context parallelism (#57): every rank all-gathers the latent keys
and the index keys of the whole rows; its own queries then select and attend among them (models/sparse_attention.py).

Why an all-gather and not the ring or Ulysses: a query's selected keys are anywhere before it, so every rank needs
every earlier key of its documents, and MLA's keys are small where they are shared. A token's latent key is
kv_lora_rank + qk_rope_head_dim values for all heads (DeepSeek-V3.2 and GLM-5: 512 + 64 = 576; 1,152 bytes in bf16)
and its index key index_head_dim (128) values in fp32, as the indexer scores it (512 bytes): 1,664 bytes, gathered
once per layer. The ring would pass the expanded keys and values, H x (qk_nope + qk_rope + v) per token (128 x
(128 + 64 + 128) = 40,960 values, 81,920 bytes in bf16: 49x more), and Ulysses' all-to-alls move the expanded q, k,
v and output of a token's heads; neither keeps the latent form. So a layer's forward receives (cp - 1) / cp x L x
1,664 bytes per rank (B = 1; 128K tokens at cp = 2: 104 MiB) and holds the gathered keys (208 MiB), and its
backward all-reduces the latents' gradient
(L x 576 values in the keys' dtype; the index keys have none, the indexer taking no gradient, but under
train.indexer_loss: then L x 128 values more). Memory stays linear
in L: the gathered keys are O(L), never O(L^2).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from longfit.parallel.comm import all_reduce_sum, group_rank, group_size
from longfit.parallel.sharding import Layout, gather_sequence, shard_sequence


class GatheredTokens(torch.autograd.Function):
    """(B, L / cp, ...) this rank's tokens -> (B, L, ...) every rank's, in row order; the backward sums the gradient
    of the whole rows over the ranks (each rank's queries reach every rank's keys) and keeps this rank's tokens."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None, layout: Layout):
        ctx.group, ctx.layout = group, layout
        return gather_sequence(x, 1, group, layout)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        total = all_reduce_sum(grad.contiguous().clone(), ctx.group)
        return shard_sequence(total, 1, group_rank(ctx.group), group_size(ctx.group), ctx.layout), None, None


def gather_tokens(x: torch.Tensor, group: dist.ProcessGroup | None, layout: Layout) -> torch.Tensor:
    """`GatheredTokens`: this rank's (B, L / cp, ...) tokens -> the whole rows, differentiable."""
    if group_size(group) == 1:
        return x
    return GatheredTokens.apply(x, group, layout)
