"""The vision side's work spread over the ranks that hold the same rows: the cp ranks, and the tp ranks (#54).

Every cp rank of a dp group holds the same rows, so the same images, and every tp rank of a cp rank the same tokens.
Instead of each rank running the tower on all of them, the images are dealt out over those cp x tp ranks
(`ParallelMesh.rows_group`; `deal`: greedily by patch count, the largest first to the least loaded rank, the same
answer on every rank from the batch's grids alone), each rank runs the tower on its own, and the embeddings are
exchanged (`_GatherImages`: one all-gather of the padded pieces). Each rank then places in its sequence shard (under
tp its tp rank's slice of it) the embeddings its tokens need (`MediaBatch.embedding_index`, cut with the tokens).

Exact, gradients included: the tower's attention never crosses two images, so an image's embeddings do not depend on
which others run beside it; the all-gather's backward sums every rank's gradient of every image's embeddings
(all-reduce), each rank's loss through its tokens, and hands each rank those of its own images, so the tower's
gradients on a rank are those of the whole rows' loss through its images, and their sum over the ranks that of every
image. Over the cp ranks FSDP2's reduction makes that sum; over the tp ranks the tower's weights are replicated
DTensors whose gradients are Partial sums (`longfit.parallel.tp.replicate_media`), summed by DTensor before FSDP2
sees them, as tp's other replicated weights.

With fewer images than ranks a rank would run nothing and hold no gradient for the tower while the others do; then
every rank runs every image (the gradient of its own loss through all of them, summed over the ranks as well).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from longfit.parallel.comm import group_rank, group_size


def deal(patches: list[int], ranks: int) -> list[list[int]]:
    """Image indices per rank, each rank's in increasing order: the largest image first to the least loaded rank
    (ties: the lower rank), so the ranks' patch counts stay within one image of each other."""
    load = [0] * ranks
    dealt: list[list[int]] = [[] for _ in range(ranks)]
    for index in sorted(range(len(patches)), key=lambda i: (-patches[i], i)):
        rank = min(range(ranks), key=lambda r: (load[r], r))
        load[rank] += patches[index]
        dealt[rank].append(index)
    return [sorted(indices) for indices in dealt]


def rank_inputs(patches: list[int], ranks: int) -> list[list[int]]:
    """Each rank's inputs (indices into `patches`, each input's work): dealt (`deal`), or with fewer inputs than
    ranks all of them on every rank (module docstring)."""
    return [list(range(len(patches)))] * ranks if len(patches) < ranks else deal(patches, ranks)


class _GatherImages(torch.autograd.Function):
    """Every rank's image embeddings (n_r, H) -> all of them (N, H) in image order; backward: the summed gradient
    of this rank's rows."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, rows: list[list[int]], total: int, group) -> torch.Tensor:
        widest = max(len(r) for r in rows)
        padded = local.new_zeros(widest, local.shape[1])  # (n_max, H)
        padded[: local.shape[0]] = local
        pieces = [torch.empty_like(padded) for _ in rows]
        dist.all_gather(pieces, padded.contiguous(), group=group)
        out = local.new_empty(total, local.shape[1])  # (N, H)
        for piece, indices in zip(pieces, rows):
            out[indices] = piece[: len(indices)]
        ctx.group, ctx.own = group, rows[group_rank(group)]
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.own], None, None, None


class DealtMedia:
    """`(encoder, pixel_values, grid_thw) -> embeddings (N, H)` of every image of the batch, the tower's work dealt
    over `group`, the ranks holding the same rows (`ParallelMesh.rows_group`, module docstring); set on
    `CausalLMLoss.media_features` by `parallelize`."""

    def __init__(self, group):
        self.group = group

    def __call__(self, encoder, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        ranks = group_size(self.group)
        patches = encoder.pixel_rows(grid_thw)  # the tower's work of each image
        dealt = rank_inputs(patches, ranks)
        if all(own == dealt[0] for own in dealt):  # every rank runs every image: nothing to exchange
            return encoder.features(pixel_values, grid_thw)
        tokens = encoder.image_tokens(grid_thw)
        patch_starts = [0, *torch.tensor(patches).cumsum(0).tolist()]
        token_starts = [0, *torch.tensor(tokens).cumsum(0).tolist()]
        own = dealt[group_rank(self.group)]
        local = encoder.features(torch.cat([pixel_values[patch_starts[i] : patch_starts[i + 1]] for i in own]),
                                 grid_thw[own])  # (n_r, H)
        rows = [[t for i in indices for t in range(token_starts[i], token_starts[i + 1])] for indices in dealt]
        return _GatherImages.apply(local, rows, token_starts[-1], self.group)

    def __deepcopy__(self, memo: dict) -> "DealtMedia":
        return self  # a process group cannot be copied (ContextParallelAttention's reason)
