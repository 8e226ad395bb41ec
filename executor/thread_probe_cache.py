"""The ``--num-threads auto`` probe's results, kept in a file so a restart on the same machine skips it.

Why: the probe costs 1.5-3.5 s of every start, and replicas started at once on one machine
time their steps while the other loads or probes, so each measures the other's load (on 2
cores one replica timed 2 threads at 1,462 ms and the other at 412 ms, and they chose
differently). An entry is keyed by what decides the answer: the CPU's model name, the CPUs
this process may use, the torch version, and the model's fingerprint, precision and attention
backend. An exclusive lock beside the file is held from the lookup to the write, so of
replicas sharing the file (compose's ``models`` volume) one probes and the others wait and
read its answer. A file that cannot be read is probed over; one that cannot be written costs
only the saving (the executor probes and starts).
"""
from __future__ import annotations

import fcntl
import json
import os
import tempfile
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Iterator

from executor.threads import ThreadProbe
from kvserve.cpus import cpu_model_name, usable_cpus
from kvserve.logs import get_logger

log = get_logger("executor.threads")
FILE_VERSION = 1


@dataclass(frozen=True)
class ProbeKey:
    """What the fastest thread count depends on."""

    cpu: str
    cpus: int
    torch: str
    model_fingerprint: str
    precision: str
    attention_backend: str

    @classmethod
    def for_runner(cls, runner) -> "ProbeKey":
        import torch

        info = runner.info
        return cls(cpu_model_name(), usable_cpus(), torch.__version__, info.model_fingerprint, info.dtype,
                   info.attention_backend)

    def text(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


class ThreadProbeCache:
    """``thread-probes.json``: {"version": 1, "entries": {key: {"chosen", "decode_step_ms_by_threads",
    "measured_at"}}}."""

    def __init__(self, path: Path):
        self.path = path

    def chosen_or_probe(self, key: ProbeKey, probe: Callable[[], ThreadProbe | None]) -> tuple[int | None, bool]:
        """The cached count for ``key``, else ``probe()``'s choice, saved: (count, whether probed).
        None when the probe had nothing to choose (a GPU device)."""
        with self._locked():
            entries = self._read()
            entry = entries.get(key.text())
            if isinstance(entry, dict) and isinstance(entry.get("chosen"), int) and entry["chosen"] >= 1:
                return entry["chosen"], False
            result = probe()
            if result is None:
                return None, True
            entries[key.text()] = {"chosen": result.chosen, "decode_step_ms_by_threads": result.summary(),
                                   "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}
            self._write(entries)
            return result.chosen, True

    @contextmanager
    def _locked(self) -> Iterator[None]:
        lock_path = self.path.with_name(self.path.name + ".lock")
        try:
            lock_path.parent.mkdir(parents=True, exist_ok=True)
            lock = open(lock_path, "a")
        except OSError as exc:
            log.warning("thread_probe_cache_unusable", path=str(lock_path), error=str(exc))
            yield
            return
        with lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX)
            except OSError as exc:  # a file system without locks: probes may overlap, nothing worse
                log.warning("thread_probe_cache_unlocked", path=str(lock_path), error=str(exc))
            yield

    def _read(self) -> dict:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            log.warning("thread_probe_cache_unreadable", path=str(self.path), error=str(exc))
            return {}
        if not isinstance(data, dict) or data.get("version") != FILE_VERSION or not isinstance(data.get("entries"), dict):
            return {}
        return data["entries"]

    def _write(self, entries: dict) -> None:
        """Whole or not at all: a reader never sees half a file."""
        try:
            handle, temporary = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name, suffix=".tmp")
        except OSError as exc:
            log.warning("thread_probe_cache_unwritable", path=str(self.path), error=str(exc))
            return
        try:
            with os.fdopen(handle, "w") as out:
                json.dump({"version": FILE_VERSION, "entries": entries}, out, indent=1, sort_keys=True)
            os.replace(temporary, self.path)
        except OSError as exc:
            Path(temporary).unlink(missing_ok=True)
            log.warning("thread_probe_cache_unwritable", path=str(self.path), error=str(exc))
