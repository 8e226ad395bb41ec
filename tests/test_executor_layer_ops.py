"""The compiled CPU layer ops (csrc/cpu/layer_ops.cpp) against their torch reference (executor/layer_ops.py)."""
from __future__ import annotations

import pytest
import torch

from executor.layer_ops import CpuLayerOps, TorchLayerOps

REFERENCE = TorchLayerOps()
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# One rounding step of the dtype: the ops differ from torch's only in float32 summation
# order (RMSNorm) and the exp approximation (SiLU), which can move a result by one step.
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=8e-3, atol=1e-5),
             torch.float16: dict(rtol=1e-3, atol=1e-5)}


@pytest.fixture(scope="module")
def cpu_ops(cpu_ops):
    """The layer ops of the compiled kernels (conftest's ``cpu_ops``)."""
    return CpuLayerOps(cpu_ops)


def randn(*shape, dtype, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)), dtype=torch.float32) * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens,width", [(1, 576), (7, 40), (300, 64)])
def test_rms_norm_and_the_fused_residual_add(cpu_ops, dtype, tokens, width):
    x, residual = randn(tokens, width, dtype=dtype, scale=3.0), randn(tokens, width + 1, dtype=dtype)[:, :width]
    weight = randn(width, dtype=dtype) + 1
    torch.testing.assert_close(cpu_ops.rms_norm(x, weight, 1e-5), REFERENCE.rms_norm(x, weight, 1e-5), **TOLERANCE[dtype])
    normed, summed = cpu_ops.add_rms_norm(x, residual, weight, 1e-6)
    expected_normed, expected_sum = REFERENCE.add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(summed, expected_sum)  # one rounding of an exact sum: bit for bit
    torch.testing.assert_close(normed, expected_normed, **TOLERANCE[dtype])
    assert normed.dtype == summed.dtype == dtype and not normed.isnan().any()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [64, 32, 24])
def test_rotary_embedding_in_place_on_q_and_k_heads_only(cpu_ops, dtype, head_dim):
    tokens, q_heads, kv_heads = 5, 6, 2
    qkv = randn(tokens, q_heads + 2 * kv_heads, head_dim, dtype=dtype)
    positions = torch.tensor([0, 3, 17, 200, 4095])
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(positions.float(), inv_freq).repeat(1, 2)  # [tokens, head_dim]
    cos_sin = torch.stack((angles.cos(), angles.sin()), dim=1).to(dtype)  # [tokens, 2, head_dim]
    expected, actual = qkv.clone(), qkv.clone()
    REFERENCE.rotary_embedding_(expected[:, : q_heads + kv_heads], cos_sin)
    cpu_ops.rotary_embedding_(actual[:, : q_heads + kv_heads], cos_sin)  # a strided view, as the model passes
    torch.testing.assert_close(actual, expected, **TOLERANCE[dtype])
    assert torch.equal(actual[:, q_heads + kv_heads:], qkv[:, q_heads + kv_heads:])  # v heads untouched
    assert torch.equal(actual[0], expected[0]) and torch.equal(actual[0], qkv[0])  # position 0 is the identity


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens,intermediate", [(1, 1536), (9, 40)])
def test_silu_and_mul(cpu_ops, dtype, tokens, intermediate):
    gate_up = randn(tokens, 2 * intermediate, dtype=dtype, scale=4.0)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # far tails and zero: no overflow, no NaN
    out = cpu_ops.silu_and_mul(gate_up)
    torch.testing.assert_close(out, REFERENCE.silu_and_mul(gate_up), **TOLERANCE[dtype])
    assert out.shape == (tokens, intermediate) and not out.isnan().any()


def test_bad_shapes_and_dtypes_are_refused_with_the_op_named(cpu_ops):
    x = torch.randn(3, 32)
    with pytest.raises(RuntimeError, match="rms_norm: weight is \\[hidden\\]"):
        cpu_ops.rms_norm(x, torch.ones(16), 1e-6)
    with pytest.raises(RuntimeError, match="add_rms_norm: residual is x's shape"):
        cpu_ops.add_rms_norm(x, torch.randn(2, 32), torch.ones(32), 1e-6)
    with pytest.raises(RuntimeError, match="rms_norm: dtype Double"):
        cpu_ops.rms_norm(x.double(), torch.ones(32, dtype=torch.double), 1e-6)
    with pytest.raises(RuntimeError, match="rotary_embedding_: cos_sin"):
        cpu_ops.rotary_embedding_(torch.randn(3, 2, 16), torch.randn(3, 2, 8))
    with pytest.raises(RuntimeError, match="silu_and_mul: gate_up is"):
        cpu_ops.silu_and_mul(torch.randn(3, 5))
