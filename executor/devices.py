"""Device and dtype choice, and the few per-device calls (memory, synchronize) torch spells differently."""
from __future__ import annotations

import importlib
from collections.abc import Iterator

import torch

from executor.loader import DTYPES
from executor.model import ModelConfig, cpu_packs_bf16


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
    """``auto``: bfloat16 on a CPU that runs it natively, else float32 (an AVX2-only CPU emulates
    bf16 many times slower); the checkpoint's dtype on a device."""
    if name == "auto":
        if device.type == "cpu":
            return torch.bfloat16 if cpu_packs_bf16() else torch.float32
        return DTYPES.get(config.checkpoint_dtype, torch.bfloat16)
    return DTYPES[name]


def resolve_kv_cache_dtype(kv_cache_dtype: str, dtype: str, config: ModelConfig, compute: torch.dtype,
                           reads_other_kv_dtype: bool) -> str:
    """The ``--kv-cache-dtype`` in effect: ``auto`` keeps K/V in the model's dtype, except where
    ``--dtype auto`` computes a bf16 checkpoint in float32 because the CPU has no native bf16: there
    they stay bf16, as on a CPU that has it (half the bytes a decode step reads, twice the tokens in
    the same memory), where the backend can read such a cache. ``bfloat16`` for a bf16 model is
    ``auto``: the same cache, described alike."""
    if kv_cache_dtype == "auto" and dtype == "auto" and compute == torch.float32 and reads_other_kv_dtype \
            and config.checkpoint_dtype == "bfloat16":
        return "bfloat16"
    if kv_cache_dtype == "bfloat16" and compute == torch.bfloat16:
        return "auto"
    return kv_cache_dtype


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

    It also keeps every thread's allocations in the main arena. The torch thread loads the
    weights, and a thread of its own would get an arena of its own, whose heaps glibc's
    ``hugetlb`` tunable does not madvise (glibc 2.36): bf16 SmolLM2's weights then lie in 4 KiB
    pages until the collapse after the start moves them (2.5 s of work on two cores, done between
    steps: under load for the whole of a short benchmark). In the main arena they fault in as huge
    pages. The torch thread does nearly all of the process's allocating, so one arena's lock is
    seldom contended.
    Process-wide, so the entry point calls it before it starts threads; returns False where libc
    has no mallopt.
    """
    import ctypes
    import ctypes.util

    m_trim_threshold, m_mmap_threshold, m_arena_max = -1, -3, -8
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    ok = mallopt(m_mmap_threshold, 32 << 20)  # glibc's maximum on 64-bit
    return bool(ok and mallopt(m_trim_threshold, 1 << 30) and mallopt(m_arena_max, 1))


# madvise(2) advice values (Linux): back with transparent huge pages; and collapse into them now.
_MADV_HUGEPAGE, _MADV_COLLAPSE = 14, 25
_HUGE_PAGE = 2 << 20


def back_large_allocations_with_huge_pages(min_bytes: int = 16 << 20) -> int:
    """Asks Linux to back this process's large private anonymous mappings (glibc's heap and its
    mmap'd chunks: where the weights and the KV cache lie) with 2 MiB pages, now and as they grow.

    A decode step reads every weight once and each sequence's scattered KV blocks; with 4 KiB
    pages nearly every block and every 4 KiB of weights is a TLB miss, a page walk that is
    two-dimensional in a VM. ``MADV_COLLAPSE`` (Linux 6.1) moves what is already there into huge
    pages whatever the system's THP policy short of ``never``; ``MADV_HUGEPAGE`` covers later
    growth where the policy is ``madvise``. Mappings under ``min_bytes`` (thread stacks, small
    arenas) are left alone. Returns the bytes collapsed: 0 where the kernel or libc cannot
    (the process runs on as before).
    """
    return sum(huge_page_collapses(min_bytes))


def huge_page_collapses(min_bytes: int = 16 << 20, piece_bytes: int | None = None) -> Iterator[int]:
    """``back_large_allocations_with_huge_pages`` a piece at a time: each ``next`` collapses up to
    ``piece_bytes`` (None: a whole mapping) and yields the bytes it collapsed (0 where it could not),
    so a caller can do other work between pieces."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
        with open("/proc/self/maps") as maps:
            lines = maps.readlines()
    except (OSError, AttributeError):
        return
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    for line in lines:
        fields = line.split()
        path = fields[5] if len(fields) > 5 else ""
        if fields[1] != "rw-p" or path not in ("", "[heap]"):
            continue
        low, high = (int(x, 16) for x in fields[0].split("-"))
        start = -(-low // _HUGE_PAGE) * _HUGE_PAGE
        length = high // _HUGE_PAGE * _HUGE_PAGE - start
        if length < min_bytes:
            continue
        madvise(start, length, _MADV_HUGEPAGE)
        step = length if piece_bytes is None else max(_HUGE_PAGE, piece_bytes // _HUGE_PAGE * _HUGE_PAGE)
        for offset in range(0, length, step):
            size = min(step, length - offset)
            yield size if madvise(start + offset, size, _MADV_COLLAPSE) == 0 else 0
