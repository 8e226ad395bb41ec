"""The torch attention backend against a naive per-sequence reference (no model, random tensors)."""
from __future__ import annotations

import pytest
import torch

from executor.attention import AttentionMetadata
from executor.attention.torch_backend import TorchAttentionBackend

NUM_HEADS, KV_HEADS, HEAD = 6, 2, 16


def make_meta(query_lens, seq_lens, tables, block_size):
    """Metadata for sequences whose new tokens are the last query_len positions of seq_len."""
    slots, starts = [], [0]
    for q, n, table in zip(query_lens, seq_lens, tables):
        for p in range(n - q, n):
            slots.append(table[p // block_size] * block_size + p % block_size)
        starts.append(starts[-1] + q)
    width = max(len(t) for t in tables)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        query_lens_cpu=list(query_lens), seq_lens_cpu=list(seq_lens),
        max_query_len=max(query_lens), max_seq_len=max(seq_lens), block_size=block_size,
    )


def reference(query, keys_per_seq, values_per_seq, query_lens, scale):
    """Per sequence: causal attention of its last query_len positions over all its keys (GQA by repeat)."""
    out, start = [], 0
    for q_len, k, v in zip(query_lens, keys_per_seq, values_per_seq):
        q = query[start:start + q_len].transpose(0, 1).double()  # [H, q, D]
        k = k.repeat_interleave(NUM_HEADS // KV_HEADS, dim=1).transpose(0, 1).double()  # [H, n, D]
        v = v.repeat_interleave(NUM_HEADS // KV_HEADS, dim=1).transpose(0, 1).double()
        n = k.shape[1]
        scores = q @ k.transpose(1, 2) * scale
        allowed = torch.arange(n).view(1, -1) <= (n - q_len + torch.arange(q_len)).view(-1, 1)
        scores = scores.masked_fill(~allowed, float("-inf"))
        out.append((scores.softmax(-1) @ v).transpose(0, 1))
        start += q_len
    return torch.cat(out).float()


@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("query_lens,seq_lens", [
    ([1, 1, 1], [1, 17, 40]),  # decode only, ragged contexts
    ([9, 33], [9, 50]),  # prefill from scratch, and a chunk after a cached prefix
    ([1, 12, 1, 7], [30, 12, 3, 40]),  # mixed prefill chunks and decode tokens
    ([20], [20]),  # one prompt
])
def test_torch_backend_matches_reference(block_size, query_lens, seq_lens):
    torch.manual_seed(0)
    backend = TorchAttentionBackend(torch.device("cpu"))
    num_blocks = 1 + sum(-(-n // block_size) for n in seq_lens) + 3
    cache = backend.allocate_kv_cache(num_blocks, block_size, KV_HEADS, HEAD, torch.float32, torch.device("cpu"))
    # Hand out blocks in a shuffled order so tables are not contiguous.
    free = torch.randperm(num_blocks - 1).add(1).tolist()
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in seq_lens]
    keys = [torch.randn(n, KV_HEADS, HEAD) for n in seq_lens]
    values = [torch.randn(n, KV_HEADS, HEAD) for n in seq_lens]
    # The cached prefixes are already in the cache ...
    prefix_meta = make_meta([n - q for q, n in zip(query_lens, seq_lens) if n > q],
                            [n - q for q, n in zip(query_lens, seq_lens) if n > q],
                            [t for t, q, n in zip(tables, query_lens, seq_lens) if n > q], block_size) \
        if any(n > q for q, n in zip(query_lens, seq_lens)) else None
    if prefix_meta is not None:
        backend.write_kv(cache, torch.cat([k[: n - q] for k, q, n in zip(keys, query_lens, seq_lens)]),
                         torch.cat([v[: n - q] for v, q, n in zip(values, query_lens, seq_lens)]), prefix_meta.slot_mapping)
    # ... and this step writes the new tokens' K/V, then attends.
    meta = make_meta(query_lens, seq_lens, tables, block_size)
    backend.write_kv(cache, torch.cat([k[n - q:] for k, q, n in zip(keys, query_lens, seq_lens)]),
                     torch.cat([v[n - q:] for v, q, n in zip(values, query_lens, seq_lens)]), meta.slot_mapping)
    query = torch.randn(sum(query_lens), NUM_HEADS, HEAD)
    out = backend.attend(query, cache, meta, HEAD**-0.5)
    expected = reference(query, keys, values, query_lens, HEAD**-0.5)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_write_kv_skips_negative_slots_and_copy_blocks():
    backend = TorchAttentionBackend(torch.device("cpu"))
    cache = backend.allocate_kv_cache(4, 2, 1, 2, torch.float32, torch.device("cpu"))  # one KV head: slot order
    key = torch.arange(6, dtype=torch.float32).view(3, 1, 2)
    backend.write_kv(cache, key, -key, torch.tensor([2, -1, 3]))
    assert cache[0].view(-1, 1, 2)[2].tolist() == [[0.0, 1.0]]
    assert cache[0].view(-1, 1, 2)[3].tolist() == [[4.0, 5.0]]
    assert cache[0].view(-1, 1, 2)[:2].abs().sum() == 0  # nothing landed in the null block
    backend.copy_blocks([cache], torch.tensor([1]), torch.tensor([2]))
    assert torch.equal(cache[0][:, 2], cache[0][:, 1]) and torch.equal(cache[1][:, 2], cache[1][:, 1])
    assert cache[0][:, 1].abs().sum() > 0
