"""Pure-torch reference of the native kernels' semantics, on vLLM's cache layout.

It runs on any device (CPU included), so the layout arithmetic is tested without
a GPU; the GPU tests then compare the kernels against it. Layouts
(x = 16 bytes / element size):

    key_cache    [num_blocks, num_kv_heads, head_size // x, block_size, x]
    value_cache  [num_blocks, num_kv_heads, head_size, block_size]

Token ``t`` of a sequence sits in block ``block_table[t // block_size]`` at offset
``t % block_size``; its key dim ``d`` is ``key_cache[blk, h, d // x, off, d % x]``
and its value dim ``d`` is ``value_cache[blk, h, d, off]``.
"""
from __future__ import annotations

import torch


def x_for(dtype: torch.dtype) -> int:
    """Elements per 16-byte vector: the ``x`` of the key layout."""
    return 16 // torch.empty((), dtype=dtype).element_size()


def new_kv_cache(
    num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, dtype: torch.dtype, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero-filled (key_cache, value_cache) in the vLLM layout."""
    x = x_for(dtype)
    if head_size % x:
        raise ValueError(f"head_size {head_size} must be a multiple of x={x} for {dtype}")
    key = torch.zeros(num_blocks, num_kv_heads, head_size // x, block_size, x, dtype=dtype, device=device)
    value = torch.zeros(num_blocks, num_kv_heads, head_size, block_size, dtype=dtype, device=device)
    return key, value


def reshape_and_cache(
    key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """key, value [num_tokens, num_kv_heads, head_size] → their slots; slot < 0 skipped."""
    block_size, x = key_cache.shape[3], key_cache.shape[4]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    blk, off = slots // block_size, slots % block_size
    n, h, d = key[keep].shape
    # Advanced indices (blk, off) around slices put the token dim first:
    # key_cache[blk, :, :, off, :] is [n, kv_heads, head_size // x, x].
    key_cache[blk, :, :, off, :] = key[keep].reshape(n, h, d // x, x)
    value_cache[blk, :, :, off] = value[keep]


def gather_kv(
    key_cache: torch.Tensor, value_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's first ``seq_len`` tokens as contiguous [seq_len, num_kv_heads, head_size] K and V."""
    num_blocks_total, kv_heads, _, block_size, x = key_cache.shape
    head_size = value_cache.shape[2]
    nb = -(-seq_len // block_size)
    blocks = block_table[:nb].long()
    # [nb, h, d/x, B, x] → [nb, B, h, d/x, x] → [nb*B, h, d]
    k = key_cache[blocks].permute(0, 3, 1, 2, 4).reshape(nb * block_size, kv_heads, head_size)
    # [nb, h, d, B] → [nb, B, h, d]
    v = value_cache[blocks].permute(0, 3, 1, 2).reshape(nb * block_size, kv_heads, head_size)
    return k[:seq_len], v[:seq_len]


def attention_one_seq(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of the last ``q.shape[0]`` tokens of a sequence over all of it, in fp32.
    q [n, num_heads, d]; k, v [seq_len, num_kv_heads, d] → [n, num_heads, d] (q's dtype).
    Query j sits at position seq_len - n + j and sees keys 0..that position."""
    n, num_heads, _ = q.shape
    seq_len, kv_heads, _ = k.shape
    group = num_heads // kv_heads
    qf = q.float().transpose(0, 1)  # [H, n, d]
    kf = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, L, d]
    vf = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = torch.matmul(qf, kf.transpose(1, 2)) * scale  # [H, n, L]
    pos = torch.arange(seq_len - n, seq_len, device=q.device)[:, None]
    allowed = torch.arange(seq_len, device=q.device)[None, :] <= pos  # [n, L]
    scores = scores.masked_fill(~allowed, float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), vf)  # [H, n, d]
    return out.transpose(0, 1).to(q.dtype)


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: list[int],
    query_lens: list[int],
    scale: float,
) -> torch.Tensor:
    """Chunked-prefill/decode attention over the paged cache (which already holds
    the new tokens' K/V). query [num_tokens, num_heads, d], sequences' new tokens
    contiguous and in order → [num_tokens, num_heads, d]."""
    out = torch.empty_like(query)
    start = 0
    for i, (seq_len, n) in enumerate(zip(seq_lens, query_lens)):
        if n == 0:
            continue
        k, v = gather_kv(key_cache, value_cache, block_tables[i], seq_len)
        out[start : start + n] = attention_one_seq(query[start : start + n], k, v, scale)
        start += n
    return out


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: list[int],
    scale: float,
) -> torch.Tensor:
    """The decode kernel's contract: one query token per sequence. query [num_seqs, num_heads, d]."""
    return paged_attention(query, key_cache, value_cache, block_tables, seq_lens, [1] * len(seq_lens), scale)


def copy_blocks(kv_caches: list[tuple[torch.Tensor, torch.Tensor]], src: torch.Tensor, dst: torch.Tensor) -> None:
    """Block src[i] → dst[i] in every layer's K and V cache."""
    for key_cache, value_cache in kv_caches:
        key_cache[dst] = key_cache[src]
        value_cache[dst] = value_cache[src]
