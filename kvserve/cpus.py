"""How many CPUs this process may use, and the thread counts worth trying on them.

Shared by the executor's ``--num-threads auto`` probe (executor/threads.py) and the benchmarks'
thread sweeps (bench/), which must not import torch to know it.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")
CPUINFO = Path("/proc/cpuinfo")


def cpu_model_name(cpuinfo: Path = CPUINFO) -> str:
    """The first CPU's model name with its family, model and stepping (Linux; a hypervisor may
    report one name, "AMD EPYC", for CPUs generations apart), else the platform's processor string."""
    fields: dict[str, str] = {}
    try:
        for line in cpuinfo.read_text().splitlines():
            name, _, value = line.partition(":")
            if not name.strip():
                break  # the first processor's block ends at its blank line
            fields.setdefault(name.strip(), value.strip())
    except OSError:
        pass
    if "model name" in fields:
        return "{} (family {} model {} stepping {})".format(
            fields["model name"], *(fields.get(key, "?") for key in ("cpu family", "model", "stepping")))
    import platform

    return platform.processor() or platform.machine()


def cgroup_cpu_limit(cpu_max: Path = CGROUP_CPU_MAX) -> int | None:
    """CPUs the cgroup's quota allows (cgroup v2 ``cpu.max``: "QUOTA PERIOD", or "max"), rounded up."""
    try:
        quota, period = cpu_max.read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    try:
        return max(1, math.ceil(int(quota) / int(period)))
    except (ValueError, ZeroDivisionError):
        return None


def usable_cpus(cpu_max: Path = CGROUP_CPU_MAX) -> int:
    """CPUs this process may run on: its affinity mask, capped by its cgroup's CPU quota."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    limit = cgroup_cpu_limit(cpu_max)
    return max(1, min(cpus, limit) if limit else cpus)


def thread_counts_to_try(cpus: int) -> list[int]:
    """1, the powers of two below ``cpus``, and ``cpus``."""
    counts, count = {1, max(1, cpus)}, 2
    while count < cpus:
        counts.add(count)
        count *= 2
    return sorted(counts)
