"""End-to-end reproductions of prefix-cache hits on KV nobody wrote (tiny model, real processes).

Each test drives real kvmanager / executor / gateway processes (fp32, greedy) into
a situation where the prefix cache used to hand out blocks whose KV was never
written (or was lost with a restarted executor), and compares the output with
the same prompt computed fresh: the same request with a distinct ``cache_salt``
(which never shares cached blocks), or a run before anything was cached.

The oracle compares the text *and* each sampled token's logprob. The tiny
random-weight model's greedy token hardly depends on the context (it repeats
the last input token), so wrong KV rarely changes its text; it always shifts
the logprobs (by ~1e-2 or more), while the same prompt computed fresh in fp32,
batched or alone, agrees to ~1e-6.
"""
from __future__ import annotations

import json
import random
import threading
import time
from pathlib import Path

import grpc
import httpx
import pytest

from conftest import free_port, launch, wait_for
from executor_proxy import ExecutorProxy
from kvserve.v1 import kvmanager_pb2, kvmanager_pb2_grpc

pytestmark = pytest.mark.timeout(240)

FP32 = ["--dtype", "float32"]
LOGPROB_TOLERANCE = 1e-3
MARKER = 7777  # the proxy refuses any Execute carrying this token id


# --- helpers ---------------------------------------------------------------------------------------


def random_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(300, 20000) for _ in range(n)]


def post(url: str, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/{route}", json=body, timeout=120)


def complete(url: str, prompt, *, max_tokens: int = 6, **extra) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "logprobs": 0,
            **extra}
    reply = post(url, "completions", body)
    assert reply.status_code == 200, reply.text
    return reply.json()


def chat(url: str, question: str, **extra) -> dict:
    body = {"messages": [{"role": "user", "content": question}], "max_tokens": 8, "temperature": 0,
            "ignore_eos": True, "logprobs": True, **extra}
    reply = post(url, "chat/completions", body)
    assert reply.status_code == 200, reply.text
    return reply.json()


def output(choice: dict) -> tuple[str, list[float]]:
    """(text, logprob of each sampled token) of a completion or chat choice."""
    logprobs = choice["logprobs"]
    if "message" in choice:
        return choice["message"]["content"], [entry["logprob"] for entry in logprobs["content"]]
    return choice["text"], list(logprobs["token_logprobs"])


def assert_same_output(got: tuple[str, list[float]], fresh: tuple[str, list[float]], what: str) -> None:
    assert got[0] == fresh[0], f"{what}: text {got[0]!r} differs from the fresh computation's {fresh[0]!r}"
    assert len(got[1]) == len(fresh[1]), what
    worst = max(abs(a - b) for a, b in zip(got[1], fresh[1]))
    assert worst < LOGPROB_TOLERANCE, (f"{what}: logprobs {got[1]} differ from the fresh computation's "
                                       f"{fresh[1]} by {worst:.2g}: it read KV that is not its prompt's")


def cached_tokens(reply: dict) -> int:
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def serves(url: str) -> bool:
    try:
        return post(url, "completions", {"prompt": "Hello", "max_tokens": 2}).status_code == 200
    except httpx.HTTPError:
        return False


def kill9(service) -> None:
    service.proc.kill()
    service.proc.wait()


class SSEStream(threading.Thread):
    """A streaming /v1/completions in the background: text, logprobs, finish reason, errors."""

    def __init__(self, url: str, body: dict):
        super().__init__(daemon=True)
        self.url, self.body = url, {**body, "stream": True, "stream_options": {"include_usage": True}}
        self.text, self.logprobs, self.errors = "", [], []
        self.finish_reason = None
        self.usage = None
        self.status = None
        self.first_token = threading.Event()

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=self.body, timeout=120) as reply:
                self.status = reply.status_code
                for line in reply.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        self.errors.append(chunk["error"])
                        continue
                    if chunk.get("usage"):
                        self.usage = chunk["usage"]
                    for choice in chunk.get("choices", []):
                        self.text += choice["text"]
                        if choice.get("logprobs"):
                            self.logprobs += choice["logprobs"]["token_logprobs"]
                        self.finish_reason = choice.get("finish_reason") or self.finish_reason
                        if self.logprobs:
                            self.first_token.set()
        except Exception as exc:  # noqa: BLE001 — reported by the test
            self.errors.append(repr(exc))
        finally:
            self.first_token.set()

    def result(self, timeout: float = 120) -> tuple[str, list[float]]:
        self.join(timeout)
        assert not self.is_alive(), "the stream did not end"
        assert self.status == 200 and not self.errors, (self.status, self.errors)
        return self.text, self.logprobs


class Services:
    """The three services as separate processes; any of them can be killed and started again."""

    def __init__(self, model_dir: Path, log_dir: Path, executor_args: list[str], gateway_args: list[str]):
        self.model_dir, self.log_dir = model_dir, log_dir
        self.executor_args = ["--model", str(model_dir), *executor_args]
        self.gateway_args = gateway_args
        self.started = []
        self.http_port = free_port()
        self.gateway = None
        try:
            self.kvmanager = self._launch("kvmanager", [])
            self.start_executor()
        except BaseException:
            self.stop()
            raise

    def _launch(self, module: str, args: list[str], port: int | None = None):
        service = launch(module, args, self.log_dir, port=port)
        self.started.append(service)
        return service

    def start_executor(self, port: int | None = None):
        self.executor = self._launch("executor", self.executor_args, port)
        return self.executor

    def start_gateway(self, executor_address: str | None = None, port: int | None = None):
        args = ["--http-port", str(self.http_port), "--kvmanager-address", self.kvmanager.address,
                "--executor-address", executor_address or self.executor.address, "--model", str(self.model_dir),
                *self.gateway_args]
        self.gateway = self._launch("gateway", args, port)
        return self.gateway

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def stop(self) -> None:
        for service in reversed(self.started):
            service.stop()


def kvmanager_stub(address: str):
    channel = grpc.insecure_channel(address)
    return channel, kvmanager_pb2_grpc.KVManagerStub(channel)


# --- 1. a sequence allocated and preempted in the same step --------------------------------------


def test_sequence_preempted_in_the_step_that_allocated_it_reads_only_its_own_kv(tiny_model_dir, tmp_path):
    """20 blocks (19 usable), 256 tokens a step. Step 1: W (200 tokens, 13 blocks) and Y's first 56
    tokens (4 blocks). Step 2: W decodes, Y's last 44 tokens need 3 more blocks (NO_ROOM), X (32
    tokens) gets the 2 free ones in the same Allocate and is preempted at once as the newest
    sequence (then Y too); only W's decode executes. X's first block was handed out, never
    written, and freed: recomputed in step 3, X must not find it in the prefix cache."""
    services = Services(tiny_model_dir, tmp_path, ["--num-blocks", "20", *FP32],
                        ["--max-num-batched-tokens", "256"])
    try:
        services.start_gateway()
        url = services.url
        rng = random.Random(1234)
        w, y, x = random_ids(rng, 200), random_ids(rng, 100), random_ids(rng, 32)
        batch = complete(url, [w, y, x])
        assert metric(url, "vllm:num_preemptions_total") >= 1, "no preemption: the scenario did not happen"
        in_batch = output(batch["choices"][2])
        alone = complete(url, x)  # may hit X's blocks, written by its recompute in the batch
        salted = complete(url, x, cache_salt="fresh")
        assert cached_tokens(salted) == 0
        assert_same_output(in_batch, output(salted["choices"][0]), "X preempted in the batch")
        assert_same_output(output(alone["choices"][0]), output(salted["choices"][0]), "X alone")
        # Those Allocates and Frees went over kvmanager's allocate socket, not gRPC.
        assert "allocate_socket_open" in services.gateway.log_path.read_text()
    finally:
        services.stop()


# --- 2. the executor restarts while another session holds the cached blocks -----------------------


QUESTION = "What is the capital of France?"


def test_restarted_executor_invalidates_blocks_another_session_holds(tiny_model_dir, tmp_path):
    """A foreign session holds the question's cached prompt blocks when the executor dies (kill -9)
    and comes back empty on the same port: nothing may hit them. Then the realistic form: gateway
    and executor die together while the gateway streams the question (its session holds the
    blocks for its lease); the new gateway must not hit them either."""
    from gateway.detokenizer import ModelTokenizer

    tokenizer = ModelTokenizer(tiny_model_dir)
    prompt_ids = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}]))
    assert len(prompt_ids) > 33
    services = Services(tiny_model_dir, tmp_path, ["--num-blocks", "256", *FP32],
                        ["--session-ttl-ms", "60000"])  # a dead gateway's session outlives the restarts
    channel, stub = kvmanager_stub(services.kvmanager.address)
    try:
        gateway = services.start_gateway()
        url, executor_port, gateway_port = services.url, services.executor.port, gateway.port
        pool_id = f"executor@{services.executor.address}"
        first = chat(url, QUESTION)
        assert cached_tokens(first) == 0
        answer = output(first["choices"][0])
        again = chat(url, QUESTION)
        assert cached_tokens(again) == 32, "the question's prompt blocks should be cached"
        assert_same_output(output(again["choices"][0]), answer, "cached question")

        # a foreign session takes the question's two cached blocks and reports them written
        session = stub.OpenSession(kvmanager_pb2.OpenSessionRequest(pool_id=pool_id, ttl_ms=60000,
                                                                    client_name="foreign")).session_id
        seq_id = 424242
        reply = stub.Allocate(kvmanager_pb2.AllocateRequest(pool_id=pool_id, session_id=session, sequences=[
            kvmanager_pb2.SequenceAllocation(seq_id=seq_id, token_ids=prompt_ids[:33], num_new_tokens=33,
                                             enable_prefix_caching=True)]))
        assert reply.results[0].status == kvmanager_pb2.ALLOCATION_STATUS_OK
        assert reply.results[0].num_cached_tokens == 32
        stub.Allocate(kvmanager_pb2.AllocateRequest(pool_id=pool_id, session_id=session,
                                                    written_seq_ids=[seq_id], written_num_tokens=[33]))
        # the gateway frees its own blocks once idle: then the foreign session alone holds 3 blocks
        assert wait_for(lambda: stub.GetStats(kvmanager_pb2.GetStatsRequest(pool_id=pool_id)).num_used_blocks == 3)

        kill9(services.executor)
        services.start_executor(port=executor_port)
        assert wait_for(lambda: serves(url), timeout=30), "the gateway does not serve after the restart"
        after = chat(url, QUESTION)
        assert cached_tokens(after) == 0, "a hit on a block the dead executor wrote"
        assert_same_output(output(after["choices"][0]), answer, "after the executor restart")
        stub.CloseSession(kvmanager_pb2.CloseSessionRequest(session_id=session))

        # realistic form: kill -9 gateway and executor while the gateway's session holds the blocks
        warm = chat(url, QUESTION)
        assert cached_tokens(warm) == 32
        holder = SSEStream(url, {"prompt": prompt_ids, "max_tokens": 1500, "temperature": 0, "ignore_eos": True,
                                 "logprobs": 0})
        holder.start()
        assert holder.first_token.wait(30)
        assert wait_for(lambda: len(holder.logprobs) >= 3, timeout=30)  # its prompt blocks were reported written
        kill9(services.gateway)
        kill9(services.executor)
        holder.join(30)
        services.start_executor(port=executor_port)
        services.start_gateway(port=gateway_port)
        stats = stub.GetStats(kvmanager_pb2.GetStatsRequest(pool_id=pool_id))
        assert stats.num_sessions == 2 and stats.num_used_blocks > 0, f"the dead gateway's lease is over: {stats}"
        after = chat(url, QUESTION)
        assert cached_tokens(after) == 0, "a hit on a block the dead executor wrote"
        assert_same_output(output(after["choices"][0]), answer, "after gateway + executor restart")
    finally:
        channel.close()
        services.stop()


# --- 3. and 4.: a proxy between gateway and executor ------------------------------------------------


@pytest.fixture(scope="module")
def proxied(tiny_model_dir, tmp_path_factory):
    """kvmanager, executor, a proxy in front of the executor, and a gateway that talks to the proxy."""
    # A fixed step deadline: the proxy holds a step across an executor restart, which the derived
    # deadline would (rightly) take for a hang; here the restart must be seen by its instance_id.
    services = Services(tiny_model_dir, tmp_path_factory.mktemp("kv-correctness-proxied"),
                        ["--num-blocks", "256", *FP32], ["--step-timeout", "120"])
    proxy = ExecutorProxy(services.executor.address, refuse_token_id=MARKER)
    try:
        proxy.start()
        services.start_gateway(executor_address=proxy.address)
        yield services, proxy
    finally:
        services.stop()
        proxy.stop()


def test_refused_step_fails_only_its_request_and_publishes_nothing(proxied):
    """While B streams, A = P + [MARKER] joins B's step; the executor (proxy) refuses the step.
    The engine retries one request at a time: B goes on, A fails with HTTP 500 naming the
    refusal. A's prompt blocks were allocated but never executed: a later P + [123] must not hit
    them (cached_tokens 0) and must equal P + [123] computed with a salt."""
    services, proxy = proxied
    url = services.url
    rng = random.Random(3)
    q, p = random_ids(rng, 20), random_ids(rng, 48)
    b_body = {"prompt": q, "max_tokens": 64, "temperature": 0, "ignore_eos": True, "logprobs": 0}
    proxy.pause(after=1)  # B's prefill runs, its first decode step waits at the proxy
    b = SSEStream(url, b_body)
    b.start()
    assert proxy.held.wait(30), "B's first decode step never reached the proxy"
    a_reply: list = []

    def send_a() -> None:
        try:
            a_reply.append(post(url, "completions", {"prompt": p + [MARKER], "max_tokens": 4, "temperature": 0}))
        except httpx.HTTPError as exc:
            a_reply.append(exc)

    a = threading.Thread(target=send_a, daemon=True)
    a.start()
    time.sleep(1.0)  # A waits in the gateway's inbox while B's step is held: they share the next step
    proxy.resume()
    a.join(60)

    assert a_reply and isinstance(a_reply[0], httpx.Response), a_reply
    reply = a_reply[0]
    assert reply.status_code == 500, reply.text
    message = reply.json()["error"]["message"]
    assert "refused" in message and "INVALID_ARGUMENT" in message and f"token id {MARKER}" in message, message
    assert any(len(batch) >= 2 for batch in proxy.refused_batches), \
        f"A never shared a step with B: {proxy.refused_batches}"
    streamed = b.result()
    assert b.finish_reason == "length" and len(streamed[1]) == 64 and b.usage["completion_tokens"] == 64
    fresh_b = complete(url, q, max_tokens=64, cache_salt="fresh")
    assert_same_output(streamed, output(fresh_b["choices"][0]), "B, whose step was refused and retried")

    reused = complete(url, p + [123])
    assert cached_tokens(reused) == 0, "a hit on P's blocks, which the refused step never wrote"
    fresh = complete(url, p + [123], cache_salt="fresh")
    assert_same_output(output(reused["choices"][0]), output(fresh["choices"][0]), "P + [123]")
    assert proxy.steps["streamed"] > 0 and proxy.steps["unary"] == 0, proxy.steps  # the gateway's usual path


def test_executor_with_execute_only_is_served_through_unary_calls(tiny_model_dir, tmp_path):
    """An executor that answers ExecuteStream UNIMPLEMENTED (the proxy in that mode) gets unary
    Executes, and the outputs are what a fresh computation gives, prefix hits included."""
    services = Services(tiny_model_dir, tmp_path, ["--num-blocks", "64", *FP32], [])
    proxy = ExecutorProxy(services.executor.address, streaming=False)
    try:
        proxy.start()
        services.start_gateway(executor_address=proxy.address)
        prompt = random_ids(random.Random(5), 40)
        first, again = complete(services.url, prompt, max_tokens=8), complete(services.url, prompt, max_tokens=8)
        assert cached_tokens(again) == 32
        fresh = complete(services.url, prompt, max_tokens=8, cache_salt="fresh")
        for reply in (first, again):
            assert_same_output(output(reply["choices"][0]), output(fresh["choices"][0]), "through unary Executes")
        assert proxy.steps["unary"] >= 8 * 3 - 2 and proxy.steps["streamed"] == 0, proxy.steps
    finally:
        services.stop()
        proxy.stop()


def test_executor_restarted_behind_a_proxy_is_recomputed_without_error(proxied):
    """The gateway's connection to the proxy stays open while the executor behind it is killed
    (kill -9) and started again on the same port; only ExecuteResponse.instance_id tells. A step
    held at the proxy across the restart reaches the new, empty executor: the gateway must drop
    its output and recompute, and the stream ends normally with the text computed fresh."""
    services, proxy = proxied
    url = services.url
    prompt = random_ids(random.Random(4), 40)
    body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "logprobs": 0}
    preemptions = metric(url, "vllm:num_preemptions_total")
    proxy.pause(after=4)  # prefill and 3 decode steps run, the 4th decode step waits at the proxy
    stream = SSEStream(url, body)
    stream.start()
    assert proxy.held.wait(30), "the stream's 5th step never reached the proxy"
    assert wait_for(lambda: len(stream.logprobs) == 4, timeout=10), stream.logprobs
    old_instance = proxy.instance_ids[-1]
    port = services.executor.port
    kill9(services.executor)
    services.start_executor(port=port)
    proxy.resume()

    streamed = stream.result()
    assert stream.finish_reason == "length" and len(streamed[1]) == 24
    assert proxy.instance_ids[-1] != old_instance, "the step did not reach the new executor"
    assert "executor restarted" in services.gateway.logs(), "the gateway did not notice the restart"
    assert metric(url, "vllm:num_preemptions_total") > preemptions, "the recompute is not counted"
    fresh = complete(url, prompt, max_tokens=24, cache_salt="fresh")
    assert_same_output(streamed, output(fresh["choices"][0]), "the stream across the executor restart")
