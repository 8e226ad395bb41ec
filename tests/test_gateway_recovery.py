"""Nothing is lost while something can serve: a killed executor or kvmanager that comes
back within ``--unavailable-timeout`` costs the requests in flight nothing (tiny model,
fp32, real processes). Their sequences are recomputed from the tokens the gateway
holds, so the output equals the same request computed fresh (a distinct
``cache_salt``), token for token and logprob for logprob. Past the timeout they fail
with 503 and the reason.
"""
from __future__ import annotations

import signal

import httpx
import pytest

from conftest import CompletionStream, wait_for

pytestmark = pytest.mark.timeout(300)

FP32 = ("--dtype", "float32")
PROMPT = list(range(1000, 1040))
MAX_TOKENS = 400
LOGPROB_TOLERANCE = 1e-3


def body(**extra) -> dict:
    return {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "logprobs": 0, **extra}


def Stream(url: str) -> CompletionStream:
    return CompletionStream(url, body())


@pytest.fixture
def stack(service_stack, tiny_model_dir):
    return service_stack(tiny_model_dir, "--unavailable-timeout", "60", executor_args=FP32)


def kill9(service) -> None:
    service.proc.kill()
    service.proc.wait()


def fresh(url: str) -> tuple[str, list[float]]:
    reply = httpx.post(url + "/v1/completions", json=body(cache_salt="fresh"), timeout=120).json()
    choice = reply["choices"][0]
    return choice["text"], choice["logprobs"]["token_logprobs"]


def preemptions(url: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:num_preemptions_total"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("vllm:num_preemptions_total not in /metrics")


def assert_identical(stream: Stream, reference: tuple[str, list[float]], what: str) -> None:
    assert stream.error is None, f"{what}: the stream failed: {stream.error}"
    assert stream.finish_reason == "length" and len(stream.logprobs) == MAX_TOKENS, what
    assert stream.text == reference[0], what
    worst = max(abs(a - b) for a, b in zip(stream.logprobs, reference[1]))
    assert worst < LOGPROB_TOLERANCE, f"{what}: logprobs differ from a fresh run by {worst:.2g}"


@pytest.mark.parametrize("victim", ["executor", "kvmanager"])
def test_a_killed_dependency_that_comes_back_costs_the_streams_nothing(stack, start_service, victim):
    url = stack.url
    stream = Stream(url)
    stream.start()
    assert stream.started.wait(60) and stream.error is None
    service = getattr(stack, victim)
    kill9(service)
    args = ("--model", str(stack.model_dir), *FP32) if victim == "executor" else ()
    start_service(victim, *args, port=service.port, timeout=300)
    stream.join(120)
    assert not stream.is_alive()
    assert_identical(stream, fresh(url), f"{victim} killed mid-stream")
    assert preemptions(url) >= 1  # the stream's sequence really was recomputed


def test_in_flight_requests_fail_with_503_only_after_the_timeout(service_stack, tiny_model_dir):
    stack = service_stack(tiny_model_dir, "--unavailable-timeout", "2", executor_args=FP32)
    executor, url = stack.executor, stack.url
    stream = Stream(url)
    stream.start()
    assert stream.started.wait(60)
    kill9(executor)
    stream.join(60)
    assert not stream.is_alive()
    assert stream.error is not None and stream.error["code"] == 503, stream.error
    assert "nothing could serve for" in stream.error["message"] and "executor" in stream.error["message"]
    assert wait_for(lambda: httpx.get(url + "/health").status_code == 503, 10)


def test_a_stopped_executor_past_the_step_timeout_is_recomputed_when_it_resumes(service_stack, tiny_model_dir):
    """SIGSTOP outlasting --step-timeout: the Execute gives up, the gateway waits for the executor
    (within --unavailable-timeout) and recomputes after SIGCONT; the stream never errs."""
    stack = service_stack(tiny_model_dir, "--step-timeout", "1.5", "--unavailable-timeout", "60", executor_args=FP32)
    executor, url = stack.executor, stack.url
    stream = Stream(url)
    stream.start()
    assert stream.started.wait(60) and stream.error is None
    executor.proc.send_signal(signal.SIGSTOP)
    try:
        assert wait_for(lambda: preemptions(url) >= 1, timeout=30), "the stuck Execute was never given up"
    finally:
        executor.proc.send_signal(signal.SIGCONT)
    stream.join(120)
    assert not stream.is_alive()
    assert_identical(stream, fresh(url), "executor stopped mid-stream")
