"""Builds the kvserve kernels as a torch extension, on CUDA or on MUSA.

    from csrc.build import load          # or: python csrc/build.py [--device musa]
    ops = load()                         # ops.paged_attention / reshape_and_cache / copy_blocks
    cpu_ops = load_cpu()                 # torch.ops.kvserve_cpu: paged_decode_attention / write_kv / greedy_sample / layer ops

CUDA: ``torch.utils.cpp_extension.load`` (JIT, ninja), for the archs of the local
GPUs (or ``TORCH_CUDA_ARCH_LIST``). MUSA: ``torch_musa.utils.musa_extension.load``
with mcc; torch_musa compiles only ``.mu`` files as device code, so the ``.cu``
sources are mirrored byte-for-byte as ``.mu`` into the build directory first —
that copy is the whole MUSA port. CPU: ``cpu/*.cpp`` with
the host compiler, ``-march=native`` (the build directory is keyed by the CPU's
feature flags, so a cache shared between machines never runs foreign code, and by the
source location and torch version, so checkouts sharing a cache do not rebuild each other's). Builds are cached under
``$KVSERVE_EXTENSIONS_DIR`` (default ``$TORCH_EXTENSIONS_DIR/kvserve`` or
``~/.cache/kvserve/torch_extensions``) and rebuilt when a source changes.

The sources are found next to this file (``CSRC``), in a source checkout and in an
installed kvserve alike: the distribution installs ``csrc/`` (this file, the kernel
sources and ``cpu/``; see ``pyproject.toml``) as a top-level package beside
``executor/``, which loads this file from there (``executor/attention/csrc_loader.py``).
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import shutil
import sys
from pathlib import Path
from types import ModuleType
from typing import Iterator

# The kernel sources: this file's directory, in a checkout and in site-packages alike.
CSRC = Path(__file__).resolve().parent
BINDING = "bindings.cpp"
# One translation unit per dtype so they compile in parallel (MAX_JOBS).
KERNEL_UNITS = ["cache_kernels.cu", "attention_f32.cu", "attention_f16.cu", "attention_bf16.cu"]
HEADERS = ["compat.h", "kernels.h", "dtype.cuh", "attention_impl.cuh"]

# Device-compiler flags shared by the CUDA build and the compile check
# (tests/test_csrc_compile.py). torch adds the -D__CUDA_NO_HALF_* guards
# itself; the kernels never rely on the operators they disable.
NVCC_FLAGS = ["-O3", "-std=c++17"]
NVCC_WARNING_FLAGS = ["-Werror", "all-warnings", "-Xcompiler", "-Wall,-Wextra,-Werror"]
TORCH_CUDA_DEFINES = [
    "-D__CUDA_NO_HALF_OPERATORS__",
    "-D__CUDA_NO_HALF_CONVERSIONS__",
    "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-D__CUDA_NO_HALF2_OPERATORS__",
]
# mcc: -O3, MTGPU target, and the GPU generation (mp_31 = S5000, mp_22 = S4000).
# torch_musa's ninja rule adds "-x musa" for .mu sources itself.
MUSA_FLAGS = ["-O3", "-mtgpu", "-DKVSERVE_USE_MUSA"]

CPU_SOURCES = [CSRC / "cpu" / name for name in ("paged_decode_attention.cpp", "write_kv.cpp", "greedy_sample.cpp",
                                                         "layer_ops.cpp", "skinny_linear.cpp", "skinny_quantized.cpp",
                                                         "skinny_linear_f32.cpp",
                                                         "causal_softmax.cpp", "prompt_linear.cpp", "prefill_attention.cpp",
                                                         "prefill_attention_f32.cpp",
                                                         "decode_layer.cpp")]
# OpenMP for at::parallel_for: the extension links libgomp.so.1, which resolves to the
# copy torch has already loaded, so both share one thread pool. -Wno-psabi: without AVX-512,
# GCC warns that 64-byte vector arguments pass differently than in AVX-512 code; every unit
# here is built with the same flags and the vectors never cross into other code, so the
# warning (an error under -Werror, which failed the whole build on AVX2 CPUs) says nothing.
CPU_FLAGS = ["-O3", "-march=native", "-fopenmp", "-Wall", "-Werror", "-Wno-psabi"]
CPU_LDFLAGS = ("-fopenmp",)  # a tuple: torch's builder appends to the lists it is given
CPU_HEADERS = sorted((CSRC / "cpu").glob("*.h"))
CPU_LIBRARY = "kvserve_cpu_kernels"
CPU_STAMP = "inputs.sha256"  # beside the library: the digest of the sources and flags it was built from

_MODULES: dict[str, ModuleType] = {}


def build_root() -> Path:
    """Where compiled extensions are cached."""
    if os.environ.get("KVSERVE_EXTENSIONS_DIR"):
        return Path(os.environ["KVSERVE_EXTENSIONS_DIR"])
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"]) / "kvserve"
    return Path.home() / ".cache" / "kvserve" / "torch_extensions"


def detect_device_type() -> str:
    """``musa`` when torch_musa sees a device, else ``cuda``."""
    try:
        import torch_musa  # noqa: F401  (registers torch.musa)
        import torch

        if torch.musa.is_available():
            return "musa"
    except ImportError:
        pass
    return "cuda"


def musa_arch() -> str:
    """``mp_XY`` for mcc's --offload-arch: $KVSERVE_MUSA_ARCH, else the device's capability."""
    if os.environ.get("KVSERVE_MUSA_ARCH"):
        return os.environ["KVSERVE_MUSA_ARCH"]
    import torch

    major, minor = torch.musa.get_device_capability()
    return f"mp_{major}{minor}"


def put_environment_ninja_first() -> None:
    """Puts the ``ninja`` this environment installs (pyproject's ``ninja`` requirement) first on
    ``PATH``, where torch looks for it. A process started as ``.venv/bin/python`` without the venv on
    ``PATH`` (``make run``, ``make test``) otherwise finds no ninja on a machine without a system one
    (then no kernel is built and the executor runs torch attention), or the system's, whose other
    version reads the build log as foreign: each switch between the two rebuilt every source (~90 s
    on 2 vCPUs)."""
    try:
        import ninja
    except ImportError:  # an environment without the requirement: whatever PATH has
        return
    entries = [e for e in os.environ.get("PATH", "").split(os.pathsep) if e]
    if entries[:1] != [ninja.BIN_DIR]:
        os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR] + [e for e in entries if e != ninja.BIN_DIR])


@contextlib.contextmanager
def exclusive_build(build_dir: Path) -> Iterator[None]:
    """Holds an exclusive ``flock`` on ``build_dir`` while torch builds or loads there, and clears
    torch's ``lock`` file left by a build that was killed. torch marks a build in progress with
    that file and waits, forever, for it to go: a process killed mid-build (a test's timeout, a
    stopped container) leaves it behind and every later start hangs. The kernel releases a flock
    when its holder dies, so a ``lock`` file found while holding the flock has no live builder.
    The environment's ninja is put first on ``PATH`` for the build (``put_environment_ninja_first``)."""
    put_environment_ninja_first()
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "kvserve-build.flock", "a") as guard:
        try:
            fcntl.flock(guard, fcntl.LOCK_EX)
        except OSError:  # a filesystem without flock: torch's own lock file, as before
            yield
            return
        try:
            (build_dir / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(guard, fcntl.LOCK_UN)


def load(device_type: str | None = None, verbose: bool = False) -> ModuleType:
    """Builds (first call, cached on disk) and imports the extension for ``cuda`` or ``musa``."""
    device_type = device_type or detect_device_type()
    if device_type not in _MODULES:
        if device_type == "cuda":
            _MODULES[device_type] = _load_cuda(verbose)
        elif device_type == "musa":
            _MODULES[device_type] = _load_musa(verbose)
        else:
            raise ValueError(f"kvserve kernels build for cuda or musa, not {device_type!r}")
    return _MODULES[device_type]


def cpu_features_key() -> str:
    """A short hash of this CPU's model and feature flags (what -march=native compiles for)."""
    import hashlib
    import platform

    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        described = [line for line in lines if line.startswith(("flags", "model name", "Features"))][:2]
    except OSError:
        described = []
    text = "\n".join(described) or platform.processor() or platform.machine()
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def cpu_build_dir(march: str = "native") -> Path:
    """Where the CPU kernel is built: keyed by the CPU's features (or the named ``march``), and
    by where the sources are and the torch they build against. ninja rebuilds when the compile
    command changes, and it names the sources by absolute path, so two checkouts (or venvs)
    sharing one cache directory would otherwise recompile each other's kernel on every start
    (a minute each)."""
    import hashlib

    import torch

    origin = hashlib.sha256(f"{CSRC}|{torch.__version__}".encode()).hexdigest()[:8]
    target = cpu_features_key() if march == "native" else f"march-{march}"
    return build_root() / f"cpu-{target}-{origin}"


def inputs_digest(paths: list[Path], settings: object) -> str:
    """A hash of what a build compiles: the files' names and bytes (not their times) and ``settings``."""
    import hashlib

    digest = hashlib.sha256(repr(settings).encode())
    for path in paths:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def built_from(build_dir: Path, library: str, digest: str) -> Path | None:
    """``build_dir``'s ``library`` when the stamp beside it says it was built from inputs of ``digest``."""
    stamp, built = build_dir / CPU_STAMP, build_dir / library
    try:
        return built if built.is_file() and stamp.read_text() == digest else None
    except OSError:
        return None


def cpu_cflags(march: str = "native") -> list[str]:
    return [f"-march={march}" if flag == "-march=native" else flag for flag in CPU_FLAGS]


def cpu_inputs_digest(march: str = "native") -> str:
    """What a CPU kernel build of ``march`` compiles: every source and header, the flags, torch's version."""
    import torch

    return inputs_digest([*CPU_SOURCES, *CPU_HEADERS], (cpu_cflags(march), CPU_LDFLAGS, torch.__version__))


def load_cpu(verbose: bool = False, march: str = "native"):
    """Builds (first call, cached on disk) and loads the CPU ops; returns ``torch.ops.kvserve_cpu``
    (``paged_decode_attention``, ``write_kv``, ``greedy_sample`` and the layer ops of ``cpu/layer_ops.cpp``).
    ``march``: another -march than this CPU's, for testing the kernels' portable paths (a process
    loads one build: the ops register under one name).

    A build whose stamp matches the sources' bytes is loaded as it is: ninja judges by times, and a
    fresh clone's sources are all newer than the cached objects, so ninja would build it all again
    (native and portable, 2-4 minutes on 2 cores). Anything else goes through ninja."""
    import torch
    from torch.utils.cpp_extension import load as torch_load

    if not hasattr(torch.ops.kvserve_cpu, "paged_decode_attention"):
        build_dir, cflags, digest = cpu_build_dir(march), cpu_cflags(march), cpu_inputs_digest(march)
        with exclusive_build(build_dir):
            built = built_from(build_dir, f"{CPU_LIBRARY}.so", digest)
            if built is not None:
                torch.ops.load_library(str(built))
            else:
                torch_load(name=CPU_LIBRARY, sources=[str(path) for path in CPU_SOURCES], extra_cflags=cflags,
                           extra_ldflags=list(CPU_LDFLAGS), build_directory=str(build_dir), is_python_module=False,
                           verbose=verbose)
                (build_dir / CPU_STAMP).write_text(digest)
    return torch.ops.kvserve_cpu


def _load_cuda(verbose: bool) -> ModuleType:
    from torch.utils.cpp_extension import load as torch_load

    build_dir = build_root() / "cuda"
    with exclusive_build(build_dir):
        return torch_load(
            name="kvserve_kernels",
            sources=[str(CSRC / s) for s in [BINDING, *KERNEL_UNITS]],
            extra_cflags=["-O3"],
            extra_cuda_cflags=["-O3"],
            extra_include_paths=[str(CSRC)],
            build_directory=str(build_dir),
            verbose=verbose,
        )


def stage_musa_sources(dest: Path) -> list[str]:
    """Mirrors csrc into ``dest`` with ``.cu`` renamed ``.mu``; returns the sources to build."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in HEADERS + [BINDING]:
        _copy_if_changed(CSRC / name, dest / name)
    sources = [str(dest / BINDING)]
    for name in KERNEL_UNITS:
        target = dest / (Path(name).stem + ".mu")
        _copy_if_changed(CSRC / name, target)
        sources.append(str(target))
    return sources


def _copy_if_changed(src: Path, dst: Path) -> None:
    # Unchanged mtimes keep ninja from rebuilding on every process start.
    if not dst.exists() or dst.read_bytes() != src.read_bytes():
        shutil.copyfile(src, dst)


def _load_musa(verbose: bool) -> ModuleType:
    import torch_musa  # noqa: F401
    from torch_musa.utils.musa_extension import load as musa_load

    root = build_root() / "musa"
    sources = stage_musa_sources(root / "src")
    build_dir = root / "build"
    with exclusive_build(build_dir):
        return musa_load(
            name="kvserve_kernels_musa",
            sources=sources,
            extra_cflags=["-O3", "-DKVSERVE_USE_MUSA"],
            extra_musa_cflags=MUSA_FLAGS + [f"--offload-arch={musa_arch()}"],
            extra_include_paths=[str(root / "src")],
            build_directory=str(build_dir),
            verbose=verbose,
        )


def musa_setup_extension(name: str = "kvserve_kernels_musa"):
    """Install-time alternative for a setup.py on MUSA:
    ``setup(ext_modules=[musa_setup_extension()], cmdclass={"build_ext": BuildExtension})``."""
    from torch_musa.utils.musa_extension import MUSAExtension

    staging = CSRC.parent / "build" / "musa_src"  # build/ is git-ignored
    staged = stage_musa_sources(staging)
    return MUSAExtension(
        name=name,
        sources=staged,
        include_dirs=[str(staging)],
        extra_compile_args={"cxx": ["-O3", "-DKVSERVE_USE_MUSA"], "mcc": MUSA_FLAGS + [f"--offload-arch={musa_arch()}"]},
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["auto", "cuda", "musa", "cpu"], default="auto")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    if args.device == "cpu":
        print(load_cpu(verbose=args.verbose))
        return 0
    module = load(None if args.device == "auto" else args.device, verbose=args.verbose)
    print(module.__file__)
    return 0


if __name__ == "__main__":
    sys.exit(main())
