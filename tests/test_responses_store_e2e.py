"""Stored responses in Redis across real processes: two gateways on one kvmanager, executor and
Redis (the replicas of a deployment) go on from each other's responses, and a gateway started
after one stopped finds them."""
from __future__ import annotations

import httpx
import pytest

from loopback_ports import free_port
from tests.redis_support import redis_server, redis_url  # noqa: F401 — fixtures

pytestmark = pytest.mark.timeout(300)


def test_gateways_on_one_redis_share_stored_responses_and_outlive_a_gateway(service_stack, start_service,
                                                                           tiny_model_dir, redis_server, redis_url):
    store_args = ("--responses-store", redis_url, "--tenants", "alice")
    stack = service_stack(tiny_model_dir, *store_args, executor_args=("--dtype", "float32"))

    def another_gateway() -> str:
        port = free_port()
        start_service("gateway", "--http-port", str(port), "--kvmanager-address", stack.kvmanager.address,
                      "--executor-address", stack.executor.address, "--model", str(tiny_model_dir), *store_args)
        return f"http://127.0.0.1:{port}/v1/responses"

    first_url, other_url = stack.url + "/v1/responses", another_gateway()
    alice = {"X-Kvserve-Tenant": "alice"}

    def create(url: str, **body) -> dict:
        reply = httpx.post(url, json={"max_output_tokens": 4, "temperature": 0, **body}, headers=alice, timeout=120)
        assert reply.status_code == 200, reply.text
        return reply.json()

    first = create(first_url, input="My name is Ada.")
    assert first["store"] is True
    second = create(other_url, input="What is my name?", previous_response_id=first["id"])
    def text(response: dict) -> str:
        return response["output"][0]["content"][0]["text"]

    whole = create(first_url, store=False, input=[{"role": "user", "content": "My name is Ada."},
                                                  {"role": "assistant", "content": text(first)},
                                                  {"role": "user", "content": "What is my name?"}])
    assert text(second) == text(whole)
    assert second["usage"]["input_tokens"] == whole["usage"]["input_tokens"]
    assert httpx.get(f"{other_url}/{first['id']}", headers=alice).json()["output"] == first["output"]
    assert httpx.get(f"{other_url}/{first['id']}").status_code == 404  # the default tenant's: none

    assert stack.gateway.stop() == 0
    restarted_url = another_gateway()
    assert httpx.get(f"{restarted_url}/{second['id']}", headers=alice).json()["id"] == second["id"]
    assert httpx.delete(f"{restarted_url}/{second['id']}", headers=alice).json()["deleted"] is True
    assert httpx.get(f"{other_url}/{second['id']}", headers=alice).status_code == 404

    # Redis gone: a response is still answered, saying it was not stored; reading the store is a 503.
    redis_server.stop()
    try:
        unkept = create(restarted_url, input="Hello?")
        assert unkept["store"] is False and unkept["output"]
        going_on = httpx.post(restarted_url, json={"input": "Again", "previous_response_id": first["id"]},
                              headers=alice, timeout=30)
        assert going_on.status_code == 503 and "responses store" in going_on.json()["error"]["message"]
    finally:
        redis_server.start()
    assert create(restarted_url, input="Back?")["store"] is True
