"""Progress of a stretch that takes more than a few seconds (the training steps, a retrieval evaluation), on stderr.

On a terminal: a tqdm bar, redrawn in place. Anywhere else (a log file, a pipe, `tee`): plain lines, one every
`every` units and one when the stretch ends, each with the time so far and the ETA, because a bar's carriage
returns make a log one line of redraws (20 KB for 40 steps). The lowest layer that shows progress owns it, so
that models, eval and train all reach it.
"""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager


def progress(total: int, what: str, unit: str, every: int = 1, initial: int = 0, enabled: bool = True):
    """A progress display with tqdm's `update(n)`, `set_postfix_str(text)` and `close()`: `what n/total unit`, the
    time so far, the ETA and the postfix. `enabled` False (ranks other than 0) shows nothing."""
    from tqdm import tqdm

    if enabled and not sys.stderr.isatty():
        return ProgressLines(total, what, unit, every, initial)
    return tqdm(total=total, initial=initial, disable=not enabled, dynamic_ncols=True, file=sys.stderr,
                bar_format=f"{what} {{n_fmt}}/{{total_fmt}} {unit} |{{bar}}| {{elapsed}}, ETA {{remaining}}{{postfix}}")


class ProgressLines:
    """The bar as lines (see the module docstring); the ETA assumes the remaining units take as long as those done."""

    def __init__(self, total: int, what: str, unit: str, every: int, initial: int):
        self.total, self.what, self.unit, self.every = total, what, unit, every
        self.n = self.shown = self.initial = initial
        self.postfix = ""
        self.started = time.perf_counter()

    def set_postfix_str(self, text: str) -> None:
        self.postfix = text

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.n % self.every == 0 or self.n == self.total:
            self._line()

    def close(self) -> None:
        if self.n != self.shown:  # stopped between two lines: say where
            self._line()

    def _line(self) -> None:
        from tqdm import tqdm

        elapsed = time.perf_counter() - self.started
        done = self.n - self.initial
        eta = tqdm.format_interval(elapsed / done * (self.total - self.n)) if done else "?"
        print(f"{self.what} {self.n}/{self.total} {self.unit} | {tqdm.format_interval(elapsed)}, ETA {eta}"
              + (f", {self.postfix}" if self.postfix else ""), file=sys.stderr, flush=True)
        self.shown = self.n


@contextmanager
def without_library_bars():
    """transformers' own bars (one per shard written) would put carriage returns among longfit's output."""
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            hf_logging.enable_progress_bar()


@contextmanager
def announced(what: str):
    """`what ...` before a stretch that shows no progress of its own, and how long it took after, on stderr, by the
    main process alone (rank 0 of a process group)."""
    import torch.distributed as dist

    main = not dist.is_initialized() or dist.get_rank() == 0
    if main:
        print(f"{what} ...", file=sys.stderr, flush=True)
    started = time.perf_counter()
    yield
    if main:
        print(f"{what}: done in {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
