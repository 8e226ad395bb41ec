"""Attention backends, chosen from the device or forced by ``--attention-backend``."""
from __future__ import annotations

import importlib

import torch

from executor.attention.base import AttentionBackend, AttentionMetadata, KVCache

# Imported lazily so that the CPU path never loads the native extension.
BACKENDS = {
    "torch": "executor.attention.torch_backend:TorchAttentionBackend",
    "cuda": "executor.attention.native:NativeAttentionBackend",
    "musa": "executor.attention.native:NativeAttentionBackend",
}


def default_backend_name(device: torch.device) -> str:
    """``cuda``/``musa`` on those devices, ``torch`` everywhere else."""
    return device.type if device.type in BACKENDS else "torch"


def create_backend(name: str, device: torch.device) -> AttentionBackend:
    """Instantiates backend ``name`` ("auto" picks from the device) for ``device``."""
    if name == "auto":
        name = default_backend_name(device)
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose from auto, {', '.join(BACKENDS)}")
    module_name, class_name = BACKENDS[name].split(":")
    backend_cls = getattr(importlib.import_module(module_name), class_name)
    return backend_cls(device)


__all__ = ["AttentionBackend", "AttentionMetadata", "KVCache", "create_backend", "default_backend_name", "BACKENDS"]
