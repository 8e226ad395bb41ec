"""How much more memory this process can take on its host: the kernel's estimate (``MemAvailable``)
or, in a cgroup with a memory limit (a container, a pod), what the limits of its cgroup and of the
cgroups above it leave, whichever is less.

The CPU KV cache is a lazily faulted mapping (``zeroed_cache``): a cache larger than this would start
fine and be killed for memory once traffic had written enough of it; ``size_kv_cache`` refuses it.
"""
from __future__ import annotations

from pathlib import Path

# cgroup v1 reports "no limit" as a page-rounded LONG_MAX.
_NO_LIMIT = 1 << 60


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # cgroup v2 writes "max" for no limit


def _mem_available(proc: Path) -> int | None:
    try:
        lines = (proc / "meminfo").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) << 10
    return None


def _cgroup_room(limit_file: Path, usage_file: Path) -> int | None:
    limit = _read_int(limit_file)
    if limit is None or limit >= _NO_LIMIT:
        return None
    return max(limit - (_read_int(usage_file) or 0), 0)


def _cgroup_rooms(proc: Path, cgroup_root: Path) -> list[int]:
    """What each limit this process's cgroups set leaves: v2 (``0::/path``) the cgroup and every one
    above it, v1 the memory controller's cgroup."""
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return []
    rooms = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            directory = cgroup_root / path.lstrip("/")
            for group in (directory, *directory.parents):
                if group == cgroup_root.parent:
                    break
                rooms.append(_cgroup_room(group / "memory.max", group / "memory.current"))
        elif "memory" in controllers.split(","):
            directory = cgroup_root / "memory" / path.lstrip("/")
            rooms.append(_cgroup_room(directory / "memory.limit_in_bytes", directory / "memory.usage_in_bytes"))
    return [room for room in rooms if room is not None]


def available_bytes(proc: Path = Path("/proc"), cgroup_root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """The bytes this process can still take; None where the host does not say (not Linux)."""
    known = [b for b in (_mem_available(proc), *_cgroup_rooms(proc, cgroup_root)) if b is not None]
    return min(known) if known else None
