"""Sends the workload to a running server and times every request.

Two transports with the same result type: OpenAI-compatible HTTP streaming
(``/v1/completions``, the default, also what the llama.cpp peer speaks) and
kvserve's gRPC ``Gateway.Generate``. The client shares the machine with the server it measures,
and every millisecond of its CPU preempts the server: HTTP goes through aiohttp, which reads a
stream for about a third of httpx's CPU (32 streams, 48 requests on the 2-core Zen 4 box: 0.22-0.27 s
of client CPU a run against 0.57-0.75 s). Load is either a closed loop of
``concurrency`` clients (each sends its next request when the previous one
ends) or an open loop of Poisson arrivals at ``request_rate`` requests/s.
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

import aiohttp
import httpx

from bench.workload import BenchRequest


@dataclass
class RequestResult:
    """What one request measured, times in seconds since the run started."""

    prompt_len: int
    expected_output_len: int
    sent_at: float = 0.0
    ttft: float = 0.0  # first output chunk minus send time
    e2e: float = 0.0  # last byte minus send time
    itl: list[float] = field(default_factory=list)  # gaps between output chunks
    output_tokens: int = 0
    cached_tokens: int = 0
    ok: bool = False
    error: str = ""


class StreamClock:
    """Times one streamed request into its result: send time, first output, gaps, end."""

    def __init__(self, result: RequestResult, t0: float):
        self.result = result
        self.start = self.last = time.perf_counter()
        result.sent_at = self.start - t0
        self.streamed = 0  # output units seen: SSE chunks over HTTP, tokens over gRPC

    def output(self, units: int = 1) -> None:
        now = time.perf_counter()
        if self.streamed == 0:
            self.result.ttft = now - self.start
        else:
            self.result.itl.append(now - self.last)
        self.last = now
        self.streamed += units

    def done(self) -> None:
        self.result.e2e = time.perf_counter() - self.start


async def fetch_model_name(session: aiohttp.ClientSession, base_url: str) -> str:
    """The first model ``/v1/models`` lists (the OpenAI APIs need a name)."""
    async with session.get(f"{base_url}/v1/models") as reply:
        reply.raise_for_status()
        return (await reply.json())["data"][0]["id"]


def completion_body(request: BenchRequest, model: str) -> dict:
    """A greedy, fixed-length streaming completion request."""
    return {
        "model": model,
        "prompt": request.prompt,
        "max_tokens": request.output_len,
        "min_tokens": request.output_len,  # servers without ignore_eos still run to length
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def sse_event(line: str) -> dict | None:
    """One line of a streamed OpenAI-style reply: its JSON chunk, or None (blank lines, comments,
    other fields, ``data: [DONE]``)."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    return json.loads(data) if data.startswith("{") else None


async def sse_chunks(reply: httpx.Response) -> AsyncIterator[dict]:
    """The JSON chunks of a streamed httpx reply, in order."""
    async for line in reply.aiter_lines():
        if (chunk := sse_event(line)) is not None:
            yield chunk


async def aiohttp_sse_chunks(reply: aiohttp.ClientResponse) -> AsyncIterator[dict]:
    """The same from an aiohttp reply (lines as bytes)."""
    async for raw in reply.content:
        if (chunk := sse_event(raw.decode())) is not None:
            yield chunk


def usage_of(chunk: dict) -> tuple[int, int, int] | None:
    """(completion tokens, cached prompt tokens, prompt tokens) from a chunk that carries usage."""
    usage = chunk.get("usage")
    if not usage:
        return None
    details = usage.get("prompt_tokens_details") or {}
    return (int(usage.get("completion_tokens") or 0), int(details.get("cached_tokens") or 0),
            int(usage.get("prompt_tokens") or 0))


# How aiohttp reports a pooled connection the server closed: before the request's body went out
# ("ClientOSError: Can not write request body", llama-server at 32 streams), or after it, before any
# byte of a response.
CLOSED_CONNECTION_ERRORS = ("ServerDisconnectedError", "ClientOSError")


async def send_http(session: aiohttp.ClientSession, base_url: str, model: str, request: BenchRequest,
                    t0: float) -> RequestResult:
    """One streaming ``/v1/completions`` request; SSE chunks with text are output chunks. A pooled
    connection the server closed before answering (llama-server does, now and then) is retried once
    on a new one, as browsers and urllib3 do: the time lost stays in the request's TTFT."""
    first = await _send_http_once(session, base_url, model, request, t0)
    if not (first.error.startswith(CLOSED_CONNECTION_ERRORS) and not first.ttft):
        return first
    # A connection of its own: the pool may hold more that the server is about to close.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True),
                                     timeout=session.timeout) as fresh:
        result = await _send_http_once(fresh, base_url, model, request, t0)
    lost = result.sent_at - first.sent_at
    result.sent_at = first.sent_at
    if result.ttft:
        result.ttft += lost
    result.e2e += lost
    return result


async def _send_http_once(session: aiohttp.ClientSession, base_url: str, model: str, request: BenchRequest,
                          t0: float) -> RequestResult:
    result = RequestResult(request.prompt_len, request.output_len)
    clock = StreamClock(result, t0)
    try:
        async with session.post(f"{base_url}/v1/completions", json=completion_body(request, model)) as reply:
            if reply.status != 200:
                body = (await reply.read()).decode(errors="replace")
                result.error = f"HTTP {reply.status}: {body[:300]}"
                return result
            async for chunk in aiohttp_sse_chunks(reply):
                usage = usage_of(chunk)
                if usage is not None:
                    result.output_tokens, result.cached_tokens, prompt_tokens = usage
                    result.prompt_len = prompt_tokens or result.prompt_len  # the server's count wins
                choices = chunk.get("choices") or []
                if choices and choices[0].get("text"):
                    clock.output()
        clock.done()
        if result.output_tokens == 0:
            result.output_tokens = clock.streamed  # no usage block: one token per chunk
        result.ok = clock.streamed > 0
        if not result.ok:
            result.error = "no output"
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


class GrpcSender:
    """``Gateway.Generate`` over one shared ``grpc.aio`` channel (the gRPC transport)."""

    def __init__(self, address: str):
        import grpc

        from kvserve.v1 import gateway_pb2, gateway_pb2_grpc

        self._pb = gateway_pb2
        self._grpc = grpc
        self.channel = grpc.aio.insecure_channel(address)
        self.stub = gateway_pb2_grpc.GatewayStub(self.channel)

    async def send(self, request: BenchRequest, t0: float) -> RequestResult:
        result = RequestResult(request.prompt_len, request.output_len)
        params = self._pb.GenerationParams(max_tokens=request.output_len, min_tokens=request.output_len,
                                           ignore_eos=True, temperature=0.0)
        clock = StreamClock(result, t0)
        try:
            async for reply in self.stub.Generate(self._pb.GenerateRequest(text=request.prompt, params=params)):
                if reply.token_ids:
                    clock.output(len(reply.token_ids))
                if reply.HasField("usage"):
                    result.output_tokens = reply.usage.completion_tokens
                    result.cached_tokens = reply.usage.cached_tokens
                    result.prompt_len = reply.usage.prompt_tokens or result.prompt_len
            clock.done()
            result.output_tokens = result.output_tokens or clock.streamed
            result.ok = clock.streamed > 0
        except self._grpc.RpcError as exc:
            result.error = f"gRPC {exc.code().name}: {exc.details()}"
        return result

    async def close(self) -> None:
        await self.channel.close()


async def run_load(requests: list[BenchRequest], *, base_url: str = "", grpc_address: str = "",
                   concurrency: int | None = None, request_rate: float | None = None, seed: int = 0,
                   progress: bool = True, timeout: float = 600.0) -> tuple[list[RequestResult], float]:
    """Sends every request once; returns (results in workload order, wall time in s).

    Exactly one of ``concurrency`` (closed loop) or ``request_rate`` (Poisson) is used;
    with neither, all requests are sent at once. ``grpc_address`` selects gRPC.
    """
    from tqdm.auto import tqdm

    bar = tqdm(total=len(requests), desc="requests", unit="req", disable=not progress, leave=False)
    http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                 timeout=aiohttp.ClientTimeout(total=None, connect=30.0, sock_read=timeout))
    grpc_sender = GrpcSender(grpc_address) if grpc_address else None
    results: list[RequestResult | None] = [None] * len(requests)
    try:
        model = "" if grpc_sender else await fetch_model_name(http, base_url)
        t0 = time.perf_counter()

        async def one(index: int) -> None:
            request = requests[index]
            if grpc_sender:
                results[index] = await grpc_sender.send(request, t0)
            else:
                results[index] = await send_http(http, base_url, model, request, t0)
            bar.update(1)

        if request_rate:
            rng = random.Random(seed)
            tasks = []
            for index in range(len(requests)):
                tasks.append(asyncio.create_task(one(index)))
                await asyncio.sleep(rng.expovariate(request_rate))
            await asyncio.gather(*tasks)
        else:
            width = concurrency or len(requests)
            queue = iter(range(len(requests)))

            async def worker() -> None:
                for index in queue:  # a shared iterator: each index is taken once
                    await one(index)

            await asyncio.gather(*(worker() for _ in range(min(width, len(requests)))))
        wall = time.perf_counter() - t0
    finally:
        bar.close()
        await http.close()
        if grpc_sender:
            await grpc_sender.close()
    return [r for r in results if r is not None], wall
