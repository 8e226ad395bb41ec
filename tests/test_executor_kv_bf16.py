"""A float32 model over a bf16 KV cache (``--kv-cache-dtype bfloat16``): write_kv rounds K/V as
torch's ``.to(torch.bfloat16)`` does, the decode kernel reads the bf16 tiles with float32 queries and
gives float32 attention over the widened cache bit for bit, and the model's logits are those over a
float32 cache holding the same rounded values, and close to a float32 cache's."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from executor.attention import create_backend
from executor.attention.cpu_backend import CpuAttentionBackend
from executor.devices import resolve_kv_cache_dtype
from executor.kv_cache import kv_bytes_per_block
from executor.model import ModelConfig
from executor.runner import ModelRunner, RunnerOptions
from tests.kv_cache_agreement import copied_blocks_logits, drive
from tests.test_executor_exactness import PROMPTS

BLOCK, HEAD, KV_HEADS, HEADS = 16, 64, 3, 9


def caches(num_blocks: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.zeros(num_blocks, KV_HEADS, HEAD, BLOCK, dtype=dtype),
            torch.zeros(num_blocks, KV_HEADS, BLOCK, HEAD, dtype=dtype))


def test_write_kv_rounds_float32_kv_as_torch_does(cpu_ops):
    g = torch.Generator().manual_seed(0)
    key, value = torch.randn(24, KV_HEADS, HEAD, generator=g) * 30, torch.randn(24, KV_HEADS, HEAD, generator=g)
    key[0, 0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), 3e38])
    value[1, 2, :3] = torch.tensor([1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, -(1.0 + 2 ** -8)])  # ties: to even
    slots = torch.tensor([17, 3, 40, -1, 5, 63] + list(range(48, 66)), dtype=torch.long)
    wide, narrow = caches(5, torch.float32), caches(5, torch.bfloat16)
    cpu_ops.write_kv(key, value, *wide, slots)
    cpu_ops.write_kv(key, value, *narrow, slots)
    for w, n in zip(wide, narrow):
        assert n.dtype == torch.bfloat16
        # the same bf16 values (a NaN stays NaN, its payload aside)
        torch.testing.assert_close(n.float(), w.to(torch.bfloat16).float(), rtol=0, atol=0, equal_nan=True)


def test_decode_attention_reads_the_bf16_cache_with_float32_queries(cpu_ops):
    g = torch.Generator().manual_seed(1)
    key_cache, value_cache = (c.normal_(generator=g).to(torch.bfloat16) for c in caches(17, torch.float32))
    query = torch.randn(4, HEADS, HEAD, generator=g)
    tables = torch.randperm(16, generator=g)[:16].add(1).view(4, 4).to(torch.int32)
    lens = torch.tensor([50, 64, 3, 33], dtype=torch.int32)
    out = cpu_ops.paged_decode_attention(query, key_cache, value_cache, tables, lens, 0.125)
    widened = cpu_ops.paged_decode_attention(query, key_cache.float(), value_cache.float(), tables, lens, 0.125)
    assert out.dtype == torch.float32 and torch.equal(out, widened)
    # and against the definition: softmax(q k^T * scale) v over each sequence's first seq_len keys
    for s, n in enumerate(lens.tolist()):
        blocks = tables[s, :(n + BLOCK - 1) // BLOCK].long()
        k = key_cache[blocks].float().permute(1, 0, 3, 2).reshape(KV_HEADS, -1, HEAD)[:, :n]
        v = value_cache[blocks].float().transpose(0, 1).reshape(KV_HEADS, -1, HEAD)[:, :n]
        q = query[s].view(KV_HEADS, HEADS // KV_HEADS, HEAD)
        expected = torch.softmax(q @ k.transpose(1, 2) * 0.125, -1) @ v
        torch.testing.assert_close(out[s], expected.reshape(HEADS, HEAD), rtol=1e-5, atol=1e-5)


def test_auto_keeps_a_bf16_checkpoints_kv_in_bf16_where_only_the_cpu_widens_it(default_model_dir):
    """``--dtype auto`` computes a bf16 checkpoint in float32 on a CPU without native bf16: its K/V
    stay bf16 there, as on a CPU with it. Asking float32 outright keeps float32 K/V."""
    bf16_checkpoint, f32_checkpoint = (ModelConfig.from_dir(default_model_dir),
                                       dataclasses.replace(ModelConfig.from_dir(default_model_dir),
                                                           checkpoint_dtype="float32"))
    assert bf16_checkpoint.checkpoint_dtype == "bfloat16"
    assert resolve_kv_cache_dtype("auto", "auto", bf16_checkpoint, torch.float32, True) == "bfloat16"
    assert resolve_kv_cache_dtype("auto", "float32", bf16_checkpoint, torch.float32, True) == "auto"
    assert resolve_kv_cache_dtype("auto", "auto", f32_checkpoint, torch.float32, True) == "auto"
    assert resolve_kv_cache_dtype("auto", "auto", bf16_checkpoint, torch.float32, False) == "auto"
    assert resolve_kv_cache_dtype("auto", "auto", bf16_checkpoint, torch.bfloat16, True) == "auto"
    assert resolve_kv_cache_dtype("bfloat16", "bfloat16", bf16_checkpoint, torch.bfloat16, True) == "auto"
    assert resolve_kv_cache_dtype("int8", "auto", bf16_checkpoint, torch.float32, True) == "int8"
    # the benchmark passes the executor the resolved name, so that its rows say what ran
    from bench.sweep import resolve_auto_kv_cache_dtype

    assert resolve_auto_kv_cache_dtype("auto", "auto", "float32", default_model_dir) == "bfloat16"
    assert resolve_auto_kv_cache_dtype("auto", "float32", "float32", default_model_dir) == "auto"
    assert resolve_auto_kv_cache_dtype("int8", "auto", "float32", default_model_dir) == "int8"
    runner = ModelRunner(RunnerOptions(default_model_dir, num_blocks=8))  # every option as `kvserve up` starts it
    assert runner.info.dtype == ("bfloat16" if runner.dtype == torch.bfloat16 else "float32+kv-bfloat16")
    assert runner.kv_caches[0][0].dtype == torch.bfloat16


def test_the_flag_is_refused_where_the_backend_cannot_read_it(default_model_dir, monkeypatch):
    with pytest.raises(ValueError, match="choose from auto, bfloat16, int8"):
        create_backend("auto", torch.device("cpu"), "float8")

    class SameDtypeOnly(type(create_backend("torch", torch.device("cpu")))):
        name = "same-dtype-only"
        reads_other_kv_dtype = False

    monkeypatch.setattr("executor.runner.create_backend", lambda *args: SameDtypeOnly(torch.device("cpu")))
    with pytest.raises(ValueError, match="needs an attention backend that reads a cache of another dtype"):
        ModelRunner(RunnerOptions(default_model_dir, dtype="float32", num_blocks=8, kv_cache_dtype="bfloat16"))


class RoundedWrites(CpuAttentionBackend):
    """The cpu backend over a float32 cache whose every K/V value is rounded to bf16 as it is written:
    the values a bf16 cache holds, widened. Attention over it is the bf16 cache's, bit for bit."""

    def write_kv(self, kv_cache, key, value, slot_mapping):
        super().write_kv(kv_cache, key.to(torch.bfloat16).float(), value.to(torch.bfloat16).float(), slot_mapping)


@pytest.fixture(scope="module")
def runners(default_model_dir, cpu_ops):
    """Float32 models on the cpu backend: over a float32 cache, over a bf16 one, and over a float32
    one written through ``RoundedWrites`` (its decode steps in the Python layers, whose writes go
    through the backend: the compiled decode layer writes K/V itself)."""
    def runner(kv: str, backend=None) -> ModelRunner:
        with pytest.MonkeyPatch.context() as patch:
            if backend is not None:
                patch.setattr("executor.runner.create_backend", lambda *args: backend)
            return ModelRunner(RunnerOptions(default_model_dir, dtype="float32", attention_backend="cpu",
                                             num_blocks=64, kv_cache_dtype=kv))

    rounded = runner("auto", RoundedWrites(torch.device("cpu")))
    rounded.model.fused_decode = None
    return {"f32": runner("auto"), "bf16": runner("bfloat16"), "rounded-f32": rounded}


def test_describe_and_sizing_report_the_bf16_cache(runners, default_model_dir):
    f32, bf16 = runners["f32"], runners["bf16"]
    assert f32.info.dtype == "float32" and bf16.info.dtype == "float32+kv-bfloat16"
    assert all(k.dtype == torch.bfloat16 and v.dtype == torch.bfloat16 for k, v in bf16.kv_caches)
    config = ModelConfig.from_dir(default_model_dir)
    assert bf16.info.kv_bytes_per_block == kv_bytes_per_block(config, 16, torch.bfloat16) == \
        f32.info.kv_bytes_per_block // 2
    # a bf16 model's bf16 cache is its usual one: the same description (and store namespace)
    same = ModelRunner(RunnerOptions(default_model_dir, dtype="bfloat16", attention_backend="torch", num_blocks=8,
                                     kv_cache_dtype="bfloat16"))
    assert same.info.dtype == "bfloat16" and same.kv_cache_dtype == "auto"


def test_the_model_over_the_bf16_cache(runners, default_model_dir):
    """Each prompt prefilled in two chunks (the second attends over the first's cached blocks), then
    greedy decode steps of all prompts at once and of one alone (the compiled decode layer on the
    bf16 cache), every runner fed the float32 cache's greedy tokens. Over the bf16 cache the logits
    are, bit for bit, those over a float32 cache holding the same rounded values; against the float32
    cache's, within 0.25 nats on its 5 likeliest tokens and 0.03 on average, the same greedy pick in
    >= 90 % of rows (measured on the AVX2 EPYC: worst 0.064 nats, mean 0.007, every pick the same)."""
    from tokenizers import Tokenizer

    def same_as_rounded_writes(logits):
        assert torch.equal(logits["bf16"], logits["rounded-f32"])

    tokenizer = Tokenizer.from_file(str(default_model_dir / "tokenizer.json"))
    found = drive(runners, [tokenizer.encode(p).ids for p in PROMPTS], reference="f32", candidate="bf16",
                  each_step=same_as_rounded_writes)
    print("\n" + found.line("bf16 KV vs float32 KV"))
    assert found.worst < 0.25 and found.mean < 0.03 and found.agree / found.total >= 0.9


def test_copy_on_write_and_decode_read_the_copied_bf16_blocks(runners):
    original, copied = copied_blocks_logits(runners["bf16"])
    assert torch.equal(original, copied)
