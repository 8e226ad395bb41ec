"""Deadlines a client relies on: the gateway's --request-timeout (HTTP 504, gRPC
DEADLINE_EXCEEDED) and a gRPC client's own deadline end a request, free its blocks, and
cost nobody else anything (real processes, tiny model)."""
from __future__ import annotations

import json

import grpc
import httpx
import pytest

from conftest import wait_for
from kvserve.v1 import gateway_pb2, gateway_pb2_grpc, kvmanager_pb2, kvmanager_pb2_grpc

pytestmark = pytest.mark.timeout(300)

LONG = {"prompt": list(range(1000, 1040)), "max_tokens": 2000, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def stack(module_stack, tiny_model_dir):
    return module_stack(tiny_model_dir, executor_args=["--dtype", "float32"],
                        gateway_args=["--request-timeout", "1.5"], exit_0=())


def used_blocks(stack) -> int:
    with grpc.insecure_channel(stack.kvmanager.address) as channel:
        stub = kvmanager_pb2_grpc.KVManagerStub(channel)
        return stub.GetStats(kvmanager_pb2.GetStatsRequest(pool_id=f"executor@{stack.executor.address}")).num_used_blocks


def test_request_past_the_gateway_timeout_is_504_and_frees_its_blocks(stack):
    reply = httpx.post(stack.http_url + "/v1/completions", json=LONG, timeout=60)
    assert reply.status_code == 504, reply.text
    assert "did not finish within its timeout" in reply.json()["error"]["message"]
    with httpx.stream("POST", stack.http_url + "/v1/completions", json={**LONG, "stream": True}, timeout=60) as sse:
        chunks = [json.loads(line[6:]) for line in sse.iter_lines() if line.startswith("data: {")]
    assert chunks[-1]["error"]["code"] == 504 and len(chunks) > 1, "streamed some tokens, then the timeout"
    short = httpx.post(stack.http_url + "/v1/completions", json={**LONG, "max_tokens": 4}, timeout=60)
    assert short.status_code == 200 and short.json()["usage"]["completion_tokens"] == 4
    assert wait_for(lambda: used_blocks(stack) == 0, 10)


def test_grpc_client_deadline_ends_the_request(stack):
    with grpc.insecure_channel(stack.grpc_address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        request = gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=LONG["prompt"]),
                                              params=gateway_pb2.GenerationParams(max_tokens=2000, ignore_eos=True))
        with pytest.raises(grpc.RpcError) as failure:
            for _ in stub.Generate(request, timeout=0.7):
                pass
        assert failure.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    assert wait_for(lambda: used_blocks(stack) == 0, 10)
    assert wait_for(lambda: running_requests(stack) == 0, 10)


def running_requests(stack) -> float:
    for line in httpx.get(stack.http_url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:num_requests_running{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("vllm:num_requests_running not in /metrics")
