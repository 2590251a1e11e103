"""Stopping a run on SIGINT (Ctrl-C) or SIGTERM (a scheduler): finish the step, checkpoint, exit 130 / 143.

The first signal is only recorded. After every step the ranks take the largest signal number any of
them recorded (one all-reduce of a scalar), so a signal that reached one rank stops all of them after
the same step; the trainer then writes that step's checkpoint and `longfit train` exits with 128 + the
signal number and the command that resumes. A second signal ends the process at once: the lock is
released, nothing more is written, and the last complete checkpoint is where the next run resumes.

A signal for which the program that runs the trainer set a Python handler of its own (the test suite's, which
stops pytest on the first Ctrl-C) stays that program's: the run is then stopped the program's way.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Callable

SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _set_by_the_program(handler) -> bool:
    """Whether `handler` is a Python handler that the running program installed, not Python's KeyboardInterrupt
    for SIGINT, the system's default or an inherited ignore (a background job), which the trainer replaces."""
    return callable(handler) and handler is not signal.default_int_handler


class StopOnSignal:
    """`with StopOnSignal(announce, on_exit) as stop:` ... `stop.signum` is the first signal received, or 0."""

    def __init__(self, announce: bool = True, on_exit: Callable[[], None] | None = None):
        self.announce = announce
        self.on_exit = on_exit
        self.signum = 0
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread():  # Python only lets the main thread set handlers
            for sig in SIGNALS:
                if not _set_by_the_program(signal.getsignal(sig)):
                    self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _say(self, text: str) -> None:
        # os.write, not print: the handler may interrupt a print on the same stream.
        if self.announce:
            os.write(2, f"\nlongfit: {text}\n".encode())

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if not self.signum:
            self.signum = signum
            self._say(f"{name} received: finishing this step, then saving a checkpoint ({name} again exits at once)")
            return
        self._say(f"{name} received again: exiting now without saving; the last complete checkpoint is kept")
        if self.on_exit is not None:
            self.on_exit()
        os._exit(128 + signum)

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
