"""GPU (CUDA or MUSA): the csrc kernels vs the pure-torch reference (executor/attention/paged_reference.py).

Skipped without a CUDA or MUSA device. The first test builds the extension (JIT, cached).

Tolerances (kernel vs an fp32 reference rounded to the dtype; both read the same
stored K/V, so the difference is fp32 summation order plus one output rounding):
    fp32: atol = rtol = 1e-4     fp16: atol = rtol = 2e-3     bf16: atol = rtol = 1.6e-2
reshape_and_cache and copy_blocks are bit-exact. Prefill rows go through the
device SDPA (its own fp16/bf16 accumulation), so the mixed-batch test allows 2x.
"""
from __future__ import annotations

import math
import random
import zlib

import pytest
import torch

from csrc_support import nan_paged_cache
from executor.attention import paged_reference as ref
from executor.attention.base import AttentionMetadata



def _device() -> str | None:
    """cuda, else musa (torch_musa), else None: the kernels are one source for both."""
    if torch.cuda.is_available():
        return "cuda"
    try:
        import torch_musa  # noqa: F401

        return "musa" if torch.musa.is_available() else None
    except ImportError:
        return None


DEVICE = _device()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(DEVICE is None, reason="needs a CUDA or MUSA device"),
]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HEAD_SIZES = [64, 80, 96, 112, 128, 256]
BLOCK_SIZES = [8, 16, 32]
GROUPS = [1, 4, 12]  # query heads per kv head; 12 > 8 spans two CTA head slices
TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@pytest.fixture(scope="module")
def ops():
    from executor.attention.native import load_ops

    return load_ops(DEVICE)


def random_cache(lens, kv_heads, head_size, block_size, dtype, seed):
    return nan_paged_cache(lens, kv_heads, head_size, block_size, dtype, seed, device=DEVICE)


@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_paged_attention_v1_v2_vs_reference(ops, dtype, head_size, block_size, group):
    seed = zlib.crc32(f"{dtype}{head_size}/{block_size}/{group}".encode()) % 10_000  # stable across runs
    rng = random.Random(seed)
    lens = [1, 8192, rng.randint(2, 700), rng.randint(700, 8191), block_size, block_size + 1]
    kv_heads = 2
    num_heads = kv_heads * group
    kc, vc, bt = random_cache(lens, kv_heads, head_size, block_size, dtype, seed)
    # A strided query (a view into a fused qkv buffer), as the model produces it.
    qkv = torch.randn(len(lens), num_heads + 2 * kv_heads, head_size, device=DEVICE).to(dtype)
    q = qkv[:, :num_heads]
    scale = head_size**-0.5
    want = ref.paged_decode_attention(q, kc, vc, bt, lens, scale)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    tol = TOL[dtype]
    for partition_size in (0, 512):  # v1, v2
        out = torch.empty(q.shape, dtype=dtype, device=DEVICE)
        ops.paged_attention(out, q, kc, vc, bt, seq_lens, scale, max(lens), partition_size)
        torch.testing.assert_close(out, want, atol=tol, rtol=tol, msg=lambda m: f"partition_size={partition_size}: {m}")


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("head_size", [64, 128, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reshape_and_cache_exact(ops, dtype, head_size, block_size):
    kv_heads, num_tokens, num_blocks = 4, 300, 64
    kc, vc = ref.new_kv_cache(num_blocks, block_size, kv_heads, head_size, dtype, DEVICE)
    kc2, vc2 = kc.clone(), vc.clone()
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:num_tokens]
    slots[::7] = -1  # padding tokens are skipped
    qkv = torch.randn(num_tokens, 3 * kv_heads, head_size, device=DEVICE).to(dtype)
    key, value = qkv[:, kv_heads : 2 * kv_heads], qkv[:, 2 * kv_heads :]  # strided views
    ops.reshape_and_cache(key, value, kc, vc, slots)
    ref.reshape_and_cache(key, value, kc2, vc2, slots)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_copy_blocks_exact(ops, dtype):
    layers = [ref.new_kv_cache(40, 16, 4, 128, dtype, DEVICE) for _ in range(5)]
    for kc, vc in layers:
        kc.normal_()
        vc.normal_()
    want = [(kc.clone(), vc.clone()) for kc, vc in layers]
    src = torch.tensor([3, 7, 7, 20], device=DEVICE)
    dst = torch.tensor([4, 8, 9, 39], device=DEVICE)
    ops.copy_blocks([k for k, _ in layers], [v for _, v in layers], torch.stack([src, dst], 1))
    ref.copy_blocks(want, src, dst)
    for (kc, vc), (k2, v2) in zip(layers, want):
        assert torch.equal(kc, k2) and torch.equal(vc, v2)


def _metadata(seq_lens, query_lens, block_tables, block_size):
    qsl, slots = [0], []
    for i, (L, n) in enumerate(zip(seq_lens, query_lens)):
        qsl.append(qsl[-1] + n)
        for p in range(L - n, L):
            slots.append(int(block_tables[i, p // block_size]) * block_size + p % block_size)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_tables=block_tables.to(DEVICE),
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=list(seq_lens),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_size=block_size,
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_size,block_size,group", [(64, 16, 3), (128, 16, 4), (128, 32, 1), (96, 8, 8)])
def test_backend_mixed_prefill_decode_vs_reference(ops, dtype, head_size, block_size, group):
    """write_kv + attend through NativeAttentionBackend: decode rows, chunked
    prefill with a cached prefix, a fresh prompt and a long decode, in one batch."""
    from executor.attention.native import NativeAttentionBackend

    backend = NativeAttentionBackend(torch.device(DEVICE))
    kv_heads = 2
    num_heads = kv_heads * group
    seq_lens = [37, 300, 64, 5000, 1]
    query_lens = [1, 77, 64, 1, 1]
    max_blocks = max(-(-L // block_size) for L in seq_lens)
    num_blocks = sum(-(-L // block_size) for L in seq_lens) + 4
    kv = backend.allocate_kv_cache(num_blocks, block_size, kv_heads, head_size, dtype, torch.device(DEVICE))
    perm = torch.randperm(num_blocks - 1) + 1
    bt = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    used = 0
    for i, L in enumerate(seq_lens):
        nb = -(-L // block_size)
        bt[i, :nb] = perm[used : used + nb].int()
        used += nb
    # Cached prefix first (as earlier steps would have), then this step's tokens.
    prefix = [L - n for L, n in zip(seq_lens, query_lens)]
    for i, p in enumerate(prefix):
        if p:
            m = _metadata([p], [p], bt[i : i + 1], block_size)
            k = torch.randn(p, kv_heads, head_size, device=DEVICE).to(dtype)
            backend.write_kv(kv, k, torch.randn_like(k), m.slot_mapping)
    meta = _metadata(seq_lens, query_lens, bt, block_size)
    n_tok = sum(query_lens)
    k = torch.randn(n_tok, kv_heads, head_size, device=DEVICE).to(dtype)
    backend.write_kv(kv, k, torch.randn_like(k), meta.slot_mapping)
    q = torch.randn(n_tok, num_heads, head_size, device=DEVICE).to(dtype)
    scale = 1 / math.sqrt(head_size)
    got = backend.attend(q, kv, meta, scale)
    want = ref.paged_attention(q, kv[0], kv[1], meta.block_tables, seq_lens, query_lens, scale)
    tol = 2 * TOL[dtype]
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    # Decode-only step through the auto v1/v2 choice.
    dmeta = _metadata(seq_lens, [1] * len(seq_lens), bt, block_size)
    qd = torch.randn(len(seq_lens), num_heads, head_size, device=DEVICE).to(dtype)
    got = backend.attend(qd, kv, dmeta, scale)
    want = ref.paged_decode_attention(qd, kv[0], kv[1], dmeta.block_tables, seq_lens, scale)
    torch.testing.assert_close(got, want, atol=TOL[dtype], rtol=TOL[dtype])
