"""The CPU seconds each process of a run used while it was measured.

On a small machine the server's processes and the benchmark client share the cores the model
runs on, so a row's CPU budget says where the box's time went: the executor's forward passes,
or the gateway's streaming, kvmanager and the client preempting them (docs/benchmarks.md).
"""
from __future__ import annotations

import os
import time
from pathlib import Path

CLIENT = "client"  # the benchmark process itself (its event loop reads every stream)


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and its threads (Linux /proc; 10 ms ticks)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """``start()``, the measured work, then ``stop()``: CPU seconds per named process in between,
    the benchmark client's own under ``CLIENT``. A process that is gone or unreadable (not Linux)
    is left out rather than guessed."""

    def __init__(self, pids: dict[str, int]):
        self._pids = dict(pids)
        self._before: dict[str, float] = {}

    def start(self) -> None:
        self._before = self._read()

    def stop(self) -> dict[str, float]:
        after = self._read()
        return {name: after[name] - self._before[name] for name in after if name in self._before}

    def _read(self) -> dict[str, float]:
        seconds = {CLIENT: time.process_time()}
        for name, pid in self._pids.items():
            try:
                seconds[name] = process_cpu_seconds(pid)
            except (OSError, IndexError, ValueError):
                continue
        return seconds


def cpu_line(cpu_s: dict[str, float], wall_s: float, num_cpus: int) -> str:
    """``executor 14.10 s, gateway 1.30 s (of 2 CPUs x 8.1 s = 16.2 CPU s)``: the processes, busiest first."""
    shares = ", ".join(f"{name} {seconds:.2f} s" for name, seconds in sorted(cpu_s.items(), key=lambda kv: -kv[1]))
    return f"{shares} (of {num_cpus} CPUs x {wall_s:.1f} s = {num_cpus * wall_s:.1f} CPU s)"
