"""Device and dtype choice, and the few per-device calls (memory, synchronize) torch spells differently."""
from __future__ import annotations

import importlib

import torch

from executor.loader import DTYPES
from executor.model import ModelConfig


def _musa_available() -> bool:
    try:
        importlib.import_module("torch_musa")
    except ImportError:
        return False
    return hasattr(torch, "musa") and torch.musa.is_available() and torch.musa.device_count() > 0


def resolve_device(name: str) -> torch.device:
    """``auto``: MUSA when torch_musa is importable and sees a device, else CUDA when available, else CPU."""
    if name == "auto":
        if _musa_available():
            return torch.device("musa", 0)
        if torch.cuda.is_available():
            return torch.device("cuda", 0)
        return torch.device("cpu")
    if name == "musa" and not _musa_available():
        raise ValueError("device: musa asked for, but torch_musa is not installed or sees no device")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: cuda asked for, but torch sees no CUDA device")
    device = torch.device(name)
    return torch.device(device.type, 0) if device.type != "cpu" and device.index is None else device


def resolve_dtype(name: str, config: ModelConfig, device: torch.device) -> torch.dtype:
    """``auto``: bfloat16 on the CPU, the checkpoint's dtype on a device."""
    if name == "auto":
        if device.type == "cpu":
            return torch.bfloat16
        return DTYPES.get(config.checkpoint_dtype, torch.bfloat16)
    return DTYPES[name]


def device_module(device: torch.device):
    """``torch.cuda`` / ``torch.musa`` for a device, None for the CPU."""
    return None if device.type == "cpu" else getattr(torch, device.type)


def synchronize(device: torch.device) -> None:
    module = device_module(device)
    if module is not None:
        module.synchronize(device)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tune_host_allocator() -> bool:
    """Keeps freed large host buffers in the heap instead of returning them to the OS.

    glibc serves allocations above its mmap threshold with fresh mmap'd pages and gives
    them back on free, so every step's large temporaries (gathered K/V, MLP activations)
    page-fault again, a cost paid per step that grows with the batch (docs/executor.md).
    Raising the mmap and trim thresholds (what tcmalloc/jemalloc do by default) stops it.
    Process-wide, so the entry point calls it; returns False where libc has no mallopt.
    """
    import ctypes
    import ctypes.util

    m_trim_threshold, m_mmap_threshold = -1, -3
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    ok = mallopt(m_mmap_threshold, 32 << 20)  # glibc's maximum on 64-bit
    return bool(ok and mallopt(m_trim_threshold, 1 << 30))
