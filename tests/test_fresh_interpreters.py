"""`longfit.launch.run_in_fresh_interpreters`: what longfit runs in processes of its own inside another program (the
preflight's traces on a rank, `longfit check`'s gloo ranks) never runs that program's script again (#55), keeps
nothing of torchrun's environment, and ends with a line naming what it was doing instead of hanging."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from longfit.config import ConfigError
from longfit.launch import TORCHRUN_VARIABLES, run_in_fresh_interpreters


def environment_seen(name: str) -> str | None:
    return os.environ.get(name)


def refuse(message: str) -> None:
    raise ConfigError(message)


def sleep(seconds: float, marker: str) -> None:
    with open(marker, "w") as file:
        file.write(str(os.getpid()))
    time.sleep(seconds)


def refuse_or_wait(index: int) -> None:
    if index == 0:
        raise ConfigError("rank 0 refused")
    time.sleep(600)  # as a peer waiting for rank 0 in a collective


def test_a_child_that_raises_stops_the_others_at_once():
    """mp.spawn's behaviour, kept: a rank that raised is not waited on beside peers that wait for it (a child that
    raised exits non-zero, and the others are stopped), so the error comes back long before the time limit."""
    start = time.monotonic()
    with pytest.raises(ConfigError, match="rank 0 refused"):
        run_in_fresh_interpreters(refuse_or_wait, [(0,), (1,)], "refusing", 120)
    assert time.monotonic() - start < 60


def test_each_call_runs_once_in_order_without_torchrun_variables(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("LONGFIT_TEST_KEPT", "kept")
    names = [*TORCHRUN_VARIABLES[:2], "TORCHELASTIC_RUN_ID", "LONGFIT_TEST_KEPT"]
    assert run_in_fresh_interpreters(environment_seen, [(name,) for name in names], "reading", 60) == [
        None, None, None, "kept"]


def test_a_child_s_exception_is_raised_here_from_its_traceback():
    with pytest.raises(ConfigError, match="no such setting") as raised:
        run_in_fresh_interpreters(refuse, [("no such setting",)], "refusing", 60)
    assert "Traceback" in str(raised.value.__cause__) and "refuse" in str(raised.value.__cause__)


def test_a_child_past_its_time_is_stopped_and_named(tmp_path):
    marker = tmp_path / "pid"
    with pytest.raises(TimeoutError, match="sleeping did not finish within 5 s"):
        run_in_fresh_interpreters(sleep, [(600.0, str(marker))], "sleeping", 5)
    pid = int(marker.read_text())
    with pytest.raises(ProcessLookupError):  # stopped and reaped, not left behind
        os.kill(pid, 0)


def test_a_script_without_a_main_guard_runs_once(tmp_path):
    """A user's script without `if __name__ == "__main__":` that asks longfit for work in other processes: it runs
    once (multiprocessing's spawn ran it again in each child)."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(f"""
        import os
        import sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_fresh_interpreters import environment_seen
        from longfit.launch import run_in_fresh_interpreters
        with open({str(tmp_path / "runs")!r}, "a") as file:
            file.write("ran\\n")
        print(run_in_fresh_interpreters(environment_seen, [("HOME",), ("HOME",)], "reading", 60))
    """))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "runs").read_text() == "ran\n"
