"""CI compile check of csrc/ (no GPU needed, skipped where nvcc is absent).

- Every kernel translation unit compiles with nvcc -c for sm_80 and sm_90 with
  all warnings as errors. sm_80 builds as C++17 (what mcc/torch_musa uses),
  sm_90 as C++20 (what torch 2.13's cpp_extension passes), so both dialects are
  covered at no extra cost.
- Device optimisation is lowered (-Xcicc -O1 -Xptxas -O1) to keep the suite
  fast on small CI machines: warnings come from the front end, which is the
  same at every level. KVSERVE_COMPILE_CHECK_FULL=1 compiles with the
  production -O3 instead (several minutes on 2 cores).
- The torch binding syntax-checks with g++ against the installed torch headers.
- The portability rules: no inline PTX, no CUDA-only names outside compat.h.
- A compile check that passed is remembered under ``~/.cache/kvserve/compile-checks/``, keyed by
  the bytes of every file in csrc/, the exact commands and the compilers' versions: the same
  inputs pass again without the two-minute compile. A change to any of them compiles afresh;
  KVSERVE_COMPILE_CHECK_CACHE=off always compiles.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kvserve.paths import cache_dir

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "csrc"
_spec = importlib.util.spec_from_file_location("kvserve_csrc_build", CSRC / "build.py")
csrc_build = importlib.util.module_from_spec(_spec)  # csrc/build.py: the source and flag lists live there
_spec.loader.exec_module(csrc_build)

NVCC = shutil.which("nvcc")
FULL = os.environ.get("KVSERVE_COMPILE_CHECK_FULL") == "1"
ARCHS = [("80", "c++17"), ("90", "c++20")]


def nvcc_command(unit: str, arch: str, std: str, out_dir: Path) -> list[str]:
    opt = [] if FULL else ["-Xcicc", "-O1", "-Xptxas", "-O1"]
    flags = [f if f != "-std=c++17" else f"-std={std}" for f in csrc_build.NVCC_FLAGS]
    return [
        NVCC, "-c", str(CSRC / unit), "-o", str(out_dir / f"{unit}.sm{arch}.o"),
        f"-I{CSRC}", "-gencode", f"arch=compute_{arch},code=sm_{arch}",
        *flags, *opt, *csrc_build.NVCC_WARNING_FLAGS, *csrc_build.TORCH_CUDA_DEFINES,
    ]  # fmt: skip


def run(cmd: list[str]) -> tuple[list[str], subprocess.CompletedProcess]:
    return cmd, subprocess.run(cmd, capture_output=True, text=True, timeout=1200)


def passed_check(name: str, commands: list[list[str]], tmp_path: Path, *versions: str) -> Path | None:
    """The marker of a check that passed with exactly these inputs (it exists once one has);
    None where the cache is off."""
    if os.environ.get("KVSERVE_COMPILE_CHECK_CACHE") == "off":
        return None
    digest = hashlib.sha256()
    for path in sorted(p for p in CSRC.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
        digest.update(str(path.relative_to(CSRC)).encode() + b"\0" + path.read_bytes())
    for cmd in commands:  # where the checkout and the test's scratch directory lie is not an input
        digest.update(" ".join(cmd).replace(str(tmp_path), "<tmp>").replace(str(ROOT), "<repo>").encode() + b"\n")
    for version in versions:
        digest.update(version.encode())
    return cache_dir() / "compile-checks" / f"{name}-{digest.hexdigest()[:32]}"


def tool_version(tool: str) -> str:
    return subprocess.run([tool, "--version"], capture_output=True, text=True, timeout=60).stdout


def remember_pass(marker: Path | None) -> None:
    if marker is not None:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text("passed\n")


@pytest.mark.timeout(1800)  # a loaded 2-core CI box; nominally ~2 min
@pytest.mark.skipif(NVCC is None, reason="nvcc not installed")
def test_kernel_units_compile_sm80_sm90_werror(tmp_path):
    jobs = [nvcc_command(u, a, s, tmp_path) for u in csrc_build.KERNEL_UNITS for a, s in ARCHS]
    marker = passed_check("kernel-units", jobs, tmp_path, tool_version(NVCC))
    if marker is not None and marker.exists():
        return
    # Longest (fp32 attention) first so the two workers finish together.
    jobs.sort(key=lambda c: "attention" not in c[2])
    with ThreadPoolExecutor(max_workers=max(1, min(len(jobs), os.cpu_count() or 1))) as pool:
        results = list(pool.map(run, jobs))
    failures = [f"$ {' '.join(cmd)}\n{res.stdout}{res.stderr}" for cmd, res in results if res.returncode != 0]
    assert not failures, "\n\n".join(failures)
    for cmd, res in results:
        assert res.stderr.strip() == "" or "warning" not in res.stderr.lower(), res.stderr
    remember_pass(marker)


def torch_include_flags() -> list[str]:
    from torch.utils.cpp_extension import include_paths

    return [f for p in include_paths() for f in ("-isystem", p)]


@pytest.mark.timeout(900)
@pytest.mark.skipif(NVCC is None or shutil.which("g++") is None, reason="nvcc or g++ not installed")
def test_binding_syntax_checks_against_torch_headers(tmp_path):
    pytest.importorskip("torch")
    cuda_include = Path(NVCC).resolve().parents[1] / "include"
    if not (cuda_include / "cuda_runtime.h").exists():
        cuda_include = Path("/usr/local/cuda/include")
    # CPU wheels of torch ship c10/cuda headers but not the CMake-generated one
    # they include; an empty stand-in is enough for a syntax check.
    stub = tmp_path / "stub" / "c10" / "cuda" / "impl"
    stub.mkdir(parents=True)
    (stub / "cuda_cmake_macros.h").write_text("#pragma once\n")
    cmd = [
        "g++", "-std=c++20", "-fsyntax-only", "-Wall", "-Wextra", "-Werror",
        "-DTORCH_EXTENSION_NAME=kvserve_kernels", "-DTORCH_API_INCLUDE_EXTENSION_H",
        *torch_include_flags(), "-isystem", str(tmp_path / "stub"), "-isystem", str(cuda_include),
        "-isystem", sysconfig.get_paths()["include"], f"-I{CSRC}", str(CSRC / csrc_build.BINDING),
    ]  # fmt: skip
    import torch

    marker = passed_check("binding", [cmd], tmp_path, tool_version(NVCC), tool_version("g++"),
                          torch.__version__, torch.version.git_version)
    if marker is not None and marker.exists():
        return
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    remember_pass(marker)


def test_sources_follow_portability_rules():
    """No inline PTX; CUDA-only names (cuda*, __nv*, cuda headers) only in compat.h."""
    device_sources = [p for p in CSRC.iterdir() if p.suffix in (".cu", ".cuh", ".h") and p.name != "compat.h"]
    assert {p.name for p in device_sources} >= {"kernels.h", "attention_impl.cuh", "cache_kernels.cu"}
    for path in device_sources:
        code = re.sub(r"//.*", "", path.read_text())  # comments may name things
        assert not re.search(r"\basm\b|__asm__", code), f"inline assembly in {path.name}"
        assert not re.search(r"\bcuda\w*|__nv_\w+|\bcub::|<cuda", code), f"CUDA-only name in {path.name}"
    listed = set(csrc_build.KERNEL_UNITS + csrc_build.HEADERS + [csrc_build.BINDING])
    on_disk = {p.name for p in CSRC.iterdir() if p.suffix in (".cu", ".cuh", ".h", ".cpp")}
    assert on_disk == listed, "csrc/build.py must list every source (the MUSA staging copies exactly these)"


def test_musa_staging_is_a_byte_copy(tmp_path):
    """The whole MUSA port is a rename: .cu → .mu, same bytes, headers alongside."""
    sources = csrc_build.stage_musa_sources(tmp_path)
    assert [Path(s).name for s in sources] == [csrc_build.BINDING] + [Path(u).stem + ".mu" for u in csrc_build.KERNEL_UNITS]
    for unit in csrc_build.KERNEL_UNITS:
        assert (tmp_path / (Path(unit).stem + ".mu")).read_bytes() == (CSRC / unit).read_bytes()
    for header in csrc_build.HEADERS:
        assert (tmp_path / header).read_bytes() == (CSRC / header).read_bytes()
    mtime = (tmp_path / "attention_f16.mu").stat().st_mtime_ns
    csrc_build.stage_musa_sources(tmp_path)  # unchanged sources keep their mtimes (no ninja rebuild)
    assert (tmp_path / "attention_f16.mu").stat().st_mtime_ns == mtime


def test_a_remembered_check_is_keyed_by_every_input(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    cmd = ["nvcc", "-c", str(tmp_path / "x.cu"), "-O1"]
    marker = passed_check("kernel-units", [cmd], tmp_path, "nvcc 12.8")
    elsewhere = tmp_path / "another-test-run"
    assert marker == passed_check("kernel-units", [["nvcc", "-c", str(elsewhere / "x.cu"), "-O1"]], elsewhere,
                                  "nvcc 12.8")  # the test's scratch directory is not an input
    here = passed_check("kernel-units", [["nvcc", "-c", str(ROOT / "csrc" / "x.cu")]], tmp_path, "nvcc 12.8")
    monkeypatch.setitem(globals(), "ROOT", Path("/another/clone"))
    assert here == passed_check("kernel-units", [["nvcc", "-c", "/another/clone/csrc/x.cu"]], tmp_path,
                                "nvcc 12.8")  # nor where the checkout lies
    assert marker != passed_check("kernel-units", [cmd[:-1] + ["-O3"]], tmp_path, "nvcc 12.8")
    assert marker != passed_check("kernel-units", [cmd], tmp_path, "nvcc 12.9")
    assert marker != passed_check("binding", [cmd], tmp_path, "nvcc 12.8")
    assert not marker.exists()
    remember_pass(marker)
    assert marker.exists() and marker.parent == tmp_path / "cache" / "compile-checks"
    monkeypatch.setenv("KVSERVE_COMPILE_CHECK_CACHE", "off")
    assert passed_check("kernel-units", [cmd], tmp_path, "nvcc 12.8") is None
