"""The seed-table switches: static batching, reserve allocation, prefix caching off (tiny model)."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest

from conftest import wait_for
from kvserve.v1 import gateway_pb2, gateway_pb2_grpc, kvmanager_pb2, kvmanager_pb2_grpc

pytestmark = pytest.mark.timeout(300)
MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def baseline_stack(module_stack, tiny_model_dir):
    return module_stack(
        tiny_model_dir, executor_args=["--max-model-len", str(MAX_MODEL_LEN)],
        gateway_args=["--batching", "static", "--kv-allocation", "reserve", "--no-enable-prefix-caching",
                      "--max-num-seqs", "3"], exit_0=())


def pool_stats(stack):
    with grpc.insecure_channel(stack.kvmanager.address) as channel:
        stub = kvmanager_pb2_grpc.KVManagerStub(channel)
        return stub.GetStats(kvmanager_pb2.GetStatsRequest(pool_id=f"executor@{stack.executor.address}"))


def complete(stack, prompt: str) -> dict:
    body = {"prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    reply = httpx.post(stack.http_url + "/v1/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_model_info_reports_the_switches(baseline_stack):
    with grpc.insecure_channel(baseline_stack.grpc_address) as channel:
        info = gateway_pb2_grpc.GatewayStub(channel).GetModelInfo(gateway_pb2.GetModelInfoRequest())
    assert (info.batching, info.kv_allocation, info.enable_prefix_caching) == ("static", "reserve", False)
    assert info.max_model_len == MAX_MODEL_LEN
    stats = pool_stats(baseline_stack)
    assert stats.allocation_policy == kvmanager_pb2.ALLOCATION_POLICY_RESERVE and not stats.enable_prefix_caching


def test_static_reserve_no_cache_gives_the_same_answers(baseline_stack):
    prompts = [f"Static batch member {i} says" for i in range(7)]
    alone = [complete(baseline_stack, p) for p in prompts]
    again = complete(baseline_stack, prompts[0])
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # prefix caching is off
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(lambda p: complete(baseline_stack, p), prompts))
    for a, b in zip(alone, together):
        assert a["choices"][0]["text"] == b["choices"][0]["text"]
    assert wait_for(lambda: pool_stats(baseline_stack).num_used_blocks == 0, 10)


def test_reserve_holds_max_model_len_per_request(baseline_stack):
    body = {"prompt": "Reserve", "max_tokens": 200, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", baseline_stack.http_url + "/v1/completions", json=body, timeout=60) as reply:
        lines = reply.iter_lines()
        next(line for line in lines if line.startswith("data: {"))
        stats = pool_stats(baseline_stack)
        assert stats.num_allocated_slots >= MAX_MODEL_LEN
        assert stats.num_stored_tokens < stats.num_allocated_slots
    assert wait_for(lambda: pool_stats(baseline_stack).num_used_blocks == 0, 10)


def test_generation_stops_at_max_model_len(baseline_stack):
    body = {"prompt": [9] * (MAX_MODEL_LEN - 5), "temperature": 0, "ignore_eos": True}
    reply = httpx.post(baseline_stack.http_url + "/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    assert choice["finish_reason"] == "length" and reply.json()["usage"]["completion_tokens"] == 5
