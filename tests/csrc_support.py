"""Shared by the kernel tests (emulated on the CPU and on a GPU): a paged KV cache
in vLLM's layout whose every slot outside the sequences holds NaN."""
from __future__ import annotations

import random

import torch

from executor.attention import paged_reference as ref


def nan_paged_cache(lens, kv_heads, head_size, block_size, dtype, seed, device="cpu"):
    """Caches full of NaN (so any read outside a sequence's context poisons the result),
    each sequence's tokens written at randomly permuted blocks; block tables padded with 0.
    Returns (key_cache, value_cache, block_tables [num_seqs, max_blocks] int32), all on ``device``."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    needed = [-(-length // block_size) for length in lens]
    num_blocks = sum(needed) + 5
    kc, vc = ref.new_kv_cache(num_blocks, block_size, kv_heads, head_size, dtype, device)
    kc.fill_(float("nan"))
    vc.fill_(float("nan"))
    perm = list(range(num_blocks))
    rng.shuffle(perm)
    bt = torch.zeros(len(lens), max(needed), dtype=torch.int32)
    used = 0
    for i, (length, nb) in enumerate(zip(lens, needed)):
        bt[i, :nb] = torch.tensor(perm[used : used + nb], dtype=torch.int32)
        used += nb
        pos = torch.arange(length)
        slots = (bt[i, pos // block_size].long() * block_size + pos % block_size).to(device)
        k = torch.randn(length, kv_heads, head_size, device=device).to(dtype)
        v = torch.randn(length, kv_heads, head_size, device=device).to(dtype)
        ref.reshape_and_cache(k, v, kc, vc, slots)
    return kc, vc, bt.to(device)
