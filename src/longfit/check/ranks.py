"""Run a function on N real gloo ranks of this machine (forks of this process, or fresh interpreters of longfit's
own) and collect what each returns.

    results = run_on_ranks(worker, 2, arg)   # worker(rank, world_size, arg) -> picklable, a module-level function

The process group comes from a FileStore in a fresh temporary directory (no port to race for); each rank uses one
CPU thread; a failure on any rank re-raises its exception here, from that rank's traceback. Where forking is safe
(`can_fork`: no other Python thread, no process group, no CUDA context) the ranks are forks of this process: they
start with torch, transformers and longfit imported, where a fresh interpreter spends seconds of CPU importing them
again (#52). Else they are `longfit.launch.run_in_fresh_interpreters`' processes. Neither is multiprocessing's spawn,
so `longfit check` asked from a user's script (`apply_longfit` under torchrun) never runs that script again (#55).
`longfit check` runs its context-parallel step this way, and the test suite its distributed parity tests.
"""

from __future__ import annotations

import datetime
import gc
import os
import pickle
import signal
import sys
import tempfile
import threading
import time
import traceback
from typing import Any, Callable, NoReturn

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


def can_fork() -> bool:
    """Whether a fork of this process is a clean rank: no other Python thread (a lock it holds would stay held in the
    child), no process group (the child would inherit it and could not make its own) and no CUDA context (which does
    not survive a fork). tqdm's monitor thread, which any progress bar (transformers' loading of weights, datasets')
    leaves running for the life of the process, is stopped first (`_stop_progress_monitor`)."""
    import torch.distributed as dist

    _stop_progress_monitor()
    return (hasattr(os, "fork") and threading.active_count() == 1 and not torch.cuda.is_initialized()
            and not (dist.is_available() and dist.is_initialized()))


def _stop_progress_monitor() -> None:
    """Stop tqdm's monitor threads (`TMonitor`: one wakes every `monitor_interval` seconds to find stalled bars; each
    bar class that ran, `tqdm.auto`'s too, holds its own) where they run; tqdm starts a new one with its next bar (it
    checks `monitor.report()`, false once stopped)."""
    monitor_module = sys.modules.get("tqdm._monitor")
    if monitor_module is None:
        return
    for thread in threading.enumerate():
        if isinstance(thread, monitor_module.TMonitor):
            thread.exit()


def _forked_rank(rank: int, world_size: int, workdir: str, fn: Callable[..., Any], args: tuple) -> NoReturn:
    """A forked child: `_entry`, then its exit without the parent's exit handlers; what it raised, pickled with its
    traceback and the time it came into the workdir for the parent."""
    from longfit.launch import TORCHRUN_VARIABLES

    status, failed_at = 1, []

    def noting_failure(*call):  # its time, before leaving the process group makes the peers fail too
        try:
            return fn(*call)
        except BaseException:
            failed_at.append(time.time())
            raise

    try:
        for name in [n for n in os.environ if n in TORCHRUN_VARIABLES or n.startswith("TORCHELASTIC_")]:
            del os.environ[name]  # no rank of a torchrun job the parent may be one of (as a fresh interpreter's)
        _entry(rank, world_size, workdir, noting_failure, args)
        status = 0
    except BaseException as error:  # noqa: BLE001 -- every failure goes back to the parent, which raises it
        when, text = (failed_at or [time.time()])[0], traceback.format_exc()
        try:
            pickle.dumps(error)
        except Exception:  # noqa: BLE001 -- an exception that does not pickle: its text still goes back
            error = RuntimeError(text.strip().splitlines()[-1])
        with open(os.path.join(workdir, f"error{rank}.pkl"), "wb") as file:
            pickle.dump((when, error, text), file)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def _run_forked(workdir: str, fn: Callable[..., Any], world_size: int, args: tuple, what: str) -> None:
    """`_entry` on `world_size` forks of this process; raises as `run_in_fresh_interpreters` does."""
    from longfit.launch import ChildTraceback

    # Garbage is freed before the forks, where its threads run: an unreachable object whose finaliser joins native
    # threads (an unclosed PyAV container's decoder threads; transformers' `read_video_pyav` leaves one) would
    # otherwise be collected in a child, which has none of them, and wait for them for ever.
    gc.collect()
    children = []
    for rank in range(world_size):
        pid = os.fork()
        if pid == 0:
            _forked_rank(rank, world_size, workdir, fn, args)
        children.append(pid)
    statuses: dict[int, int] = {}
    deadline = time.monotonic() + RANKS_TIMEOUT_S
    try:
        while len(statuses) < world_size and not any(statuses.values()):  # a failed rank: the others may wait for it
            for pid in children:
                done, status = (0, 0) if pid in statuses else os.waitpid(pid, os.WNOHANG)
                if done == pid:
                    statuses[pid] = os.waitstatus_to_exitcode(status)
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} did not finish within {RANKS_TIMEOUT_S} s; its processes were stopped")
            time.sleep(0.02)
    finally:
        for pid in children:
            if pid not in statuses:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
    failures = []
    for rank in range(world_size):
        path = os.path.join(workdir, f"error{rank}.pkl")
        if os.path.exists(path):
            with open(path, "rb") as file:
                failures.append((*pickle.load(file), rank))
    if failures:  # the first failure is the cause; a peer's lost connection to it came after
        _, error, text, rank = min(failures, key=lambda failure: failure[0])
        raise error from ChildTraceback(f"{what}, process {rank}:\n{text}")
    for rank in range(world_size):
        if not os.path.exists(os.path.join(workdir, f"rank{rank}.pt")):
            raise RuntimeError(f"{what}: process {rank} ended with no result")


def run_on_ranks(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """`fn(rank, world_size, *args)` on `world_size` gloo ranks; the per-rank results, in rank order."""
    from longfit.launch import run_in_fresh_interpreters

    what = f"{getattr(fn, '__name__', fn)} on {world_size} gloo ranks"
    with tempfile.TemporaryDirectory(prefix="longfit-ranks-") as workdir:
        if can_fork():
            _run_forked(workdir, fn, world_size, args, what)
        else:
            run_in_fresh_interpreters(_entry, [(rank, world_size, workdir, fn, args) for rank in range(world_size)],
                                      what, RANKS_TIMEOUT_S)
        return [torch.load(os.path.join(workdir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
