"""CPU: the pure-torch reference on vLLM's paged layout vs an independent naive
attention, and the native backend's Python orchestration (mixed prefill/decode
batches, v1/v2 choice) with the kernels replaced by the reference. Fast."""
from __future__ import annotations

import math
import random

import pytest
import torch

from executor.attention import paged_reference as ref
from executor.attention.base import AttentionMetadata
from executor.attention.native import NativeAttentionBackend


def naive_attention(q, keys, values, positions, scale):
    """Independent of the layout: per query token, per head, plain loops over
    the sequence's own contiguous K/V. q [n, H, d]; keys/values [L, kvH, d]."""
    n, num_heads, d = q.shape
    group = num_heads // keys.shape[1]
    out = torch.zeros(n, num_heads, d, dtype=torch.float64)
    for j in range(n):
        p = positions[j]
        for h in range(num_heads):
            kh = h // group
            scores = [float(q[j, h].double() @ keys[t, kh].double()) * scale for t in range(p + 1)]
            m = max(scores)
            w = [math.exp(s - m) for s in scores]
            z = sum(w)
            for t in range(p + 1):
                out[j, h] += (w[t] / z) * values[t, kh].double()
    return out


def make_batch(seq_lens, query_lens, num_heads, kv_heads, head_size, block_size, dtype, seed=0):
    """Random sequences written into randomly placed blocks through reshape_and_cache."""
    g = torch.Generator().manual_seed(seed)
    blocks_needed = sum(-(-L // block_size) for L in seq_lens)
    num_blocks = blocks_needed + 3
    perm = torch.randperm(num_blocks - 1, generator=g)[:blocks_needed] + 1  # block 0 = null block
    max_blocks = max(-(-L // block_size) for L in seq_lens)
    block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    kc, vc = ref.new_kv_cache(num_blocks, block_size, kv_heads, head_size, dtype, "cpu")
    truth, used = [], 0
    for i, L in enumerate(seq_lens):
        nb = -(-L // block_size)
        block_tables[i, :nb] = perm[used : used + nb].int()
        used += nb
        k = torch.randn(L, kv_heads, head_size, generator=g).to(dtype)
        v = torch.randn(L, kv_heads, head_size, generator=g).to(dtype)
        pos = torch.arange(L)
        slots = block_tables[i, pos // block_size].long() * block_size + pos % block_size
        ref.reshape_and_cache(k, v, kc, vc, slots)
        truth.append((k, v))
    q = torch.randn(sum(query_lens), num_heads, head_size, generator=g).to(dtype)
    return kc, vc, block_tables, truth, q


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_layout_positions(dtype, block_size):
    """key dim d of token t is key_cache[blk, h, d // x, off, d % x]; value is value_cache[blk, h, d, off]."""
    kv_heads, head_size = 2, 64
    kc, vc, bt, truth, _ = make_batch([37], [1], 2, kv_heads, head_size, block_size, dtype)
    x = 16 // kc.element_size()
    assert kc.shape == (kc.shape[0], kv_heads, head_size // x, block_size, x)
    k, v = truth[0]
    for t in (0, 1, block_size - 1, block_size, 36):
        blk, off = int(bt[0, t // block_size]), t % block_size
        for h in range(kv_heads):
            for d in (0, 1, x - 1, x, head_size - 1):
                assert kc[blk, h, d // x, off, d % x] == k[t, h, d]
                assert vc[blk, h, d, off] == v[t, h, d]
    gk, gv = ref.gather_kv(kc, vc, bt[0], 37)
    assert torch.equal(gk, k) and torch.equal(gv, v)


def test_negative_slots_are_skipped():
    kc, vc = ref.new_kv_cache(4, 8, 1, 64, torch.float32, "cpu")
    k = torch.ones(3, 1, 64)
    ref.reshape_and_cache(k, k * 2, kc, vc, torch.tensor([8, -1, 9]))
    assert kc[1, 0, :, 0].eq(1).all() and kc[1, 0, :, 1].eq(1).all()
    assert kc.sum() == 2 * 64 and vc.sum() == 2 * 2 * 64


@pytest.mark.parametrize(
    "num_heads,kv_heads,head_size,block_size",
    [(4, 4, 64, 16), (8, 2, 64, 8), (8, 1, 128, 32), (6, 2, 80, 16)],
)
def test_reference_matches_naive_mixed_batch(num_heads, kv_heads, head_size, block_size):
    # decode (1 new token), prefill with a cached prefix (chunked), full prefill
    seq_lens = [29, 40, 17, 1]
    query_lens = [1, 9, 17, 1]
    kc, vc, bt, truth, q = make_batch(seq_lens, query_lens, num_heads, kv_heads, head_size, block_size, torch.float32)
    scale = head_size**-0.5
    got = ref.paged_attention(q, kc, vc, bt, seq_lens, query_lens, scale)
    start = 0
    for (k, v), L, n in zip(truth, seq_lens, query_lens):
        want = naive_attention(q[start : start + n], k, v, list(range(L - n, L)), scale)
        torch.testing.assert_close(got[start : start + n].double(), want, atol=1e-5, rtol=1e-5)
        start += n


def test_copy_blocks_reference():
    layers = [ref.new_kv_cache(6, 16, 2, 64, torch.float16, "cpu") for _ in range(3)]
    for kc, vc in layers:
        kc.normal_()
        vc.normal_()
    before = [(kc.clone(), vc.clone()) for kc, vc in layers]
    ref.copy_blocks(layers, torch.tensor([1, 4]), torch.tensor([2, 5]))
    for (kc, vc), (k0, v0) in zip(layers, before):
        assert torch.equal(kc[2], k0[1]) and torch.equal(kc[5], k0[4]) and torch.equal(vc[5], v0[4])
        assert torch.equal(kc[[0, 1, 3, 4]], k0[[0, 1, 3, 4]])


# ---- the native backend's Python side, kernels replaced by the reference


class FakeOps:
    """Implements the extension's three ops with the reference (same signatures)."""

    def __init__(self):
        self.decode_calls = []

    def paged_attention(self, out, query, key_cache, value_cache, block_tables, seq_lens, scale, max_seq_len, partition_size):
        assert block_tables.dtype == torch.int32 and seq_lens.dtype == torch.int32
        self.decode_calls.append((query.shape[0], partition_size))
        out.copy_(ref.paged_decode_attention(query, key_cache, value_cache, block_tables, seq_lens.tolist(), scale))

    def reshape_and_cache(self, key, value, key_cache, value_cache, slot_mapping):
        ref.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)

    def copy_blocks(self, key_caches, value_caches, block_mapping):
        ref.copy_blocks(list(zip(key_caches, value_caches)), block_mapping[:, 0], block_mapping[:, 1])


def cpu_backend(num_sms=132):
    backend = object.__new__(NativeAttentionBackend)
    backend.device, backend.name, backend.ops, backend.num_sms = torch.device("cpu"), "cuda", FakeOps(), num_sms
    return backend


def metadata(seq_lens, query_lens, block_tables, block_size):
    qsl = [0]
    for n in query_lens:
        qsl.append(qsl[-1] + n)
    slots = []
    for i, (L, n) in enumerate(zip(seq_lens, query_lens)):
        for p in range(L - n, L):
            slots.append(int(block_tables[i, p // block_size]) * block_size + p % block_size)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=block_tables,
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=list(seq_lens),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_size=block_size,
    )


@pytest.mark.parametrize("query_lens", [[1, 1, 1, 1], [1, 12, 1, 33], [5, 12, 20, 33]])
def test_native_orchestration_mixed_batches(query_lens):
    seq_lens = [40, 12, 70, 33]
    num_heads, kv_heads, head_size, block_size = 8, 2, 64, 16
    kc, vc, bt, truth, q = make_batch(seq_lens, query_lens, num_heads, kv_heads, head_size, block_size, torch.float32, seed=3)
    backend = cpu_backend()
    meta = metadata(seq_lens, query_lens, bt, block_size)
    got = backend.attend(q, (kc, vc), meta, 0.125)
    want = ref.paged_attention(q, kc, vc, bt, seq_lens, query_lens, 0.125)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    n_decode = sum(1 for n in query_lens if n == 1)
    assert [c[0] for c in backend.ops.decode_calls] == ([n_decode] if n_decode else [])


def test_native_write_kv_then_prefill_chunks_matches_reference():
    """Chunked prefill through write_kv + attend, chunk by chunk, equals one-shot attention."""
    random.seed(0)
    num_heads, kv_heads, head_size, block_size, L = 4, 2, 64, 8, 45
    backend = cpu_backend()
    kc, vc = backend.allocate_kv_cache(10, block_size, kv_heads, head_size, torch.float32, torch.device("cpu"))
    bt = torch.tensor([[3, 7, 1, 9, 4, 2]], dtype=torch.int32)
    g = torch.Generator().manual_seed(1)
    k, v, q = (torch.randn(L, h, head_size, generator=g) for h in (kv_heads, kv_heads, num_heads))
    outs, done = [], 0
    for chunk in (16, 20, 1, 8):
        meta = metadata([done + chunk], [chunk], bt, block_size)
        backend.write_kv((kc, vc), k[done : done + chunk], v[done : done + chunk], meta.slot_mapping)
        outs.append(backend.attend(q[done : done + chunk], (kc, vc), meta, 0.125))
        done += chunk
    want = naive_attention(q, k, v, list(range(L)), 0.125)
    torch.testing.assert_close(torch.cat(outs).double(), want, atol=1e-5, rtol=1e-5)


def test_v2_choice():
    backend = cpu_backend(num_sms=132)
    assert not backend.use_v2(32, 32, 8, 512)  # one partition: v1
    assert backend.use_v2(32, 32, 8, 4096)  # 256 CTAs < 4 per SM: split
    assert not backend.use_v2(256, 32, 8, 4096)  # 2048 CTAs fill the device
    assert backend.use_v2(1, 32, 8, 100_000)


def test_native_backend_refuses_cpu():
    with pytest.raises(ValueError):
        NativeAttentionBackend(torch.device("cpu"))


def test_fake_ops_signature_matches_binding():
    """The fake's parameter names are the binding's (csrc/bindings.cpp py::arg list)."""
    import inspect
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "csrc" / "bindings.cpp").read_text()
    for op in ("paged_attention", "reshape_and_cache", "copy_blocks"):
        block = re.search(rf'm\.def\("{op}".*?\);', text, re.S).group(0)
        want = re.findall(r'py::arg\("(\w+)"\)', block)
        got = list(inspect.signature(getattr(FakeOps, op)).parameters)[1:]
        assert got == want, op


