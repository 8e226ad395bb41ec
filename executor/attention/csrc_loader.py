"""Finds csrc/build.py, which builds the compiled kernels (CUDA, MUSA and CPU) on first use."""
from __future__ import annotations

import importlib.util
from functools import cache
from pathlib import Path
from types import ModuleType


@cache
def csrc_build_script() -> ModuleType:
    """csrc/build.py, loaded by path from beside the ``executor`` package: the repository
    checkout (editable install) or site-packages, where the wheel installs csrc/ too."""
    path = Path(__file__).resolve().parents[2] / "csrc" / "build.py"
    spec = importlib.util.spec_from_file_location("kvserve_csrc_build", path)
    if spec is None or spec.loader is None or not path.is_file():
        raise ImportError(f"kvserve kernels: cannot find {path} (reinstall kvserve: the csrc sources are missing)")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
