"""Run a function on N real gloo ranks of this machine (fresh interpreters of longfit's own) and collect what each
returns.

    results = run_on_ranks(worker, 2, arg)   # worker(rank, world_size, arg) -> picklable, a module-level function

The process group comes from a FileStore in a fresh temporary directory (no port to race for); each rank uses one
CPU thread; a failure on any rank re-raises its exception here, from that rank's traceback. The ranks are
`longfit.launch.run_in_fresh_interpreters`' processes, not multiprocessing's spawn, so that `longfit check` asked
from a user's script (`apply_longfit` under torchrun) never runs that script again (#55). `longfit check` runs its
context-parallel step this way, and the test suite its distributed parity tests.
"""

from __future__ import annotations

import datetime
import os
import tempfile
from typing import Any, Callable

import torch

RANKS_TIMEOUT_S = 1800
"""The longest the ranks of one call may take: the test suite's longest parity runs take minutes; a hang ends here
(a collective that waits for a dead peer ends sooner, at the process group's 120 s)."""


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
    from longfit.launch import run_in_fresh_interpreters

    with tempfile.TemporaryDirectory(prefix="longfit-ranks-") as workdir:
        run_in_fresh_interpreters(_entry, [(rank, world_size, workdir, fn, args) for rank in range(world_size)],
                                  f"{getattr(fn, '__name__', fn)} on {world_size} gloo ranks", RANKS_TIMEOUT_S)
        return [torch.load(os.path.join(workdir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
