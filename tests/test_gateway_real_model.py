"""The gateway on the real default model (SmolLM2-135M-Instruct): answers make sense, streaming agrees."""
from __future__ import annotations

import openai
import pytest

from conftest import PARIS_QUESTION, start_stack

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


# Each weight format end to end: gateway, kvmanager and an executor with --quantization, the
# second request of a prompt served from the prefix cache (int8 also rounds activations and
# both quantized modes carry an int8 LM head: a cached prompt must still answer as a cold one).
# "kv-int8": bf16 weights over --kv-cache-dtype int8, whose cached prompt is read back dequantized;
# "f32-kv-bf16": float32 compute over a bf16 cache (the default where the CPU has no native bf16).
EXECUTOR_ARGS = {"none": [], "int8": ["--quantization", "int8"], "int4": ["--quantization", "int4"],
                 "kv-int8": ["--kv-cache-dtype", "int8"],
                 "f32-kv-bf16": ["--dtype", "float32", "--kv-cache-dtype", "bfloat16"]}


@pytest.fixture(scope="module", params=list(EXECUTOR_ARGS))
def served(request, default_model_dir, tmp_path_factory):
    stack = start_stack(default_model_dir, tmp_path_factory.mktemp(f"gateway-real-{request.param}"),
                        executor_args=EXECUTOR_ARGS[request.param])
    client = openai.OpenAI(base_url=stack.http_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    yield client, request.param
    assert stack.stop()["gateway"] == 0


def test_chat_answers_and_stream_matches(served):
    client, quantization = served
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": PARIS_QUESTION}]
    whole = client.chat.completions.create(model=model, messages=messages, max_tokens=24, temperature=0)
    answer = whole.choices[0].message.content
    assert "Paris" in answer and whole.choices[0].finish_reason == "stop", (quantization, answer)
    chunks = client.chat.completions.create(model=model, messages=messages, max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    parts, usage = [], None
    for chunk in chunks:
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
        if chunk.usage:
            usage = chunk.usage
    assert "".join(parts) == answer
    assert usage.prompt_tokens_details.cached_tokens > 0  # the same chat prompt again


def test_completion_with_stop_string(served):
    client, _ = served
    model = client.models.list().data[0].id
    reply = client.completions.create(model=model, prompt="1, 2, 3, 4,", max_tokens=20, temperature=0,
                                      stop=[" 7"])
    assert reply.choices[0].finish_reason == "stop"
    assert " 7" not in reply.choices[0].text and "5" in reply.choices[0].text
