"""Several executors behind one gateway, real processes, the tiny model in fp32.

What a user of a scaled-out deployment relies on: a killed or stopped executor, or
a restarted kvmanager, costs the streams in flight nothing (they move to an executor
that can serve and are recomputed from the tokens the gateway holds, so their output
equals the same request computed fresh, token for token and logprob for logprob);
no block stays held in any pool afterwards; and KV-aware routing sends requests with
a shared system prompt to the executor that has it (compared with round-robin
on the same executors).
"""
from __future__ import annotations

import random
import re
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest

from conftest import CompletionStream, free_port, wait_for
from kvserve.v1 import kvmanager_pb2, kvmanager_pb2_grpc

pytestmark = pytest.mark.timeout(420)

FP32 = ("--dtype", "float32")
LOGPROB_TOLERANCE = 1e-3
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def Stream(url: str, prompt: list[int], max_tokens: int) -> CompletionStream:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "logprobs": 0}
    return CompletionStream(url, body, timeout=300)


def start_streams(url: str, prompts: list[list[int]], max_tokens: int) -> list[CompletionStream]:
    streams = [Stream(url, prompt, max_tokens) for prompt in prompts]
    for stream in streams:
        stream.start()
    return streams


def fresh(url: str, prompt: list[int], max_tokens: int) -> tuple[str, list[float]]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "logprobs": 0,
            "cache_salt": "fresh"}
    choice = httpx.post(url + "/v1/completions", json=body, timeout=300).json()["choices"][0]
    return choice["text"], choice["logprobs"]["token_logprobs"]


def assert_all_identical_to_fresh(url: str, streams: list[CompletionStream], what: str) -> None:
    for i, stream in enumerate(streams):
        stream.join(300)
        assert not stream.is_alive(), f"{what}: stream {i} hangs"
        assert stream.error is None, f"{what}: stream {i} failed: {stream.error}"
        assert stream.finish_reason == "length" and len(stream.logprobs) == stream.body["max_tokens"], (what, i)
    # The fresh runs go together, batched as the streams were (one by one, 32 of them took ~25 s).
    with ThreadPoolExecutor(len(streams)) as pool:
        fresh_runs = list(pool.map(lambda s: fresh(url, s.body["prompt"], s.body["max_tokens"]), streams))
    for i, (stream, (text, logprobs)) in enumerate(zip(streams, fresh_runs)):
        assert stream.text == text, f"{what}: stream {i} differs from a fresh run"
        worst = max(abs(a - b) for a, b in zip(stream.logprobs, logprobs))
        assert worst < LOGPROB_TOLERANCE, f"{what}: stream {i} logprobs differ by {worst:.2g}"


def metrics(url: str) -> str:
    return httpx.get(url + "/metrics", timeout=10).text


def metric_by_executor(url: str, name: str) -> dict[str, float]:
    values: dict[str, float] = {}
    for line in metrics(url).splitlines():
        if line.startswith(name + "{"):
            executor = re.search(r'executor="([^"]+)"', line).group(1)
            values[executor] = values.get(executor, 0.0) + float(line.rsplit(" ", 1)[1])
    return values


def used_blocks(kvmanager_address: str, pool_id: str) -> int:
    with grpc.insecure_channel(kvmanager_address) as channel:
        stats = kvmanager_pb2_grpc.KVManagerStub(channel).GetStats(kvmanager_pb2.GetStatsRequest(pool_id=pool_id))
    return stats.num_used_blocks


def random_prompts(count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, 30000) for _ in range(length)] for _ in range(count)]


@pytest.fixture
def cluster(start_service, tiny_model_dir):
    """``cluster(num_executors, *gateway_args)``: kvmanager, executors and a gateway over all of them."""

    def start(num_executors: int, *gateway_args: str) -> dict:
        kvmanager = start_service("kvmanager")
        executors = [start_service("executor", "--model", str(tiny_model_dir), "--num-blocks", "512", *FP32,
                                   env=ONE_THREAD, timeout=300) for _ in range(num_executors)]
        http_port = free_port()
        gateway = start_service("gateway", "--http-port", str(http_port), "--kvmanager-address", kvmanager.address,
                                "--executor-address", ",".join(e.address for e in executors),
                                "--model", str(tiny_model_dir), "--unavailable-timeout", "120", *gateway_args)
        url = f"http://127.0.0.1:{http_port}"
        assert wait_for(lambda: len(metric_by_executor(url, "kvserve:executor_up")) == num_executors, 30)
        return {"kvmanager": kvmanager, "executors": executors, "gateway": gateway, "url": url,
                "model": tiny_model_dir}

    return start


def busiest(url: str, executors) -> object:
    running = metric_by_executor(url, "kvserve:executor_num_sequences_running")
    return max(executors, key=lambda e: running.get(e.address, 0))


def test_killed_executor_of_three_costs_32_streams_nothing(cluster):
    stack = cluster(3)
    url = stack["url"]
    # Long enough that the busiest executor still runs streams when it is killed: with 64 tokens, on a
    # busy CI machine, its last ones finished between the metrics read and the kill (nothing migrated).
    streams = start_streams(url, random_prompts(32, 24, seed=1), max_tokens=160)
    assert wait_for(lambda: all(len(s.logprobs) >= 4 or s.error for s in streams), 120), "streams never started"
    running = metric_by_executor(url, "kvserve:executor_num_sequences_running")
    assert sum(1 for v in running.values() if v > 0) >= 2, f"the load was not spread: {running}"
    victim = busiest(url, stack["executors"])
    victim.proc.kill()
    victim.proc.wait()
    assert_all_identical_to_fresh(url, streams, "one of three executors killed mid-generation")
    migrated = metric_by_executor(url, "kvserve:requests_migrated_total")
    assert migrated.get(victim.address, 0) >= 1, migrated
    for executor in stack["executors"]:
        pool = f"executor@{executor.address}"
        assert wait_for(lambda: used_blocks(stack["kvmanager"].address, pool) == 0, 15), f"blocks held in {pool}"


def test_stopped_executor_is_routed_around_and_serves_again_after_sigcont(cluster):
    stack = cluster(2, "--step-timeout", "2")
    url = stack["url"]
    prompts = random_prompts(12, 24, seed=2)
    streams = start_streams(url, prompts, max_tokens=48)
    assert wait_for(lambda: all(len(s.logprobs) >= 4 or s.error for s in streams), 120), "streams never started"
    victim = busiest(url, stack["executors"])
    victim.proc.send_signal(signal.SIGSTOP)
    try:
        for i, stream in enumerate(streams):  # they finish while the victim is still stopped
            stream.join(120)
            assert not stream.is_alive(), f"stream {i} hangs behind a stopped executor"
        assert metric_by_executor(url, "kvserve:executor_up").get(victim.address) == 0
    finally:
        victim.proc.send_signal(signal.SIGCONT)
    assert wait_for(lambda: metric_by_executor(url, "kvserve:executor_up").get(victim.address) == 1, 30), \
        "the executor did not come back after SIGCONT"
    assert_all_identical_to_fresh(url, streams, "an executor stopped past its step deadline")
    routed_before = metric_by_executor(url, "kvserve:routing_decisions_total").get(victim.address, 0)
    assert_all_identical_to_fresh(url, start_streams(url, random_prompts(8, 24, seed=3), 16), "after SIGCONT")
    assert metric_by_executor(url, "kvserve:routing_decisions_total").get(victim.address, 0) > routed_before


def test_kvmanager_killed_under_load_and_restarted_costs_the_streams_nothing(cluster, start_service):
    stack = cluster(2)
    url = stack["url"]
    streams = start_streams(url, random_prompts(16, 24, seed=4), max_tokens=64)
    assert wait_for(lambda: all(len(s.logprobs) >= 4 or s.error for s in streams), 120), "streams never started"
    kvmanager = stack["kvmanager"]
    kvmanager.proc.kill()
    kvmanager.proc.wait()
    start_service("kvmanager", port=kvmanager.port)
    assert_all_identical_to_fresh(url, streams, "kvmanager killed and restarted under load")
    for executor in stack["executors"]:
        pool = f"executor@{executor.address}"
        assert wait_for(lambda: used_blocks(kvmanager.address, pool) == 0, 15), f"blocks held in {pool}"
    # Both backends' Allocates shared one allocate socket before the kill, and the new kvmanager's after it.
    opened = [line for line in stack["gateway"].log_path.read_text().splitlines() if "allocate_socket_open" in line]
    assert len({line.split("path")[1] for line in opened}) == 2, opened


def routed_hit_rate(url: str, system_prompts: list[list[int]], order: list[int], concurrency: int) -> float:
    """Share of the ideal prefix hits (every system prompt computed once) the requests got."""
    rng = random.Random(6)
    cached = 0
    failures: list[str] = []
    lock = threading.Lock()
    jobs = list(order)

    def worker():
        nonlocal cached
        while True:
            with lock:
                if not jobs:
                    return
                which = jobs.pop()
                suffix = [rng.randrange(1000, 30000) for _ in range(8)]
            reply = httpx.post(url + "/v1/completions", timeout=300,
                               json={"prompt": system_prompts[which] + suffix, "max_tokens": 4, "temperature": 0})
            with lock:
                if reply.status_code != 200:
                    failures.append(f"{reply.status_code}: {reply.text}")
                else:
                    cached += reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert not failures, f"{len(failures)} of {len(order)} requests failed, first: {failures[0]}"
    repeats = len(order) // len(system_prompts)
    ideal = len(system_prompts) * (repeats - 1) * len(system_prompts[0])
    return cached / ideal


def test_kv_routing_keeps_shared_system_prompts_where_they_are_cached(cluster, start_service):
    """One request at a time, kv routing computes every system prompt once (the ideal);
    round-robin over the same three executors computes it once on each executor its
    requests land on. Under load kv routing may give hits up for an idle executor
    (a prefix pending behind a busy one costs as much as computing it afresh), so the
    bar there is lower; the gap to round-robin stays."""
    stack = cluster(3, "--routing", "kv", "--pool-id", "shared")
    order = [i for i in range(8) for _ in range(8)]
    random.Random(7).shuffle(order)
    rates = {("kv", 1): routed_hit_rate(stack["url"], random_prompts(8, 256, seed=5), order, concurrency=1),
             ("kv", 4): routed_hit_rate(stack["url"], random_prompts(8, 256, seed=6), order, concurrency=4)}
    stack["gateway"].stop()
    # Round-robin on the same executors and pool (one pool per executor), on system prompts none of them holds.
    http_port = free_port()
    start_service("gateway", "--http-port", str(http_port), "--kvmanager-address", stack["kvmanager"].address,
                  "--executor-address", ",".join(e.address for e in stack["executors"]),
                  "--model", str(stack["model"]), "--routing", "round-robin", "--pool-id", "shared")
    rr_url = f"http://127.0.0.1:{http_port}"
    assert wait_for(lambda: len(metric_by_executor(rr_url, "kvserve:executor_up")) == 3, 30)
    rates["round-robin", 1] = routed_hit_rate(rr_url, random_prompts(8, 256, seed=7), order, concurrency=1)
    rates["round-robin", 4] = routed_hit_rate(rr_url, random_prompts(8, 256, seed=8), order, concurrency=4)
    print("prefix hit rate, share of the ideal:",
          ", ".join(f"{policy} x{concurrency} {rate:.3f}" for (policy, concurrency), rate in rates.items()))
    assert rates["kv", 1] >= 0.99, rates
    assert rates["round-robin", 1] <= 0.9, rates  # the comparison can tell routings apart
    assert rates["kv", 4] >= 0.8, rates
    assert rates["kv", 4] >= rates["round-robin", 4] + 0.05, rates
