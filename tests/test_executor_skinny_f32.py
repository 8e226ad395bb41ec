"""The float32 few-row matmul (csrc/cpu/skinny_linear_f32.cpp, executor/skinny.py's
SkinnyF32Matmul): float32 activations times bf16-valued weights read as bf16, what a float32 model
(a CPU without native bf16) runs for every step. Against float32 arithmetic, and the model using
it: the same greedy tokens and logits within float32 rounding as torch's float32 matmul."""
from __future__ import annotations

import pytest
import torch

from executor.loader import load_model
from executor.model import Linear
from executor.runner import ModelRunner, RunnerOptions, SequenceInput
from executor.skinny import SkinnyF32Matmul
from tests.test_executor_skinny_linear import PROMPTS, randn


def reference(x, weight, bias=None):
    # float64 sums of the same products: the kernel differs only in float32 rounding
    out = x.double() @ weight.double().T
    return (out if bias is None else out + bias.double()).float()


# float32 sums of 1536 products in another order: a few units in the last place of the largest terms
F32_SUMS = dict(rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 33])
@pytest.mark.parametrize("out_features,in_features", [(16, 2), (40, 64), (832, 576), (7, 1536)])
def test_matches_float32_arithmetic_for_any_rows_and_ragged_outputs(cpu_ops, rows, out_features, in_features):
    weight, x = randn(out_features, in_features, scale=0.05), randn(rows, in_features).float()
    x += torch.randn(rows, in_features) * 1e-3  # activations that are not bf16 values: kept unrounded
    out = cpu_ops.skinny_linear_f32(x, cpu_ops.pack_skinny_weight(weight), None, out_features)
    assert out.shape == (rows, out_features) and out.dtype == torch.float32
    torch.testing.assert_close(out, reference(x, weight), **F32_SUMS)


def test_bias_strided_rows_and_threads_give_the_same_result(cpu_ops):
    weight, bias = randn(100, 96, scale=0.1), randn(100).float()
    x = randn(5, 128).float()[:, :96]  # rows 128 apart, as a reshaped attention output can be
    packed = cpu_ops.pack_skinny_weight(weight)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_ops.skinny_linear_f32(x, packed, bias, 100)
        torch.set_num_threads(2)
        two = cpu_ops.skinny_linear_f32(x, packed, bias, 100)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)  # each output tile is summed by one thread, in one order
    torch.testing.assert_close(one, reference(x, weight, bias), **F32_SUMS)


def test_a_row_gets_the_same_bits_alone_or_in_any_batch(cpu_ops):
    """A token's projection does not depend on what else is in its step (chunks of 4 rows share
    weight registers, not sums)."""
    packed = cpu_ops.pack_skinny_weight(randn(100, 576, scale=0.05))
    batch = torch.randn(40, 576)
    alone = torch.cat([cpu_ops.skinny_linear_f32(batch[i:i + 1], packed, None, 100) for i in range(40)])
    for rows in (2, 3, 4, 5, 8, 17, 32, 33, 40):
        assert torch.equal(cpu_ops.skinny_linear_f32(batch[:rows], packed, None, 100), alone[:rows]), rows


def test_a_prompt_step_too_large_for_the_cache_gets_the_same_bits_in_panels_of_rows(cpu_ops):
    """Beyond 2 MiB of x (a long prompt's step) the tiles pass over panels of rows in turn, each
    panel's first chunk widening the tile again: every row keeps the bits it gets in a small batch,
    the bias and a ragged last tile included."""
    weight, bias = randn(40, 1536, scale=0.05), randn(40).float()
    packed = cpu_ops.pack_skinny_weight(weight)
    x = torch.randn(400, 1536)  # 2.4 MiB: panels of 31 rows
    out = cpu_ops.skinny_linear_f32(x, packed, bias, 40)
    torch.testing.assert_close(out, reference(x, weight, bias), **F32_SUMS)
    small = torch.cat([cpu_ops.skinny_linear_f32(x[i:i + 25], packed, bias, 40) for i in range(0, 400, 25)])
    assert torch.equal(out, small)


def test_zero_rows_and_bad_arguments_are_refused_clearly(cpu_ops):
    packed = cpu_ops.pack_skinny_weight(randn(32, 64))
    assert cpu_ops.skinny_linear_f32(torch.zeros(0, 64), packed, None, 32).shape == (0, 32)
    with pytest.raises(RuntimeError, match="x must be"):
        cpu_ops.skinny_linear_f32(randn(1, 64), packed, None, 32)  # bf16 activations
    with pytest.raises(RuntimeError, match="x has 32 features, the weight 64"):
        cpu_ops.skinny_linear_f32(torch.zeros(1, 32), packed, None, 32)
    with pytest.raises(RuntimeError, match="out_features 40 does not match"):
        cpu_ops.skinny_linear_f32(torch.zeros(1, 64), packed, None, 40)
    with pytest.raises(RuntimeError, match="bias must be"):
        cpu_ops.skinny_linear_f32(torch.zeros(1, 64), packed, torch.zeros(31), 32)
    with pytest.raises(RuntimeError, match="packed must come from pack_skinny_weight"):
        cpu_ops.skinny_linear_f32(torch.zeros(1, 64), packed.float(), None, 32)


def test_only_weights_that_are_exactly_bf16_values_take_it():
    """Nothing is rounded: a float32 checkpoint's weights (or a bf16 layer that was not) keep the
    float32 matmul at every step."""
    weight = randn(8, 64).float()
    assert SkinnyF32Matmul.fits(weight)
    nudged = weight.clone()
    nudged[3, 5] += 2 ** -20
    assert not SkinnyF32Matmul.fits(nudged)
    assert not SkinnyF32Matmul.fits(weight[:, :63]) and not SkinnyF32Matmul.fits(weight.to(torch.bfloat16))


@pytest.fixture(scope="module")
def float32_runners(default_model_dir, cpu_ops):
    """(a float32 runner whose projections take the kernel, one whose model was loaded without it)."""
    skinny, usual = (ModelRunner(RunnerOptions(default_model_dir, dtype="float32", attention_backend="cpu",
                                               num_blocks=64)) for _ in range(2))
    usual.model = load_model(default_model_dir, usual.dtype, usual.device, usual.max_model_len)
    return skinny, usual


def test_a_float32_model_of_a_bf16_checkpoint_runs_every_step_with_it(float32_runners, cpu_ops, monkeypatch):
    """Every projection and the LM head take the kernel, their float32 weights dropped (half the
    bytes held); a prompt step's projections take it too."""
    model = float32_runners[0].model
    projections = [m for m in model.modules() if isinstance(m, Linear)]
    assert projections and all(isinstance(m.skinny, SkinnyF32Matmul) and m.weight is None for m in projections)
    assert isinstance(model.skinny_lm_head, SkinnyF32Matmul) and model.skinny_lm_head.max_rows is None
    assert all(m.skinny is None for m in float32_runners[1].model.modules() if isinstance(m, Linear))
    rows = []

    class CountingOps:
        @staticmethod
        def skinny_linear_f32(x, *args):
            rows.append(x.shape[0])
            return cpu_ops.skinny_linear_f32(x, *args)

    for skinny in [m.skinny for m in projections] + [model.skinny_lm_head]:
        monkeypatch.setattr(skinny, "_ops", CountingOps())
    float32_runners[0].forward_logits([SequenceInput(0, list(range(100, 400)), 0, list(range(1, 20)))])
    assert len(rows) == len(projections) + 1 and rows[0] == 300  # every projection, then the head's 1 row


def test_logits_and_greedy_tokens_match_torchs_float32_matmul(float32_runners, default_model_dir):
    """Each prompt prefilled, then greedy steps of all prompts at once and of one alone, with and
    without the kernel, both fed their own greedy tokens: the same tokens, and logits within float32
    rounding of the sums (the products are the same)."""
    from tokenizers import Tokenizer

    skinny_runner, usual_runner = float32_runners
    tokenizer = Tokenizer.from_file(str(default_model_dir / "tokenizer.json"))
    prompts = [tokenizer.encode(p).ids for p in PROMPTS]
    tables = [[1 + 4 * i + j for j in range(4)] for i in range(len(prompts))]
    worst = 0.0
    for batch in (list(range(len(prompts))), [3]):
        seqs = [SequenceInput(i, prompts[i], 0, tables[i]) for i in batch]
        for step in range(9):
            skinny, usual = skinny_runner.forward_logits(seqs), usual_runner.forward_logits(seqs)
            assert torch.equal(skinny.argmax(-1), usual.argmax(-1)), step
            worst = max(worst, (skinny - usual).abs().max().item())
            seqs = [SequenceInput(i, [t], len(prompts[i]) + step, tables[i])
                    for i, t in zip(batch, usual.argmax(-1).tolist())]
    print(f"\nfloat32, skinny_linear_f32 vs torch's matmul: worst logit difference {worst:.2e}")
    assert worst < 1e-2  # logits span ~30; a wrong weight or layout costs whole units
