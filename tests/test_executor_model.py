"""Config parsing, sharded loading, KV sizing: the parts of the model that need no reference run."""
from __future__ import annotations

import json

import pytest
import torch

from executor.kv_cache import DEFAULT_CPU_KV_BYTES, kv_bytes_per_block, max_concurrency, size_kv_cache
from executor.loader import load_model, model_fingerprint
from executor.model import ModelConfig, UnsupportedModel

LLAMA = {"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512}


def test_rope_theta_in_both_spellings_and_llama3_scaling():
    v4 = ModelConfig.from_dict({**LLAMA, "rope_theta": 500000.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}})
    v5 = ModelConfig.from_dict({**LLAMA, "rope_parameters": {
        "rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}})
    assert v4 == v5 and v4.rope_theta == 500000.0 and v4.rope_scaling["rope_type"] == "llama3"
    plain = ModelConfig.from_dict({**LLAMA, "rope_parameters": {"rope_theta": 1e5, "rope_type": "default"}})
    assert plain.rope_theta == 1e5 and plain.rope_scaling == {} and plain.head_dim == 16


def test_family_flags():
    qwen2 = ModelConfig.from_dict({**LLAMA, "architectures": ["Qwen2ForCausalLM"]})
    qwen3 = ModelConfig.from_dict({**LLAMA, "architectures": ["Qwen3ForCausalLM"], "head_dim": 32})
    assert (qwen2.qkv_bias, qwen2.o_bias, qwen2.qk_norm) == (True, False, False)
    assert (qwen3.qkv_bias, qwen3.qk_norm, qwen3.head_dim) == (False, True, 32)


@pytest.mark.parametrize("change,message", [
    ({"architectures": ["GPT2LMHeadModel"]}, "architecture 'GPT2LMHeadModel' is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "rope_type 'yarn'"),
    ({"use_sliding_window": True}, "sliding-window"),
])
def test_unsupported_configs_say_why(change, message):
    with pytest.raises(UnsupportedModel, match=message):
        ModelConfig.from_dict({**LLAMA, **change})


def test_missing_field_names_it(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in LLAMA.items() if k != "hidden_size"}))
    with pytest.raises(UnsupportedModel, match="hidden_size"):
        ModelConfig.from_dir(tmp_path)


def test_sharded_checkpoint_loads_like_a_single_file(tmp_path, tiny_model_dir):
    from transformers import LlamaForCausalLM

    sharded = tmp_path / "sharded"
    LlamaForCausalLM.from_pretrained(tiny_model_dir).save_pretrained(sharded, max_shard_size="2MB")
    assert (sharded / "model.safetensors.index.json").is_file()
    one = load_model(tiny_model_dir, torch.float32, torch.device("cpu"), 64)
    many = load_model(sharded, torch.float32, torch.device("cpu"), 64)
    for (name, a), (_, b) in zip(one.state_dict().items(), many.state_dict().items()):
        assert torch.equal(a, b), name
    assert model_fingerprint(tiny_model_dir) == model_fingerprint(tiny_model_dir)
    assert model_fingerprint(tiny_model_dir) != model_fingerprint(sharded)


def test_kv_sizing():
    config = ModelConfig.from_dict(LLAMA)
    per_block = kv_bytes_per_block(config, 16, torch.bfloat16)
    assert per_block == 2 * 2 * 16 * 2 * 16 * 2
    cpu = torch.device("cpu")
    assert size_kv_cache(config, 16, torch.bfloat16, cpu, num_blocks=10).num_blocks == 10
    assert size_kv_cache(config, 16, torch.bfloat16, cpu, kv_cache_memory=per_block * 7 + 1).num_blocks == 7
    assert size_kv_cache(config, 16, torch.bfloat16, cpu).num_blocks == DEFAULT_CPU_KV_BYTES // per_block
    gpu = size_kv_cache(config, 16, torch.bfloat16, torch.device("cuda"), gpu_memory_utilization=0.5,
                        device_memory=(60 * per_block, 100 * per_block, 5 * per_block))
    assert gpu.num_blocks == 50 - 40 - 5  # half of the device, minus what is in use, minus the activation peak
    with pytest.raises(ValueError, match="too small"):
        size_kv_cache(config, 16, torch.bfloat16, cpu, num_blocks=1)
    assert max_concurrency(257, 16, 4096) == pytest.approx(1.0)


def test_loading_a_model_and_sampling_never_import_torch_dynamo_or_sympy(tiny_model_dir):
    """torch._dynamo's import costs 2-3 s of CPU and sympy's 1 s; torch._refs, which a random init
    (nn.Embedding's normal_) and ``to_empty`` on the meta device run through, pulled them into
    every executor's start."""
    import subprocess
    import sys

    script = f"""
import sys
from executor.runner import ModelRunner, RunnerOptions, SequenceInput
from executor.sampling import SamplingParams
runner = ModelRunner(RunnerOptions({str(tiny_model_dir)!r}, dtype="float32", num_blocks=16))
sampling = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, seed=1, top_logprobs=2,
                          presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1,
                          penalty_token_ids=(5,), penalty_output_counts=(1,))
print(runner.execute([SequenceInput(seq_id=1, token_ids=[1, 5, 7], start_position=0, block_table=[1],
                                    sample=True, sampling=sampling)]).sampled_token_ids)
print("torch._dynamo" in sys.modules or "sympy" in sys.modules)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-1] == "False"


def test_materializing_keeps_shared_parameters_shared_and_casts_only_floats():
    from executor.loader import materialize_empty

    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
        model[1].weight = model[0].weight
        model.register_buffer("steps", torch.zeros(3, dtype=torch.int64))
    materialize_empty(model, torch.bfloat16, torch.device("cpu"))
    assert model[0].weight is model[1].weight and model[0].weight.device.type == "cpu"
    assert model[0].weight.dtype == torch.bfloat16 and not model[0].weight.requires_grad
    assert model.steps.dtype == torch.int64 and model.steps.device.type == "cpu"
    assert len(list(model.parameters())) == 1
