"""`run_on_ranks`: real gloo ranks as forks of this process where that is safe (#52: a fresh interpreter spends
seconds importing torch and transformers again), fresh interpreters where it is not."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from longfit.check.ranks import can_fork, run_on_ranks

STATE = {"set by the test": None}


def _rank_sees(rank: int, world_size: int) -> tuple:
    """What a rank sees: a value the parent set after importing this module, and the sum of the ranks over gloo."""
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    return STATE["set by the test"], float(total)


def _fails_on_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("rank 1 refuses")
    dist.barrier()  # rank 0 waits here for the rank that failed: stopped, not waited for
    return rank


def test_ranks_are_forks_of_this_process(monkeypatch) -> None:
    monkeypatch.setitem(STATE, "set by the test", "the parent's value")
    assert can_fork()
    assert run_on_ranks(_rank_sees, 2) == [("the parent's value", 1.0)] * 2


def _torchrun_variables_seen(rank: int, world_size: int) -> dict:
    import os

    from longfit.launch import TORCHRUN_VARIABLES

    return {name: os.environ[name] for name in TORCHRUN_VARIABLES if name in os.environ}


def test_a_forked_rank_is_no_rank_of_the_parents_torchrun_job(monkeypatch) -> None:
    """As a fresh interpreter (#55): torchrun's variables of a parent that is one of its ranks are not the fork's."""
    for name, value in {"RANK": "3", "WORLD_SIZE": "8", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)
    assert run_on_ranks(_torchrun_variables_seen, 2) == [{}, {}]


def test_a_forked_rank_failure_is_raised_here_with_its_traceback() -> None:
    with pytest.raises(ValueError, match="rank 1 refuses") as raised:
        run_on_ranks(_fails_on_rank_one, 2)
    assert "process 1" in str(raised.value.__cause__) and "_fails_on_rank_one" in str(raised.value.__cause__)


def test_no_fork_while_another_thread_runs() -> None:
    """A lock another thread holds would stay held in a fork for ever: the ranks are fresh interpreters then."""
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
        assert not can_fork()
    finally:
        stop.set()
        thread.join()
    assert can_fork()


def test_a_progress_bars_monitor_thread_does_not_stop_forks(monkeypatch) -> None:
    """tqdm's monitor thread outlives every bar (transformers' loading of weights starts it): it is stopped, the ranks
    are still forks, and the next bar starts a new one."""
    import io

    import tqdm

    monkeypatch.setattr(tqdm.tqdm, "monitor_interval", 10)
    with tqdm.tqdm(total=1, file=io.StringIO()) as bar:
        bar.update()
    assert tqdm.tqdm.monitor is not None and tqdm.tqdm.monitor.is_alive()
    assert can_fork()
    assert not tqdm.tqdm.monitor.is_alive()
    with tqdm.tqdm(total=1, file=io.StringIO()):
        assert tqdm.tqdm.monitor.is_alive()


def _collects_garbage(rank: int, world_size: int) -> int:
    import gc

    gc.collect()
    return rank


def test_garbage_holding_native_threads_is_freed_before_the_forks(tmp_path, monkeypatch) -> None:
    """An unclosed PyAV container that decoded frames (transformers' `read_video_pyav` leaves one) frees its decoder's
    threads when the garbage collector clears its reference cycle: in a fork, which has none of them, that waited for
    ever. The parent collects it before forking, and the ranks finish (a hang would end at the shortened timeout)."""
    import gc

    import numpy as np

    import longfit.check.ranks as ranks

    av = pytest.importorskip("av")
    sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
    from video_qa import write_clip

    clip = write_clip(tmp_path / "clip.mp4", [np.full((48, 64, 3), 16 * i, dtype=np.uint8) for i in range(8)], 4)
    held = [av.open(str(clip))]
    for index, _ in enumerate(held[0].decode(video=0)):
        if index == 2:
            break
    gc.collect()  # the container, still held, moves to the oldest generation: a young collection leaves it
    held.clear()
    monkeypatch.setattr(ranks, "RANKS_TIMEOUT_S", 60)
    assert run_on_ranks(_collects_garbage, 2) == [0, 1]
