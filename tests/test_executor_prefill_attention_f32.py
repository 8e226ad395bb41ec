"""A float32 model's prefill chunks on a CPU with AVX2 and no AVX-512: paged_prefill_attention_f32
(csrc/cpu/prefill_attention_f32.cpp) against float64, against the GEMM path it replaces, and its
rows against themselves under another cut of the prompt."""
from __future__ import annotations

import pytest
import torch

from executor.attention.cpu_backend import CpuAttentionBackend
from tests.test_executor_attention import (PREFILL_FIRST, PREFILL_LENS, PREFILL_TABLE, assert_refuses_bad_tables,
                                           backend_on_path, run_step)


@pytest.fixture
def f32_prefill_ops(cpu_ops):
    if not cpu_ops.has_prefill_attention_f32():
        pytest.skip("built for AVX2 without AVX-512 only: elsewhere a float32 prefill keeps the GEMM path")
    return cpu_ops


@pytest.mark.parametrize("cache_dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.int8, 3e-2)])
@pytest.mark.parametrize("head_size", [16, 64, 128])
def test_f32_prefill_matches_float64_under_the_causal_mask(f32_prefill_ops, cache_dtype, tolerance, head_size):
    """A chunk after a cached prefix of several blocks, a chunk shorter than the group's query length
    (padding rows), a decode token and whole prompts of more than one unit of query tokens in one step;
    every unused slot of the cache holds inf (in the int8 records, codes of -1 under NaN scales: bytes
    0xFF), which must reach no output."""
    torch.manual_seed(21)
    out, expected = run_step(backend_on_path(cache_dtype, fused=True), 16, [37, 5, 1, 64, 70], [177, 21, 40, 64, 70],
                             num_heads=9, kv_heads=3, head=head_size,
                             stale=-1 if cache_dtype == torch.int8 else float("inf"))
    assert out.isfinite().all()
    torch.testing.assert_close(out, expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_f32_prefill_agrees_with_the_gemm_path(f32_prefill_ops, cache_dtype):
    """The fused kernel and the gathered K/V with two GEMMs around causal_softmax_ (the path of every
    other CPU) give the same outputs to float32 rounding (the int8 records widened to the same code *
    scale on both): a model's prefill does not depend on which CPU it runs on. Query chunks longer
    than the GEMM path's own chunking are included."""
    outputs = []
    for fused in (True, False):
        torch.manual_seed(22)
        outputs.append(run_step(backend_on_path(cache_dtype, fused), 16, [300, 1, 77], [428, 90, 77], num_heads=9,
                                kv_heads=3, head=64, stale=0)[0])
    torch.testing.assert_close(outputs[0], outputs[1], atol=1e-5, rtol=1e-4)


def test_f32_prefill_rows_do_not_depend_on_the_cut_of_the_prompt(f32_prefill_ops):
    """A prompt attended as one chunk, and as a chunk after a cached prefix, beside another sequence:
    each token's output is the same bits (a row's sums run in a fixed order over its own keys)."""
    torch.manual_seed(23)
    kv_heads, group, d, n = 3, 3, 64, 100
    backend = CpuAttentionBackend(torch.device("cpu"))
    key_cache, value_cache = backend.allocate_kv_cache(24, 16, kv_heads, d, torch.bfloat16, torch.device("cpu"))
    key_cache.copy_(torch.randn(key_cache.shape))
    value_cache.copy_(torch.randn(value_cache.shape))
    q = torch.randn(kv_heads, group, n, d)  # one sequence's query tokens per query head
    table = list(range(3, 10))
    attend = f32_prefill_ops.paged_prefill_attention_f32

    def rows(first: int, tokens: int, other_len: int) -> torch.Tensor:
        width = max(tokens, other_len)
        padded = torch.zeros(2, kv_heads, group, width, d)
        padded[0, :, :, :tokens] = q[:, :, first:first + tokens]
        padded[1, :, :, :other_len] = torch.randn(kv_heads, group, other_len, d)
        tables = torch.tensor([table, list(range(12, 19))], dtype=torch.int32)
        out = attend(padded.view(2, kv_heads, group * width, d), key_cache, value_cache, tables,
                     torch.tensor([first, 0], dtype=torch.int32), torch.tensor([first + tokens, other_len], dtype=torch.int32),
                     width, 0.125)
        out = out.view(2, kv_heads, group, width, d)
        assert (out[0, :, :, tokens:] == 0).all()  # padding rows
        return out[0, :, :, :tokens]

    whole = rows(0, n, 20)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tail = rows(60, n - 60, 90)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(whole[:, :, 60:], tail)


def test_f32_prefill_refuses_what_it_cannot_compute(f32_prefill_ops):
    backend = CpuAttentionBackend(torch.device("cpu"))
    key_cache, value_cache = backend.allocate_kv_cache(4, 16, 1, 64, torch.float32, torch.device("cpu"))
    q = torch.zeros(1, 1, 4, 64)
    attend = f32_prefill_ops.paged_prefill_attention_f32
    assert_refuses_bad_tables(attend, q, key_cache, value_cache)
    args = (PREFILL_TABLE, PREFILL_FIRST, PREFILL_LENS, 4, 0.125)
    with pytest.raises(RuntimeError, match="q must be float32"):
        attend(q.bfloat16(), key_cache, value_cache, *args)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        attend(q, key_cache.half(), value_cache.half(), *args)
    odd_k, odd_v = backend.allocate_kv_cache(4, 16, 1, 40, torch.float32, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="head_size must be a multiple of 16"):
        attend(torch.zeros(1, 1, 4, 40), odd_k, odd_v, *args)
    # V with fewer KV heads than q and K (with K's strides): its second head's tiles are not V's.
    two_k, two_v = backend.allocate_kv_cache(4, 16, 2, 64, torch.float32, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="q has 2 KV heads"):
        attend(torch.zeros(1, 2, 4, 64), two_k, two_v[:, :1], *args)
