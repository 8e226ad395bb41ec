"""Dependencies going away and coming back, and a graceful SIGTERM (tiny model, real processes)."""
from __future__ import annotations

import json
import signal
import threading
import time

import grpc
import httpx
import pytest

from conftest import wait_for
from kvserve.v1 import kvmanager_pb2, kvmanager_pb2_grpc

pytestmark = pytest.mark.timeout(300)


def used_blocks(kvmanager_address: str, executor_address: str) -> int:
    with grpc.insecure_channel(kvmanager_address) as channel:
        stub = kvmanager_pb2_grpc.KVManagerStub(channel)
        request = kvmanager_pb2.GetStatsRequest(pool_id=f"executor@{executor_address}")
        return stub.GetStats(request, timeout=2).num_used_blocks


def generate(url: str) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 4}, timeout=60)


def serves_again(url: str) -> bool:
    return generate(url).status_code == 200


def test_dependency_down_is_503_then_recovers_then_sigterm_is_graceful(start_service, service_stack, tiny_model_dir):
    stack = service_stack(tiny_model_dir, "--unavailable-timeout", "6")
    kvmanager, executor, gateway, url = stack.kvmanager, stack.executor, stack.gateway, stack.url
    assert generate(url).status_code == 200

    kvmanager.stop()
    asked = time.monotonic()
    down = generate(url)  # waits for a dependency to come back, as requests in flight do, then 503
    assert time.monotonic() - asked >= 5
    assert down.status_code == 503 and "kvmanager" in down.json()["error"]["message"]
    assert down.headers["retry-after"] == "1"
    # A request that arrives while kvmanager is down waits for it (within --unavailable-timeout).
    waiting: list[httpx.Response] = []
    arrived = threading.Thread(target=lambda: waiting.append(generate(url)), daemon=True)
    arrived.start()
    health = httpx.get(url + "/health")
    assert health.status_code == 503 and health.json()["kvmanager"] == "UNREACHABLE"
    kvmanager = start_service("kvmanager", port=kvmanager.port)
    arrived.join(60)
    assert waiting and waiting[0].status_code == 200, waiting and waiting[0].text
    assert wait_for(lambda: serves_again(url), timeout=20)
    assert httpx.get(url + "/health").status_code == 200

    cached_prompt = {"prompt": "A prompt long enough to fill a few KV blocks. " * 6, "max_tokens": 8,
                     "temperature": 0, "ignore_eos": True}
    before = httpx.post(url + "/v1/completions", json=cached_prompt, timeout=60).json()
    executor.stop()
    down = generate(url)
    assert down.status_code == 503 and "executor" in down.json()["error"]["message"]
    assert httpx.get(url + "/health").json()["executor"] == "UNREACHABLE"
    executor = start_service("executor", "--model", str(tiny_model_dir), port=executor.port, timeout=300)
    assert wait_for(lambda: serves_again(url), timeout=20)
    # the new executor's cache is empty: kvmanager's prefix cache was reset, answers are unchanged
    after = httpx.post(url + "/v1/completions", json=cached_prompt, timeout=60).json()
    assert after["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert after["choices"][0]["text"] == before["choices"][0]["text"]

    assert gateway.alive()
    assert wait_for(lambda: used_blocks(kvmanager.address, executor.address) == 0, 10)
    sigterm_aborts_in_flight_frees_blocks_and_exits_zero(gateway, kvmanager, executor, url)


def sigterm_aborts_in_flight_frees_blocks_and_exits_zero(gateway, kvmanager, executor, base_url: str):
    url = base_url + "/v1/completions"
    body = {"prompt": "Talk", "max_tokens": 1800, "stream": True, "ignore_eos": True}
    chunks: list[dict] = []
    started = threading.Event()

    def stream():
        with httpx.stream("POST", url, json=body, timeout=60) as reply:
            for line in reply.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:]))
                    started.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert started.wait(30)
    assert used_blocks(kvmanager.address, executor.address) > 0
    assert gateway.stop(signal.SIGTERM) == 0
    reader.join(30)
    assert chunks[-1]["choices"][0]["finish_reason"] == "abort"
    assert used_blocks(kvmanager.address, executor.address) == 0
