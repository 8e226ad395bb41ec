"""Bad input costs only its sender: hostile HTTP and gRPC requests against a real stack (tiny model).

Every hostile request must be refused at the gateway's edge (HTTP 4xx with an
OpenAI-style error naming the field, gRPC INVALID_ARGUMENT) and never reach a
batched step, where the executor would refuse the whole step and fail every
request in flight with it. One stack serves the whole module.
"""
from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest

from conftest import wait_for
from kvserve.v1 import gateway_pb2, gateway_pb2_grpc, kvmanager_pb2, kvmanager_pb2_grpc

pytestmark = pytest.mark.timeout(180)

VOCAB = 49152  # tiny_model_dir's vocabulary
MAX_NUM_SEQS = 16
# A stream's length: StreamWatcher starts the next as one ends, until the test hangs up.
LONG_STREAM_TOKENS = 2000


@pytest.fixture(scope="module")
def stack(module_stack, tiny_model_dir):
    return module_stack(tiny_model_dir, gateway_args=["--max-num-seqs", str(MAX_NUM_SEQS)])


@pytest.fixture(scope="module")
def http(stack):
    with httpx.Client(base_url=stack.http_url, timeout=60) as client:
        yield client


def raw(text: str) -> bytes:
    """A body written by hand: NaN, Infinity, lone surrogates and friends that json.dumps would not write."""
    return text.encode()


C, CHAT = "completions", "chat/completions"
MSG = [{"role": "user", "content": "hi"}]

# (route, body: dict or raw bytes, needle in the error message)
# Before the gateway checked them, these passed validation and reached a batched step, where the
# executor (or the protobuf encoding of the step) refused the whole step.
REACHED_THE_STEP = [
    (C, raw('{"prompt": "hi", "temperature": 1e39}'), "temperature"),
    (C, raw('{"prompt": "hi", "temperature": NaN}'), "temperature"),
    (C, raw('{"prompt": "hi", "temperature": Infinity}'), "temperature"),
    (C, {"prompt": "hi", "top_k": 2**32}, "top_k"),
    (C, {"prompt": "hi", "stop_token_ids": list(range(VOCAB)), "min_tokens": 1, "max_tokens": 4}, "stop_token_ids"),
    (C, raw('{"prompt": "hi", "cache_salt": "\\ud800"}'), "cache_salt"),
    (CHAT, raw('{"messages": [{"role": "user", "content": "hi"}], "cache_salt": "\\ud800"}'), "cache_salt"),
    (CHAT, {"messages": MSG, "stop_token_ids": list(range(VOCAB)), "min_tokens": 2, "max_tokens": 4},
     "stop_token_ids"),
]
HOSTILE = REACHED_THE_STEP + [
    # OpenAI's prediction: content text or text parts only
    (CHAT, {"messages": MSG, "prediction": {"type": "content", "content": None}}, "prediction.content"),
    (CHAT, {"messages": MSG, "prediction": {"type": "diff", "content": "x"}}, "prediction.type"),
    (CHAT, {"messages": MSG, "prediction": {"type": "content", "content": [{"type": "image_url"}]}},
     "prediction.content"),
    (CHAT, raw('{"messages": [{"role": "user", "content": "hi"}], "prediction": {"type": "content", '
               '"content": "\\ud800"}}'), "prediction.content"),
    # non-finite or out-of-range numbers that would not fit (or would overflow) the wire fields
    (C, raw('{"prompt": "hi", "temperature": -Infinity}'), "temperature"),
    (C, raw('{"prompt": "hi", "temperature": 1e400}'), "temperature"),
    (C, {"prompt": "hi", "temperature": 101}, "temperature"),
    (C, {"prompt": "hi", "temperature": "NaN"}, "temperature"),
    (C, {"prompt": "hi", "temperature": True}, "temperature"),
    (C, raw('{"prompt": "hi", "top_p": NaN}'), "top_p"),
    (C, raw('{"prompt": "hi", "top_p": Infinity}'), "top_p"),
    (C, {"prompt": "hi", "top_p": 0}, "top_p"),
    (C, {"prompt": "hi", "top_p": -0.5}, "top_p"),
    (C, {"prompt": "hi", "top_p": 1e39}, "top_p"),
    (C, {"prompt": "hi", "top_k": 2**31}, "top_k"),
    (C, {"prompt": "hi", "top_k": -2}, "top_k"),
    (C, {"prompt": "hi", "top_k": 1.5}, "top_k"),
    (C, {"prompt": "hi", "top_k": True}, "top_k"),
    (C, {"prompt": "hi", "max_tokens": True}, "max_tokens"),
    (C, {"prompt": "hi", "max_tokens": "ten"}, "max_tokens"),
    (C, {"prompt": "hi", "max_tokens": [4]}, "max_tokens"),
    (C, {"prompt": "hi", "max_tokens": {"a": 1}}, "max_tokens"),
    (C, raw('{"prompt": "hi", "max_tokens": 1e400}'), "max_tokens"),
    (C, {"prompt": "hi", "max_tokens": 10**30}, "max_tokens"),
    (C, {"prompt": "hi", "n": 0}, "n"),
    (C, {"prompt": "hi", "n": 10**30}, "n"),
    (C, {"prompt": "hi", "n": False}, "n"),
    (C, {"prompt": "hi", "seed": -1}, "seed"),
    (C, {"prompt": "hi", "seed": 2**64}, "seed"),
    (C, {"prompt": "hi", "seed": 1.5}, "seed"),
    (C, {"prompt": "hi", "logprobs": 21}, "logprobs"),
    (C, {"prompt": "hi", "logprobs": -1}, "logprobs"),
    (C, {"prompt": "hi", "min_tokens": -1}, "min_tokens"),
    (C, {"prompt": "hi", "min_tokens": 10**9}, "min_tokens"),
    (C, {"prompt": "hi", "min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    # stop / stop_token_ids: a suppressed set covering the vocabulary leaves nothing to sample
    (C, {"prompt": "hi", "stop_token_ids": list(range(VOCAB)), "min_tokens": 1, "ignore_eos": True,
         "max_tokens": 4}, "stop_token_ids"),
    (C, {"prompt": "hi", "stop_token_ids": list(range(300))}, "stop_token_ids"),
    (C, {"prompt": "hi", "stop_token_ids": [-1]}, "stop_token_ids"),
    (C, {"prompt": "hi", "stop_token_ids": [2**40]}, "stop_token_ids"),
    (C, {"prompt": "hi", "stop_token_ids": ["a"]}, "stop_token_ids"),
    (C, {"prompt": "hi", "stop_token_ids": 7}, "stop_token_ids"),
    (C, {"prompt": "hi", "stop": 5}, "stop"),
    (C, {"prompt": "hi", "stop": [1, 2]}, "stop"),
    (C, {"prompt": "hi", "stop": [f"s{i}" for i in range(17)]}, "stop"),
    (C, raw('{"prompt": "hi", "stop": ["ok", "\\ud800"]}'), "stop"),
    # lone surrogates: not Unicode, so neither tokenizable nor a protobuf string
    (C, raw('{"prompt": "hi", "cache_salt": "tenant-\\udfff"}'), "cache_salt"),
    (C, {"prompt": "hi", "cache_salt": 5}, "cache_salt"),
    (C, {"prompt": "hi", "cache_salt": "x" * 257}, "cache_salt"),
    (C, raw('{"prompt": "\\ud800"}'), "prompt"),
    (C, raw('{"prompt": "abc\\udc00def"}'), "prompt"),
    (C, raw('{"prompt": ["fine", "\\ud83d"]}'), "prompt"),
    (C, raw('{"prompt": "hi", "model": "\\ud800"}'), "model"),
    (C, raw('{"prompt": "hi", "user": "\\ud800"}'), "user"),
    # malformed prompts
    (C, {"prompt": None}, "prompt"),
    (C, {"prompt": {"text": "hi"}}, "prompt"),
    (C, {"prompt": 42}, "prompt"),
    (C, {"prompt": [1, True]}, "prompt"),
    (C, {"prompt": [1.5]}, "prompt"),
    (C, {"prompt": [[1], "x"]}, "prompt"),
    (C, {"prompt": [[1, [2]]]}, "prompt"),
    (C, {"prompt": ["a", 1]}, "prompt"),
    (C, {"prompt": [[]]}, "prompt"),
    (C, {"prompt": ""}, "prompt"),
    (C, {"prompt": [-1]}, "token id"),
    (C, {"prompt": [2**40]}, "token id"),
    (C, {"prompt": ["x"] * 65}, "prompt"),
    (C, {"prompt": "hi", "echo": "perhaps"}, "echo"),
    (C, {"prompt": "hi", "echo": True, "logprobs": 21}, "logprobs"),
    (C, {"prompt": "hi", "stream": "maybe"}, "stream"),
    (C, {"prompt": "hi", "stream_options": {"include_usage": [1]}}, "stream_options"),
    (C, {"prompt": "hi", "stream_options": "yes"}, "stream_options"),
    (C, {"prompt": "hi", "frequency_penalty": -2.1}, "frequency_penalty"),
    (C, raw('{"prompt": "hi", "presence_penalty": NaN}'), "presence_penalty"),
    (C, {"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty"),
    (C, {"prompt": "hi", "min_p": 1.5}, "min_p"),
    (C, {"prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias"),
    (C, {"prompt": "hi", "logit_bias": {"five": 1}}, "logit_bias"),
    (C, {"prompt": "hi", "logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    (C, {"prompt": "hi", "logit_bias": [1, 2]}, "logit_bias"),
    # structured outputs: invalid, unsatisfiable, doubled, unknown
    (C, {"prompt": "hi", "guided_json": {"type": "integer", "minimum": 5, "maximum": 1}}, "guided_json"),
    (C, {"prompt": "hi", "guided_json": "{not json"}, "guided_json"),
    (C, {"prompt": "hi", "guided_regex": "(unclosed"}, "regex"),
    (C, {"prompt": "hi", "guided_choice": []}, "guided_choice"),
    (C, {"prompt": "hi", "guided_grammar": "start: undefined_rule"}, "grammar"),
    (C, {"prompt": "hi", "guided_regex": "a", "guided_choice": ["b"]}, "one structured-output"),
    (C, {"prompt": "hi", "response_format": {"type": "xml"}}, "response_format"),
    (C, {"prompt": "hi", "response_format": {"type": "json_schema"}}, "json_schema"),
    (C, {"prompt": "hi", "structured_outputs": {"structural_tag": "x"}}, "structural_tag"),
    (C, {"prompt": "hi", "guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
    (C, {"prompt": "hi", "guided_regex": "x" * 70_000}, "regex"),
    (C, {"prompt": "hi", "unknown_field": 1}, "unknown_field"),
    (C, {"prompt": "hi", "store": True}, "store"),
    # bodies that are not objects, or not JSON, or not UTF-8
    (C, [1, 2, 3], "dictionary"),
    (C, "just a string", "dictionary"),
    (C, raw('{"prompt": "hi",'), "JSON"),
    (C, b'{"prompt": "\xff\xfe"}', "body"),
    (C, raw("[" * 100_000), "body"),
    # chat: content parts, roles, messages
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "text"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]}, "text"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "text"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "image_url"),
    (CHAT, {"messages": [{"role": "user", "content": ["hello"]}]}, "content"),
    (CHAT, {"messages": [{"role": "user", "content": 7}]}, "content"),
    (CHAT, {"messages": [{"role": "user", "content": {"text": "hi"}}]}, "content"),
    (CHAT, raw('{"messages": [{"role": "user", "content": "\\ud800"}]}'), "content"),
    (CHAT, raw('{"messages": [{"role": "user", "content": [{"type": "text", "text": "a\\udbff"}]}]}'), "content"),
    (CHAT, raw('{"messages": [{"role": "\\ud800", "content": "hi"}]}'), "role"),
    (CHAT, {"messages": [{"role": 5, "content": "hi"}]}, "role"),
    (CHAT, {"messages": [{"content": "hi"}]}, "role"),
    (CHAT, {"messages": [None]}, "messages"),
    (CHAT, {"messages": [[]]}, "messages"),
    (CHAT, {"messages": "hello"}, "messages"),
    (CHAT, {"messages": []}, "messages"),
    (CHAT, {"messages": MSG, "max_completion_tokens": True}, "max_completion_tokens"),
    (CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 21}, "logprobs"),
    (CHAT, {"messages": MSG, "top_logprobs": 2}, "top_logprobs: needs logprobs"),
    (CHAT, raw('{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}'), "temperature"),
    (CHAT, {"messages": MSG, "temperature": 1e39}, "temperature"),
    (CHAT, {"messages": MSG, "top_k": 2**32}, "top_k"),
    (CHAT, {"messages": MSG, "top_p": 0}, "top_p"),
    # tools
    (CHAT, {"messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "g"}}}, "no tool named"),
    (CHAT, {"messages": MSG, "tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "name"),
    (CHAT, {"messages": MSG, "tools": [{"type": "retrieval"}]}, "tools[0]"),
    (CHAT, {"messages": MSG, "tool_choice": "required"}, "tool_choice"),
    (CHAT, {"messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "always"},
     "tool_choice"),
    (CHAT, {"messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}, {"type": "function",
            "function": {"name": "f"}}]}, "distinct"),
    (CHAT, {"messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
            "response_format": {"type": "json_object"}}, "tool_choice"),
    (CHAT, {"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "x"}]}]}, "tool_calls"),
    (CHAT, {"messages": [{"role": "user", "content": "hi", "weird": 1}]}, "weird"),
]


def post(client: httpx.Client, route: str, body) -> httpx.Response:
    if isinstance(body, bytes):
        return client.post(f"/v1/{route}", content=body, headers={"content-type": "application/json"})
    return client.post(f"/v1/{route}", json=body)


def assert_refused(reply: httpx.Response, needle: str, status: int = 400) -> dict:
    assert reply.status_code == status, reply.text[:500]
    error = reply.json()["error"]
    assert error["code"] == status and error["type"] == "invalid_request_error", error
    assert needle in error["message"], error
    return error


def _id(case) -> str:
    route, body, needle = case
    text = body.decode("utf-8", "backslashreplace") if isinstance(body, bytes) else json.dumps(body)
    return f"{route.split('/')[0]}:{text[:60]}"


@pytest.mark.parametrize("route,body,needle", HOSTILE, ids=[_id(c) for c in HOSTILE])
def test_hostile_http_body_is_refused_with_a_message(http, route, body, needle):
    assert_refused(post(http, route, body), needle)


def test_a_route_this_server_does_not_offer_is_refused_naming_the_ones_it_does(http):
    """What an OpenAI client's ``embeddings.create`` (or a typo, or GET on a POST route) gets: an
    OpenAI-style error that says what was asked and what is served, not a bare "Not Found"."""
    missing = http.post("/v1/embeddings", json={"model": "m", "input": "hi"})
    assert missing.status_code == 404
    message = missing.json()["error"]["message"]
    assert "POST /v1/embeddings" in message and "POST /v1/chat/completions" in message
    assert "GET /v1/models/{model_id}" in message and "/admin/" not in message
    wrong_method = http.get(f"/v1/{CHAT}")
    assert wrong_method.status_code == 405 and "does not take GET" in wrong_method.json()["error"]["message"]
    assert http.get("/v1/models/no-such-model").json()["error"]["message"] != message  # a route's own 404


@pytest.mark.parametrize("content_type", [None, "application/x-www-form-urlencoded", "text/plain"])
def test_a_json_body_not_sent_as_json_is_refused_saying_so(http, content_type):
    """What ``curl -d '{...}'`` sends without ``-H 'Content-Type: application/json'``."""
    body = json.dumps({"prompt": "hi", "max_tokens": 1}).encode()
    headers = {"content-type": content_type} if content_type else {}
    error = assert_refused(http.post(f"/v1/{C}", content=body, headers=headers), "Content-Type: application/json")
    assert (content_type or "none") in error["message"]
    sent_as_json = http.post(f"/v1/{C}", content=body, headers={"content-type": "application/json; charset=utf-8"})
    assert sent_as_json.status_code == 200, sent_as_json.text


def grpc_request(text: str = "hi", **params) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(text=text, params=gateway_pb2.GenerationParams(**params))


# (request, needle in the status details)
HOSTILE_GRPC = [
    (grpc_request(temperature=float("nan")), "temperature"),
    (grpc_request(temperature=float("inf")), "temperature"),
    (grpc_request(temperature=float("-inf")), "temperature"),
    (grpc_request(temperature=1e39), "temperature"),  # float32: becomes inf on the wire
    (grpc_request(temperature=1000.0), "temperature"),
    (grpc_request(top_p=float("nan")), "top_p"),
    (grpc_request(top_p=1.5), "top_p"),
    (grpc_request(top_k=2**32 - 1), "top_k"),
    (grpc_request(stop_token_ids=list(range(VOCAB)), min_tokens=1, max_tokens=4), "stop_token_ids"),
    (grpc_request(stop_token_ids=[-7]), "stop_token_ids"),
    (grpc_request(min_tokens=9, max_tokens=3), "min_tokens"),
    (grpc_request(n=1000), "n"),
    (grpc_request(logprobs=99), "logprobs"),
    (grpc_request(cache_salt="s" * 10_000), "cache_salt"),
    (grpc_request(text=""), "prompt"),
    (gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=[1, -5])), "token id"),
    (gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=[1, 2**31 - 1])), "token id"),
    (gateway_pb2.GenerateRequest(params=gateway_pb2.GenerationParams(max_tokens=3)), "prompt"),
    (grpc_request(text="word " * 200_000), "too long"),
    (grpc_request(text="x" * (4 * 2**20 + 1)), "text"),
    (grpc_request(prediction="x" * (4 * 2**20 + 1)), "prediction"),
    (gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=[7] * 1_000_000)), "too long"),
    (grpc_request(stop_token_ids=[3] * 300_000), "stop_token_ids"),
    (grpc_request(stop=["s"] * 100_000), "stop"),
]


def grpc_refusal(stub, request) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as refused:
        list(stub.Generate(request, timeout=30))
    return refused.value


def test_hostile_grpc_requests_are_invalid_argument(stack):
    with grpc.insecure_channel(stack.grpc_address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        for request, needle in HOSTILE_GRPC:
            error = grpc_refusal(stub, request)
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (request.params, error)
            assert needle in error.details(), (needle, error.details())
        # proto defaults stay valid: top_p 0 = off, temperature 0 = greedy
        ok = list(stub.Generate(grpc_request(max_tokens=2, ignore_eos=True), timeout=30))
        assert ok[-1].finish_reason == gateway_pb2.FINISH_REASON_LENGTH


def test_grpc_text_that_is_not_utf8_is_refused(stack):
    """A client that hand-encodes a lone surrogate (CESU-8 bytes) never reaches the tokenizer."""
    surrogate = "\ud800".encode("utf-8", "surrogatepass")
    text = b"ok " + surrogate
    payload = b"\x12" + bytes([len(text)]) + text  # field 2 (text), length-delimited
    with grpc.insecure_channel(stack.grpc_address) as channel:
        generate = channel.unary_stream("/kvserve.v1.Gateway/Generate")
        with pytest.raises(grpc.RpcError) as refused:
            list(generate(payload, timeout=30))
        # protobuf cannot parse it (bad UTF-8 in a string field); the server says so as the sender's fault
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "malformed request message" in refused.value.details()
        stub = gateway_pb2_grpc.GatewayStub(channel)
        assert list(stub.Generate(grpc_request(max_tokens=2, ignore_eos=True), timeout=30))


def metric(http: httpx.Client, name: str) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def used_blocks(stack) -> int:
    with grpc.insecure_channel(stack.kvmanager.address) as channel:
        stub = kvmanager_pb2_grpc.KVManagerStub(channel)
        stats = stub.GetStats(kvmanager_pb2.GetStatsRequest(pool_id=f"executor@{stack.executor.address}"))
        return stats.num_used_blocks


def assert_nothing_left(stack, http) -> None:
    assert wait_for(lambda: used_blocks(stack) == 0, timeout=10), used_blocks(stack)
    assert metric(http, "vllm:num_requests_running") == 0
    assert metric(http, "vllm:num_requests_waiting") == 0


class StreamWatcher:
    """Streaming completions read on a thread, noting the longest gap between a stream's chunks.

    One stream is in flight whatever the CPU's speed: each runs to ``max_tokens`` (the tiny model's
    context bounds it) and the next starts at once, until the test ends the last one with
    ``hang_up`` (the client goes away: the gateway frees what it held). Each that ends must end by
    its length, error-free."""

    def __init__(self, url: str, body: dict):
        self.url, self.body = url, body
        self.texts: list[str] = []
        self.streams_completed = 0
        self.error: BaseException | None = None
        self.max_gap = 0.0
        self.first_chunk = threading.Event()
        self._hung_up = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            while not self._hung_up.is_set():
                if self._stream() is not None:
                    self.streams_completed += 1
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc
            self.first_chunk.set()

    def _stream(self) -> str | None:
        """One stream to its end (its finish reason) or until the hang-up (None)."""
        finish_reason = None
        with httpx.stream("POST", self.url, json=self.body, timeout=120) as reply:
            assert reply.status_code == 200, reply.read()
            last = None
            for line in reply.iter_lines():
                if self._hung_up.is_set():
                    return None
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.monotonic()
                if last is not None:
                    self.max_gap = max(self.max_gap, now - last)
                last = now
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                for choice in chunk["choices"]:
                    self.texts.append(choice["text"])
                    finish_reason = choice["finish_reason"] or finish_reason
                self.first_chunk.set()
        assert finish_reason == "length", finish_reason
        return finish_reason

    def hang_up(self, timeout: float = 30) -> None:
        """Ends the stream in flight from the client's side; asserts every stream ran without an error."""
        assert self.thread.is_alive() and self.error is None, repr(self.error)
        self._hung_up.set()
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the stream did not end"
        assert self.error is None, repr(self.error)


def test_hostile_requests_do_not_disturb_a_stream_in_flight(stack, http):
    watcher = StreamWatcher(stack.http_url + "/v1/completions", {
        "prompt": "A long and peaceful story:", "max_tokens": LONG_STREAM_TOKENS, "stream": True, "ignore_eos": True,
        "temperature": 0.8, "seed": 3})
    assert watcher.first_chunk.wait(60)

    def fire_http(case):
        route, body, needle = case
        with httpx.Client(base_url=stack.http_url, timeout=60) as client:
            return post(client, route, body).status_code

    def fire_grpc(case):
        request, _ = case
        with grpc.insecure_channel(stack.grpc_address) as channel:
            try:
                list(gateway_pb2_grpc.GatewayStub(channel).Generate(request, timeout=30))
            except grpc.RpcError as exc:
                return exc.code()
            return grpc.StatusCode.OK

    with ThreadPoolExecutor(8) as pool:
        # first what used to reach the step, all at once, while the stream surely runs
        first = list(pool.map(fire_http, REACHED_THE_STEP))
        assert watcher.error is None, f"the stream was disturbed: {watcher.error!r}"
        assert watcher.thread.is_alive(), "the streams stopped before the hostile requests were answered"
        http_codes = first + list(pool.map(fire_http, HOSTILE[len(REACHED_THE_STEP):]))
        grpc_codes = list(pool.map(fire_grpc, HOSTILE_GRPC))
    assert all(code == 400 for code in http_codes), http_codes
    assert all(code == grpc.StatusCode.INVALID_ARGUMENT for code in grpc_codes), grpc_codes
    watcher.hang_up()
    assert watcher.max_gap < 1.5, watcher.max_gap
    usage = http.post("/v1/completions", json={"prompt": "A long and peaceful story:", "max_tokens": 3})
    assert usage.status_code == 200
    assert http.get("/health").status_code == 200
    assert_nothing_left(stack, http)


def test_big_bodies_are_refused_quickly_and_stall_nothing(stack, http):
    watcher = StreamWatcher(stack.http_url + "/v1/completions", {
        "prompt": "Another story:", "max_tokens": LONG_STREAM_TOKENS, "stream": True, "ignore_eos": True})
    assert watcher.first_chunk.wait(60)
    big = json.dumps({"prompt": "lorem ipsum " * 500_000}).encode()  # 6 MB
    assert len(big) > 4 * 2**20
    started = time.monotonic()
    reply = http.post("/v1/completions", content=big, headers={"content-type": "application/json"})
    assert_refused(reply, "too large", 413)
    assert time.monotonic() - started < 3.0

    def chunks():  # no Content-Length: the size is counted as it arrives
        for i in range(0, len(big), 1 << 16):
            yield big[i:i + (1 << 16)]

    reply = http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert "content-length" not in reply.request.headers
    assert_refused(reply, "too large", 413)
    # Just under the limit: tokenized off the event loop (and refused from a prefix), quickly.
    under = {"prompt": "lorem ipsum dolor " * 200_000}
    assert 3 * 2**20 < len(json.dumps(under)) < 4 * 2**20
    chat = {"messages": [{"role": "user", "content": "lorem ipsum dolor " * 200_000}]}
    many = {"messages": [{"role": "user", "content": f"message {i}"} for i in range(50_000)]}
    started = time.monotonic()

    def send(args):
        with httpx.Client(base_url=stack.http_url, timeout=60) as client:
            return post(client, *args)

    with ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(send, [(C, under), (C, under), (CHAT, chat), (CHAT, many)]))
    for reply in replies:
        assert_refused(reply, "too long")
    assert time.monotonic() - started < 10.0
    # Between steps 30 000-token prompts' tokenization ran on threads: the stream kept flowing.
    medium = {"prompt": "lorem ipsum dolor " * 1_500}  # 27 000 characters: tokenized in full, off the loop
    assert_refused(post(http, C, medium), "too long")
    watcher.hang_up()
    assert watcher.max_gap < 1.5, watcher.max_gap
    assert http.get("/health").status_code == 200
    assert_nothing_left(stack, http)


def test_edge_values_that_are_fine_still_work(http):
    """What the checks must not refuse: boundary values and the formats they normalize."""
    for body in [
        {"prompt": "hi", "max_tokens": 2, "temperature": 1e-30, "ignore_eos": True},  # tiny: greedy
        {"prompt": "hi", "max_tokens": 2, "temperature": 100, "top_p": 1e-30, "top_k": 2**31 - 1},
        {"prompt": "hi", "max_tokens": 2, "top_k": -1, "seed": 2**64 - 1, "stop_token_ids": [5, 5, 7]},
        {"prompt": "hi", "max_tokens": 2, "stop_token_ids": list(range(1, 257)), "min_tokens": 1},
        {"prompt": "hi", "max_tokens": 2, "cache_salt": "tenant-é-ü-😀" * 10, "stop": ["\u2028", "😀"]},
        {"prompt": "héllo wörld 😀", "max_tokens": 2},
        {"prompt": [[1, 2], [3]], "max_tokens": 2},
    ]:
        reply = http.post("/v1/completions", json=body)
        assert reply.status_code == 200, (body, reply.text)
    reply = http.post("/v1/chat/completions", json={"max_tokens": 2, "messages": [
        {"role": "system", "content": None},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "😀"}]}]})
    assert reply.status_code == 200, reply.text
