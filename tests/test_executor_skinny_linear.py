"""The CPU's few-row matmuls (csrc/cpu/skinny_linear.cpp and skinny_quantized.cpp, executor/skinny.py), bf16 and int4, against
float32 arithmetic, and the model using them for decode steps: the same logits as oneDNN's packed
matmul (bf16) and torch's int4 kernel, within bf16 rounding."""
from __future__ import annotations

import pytest
import torch

from executor.loader import load_model
from executor.model import Linear, cpu_packs_bf16
from executor.quantization import (Int4Linear, Int8Linear, dequantize_int4, dequantize_int8, quantize_activations_int8,
                                   quantize_int4, quantize_int8)
from executor.runner import ModelRunner, RunnerOptions, SequenceInput
from executor.skinny import (AMX_SKINNY_MAX_ROWS, SKINNY_MAX_ROWS, SkinnyInt4Matmul, SkinnyInt8Matmul, SkinnyMatmul,
                             bf16_skinny_max_rows)
from tests.test_executor_exactness import PROMPTS as EXACTNESS_PROMPTS


def randn(*shape, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed + sum(shape))
    return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)


def reference(x, weight, bias=None):
    # float32 products and sums of the bf16 inputs, rounded to bf16 once: what the kernel computes
    # up to the order of its additions.
    out = x.float() @ weight.float().T
    return (out if bias is None else out + bias.float()).to(torch.bfloat16)


# A bf16 result may land one rounding step (2^-8 relative) away from the reference, since the
# float32 sums are added in another order.
BF16_STEP = dict(rtol=2 ** -7, atol=1e-3)


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 9, 17, 48, SKINNY_MAX_ROWS])
@pytest.mark.parametrize("out_features,in_features", [(16, 2), (40, 64), (40, 66), (832, 576), (7, 1536)])
def test_matches_float32_arithmetic_for_any_rows_and_ragged_outputs(cpu_ops, rows, out_features, in_features):
    weight, x = randn(out_features, in_features, scale=0.05), randn(rows, in_features)
    packed = cpu_ops.pack_skinny_weight(weight)
    out = cpu_ops.skinny_linear(x, packed, None, out_features)
    assert out.shape == (rows, out_features) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out, reference(x, weight), **BF16_STEP)


def test_bias_strided_rows_and_threads_give_the_same_result(cpu_ops):
    weight, bias = randn(100, 96, scale=0.1), randn(100)
    x = randn(5, 128)[:, :96]  # rows 128 apart: the attention output's reshape can be strided like this
    packed = cpu_ops.pack_skinny_weight(weight)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_ops.skinny_linear(x, packed, bias, 100)
        torch.set_num_threads(2)
        two = cpu_ops.skinny_linear(x, packed, bias, 100)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)  # each output tile is summed by one thread, in one order
    torch.testing.assert_close(one, reference(x.contiguous(), weight, bias), **BF16_STEP)


def packed_kernel(cpu_ops, kind: str, weight: torch.Tensor):
    """(the packed weight, the few-row kernel that reads it) for bf16, int8 or int4 weights."""
    if kind == "bf16":
        return cpu_ops.pack_skinny_weight(weight), cpu_ops.skinny_linear
    if kind == "int8":
        return cpu_ops.pack_skinny_int8(*quantize_int8(weight, torch.bfloat16)), cpu_ops.skinny_linear_int8
    return cpu_ops.pack_skinny_int4(*quantize_int4(weight, torch.bfloat16)), cpu_ops.skinny_linear_int4


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_kernels_give_the_same_bits_on_one_thread_and_two(cpu_ops, kind):
    """64 rows of 1536 inputs: enough for the activations' quantization to be split between two
    threads by rows, as the output tiles are; neither split changes a bit."""
    weight = randn(48, 1536, scale=0.05)
    packed, op = packed_kernel(cpu_ops, kind, weight)
    x = randn(64, 1536)
    x[37, 700] = float("nan")  # a group with NaN in the second thread's rows: its row only
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = op(x, packed, None, 48)
        torch.set_num_threads(2)
        two = op(x, packed, None, 48)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one.nan_to_num(), two.nan_to_num())
    assert two[37].isnan().all() and not two[[*range(37), *range(38, 64)]].isnan().any()


@pytest.mark.parametrize("kind", ["bf16", "int8", "int4"])
def test_a_row_gets_the_same_bits_alone_or_in_any_batch(cpu_ops, kind):
    """A token's projection does not depend on what else is in its step: each row is summed in
    the same order whatever the number of rows (the chunks of 8 share weight loads, not sums)."""
    weight = randn(100, 576, scale=0.05)
    packed, op = packed_kernel(cpu_ops, kind, weight)
    batch = randn(70, 576)
    alone = torch.cat([op(batch[i:i + 1], packed, None, 100) for i in range(70)])
    # int8 / int4 where there is AMX: from 9 rows tiles of 16 rows, a tail of <= 4 VNNI; bf16 there:
    # chunks of up to 32 rows on the tiles, the last one shorter
    for rows in (2, 5, 8, 9, 17, 20, 31, 33, 40, 64, 70):
        assert torch.equal(op(batch[:rows], packed, None, 100), alone[:rows]), rows


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_a_prompt_step_beyond_the_cache_gets_each_rows_bits_in_panels(cpu_ops, kind):
    """From 512 KiB of int8 activation codes (~900 rows at K = 576) the tiles pass over panels of rows
    in turn: every row keeps the bits it gets in a batch of 40, the bias and a ragged tile included."""
    weight, bias = randn(40, 576, scale=0.05), randn(40).float()
    packed, op = packed_kernel(cpu_ops, kind, weight)
    x = randn(1000, 576).float()  # 563 KiB of codes: panels of 167 rows
    out = op(x, packed, bias, 40)
    assert torch.equal(out, torch.cat([op(x[i:i + 40], packed, bias, 40) for i in range(0, 1000, 40)]))


def test_zero_rows_and_bad_arguments_are_refused_clearly(cpu_ops):
    weight = randn(32, 64)
    packed = cpu_ops.pack_skinny_weight(weight)
    assert cpu_ops.skinny_linear(randn(0, 64), packed, None, 32).shape == (0, 32)
    with pytest.raises(RuntimeError, match="in_features must be even"):
        cpu_ops.pack_skinny_weight(randn(32, 63))
    with pytest.raises(RuntimeError, match="must be bfloat16"):
        cpu_ops.pack_skinny_weight(weight.float())
    with pytest.raises(RuntimeError, match="x has 32 features, the weight 64"):
        cpu_ops.skinny_linear(randn(1, 32), packed, None, 32)
    with pytest.raises(RuntimeError, match="out_features 40 does not match"):
        cpu_ops.skinny_linear(randn(1, 64), packed, None, 40)
    with pytest.raises(RuntimeError, match="x must be"):
        cpu_ops.skinny_linear(randn(1, 64).float(), packed, None, 32)
    with pytest.raises(RuntimeError, match="bias must be"):
        cpu_ops.skinny_linear(randn(1, 64), packed, randn(31), 32)


def int4_weight(out_features, in_features, seed=0):
    codes, scales, zeros = quantize_int4(randn(out_features, in_features, scale=0.05, seed=seed), torch.bfloat16)
    return (codes, scales, zeros), dequantize_int4(codes, scales, zeros)


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 9, 17, 40])
@pytest.mark.parametrize("out_features,in_features", [(16, 32), (40, 64), (832, 576), (7, 1536)])
def test_int4_matches_float32_arithmetic_on_quantized_activations_and_dequantized_weights(cpu_ops, rows, out_features,
                                                                                        in_features):
    """As int8 (and llama.cpp's Q4_1 x Q8_1): activations rounded per token and group of 32, then
    integer dot products with the 4-bit codes; the rest is float32 arithmetic."""
    quantized, weight = int4_weight(out_features, in_features)
    x, bias = randn(rows, in_features), randn(out_features)
    x[0, :32] = 0  # an all-zero group
    out = cpu_ops.skinny_linear_int4(x, cpu_ops.pack_skinny_int4(*quantized), bias, out_features)
    assert out.shape == (rows, out_features) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out, reference(quantize_activations_int8(x), weight, bias), atol=2e-3, rtol=2 ** -7)
    torch.testing.assert_close(out, reference(x, weight, bias), atol=0.05, rtol=0.02)


@pytest.mark.parametrize("rows", [3, 20])
def test_int4_a_nan_activation_reaches_its_token_only(cpu_ops, rows):
    quantized, _ = int4_weight(48, 64)
    x = randn(rows, 64)
    x[1, 40] = float("nan")
    out = cpu_ops.skinny_linear_int4(x, cpu_ops.pack_skinny_int4(*quantized), None, 48)
    assert out[1].isnan().all() and not out[[0, *range(2, rows)]].isnan().any()


def test_int4_bad_arguments_are_refused_clearly(cpu_ops):
    (codes, scales, zeros), _ = int4_weight(32, 64)
    packed = cpu_ops.pack_skinny_int4(codes, scales, zeros)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        cpu_ops.pack_skinny_int4(codes[:, :48], scales, zeros)
    with pytest.raises(RuntimeError, match=r"codes must be in \[0, 15\]"):
        cpu_ops.pack_skinny_int4(codes + 16, scales, zeros)
    with pytest.raises(RuntimeError, match="scales and zeros must be"):
        cpu_ops.pack_skinny_int4(codes, scales[:, :1], zeros)
    with pytest.raises(RuntimeError, match="x has 32 features, the weight 64"):
        cpu_ops.skinny_linear_int4(randn(1, 32), packed, None, 32)
    with pytest.raises(RuntimeError, match="packed must come from pack_skinny_int4"):
        cpu_ops.skinny_linear_int4(randn(1, 64), codes, None, 32)


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 9, 17, 40])
@pytest.mark.parametrize("out_features,in_features", [(16, 32), (40, 64), (832, 576), (7, 1536)])
def test_int8_matches_float32_arithmetic_on_quantized_activations_and_weights(cpu_ops, rows, out_features,
                                                                              in_features):
    """The int8 kernel rounds each token's activations per group of 32 to 255 levels (VNNI integer
    dot products); with that rounding done alike in torch, the rest is float32 arithmetic."""
    codes, scales = quantize_int8(randn(out_features, in_features, scale=0.05), torch.bfloat16)
    x, bias = randn(rows, in_features), randn(out_features)
    x[0, :32] = 0  # an all-zero group
    out = cpu_ops.skinny_linear_int8(x, cpu_ops.pack_skinny_int8(codes, scales), bias, out_features)
    assert out.shape == (rows, out_features) and out.dtype == torch.bfloat16
    quantized_x = quantize_activations_int8(x)
    # Sums of ~2 * in_features products that partly cancel, added per group: a step of bf16 at
    # the size of the terms (not of the result) apart at most.
    torch.testing.assert_close(out, reference(quantized_x, dequantize_int8(codes, scales), bias), atol=2e-3,
                               rtol=2 ** -7)
    # ... and against the unrounded activations, within what 255 levels per group cost (~0.3%)
    torch.testing.assert_close(out, reference(x, dequantize_int8(codes, scales), bias), atol=0.05, rtol=0.02)


@pytest.mark.parametrize("rows", [3, 20])
def test_int8_a_nan_activation_reaches_its_token_only(cpu_ops, rows):
    codes, scales = quantize_int8(randn(48, 64, scale=0.05), torch.bfloat16)
    x = randn(rows, 64)
    x[1, 40] = float("nan")
    out = cpu_ops.skinny_linear_int8(x, cpu_ops.pack_skinny_int8(codes, scales), None, 48)
    assert out[1].isnan().all() and not out[[0, *range(2, rows)]].isnan().any()


@pytest.mark.parametrize("rows", [1, 3, 9, 40])
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_kernels_take_float32_activations_and_return_float32(cpu_ops, mode, rows):
    """A float32 model (a CPU without native bf16) calls the int8 / int4 kernels with float32 x: the
    same quantized activations and integer dots as from bf16 x of the same values, in float32 out."""
    weight, bias = randn(40, 576, scale=0.05), randn(40)
    if mode == "int8":
        codes, scales = quantize_int8(weight.float(), torch.float32)
        packed, op, dequantized = cpu_ops.pack_skinny_int8(codes, scales), cpu_ops.skinny_linear_int8, \
            dequantize_int8(codes, scales)
    else:
        quantized = quantize_int4(weight.float(), torch.bfloat16)
        packed, op, dequantized = cpu_ops.pack_skinny_int4(*quantized), cpu_ops.skinny_linear_int4, \
            dequantize_int4(*quantized)
    x = randn(rows, 576).float() + torch.randn(rows, 576) * 1e-3  # not bf16 values
    out = op(x, packed, bias.float(), 40)
    assert out.dtype == torch.float32 and out.shape == (rows, 40)
    expected = quantize_activations_int8(x) @ dequantized.float().T + bias.float()
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-5)
    bf16_x = x.to(torch.bfloat16)
    assert torch.equal(op(bf16_x.float(), packed, bias.float(), 40).to(torch.bfloat16), op(bf16_x, packed, bias.float(), 40))
    with pytest.raises(RuntimeError, match="bfloat16 or float32"):
        op(x.double(), packed, None, 40)


def test_int8_bad_arguments_are_refused_clearly(cpu_ops):
    codes, scales = quantize_int8(randn(32, 64), torch.bfloat16)
    packed = cpu_ops.pack_skinny_int8(codes, scales)
    with pytest.raises(RuntimeError, match="codes must be"):
        cpu_ops.pack_skinny_int8(codes.to(torch.uint8), scales)
    with pytest.raises(RuntimeError, match="scales must be"):
        cpu_ops.pack_skinny_int8(codes, scales[:5])
    with pytest.raises(RuntimeError, match="in_features must be a multiple of 32, got 48"):
        cpu_ops.pack_skinny_int8(codes[:, :48], scales)
    with pytest.raises(RuntimeError, match="x has 32 features, the weight 64"):
        cpu_ops.skinny_linear_int8(randn(1, 32), packed, None, 32)
    assert not SkinnyInt8Matmul.fits(codes[:, :48], scales)  # such a layer keeps torch's kernel


@pytest.fixture(scope="module")
def runners(default_model_dir, cpu_ops):
    """runners(mode) → (a runner with the skinny kernels, one whose model was loaded without them),
    built on first use for ``mode`` (none, int8, int4)."""
    made = {}

    def get(mode: str) -> tuple[ModelRunner, ModelRunner]:
        if mode not in made:
            skinny, usual = (ModelRunner(RunnerOptions(default_model_dir, dtype="bfloat16", attention_backend="cpu",
                                                       num_blocks=64, quantization=mode)) for _ in range(2))
            usual.model = load_model(default_model_dir, usual.dtype, usual.device, usual.max_model_len, mode)
            made[mode] = (skinny, usual)
        return made[mode]

    return get


# The skinny kernels replace oneDNN's packed bf16 weights, which only a CPU with native bf16 has.
needs_bf16_packing = pytest.mark.skipif(not cpu_packs_bf16(), reason="this CPU has no native bf16 matmuls "
                                        "(oneDNN's packing needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT)")


@needs_bf16_packing
def test_the_model_decodes_with_it_and_keeps_one_copy_less(runners, cpu_ops):
    model = runners("none")[0].model
    projections = [m for m in model.modules() if isinstance(m, Linear)]
    # on AMX the few-row layout serves every step and oneDNN's copy goes too
    amx = cpu_ops.has_amx()
    assert projections and all((m.packed_weight is None) == amx and m.weight is None for m in projections)
    max_rows = bf16_skinny_max_rows(cpu_ops)  # on AMX fewer: beyond, the prompt kernel is faster
    assert max_rows == (AMX_SKINNY_MAX_ROWS if amx else SKINNY_MAX_ROWS)
    assert all(isinstance(m.skinny, SkinnyMatmul) and m.skinny.max_rows == max_rows
               and m.skinny.takes_every_step == amx for m in projections)
    assert isinstance(model.skinny_lm_head, SkinnyMatmul) and model.skinny_lm_head.max_rows == max_rows
    assert (model.packed_lm_head is None) == amx
    assert model.embed_tokens.weight is not None  # the tied LM head's matrix is the embedding: kept


@needs_bf16_packing
def test_quantized_projections_and_head_get_the_skinny_layouts_and_drop_torchs(runners):
    for mode, linear_class, skinny_class, torch_buffer in (("int8", Int8Linear, SkinnyInt8Matmul, "codes"),
                                                           ("int4", Int4Linear, SkinnyInt4Matmul, "packed")):
        skinny, usual = runners(mode)
        projections = [m for m in skinny.model.modules() if isinstance(m, linear_class)]
        assert projections and all(isinstance(m.skinny, skinny_class) and getattr(m, torch_buffer) is None
                                   for m in projections)
        assert all(m.skinny is None and getattr(m, torch_buffer) is not None
                   for m in usual.model.modules() if isinstance(m, linear_class))
        # the LM head as the peers' quantized checkpoints have it: int8 at every step, no bf16 copies
        head = skinny.model.quantized_lm_head
        assert isinstance(head, SkinnyInt8Matmul) and head.out_features == skinny.model.config.vocab_size
        assert skinny.model.packed_lm_head is None and skinny.model.skinny_lm_head is None
        assert usual.model.quantized_lm_head is None and usual.model.packed_lm_head is not None


# The exactness test's prompts less its second (a near-copy of the first): 8, one decode batch.
PROMPTS = EXACTNESS_PROMPTS[:1] + EXACTNESS_PROMPTS[2:]


def test_prompt_tokens_round_alike_however_few_are_left_after_a_cache_hit(runners, default_model_dir, cpu_ops):
    """A prompt's last few tokens (a prefix-cache hit leaves at most a block's worth) are computed
    exactly as without the skinny kernels (oneDNN), so a cached and an uncached prompt round alike:
    prompt tokens take oneDNN, or on AMX the tile kernels, which sum each row as oneDNN's tiles do."""
    skinny_runner, usual_runner = runners("none")
    prompt = list(range(200, 234))  # 2 tokens left after the hit: few enough for the skinny kernel anywhere
    table = [50, 51, 52]
    results = []
    for runner in (skinny_runner, usual_runner):
        runner.forward_logits([SequenceInput(0, prompt[:32], 0, table)])
        results.append(runner.forward_logits([SequenceInput(0, prompt[32:], 32, table)]))
    assert len(prompt) - 32 <= bf16_skinny_max_rows(cpu_ops) and torch.equal(results[0], results[1])


def test_on_amx_a_bf16_decode_token_is_the_same_bits_alone_in_a_batch_or_beside_a_prompt(runners, cpu_ops):
    """Where the CPU has AMX bf16 tiles every bf16 projection takes the tile kernels, which sum each
    row alike at any row count, and decode rows take the decode attention kernel in any step: a
    greedy answer does not depend on what else the server is doing."""
    if not cpu_ops.has_amx():
        pytest.skip("without AMX, decode steps take the VDPBF16PS kernel and mixed steps oneDNN's GEMM")
    runner = runners("none")[0]
    tables = [[1 + 2 * i, 2 + 2 * i] for i in range(16)]
    for i, table in enumerate(tables):
        runner.forward_logits([SequenceInput(i, [(37 * i + 11 * j) % 20000 + 50 for j in range(20)], 0, table)])
    alone = runner.forward_logits([SequenceInput(0, [1234], 20, tables[0])])[0]
    batch = runner.forward_logits([SequenceInput(i, [1234 + i], 20, table) for i, table in enumerate(tables)])
    prompt = SequenceInput(99, [(5 * j) % 30000 + 10 for j in range(64)], 0, [40, 41, 42, 43, 44])
    mixed = runner.forward_logits([prompt, SequenceInput(0, [1234], 20, tables[0])])
    assert torch.equal(batch[0], alone) and torch.equal(mixed[1], alone)


@pytest.mark.parametrize("mode", ["none", "int8", "int4"])
def test_logits_match_the_usual_kernels(runners, mode, default_model_dir, cpu_ops):
    """Each prompt prefilled, then greedy steps of all 8 prompts at once and of one alone, in a
    runner with the skinny kernels and in one without (oneDNN for bf16, torch's int8 / int4
    matmuls), both fed the latter's greedy tokens. bf16 prefills take oneDNN either way;
    quantized ones take the skinny kernels at every size. The logits differ by bf16 rounding in another summation order, so the bar is the one
    bf16 meets against float32 (tests/test_executor_exactness.py): the log-probabilities of the 5
    most likely tokens within 0.6 nats (int8, int4: see MAX_TOP5_ERROR), the greedy pick the same in
    >= 90% of rows."""
    skinny_runner, usual_runner = runners(mode)
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(default_model_dir / "tokenizer.json"))
    prompts = [tokenizer.encode(p).ids for p in PROMPTS]
    assert len(prompts) <= SKINNY_MAX_ROWS  # without AMX the batch's decode steps take the skinny kernel
    tables = [[1 + 4 * i + j for j in range(4)] for i in range(len(prompts))]
    worst, agree, total = 0.0, 0, 0
    for batch in (list(range(len(prompts))), [3]):
        seqs = [SequenceInput(i, prompts[i], 0, tables[i]) for i in batch]
        for step in range(9):
            skinny, usual = skinny_runner.forward_logits(seqs), usual_runner.forward_logits(seqs)
            top5 = usual.topk(5, dim=-1).indices
            err = (skinny.log_softmax(-1).gather(1, top5) - usual.log_softmax(-1).gather(1, top5)).abs().max()
            worst = max(worst, err.item())
            agree += int((skinny.argmax(-1) == usual.argmax(-1)).sum())
            total += len(seqs)
            seqs = [SequenceInput(i, [t], len(prompts[i]) + step, tables[i])
                    for i, t in zip(batch, usual.argmax(-1).tolist())]
    print(f"\n{mode}, skinny vs the usual kernels: worst top-5 logprob error {worst:.3f} nats, "
          f"argmax agreement {agree}/{total}")
    assert worst < MAX_TOP5_ERROR[mode] and agree / total >= 0.9


# The quantized kernels also round activations (per token and group of 32, to 255 levels) where
# torch's int8 / int4 matmuls take them in bf16: int8 0.75-0.82 nats measured, int4 0.75, so their
# bar is wider; a layout or offset mistake costs whole nats and the greedy agreement.
MAX_TOP5_ERROR = {"none": 0.6, "int4": 1.2, "int8": 1.2}
