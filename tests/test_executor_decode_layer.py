"""A decode step's layers in one compiled call each (csrc/cpu/decode_layer.cpp,
executor/decode_layer.py): the same bits as the Python layers, taken only where it applies."""
from __future__ import annotations

import pytest
import torch

from executor.decode_layer import FusedDecodeLayers
from executor.model import cpu_packs_bf16
from executor.runner import ModelRunner, RunnerOptions, SequenceInput
from tests.test_executor_skinny_linear import PROMPTS


def runner_pair(model_dir, dtype: str, **options) -> tuple[ModelRunner, ModelRunner]:
    """(a runner whose model has the fused layers, one whose model is the same without them)."""
    fused, layered = (ModelRunner(RunnerOptions(model_dir, dtype=dtype, attention_backend="cpu", num_blocks=64,
                                                **options)) for _ in range(2))
    assert isinstance(fused.model.fused_decode, FusedDecodeLayers)
    layered.model.fused_decode = None
    return fused, layered


def counting(fused_layers: FusedDecodeLayers) -> list[int]:
    """Counts the compiled calls of ``fused_layers`` from now on: [calls]."""
    calls = [0]
    op = fused_layers._op

    def counted(*args):
        calls[0] += 1
        return op(*args)

    fused_layers._op = counted
    return calls


@pytest.fixture(scope="module")
def prompts(default_model_dir):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(default_model_dir / "tokenizer.json"))
    return [tokenizer.encode(p).ids for p in PROMPTS]


def dtypes():
    yield "float32"
    yield pytest.param("bfloat16", marks=pytest.mark.skipif(not cpu_packs_bf16(), reason="this CPU has no native "
                                                            "bf16 matmuls: a bf16 model has no few-row layouts"))


@pytest.mark.parametrize("quantization,kv_cache_dtype", [("none", "auto"), ("int8", "auto"), ("int4", "auto"),
                                                          ("none", "bfloat16"), ("none", "int8"), ("int4", "int8")])
@pytest.mark.parametrize("dtype", dtypes())
def test_decode_steps_give_the_same_bits_and_kv_as_the_python_layers(default_model_dir, cpu_ops, prompts, dtype,
                                                                       quantization, kv_cache_dtype):
    """Prompts prefilled, then greedy decode steps of several sequences and of one alone: every
    logit and every KV slot written equal, and one compiled call per layer on each decode step
    (quantized projections: at any batch size; a float32 model's bf16 cache, and the int8 cache's
    records, too)."""
    fused, layered = runner_pair(default_model_dir, dtype, quantization=quantization, kv_cache_dtype=kv_cache_dtype)
    if kv_cache_dtype != "auto":
        assert fused.kv_caches[0][0].dtype == (torch.int8 if kv_cache_dtype == "int8" else torch.bfloat16)
    calls = counting(fused.model.fused_decode)
    max_rows = fused.model.fused_decode.max_rows or len(prompts)
    # the quantized layouts and the float32 one take any number of rows; bf16's up to its limit
    assert (fused.model.fused_decode.max_rows is None) == (quantization != "none" or dtype == "float32")
    batch = list(range(min(len(prompts), max_rows)))
    tables = [[1 + 4 * i + j for j in range(4)] for i in range(len(prompts))]
    for chosen in (batch, [3]):
        seqs = [SequenceInput(i, prompts[i], 0, tables[i]) for i in chosen]
        for step in range(5):
            before = calls[0]
            a, b = fused.forward_logits(seqs), layered.forward_logits(seqs)
            assert torch.equal(a, b), step
            decode = step > 0
            assert calls[0] - before == (fused.model.config.num_layers if decode else 0)
            seqs = [SequenceInput(i, [t], len(prompts[i]) + step, tables[i]) for i, t in zip(chosen, a.argmax(-1).tolist())]
    for (k1, v1), (k2, v2) in zip(fused.kv_caches, layered.kv_caches):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


def test_steps_it_does_not_take_run_the_python_layers(default_model_dir, cpu_ops, prompts):
    """A step with prompt tokens keeps DecoderLayer (and still agrees with it)."""
    fused, layered = runner_pair(default_model_dir, "float32")
    calls = counting(fused.model.fused_decode)
    tables = [[1], [2]]  # 8 prompt tokens and 2 more: one block each
    prompt = prompts[0][:8]
    for runner in (fused, layered):
        runner.forward_logits([SequenceInput(i, prompt, 0, tables[i]) for i in range(2)])
    mixed = [SequenceInput(0, [9], len(prompt), tables[0]), SequenceInput(1, [5, 6], len(prompt), tables[1])]
    assert torch.equal(fused.forward_logits(mixed), layered.forward_logits(mixed))
    assert calls[0] == 0


def test_bad_arguments_are_refused_clearly(cpu_ops):
    x = torch.zeros(1, 64)
    cache = torch.zeros(4, 1, 16, 16)
    with pytest.raises(RuntimeError, match="6 weights, 4 biases and 4 sizes"):
        cpu_ops.decode_layer(x, None, [x] * 5, [None] * 4, cache, cache, torch.zeros(1, 1, dtype=torch.int32),
                             torch.ones(1, dtype=torch.int32), torch.zeros(1, dtype=torch.long),
                             torch.zeros(1, 2, 16), [1, 1, 16, 32], 1e-5, 0.25)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        cpu_ops.decode_layer(x.half(), None, [x] * 6, [None] * 4, cache, cache, torch.zeros(1, 1, dtype=torch.int32),
                             torch.ones(1, dtype=torch.int32), torch.zeros(1, dtype=torch.long),
                             torch.zeros(1, 2, 16), [1, 1, 16, 32], 1e-5, 0.25)
