"""The ``kvserve.v1.Executor`` servicer: protobuf ⇄ domain, nothing else.

All torch work — loading the model and every step — runs in one worker thread
(``TorchThread``), so the event loop keeps answering health checks during a long
forward pass and two steps never run at once. One thread, not merely one at a
time: each thread that runs parallel torch ops gets its own OpenMP team, and with
two teams on a small machine libgomp stops spinning between parallel regions (its
"throttled" mode), which slows every step (docs/executor.md has the numbers).
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from executor.runner import ModelRunner, SequenceInput, StepOutput
from executor.sampling import SamplingParams
from kvserve.v1 import executor_pb2, executor_pb2_grpc


def sequence_from_proto(seq: executor_pb2.ExecuteSequence) -> SequenceInput:
    sampling = None
    if seq.sample:
        s = seq.sampling
        sampling = SamplingParams(
            temperature=s.temperature,
            top_k=s.top_k,
            top_p=s.top_p,
            seed=s.seed if s.HasField("seed") else None,
            top_logprobs=s.top_logprobs,
            suppressed_token_ids=tuple(s.suppressed_token_ids),
        )
    return SequenceInput(
        seq_id=seq.seq_id,
        token_ids=list(seq.token_ids),
        start_position=seq.start_position,
        block_table=list(seq.block_table),
        sample=seq.sample,
        sampling=sampling or SamplingParams(),
    )


def response_from_step(out: StepOutput, total_ms: float, instance_id: str) -> executor_pb2.ExecuteResponse:
    reply = executor_pb2.ExecuteResponse(
        instance_id=instance_id,
        sampled_token_ids=out.sampled_token_ids,
        sampled_logprobs=out.sampled_logprobs,
        num_tokens=out.num_tokens,
        timings=executor_pb2.StepTimings(copy_ms=out.copy_ms, forward_ms=out.forward_ms,
                                         sample_ms=out.sample_ms, total_ms=total_ms),
    )
    if out.top_logprobs is not None and any(ids for ids, _ in out.top_logprobs):
        reply.top_logprobs.extend(executor_pb2.TopLogprobs(token_ids=ids, logprobs=lps) for ids, lps in out.top_logprobs)
    return reply


class TorchThread:
    """The one thread that runs torch: the model load and then every step."""

    def __init__(self, num_threads: int | None = None):
        initializer = (lambda: torch.set_num_threads(num_threads)) if num_threads else None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="executor-torch", initializer=initializer)

    async def run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class ExecutorServicer(executor_pb2_grpc.ExecutorServicer):
    def __init__(self, runner: ModelRunner, torch_thread: TorchThread):
        self.runner = runner
        self._torch_thread = torch_thread

    async def Describe(self, request, context):
        return executor_pb2.DescribeResponse(**dataclasses.asdict(self.runner.info))

    async def Execute(self, request, context):
        return await self._step(request)

    async def ExecuteStream(self, request_iterator, context):
        # A refused step raises out of here: the interceptor ends the stream with its status.
        async for request in request_iterator:
            yield await self._step(request)

    async def _step(self, request: executor_pb2.ExecuteRequest) -> executor_pb2.ExecuteResponse:
        start = time.perf_counter()
        sequences = [sequence_from_proto(s) for s in request.sequences]
        copy_src, copy_dst = list(request.copy_src), list(request.copy_dst)
        out = await self._torch_thread.run(self.runner.execute, sequences, copy_src, copy_dst)
        return response_from_step(out, (time.perf_counter() - start) * 1e3, self.runner.info.instance_id)
