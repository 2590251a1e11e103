"""Small collectives over an explicit process group; no-ops when the group is None or has one rank.

None means "no distributed run" here, not torch's "default group": callers hold their groups in a
`ParallelMesh`, which is all None on a single process, so the same code runs on 1 and N ranks.
Tensors must live where the group's backend communicates (CUDA for NCCL, CPU for gloo).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def group_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_rank(group)


def all_reduce_sum(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum over the group's ranks, in place; returns `tensor`."""
    if group_size(group) > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def all_reduce_max(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Element-wise maximum over the group's ranks, in place; returns `tensor`."""
    if group_size(group) > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor


def barrier(group: dist.ProcessGroup | None) -> None:
    if group_size(group) > 1:
        dist.barrier(group=group)
