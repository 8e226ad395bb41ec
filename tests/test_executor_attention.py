"""The CPU attention backends (plain torch, and the compiled decode kernel) against a naive
per-sequence reference (no model, random tensors)."""
from __future__ import annotations

import pytest
import torch

import executor.attention.cpu_backend as cpu_backend
from executor.attention import AttentionMetadata, create_backend
from executor.attention.cpu_backend import CAUSAL_QUERY_CHUNK, CpuAttentionBackend, CpuInt8KVAttentionBackend
from executor.attention.torch_backend import TorchAttentionBackend

NUM_HEADS, KV_HEADS, HEAD = 6, 2, 16
BACKENDS = {"torch": TorchAttentionBackend, "cpu": CpuAttentionBackend}


def key_at(backend, cache, slot: int) -> torch.Tensor:
    """The stored key of one slot, [kv_heads, head_size], whatever the backend's layout."""
    key_cache = cache[0]
    if isinstance(backend, CpuAttentionBackend):  # [blocks, kv_heads, head_size, block_size]
        return key_cache[slot // key_cache.shape[3], :, :, slot % key_cache.shape[3]]
    return key_cache[:, slot // key_cache.shape[2], slot % key_cache.shape[2], :]


def block_of(backend, part: torch.Tensor, block: int) -> torch.Tensor:
    """One block of a K or V cache, all heads, whatever the backend's layout."""
    return part[block] if isinstance(backend, CpuAttentionBackend) else part[:, block]


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
    group = query.shape[1] // keys_per_seq[0].shape[1]
    for q_len, k, v in zip(query_lens, keys_per_seq, values_per_seq):
        q = query[start:start + q_len].transpose(0, 1).double()  # [H, q, D]
        k = k.repeat_interleave(group, dim=1).transpose(0, 1).double()  # [H, n, D]
        v = v.repeat_interleave(group, dim=1).transpose(0, 1).double()
        n = k.shape[1]
        scores = q @ k.transpose(1, 2) * scale
        allowed = torch.arange(n).view(1, -1) <= (n - q_len + torch.arange(q_len)).view(-1, 1)
        scores = scores.masked_fill(~allowed, float("-inf"))
        out.append((scores.softmax(-1) @ v).transpose(0, 1))
        start += q_len
    return torch.cat(out).float()


def run_step(backend, block_size, query_lens, seq_lens, num_heads=NUM_HEADS, kv_heads=KV_HEADS, head=HEAD,
             dtype=torch.float32, stale=1e4):
    """Writes every sequence's cached prefix, then one step's new K/V, and attends; returns (out, expected)."""
    num_blocks = 1 + sum(-(-n // block_size) for n in seq_lens) + 3
    cache = backend.allocate_kv_cache(num_blocks, block_size, kv_heads, head, dtype, torch.device("cpu"))
    # Stale values in every slot: attending past a sequence's last token shows in the output.
    for part in cache:
        part.fill_(stale)
    # Hand out blocks in a shuffled order so tables are not contiguous.
    free = torch.randperm(num_blocks - 1).add(1).tolist()
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in seq_lens]
    keys = [torch.randn(n, kv_heads, head).to(dtype) for n in seq_lens]
    values = [torch.randn(n, kv_heads, head).to(dtype) for n in seq_lens]
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
    query = torch.randn(sum(query_lens), num_heads, head).to(dtype)
    out = backend.attend(query, cache, meta, head**-0.5)
    return out.float(), reference(query.float(), [k.float() for k in keys], [v.float() for v in values],
                                  query_lens, head**-0.5)


def backend_on_path(cache_dtype: torch.dtype | None, fused: bool) -> CpuAttentionBackend:
    """The cpu backend with its cache in ``cache_dtype`` (None: the dtype asked for; ``torch.int8``: the
    int8 cache's records), taking the fused float32 prefill kernel where this CPU has it or, with
    ``fused`` False, the gathered K/V and two GEMMs on every CPU."""
    int8 = cache_dtype == torch.int8
    backend = (CpuInt8KVAttentionBackend if int8 else CpuAttentionBackend)(torch.device("cpu"))
    allocate = backend.allocate_kv_cache

    def allocate_in(num_blocks, block_size, kv_heads, head_size, dtype, device):
        tiles_dtype = dtype if int8 else cache_dtype or dtype
        caches = allocate(num_blocks, block_size, kv_heads, head_size, tiles_dtype, device)
        assert backend._fused_prefill_f32 or not fused
        backend._fused_prefill_f32 = fused
        return caches

    backend.allocate_kv_cache = allocate_in
    return backend


@pytest.mark.parametrize("backend_name", list(BACKENDS))
@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("query_lens,seq_lens", [
    ([1, 1, 1], [1, 17, 40]),  # decode only, ragged contexts
    ([9, 33], [9, 50]),  # prefill from scratch, and a chunk after a cached prefix
    ([1, 12, 1, 7], [30, 12, 3, 40]),  # mixed prefill chunks and decode tokens
    ([20], [20]),  # one prompt
])
def test_backend_matches_reference(backend_name, block_size, query_lens, seq_lens):
    torch.manual_seed(0)
    out, expected = run_step(BACKENDS[backend_name](torch.device("cpu")), block_size, query_lens, seq_lens)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend_name", list(BACKENDS))
def test_bf16_prefill_and_mixed_steps_match_reference(backend_name):
    """bf16 on the CPU computes prefill attention as two GEMMs and a softmax (not SDPA): same result
    within bf16 rounding, padded query rows and cached prefixes included."""
    torch.manual_seed(2)
    out, expected = run_step(BACKENDS[backend_name](torch.device("cpu")), 16, [1, 37, 5, 64], [40, 37, 70, 64],
                             num_heads=9, kv_heads=3, head=64, dtype=torch.bfloat16)
    torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("backend_name", list(BACKENDS))
def test_prefill_chunks_of_unlike_sizes_attend_in_groups_of_like_size(backend_name):
    """A 200-token prompt beside 4-token chunks (prompts whose system prompt was cached) is a group of
    its own, so the short chunks are not padded to 200 query rows; the step still matches the
    reference, decode tokens included."""
    from executor.attention.torch_backend import prefill_groups

    torch.manual_seed(4)
    query_lens, seq_lens = [4, 200, 1, 5, 4, 150], [132, 200, 60, 133, 132, 150]
    meta = make_meta(query_lens, seq_lens, [[1] * -(-n // 16) for n in seq_lens], 16)
    assert prefill_groups(meta, [0, 1, 3, 4, 5]) == [[1, 5], [0, 3, 4]]
    out, expected = run_step(BACKENDS[backend_name](torch.device("cpu")), 16, query_lens, seq_lens, num_heads=9,
                             kv_heads=3, head=64)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend_name", list(BACKENDS))
def test_prefill_chunks_of_like_size_in_one_group_keep_the_batch_order(backend_name):
    """Chunks of like size, the longer one later in the batch: one group, every token of the step,
    whose output must come back in the batch's order."""
    torch.manual_seed(5)
    from executor.attention.torch_backend import prefill_groups

    query_lens = seq_lens = [12, 14, 13]
    assert prefill_groups(make_meta(query_lens, seq_lens, [[1]] * 3, 16), [0, 1, 2]) == [[0, 1, 2]]
    out, expected = run_step(BACKENDS[backend_name](torch.device("cpu")), 16, query_lens, seq_lens)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_cpu_prefill_in_query_chunks_matches_reference():
    """On the GEMM path, prefill chunks longer than CAUSAL_QUERY_CHUNK take the GEMMs chunk by chunk, each against the
    keys its last token sees: the same attention, with padded rows, a cached prefix and a decode token
    in the step."""
    torch.manual_seed(3)
    query_lens, seq_lens = [300, 1, 130, 200], [300, 40, 200, 420]
    assert max(query_lens) > 2 * CAUSAL_QUERY_CHUNK
    out, expected = run_step(backend_on_path(None, fused=False), 16, query_lens, seq_lens, num_heads=9, kv_heads=3,
                             head=64)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
def test_cpu_decode_kernel_long_contexts_model_shapes(dtype, tolerance):
    """The decode kernel at the default model's shapes (9 heads on 3 KV heads of 64), up to 1000 tokens."""
    torch.manual_seed(1)
    seq_lens = [1000, 1, 16, 17, 255, 513]
    # NaN left in the unused slots of last blocks must not reach the output.
    out, expected = run_step(CpuAttentionBackend(torch.device("cpu")), 16, [1] * len(seq_lens), seq_lens,
                             num_heads=9, kv_heads=3, head=64, dtype=dtype, stale=float("nan"))
    torch.testing.assert_close(out, expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("num_heads,kv_heads", [(2, 2), (4, 2), (7, 1), (8, 1), (12, 2)])
def test_cpu_decode_kernel_every_gqa_group_size(num_heads, kv_heads):
    """Query heads per KV head 1, 2, 7 (rows 4 + 3), 8 (4 + 4) and 6 (4 + 2), head size 32."""
    torch.manual_seed(3)
    seq_lens = [3, 48, 130]
    out, expected = run_step(CpuAttentionBackend(torch.device("cpu")), 16, [1] * len(seq_lens), seq_lens,
                             num_heads=num_heads, kv_heads=kv_heads, head=32, stale=float("nan"))
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_cpu_decode_kernel_rows_do_not_depend_on_batch_or_threads():
    """A sequence's attention is bit for bit the same alone or in a batch, on 1 or 2 threads: the
    kernel visits a sequence's KV heads together in runs that threads and batches cut differently
    (alone, its heads split over the threads; five sequences, whole ones claimed longest first by
    whichever thread is free), and a greedy answer must not depend on that."""
    generator = torch.Generator().manual_seed(4)
    kv_heads, num_heads, head, num_blocks = 3, 9, 64, 300
    backend = CpuAttentionBackend(torch.device("cpu"))
    key_cache, value_cache = backend.allocate_kv_cache(num_blocks, 16, kv_heads, head, torch.bfloat16,
                                                       torch.device("cpu"))
    key_cache.copy_(torch.randn(key_cache.shape, generator=generator))
    value_cache.copy_(torch.randn(value_cache.shape, generator=generator))
    seq_lens = torch.tensor([700, 33, 1, 250, 16], dtype=torch.int32)
    tables = torch.randperm(num_blocks - 1, generator=generator)[: 5 * 44].add(1).view(5, 44).to(torch.int32)
    query = torch.randn(5, num_heads, head, generator=generator).to(torch.bfloat16)

    def attend(rows: list[int], threads: int) -> torch.Tensor:
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return backend._ops.paged_decode_attention(query[rows], key_cache, value_cache, tables[rows],
                                                       seq_lens[rows], head ** -0.5)
        finally:
            torch.set_num_threads(previous)

    batched = attend([0, 1, 2, 3, 4], 1)
    assert torch.equal(attend([0, 1, 2, 3, 4], 2), batched)
    for row in range(5):
        assert torch.equal(attend([row], 1)[0], batched[row])
        assert torch.equal(attend([row], 2)[0], batched[row])


@pytest.mark.parametrize("backend_name", list(BACKENDS))
def test_write_kv_skips_negative_slots_and_copy_blocks(backend_name):
    backend = BACKENDS[backend_name](torch.device("cpu"))
    cache = backend.allocate_kv_cache(4, 2, 1, 2, torch.float32, torch.device("cpu"))
    key = torch.arange(6, dtype=torch.float32).view(3, 1, 2)
    backend.write_kv(cache, key, -key, torch.tensor([2, -1, 3]))
    assert key_at(backend, cache, 2).tolist() == [[0.0, 1.0]]
    assert key_at(backend, cache, 3).tolist() == [[4.0, 5.0]]
    assert block_of(backend, cache[1], 1).reshape(-1).tolist() == [-0.0, -1.0, -4.0, -5.0]
    assert all(block_of(backend, part, 0).abs().sum() == 0 for part in cache)  # nothing in the null block
    backend.copy_blocks([cache], torch.tensor([1]), torch.tensor([2]))
    assert all(torch.equal(block_of(backend, part, 2), block_of(backend, part, 1)) for part in cache)
    assert block_of(backend, cache[0], 1).abs().sum() > 0
    assert all(block_of(backend, part, 3).abs().sum() == 0 for part in cache)  # only the destination changed


def test_decode_kernel_rejects_a_block_id_outside_the_cache():
    backend = CpuAttentionBackend(torch.device("cpu"))
    key_cache, value_cache = backend.allocate_kv_cache(4, 16, 1, 16, torch.float32, torch.device("cpu"))
    query = torch.randn(1, 1, 16)
    with pytest.raises(RuntimeError, match="block id 9 out of range"):
        backend._ops.paged_decode_attention(query, key_cache, value_cache, torch.tensor([[9]], dtype=torch.int32),
                           torch.tensor([5], dtype=torch.int32), 0.25)


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-6), (torch.bfloat16, 8e-3)])
def test_causal_softmax_masks_each_row_at_its_own_position(cpu_ops, dtype, tolerance):
    """The prefill softmax against a masked softmax in float64: a cached prefix, a shorter sequence
    padded to the group's query length (its extra rows see all its keys), rows of several query
    heads, a context that is not whole vectors; the masked part of every row is exactly 0."""
    torch.manual_seed(5)
    query_len, group, ctx_len = 7, 3, 45
    first_query_pos, seq_lens = [38, 0], [45, 4]
    scores = torch.randn(2, 2, group * query_len, ctx_len).mul(4).to(dtype)
    keys = torch.tensor([[min(first + r % query_len + 1, n) for r in range(group * query_len)]
                         for first, n in zip(first_query_pos, seq_lens)])  # [seqs, rows]
    allowed = torch.arange(ctx_len).view(1, 1, 1, -1) < keys.view(2, 1, -1, 1)
    expected = scores.double().masked_fill(~allowed, float("-inf")).softmax(-1)
    out = cpu_ops.causal_softmax_(scores, torch.tensor(first_query_pos, dtype=torch.int32),
                                  torch.tensor(seq_lens, dtype=torch.int32), query_len)
    assert out.data_ptr() == scores.data_ptr()
    torch.testing.assert_close(scores.double(), expected, atol=tolerance, rtol=tolerance)
    assert bool((scores[~allowed.expand_as(scores)] == 0).all())


def test_causal_softmax_refuses_positions_outside_the_scores(cpu_ops):
    scores = torch.zeros(1, 1, 4, 16)
    lens = torch.tensor([17], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="seq_len 17 .* for 16 score columns"):
        cpu_ops.causal_softmax_(scores, torch.tensor([13], dtype=torch.int32), lens, 4)
    with pytest.raises(RuntimeError, match="multiple of query_len"):
        cpu_ops.causal_softmax_(scores, torch.tensor([0], dtype=torch.int32), torch.tensor([4], dtype=torch.int32), 3)


@pytest.fixture
def prefill_ops(cpu_ops):
    if not cpu_ops.has_prefill_attention():
        pytest.skip("this CPU has no AVX-512 BF16: prefill attention keeps the two GEMMs and causal_softmax_")
    return cpu_ops


FUSED_BACKENDS = {"bf16 cache": CpuAttentionBackend, "int8 cache": CpuInt8KVAttentionBackend}


@pytest.mark.parametrize("cache", list(FUSED_BACKENDS))
@pytest.mark.parametrize("head_size", [32, 64, 128])
def test_fused_prefill_matches_float64_under_the_causal_mask(prefill_ops, cache, head_size):
    """Prefill chunks in paged_prefill_attention (scores, online softmax and values, the products on
    AMX tiles where the CPU has them, else VDPBF16PS; K/V read from the blocks where they lie)
    against float64: a chunk after a cached prefix longer than
    one 64-key chunk, a shorter chunk padded to the group's query length, a decode token beside
    them, rows that are not whole tiles of 16, contexts that are not whole chunks; every unused slot
    of the cache holds a stale value (inf; in the int8 cache ~1.7e24), which must reach no output."""
    torch.manual_seed(11)
    backend = FUSED_BACKENDS[cache](torch.device("cpu"))
    # int8 records filled with byte 100: codes of 100 under scales of ~1.7e22
    out, expected = run_step(backend, 16, [37, 5, 1, 64], [177, 21, 40, 64], num_heads=9, kv_heads=3,
                             head=head_size, dtype=torch.bfloat16,
                             stale=float("inf") if cache == "bf16 cache" else 100)
    assert backend._fused_prefill
    torch.testing.assert_close(out, expected, atol=3e-2, rtol=2e-2)


@pytest.mark.parametrize("cache", list(FUSED_BACKENDS))
def test_fused_prefill_agrees_with_the_gemm_path(prefill_ops, cache):
    """Without AVX-512 BF16 the backend gathers the blocks and computes prefill as two GEMMs around
    causal_softmax_: both paths give the same outputs within bf16 rounding (and the int8 cache's
    keys and values are widened to the same bf16 on both), so a model's prefill does not depend on
    the CPU."""
    outputs = []
    for fused in (True, False):
        backend = FUSED_BACKENDS[cache](torch.device("cpu"))
        allocate = backend.allocate_kv_cache

        def allocate_on_one_path(*args, backend=backend, allocate=allocate, fused=fused):
            caches = allocate(*args)
            assert backend._fused_prefill
            backend._fused_prefill = fused
            return caches

        backend.allocate_kv_cache = allocate_on_one_path
        torch.manual_seed(12)
        outputs.append(run_step(backend, 16, [130, 1, 77], [258, 90, 77], num_heads=9, kv_heads=3, head=64,
                                dtype=torch.bfloat16, stale=0)[0])
    torch.testing.assert_close(outputs[0], outputs[1], atol=2e-2, rtol=2e-2)


PREFILL_TABLE, PREFILL_FIRST, PREFILL_LENS = (torch.tensor([[1, 2]], dtype=torch.int32), torch.tensor([0], dtype=torch.int32),
                                              torch.tensor([4], dtype=torch.int32))


def assert_refuses_bad_tables(attend, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    """What the float32 prefill kernel refuses of a step's tables and shapes, for one sequence of 4 query tokens
    (``q`` [1, 1, 4, d]) in blocks 1 and 2 of a one-KV-head cache: a seq_len past its blocks, a block id
    outside the cache, rows that are not whole query lengths, another number of KV heads than the caches'."""
    table, first, lens = PREFILL_TABLE, PREFILL_FIRST, PREFILL_LENS
    with pytest.raises(RuntimeError, match="seq_len 33 .* for 2 blocks"):
        attend(q, key_cache, value_cache, table, first, torch.tensor([33], dtype=torch.int32), 4, 0.125)
    with pytest.raises(RuntimeError, match="block id 9 out of range"):
        attend(q, key_cache, value_cache, torch.tensor([[9, 1]], dtype=torch.int32), first, lens, 4, 0.125)
    with pytest.raises(RuntimeError, match="multiple of query_len"):
        attend(q, key_cache, value_cache, table, first, lens, 3, 0.125)
    with pytest.raises(RuntimeError, match="q has 2 KV heads"):
        attend(q.expand(1, 2, 4, q.shape[3]).contiguous(), key_cache, value_cache, table, first, lens, 4, 0.125)


def test_fused_prefill_refuses_what_it_cannot_compute(prefill_ops):
    """paged_prefill_attention's tables and shapes (one sequence of 4 query tokens in blocks 1 and 2 of a
    one-KV-head cache): each refusal names what is wrong, and nothing is written."""
    backend = CpuAttentionBackend(torch.device("cpu"))
    key_cache, value_cache = backend.allocate_kv_cache(4, 16, 1, 64, torch.bfloat16, torch.device("cpu"))
    q, out = torch.zeros(4, 1, 64).bfloat16(), torch.full((4, 1, 64), 7.0).bfloat16()
    start = torch.tensor([0], dtype=torch.int32)
    attend = prefill_ops.paged_prefill_attention

    def refused(match, q=q, caches=(key_cache, value_cache), table=PREFILL_TABLE, start=start, first=PREFILL_FIRST,
                lens=PREFILL_LENS, out=out):
        with pytest.raises(RuntimeError, match=match):
            attend(q, *caches, table, start, first, lens, 0.125, out)

    refused("seq_len 33 .* for 2 blocks", lens=torch.tensor([33], dtype=torch.int32))
    refused("block id 9 out of range", table=torch.tensor([[9, 1]], dtype=torch.int32))
    refused("4 query rows from row 1 are not all among q's 4", start=torch.tensor([1], dtype=torch.int32))
    refused("query_starts must be int32", start=torch.tensor([0, 0], dtype=torch.int32))
    two_kv = backend.allocate_kv_cache(4, 16, 2, 64, torch.bfloat16, torch.device("cpu"))
    refused("q's 1 heads are not a whole number of query heads for each of the caches' 2 KV heads", caches=two_kv)
    refused("q must be bfloat16", q=q.float())
    refused("q's heads must be contiguous", q=torch.zeros(4, 64, 2).bfloat16().transpose(1, 2))
    refused("out must be contiguous bfloat16 of q's shape", out=out[:3])
    odd_k, odd_v = backend.allocate_kv_cache(4, 16, 1, 48, torch.bfloat16, torch.device("cpu"))
    refused("head_size must be a multiple of 32", q=torch.zeros(4, 1, 48).bfloat16(), caches=(odd_k, odd_v),
            out=torch.zeros(4, 1, 48).bfloat16())
    assert bool((out == 7).all())


def test_fused_prefill_reads_q_where_the_projection_left_it_and_writes_only_its_rows(prefill_ops):
    """The step's q as a view of the q/k/v projection (tokens further apart than their heads), two
    sequences' query rows with another token between them: each sequence's rows are its causal
    attention (float64 reference), the row between is not touched."""
    torch.manual_seed(13)
    heads, kv_heads, d = 9, 3, 64
    backend = CpuAttentionBackend(torch.device("cpu"))
    key_cache, value_cache = backend.allocate_kv_cache(8, 16, kv_heads, d, torch.bfloat16, torch.device("cpu"))
    tables, seq_lens, query_lens, starts = [[3, 5], [6]], [20, 7], [5, 7], [0, 6]
    keys = [torch.randn(n, kv_heads, d).bfloat16() for n in seq_lens]
    values = [torch.randn(n, kv_heads, d).bfloat16() for n in seq_lens]
    meta = make_meta(seq_lens, seq_lens, tables, 16)
    backend.write_kv((key_cache, value_cache), torch.cat(keys), torch.cat(values), meta.slot_mapping)
    qkv = torch.randn(13, (heads + 2 * kv_heads) * d).bfloat16()
    q = qkv[:, :heads * d].view(13, heads, d)
    out = torch.full((13, heads, d), 7.0).bfloat16()
    prefill_ops.paged_prefill_attention(
        q, key_cache, value_cache, torch.tensor([[3, 5], [6, 0]], dtype=torch.int32),
        torch.tensor(starts, dtype=torch.int32), torch.tensor([n - m for n, m in zip(seq_lens, query_lens)],
                                                              dtype=torch.int32),
        torch.tensor(seq_lens, dtype=torch.int32), d**-0.5, out)
    rows = torch.cat([q[start:start + m] for start, m in zip(starts, query_lens)])
    expected = reference(rows.float(), [k.float() for k in keys], [v.float() for v in values], query_lens, d**-0.5)
    got = torch.cat([out[start:start + m] for start, m in zip(starts, query_lens)]).float()
    torch.testing.assert_close(got, expected.float(), atol=3e-2, rtol=2e-2)
    assert bool((out[5] == 7).all())


def test_auto_falls_back_to_torch_where_the_cpu_kernel_cannot_build(monkeypatch):
    def no_compiler():
        raise RuntimeError("Error building extension 'kvserve_cpu_kernels': c++: not found")

    monkeypatch.setattr(cpu_backend, "csrc_build_script", no_compiler)
    assert create_backend("auto", torch.device("cpu")).name == "torch"
    with pytest.raises(RuntimeError, match="c\\+\\+: not found"):
        create_backend("cpu", torch.device("cpu"))
