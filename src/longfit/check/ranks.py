"""Run a function on N real gloo ranks of this machine (torch.multiprocessing spawn) and collect what each returns.

    results = run_on_ranks(worker, 2, arg)   # worker(rank, world_size, arg) -> picklable, a module-level function

The process group comes from a FileStore in a fresh temporary directory (no port to race for); each rank uses one
CPU thread; a failure on any rank re-raises here with that rank's traceback. `longfit check` runs its context-
parallel step this way, and the test suite its distributed parity tests.
"""

from __future__ import annotations

import datetime
import os
import tempfile
from typing import Any, Callable

import torch


def _entry(rank: int, world_size: int, workdir: str, fn: Callable[..., Any], args: tuple) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(workdir, 'store')}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=120))
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(workdir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_on_ranks(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """`fn(rank, world_size, *args)` on `world_size` gloo ranks; the per-rank results, in rank order."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="longfit-ranks-") as workdir:
        mp.spawn(_entry, args=(world_size, workdir, fn, args), nprocs=world_size, join=True)
        return [torch.load(os.path.join(workdir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
