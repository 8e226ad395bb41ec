"""Loopback ports for the services the tests start, picked where nothing else takes them.

A port the OS hands out for ``bind(("127.0.0.1", 0))`` comes from its ephemeral range, the range
every outgoing connection's source port comes from too. A test picks a port, closes it, and its
executor binds it seconds later, after loading its model; meanwhile a client connection of this
or another xdist worker can take it as its source port, and the executor cannot listen
("Address already in use"). These ports lie below the ephemeral range,
where no outgoing connection's source port falls, each xdist worker in a window of its own, in
turn: a worker does not pick the same port twice while an earlier pick may still be waiting for
its service to bind it.
"""
from __future__ import annotations

import itertools
import os
import socket
from pathlib import Path

from kvserve.ports import free_port as kernel_free_port

WINDOW = 1000  # ports per xdist worker
FIRST_PORT = 10000  # below the ephemeral range (Linux: 32768-60999 by default), above well-known services


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for source ports (Linux), or IANA's dynamic range elsewhere."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 49152, 65535


def worker_index() -> int:
    """This pytest-xdist worker's number (``gw3`` → 3); 0 outside xdist."""
    name = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    return int(name[2:]) if name.startswith("gw") and name[2:].isdigit() else 0


def bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class PortPicker:
    """The next free port of one window, in turn."""

    def __init__(self, start: int, size: int):
        self.start, self.size = start, size
        self._offsets = itertools.count()

    def __call__(self) -> int:
        for _ in range(self.size):
            port = self.start + next(self._offsets) % self.size
            if bindable(port):
                return port
        raise RuntimeError(f"no free port in {self.start}-{self.start + self.size - 1}")

    @classmethod
    def for_this_worker(cls) -> "PortPicker | None":
        """This worker's window, or None where it would reach into the ephemeral range."""
        start = FIRST_PORT + worker_index() * WINDOW
        return cls(start, WINDOW) if start + WINDOW <= ephemeral_range()[0] else None


# One picker a process: import this module as ``loopback_ports`` only (tests/ is on sys.path), never as
# ``tests.loopback_ports``, which would be a second module with a second picker handing out the same ports.
free_port = PortPicker.for_this_worker() or kernel_free_port
