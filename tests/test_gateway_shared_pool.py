"""Two gateways, one kvmanager, one executor, one pool (tiny model, fp32, real processes).

Sessions keep their sequences apart; prefix hits are shared across gateways, but only
on KV an Execute has written (a hit is reported to the client as ``cached_tokens``).
Every output equals the same request computed fresh (a distinct ``cache_salt``).
"""
from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from conftest import free_port

pytestmark = pytest.mark.timeout(240)

LOGPROB_TOLERANCE = 1e-3


def complete(url: str, prompt: list[int], **extra) -> tuple[str, list[float], int]:
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "logprobs": 0, **extra}
    reply = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    reply = reply.json()
    choice = reply["choices"][0]
    return choice["text"], choice["logprobs"]["token_logprobs"], reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def assert_same(got, fresh, what: str) -> None:
    assert got[0] == fresh[0], what
    worst = max(abs(a - b) for a, b in zip(got[1], fresh[1]))
    assert worst < LOGPROB_TOLERANCE, f"{what}: logprobs differ from a fresh run by {worst:.2g}"


def test_two_gateways_share_one_pool_and_its_written_prefixes(start_service, tiny_model_dir):
    kvmanager = start_service("kvmanager")
    executor = start_service("executor", "--model", str(tiny_model_dir), "--dtype", "float32",
                             "--num-blocks", "256", timeout=300)
    urls = []
    for _ in range(2):
        http_port = free_port()
        start_service("gateway", "--http-port", str(http_port), "--kvmanager-address", kvmanager.address,
                      "--executor-address", executor.address, "--model", str(tiny_model_dir), "--pool-id", "shared")
        urls.append(f"http://127.0.0.1:{http_port}")
    a, b = urls
    rng = random.Random(7)
    prompt = [rng.randrange(300, 20000) for _ in range(40)]

    first = complete(a, prompt)
    assert first[2] == 0
    second = complete(b, prompt)  # the other gateway's written blocks: 2 full blocks of 16
    assert second[2] == 32
    fresh = complete(b, prompt, cache_salt="fresh")
    assert fresh[2] == 0
    assert_same(first, fresh, "gateway A")
    assert_same(second, fresh, "gateway B on A's blocks")

    # Both gateways at once, on prompts sharing a system prompt: each output is its own.
    system = [rng.randrange(300, 20000) for _ in range(32)]
    prompts = [system + [rng.randrange(300, 20000) for _ in range(8 + i)] for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda i: complete(urls[i % 2], prompts[i]), range(8)))
    for i, got in enumerate(together):
        assert_same(got, complete(urls[i % 2], prompts[i], cache_salt=f"fresh-{i}"), f"concurrent request {i}")
