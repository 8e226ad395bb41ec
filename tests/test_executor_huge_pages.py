"""The executor's large host allocations (weights, KV cache) moved into 2 MiB pages on Linux."""
from __future__ import annotations

import platform
from pathlib import Path

import pytest
import torch

from executor.devices import back_large_allocations_with_huge_pages


def anon_huge_bytes() -> int:
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1]) << 10
    return 0


def kernel_collapses() -> bool:
    """Linux >= 6.1 (MADV_COLLAPSE) with transparent huge pages not switched off."""
    if platform.system() != "Linux":
        return False
    major, minor = (int(part) for part in platform.release().split(".")[:2])
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return (major, minor) >= (6, 1) and thp.exists() and "[never]" not in thp.read_text()


@pytest.mark.skipif(not kernel_collapses(), reason="needs Linux >= 6.1 with transparent huge pages")
def test_a_large_tensor_ends_up_in_huge_pages_with_its_contents():
    weights = torch.arange(48 << 20, dtype=torch.int32)  # 192 MiB, written: 4 KiB pages now
    before = anon_huge_bytes()
    collapsed = back_large_allocations_with_huge_pages()
    assert collapsed >= 64 << 20
    assert anon_huge_bytes() >= before + (64 << 20)
    assert torch.equal(weights[-5:], torch.arange((48 << 20) - 5, 48 << 20, dtype=torch.int32))


def test_small_mappings_are_left_alone():
    assert back_large_allocations_with_huge_pages(min_bytes=1 << 50) == 0
