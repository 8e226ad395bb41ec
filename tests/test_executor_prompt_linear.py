"""The int8 weights' prompt kernel (csrc/cpu/prompt_linear_int8.cpp): the codes expanded to bf16 on
AMX tiles against float32 arithmetic on the unrounded activations, and the layer taking it for
steps with prompt tokens only. Skipped where the CPU has no AMX bf16 tiles, where the op refuses."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from executor.quantization import Int8Linear, dequantize_int8, quantize_int8
from tests.test_executor_skinny_linear import BF16_STEP, randn, reference


@pytest.fixture
def prompt_ops(cpu_ops):
    if not cpu_ops.has_prompt_linear_int8():
        pytest.skip("this CPU has no AMX bf16 tiles: int8 prompt steps keep skinny_linear_int8")
    return cpu_ops


def pack(cpu_ops, out_features, in_features, seed=0):
    codes, scales = quantize_int8(randn(out_features, in_features, scale=0.05, seed=seed), torch.bfloat16)
    return codes, scales, cpu_ops.pack_skinny_int8(codes, scales)


@pytest.mark.parametrize("rows", [1, 5, 16, 31, 33, 64])
@pytest.mark.parametrize("out_features,in_features", [(16, 32), (40, 64), (832, 576), (7, 1536)])
def test_matches_float32_arithmetic_on_unrounded_activations(prompt_ops, rows, out_features, in_features):
    """No activation rounding: the integer codes are exact in bf16, so the product is the float32
    one of x and the dequantized weights (odd tile counts, ragged outputs and row tails included)."""
    codes, scales, packed = pack(prompt_ops, out_features, in_features)
    x, bias = randn(rows, in_features), randn(out_features)
    out = prompt_ops.prompt_linear_int8(x, packed, bias, out_features)
    assert out.shape == (rows, out_features) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out, reference(x, dequantize_int8(codes, scales), bias), **BF16_STEP)


def test_a_row_gets_the_same_bits_alone_or_in_any_batch(prompt_ops):
    """A prompt token's projection does not depend on how many tokens share its step."""
    _, _, packed = pack(prompt_ops, 100, 576)
    batch = randn(70, 576)
    alone = torch.cat([prompt_ops.prompt_linear_int8(batch[i:i + 1], packed, None, 100) for i in range(70)])
    for rows in (2, 17, 32, 33, 70):
        assert torch.equal(prompt_ops.prompt_linear_int8(batch[:rows], packed, None, 100), alone[:rows]), rows
    strided = torch.cat([batch, batch], dim=1)[:, :576]  # rows 1152 apart: taken as they are or copied
    assert torch.equal(prompt_ops.prompt_linear_int8(strided, packed, None, 100), alone)


def test_a_nan_activation_reaches_its_token_only(prompt_ops):
    _, _, packed = pack(prompt_ops, 48, 64)
    x = randn(20, 64)
    x[1, 40] = float("nan")
    out = prompt_ops.prompt_linear_int8(x, packed, None, 48)
    assert out[1].isnan().all() and not out[[0, *range(2, 20)]].isnan().any()


def test_bad_arguments_are_refused_clearly(prompt_ops):
    _, _, packed = pack(prompt_ops, 32, 64)
    with pytest.raises(RuntimeError, match="x has 32 features, the weight 64"):
        prompt_ops.prompt_linear_int8(randn(3, 32), packed, None, 32)
    with pytest.raises(RuntimeError, match="out_features 48 does not match"):
        prompt_ops.prompt_linear_int8(randn(3, 64), packed, None, 48)
    with pytest.raises(RuntimeError, match="x must be"):
        prompt_ops.prompt_linear_int8(randn(3, 64).float(), packed, None, 32)
    with pytest.raises(RuntimeError, match="bias must be"):
        prompt_ops.prompt_linear_int8(randn(3, 64), packed, randn(5), 32)
    assert prompt_ops.prompt_linear_int8(randn(0, 64), packed, None, 32).shape == (0, 32)


def test_without_amx_bf16_the_op_refuses_and_the_layer_keeps_the_int8_kernel(cpu_ops):
    if cpu_ops.has_prompt_linear_int8():
        pytest.skip("this CPU has AMX bf16 tiles")
    _, _, packed = pack(cpu_ops, 32, 64)
    with pytest.raises(RuntimeError, match="needs AMX bf16 tiles"):
        cpu_ops.prompt_linear_int8(randn(3, 64), packed, None, 32)
    layer = Int8Linear(nn.Linear(64, 32, bias=False).to(torch.bfloat16), skinny_ops=cpu_ops)
    x = randn(3, 64)
    assert torch.equal(layer(x, decode_step=False), layer(x, decode_step=True))


def test_the_layer_takes_it_for_prompt_steps_and_the_int8_kernel_for_decode_steps(prompt_ops):
    linear = nn.Linear(576, 96, bias=True)
    with torch.no_grad():
        linear.weight.copy_(randn(96, 576, scale=0.05).float())
    layer = Int8Linear(linear.to(torch.bfloat16), skinny_ops=prompt_ops)
    x = randn(2, 5, 576)
    packed, bias = layer.skinny.packed, layer.bias
    rows = x.reshape(-1, 576)
    assert torch.equal(layer(x, decode_step=False).reshape(-1, 96), prompt_ops.prompt_linear_int8(rows, packed, bias, 96))
    assert torch.equal(layer(x, decode_step=True).reshape(-1, 96), prompt_ops.skinny_linear_int8(rows, packed, bias, 96))
