"""``--quantization int8|int4``: the formats, the kernels against them, the model, and the refusals."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from executor import quantization
from executor.loader import load_model
from executor.quantization import (
    INT4_GROUP_SIZE, Int4Linear, Int8Linear, QuantizationUnsupported, check_supported, dequantize_int4,
    dequantize_int8, quantize_int4, quantize_int8,
)
from executor.runner import ModelRunner, RunnerOptions, SequenceInput
from executor.skinny import SkinnyInt8Matmul

CPU = torch.device("cpu")
QUANTIZED = {"int8": Int8Linear, "int4": Int4Linear}
# Relative (Frobenius) error of a quantized layer's output against the float layer's, for
# Gaussian weights: 8 bits per channel lose ~0.8%, 4 bits per group of 32 ~8%.
OUTPUT_ERROR = {"int8": 0.015, "int4": 0.12}


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


def float_linear(in_features: int = 128, out_features: int = 96, dtype=torch.float32, bias=True) -> nn.Linear:
    torch.manual_seed(1)
    return nn.Linear(in_features, out_features, bias=bias).to(dtype).requires_grad_(False)


def test_formats_round_trip_within_half_a_step():
    weight = torch.randn(48, 96)
    codes, scales = quantize_int8(weight, torch.float32)
    assert codes.dtype == torch.int8 and codes.abs().max() <= 127 and scales.shape == (48,)
    assert ((dequantize_int8(codes, scales) - weight).abs() <= scales[:, None] / 2 + 1e-6).all()
    codes, scales, zeros = quantize_int4(weight, torch.float32)
    assert codes.dtype == torch.uint8 and codes.max() <= 15 and scales.shape == (48, 96 // INT4_GROUP_SIZE)
    step = scales.repeat_interleave(INT4_GROUP_SIZE, dim=1)
    assert ((dequantize_int4(codes, scales, zeros) - weight).abs() <= step / 2 + 1e-5).all()
    # A constant group (zero range) and an all-zero channel stay exact instead of dividing by zero.
    flat = torch.zeros(16, 64)
    flat[0, :32] = 0.5
    assert torch.equal(dequantize_int4(*quantize_int4(flat, torch.float32)), flat)
    assert torch.equal(dequantize_int8(*quantize_int8(flat, torch.float32)), flat)


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_quantized_linear_is_the_dequantized_matmul_and_close_to_float(mode, dtype):
    linear = float_linear(dtype=dtype)
    x = torch.randn(5, 128).to(dtype)
    layer = QUANTIZED[mode](linear)
    out = layer(x)
    assert out.shape == (5, 96) and out.dtype == dtype
    if mode == "int8":
        weight = dequantize_int8(*quantize_int8(linear.weight, dtype))
    else:
        weight = dequantize_int4(*quantize_int4(linear.weight, dtype))
    exact = x.float() @ weight.t() + linear.bias.float()
    # The kernel computes exactly the format's weights (up to the compute dtype's rounding).
    assert relative_error(out, exact) < (1e-5 if dtype == torch.float32 else 1e-2)
    assert relative_error(out, linear(x)) < OUTPUT_ERROR[mode]
    # Leading dimensions pass through, as for nn.Linear.
    assert torch.allclose(layer(x.view(1, 5, 128))[0], out)


@pytest.fixture(scope="module")
def tiny_runners(tiny_model_dir):
    return {mode: ModelRunner(RunnerOptions(tiny_model_dir, dtype="float32", quantization=mode, num_blocks=16))
            for mode in ("none", "int8", "int4")}


def test_describe_reports_the_quantization(tiny_runners):
    assert [tiny_runners[m].info.dtype for m in ("none", "int8", "int4")] == ["float32", "float32+int8", "float32+int4"]
    layer = tiny_runners["int8"].model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, Int8Linear) and isinstance(layer.mlp.down_proj, Int8Linear)
    assert isinstance(tiny_runners["int4"].model.layers[1].mlp.gate_up_proj, Int4Linear)


def test_int8_model_gives_the_float_model_greedy_tokens(tiny_runners):
    """Logits after a prompt and then 7 greedy steps: int8 stays within 2% of float and picks
    the same tokens; int4 (coarser) within 15%."""
    prompt = [1, 450, 7032, 310, 278, 5917, 13, 1576]
    tokens = {}
    for mode, runner in tiny_runners.items():
        seq, logits = list(prompt), []
        for _ in range(8):
            start = len(logits) and len(seq) - 1
            step = runner.forward_logits([SequenceInput(0, seq[start:], start, [1, 2], sample=True)])[0]
            logits.append(step)
            seq.append(int(step.argmax()))
        tokens[mode] = (seq[len(prompt):], torch.stack(logits))
    float_tokens, float_logits = tokens["none"]
    assert tokens["int8"][0] == float_tokens
    assert relative_error(tokens["int8"][1], float_logits) < 0.02
    assert relative_error(tokens["int4"][1], float_logits) < 0.15


def test_bad_quantization_values_fail_clearly(tiny_model_dir):
    from executor.__main__ import build_parser

    parser = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantization", "int3"])
    assert parser.parse_args([]).quantization == "none"
    with pytest.raises(QuantizationUnsupported, match="quantization: 'fp8' is not one of none, int8, int4") as info:
        ModelRunner(RunnerOptions(tiny_model_dir, quantization="fp8", num_blocks=16))
    assert parser.in_flag_terms(str(info.value)).startswith("--quantization: 'fp8'")


def test_int4_without_the_kernel_fails_with_the_message(tiny_model_dir, monkeypatch):
    real = quantization.has_kernel
    monkeypatch.setattr(quantization, "has_kernel", lambda op, device: "int4" not in op and real(op, device))
    with pytest.raises(QuantizationUnsupported, match="int4 is not supported by this torch build .* on cpu: it needs "
                                                      "aten::_convert_weight_to_int4pack_for_cpu"):
        load_model(tiny_model_dir, torch.float32, CPU, 64, quantization="int4")
    check_supported("int8", torch.float32, CPU)  # int8 is unaffected
    with pytest.raises(QuantizationUnsupported, match="int4 is not supported .* on meta"):
        check_supported("int4", torch.bfloat16, torch.device("meta"))


def test_int4_refuses_shapes_its_kernel_cannot_take():
    model = nn.Module()
    layer = nn.Module()
    layer.self_attn, layer.mlp = nn.Module(), nn.Module()
    layer.self_attn.qkv_proj, layer.self_attn.o_proj = float_linear(64, 128), float_linear(64, 64)
    layer.mlp.gate_up_proj, layer.mlp.down_proj = float_linear(64, 200), float_linear(100, 64)
    model.layers, model.embed_tokens = nn.ModuleList([layer]), nn.Embedding(10, 64)
    with pytest.raises(QuantizationUnsupported, match=r"layers.0.mlp.gate_up_proj is \[200, 64\]"):
        quantization.quantize_model(model, "int4")
    assert isinstance(layer.self_attn.qkv_proj, nn.Linear)  # refused before anything was replaced


def one_layer_model(dtype=torch.float32) -> nn.Module:
    model, layer = nn.Module(), nn.Module()
    layer.self_attn, layer.mlp = nn.Module(), nn.Module()
    layer.self_attn.qkv_proj, layer.self_attn.o_proj = float_linear(64, 128, dtype), float_linear(64, 64, dtype)
    layer.mlp.gate_up_proj, layer.mlp.down_proj = float_linear(64, 256, dtype), float_linear(128, 64, dtype)
    model.layers, model.embed_tokens = nn.ModuleList([layer]), nn.Embedding(10, 64).to(dtype)
    model.lm_head_weight = lambda: model.embed_tokens.weight
    return model


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantizing_where_only_torchs_kernels_run_says_it_is_slower_than_none(mode, monkeypatch):
    """Without the compiled kernels (no C++ compiler) the quantized modes run torch's kernels, 10x
    slower than float32 at 27 rows on an AVX2 EPYC: a user asking for them there is told at start,
    not left to find it in a benchmark."""
    warnings = []
    monkeypatch.setattr(quantization.log, "warning", lambda event, **fields: warnings.append((event, fields)))
    quantization.quantize_model(one_layer_model(), mode, skinny_ops=None)
    assert [event for event, _ in warnings] == ["quantization_slower_than_none"]
    assert warnings[0][1]["mode"] == mode and "--quantization none" in warnings[0][1]["reason"]


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_a_float32_model_takes_the_compiled_kernels_without_a_warning(mode, cpu_ops, monkeypatch):
    """A CPU without native bf16 computes in float32: the compiled kernels take its activations, so
    nothing is slower than none and nothing is logged."""
    warnings = []
    monkeypatch.setattr(quantization.log, "warning", lambda event, **fields: warnings.append((event, fields)))
    model = one_layer_model(torch.float32)
    model.config = SimpleNamespace(tie_word_embeddings=True)
    quantization.quantize_model(model, mode, skinny_ops=cpu_ops)
    assert isinstance(model.quantized_lm_head, SkinnyInt8Matmul)
    projections = [m for m in model.modules() if isinstance(m, (quantization.Int8Linear, quantization.Int4Linear))]
    assert len(projections) == 4 and all(p.skinny is not None for p in projections) and not warnings
    x = torch.randn(3, 64)
    assert model.layers[0].self_attn.qkv_proj(x, decode_step=True).dtype == torch.float32


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_linear_on_cuda(mode):
    device = torch.device("cuda", 0)
    try:
        check_supported(mode, torch.bfloat16, device)
    except QuantizationUnsupported as exc:
        pytest.skip(str(exc))
    linear = float_linear(256, 128, torch.bfloat16).to(device)
    x = torch.randn(7, 256, dtype=torch.bfloat16, device=device)
    assert relative_error(QUANTIZED[mode](linear)(x), linear(x)) < OUTPUT_ERROR[mode]
