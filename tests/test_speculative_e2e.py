"""Prompt-lookup speculative decoding end to end: gateway, kvmanager and executor as processes.

The gateway runs with its default, ``--speculative-decoding prompt-lookup``; the executor in float32 (greedy
verification in a multi-token forward then picks what single-token decoding picks). A copy-heavy
request drafts and must answer the same text as the same request decoded without drafts: one
with ``logprobs`` (which never drafts: the executor refuses drafts with top_logprobs) and one on
a second gateway with speculation off, sharing kvmanager and the executor. Accepted drafts are
seen in ``/metrics`` (vLLM's ``spec_decode`` counters), so the drafts really were used.
"""
from __future__ import annotations

import re
import time

import grpc
import httpx
import pytest

from conftest import service_env, start_stack
from kvserve.v1 import gateway_pb2, gateway_pb2_grpc
from kvserve.launcher import spawn
from loopback_ports import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

COPY_PROMPT = ("Repeat the following text exactly, word for word.\n\nText: The quick brown fox jumps over the lazy "
               "dog. The early bird catches the worm. A stitch in time saves nine. Actions speak louder than words."
               "\n\nRepeated text:")


def counter(metrics: str, name: str) -> float:
    match = re.search(rf'^{re.escape(name)}_total{{[^}}]*}} ([0-9.e+]+)$', metrics, re.M)
    return float(match.group(1)) if match else 0.0


@pytest.fixture(scope="module")
def stacks(default_model_dir, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("speculative-e2e")
    stack = start_stack(default_model_dir, log_dir, executor_args=["--dtype", "float32"],
                        gateway_args=["--num-speculative-tokens", "6"])
    http_port = free_port()
    plain = spawn("gateway", ["--kvmanager-address", stack.kvmanager.address, "--executor-address",
                              stack.executor.address, "--model", str(default_model_dir), "--http-port", str(http_port),
                              "--speculative-decoding", "off"],
                  port=free_port(), log_path=log_dir / "plain-gateway.log", env=service_env())
    # No --pool-id: both gateways use the executor's one pool in kvmanager (executor@<address>).
    yield stack.http_url, f"http://127.0.0.1:{http_port}", stack.grpc_address
    plain.stop()
    assert stack.stop()["gateway"] == 0


def complete(url: str, **extra) -> dict:
    return answer(url, "/v1/completions", {"model": "m", "prompt": COPY_PROMPT, "max_tokens": 48, "temperature": 0,
                                            **extra})


def answer(url: str, route: str, body: dict) -> dict:
    for _ in range(120):
        try:
            reply = httpx.post(url + route, json=body, timeout=300)
        except httpx.TransportError:
            time.sleep(1)  # the second gateway is still starting
            continue
        if reply.status_code == 503:
            time.sleep(1)
            continue
        assert reply.status_code == 200, reply.text
        return reply.json()
    raise AssertionError(f"{url} never answered")


def test_prompt_lookup_answers_exactly_the_plain_greedy_text_with_accepted_drafts(stacks):
    spec_url, plain_url, _ = stacks
    model = httpx.get(spec_url + "/v1/models").json()["data"][0]["id"]
    before = httpx.get(spec_url + "/metrics").text
    drafted = complete(spec_url, model=model)
    after = httpx.get(spec_url + "/metrics").text
    text = drafted["choices"][0]["text"]
    assert "quick brown fox" in text  # the model does copy: drafts have something to be right about
    accepted = counter(after, "vllm:spec_decode_num_accepted_tokens") - \
        counter(before, "vllm:spec_decode_num_accepted_tokens")
    sent = counter(after, "vllm:spec_decode_num_draft_tokens") - counter(before, "vllm:spec_decode_num_draft_tokens")
    assert accepted > 0 and sent >= accepted, (accepted, sent)
    assert drafted["usage"]["completion_tokens"] == 48 or drafted["choices"][0]["finish_reason"] == "stop"
    # Without drafts: the same gateway with logprobs asked (never drafts), and another gateway with speculation off.
    undrafted = complete(spec_url, model=model, logprobs=1)
    assert counter(httpx.get(spec_url + "/metrics").text, "vllm:spec_decode_num_draft_tokens") == \
        counter(after, "vllm:spec_decode_num_draft_tokens")
    plain = complete(plain_url, model=model)
    assert undrafted["choices"][0]["text"] == text
    assert plain["choices"][0]["text"] == text
    assert counter(httpx.get(plain_url + "/metrics").text, "vllm:spec_decode_num_draft_tokens") == 0


def test_a_request_short_of_min_tokens_drafts_and_answers_the_plain_text(stacks):
    """min_tokens suppresses EOS at every position of such a step: the executor says it verifies
    drafts with suppressed tokens (Describe), so these requests draft too, as fixed-length ones do."""
    spec_url, plain_url, _ = stacks
    model = httpx.get(spec_url + "/v1/models").json()["data"][0]["id"]
    before = httpx.get(spec_url + "/metrics").text
    drafted = complete(spec_url, model=model, min_tokens=48)
    after = httpx.get(spec_url + "/metrics").text
    accepted = counter(after, "vllm:spec_decode_num_accepted_tokens") - \
        counter(before, "vllm:spec_decode_num_accepted_tokens")
    assert accepted > 0
    assert drafted["usage"]["completion_tokens"] == 48
    assert complete(plain_url, model=model, min_tokens=48)["choices"][0]["text"] == drafted["choices"][0]["text"]


def chat(url: str, model: str, **extra) -> dict:
    return answer(url, "/v1/chat/completions", {
        "model": model, "messages": [{"role": "user", "content": "Write a short poem about the sea."}],
        "max_tokens": 40, "temperature": 0, **extra})


def test_a_prediction_drafts_the_output_it_expects_and_changes_no_token(stacks):
    """OpenAI's Predicted Outputs: the prediction's tokens are drafts, verified like any other, so the
    answer is the plain greedy one whatever was predicted; a right prediction is mostly accepted."""
    spec_url, plain_url, _ = stacks
    model = httpx.get(spec_url + "/v1/models").json()["data"][0]["id"]
    plain = chat(plain_url, model)
    text = plain["choices"][0]["message"]["content"]
    assert "completion_tokens_details" not in plain["usage"]  # no prediction, nothing to report
    right = chat(spec_url, model, prediction={"type": "content", "content": text})
    assert right["choices"][0]["message"]["content"] == text
    details = right["usage"]["completion_tokens_details"]
    assert details["accepted_prediction_tokens"] >= right["usage"]["completion_tokens"] // 2, details
    wrong = chat(spec_url, model, prediction={"type": "content", "content": [
        {"type": "text", "text": "Roses are red, violets are blue, "}, {"type": "text", "text": "sugar is sweet."}]})
    assert wrong["choices"][0]["message"]["content"] == text
    assert set(wrong["usage"]["completion_tokens_details"]) == {"accepted_prediction_tokens",
                                                                "rejected_prediction_tokens"}
    sampled = chat(spec_url, model, prediction={"type": "content", "content": text}, logprobs=True)
    assert sampled["usage"]["completion_tokens_details"] == {"accepted_prediction_tokens": 0,
                                                             "rejected_prediction_tokens": 0}  # never drafts


def test_a_prediction_over_grpc_drafts_as_over_http(stacks):
    spec_url, plain_url, grpc_address = stacks
    model = httpx.get(spec_url + "/v1/models").json()["data"][0]["id"]
    text = complete(plain_url, model=model)["choices"][0]["text"]
    request = gateway_pb2.GenerateRequest(text=COPY_PROMPT, params=gateway_pb2.GenerationParams(
        max_tokens=48, prediction=text))
    with grpc.insecure_channel(grpc_address) as channel:
        replies = list(gateway_pb2_grpc.GatewayStub(channel).Generate(request, timeout=300))
    assert "".join(reply.text for reply in replies) == text
    usage = replies[-1].usage
    assert usage.accepted_prediction_tokens >= usage.completion_tokens // 2, usage
