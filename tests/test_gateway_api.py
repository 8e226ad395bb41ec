"""The gateway's OpenAI-compatible and gRPC APIs against real kvmanager + executor processes (tiny model)."""
from __future__ import annotations

import http.client
import json
import shutil
import socket
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import openai
import pytest

from gateway.detokenizer import ModelTokenizer
from kvserve.v1 import gateway_pb2, gateway_pb2_grpc, kvmanager_pb2, kvmanager_pb2_grpc
from conftest import free_port, wait_for

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def stack(module_stack, tiny_model_dir):
    return module_stack(tiny_model_dir, gateway_args=["--max-num-seqs", "48"])


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.http_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model_name(client):
    return client.models.list().data[0].id


def pool_stats(stack) -> kvmanager_pb2.PoolStats:
    with grpc.insecure_channel(stack.kvmanager.address) as channel:
        stub = kvmanager_pb2_grpc.KVManagerStub(channel)
        return stub.GetStats(kvmanager_pb2.GetStatsRequest(pool_id=f"executor@{stack.executor.address}"))


def assert_idle(stack) -> None:
    assert wait_for(lambda: pool_stats(stack).num_used_blocks == 0, timeout=10), pool_stats(stack)
    assert metric(stack, "vllm:num_requests_running") == 0


def metric(stack, name: str) -> float:
    text = httpx.get(stack.http_url + "/metrics").text
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def test_models_health_and_metric_names(stack, model_name, tiny_model_dir):
    assert model_name == tiny_model_dir.name
    health = httpx.get(stack.http_url + "/health")
    assert health.status_code == 200 and health.json()["kvmanager"] == "SERVING"
    text = httpx.get(stack.http_url + "/metrics").text
    for name in ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_preemptions",
                 "vllm:prompt_tokens", "vllm:generation_tokens", "vllm:time_to_first_token_seconds",
                 "vllm:inter_token_latency_seconds", "vllm:e2e_request_latency_seconds",
                 "kvserve:step_rpc_seconds", "kvserve:kv_stored_tokens", "kvserve:kv_allocated_slots"]:
        assert f"{name}" in text and 'model_name="' in text, name


def test_metrics_named_in_the_query_are_all_that_is_rendered(stack):
    """``/metrics?name[]=...``, as Prometheus' own handlers filter: a scraper polling a few gauges
    (the benchmark's sampler, four times a second) gets those lines, not every histogram."""
    import asyncio

    from bench.server_metrics import SAMPLED_GAUGES, MetricsSampler

    names = ["vllm:num_requests_running", "kvserve:kv_stored_tokens", "vllm:prefix_cache_queries_total"]
    text = httpx.get(stack.http_url + "/metrics", params={"name[]": names}).text
    rendered = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    assert rendered == set(names), text
    assert "_bucket" in httpx.get(stack.http_url + "/metrics").text and "_bucket" not in text
    assert httpx.get(stack.http_url + "/metrics", params={"name[]": "no_such_metric"}).text == ""

    async def sample_a_moment():
        sampler = MetricsSampler(stack.http_url, interval=0.02)
        await sampler.start()
        await asyncio.sleep(0.3)
        return await sampler.stop()

    metrics = asyncio.run(sample_a_moment())
    assert len(metrics.samples) >= 4 and "steps" in metrics.counters  # the first and last scrapes: everything
    for sample in metrics.samples:  # the ones between asked for the gauges only, and got them
        assert None not in (sample.running, sample.waiting, sample.kv_usage, sample.kv_stored, sample.kv_allocated)
    assert set(SAMPLED_GAUGES) >= {"vllm:num_requests_running", "kvserve:kv_allocated_slots"}


def test_a_model_is_retrieved_by_name_as_openai_clients_ask(stack, model_name):
    client = openai.OpenAI(base_url=stack.http_url + "/v1", api_key="unused", max_retries=0)
    entry = client.models.retrieve(model_name)
    assert entry.id == model_name and entry.object == "model"
    listed = httpx.get(stack.http_url + "/v1/models").json()["data"][0]
    assert entry.model_dump()["max_model_len"] == listed["max_model_len"]
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("gpt-4o")
    assert "'gpt-4o' does not exist" in str(missing.value) and missing.value.body["param"] == "model"


def test_an_idle_connection_outlives_a_client_pools_idle_timeout(stack):
    # A server that closes idle connections sooner than the client's pool forgets them races the
    # client's next request on them ("Server disconnected without sending a response"). uvicorn's
    # own default closes after 5 s; the gateway keeps them --http-keep-alive (75 s).
    conn = http.client.HTTPConnection("127.0.0.1", stack.http_port, timeout=10)
    conn.request("GET", "/health")
    assert conn.getresponse().read()
    sock = conn.sock
    time.sleep(6.5)
    sock.setblocking(False)
    with pytest.raises(BlockingIOError):  # b"" would mean the gateway closed it
        sock.recv(1, socket.MSG_PEEK)
    sock.setblocking(True)
    conn.request("GET", "/health")
    assert conn.getresponse().status == 200 and conn.sock is sock
    conn.close()


def test_completion_stream_and_not_agree(client, model_name, stack):
    kwargs = dict(model=model_name, prompt="Once upon a time", max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs)
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 12 and whole.usage.prompt_tokens > 0
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == 12
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_stream_and_not_agree(client, model_name):
    messages = [{"role": "user", "content": "Tell me a story."}]
    whole = client.chat.completions.create(model=model_name, messages=messages, max_tokens=10, temperature=0)
    assert whole.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model=model_name, messages=messages, max_tokens=10,
                                                 temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert whole.usage.prompt_tokens_details.cached_tokens >= 0


def test_32_concurrent_streams_run_together(client, model_name, stack):
    running_seen: list[float] = []
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            running_seen.append(metric(stack, "vllm:num_requests_running"))
            time.sleep(0.05)

    def one(i: int) -> int:
        stream = client.completions.create(model=model_name, prompt=f"Request number {i}:", max_tokens=24,
                                           temperature=0, stream=True, extra_body={"ignore_eos": True})
        return sum(1 for chunk in stream if chunk.choices and chunk.choices[0].text is not None)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with ThreadPoolExecutor(32) as pool:
            counts = list(pool.map(one, range(32)))
    finally:
        stop.set()
        watcher.join()
    assert len(counts) == 32 and all(c >= 1 for c in counts)
    assert max(running_seen) > 1
    assert metric(stack, "kvserve:num_requests_running_peak") >= 8
    assert_idle(stack)


def test_same_prompt_twice_hits_prefix_cache(client, model_name):
    prompt = "The history of the lighthouse keeper " * 12
    first = client.completions.create(model=model_name, prompt=prompt, max_tokens=16, temperature=0)
    second = client.completions.create(model=model_name, prompt=prompt, max_tokens=16, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens_details.cached_tokens
    assert second.choices[0].text == first.choices[0].text


def test_shared_system_prompt_is_hit(client, model_name):
    system = " ".join(f"Rule {i}: always answer politely and precisely." for i in range(45))
    questions = ["What is two plus two?", "Name a color.", "Where is the moon?"]
    usages = []
    for question in questions:
        reply = client.chat.completions.create(
            model=model_name, max_tokens=4, temperature=0,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": question}])
        usages.append(reply.usage)
    assert usages[0].prompt_tokens > 400
    for usage in usages[1:]:
        assert usage.prompt_tokens_details.cached_tokens >= 384


def test_stop_string_is_not_leaked(client, model_name):
    kwargs = dict(model=model_name, prompt="A list of words:", temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(max_tokens=24, **kwargs).choices[0].text
    stop = full[len(full) // 2: len(full) // 2 + 3]
    expected = full[: full.index(stop)]
    cut = client.completions.create(max_tokens=24, stop=[stop], **kwargs)
    assert cut.choices[0].text == expected and cut.choices[0].finish_reason == "stop"
    streamed = list(client.completions.create(max_tokens=24, stop=[stop], stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == expected


def greedy_tokens(stack, text: str, max_tokens: int) -> list[int]:
    with grpc.insecure_channel(stack.grpc_address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        request = gateway_pb2.GenerateRequest(
            text=text, params=gateway_pb2.GenerationParams(max_tokens=max_tokens, ignore_eos=True))
        return [t for message in stub.Generate(request) for t in message.token_ids]


def test_stop_token_ids_and_min_tokens(client, model_name, stack):
    first = greedy_tokens(stack, "Counting:", 1)
    kwargs = dict(model=model_name, prompt="Counting:", temperature=0, max_tokens=8)
    stopped = client.completions.create(extra_body={"stop_token_ids": first}, **kwargs)
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == 1
    assert stopped.choices[0].text == ""  # the stop token's text is left out
    held = client.completions.create(extra_body={"stop_token_ids": first, "min_tokens": 4}, **kwargs)
    assert held.usage.completion_tokens >= 4


def test_logprobs_and_parallel_sampling(client, model_name, stack):
    reply = client.completions.create(model=model_name, prompt="Colors:", max_tokens=6, temperature=0,
                                      logprobs=2, extra_body={"ignore_eos": True})
    lp = reply.choices[0].logprobs
    assert len(lp.token_logprobs) == 6 and all(len(top) >= 1 for top in lp.top_logprobs)
    kwargs = dict(model=model_name, prompt="Colors of the rainbow are", max_tokens=8, temperature=1.0, seed=7,
                  n=3, extra_body={"ignore_eos": True})
    copies_before = pool_stats(stack).num_copies
    first = client.completions.create(**kwargs)
    assert pool_stats(stack).num_copies > copies_before  # choices forked, last prompt block copied on write
    again = client.completions.create(**kwargs)
    texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    assert len(texts) == 3 and len(set(texts)) > 1
    assert texts == [c.text for c in sorted(again.choices, key=lambda c: c.index)]
    assert first.usage.completion_tokens == 24


def test_batched_prompts_number_choices_prompt_major(client, model_name):
    prompts = ["First prompt", "Second prompt here"]
    kwargs = dict(model=model_name, max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    singles = [client.completions.create(prompt=p, **kwargs).choices[0].text for p in prompts]
    batched = client.completions.create(prompt=prompts, n=2, **kwargs)
    texts = {c.index: c.text for c in batched.choices}
    assert texts == {0: singles[0], 1: singles[0], 2: singles[1], 3: singles[1]}
    assert batched.usage.completion_tokens == 20
    chunks = list(client.completions.create(prompt=prompts, stream=True, stream_options={"include_usage": True},
                                            **kwargs))
    streamed: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert streamed == {0: singles[0], 1: singles[1]} and chunks[-1].usage.completion_tokens == 10


def test_chat_logprobs(client, model_name):
    reply = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "Hi"}], max_tokens=5, temperature=0,
        logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = reply.choices[0].logprobs.content
    assert len(content) == 5 and all(len(item.top_logprobs) == 2 for item in content)
    assert all(item.logprob <= 0 for item in content)


def test_logprobs_bytes_of_a_token_that_is_part_of_a_character(client, model_name, tiny_model_dir):
    # The emoji's last token is bytes that are no character on their own: its text is U+FFFD, and
    # only `bytes` tells a client what to join to rebuild the text.
    tokenizer = ModelTokenizer(tiny_model_dir)
    byte_token = tokenizer.encode("🎉")[-1]
    expected = list(tokenizer.token_bytes(byte_token))
    assert expected != list("\ufffd".encode())
    reply = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "Hi"}], max_tokens=1, temperature=0,
        logprobs=True, top_logprobs=1, logit_bias={str(byte_token): 100})
    item = reply.choices[0].logprobs.content[0]
    assert item.bytes == expected and item.top_logprobs[0].bytes == expected


def test_grpc_generate_returns_the_alternatives_it_is_asked_for(stack):
    with grpc.insecure_channel(stack.grpc_address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        request = gateway_pb2.GenerateRequest(text="Counting:", params=gateway_pb2.GenerationParams(
            max_tokens=6, ignore_eos=True, logprobs=3))
        messages = list(stub.Generate(request))
        plain = list(stub.Generate(gateway_pb2.GenerateRequest(text="Counting:", params=gateway_pb2.GenerationParams(
            max_tokens=6, ignore_eos=True))))
    tokens = [t for m in messages for t in m.token_ids]
    assert len(tokens) == 6
    for message in messages:
        assert len(message.top_logprobs) == len(message.token_ids) == len(message.logprobs)
        for token, logprob, top in zip(message.token_ids, message.logprobs, message.top_logprobs):
            assert len(top.token_ids) == len(top.logprobs) == 3
            assert list(top.logprobs) == sorted(top.logprobs, reverse=True)
            assert top.token_ids[0] == token and top.logprobs[0] == pytest.approx(logprob)  # greedy: the top one
    assert all(not m.top_logprobs for m in plain)


def test_grpc_generate_model_info_and_abort(stack):
    with grpc.insecure_channel(stack.grpc_address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        info = stub.GetModelInfo(gateway_pb2.GetModelInfoRequest())
        assert info.max_model_len > 0 and info.block_size > 0 and info.batching == "continuous"
        assert info.enable_prefix_caching and info.kv_allocation == "paged"
        request = gateway_pb2.GenerateRequest(
            request_id="grpc-1", token_ids=gateway_pb2.TokenIds(ids=[1, 2, 3, 4, 5]),
            params=gateway_pb2.GenerationParams(max_tokens=5, ignore_eos=True))
        messages = list(stub.Generate(request))
        assert sum(len(m.token_ids) for m in messages) == 5
        assert messages[-1].finish_reason == gateway_pb2.FINISH_REASON_LENGTH
        assert messages[-1].usage.prompt_tokens == 5 and messages[-1].usage.completion_tokens == 5
        assert not stub.Abort(gateway_pb2.AbortRequest(request_id="nobody")).aborted
        long_request = gateway_pb2.GenerateRequest(
            request_id="grpc-long", text="Go on forever",
            params=gateway_pb2.GenerationParams(max_tokens=1500, ignore_eos=True))
        stream = stub.Generate(long_request)
        next(stream)
        assert stub.Abort(gateway_pb2.AbortRequest(request_id="grpc-long")).aborted
        rest = list(stream)
        assert rest and rest[-1].finish_reason == gateway_pb2.FINISH_REASON_ABORT
        with pytest.raises(grpc.RpcError) as bad:
            list(stub.Generate(gateway_pb2.GenerateRequest(text="x", params=gateway_pb2.GenerationParams(
                temperature=-1))))
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert_idle(stack)


BAD_REQUESTS = [
    ("completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": -3}, "max_tokens"),
    ("completions", {"prompt": "hi", "model": "no-such-model"}, "no-such-model"),
    ("completions", {"prompt": "hi", "n": 500}, "n"),
    ("completions", {"prompt": "hi", "n": 49}, "max_num_seqs"),
    ("completions", {"prompt": "hi", "temperature": -0.5}, "temperature"),
    ("completions", {"prompt": "hi", "top_p": 1.5}, "top_p"),
    ("completions", {"prompt": [1, 2, 99999999]}, "token id"),
    ("completions", {"prompt": [5] * 5000}, "too long"),
    ("completions", {"prompt": "hi", "logprobs": 99}, "logprobs"),
    ("completions", {"max_tokens": 3}, "prompt"),
    ("completions", {"prompt": "hi", "presence_penalty": 2.5}, "presence_penalty"),
    ("completions", {"prompt": "hi", "no_such_field": 1}, "no_such_field"),
    ("completions", {"prompt": "hi", "logit_bias": {"99999999": 1}}, "logit_bias"),
    ("completions", {"prompt": "hi", "guided_regex": "[0-9"}, "regex"),
    ("chat/completions", {"messages": []}, "messages"),
    ("chat/completions", {"messages": "hello"}, "messages"),
]


@pytest.mark.parametrize("path,body,needle", BAD_REQUESTS)
def test_bad_input_is_400_and_gateway_keeps_serving(stack, path, body, needle):
    reply = httpx.post(f"{stack.http_url}/v1/{path}", json=body, timeout=30)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert needle in error["message"] and error["code"] == 400
    ok = httpx.post(f"{stack.http_url}/v1/completions", json={"prompt": "fine", "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200


def test_bad_json_and_prompt_over_max_model_len(stack):
    reply = httpx.post(f"{stack.http_url}/v1/completions", content=b"{not json",
                       headers={"content-type": "application/json"})
    assert reply.status_code == 400 and "JSON" in reply.json()["error"]["message"]
    max_len = httpx.get(stack.http_url + "/v1/models").json()["data"][0]["max_model_len"]
    reply = httpx.post(f"{stack.http_url}/v1/completions", json={"prompt": [5] * 10, "max_tokens": max_len})
    assert reply.status_code == 400 and "max_model_len" in reply.json()["error"]["message"]
    assert httpx.post(f"{stack.http_url}/v1/completions", json={"prompt": "ok", "max_tokens": 2}).status_code == 200
    assert_idle(stack)


def test_client_disconnect_mid_stream_frees_blocks(stack):
    body = {"prompt": "Keep talking", "max_tokens": 1500, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{stack.http_url}/v1/completions", json=body, timeout=30) as reply:
        lines = reply.iter_lines()
        first = next(line for line in lines if line.startswith("data:"))
        assert json.loads(first[5:])["choices"]
    assert_idle(stack)


def test_full_queue_is_429(stack, start_service, tiny_model_dir):
    http_port = free_port()
    gateway = start_service("gateway", "--http-port", str(http_port), "--kvmanager-address", stack.kvmanager.address,
                            "--executor-address", stack.executor.address, "--model", str(tiny_model_dir),
                            "--max-queue-len", "1", "--max-num-seqs", "1")
    url = f"http://127.0.0.1:{http_port}/v1/completions"
    body = {"prompt": "Long", "max_tokens": 1500, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", url, json=body, timeout=30) as running:
        running_lines = running.iter_lines()  # keep a reference: closing it would disconnect
        next(line for line in running_lines if line.startswith("data:"))
        with httpx.stream("POST", url, json=body, timeout=30) as queued:
            assert queued.status_code == 200
            assert wait_for(lambda: _metric_at(http_port, "vllm:num_requests_waiting") == 1, 10)
            full = httpx.post(url, json={"prompt": "x", "max_tokens": 2}, timeout=30)
            assert full.status_code == 429 and "queue full" in full.json()["error"]["message"]
    assert gateway.alive()
    assert_idle(stack)


def _metric_at(http_port: int, name: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{http_port}/metrics").text
    line = next(line for line in text.splitlines() if line.startswith(name + "{"))
    return float(line.rsplit(" ", 1)[1])


NODE_EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "node"


def test_node_grpc_client_streams_a_generation(stack):
    node, npm = shutil.which("node"), shutil.which("npm")
    if not node or not npm:
        pytest.skip("node/npm not installed")
    if not (NODE_EXAMPLE / "node_modules" / "@grpc" / "grpc-js").exists():
        installed = subprocess.run([npm, "install", "--no-audit", "--no-fund"], cwd=NODE_EXAMPLE,
                                   capture_output=True, text=True, timeout=300)
        if installed.returncode != 0:
            pytest.skip(f"npm install failed (offline?): {installed.stderr[-500:]}")
    run = subprocess.run([node, "generate.js", "--address", stack.grpc_address, "--max-tokens", "7",
                          "Hello from Node"], cwd=NODE_EXAMPLE, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    assert summary["num_tokens"] >= 1 and summary["finish_reason"] in ("FINISH_REASON_LENGTH", "FINISH_REASON_STOP")
    assert summary["usage"]["completion_tokens"] == summary["num_tokens"]
    assert summary["text"].strip() in run.stderr


def test_uvicorn_parses_and_frames_http_with_httptools():
    """httptools is a dependency: uvicorn's automatic choice, which the gateway leaves it, is then its C
    parser and writer, not h11's Python (~15 % of the gateway's CPU at 32 streams, docs/gateway.md)."""
    from uvicorn.config import Config
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    async def app(scope, receive, send):
        raise AssertionError("not served")

    config = Config(app, log_level="warning", lifespan="off")
    config.load()
    assert config.http_protocol_class is HttpToolsProtocol
