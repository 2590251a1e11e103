"""Record every attempt of Python code to reach another machine, and refuse it.

`block_network(record)` replaces socket connections and host name lookups: a TCP/UDP connection to, or a
lookup of, anything but this machine (loopback, its own host name) calls `record(what)` and fails with
OSError, as an unplugged network would; unix sockets and local connections go through. The caller
gets to see attempts that the library catches and hides (peft turns a failed hub lookup into a warning).

In a subprocess: `python -c GUARDED_MAIN ARGS...` runs `python -m longfit ARGS...` with the guard in place
and appends each attempt as one line to the file named by $LONGFIT_TEST_NETWORK_LOG.
"""

from __future__ import annotations

import os
import socket
from typing import Callable

GUARDED_MAIN = (
    "import runpy, sys; import network_guard; network_guard.block_network(network_guard.append_to_log); "
    "sys.argv[0] = 'longfit'; runpy.run_module('longfit', run_name='__main__', alter_sys=True)"
)


def _local(host) -> bool:
    if host is None:
        return True
    host = host.decode() if isinstance(host, bytes) else str(host)
    return host in ("", "localhost", "::1", "0.0.0.0", socket.gethostname()) or host.startswith("127.")


def block_network(record: Callable[[str], None], setattr=setattr) -> None:
    """Install the guard; pass pytest's `monkeypatch.setattr` to have it removed after the test."""
    connect, connect_ex, getaddrinfo = socket.socket.connect, socket.socket.connect_ex, socket.getaddrinfo

    def refuse(what: str) -> OSError:
        record(what)
        return OSError(f"network access blocked by the test: {what}")

    def guarded_connect(self, address):
        if self.family in (socket.AF_INET, socket.AF_INET6) and not _local(address[0]):
            raise refuse(f"connect to {address}")
        return connect(self, address)

    def guarded_connect_ex(self, address):
        if self.family in (socket.AF_INET, socket.AF_INET6) and not _local(address[0]):
            raise refuse(f"connect to {address}")
        return connect_ex(self, address)

    def guarded_getaddrinfo(host, *args, **kwargs):
        if not _local(host):
            record(f"look up {host}")
            raise socket.gaierror(socket.EAI_NONAME, f"name lookup blocked by the test: {host}")
        return getaddrinfo(host, *args, **kwargs)

    setattr(socket.socket, "connect", guarded_connect)
    setattr(socket.socket, "connect_ex", guarded_connect_ex)
    setattr(socket, "getaddrinfo", guarded_getaddrinfo)


def append_to_log(what: str) -> None:
    with open(os.environ["LONGFIT_TEST_NETWORK_LOG"], "a") as log:
        log.write(what + "\n")
