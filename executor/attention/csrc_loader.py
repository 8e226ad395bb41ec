"""Finds csrc/build.py, which builds the compiled kernels (CUDA, MUSA and CPU) on first use."""
from __future__ import annotations

import importlib.util
from functools import cache
from pathlib import Path
from types import ModuleType


@cache
def csrc_build_script() -> ModuleType:
    """csrc/build.py, loaded by path: csrc/ is not a Python package of the distribution."""
    path = Path(__file__).resolve().parents[2] / "csrc" / "build.py"
    spec = importlib.util.spec_from_file_location("kvserve_csrc_build", path)
    if spec is None or spec.loader is None or not path.is_file():
        raise ImportError(f"kvserve kernels: cannot find {path} (install kvserve from a source checkout)")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
