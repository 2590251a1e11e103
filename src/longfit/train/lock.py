"""One run per output directory: OUTPUT_DIR/.lock, held for the whole run by rank 0.

The lock is an exclusive `flock` on the file, which the kernel drops when the process ends, however it
ends (kill -9 included); the file holds the holder's pid, host, start time and command for the
message a second run gets. A lock file that nobody holds is stale: it is taken over with a warning.
Where the file system has no flock, liveness falls back to the recorded pid on this host (a pid of
another host cannot be checked: the message says to delete the file if that run is gone).

Only rank 0 takes the lock: the other ranks of a torchrun job are started with it and trust it, and
rank 0's refusal reaches them through `rank_zero_decides`.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

import psutil

from longfit.config import ConfigError

LOCK_NAME = ".lock"


def _holder_text(holder: dict) -> str:
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("started", 0)))
    command = f" ({holder['command']})" if holder.get("command") else ""
    return f"pid {holder.get('pid')} on host {holder.get('host')}, started {started}{command}"


def _alive_here(holder: dict) -> bool:
    """Whether the recorded process still runs on this host (the same process: pids are reused)."""
    try:
        process = psutil.Process(int(holder["pid"]))
        return abs(process.create_time() - float(holder["process_start"])) < 1.0
    except (psutil.Error, KeyError, TypeError, ValueError):
        return False


class RunLock:
    """`acquire` creates output_dir and takes its lock, refusing one that is held; `release` gives it up.
    Also a context manager."""

    def __init__(self, output_dir: Path, log=print):
        self.path = output_dir / LOCK_NAME
        self.output_dir = output_dir
        self.log = log
        self.fd: int | None = None

    def acquire(self) -> None:
        try:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise ConfigError(f"output_dir={self.output_dir} cannot be written ({e.strerror}): choose a directory "
                              f"you can write to") from e
        try:
            previous = self._read(fd)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                self._refuse(previous)
            except OSError as e:  # no flock on this file system: judge by the recorded process
                if e.errno not in (errno.ENOLCK, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOSYS):
                    raise
                if previous and (previous.get("host") != socket.gethostname() or _alive_here(previous)):
                    self._refuse(previous)
            if os.fstat(fd).st_ino != os.stat(self.path).st_ino:  # released and removed while we waited
                os.close(fd)
                return self.acquire()
            if previous:
                self.log(f"warning: took over the stale lock of a run that is no longer running: {_holder_text(previous)}")
            me = psutil.Process()
            record = {
                "pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
                "process_start": me.create_time(), "command": " ".join(["longfit", *sys.argv[1:]]),
            }
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(record).encode(), 0)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def _read(self, fd: int) -> dict | None:
        text = os.pread(fd, 1 << 16, 0)
        if not text.strip():
            return None
        try:
            holder = json.loads(text)
        except ValueError:
            return {"pid": "?", "host": "?"}
        return holder if isinstance(holder, dict) else {"pid": "?", "host": "?"}

    def _refuse(self, holder: dict | None) -> None:
        raise ConfigError(
            f"output_dir={self.output_dir} is in use by another longfit run: {_holder_text(holder or {})}. Wait for "
            f"it to finish or stop it (Ctrl-C saves a checkpoint), or choose another output_dir. If that run is gone "
            f"(a machine that crashed), delete {self.path}."
        )

    def release(self) -> None:
        """Remove the lock file and drop the lock (also called from a signal handler before exiting)."""
        if self.fd is None:
            return
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
        os.close(self.fd)
        self.fd = None

    def __exit__(self, *exc) -> None:
        self.release()
