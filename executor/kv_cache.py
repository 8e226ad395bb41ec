"""How many KV blocks fit: ``--num-blocks``, ``--kv-cache-memory`` or ``--gpu-memory-utilization``.

Block 0 is the null block: the manager never hands it out and block tables are
padded with it, so ``num_blocks - 1`` blocks hold tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from executor.model import ModelConfig

# The CPU default: 1 GiB of KV. For SmolLM2-135M in bf16 (22.5 KiB per token) that
# is 2912 blocks of 16 tokens, ~46k tokens: several full-length requests at once.
DEFAULT_CPU_KV_BYTES = 1 << 30
MIN_BLOCKS = 2  # the null block and one to write into


@dataclass(frozen=True)
class KVSizing:
    num_blocks: int
    bytes_per_block: int
    source: str  # which flag (or default) decided

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
    """K and V, every layer, one block, each value a ``dtype`` (the cache's); with ``kv_cache_dtype`` "int8" a
    byte a value and a float32 scale per token and KV head (executor/attention/cpu_backend.py)."""
    if kv_cache_dtype == "int8":
        per_token_head = config.head_dim + 4
    else:
        per_token_head = config.head_dim * torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_layers * block_size * config.num_kv_heads * per_token_head


def size_kv_cache(
    config: ModelConfig,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    *,
    num_blocks: int | None = None,
    kv_cache_memory: int | None = None,
    gpu_memory_utilization: float = 0.9,
    device_memory: tuple[int, int, int] | None = None,
    kv_cache_dtype: str = "auto",
    host_available: int | None = None,
) -> KVSizing:
    """Blocks from the first of: ``num_blocks``, ``kv_cache_memory`` bytes, and on a device
    ``total * gpu_memory_utilization - memory in use - activation peak`` (``device_memory`` =
    (free, total, activation_peak) bytes measured after loading the weights); on the CPU 1 GiB.

    ``host_available``: the bytes a host cache may take (``host_memory.available_bytes()`` after the
    weights are loaded); a larger one is refused, naming the flag that sized it. The host cache's pages
    are faulted in as blocks are first written: such a cache would start, then be killed for memory
    under load."""
    per_block = kv_bytes_per_block(config, block_size, dtype, kv_cache_dtype)
    if num_blocks is not None:
        blocks, source = num_blocks, "num_blocks"
    elif kv_cache_memory is not None:
        blocks, source = kv_cache_memory // per_block, f"kv_cache_memory={kv_cache_memory}"
    elif device.type != "cpu" and device_memory is not None:
        free, total, activation_peak = device_memory
        if not 0.0 < gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization: must be in (0, 1], got {gpu_memory_utilization}")
        budget = int(total * gpu_memory_utilization) - (total - free) - activation_peak
        blocks = max(budget, 0) // per_block
        source = f"gpu_memory_utilization={gpu_memory_utilization}"
    else:
        blocks, source = DEFAULT_CPU_KV_BYTES // per_block, "cpu default (1 GiB)"
    if blocks < MIN_BLOCKS:
        raise ValueError(
            f"KV cache too small: {blocks} blocks of {per_block} bytes from {source}; need at least {MIN_BLOCKS}"
        )
    sizing = KVSizing(int(blocks), per_block, source)
    if host_available is not None and sizing.total_bytes > host_available:
        field = "num_blocks" if source == "num_blocks" else "kv_cache_memory"
        raise ValueError(f"{field}: a KV cache of {sizing.total_bytes / 2**30:.2f} GiB ({source}) does not fit in "
                         f"the {host_available / 2**30:.2f} GiB this host has left for this process (MemAvailable, "
                         f"or what its cgroup's memory limit leaves); it would be killed for memory under load: "
                         f"choose a smaller --kv-cache-memory or --num-blocks")
    return sizing


def max_concurrency(num_blocks: int, block_size: int, max_model_len: int) -> float:
    """How many max_model_len-token requests the usable blocks (all but the null block) hold."""
    return (num_blocks - 1) * block_size / max_model_len
