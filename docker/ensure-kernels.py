#!/usr/bin/env python3
"""Container wrapper: makes sure the compiled kernels exist for this machine, saying so in the
log when it has to compile them, then runs the given command in its place.

    kvserve-ensure-kernels -- python -m executor --port 50053

The image holds the CPU attention kernel prebuilt for the CPU it was built on
(``$KVSERVE_EXTENSIONS_DIR/cpu-<cpu features key>-<sources key>``, see csrc/build.py), stamped with
the digest of the sources and flags it was built from. On another CPU, or after an upgrade changed
the kernel sources (the stamp no longer matches), the executor would compile it at start (about
1-2 minutes, silently); this wrapper does it first and logs ``kernel_compile_started`` /
``kernel_compile_finished`` with the time taken. Where it cannot compile (no compiler: the
``runtime-slim`` image) it logs ``kernel_compile_failed`` and the executor falls back to plain
torch attention. ``$KVSERVE_ENSURE_KERNELS`` (or ``--kernels``) picks the kernels: ``cpu``
(default), ``cuda``, ``musa`` or ``none``, space- or comma-separated.

Compose mounts a volume at ``$KVSERVE_EXTENSIONS_DIR``; Docker fills it from the image the
first time, so a compile done here is kept for the next ``docker compose up``.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

APP = Path(os.environ.get("KVSERVE_APP_DIR", "/opt/kvserve/app"))


def log(event: str, level: str = "info", **fields) -> None:
    """One JSON line, shaped like the services' structlog output."""
    record = {"event": event, "level": level, "logger": "kvserve.ensure_kernels",
              "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(), **fields}
    print(json.dumps(record), flush=True)


def build_script():
    path = APP / "csrc" / "build.py"
    spec = importlib.util.spec_from_file_location("kvserve_csrc_build", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _stale(output: Path, sources: list[Path]) -> bool:
    """For the GPU kernels, whose builds carry no stamp: judged by file times."""
    if not output.is_file():
        return True
    built = output.stat().st_mtime
    return any(src.stat().st_mtime > built for src in sources if src.exists())


class _TorchVersionOnly:
    """Stands in for ``torch`` while csrc/build.py's ``cpu_build_dir`` and ``cpu_inputs_digest``
    read ``torch.__version__``: importing torch costs 3 s of CPU (10 s on a loaded 2-core machine)
    on every executor start, and the executor imports it again right after. The installed
    distribution's version is the same string (``2.13.0+cpu``)."""

    def __init__(self, version: str):
        self.__version__ = version


def _reading_torch_version(call):
    """``call()`` (of csrc/build.py, reading only ``torch.__version__``) without importing torch
    where its distribution says its version."""
    import importlib.metadata

    try:
        version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return call()
    if sys.modules.get("torch") is not None:
        return call()
    sys.modules["torch"] = _TorchVersionOnly(version)  # type: ignore[assignment]
    try:
        return call()
    finally:
        del sys.modules["torch"]


def _cpu_build_dir(build) -> Path:
    return _reading_torch_version(build.cpu_build_dir)


def plan(build, kernel: str) -> tuple[Path, bool]:
    """(the library the build writes, whether it is there and built from the current sources) for ``kernel``."""
    root = build.build_root()
    if kernel == "cpu":
        directory, digest = _cpu_build_dir(build), _reading_torch_version(build.cpu_inputs_digest)
        library = f"{build.CPU_LIBRARY}.so"
        return directory / library, build.built_from(directory, library, digest) is not None
    sources = [build.CSRC / name for name in [build.BINDING, *build.KERNEL_UNITS, *build.HEADERS]]
    if kernel == "cuda":
        output = root / "cuda" / "kvserve_kernels.so"
    elif kernel == "musa":
        output = root / "musa" / "build" / "kvserve_kernels_musa.so"
    else:
        raise SystemExit(f"ensure-kernels: unknown kernel {kernel!r} (cpu, cuda, musa or none)")
    return output, not _stale(output, sources)


def ensure(kernel: str) -> None:
    build = build_script()
    output, ready = plan(build, kernel)
    if ready:
        log("kernel_ready", kernel=kernel, path=str(output))
        return
    log("kernel_compile_started", kernel=kernel, directory=str(output.parent),
        note="no prebuilt kernel for this machine; compiling (about 1-2 minutes; kept in the volume)")
    start = time.monotonic()
    try:
        if kernel == "cpu":
            build.load_cpu()
        else:
            build.load(kernel)
    except Exception as exc:  # noqa: BLE001 - the executor decides what a missing kernel means
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()] or [type(exc).__name__]
        telling = [line for line in lines if "error" in line.lower() or "not found" in line]
        log("kernel_compile_failed", level="warning", kernel=kernel, seconds=round(time.monotonic() - start, 1),
            error=(telling or lines)[0][:300], note="the executor falls back to torch attention where it can")
        return
    log("kernel_compile_finished", kernel=kernel, seconds=round(time.monotonic() - start, 1), path=str(output))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command: list[str] = []
    if "--" in argv:
        split = argv.index("--")
        argv, command = argv[:split], argv[split + 1:]
    parser = argparse.ArgumentParser(prog="kvserve-ensure-kernels", description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", default=os.environ.get("KVSERVE_ENSURE_KERNELS", "cpu"))
    args = parser.parse_args(argv)
    for kernel in args.kernels.replace(",", " ").split():
        if kernel != "none":
            ensure(kernel)
    if command:
        os.execvp(command[0], command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
