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
        raise ValueError("--device musa: torch_musa is not installed or sees no device")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: torch sees no CUDA device")
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
