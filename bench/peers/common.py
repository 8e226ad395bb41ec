"""What the peers share: the cache folder, CPU facts, venvs, ports, skip reasons, row labels."""
from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from kvserve.paths import cache_dir


class PeerUnavailable(Exception):
    """A peer cannot be set up or run here; the message is the reason printed with the skip."""


class PeerCrashed(PeerUnavailable):
    """A peer's process was ended by a signal (``signal_name``: "SIGFPE", ...)."""

    def __init__(self, message: str, signal_name: str):
        super().__init__(message)
        self.signal_name = signal_name


def peers_dir() -> Path:
    """``~/.cache/kvserve/peers`` (or under ``$KVSERVE_CACHE_DIR``): builds, venvs, exported models."""
    return cache_dir() / "peers"


def setup_allowed() -> bool:
    """Building or installing a peer never happens under pytest (``make test``), nor when
    ``KVSERVE_BENCH_NO_PEER_SETUP`` is set: then only what is already cached is used."""
    return "PYTEST_CURRENT_TEST" not in os.environ and not os.environ.get("KVSERVE_BENCH_NO_PEER_SETUP")


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The ``flags`` of the first processor in /proc/cpuinfo (empty where there is none)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):  # x86 / arm64
            return set(value.split())
    return set()


def cpu_flags_hash(flags: set[str]) -> str:
    """A short stable name for a CPU feature set: a binary built for one is cached under it."""
    return hashlib.sha256(" ".join(sorted(flags)).encode()).hexdigest()[:12]


def amx_workaround_flags(flags: set[str]) -> list[str]:
    """Compiler flags that keep AMX out of a native build: llama.cpp's Q4 path dies with
    SIGILL on AMX CPUs otherwise (``-march=native`` turns the AMX intrinsics on)."""
    if "amx_tile" in flags:
        return ["-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16"]
    return []


def lscpu_text() -> str:
    """``lscpu`` output, or /proc/cpuinfo's first processor where lscpu is missing."""
    if shutil.which("lscpu"):
        try:
            return subprocess.run(["lscpu"], capture_output=True, text=True, timeout=20,
                                  env={**os.environ, "LC_ALL": "C"}).stdout
        except (OSError, subprocess.SubprocessError):
            pass
    try:
        return Path("/proc/cpuinfo").read_text().split("\n\n")[0] + "\n"
    except OSError:
        return "no lscpu and no /proc/cpuinfo\n"


def lscpu_summary(text: str) -> dict:
    """The lines of ``lscpu`` a reader of the table needs."""
    wanted = ("Model name", "Architecture", "CPU(s)", "Thread(s) per core", "Core(s) per socket", "Socket(s)",
              "L2 cache", "L3 cache", "NUMA node(s)", "Hypervisor vendor")
    out = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in wanted and key.strip() not in out:
            out[key.strip()] = value.strip()
    return out


def write_lscpu(out_dir: Path) -> dict:
    """Writes ``lscpu.txt`` into the results folder; returns its summary."""
    text = lscpu_text()
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "lscpu.txt").write_text(text)
    return lscpu_summary(text)


def nice_prefix(level: int = 10) -> list[str]:
    """``nice -n level`` where there is a nice: set-up work yields the CPU to whatever else runs."""
    return ["nice", "-n", str(level)] if shutil.which("nice") else []


def run_logged(cmd: list[str], log_path: Path, *, cwd: Path | None = None, env: dict | None = None,
               timeout: float | None = None) -> None:
    """Runs ``cmd`` with its output appended to ``log_path``; a failure raises PeerUnavailable
    quoting the log's last lines."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        log.write(("\n$ " + " ".join(map(str, cmd)) + "\n").encode())
        log.flush()
        try:
            code = subprocess.run(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, timeout=timeout).returncode
        except FileNotFoundError as exc:
            raise PeerUnavailable(f"{cmd[0]} not found ({exc})") from None
        except subprocess.TimeoutExpired:
            raise PeerUnavailable(f"{' '.join(map(str, cmd[:3]))} ... timed out after {timeout:.0f} s "
                                  f"(log: {log_path})") from None
    if code != 0:
        tail = log_path.read_text(errors="replace").strip().splitlines()[-6:]
        message = (f"{' '.join(map(str, cmd[:4]))} ... exited with {exit_status(code)} (log: {log_path}): "
                   + " | ".join(tail)[-600:])
        if code < 0:
            raise PeerCrashed(message, signal_name(-code))
        raise PeerUnavailable(message)


def exit_status(code: int) -> str:
    """A process's return code as read: ``3``, or ``-8 (SIGFPE)`` for one a signal ended."""
    return str(code) if code >= 0 else f"{code} ({signal_name(-code)})"


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def ensure_venv(path: Path, packages: list[str], log_path: Path, *, first: list[str] = (),
                remove: list[str] = (), log=print) -> Path:
    """A venv at ``path`` holding ``packages`` (``first`` installed before them, e.g. a CPU torch
    so nothing pulls a CUDA build; ``remove`` uninstalled after them); returns its python.
    Installs once (a stamp records what)."""
    python = path / "bin" / "python"
    stamp = path / ".kvserve-peer-installed"
    wanted = "\n".join([*first, "--", *packages, *(["-- remove", *remove] if remove else [])])
    if python.exists() and stamp.exists() and stamp.read_text() == wanted:
        return python
    if not setup_allowed():
        raise PeerUnavailable(f"{path} is not set up and peer set-up is off here (pytest or "
                              "KVSERVE_BENCH_NO_PEER_SETUP)")
    log(f"   installing {' '.join([*first, *packages])} into {path} (once; log: {log_path})")
    started = time.perf_counter()
    if not python.exists():
        run_logged([sys.executable, "-m", "venv", str(path)], log_path)
    pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    if first:
        run_logged([*pip, *first], log_path, timeout=3600)
    # the constraint keeps whatever ``first`` pinned (torch) from being swapped for another build
    constraints = path / "constraints.txt"
    constraints.write_text("\n".join(first) + "\n")
    run_logged([*pip, "-c", str(constraints), *packages], log_path, timeout=3600)
    if remove:
        run_logged([str(python), "-m", "pip", "uninstall", "--disable-pip-version-check", "-q", "-y", *remove],
                   log_path)
    stamp.write_text(wanted)
    log(f"   installed in {time.perf_counter() - started:.0f} s")
    return python


def label(name: str, *, weights: str, weight_bits: int | None, threads: int, kv_budget: str,
          transport: str) -> dict:
    """The row fields every system states beside its numbers."""
    return {"system": name, "weights": weights, "weight_bits": weight_bits, "threads": threads,
            "kv_budget": kv_budget, "transport": transport}
