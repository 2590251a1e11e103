"""Run a function on N real gloo ranks (torch.multiprocessing spawn) and collect what each returns.

    from parallel_harness import run_distributed
    results = run_distributed(worker, 4, arg1, arg2)   # worker(rank, world_size, arg1, arg2) -> picklable

`worker` must be a module-level function (spawned children import it by module name). The process
group is initialised from a FileStore in a fresh temporary directory (no ports to race for), each
rank uses one CPU thread, and a failure on any rank re-raises here with the child's traceback.
"""

from __future__ import annotations

import datetime
import os
import tempfile
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, world_size: int, workdir: str, fn: Callable[..., Any], args: tuple) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{os.path.join(workdir, 'store')}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=120),
    )
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(workdir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """Call `fn(rank, world_size, *args)` on `world_size` gloo ranks; return the per-rank results."""
    with tempfile.TemporaryDirectory(prefix="longfit-dist-") as workdir:
        mp.spawn(_entry, args=(world_size, workdir, fn, args), nprocs=world_size, join=True)
        return [torch.load(os.path.join(workdir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
