"""Best-of-N timing for the micro-benchmarks (executor, matmul, attention, sampling, quantization).

The functions under comparison run in turn, round after round, so that load from other processes
on a shared machine hits all of them alike; the minimum is the least disturbed number.
"""
from __future__ import annotations

import time
from typing import Callable


def timed_interleaved(fns: dict[str, Callable[[], object]], rounds: int, warmup: int = 2) -> dict[str, float]:
    """Best-of-``rounds`` milliseconds of each function, after ``warmup`` untimed rounds."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    best = {name: float("inf") for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], (time.perf_counter() - start) * 1e3)
    return best
