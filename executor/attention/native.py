"""Attention backend on the native kernels in csrc/ (CUDA and MUSA, one source).

- KV cache: vLLM layout, K [num_blocks, kv_heads, head_size/x, block_size, x],
  V [num_blocks, kv_heads, head_size, block_size] (see paged_reference.py).
- write_kv → reshape_and_cache kernel; copy_blocks → one copy_blocks launch for
  all layers.
- attend, decode-only step → paged_attention kernel (v1, or v2 when few CTAs
  would otherwise stream long contexts).
- attend with prefill rows (chunked prefill, cached prefix, mixed batches):
  rows with one new token still go through the decode kernel; each prefill
  sequence gathers its K/V (cached prefix + this chunk) from the paged cache into
  contiguous tensors and runs the device's scaled_dot_product_attention with the
  causal mask shifted by the prefix, so a query at position p sees keys 0..p.
  Prefill is compute-bound, so the gather copy is small next to the attention.
"""
from __future__ import annotations

import math
from types import ModuleType

import torch
import torch.nn.functional as F

from executor.attention import paged_reference
from executor.attention.base import AttentionBackend, AttentionMetadata, KVCache
from executor.attention.csrc_loader import csrc_build_script


def load_ops(device_type: str) -> ModuleType:
    """The compiled extension for ``cuda`` or ``musa`` (built on first use, cached on disk)."""
    return csrc_build_script().load(device_type)


def _multiprocessor_count(device: torch.device) -> int:
    try:
        props = getattr(torch, device.type).get_device_properties(device)
        return int(props.multi_processor_count)
    except Exception:  # an unknown count only changes the v1/v2 choice
        return 108


def _packed_heads(t: torch.Tensor) -> torch.Tensor:
    """t itself when [n, heads, d] has unit dim stride and packed heads, else a contiguous copy."""
    return t if t.stride(2) == 1 and t.stride(1) == t.shape[2] else t.contiguous()


class NativeAttentionBackend(AttentionBackend):
    """The csrc kernels on a CUDA or MUSA device."""

    # Tokens per v2 partition (a multiple of the kernel's 128-token tile).
    PARTITION_SIZE = 512
    # v1 runs one CTA per (sequence, kv head[, head slice]); below this many CTAs
    # per multiprocessor the device is under-filled and v2 splits long contexts.
    MIN_CTAS_PER_SM = 4
    SUPPORTED_HEAD_SIZES = (64, 80, 96, 112, 128, 256)
    SUPPORTED_BLOCK_SIZES = (8, 16, 32)
    SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        if self.device.type not in ("cuda", "musa"):
            raise ValueError(f"the native attention backend runs on cuda or musa devices, not {self.device}")
        self.name = self.device.type
        self.ops = load_ops(self.device.type)
        self.num_sms = _multiprocessor_count(self.device)

    # ---- cache
    def allocate_kv_cache(
        self,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> KVCache:
        if head_size not in self.SUPPORTED_HEAD_SIZES:
            raise ValueError(f"native kernels support head sizes {self.SUPPORTED_HEAD_SIZES}, not {head_size}")
        if block_size not in self.SUPPORTED_BLOCK_SIZES:
            raise ValueError(f"native kernels support block sizes {self.SUPPORTED_BLOCK_SIZES}, not {block_size}")
        if dtype not in self.SUPPORTED_DTYPES:
            raise ValueError(f"native kernels support {self.SUPPORTED_DTYPES}, not {dtype}")
        return paged_reference.new_kv_cache(num_blocks, block_size, num_kv_heads, head_size, dtype, device)

    def write_kv(self, kv_cache: KVCache, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        key_cache, value_cache = kv_cache
        # The kernel takes any token stride but needs each token's heads packed
        # ([.., kv_heads, head_size] with unit inner strides) and the cache dtype.
        key, value = (_packed_heads(t).to(key_cache.dtype) for t in (key, value))
        self.ops.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping.to(torch.int64))

    def copy_blocks(self, kv_caches: list[KVCache], src: torch.Tensor, dst: torch.Tensor) -> None:
        if not kv_caches or src.numel() == 0:
            return
        mapping = torch.stack([src.to(torch.int64), dst.to(torch.int64)], dim=1)  # [num_pairs, 2]
        self.ops.copy_blocks([k for k, _ in kv_caches], [v for _, v in kv_caches], mapping)

    # ---- attention
    def attend(self, query: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """query [num_tokens, num_heads, head_size] → same shape."""
        if meta.is_decode_only:
            return self.decode(query, kv_cache, meta.block_tables, meta.seq_lens, meta.max_seq_len, scale)
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        starts = [0]
        for n in meta.query_lens_cpu:
            starts.append(starts[-1] + n)
        decode_seqs = [i for i, n in enumerate(meta.query_lens_cpu) if n == 1]
        if decode_seqs:
            seq_idx = torch.tensor(decode_seqs, dtype=torch.long).to(query.device, non_blocking=True)
            tok_idx = torch.tensor([starts[i] for i in decode_seqs], dtype=torch.long).to(query.device, non_blocking=True)
            max_len = max(meta.seq_lens_cpu[i] for i in decode_seqs)
            out[tok_idx] = self.decode(
                query[tok_idx],
                kv_cache,
                meta.block_tables[seq_idx].contiguous(),
                meta.seq_lens[seq_idx].contiguous(),
                max_len,
                scale,
            )
        key_cache, value_cache = kv_cache
        for i, n in enumerate(meta.query_lens_cpu):
            if n > 1:
                s, e = starts[i], starts[i + 1]
                out[s:e] = self.prefill_one(query[s:e], key_cache, value_cache, meta.block_tables[i], meta.seq_lens_cpu[i], scale)
        return out

    def use_v2(self, num_seqs: int, num_heads: int, num_kv_heads: int, max_seq_len: int) -> bool:
        """v2 when the context spans several partitions and v1 would leave the device under-filled."""
        if max_seq_len <= self.PARTITION_SIZE:
            return False
        group = num_heads // num_kv_heads
        ctas_v1 = num_seqs * num_kv_heads * math.ceil(group / 8)
        return ctas_v1 < self.MIN_CTAS_PER_SM * self.num_sms

    def decode(
        self,
        query: torch.Tensor,
        kv_cache: KVCache,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        max_seq_len: int,
        scale: float,
        partition_size: int | None = None,
    ) -> torch.Tensor:
        """One query token per sequence. query [num_seqs, num_heads, head_size]; block_tables
        [num_seqs, max_blocks] int32; seq_lens [num_seqs] int32. partition_size: None picks
        v1/v2, 0 forces v1, >0 forces v2 with that partition."""
        key_cache, value_cache = kv_cache
        query = _packed_heads(query)
        if partition_size is None:
            v2 = self.use_v2(query.shape[0], query.shape[1], key_cache.shape[1], max_seq_len)
            partition_size = self.PARTITION_SIZE if v2 else 0
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        self.ops.paged_attention(
            out,
            query,
            key_cache,
            value_cache,
            block_tables.to(torch.int32).contiguous(),
            seq_lens.to(torch.int32).contiguous(),
            float(scale),
            int(max_seq_len),
            int(partition_size),
        )
        return out

    @staticmethod
    def prefill_one(
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_table: torch.Tensor,
        seq_len: int,
        scale: float,
    ) -> torch.Tensor:
        """The last n = query.shape[0] tokens of one sequence over its whole context
        (cached prefix + this chunk, already in the cache). query [n, num_heads, d] → same."""
        n, num_heads, _ = query.shape
        k, v = paged_reference.gather_kv(key_cache, value_cache, block_table, seq_len)  # [L, kv_heads, d]
        group = num_heads // k.shape[1]
        if group > 1:
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
        q4 = query.transpose(0, 1).unsqueeze(0)  # [1, H, n, d]
        k4 = k.transpose(0, 1).unsqueeze(0)  # [1, H, L, d]
        v4 = v.transpose(0, 1).unsqueeze(0)
        if n == seq_len:  # no cached prefix: plain causal
            o = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=scale)
        else:
            # Query j is at position seq_len - n + j and sees keys 0..that position.
            pos = torch.arange(seq_len - n, seq_len, device=query.device)[:, None]
            mask = torch.arange(seq_len, device=query.device)[None, :] <= pos  # [n, L]
            o = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, scale=scale)
        return o.squeeze(0).transpose(0, 1)
