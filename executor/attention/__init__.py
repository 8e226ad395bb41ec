"""Attention backends, chosen from the device or forced by ``--attention-backend``."""
from __future__ import annotations

import importlib
import time

import torch

from executor.attention.base import AttentionBackend, AttentionMetadata, KVCache
from kvserve.logs import get_logger

log = get_logger("executor.attention")

# Imported lazily so that a path never loads a native extension it does not use.
BACKENDS = {
    "cpu": "executor.attention.cpu_backend:CpuAttentionBackend",
    "torch": "executor.attention.torch_backend:TorchAttentionBackend",
    "cuda": "executor.attention.native:NativeAttentionBackend",
    "musa": "executor.attention.native:NativeAttentionBackend",
}


def default_backend_name(device: torch.device) -> str:
    """The compiled kernels of the device: ``cpu``, ``cuda`` or ``musa``; ``torch`` for any other device."""
    return device.type if device.type in BACKENDS else "torch"


def _instantiate(name: str, device: torch.device) -> AttentionBackend:
    module_name, class_name = BACKENDS[name].split(":")
    return getattr(importlib.import_module(module_name), class_name)(device)


# --kv-cache-dtype: "auto" keeps K/V in the model's dtype; "bfloat16" stores them in bf16 whatever the
# model computes in (backends with ``reads_other_kv_dtype``); "int8" is the cpu backend's int8 cache.
KV_CACHE_DTYPES = ("auto", "bfloat16", "int8")


def create_backend(name: str, device: torch.device, kv_cache_dtype: str = "auto") -> AttentionBackend:
    """Instantiates backend ``name`` for ``device``. "auto" picks the device's compiled kernels and,
    on the CPU only, falls back to plain torch (with a warning) where they cannot be built."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype: {kv_cache_dtype!r}; choose from {', '.join(KV_CACHE_DTYPES)}")
    if kv_cache_dtype == "int8":
        return _int8_kv_backend(name, device)
    if name != "auto":
        if name not in BACKENDS:
            raise ValueError(f"unknown attention backend {name!r}; choose from auto, {', '.join(BACKENDS)}")
        return _instantiate(name, device)
    name = default_backend_name(device)
    if name != "cpu":
        return _instantiate(name, device)
    # The first start on a CPU compiles the kernels (cached on disk per CPU feature set):
    # say so, since it can take a minute or two on a small machine.
    started = time.monotonic()
    log.info("cpu_kernels_loading", detail="compiled on the first start on this CPU, cached afterwards")
    try:
        backend = _instantiate(name, device)
        log.info("cpu_kernels_loaded", seconds=round(time.monotonic() - started, 2))
        return backend
    except (ImportError, OSError, RuntimeError) as exc:
        # No C++ compiler (or ninja) here: the torch backend computes the same attention, slower.
        log.warning("cpu_kernels_unavailable", fallback="torch", error=_build_error_summary(exc))
        return _instantiate("torch", device)


def _int8_kv_backend(name: str, device: torch.device) -> AttentionBackend:
    """The int8 cache lives in the cpu backend's kernels alone; without them the flag is refused
    rather than quietly ignored."""
    if device.type != "cpu" or name not in ("auto", "cpu"):
        raise ValueError(f"--kv-cache-dtype int8 needs the cpu attention backend on the CPU "
                         f"(got --attention-backend {name} on {device})")
    try:
        from executor.attention.cpu_backend import CpuInt8KVAttentionBackend

        return CpuInt8KVAttentionBackend(device)
    except (ImportError, OSError, RuntimeError) as exc:
        raise ValueError(f"--kv-cache-dtype int8 needs the CPU kernels, which cannot be built here: "
                         f"{_build_error_summary(exc)}") from exc


def _build_error_summary(exc: Exception) -> str:
    """The line of a compiler's output that says what went wrong, not ninja's closing remark."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()] or [type(exc).__name__]
    telling = [line for line in lines if "error:" in line.lower() or line.endswith("not found")]
    return (telling[0] if telling else lines[0])[:300]


__all__ = ["AttentionBackend", "AttentionMetadata", "KVCache", "create_backend", "default_backend_name", "BACKENDS",
           "KV_CACHE_DTYPES"]
