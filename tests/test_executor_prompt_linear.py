"""The quantized weights' prompt kernels (csrc/cpu/prompt_linear.cpp): int8 codes and int4 groups
expanded to bf16 on AMX tiles, against float32 arithmetic on the unrounded activations, and the
layers taking them for steps with prompt tokens only. Skipped where the CPU has no AMX bf16 tiles,
where the ops refuse."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from executor.layer_ops import TorchLayerOps
from executor.model import Linear, pack_weight, packed_linear
from executor.quantization import Int4Linear, Int8Linear, dequantize_int4, dequantize_int8, quantize_int4, quantize_int8
from executor.skinny import AMX_SKINNY_MAX_ROWS, SkinnyMatmul
from tests.test_executor_skinny_linear import BF16_STEP, randn, reference


@pytest.fixture
def prompt_ops(cpu_ops):
    if not cpu_ops.has_prompt_linear():
        pytest.skip("this CPU has no AMX bf16 tiles: int8 prompt steps keep skinny_linear_int8")
    return cpu_ops


FORMATS = ["int8", "int4"]
# silu(gate) * up from sums added in another order: gate and up may each land a bf16 rounding step
# from the reference, so their product about two.
SILU_STEPS = dict(rtol=2 ** -6, atol=2e-3)


def silu_op(cpu_ops, kind):
    return cpu_ops.prompt_silu_and_mul_int8 if kind == "int8" else cpu_ops.prompt_silu_and_mul_int4


def pack(cpu_ops, kind, out_features, in_features, seed=0):
    """→ (the weight the prompt op multiplies by, the packed weight, the prompt op, the decode op):
    int8's dequantized in float32 (its scale multiplies the sums), int4's rounded to bf16."""
    weight = randn(out_features, in_features, scale=0.05, seed=seed)
    if kind == "int8":
        codes, scales = quantize_int8(weight, torch.bfloat16)
        return (dequantize_int8(codes, scales), cpu_ops.pack_skinny_int8(codes, scales),
                cpu_ops.prompt_linear_int8, cpu_ops.skinny_linear_int8)
    codes, scales, zeros = quantize_int4(weight, torch.bfloat16)
    return (dequantize_int4(codes, scales, zeros).to(torch.bfloat16), cpu_ops.pack_skinny_int4(codes, scales, zeros),
            cpu_ops.prompt_linear_int4, cpu_ops.skinny_linear_int4)


def quantized_layer(cpu_ops, kind, out_features, in_features=576):
    """An Int8Linear / Int4Linear with a bias, on the CPU kernels."""
    linear = nn.Linear(in_features, out_features, bias=True)
    with torch.no_grad():
        linear.weight.copy_(randn(out_features, in_features, scale=0.05).float())
    return (Int8Linear if kind == "int8" else Int4Linear)(linear.to(torch.bfloat16), skinny_ops=cpu_ops)


@pytest.mark.parametrize("kind", FORMATS)
@pytest.mark.parametrize("rows", [1, 5, 16, 31, 33, 64])
@pytest.mark.parametrize("out_features,in_features", [(16, 32), (40, 64), (832, 576), (7, 1536)])
def test_matches_float32_arithmetic_on_unrounded_activations(prompt_ops, kind, rows, out_features, in_features):
    """No activation rounding: the product is the float32 one of x and the dequantized weights in
    bf16 (int8's codes are exact in bf16; int4's weights round once), odd tile counts, ragged
    outputs and row tails included."""
    weight, packed, op, _ = pack(prompt_ops, kind, out_features, in_features)
    x, bias = randn(rows, in_features), randn(out_features)
    out = op(x, packed, bias, out_features)
    assert out.shape == (rows, out_features) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out, reference(x, weight, bias), **BF16_STEP)


@pytest.mark.parametrize("kind", FORMATS)
def test_a_row_gets_the_same_bits_alone_or_in_any_batch(prompt_ops, kind):
    """A prompt token's projection does not depend on how many tokens share its step."""
    _, packed, op, _ = pack(prompt_ops, kind, 100, 576)
    batch = randn(70, 576)
    alone = torch.cat([op(batch[i:i + 1], packed, None, 100) for i in range(70)])
    for rows in (2, 17, 32, 33, 70):
        assert torch.equal(op(batch[:rows], packed, None, 100), alone[:rows]), rows
    strided = torch.cat([batch, batch], dim=1)[:, :576]  # rows 1152 apart: taken as they are or copied
    assert torch.equal(op(strided, packed, None, 100), alone)


@pytest.mark.parametrize("kind", FORMATS)
def test_rows_beyond_one_pass_over_the_weights(prompt_ops, kind):
    """Long prompts are taken in passes of rows that fit in L2 (256 rows of 1536 inputs): each row
    the same as in a short call, and as float32 arithmetic."""
    weight, packed, op, _ = pack(prompt_ops, kind, 40, 1536)
    x = randn(300, 1536)
    out = op(x, packed, None, 40)
    torch.testing.assert_close(out, reference(x, weight), **BF16_STEP)
    assert torch.equal(out[250:], op(x[250:], packed, None, 40))


@pytest.mark.parametrize("kind", FORMATS)
def test_a_nan_activation_reaches_its_token_only(prompt_ops, kind):
    _, packed, op, _ = pack(prompt_ops, kind, 48, 64)
    x = randn(20, 64)
    x[1, 40] = float("nan")
    out = op(x, packed, None, 48)
    assert out[1].isnan().all() and not out[[0, *range(2, 20)]].isnan().any()


@pytest.mark.parametrize("kind", FORMATS)
def test_bad_arguments_are_refused_clearly(prompt_ops, kind):
    _, packed, op, _ = pack(prompt_ops, kind, 32, 64)
    with pytest.raises(RuntimeError, match="x has 32 features, the weight 64"):
        op(randn(3, 32), packed, None, 32)
    with pytest.raises(RuntimeError, match="out_features 48 does not match"):
        op(randn(3, 64), packed, None, 48)
    with pytest.raises(RuntimeError, match="x must be"):
        op(randn(3, 64).float(), packed, None, 32)
    with pytest.raises(RuntimeError, match="bias must be"):
        op(randn(3, 64), packed, randn(5), 32)
    with pytest.raises(RuntimeError, match="packed must come from"):
        op(randn(3, 64), pack(prompt_ops, "int4" if kind == "int8" else "int8", 32, 64)[1], None, 32)
    assert op(randn(0, 64), packed, None, 32).shape == (0, 32)


@pytest.mark.parametrize("kind", FORMATS)
@pytest.mark.parametrize("rows", [1, 5, 32, 33, 300])
@pytest.mark.parametrize("intermediate,in_features", [(16, 64), (48, 576), (96, 1536)])
def test_silu_and_mul_from_the_sums_is_the_separate_ops_bit_for_bit(prompt_ops, kind, rows, intermediate,
                                                                    in_features):
    """The MLP's gate_up projection with the activation applied to its sums: the same bits as
    silu_and_mul after prompt_linear (gate and up each rounded to bf16 first), and within bf16
    rounding of float32 arithmetic followed by torch's SiLU; with and without a bias, short rows
    and rows past one pass over the weights (300 of 1536 inputs)."""
    weight, packed, op, _ = pack(prompt_ops, kind, 2 * intermediate, in_features)
    x, bias = randn(rows, in_features), randn(2 * intermediate, seed=1)
    for b in (None, bias):
        fused = silu_op(prompt_ops, kind)(x, packed, b, intermediate)
        assert fused.shape == (rows, intermediate) and fused.dtype == torch.bfloat16
        assert torch.equal(fused, prompt_ops.silu_and_mul(op(x, packed, b, 2 * intermediate)))
        expected = TorchLayerOps().silu_and_mul(reference(x, weight, b))
        torch.testing.assert_close(fused, expected, **SILU_STEPS)


@pytest.mark.parametrize("kind", FORMATS)
def test_silu_and_mul_refuses_a_weight_that_is_not_gate_and_up(prompt_ops, kind):
    _, packed, _, _ = pack(prompt_ops, kind, 96, 64)
    fused = silu_op(prompt_ops, kind)
    with pytest.raises(RuntimeError, match="has 96 outputs, not 2 x intermediate 40"):
        fused(randn(3, 64), packed, None, 40)
    _, odd, _, _ = pack(prompt_ops, kind, 40, 64)  # gate and up of 20: not whole tiles
    with pytest.raises(RuntimeError, match="not 2 x intermediate 20 \\(a multiple of 16\\)"):
        fused(randn(3, 64), odd, None, 20)
    with pytest.raises(RuntimeError, match="bias must be"):
        fused(randn(3, 64), packed, randn(48), 48)
    with pytest.raises(RuntimeError, match="x has 32 features"):
        fused(randn(3, 32), packed, None, 48)


@pytest.mark.parametrize("kind", FORMATS)
def test_the_layer_applies_silu_and_mul_to_prompt_sums_and_after_decode_steps(prompt_ops, kind):
    layer = quantized_layer(prompt_ops, kind, 192)
    x = randn(2, 5, 576)
    calls = []
    fused_op = layer.skinny._prompt_silu_op
    layer.skinny._prompt_silu_op = lambda *args: calls.append(args) or fused_op(*args)
    ops = TorchLayerOps()
    prompt = layer.silu_and_mul(x, ops, decode_step=False)
    assert len(calls) == 1 and prompt.shape == (2, 5, 96)
    assert torch.equal(prompt, ops.silu_and_mul(layer(x, decode_step=False)))
    decode = layer.silu_and_mul(x, ops, decode_step=True)
    assert len(calls) == 1 and torch.equal(decode, ops.silu_and_mul(layer(x, decode_step=True)))


@pytest.mark.parametrize("rows", [1, 5, 33, 300])
@pytest.mark.parametrize("intermediate,in_features", [(16, 64), (48, 576), (96, 1536)])
def test_bf16_silu_and_mul_reads_the_skinny_layout_in_place(prompt_ops, rows, intermediate, in_features):
    """bf16 weights in pack_skinny_weight's layout, which is the tiles' B operand as it lies: within
    bf16 rounding of float32 arithmetic followed by torch's SiLU, and of oneDNN's projection followed
    by silu_and_mul; each row the same bits alone as in the batch."""
    weight, x = randn(2 * intermediate, in_features, scale=0.05), randn(rows, in_features)
    bias = randn(2 * intermediate, seed=1)
    packed = prompt_ops.pack_skinny_weight(weight)
    fused = prompt_ops.prompt_silu_and_mul_bf16(x, packed, bias, intermediate)
    torch.testing.assert_close(fused, TorchLayerOps().silu_and_mul(reference(x, weight, bias)), **SILU_STEPS)
    onednn = prompt_ops.silu_and_mul(packed_linear(x, pack_weight(weight), bias))
    torch.testing.assert_close(fused, onednn, **SILU_STEPS)
    for i in {0, rows // 2, rows - 1}:
        assert torch.equal(prompt_ops.prompt_silu_and_mul_bf16(x[i:i + 1], packed, bias, intermediate), fused[i:i + 1])


@pytest.mark.parametrize("rows", [1, 5, 33, 64])
@pytest.mark.parametrize("out_features,in_features", [(40, 64), (832, 576), (7, 1536)])
def test_bf16_matches_float32_arithmetic(prompt_ops, rows, out_features, in_features):
    weight, x, bias = randn(out_features, in_features, scale=0.05), randn(rows, in_features), randn(out_features)
    out = prompt_ops.prompt_linear_bf16(x, prompt_ops.pack_skinny_weight(weight), bias, out_features)
    assert out.shape == (rows, out_features) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out, reference(x, weight, bias), **BF16_STEP)


def test_bf16_gives_each_row_the_decode_kernels_bits_so_any_step_may_take_either(prompt_ops):
    """On AMX a bf16 projection takes skinny_linear up to AMX_SKINNY_MAX_ROWS rows and this kernel
    beyond, at every step: a token's projection is the same bits in a prompt, a verify step or a
    decode step of any size."""
    weight, bias = randn(100, 576, scale=0.05), randn(100)
    packed = prompt_ops.pack_skinny_weight(weight)
    batch = randn(70, 576)
    alone = torch.cat([prompt_ops.skinny_linear(batch[i:i + 1], packed, bias, 100) for i in range(70)])
    for rows in (1, 17, 33, 70):
        assert torch.equal(prompt_ops.prompt_linear_bf16(batch[:rows], packed, bias, 100), alone[:rows]), rows
    layer = SkinnyMatmul(prompt_ops, weight, max_rows=AMX_SKINNY_MAX_ROWS)
    assert layer.takes_every_step and layer.takes(batch, decode_step=False)
    calls = []
    prompt_op = prompt_ops.prompt_linear_bf16
    layer._ops = SimpleNamespace(skinny_linear=prompt_ops.skinny_linear,
                                 prompt_linear_bf16=lambda *a: calls.append(a) or prompt_op(*a))
    assert torch.equal(layer(batch[:AMX_SKINNY_MAX_ROWS], bias), alone[:AMX_SKINNY_MAX_ROWS]) and not calls
    assert torch.equal(layer(batch, bias), alone) and len(calls) == 1
    with pytest.raises(RuntimeError, match="packed must come from pack_skinny_weight"):
        prompt_ops.prompt_linear_bf16(batch, pack(prompt_ops, "int8", 100, 576)[1], None, 100)
    with pytest.raises(RuntimeError, match="x has 64 features, the weight 576"):
        prompt_ops.prompt_linear_bf16(randn(3, 64), packed, None, 100)


def test_bf16_silu_and_mul_refuses_what_is_not_a_skinny_bf16_gate_up(prompt_ops):
    packed = prompt_ops.pack_skinny_weight(randn(96, 64))
    op = prompt_ops.prompt_silu_and_mul_bf16
    with pytest.raises(RuntimeError, match="packed must come from pack_skinny_weight"):
        op(randn(3, 64), pack(prompt_ops, "int8", 96, 64)[1], None, 48)
    with pytest.raises(RuntimeError, match="x has 32 features, the weight 64"):
        op(randn(3, 32), packed, None, 48)
    with pytest.raises(RuntimeError, match="not 2 x intermediate 40"):
        op(randn(3, 64), packed, None, 40)


def test_the_bf16_layer_applies_silu_and_mul_to_prompt_sums_and_after_decode_steps(prompt_ops):
    layer = Linear(576, 192, bias=True).to(torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(randn(192, 576, scale=0.05))
    layer.packed_weight = pack_weight(layer.weight)
    layer.skinny = SkinnyMatmul(prompt_ops, layer.weight, max_rows=2)
    calls = []
    fused_op = layer.skinny._prompt_silu_op
    layer.skinny._prompt_silu_op = lambda *args: calls.append(args) or fused_op(*args)
    ops, x = TorchLayerOps(), randn(7, 576)
    with torch.inference_mode():
        prompt = layer.silu_and_mul(x, ops, decode_step=False)
        assert len(calls) == 1 and prompt.shape == (7, 96)
        torch.testing.assert_close(prompt, ops.silu_and_mul(layer(x, decode_step=False)), **SILU_STEPS)
        decode = layer.silu_and_mul(x, ops, decode_step=True)
        assert len(calls) == 1 and torch.equal(decode, ops.silu_and_mul(layer(x, decode_step=True)))


@pytest.mark.parametrize("kind", FORMATS)
def test_without_amx_bf16_the_ops_refuse_and_the_layers_keep_the_decode_kernels(cpu_ops, kind):
    if cpu_ops.has_prompt_linear():
        pytest.skip("this CPU has AMX bf16 tiles")
    _, packed, op, _ = pack(cpu_ops, kind, 32, 64)
    with pytest.raises(RuntimeError, match="needs AMX bf16 tiles"):
        op(randn(3, 64), packed, None, 32)
    with pytest.raises(RuntimeError, match="needs AMX bf16 tiles"):
        silu_op(cpu_ops, kind)(randn(3, 64), packed, None, 16)
    layer = (Int8Linear if kind == "int8" else Int4Linear)(nn.Linear(64, 32, bias=False).to(torch.bfloat16),
                                                            skinny_ops=cpu_ops)
    x = randn(3, 64)
    assert torch.equal(layer(x, decode_step=False), layer(x, decode_step=True))


@pytest.mark.parametrize("kind", FORMATS)
def test_the_layer_takes_it_for_prompt_steps_and_the_decode_kernel_for_decode_steps(prompt_ops, kind):
    layer = quantized_layer(prompt_ops, kind, 96)
    _, _, prompt_op, decode_op = pack(prompt_ops, kind, 16, 32)
    x = randn(2, 5, 576)
    packed, bias = layer.skinny.packed, layer.bias
    rows = x.reshape(-1, 576)
    assert torch.equal(layer(x, decode_step=False).reshape(-1, 96), prompt_op(rows, packed, bias, 96))
    assert torch.equal(layer(x, decode_step=True).reshape(-1, 96), decode_op(rows, packed, bias, 96))
