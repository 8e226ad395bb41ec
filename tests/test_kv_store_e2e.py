"""The store tier across real processes (kvmanager, executor, gateway and the store: a directory,
or a real ``redis-server``), tiny fp32 model: KV moves instead of being recomputed.

* an executor killed and restarted (its pool gone) serves a repeated prompt from the store;
* kvmanager and executor both restarted (every index gone) still do: kvmanager rebuilds its
  index from the store itself;
* entries corrupted or wiped behind everyone's back cost a miss and a recompute, never a wrong
  token: every answer equals the first one, token for token and logprob for logprob;
* a request that needs the blocks kvmanager holds for saves in transit waits for them.
"""
from __future__ import annotations

import concurrent.futures

import grpc
import httpx
import pytest

from conftest import free_port, wait_for
from kvserve.v1 import kvmanager_pb2, kvmanager_pb2_grpc
from tests.redis_support import redis_server, redis_url  # noqa: F401 — fixtures

pytestmark = pytest.mark.timeout(600)

FP32 = ("--dtype", "float32")
PROMPT = list(range(2000, 2100))  # 100 tokens: 6 full blocks findable (a hit leaves the last token)
LOGPROB_TOLERANCE = 1e-4


def ask(url: str) -> tuple[str, list[float], int]:
    reply = httpx.post(url + "/v1/completions", json={
        "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "logprobs": 0}, timeout=120)
    assert reply.status_code == 200, reply.text
    body = reply.json()
    choice = body["choices"][0]
    return choice["text"], choice["logprobs"]["token_logprobs"], body["usage"]["prompt_tokens_details"]["cached_tokens"]


def store_stats(kvmanager_address: str, executor_address: str) -> kvmanager_pb2.PoolStats:
    """The executor's pool's stats; all zero until the gateway has registered the pool."""
    with grpc.insecure_channel(kvmanager_address) as channel:
        stub = kvmanager_pb2_grpc.KVManagerStub(channel)
        try:
            return stub.GetStats(kvmanager_pb2.GetStatsRequest(pool_id=f"executor@{executor_address}"), timeout=5)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND:
                raise
            return kvmanager_pb2.PoolStats()


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def restart(start_service, service, *args):
    service.proc.kill()
    service.proc.wait()
    return start_service(service.module, *args, port=service.port, timeout=300)


def store_stack(service_stack, model_dir, store_url: str):
    """kvmanager, an executor with ``--kv-store store_url`` and a gateway (conftest's
    ``service_stack``); (kvmanager, executor, the executor's flags, the gateway's HTTP URL)."""
    stack = service_stack(model_dir, "--unavailable-timeout", "120", executor_args=(*FP32, "--kv-store", store_url))
    return stack.kvmanager, stack.executor, ("--model", str(model_dir), *FP32, "--kv-store", store_url), stack.url


@pytest.fixture(params=["directory", "redis"])
def store_url(request, tmp_path):
    if request.param == "directory":
        return str(tmp_path / "kv-store")
    return request.getfixturevalue("redis_url")


def test_kv_survives_restarts_of_the_executor_and_kvmanager_and_corruption_costs_only_a_miss(
        start_service, service_stack, tiny_model_dir, store_url, tmp_path):
    kvmanager, executor, executor_args, url = store_stack(service_stack, tiny_model_dir, store_url)

    text, logprobs, cached = ask(url)
    assert cached == 0
    # The prompt's 6 full blocks (and the output's) are saved once their KV is written, and
    # findable once the executor reported the saves (the gateway does when idle).
    assert wait_for(lambda: store_stats(kvmanager.address, executor.address).num_store_saves >= 6, 30)

    def same_answer(what: str, expect_cached: int | None = 96) -> None:
        got_text, got_logprobs, got_cached = ask(url)
        assert got_text == text, what
        assert max(abs(a - b) for a, b in zip(got_logprobs, logprobs)) < LOGPROB_TOLERANCE, what
        if expect_cached is not None:
            assert got_cached == expect_cached, f"{what}: {got_cached} tokens cached"

    executor = restart(start_service, executor, *executor_args)
    assert wait_for(lambda: httpx.get(url + "/health").status_code == 200, 60)
    same_answer("the executor restarted: its pool is empty, the store is not")
    stats = store_stats(kvmanager.address, executor.address)
    assert stats.store_hits >= 96 and stats.num_store_blocks >= 6

    kvmanager = restart(start_service, kvmanager)
    executor = restart(start_service, executor, *executor_args)
    assert wait_for(lambda: httpx.get(url + "/health").status_code == 200, 60)
    assert wait_for(lambda: store_stats(kvmanager.address, executor.address).num_store_blocks >= 6, 30), \
        "a restarted kvmanager rebuilds its store index from the store"
    same_answer("kvmanager and executor restarted: the index is rebuilt from the store")

    # Corrupt every entry behind kvmanager's back; restart the executor so that nothing is in its pool.
    corrupt(store_url)
    executor = restart(start_service, executor, *executor_args)
    assert wait_for(lambda: httpx.get(url + "/health").status_code == 200, 60)
    misses = metric(url, "kvserve:kv_store_load_misses_total")
    same_answer("every entry corrupt: the loads miss, the prompt is recomputed", expect_cached=None)
    assert metric(url, "kvserve:kv_store_load_misses_total") > misses
    assert store_stats(kvmanager.address, executor.address).num_store_load_failures >= 1
    same_answer("after the miss the prompt is saved again and hits", expect_cached=None)


def corrupt(store_url: str) -> None:
    """Flips a byte in the payload of every entry (directory), or truncates every entry (Redis)."""
    if store_url.startswith("redis://"):
        import redis

        client = redis.Redis.from_url(store_url)
        for key in client.scan_iter(match="kvserve:kv:*"):
            if not key.endswith(b":keys"):
                client.setrange(key, 40, b"\xff\x00\xff")
        client.close()
        return
    from pathlib import Path

    files = list(Path(store_url).rglob("*.kvb"))
    assert files, "the store holds no entry to corrupt"
    for path in files:
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))


def test_an_executor_without_a_store_refuses_store_operations(start_service, tiny_model_dir):
    from kvserve.v1 import executor_pb2, executor_pb2_grpc

    executor = start_service("executor", "--model", str(tiny_model_dir), *FP32, timeout=300)
    with grpc.insecure_channel(executor.address) as channel:
        stub = executor_pb2_grpc.ExecutorStub(channel)
        assert stub.Describe(executor_pb2.DescribeRequest(), timeout=5).kv_store == ""
        with pytest.raises(grpc.RpcError) as refused:
            stub.Execute(executor_pb2.ExecuteRequest(store_delete_hashes=[b"x" * 16]), timeout=30)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "--kv-store" in refused.value.details()


def test_a_bad_store_url_is_a_one_line_start_up_error(start_service, tiny_model_dir):
    executor = start_service("executor", "--model", str(tiny_model_dir), *FP32, "--kv-store", "ftp://nowhere",
                             wait=False)
    assert executor.proc.wait(120) != 0
    last_line = executor.logs().strip().splitlines()[-1]
    assert "--kv-store" in last_line and "ftp://nowhere" in last_line, last_line


def test_a_stream_moved_off_a_killed_executor_resumes_by_loading_what_was_saved(start_service, service_stack,
                                                                                 tiny_model_dir, tmp_path):
    """The store tier makes migration move KV: the recomputed sequence loads the blocks its dead
    executor saved and computes only the rest; the stream stays token- and logprob-identical."""
    from test_gateway_recovery import Stream, assert_identical, fresh, kill9

    _, executor, executor_args, url = store_stack(service_stack, tiny_model_dir, str(tmp_path / "kv-store"))
    stream = Stream(url)
    stream.start()
    assert stream.started.wait(60) and stream.error is None
    assert wait_for(lambda: len(stream.logprobs) >= 40, 60)  # a few blocks of output are written and saved
    kill9(executor)
    start_service("executor", *executor_args, port=executor.port, timeout=300)
    stream.join(180)
    assert not stream.is_alive()
    loaded = metric(url, "kvserve:kv_store_hit_tokens_total")
    assert_identical(stream, fresh(url), "executor killed mid-stream, its KV loaded from the store")
    assert loaded >= 32, f"the resumed sequence loaded {loaded} tokens from the store"


def test_a_stopped_store_server_costs_misses_never_a_failed_request(start_service, service_stack, tiny_model_dir,
                                                                     redis_server, redis_url):
    """Redis killed while serving: saves fail (never findable), loads miss (recomputed), every
    answer stays the same; once it is back, saves and loads resume."""
    kvmanager, executor, executor_args, url = store_stack(service_stack, tiny_model_dir, redis_url)
    text, logprobs, _ = ask(url)
    assert wait_for(lambda: store_stats(kvmanager.address, executor.address).num_store_saves >= 6, 30)

    redis_server.kill()
    before = store_stats(kvmanager.address, executor.address)
    # A prompt never seen: its saves fail while the server is down, and the request does not.
    other = httpx.post(url + "/v1/completions", json={"prompt": list(range(3000, 3100)), "max_tokens": 4,
                                                      "temperature": 0}, timeout=120)
    assert other.status_code == 200, other.text
    assert wait_for(lambda: store_stats(kvmanager.address, executor.address).num_store_save_failures
                    > before.num_store_save_failures, 30)
    # The pool forgets the first prompt; kvmanager's store index still has it, so the admission
    # orders loads, which miss: the prompt is recomputed, the answer is the same.
    with grpc.insecure_channel(kvmanager.address) as channel:
        kvmanager_pb2_grpc.KVManagerStub(channel).ResetPrefixCache(
            kvmanager_pb2.ResetPrefixCacheRequest(pool_id=f"executor@{executor.address}"), timeout=5)
    got_text, got_logprobs, _ = ask(url)
    assert got_text == text
    assert max(abs(a - b) for a, b in zip(got_logprobs, logprobs)) < LOGPROB_TOLERANCE
    assert metric(url, "kvserve:kv_store_load_misses_total") >= 1

    redis_server.restart()
    again_text, again_logprobs, _ = ask(url)
    assert again_text == text
    assert max(abs(a - b) for a, b in zip(again_logprobs, logprobs)) < LOGPROB_TOLERANCE


def test_a_full_store_keeps_the_head_every_prompt_shares_across_restarts(start_service, service_stack,
                                                                          tiny_model_dir, tmp_path):
    # Every prompt starts with the same block (as every chat starts with its template's), hit in the
    # device tier after the first; the store holds 12 blocks and takes 20 younger ones. A restart of
    # both kvmanager and the executor must still find the newest prompt whole: the shared head stays.
    from executor.kv_cache import kv_bytes_per_block
    from executor.model import ModelConfig
    import torch

    capacity = 12 * kv_bytes_per_block(ModelConfig.from_dir(tiny_model_dir), 16, torch.float32)
    store = str(tmp_path / "kv-store")
    args = (*FP32, "--kv-store", store, "--kv-store-capacity", str(capacity))
    stack = service_stack(tiny_model_dir, "--unavailable-timeout", "120", executor_args=args)
    kvmanager, executor, url = stack.kvmanager, stack.executor, stack.url
    head = list(range(3000, 3016))

    def ask_prompt(i: int) -> int:
        reply = httpx.post(url + "/v1/completions", timeout=120, json={
            "prompt": head + list(range(4000 + 100 * i, 4032 + 100 * i)) + [5], "max_tokens": 1,
            "temperature": 0, "ignore_eos": True})
        assert reply.status_code == 200, reply.text
        return reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    for i in range(10):
        assert ask_prompt(i) == (16 if i else 0)
    assert wait_for(lambda: store_stats(kvmanager.address, executor.address).num_store_saves >= 21, 30)
    assert store_stats(kvmanager.address, executor.address).num_store_blocks == 12
    kvmanager = restart(start_service, kvmanager)
    executor = restart(start_service, executor, "--model", str(tiny_model_dir), *args)
    assert wait_for(lambda: httpx.get(url + "/health").status_code == 200, 60)
    assert wait_for(lambda: store_stats(kvmanager.address, executor.address).num_store_blocks >= 3, 30)
    assert ask_prompt(9) == 48  # the head and the newest prompt's two blocks, loaded from the store


@pytest.mark.parametrize("save_policy", ["free", "all"])
def test_a_request_that_needs_blocks_held_for_saves_waits_for_them(start_service, tiny_model_dir, tmp_path,
                                                                    save_policy):
    # A pool of 9 blocks (and the null block). The first request ends with 9 and its last block full;
    # the second needs all 9, so it waits. When the first ends, kvmanager frees its blocks in the
    # Allocate that tries the second again, but holds those whose saves it orders then (``free``: all
    # of them; ``all``: the block filled last) until the executor has written them. They come back:
    # the second request must wait for them, not fail as too large for the pool.
    kvmanager = start_service("kvmanager", "--kv-store-save", save_policy)
    executor = start_service("executor", "--model", str(tiny_model_dir), *FP32, "--num-blocks", "10",
                             "--kv-store", str(tmp_path / "kv-store"), timeout=300)
    http_port = free_port()
    start_service("gateway", "--http-port", str(http_port), "--kvmanager-address", kvmanager.address,
                  "--executor-address", executor.address, "--model", str(tiny_model_dir))
    url = f"http://127.0.0.1:{http_port}"

    def complete(prompt: list[int], max_tokens: int) -> httpx.Response:
        return httpx.post(url + "/v1/completions", timeout=120, json={
            "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        for round_ in range(3):
            first = {"prompt": list(range(6000 + 1000 * round_, 6064 + 1000 * round_)), "max_tokens": 65,
                     "temperature": 0, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", url + "/v1/completions", json=first, timeout=120) as stream:
                assert stream.status_code == 200
                chunks = stream.iter_lines()
                next(chunks)  # the first request runs: the second waits behind it
                second = pool.submit(complete, list(range(6500 + 1000 * round_, 6636 + 1000 * round_)), 4)
                assert any(line == "data: [DONE]" for line in chunks)
            assert second.result().status_code == 200, second.result().text
    assert wait_for(lambda: metric(url, "vllm:num_requests_running") == 0
                    and metric(url, "vllm:num_requests_waiting") == 0, 30)
