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


def test_the_launcher_asks_glibc_for_huge_pages_and_keeps_other_tunables():
    from kvserve.launcher import with_huge_page_malloc

    assert with_huge_page_malloc({"A": "1"}) == {"A": "1", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    assert with_huge_page_malloc({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})["GLIBC_TUNABLES"] == \
        "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
    chosen = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}  # the user's own choice wins
    assert with_huge_page_malloc(chosen) == chosen


def glibc_supports_hugetlb_tunable() -> bool:
    libc, version = platform.libc_ver()
    return libc == "glibc" and tuple(int(p) for p in version.split(".")[:2]) >= (2, 35)


@pytest.mark.skipif(not (kernel_collapses() and glibc_supports_hugetlb_tunable()),
                    reason="needs Linux >= 6.1 with transparent huge pages and glibc >= 2.35")
def test_with_the_tunable_large_allocations_fault_in_as_huge_pages_without_a_collapse():
    import os
    import subprocess
    import sys

    from kvserve.launcher import with_huge_page_malloc

    script = """
import torch
from pathlib import Path
from executor.devices import tune_host_allocator
tune_host_allocator()
weights = torch.ones(48 << 20, dtype=torch.int32)  # 192 MiB, written
huge = next(int(l.split()[1]) for l in Path("/proc/self/smaps_rollup").read_text().splitlines()
            if l.startswith("AnonHugePages:"))
print(huge << 10)
"""
    def huge_bytes(env: dict[str, str]) -> int:
        done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return int(done.stdout.split()[-1])

    plain = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    assert huge_bytes(with_huge_page_malloc(plain)) >= 128 << 20


@pytest.mark.skipif(not (kernel_collapses() and glibc_supports_hugetlb_tunable()),
                    reason="needs Linux >= 6.1 with transparent huge pages and glibc >= 2.35")
def test_weights_made_in_another_thread_fault_in_as_huge_pages_too():
    """The executor loads its model in the torch thread: its many small weights (SmolLM2's are
    0.3-2 MiB each, below the mmap threshold) must land where the tunable reaches, not in a
    thread arena that stays in 4 KiB pages until the collapse after the start."""
    import os
    import subprocess
    import sys

    from kvserve.launcher import with_huge_page_malloc

    script = """
import threading
import torch
from pathlib import Path
from executor.devices import tune_host_allocator
tune_host_allocator()
weights = []
def load():
    weights.extend(torch.ones(1 << 18, dtype=torch.float32) for _ in range(160))  # 160 x 1 MiB, written
loader = threading.Thread(target=load)
loader.start()
loader.join()
huge = next(int(l.split()[1]) for l in Path("/proc/self/smaps_rollup").read_text().splitlines()
            if l.startswith("AnonHugePages:"))
print(huge << 10)
"""
    plain = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    done = subprocess.run([sys.executable, "-c", script], env=with_huge_page_malloc(plain), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout.split()[-1]) >= 128 << 20


def resident_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) << 10
    raise AssertionError("no VmRSS in /proc/self/status")


@pytest.mark.skipif(platform.system() != "Linux", reason="reads /proc/self/status")
@pytest.mark.parametrize("backend_name, kv_cache_dtype", [("cpu", "auto"), ("cpu", "int8"), ("torch", "auto")])
def test_a_host_kv_cache_reads_zero_and_costs_memory_only_where_written(backend_name, kv_cache_dtype):
    from executor.attention import create_backend

    backend = create_backend(backend_name, torch.device("cpu"), kv_cache_dtype)
    before = resident_bytes()
    # 30 layers of SmolLM2-135M's K and V in 2048 blocks of 16 tokens: 720 MiB in bf16.
    caches = [backend.allocate_kv_cache(2048, 16, 3, 64, torch.bfloat16, torch.device("cpu")) for _ in range(30)]
    assert resident_bytes() - before < 64 << 20, "the cache was written at allocation"
    key, value = caches[-1]
    assert 2048 in key.shape[:2] and not key.any() and not value.any()
    key.view(-1)[:5].fill_(3)
    assert key.view(-1)[:6].tolist() == [3] * 5 + [0] and not caches[0][0].any()
