"""Measures one running server: warm it up, sample /metrics, send the workload, summarize."""
from __future__ import annotations

import asyncio
import time

from bench.client import run_load
from bench.cpu_usage import CpuMeter
from bench.report import Row, row_from_results
from bench.server_metrics import MetricsSampler
from bench.workload import BenchRequest

# Not the shared system prompt, so the warm-up cannot seed the prefix cache for the run.
WARMUP_REQUEST = BenchRequest("Say hello to the benchmark in one short sentence.", 12, 8)


async def measure_async(name: str, requests: list[BenchRequest], *, base_url: str, grpc_address: str = "",
                        concurrency: int | None = None, request_rate: float | None = None, seed: int = 0,
                        warmup: int = 2, metrics_interval: float = 0.25, progress: bool = True,
                        kv_allocation: str = "", server_pids: dict[str, int] | None = None) -> Row:
    """``server_pids``: the server's processes by name, whose CPU seconds over the run the row keeps
    beside the client's own (``Row.cpu_s``)."""
    if warmup:
        # First calls pay one-time costs (allocator growth, lazy imports); keep them out of the numbers.
        await run_load([WARMUP_REQUEST] * warmup, base_url=base_url, grpc_address=grpc_address,
                       concurrency=1, progress=False)  # one at a time: the peak gauge stays at 1
    sampler = MetricsSampler(base_url, interval=metrics_interval)
    await sampler.start(time.perf_counter())
    cpu = CpuMeter(server_pids or {})
    cpu.start()
    try:
        results, wall = await run_load(requests, base_url=base_url, grpc_address=grpc_address,
                                       concurrency=concurrency, request_rate=request_rate, seed=seed,
                                       progress=progress)
    finally:
        cpu_s = cpu.stop()
        metrics = await sampler.stop()
    row = row_from_results(name, results, wall, metrics)
    row.cpu_s = cpu_s
    if not metrics.available:
        row.notes.append("/metrics not reachable: no server-side numbers")
    elif row.kv_utilization is None:
        row.notes.append("server exports no stored-token/allocated-slot gauges: KV utilization n/a")
    if row.kv_utilization is not None:
        # Slots allocated but holding no token. With on-demand paging only the last,
        # partly filled block of a sequence has such slots (internal fragmentation);
        # with reservation they are mostly reserved for tokens not yet (or never) made.
        row.unused_kv_slots = 1.0 - row.kv_utilization
        if kv_allocation == "paged":
            row.internal_fragmentation = row.unused_kv_slots
    return row


def measure(name: str, requests: list[BenchRequest], **kwargs) -> Row:
    return asyncio.run(measure_async(name, requests, **kwargs))


async def model_info_async(grpc_address: str) -> dict:
    """The gateway's ``GetModelInfo`` as a dict (what configuration is really running)."""
    import grpc
    from google.protobuf.json_format import MessageToDict

    from kvserve.v1 import gateway_pb2, gateway_pb2_grpc

    async with grpc.aio.insecure_channel(grpc_address) as channel:
        reply = await gateway_pb2_grpc.GatewayStub(channel).GetModelInfo(gateway_pb2.GetModelInfoRequest(),
                                                                         timeout=10)
    return MessageToDict(reply, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


def model_info(grpc_address: str) -> dict:
    try:
        return asyncio.run(model_info_async(grpc_address))
    except Exception as exc:  # informational only: a missing RPC must not fail the run
        return {"error": f"{type(exc).__name__}: {exc}"}
