"""Paged attention on the CPU: decode tokens in a compiled kernel that reads blocks in place.

The plain torch backend gathers every decode sequence's blocks into one contiguous
tensor per layer before SDPA; at batch 32 x 1024 tokens that copy costs as much as
the attention. ``csrc/cpu/paged_decode_attention.cpp`` streams each sequence over its own
blocks instead. Its layout, per layer, block-major:

- K ``[num_blocks, num_kv_heads, head_size, block_size]``: each tile transposed, so one
  block's 16 scores are broadcast-FMAs into one vector register;
- V ``[num_blocks, num_kv_heads, block_size, head_size]``.

Block-major because blocks are scattered once sequences come and go: one block's K tiles for
every head (SmolLM2: 3 x 2 KiB) are one stretch of memory, read at ~1.5x the speed of separate
tiles each in a page of its own, while consecutive blocks still make one sequential stream
(``python -m bench.attention_bench`` measures both layouts).

Prefill chunks (more than one new token per sequence), where the CPU has AVX-512 BF16 (its products
on AMX bf16 tiles where there are some) and the model computes in bf16, go to
``paged_prefill_attention`` (``csrc/cpu/prefill_attention.cpp``): per 16 query rows, scores, an
online softmax and the values in one pass over 64-key chunks read from the blocks where they lie, so
neither the gathered K/V nor the [rows, ctx_len] scores go through memory; a step's chunks go in one
call, their query rows read and their outputs written where the step's tokens lie (no groups). A
float32 model's prefill chunks on a CPU with AVX2 and no AVX-512 (bf16 emulated: the model computes
in float32) go to
``paged_prefill_attention_f32`` (``csrc/cpu/prefill_attention_f32.cpp``), the same idea in float32 FMAs over
a float32, bf16 or int8 cache. Elsewhere they gather their blocks as the torch backend does and attend with two
oneDNN GEMMs around ``causal_softmax_`` (``csrc/cpu/causal_softmax.cpp``), which masks and
normalizes each score row in one pass, where torch needed an additive mask, an add and a softmax
(SDPA beyond ``MATMUL_ATTENTION_MAX_SCORES``). The kernels want ``block_size`` 16 and a
``head_size`` that is a multiple of 16 (32 for prefill); with other shapes every group takes the
torch path.

``--kv-cache-dtype int8`` (``CpuInt8KVAttentionBackend``) keeps K and V as int8 codes with one
float32 scale per token and KV head, about half the bytes a decode step reads (at concurrency 32 the
attention reads about as many bytes as the int8 weights): each (block, head) tile is then a
record of the tile's codes followed by the block's 16 scales (``csrc/cpu/write_kv.cpp``).

The kernel is compiled on first use (``csrc/build.py``; ``make install`` does it ahead; cached on disk
and keyed by the CPU's features); ``create_backend("auto")`` falls back to the torch
backend with a warning where no compiler is available.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from executor.attention.base import AttentionMetadata, KVCache, zeroed_cache
from executor.attention.csrc_loader import csrc_build_script
from executor.attention.torch_backend import (MATMUL_ATTENTION_MAX_SCORES, TorchAttentionBackend, _Group, _make_group,
                                             rows_per_kv_head, tokens_from_rows)
from executor.layer_ops import CpuLayerOps

KERNEL_BLOCK_SIZE = 16
# Prefill chunks of more query tokens than this take the attention's GEMMs in chunks of this many.
CAUSAL_QUERY_CHUNK = 128


@dataclass
class _PrefillRows:
    """A step's sequences of more than one query token, as ``paged_prefill_attention`` takes them in one
    call, and its decode tokens (a group for the decode kernel), the same in every layer."""

    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    query_starts: torch.Tensor  # [num_seqs] int32: each sequence's first query row among the step's tokens
    first_query_pos: torch.Tensor  # [num_seqs] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    decode: _Group | None


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(self, device: torch.device):
        super().__init__(device)
        if self.device.type != "cpu":
            raise ValueError(f"the cpu attention backend runs on the CPU, not {self.device}")
        self._ops = csrc_build_script().load_cpu()
        self.greedy_sample = self._ops.greedy_sample
        self.layer_ops = CpuLayerOps(self._ops)
        self.skinny_matmul_ops = self._ops
        self._kernel_fits = True
        # Prefill chunks fused (AVX-512 BF16 or AMX), for bf16 models whose head size the kernel takes
        # (set once the cache is allocated); elsewhere the two GEMMs around causal_softmax_.
        self._fused_prefill = False
        # A float32 model's prefill chunks fused on a CPU with AVX2 and no AVX-512, over a float32 or
        # bf16 cache (set once the cache is allocated).
        self._fused_prefill_f32 = False
        self._prefill_meta: AttentionMetadata | None = None
        self._prefill_rows: _PrefillRows | None = None

    def allocate_kv_cache(self, num_blocks, block_size, num_kv_heads, head_size, dtype, device) -> KVCache:
        self._kernel_fits = block_size == KERNEL_BLOCK_SIZE and head_size % KERNEL_BLOCK_SIZE == 0
        self._fused_prefill = self._fused_prefill_fits(block_size, head_size, dtype)
        self._fused_prefill_f32 = self._fused_prefill_f32_fits(block_size, head_size) and \
            dtype in (torch.float32, torch.bfloat16)
        key_cache = zeroed_cache((num_blocks, num_kv_heads, head_size, block_size), dtype, device)
        value_cache = zeroed_cache((num_blocks, num_kv_heads, block_size, head_size), dtype, device)
        return key_cache, value_cache

    def _fused_prefill_f32_fits(self, block_size: int, head_size: int) -> bool:
        return bool(self._ops.has_prefill_attention_f32()) and block_size == KERNEL_BLOCK_SIZE and \
            head_size % KERNEL_BLOCK_SIZE == 0 and head_size <= 256

    def _fused_prefill_fits(self, block_size: int, head_size: int, dtype: torch.dtype) -> bool:
        return bool(self._ops.has_prefill_attention()) and block_size == KERNEL_BLOCK_SIZE and \
            head_size % 32 == 0 and head_size <= 256 and dtype == torch.bfloat16

    def write_kv(self, kv_cache: KVCache, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        # key, value: [num_tokens, num_kv_heads, head_size]; slot_mapping: [num_tokens]
        key_cache, value_cache = kv_cache
        self._ops.write_kv(key, value, key_cache, value_cache, slot_mapping)  # rounded to the cache's dtype

    def attend(self, query: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        # query: [num_tokens, num_heads, head_size] → [num_tokens, num_heads, head_size]
        if not self._fused_prefill or query.dtype != torch.bfloat16 or meta.max_query_len == 1:
            return super().attend(query, kv_cache, meta, scale)
        # Every prefill chunk in one call, read and written where its tokens lie (no groups, no padding).
        rows = self._prefill_plan(meta)
        if query.stride(2) != 1 or query.stride(1) != query.shape[2]:
            query = query.contiguous()
        key_cache, value_cache = kv_cache
        out = torch.empty(query.shape, dtype=query.dtype)
        self._ops.paged_prefill_attention(query, key_cache, value_cache, rows.block_tables, rows.query_starts,
                                          rows.first_query_pos, rows.seq_lens, scale, out)
        if rows.decode is not None:
            index = rows.decode.token_index
            out.index_copy_(0, index, self._attend_group(query.index_select(0, index), kv_cache, rows.decode, scale))
        return out

    def _prefill_plan(self, meta: AttentionMetadata) -> _PrefillRows:
        if meta is not self._prefill_meta:
            prefill = [s for s, n in enumerate(meta.query_lens_cpu) if n > 1]
            decode = [s for s, n in enumerate(meta.query_lens_cpu) if n == 1]
            index = torch.tensor(prefill, dtype=torch.long)
            lens = [meta.seq_lens_cpu[s] for s in prefill]
            first = [n - meta.query_lens_cpu[s] for s, n in zip(prefill, lens)]
            self._prefill_rows = _PrefillRows(
                meta.block_tables.index_select(0, index).contiguous(),
                meta.query_start_loc.index_select(0, index).to(torch.int32),
                torch.tensor(first, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32),
                _make_group(meta, decode, self.device) if decode else None)
            self._prefill_meta = meta
        return self._prefill_rows

    def decode_kernel_inputs(self, meta, kv_cache, dtype):
        # decode_layer takes the int8 cache's records too (its _int8 kernels, the same arguments)
        if meta.max_query_len != 1 or not self._kernel_fits:
            return None  # prompt tokens, or shapes the kernel refuses
        (group,) = self._groups(meta)
        return group.block_tables, group.seq_lens

    def copy_blocks(self, kv_caches: list[KVCache], src: torch.Tensor, dst: torch.Tensor) -> None:
        for key_cache, value_cache in kv_caches:
            key_cache.index_copy_(0, dst, key_cache.index_select(0, src))
            value_cache.index_copy_(0, dst, value_cache.index_select(0, src))

    def _gather_keys(self, key_cache: torch.Tensor, g: _Group) -> torch.Tensor:
        _, kv_heads, head_size, block_size = key_cache.shape
        tiles = key_cache.index_select(0, g.block_ids)
        # [num_seqs, blocks, kv_heads, head_size, block_size] → [num_seqs, kv_heads, ctx_len, head_size]
        tiles = tiles.view(g.num_seqs, -1, kv_heads, head_size, block_size).permute(0, 2, 1, 4, 3)
        return tiles.reshape(g.num_seqs, kv_heads, g.ctx_len, head_size)

    def _gather_values(self, value_cache: torch.Tensor, g: _Group) -> torch.Tensor:
        _, kv_heads, block_size, head_size = value_cache.shape
        tiles = value_cache.index_select(0, g.block_ids)
        # [num_seqs, blocks, kv_heads, block_size, head_size] → [num_seqs, kv_heads, ctx_len, head_size]
        tiles = tiles.view(g.num_seqs, -1, kv_heads, block_size, head_size).transpose(1, 2)
        return tiles.reshape(g.num_seqs, kv_heads, g.ctx_len, head_size)

    def _attend_group(self, query: torch.Tensor, kv_cache: KVCache, g: _Group, scale: float) -> torch.Tensor:
        # query: [n_tokens, num_heads, head_size], the group's tokens in flat order
        # A float32 model over a bf16 cache (--dtype float32 where the CPU has bf16) is not rounded to
        # bf16 queries: its prompt attends in float32 over the widened K/V, as over a float32 cache.
        if g.query_len != 1 and self._fused_prefill_f32 and query.dtype == torch.float32:
            return self._fused_prefill_f32_group(query, kv_cache, g, scale)
        if g.query_len != 1 or not self._kernel_fits:
            return super()._attend_group(query, kv_cache, g, scale)
        key_cache, value_cache = kv_cache
        return self._ops.paged_decode_attention(query, key_cache, value_cache, g.block_tables, g.seq_lens, scale)

    def _fused_prefill_f32_group(self, query: torch.Tensor, kv_cache: KVCache, g: _Group, scale: float) -> torch.Tensor:
        """A float32 prefill group's attention in paged_prefill_attention_f32
        (csrc/cpu/prefill_attention_f32.cpp): per unit of query tokens, K/V widened once from the blocks,
        then scores, softmax and values a few rows at a time."""
        key_cache, value_cache = kv_cache
        q = rows_per_kv_head(query, g, key_cache.shape[1])
        out = self._ops.paged_prefill_attention_f32(q, key_cache, value_cache, g.block_tables, g.first_query_pos,
                                                    g.seq_lens, g.query_len, scale)
        return tokens_from_rows(out, g, query.shape[1])

    def _masked_attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, g: _Group,
                          scale: float) -> torch.Tensor:
        # q: [num_seqs, kv_heads, group * query_len, d]; keys, values: [num_seqs, kv_heads, ctx_len, d]
        if q.numel() // q.shape[-1] * keys.shape[2] > MATMUL_ATTENTION_MAX_SCORES:
            return super()._masked_attention(q, keys, values, g, scale)
        if g.query_len <= CAUSAL_QUERY_CHUNK:
            return self._causal_gemms(q, keys, values, g.first_query_pos, g.seq_lens, g.query_len, scale)
        # Query tokens in chunks, each against the keys its last token sees: the GEMMs skip the
        # square's upper triangle (a 512-token prompt: 62 % of the full products in chunks of 128).
        num_seqs, kv_heads, rows, d = q.shape
        group = rows // g.query_len
        q_tokens = q.view(num_seqs, kv_heads, group, g.query_len, d)
        out = torch.empty_like(q_tokens)
        for t0, t1, seen, chunk_first, chunk_lens in g.causal_query_chunks(CAUSAL_QUERY_CHUNK):
            q_chunk = q_tokens[:, :, :, t0:t1].reshape(num_seqs, kv_heads, group * (t1 - t0), d)
            attended = self._causal_gemms(q_chunk, keys[:, :, :seen], values[:, :, :seen], chunk_first,
                                          chunk_lens, t1 - t0, scale)
            out[:, :, :, t0:t1] = attended.view(num_seqs, kv_heads, group, t1 - t0, d)
        return out.view(num_seqs, kv_heads, rows, d)

    def _causal_gemms(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, first_query_pos: torch.Tensor,
                      seq_lens: torch.Tensor, query_len: int, scale: float) -> torch.Tensor:
        # Two oneDNN GEMMs around causal_softmax_, which applies the mask as it goes (no additive
        # mask tensor, no separate add): csrc/cpu/causal_softmax.cpp.
        scores = torch.matmul(q * scale, keys.transpose(-1, -2))
        self._ops.causal_softmax_(scores, first_query_pos, seq_lens, query_len)
        return torch.matmul(scores, values)


class CpuInt8KVAttentionBackend(CpuAttentionBackend):
    """The cpu backend over an int8 KV cache: per layer, K and V ``[num_blocks, num_kv_heads,
    record]`` int8, a record being the tile above (K ``[head_size, 16]``, V ``[16, head_size]``) of
    codes and then 16 float32 scales, one per token: x ~ code * scale, scale = max|x| / 127 over the
    token's head. Decode tokens read it in ``paged_decode_attention_int8``; prefill chunks in
    ``paged_prefill_attention`` where the CPU has AVX-512 BF16 (it widens the codes as it packs them, to the
    same bf16) or in ``paged_prefill_attention_f32`` where a float32 model runs on AVX2 (code * scale in
    float32, as the gather computes it), else they gather their blocks dequantized to the model's dtype
    and take the torch path."""

    def __init__(self, device: torch.device):
        super().__init__(device)
        self._compute_dtype = torch.bfloat16

    def allocate_kv_cache(self, num_blocks, block_size, num_kv_heads, head_size, dtype, device) -> KVCache:
        if block_size != KERNEL_BLOCK_SIZE or head_size % KERNEL_BLOCK_SIZE:
            raise ValueError(f"--kv-cache-dtype int8 needs block_size {KERNEL_BLOCK_SIZE} and a head size that is a "
                             f"multiple of {KERNEL_BLOCK_SIZE} (got {block_size} and {head_size})")
        self._compute_dtype = dtype
        self._fused_prefill = self._fused_prefill_fits(block_size, head_size, dtype)
        self._fused_prefill_f32 = self._fused_prefill_f32_fits(block_size, head_size)
        shape = (num_blocks, num_kv_heads, int8_record_bytes(block_size, head_size))
        return zeroed_cache(shape, torch.int8, device), zeroed_cache(shape, torch.int8, device)

    def write_kv(self, kv_cache: KVCache, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        key_cache, value_cache = kv_cache
        self._ops.write_kv_int8(key, value, key_cache, value_cache, slot_mapping)

    @staticmethod
    def _group_records(cache: torch.Tensor, g: _Group) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The group's blocks' codes [num_seqs * blocks, kv_heads, tile] int8, their scales
        [num_seqs * blocks, kv_heads, 16] float32, and the head size."""
        records = cache.index_select(0, g.block_ids)  # [num_seqs * blocks, kv_heads, record]
        tile = records.shape[-1] - KERNEL_BLOCK_SIZE * 4
        head_size = tile // KERNEL_BLOCK_SIZE
        return records[..., :tile], records[..., tile:].contiguous().view(torch.float32), head_size

    def _gather_keys(self, key_cache: torch.Tensor, g: _Group) -> torch.Tensor:
        codes, scales, head_size = self._group_records(key_cache, g)
        kv_heads = codes.shape[1]
        # codes [n, kv_heads, head_size, 16] * scales [n, kv_heads, 1, 16] → [num_seqs, kv_heads, ctx_len, head_size]
        tiles = (codes.view(-1, kv_heads, head_size, KERNEL_BLOCK_SIZE).float() * scales.unsqueeze(2))
        tiles = tiles.to(self._compute_dtype).view(g.num_seqs, -1, kv_heads, head_size, KERNEL_BLOCK_SIZE)
        return tiles.permute(0, 2, 1, 4, 3).reshape(g.num_seqs, kv_heads, g.ctx_len, head_size)

    def _gather_values(self, value_cache: torch.Tensor, g: _Group) -> torch.Tensor:
        codes, scales, head_size = self._group_records(value_cache, g)
        kv_heads = codes.shape[1]
        # codes [n, kv_heads, 16, head_size] * scales [n, kv_heads, 16, 1] → [num_seqs, kv_heads, ctx_len, head_size]
        tiles = (codes.view(-1, kv_heads, KERNEL_BLOCK_SIZE, head_size).float() * scales.unsqueeze(3))
        tiles = tiles.to(self._compute_dtype).view(g.num_seqs, -1, kv_heads, KERNEL_BLOCK_SIZE, head_size)
        return tiles.transpose(1, 2).reshape(g.num_seqs, kv_heads, g.ctx_len, head_size)

    def _attend_group(self, query: torch.Tensor, kv_cache: KVCache, g: _Group, scale: float) -> torch.Tensor:
        if g.query_len != 1:  # the fused prefill kernel, or the gather of the records and two GEMMs
            return super()._attend_group(query, kv_cache, g, scale)
        key_cache, value_cache = kv_cache
        return self._ops.paged_decode_attention_int8(query, key_cache, value_cache, g.block_tables, g.seq_lens, scale)


def int8_record_bytes(block_size: int, head_size: int) -> int:
    """One (block, KV head) record of the int8 cache: the codes, then a float32 scale per token."""
    return block_size * head_size + block_size * 4
