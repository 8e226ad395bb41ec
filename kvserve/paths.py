"""Where kvserve keeps files it prepares (the embedded default model)."""
from __future__ import annotations

import os
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def cache_dir() -> Path:
    """``$KVSERVE_CACHE_DIR`` or ``~/.cache/kvserve``."""
    return Path(os.environ.get("KVSERVE_CACHE_DIR") or Path.home() / ".cache" / "kvserve")


def default_model_dir() -> Path:
    """The embedded default model's Hugging Face directory."""
    return cache_dir() / "models" / DEFAULT_MODEL_NAME
