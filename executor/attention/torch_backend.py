"""Paged attention in plain torch: any device's fallback, the cpu backend's prefill path, and the
reference for the native kernels.

KV layout (per layer, K and V alike): ``[num_kv_heads, num_blocks, block_size, head_size]``,
head-major, so that gathering a batch's blocks yields ``[kv_heads, num_seqs, ctx_len, head_size]``
whose per-(sequence, head) matrices are contiguous, which is what SDPA reads fastest; a flat view
``[num_kv_heads, num_blocks * block_size, head_size]`` is indexed by slot, so writing new K/V
is one ``index_copy_``.

Attention is batched over sequences, never a loop over them. Once per step (the
first layer) the metadata is turned into a plan of groups:

- one decode group (sequences with one new token): their blocks are gathered into
  ``[num_seqs, kv_heads, ctx_len, head_size]`` and one masked attention runs with a key
  mask ``j < seq_len``;
- prefill groups (chunks of more than one token, with or without a cached prefix):
  queries are padded to the group's ``max_query_len`` and the causal mask is offset by each
  sequence's cached prefix: query ``i`` sees key ``j`` iff
  ``j <= seq_len - query_len + i`` (and ``j < seq_len``). Chunks of like size share a group;
  a group takes another chunk only while its padded work (sequences x longest chunk x
  longest context) stays within ``PREFILL_PADDING`` times the work its chunks need, so
  an 800-token prompt beside 20-token ones is not paid for eight times over.

A group's masked attention is SDPA, except in bf16 on the CPU where two oneDNN GEMMs and a
softmax are faster (``_masked_attention``). GQA without copying K/V: the
``group = num_heads // num_kv_heads`` query heads that share a KV head are laid out as
extra query rows of that KV head, so the attention sees
``[num_seqs, kv_heads, group * query_len, head_size]`` against
``[num_seqs, kv_heads, ctx_len, head_size]``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from executor.attention.base import AttentionBackend, AttentionMetadata, KVCache, zeroed_cache


@dataclass
class _Group:
    """Sequences attended together, and where their tokens sit in the flat batch."""

    block_tables: torch.Tensor  # [num_seqs, blocks_per_seq] int32, the group's rows of the step's tables
    seq_lens: torch.Tensor  # [num_seqs] int32
    token_index: torch.Tensor  # [n_tokens] positions in the flat token dim
    padded_index: torch.Tensor | None  # [n_tokens] rows in [num_seqs * query_len]; None: no padding needed
    # [num_seqs * query_len]: each padded row's token in the group, n_tokens (a zero row) for padding
    padded_source: torch.Tensor | None
    block_ids: torch.Tensor  # [num_seqs * blocks_per_seq] blocks to gather, sequence-major
    mask: torch.Tensor  # [num_seqs, 1, query_len, ctx_len] bool, True = attend
    first_query_pos: torch.Tensor  # [num_seqs] int32: the position of each sequence's first query token
    num_seqs: int
    query_len: int
    ctx_len: int
    # The mask as SDPA wants it, built on first use: additive (0 / -inf) in the compute dtype,
    # rows repeated per query head of a KV-head group. Keyed by (group_size, dtype).
    sdpa_masks: dict = field(default_factory=dict)
    # Rows of the flat [kv_heads * num_blocks, block_size * head_size] cache view to gather,
    # head-major; keyed by (kv_heads, num_blocks).
    gather_rows: dict = field(default_factory=dict)
    # A long prefill's query chunks (the cpu backend's causal GEMMs), the same in every layer:
    # keyed by the chunk length.
    query_chunks: dict = field(default_factory=dict)

    def causal_query_chunks(self, chunk: int) -> list[tuple[int, int, int, torch.Tensor, torch.Tensor]]:
        """Per chunk of ``chunk`` query tokens: (t0, t1, keys its last token sees, each sequence's
        first query position in it, its keys seen) — [num_seqs] int32 tensors."""
        if chunk not in self.query_chunks:
            first, lens = self.first_query_pos.tolist(), self.seq_lens.tolist()
            chunks = []
            for t0 in range(0, self.query_len, chunk):
                t1 = min(t0 + chunk, self.query_len)
                chunk_lens = [min(n, f + t1) for f, n in zip(first, lens)]
                # a shorter sequence's padding rows past its prompt: any valid mask (their output is dropped)
                chunk_first = [min(f + t0, n - 1) for f, n in zip(first, chunk_lens)]
                chunks.append((t0, t1, max(chunk_lens), torch.tensor(chunk_first, dtype=torch.int32),
                               torch.tensor(chunk_lens, dtype=torch.int32)))
            self.query_chunks[chunk] = chunks
        return self.query_chunks[chunk]

    def cache_rows(self, kv_heads: int, num_blocks: int) -> torch.Tensor:
        key = (kv_heads, num_blocks)
        if key not in self.gather_rows:
            head_offsets = torch.arange(kv_heads, device=self.block_ids.device).view(-1, 1) * num_blocks
            self.gather_rows[key] = (head_offsets + self.block_ids.view(1, -1)).reshape(-1)
        return self.gather_rows[key]

    def sdpa_mask(self, group_size: int, dtype: torch.dtype) -> torch.Tensor:
        key = (group_size, dtype)
        if key not in self.sdpa_masks:
            allowed = self.mask.repeat(1, 1, group_size, 1)  # rows: (group, query)
            additive = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
            self.sdpa_masks[key] = additive.masked_fill_(~allowed, float("-inf"))
        return self.sdpa_masks[key]


# A prefill group's padded attention work may be this many times what its chunks need.
PREFILL_PADDING = 1.5


def prefill_groups(meta: AttentionMetadata, seqs: list[int]) -> list[list[int]]:
    """The prefill chunks ``seqs`` in groups of like size: longest chunk first, each joining the
    group before it while that group's padded work stays within ``PREFILL_PADDING`` of its own."""
    query_lens, seq_lens = meta.query_lens_cpu, meta.seq_lens_cpu
    groups: list[list[int]] = []
    needed = 0  # the last group's own work: sum of query_len x seq_len
    for s in sorted(seqs, key=lambda s: (query_lens[s], seq_lens[s]), reverse=True):
        work = query_lens[s] * seq_lens[s]
        if groups:
            group = groups[-1]
            longest_context = max(seq_lens[s], max(seq_lens[g] for g in group))
            padded = (len(group) + 1) * query_lens[group[0]] * longest_context
            if padded <= PREFILL_PADDING * (needed + work):
                group.append(s)
                needed += work
                continue
        groups.append([s])
        needed = work
    # Each group's sequences in batch order: a group holding every token is the batch's own layout.
    return [sorted(group) for group in groups]


def _make_group(meta: AttentionMetadata, seqs: list[int], device: torch.device) -> _Group:
    bs = meta.block_size
    query_lens = [meta.query_lens_cpu[s] for s in seqs]
    seq_lens = [meta.seq_lens_cpu[s] for s in seqs]
    starts = meta.query_start_loc.tolist()
    query_len = max(query_lens)
    blocks_per_seq = -(-max(seq_lens) // bs)
    ctx_len = blocks_per_seq * bs
    seq_index = torch.tensor(seqs, dtype=torch.long, device=device)
    block_tables = meta.block_tables.index_select(0, seq_index)[:, :blocks_per_seq].contiguous()
    block_ids = block_tables.reshape(-1).long()
    token_index = torch.tensor(
        [starts[s] + i for s, n in zip(seqs, query_lens) for i in range(n)], dtype=torch.long, device=device
    )
    padded_index = padded_source = None  # equal query lengths: the tokens already form [num_seqs, query_len]
    if any(n != query_len for n in query_lens):
        rows = [row * query_len + i for row, n in enumerate(query_lens) for i in range(n)]
        padded_index = torch.tensor(rows, dtype=torch.long, device=device)
        source = [len(rows)] * (len(seqs) * query_len)
        for token, row in enumerate(rows):
            source[row] = token
        padded_source = torch.tensor(source, dtype=torch.long, device=device)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    seq_len_t = seq_lens_t.long().view(-1, 1, 1)
    first_query_pos = seq_len_t - torch.tensor(query_lens, dtype=torch.long, device=device).view(-1, 1, 1)
    key_pos = torch.arange(ctx_len, device=device).view(1, 1, -1)
    query_pos = first_query_pos + torch.arange(query_len, device=device).view(1, -1, 1)
    mask = (key_pos <= query_pos) & (key_pos < seq_len_t)  # [num_seqs, query_len, ctx_len]
    return _Group(block_tables, seq_lens_t, token_index, padded_index, padded_source, block_ids, mask.unsqueeze(1),
                  first_query_pos.view(-1).to(torch.int32), len(seqs), query_len, ctx_len)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    reads_other_kv_dtype = True

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        # The plan is derived from the step's metadata on the first layer and reused by the rest.
        self._plan_meta: AttentionMetadata | None = None
        self._plan: list[_Group] = []
        self._plan_order: torch.Tensor | None = None  # each token's row in the groups' outputs, concatenated
        self._checked_slots: torch.Tensor | None = None
        self._slots_all_valid = True

    def allocate_kv_cache(self, num_blocks, block_size, num_kv_heads, head_size, dtype, device) -> KVCache:
        shape = (num_kv_heads, num_blocks, block_size, head_size)
        return zeroed_cache(shape, dtype, device), zeroed_cache(shape, dtype, device)

    def write_kv(self, kv_cache: KVCache, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        # key, value: [num_tokens, num_kv_heads, head_size]; slot_mapping: [num_tokens]
        key, value, slot_mapping = self._writable(key, value, slot_mapping)
        for cache, new in zip(kv_cache, (key, value)):
            _write_token_rows(cache, new, slot_mapping)

    def _writable(self, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor):
        """key, value and slot_mapping without the tokens whose slot is -1 (not to be written)."""
        # Every layer gets the same slot_mapping: check it for skipped slots once.
        if slot_mapping is not self._checked_slots:
            self._slots_all_valid = not bool((slot_mapping < 0).any())
            self._checked_slots = slot_mapping
        if not self._slots_all_valid:
            keep = slot_mapping >= 0
            key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
        return key, value, slot_mapping

    def copy_blocks(self, kv_caches: list[KVCache], src: torch.Tensor, dst: torch.Tensor) -> None:
        for key_cache, value_cache in kv_caches:
            key_cache.index_copy_(1, dst, key_cache.index_select(1, src))
            value_cache.index_copy_(1, dst, value_cache.index_select(1, src))

    def _groups(self, meta: AttentionMetadata) -> list[_Group]:
        if meta is not self._plan_meta:
            device = meta.block_tables.device
            decode = [s for s, n in enumerate(meta.query_lens_cpu) if n == 1]
            prefill = [s for s, n in enumerate(meta.query_lens_cpu) if n > 1]
            self._plan = [_make_group(meta, seqs, device)
                          for seqs in ([decode] if decode else []) + prefill_groups(meta, prefill)]
            grouped = torch.cat([g.token_index for g in self._plan])
            self._plan_order = torch.empty_like(grouped)
            self._plan_order[grouped] = torch.arange(grouped.numel(), device=device)
            self._plan_meta = meta
        return self._plan

    def attend(self, query: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        # query: [num_tokens, num_heads, head_size] → [num_tokens, num_heads, head_size]
        groups = self._groups(meta)
        if len(groups) == 1 and groups[0].token_index.numel() == query.shape[0]:
            return self._attend_group(query, kv_cache, groups[0], scale)
        # The decode tokens, then the prefill chunks by size; gathers (index_select), which run several
        # times faster than indexing with a tensor and than scattering into the output.
        outs = [self._attend_group(query.index_select(0, g.token_index), kv_cache, g, scale) for g in groups]
        return torch.cat(outs).index_select(0, self._plan_order)

    def _gather_keys(self, key_cache: torch.Tensor, g: _Group) -> torch.Tensor:
        """The group's keys, [num_seqs, kv_heads, ctx_len, head_size]."""
        return _gather_token_rows(key_cache, g)

    def _gather_values(self, value_cache: torch.Tensor, g: _Group) -> torch.Tensor:
        """The group's values, [num_seqs, kv_heads, ctx_len, head_size]."""
        return _gather_token_rows(value_cache, g)

    def _attend_group(self, query: torch.Tensor, kv_cache: KVCache, g: _Group, scale: float) -> torch.Tensor:
        # query: [n_tokens, num_heads, head_size], the group's tokens in flat order
        key_cache, value_cache = kv_cache
        # computed in the query's dtype, whatever the cache holds (a bf16 cache of a float32 model)
        keys = self._gather_keys(key_cache, g).to(query.dtype)
        values = self._gather_values(value_cache, g).to(query.dtype)
        q = rows_per_kv_head(query, g, keys.shape[1])
        out = self._masked_attention(q, keys, values, g, scale)
        return tokens_from_rows(out, g, query.shape[1])

    def _masked_attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, g: _Group,
                          scale: float) -> torch.Tensor:
        # q: [num_seqs, kv_heads, group * query_len, d]; keys, values: [num_seqs, kv_heads, ctx_len, d]
        return _masked_attention(q, keys, values, g.sdpa_mask(q.shape[2] // g.query_len, q.dtype), scale)


def rows_per_kv_head(query: torch.Tensor, g: _Group, kv_heads: int) -> torch.Tensor:
    """A group's query tokens as rows of their KV heads: [n_tokens, heads, d] → [num_seqs, kv_heads,
    group * query_len, d], the query heads sharing a KV head one after another (GQA without copying
    K/V), shorter chunks padded with zero rows to the group's query length."""
    num_heads, head_size = query.shape[1], query.shape[2]
    if g.padded_source is not None:  # a gather from the tokens and a zero row, not a scatter into zeros
        query = torch.cat([query, query.new_zeros(1, num_heads, head_size)]).index_select(0, g.padded_source)
    q = query.view(g.num_seqs, g.query_len, kv_heads, num_heads // kv_heads, head_size).permute(0, 2, 3, 1, 4)
    return q.reshape(g.num_seqs, kv_heads, num_heads // kv_heads * g.query_len, head_size)


def tokens_from_rows(out: torch.Tensor, g: _Group, num_heads: int) -> torch.Tensor:
    """rows_per_kv_head's inverse: [num_seqs, kv_heads, group * query_len, d] → [n_tokens, heads, d]."""
    kv_heads, head_size = out.shape[1], out.shape[3]
    out = out.view(g.num_seqs, kv_heads, num_heads // kv_heads, g.query_len, head_size).permute(0, 3, 1, 2, 4)
    out = out.reshape(g.num_seqs * g.query_len, num_heads, head_size)
    return out if g.padded_index is None else out.index_select(0, g.padded_index)


# Above this many scores per step the [rows, ctx_len] matrix is not materialized (bf16: 64 MiB).
MATMUL_ATTENTION_MAX_SCORES = 32 << 20


def _masked_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                      scale: float) -> torch.Tensor:
    # q: [num_seqs, kv_heads, rows, d]; keys, values: [num_seqs, kv_heads, ctx_len, d];
    # mask: [num_seqs, 1, rows, ctx_len] additive → [num_seqs, kv_heads, rows, d]
    if q.dtype == torch.bfloat16 and q.device.type == "cpu" and \
            q.shape[0] * q.shape[1] * q.shape[2] * keys.shape[2] <= MATMUL_ATTENTION_MAX_SCORES:
        # On the CPU, bf16 SDPA (flash) with a mask runs at a fraction of oneDNN's bf16 GEMMs:
        # two GEMMs and a softmax (accumulated in fp32) are 1.7x faster for a 512-token prefill.
        scores = torch.matmul(q * scale, keys.transpose(-1, -2)).add_(mask)
        return torch.matmul(scores.softmax(dim=-1), values)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)


def _write_token_rows(cache: torch.Tensor, new: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """new [num_tokens, kv_heads, head_size] into a [kv_heads, num_blocks, block_size, head_size] cache."""
    kv_heads, _, _, head_size = cache.shape
    # [kv_heads, num_blocks * block_size, head_size] indexed by slot along dim 1
    cache.view(kv_heads, -1, head_size).index_copy_(1, slot_mapping, new.transpose(0, 1).to(cache.dtype))


def _gather_token_rows(cache: torch.Tensor, g: _Group) -> torch.Tensor:
    """The group's blocks of a [kv_heads, num_blocks, block_size, head_size] cache as
    [num_seqs, kv_heads, ctx_len, head_size]: a view whose (seq, head) matrices are contiguous."""
    kv_heads, num_blocks, _, head_size = cache.shape
    rows = cache.view(kv_heads * num_blocks, -1).index_select(0, g.cache_rows(kv_heads, num_blocks))
    return rows.view(kv_heads, g.num_seqs, g.ctx_len, head_size).transpose(0, 1)
