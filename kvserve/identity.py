"""Identities that cross the services: what a tokenizer is, which process an executor is.

Both the executor (which describes itself) and the gateway (which checks what it
is connected to) compute them the same way, so they live in the shared package.
"""
from __future__ import annotations

import hashlib
import uuid
from pathlib import Path


def tokenizer_fingerprint(model_dir: Path | str) -> str:
    """Lowercase hex sha256 of the model directory's ``tokenizer.json`` bytes ("" without one)."""
    path = Path(model_dir) / "tokenizer.json"
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else ""


def new_instance_id() -> str:
    """A fresh id for one start of a process: a new KV cache."""
    return uuid.uuid4().hex
