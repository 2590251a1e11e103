"""Run a function on N real gloo ranks (torch.multiprocessing spawn) and collect what each returns.

    from parallel_harness import run_distributed
    results = run_distributed(worker, 4, arg1, arg2)   # worker(rank, world_size, arg1, arg2) -> picklable

`worker` must be a module-level function (spawned children import it by module name). The spawning is
`longfit.check.ranks.run_on_ranks`, the one `longfit check` uses: the process group from a FileStore in a
fresh temporary directory (no ports to race for), one CPU thread per rank, and a failure on any rank
re-raised here with the child's traceback.
"""

from __future__ import annotations

from longfit.check.ranks import run_on_ranks as run_distributed

__all__ = ["run_distributed"]
