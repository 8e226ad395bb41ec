"""The ``kvserve.v1.Executor`` servicer: protobuf ⇄ domain, nothing else.

All torch work — loading the model and every step — runs in one thread
(``executor.torch_thread.TorchThread``), so the event loop keeps answering health
checks during a long forward pass and two steps never run at once. ``run_step`` is a
step from request to reply, the same whether it came over gRPC or the step socket.
"""
from __future__ import annotations

import dataclasses
import functools
import time

from executor.runner import ModelRunner, SequenceInput, StepOutput
from executor.sampling import SamplingParams
from executor.torch_thread import TorchThread
from kvserve.errors import StaleStep
from kvserve.store_orders import StoreOrders
from kvserve.v1 import executor_pb2, executor_pb2_grpc


def sequence_from_proto(seq: executor_pb2.ExecuteSequence) -> SequenceInput:
    # Fields read from the upb message one at a time cost ~1 µs each (an empty repeated field's list
    # as much), on the torch thread: ~20 µs a sequence, 0.6 ms of a 32-sequence step. Sampling
    # parameters repeat from step to step and are parsed once; empty lists are not built.
    return SequenceInput(
        seq_id=seq.seq_id,
        token_ids=list(seq.token_ids),
        start_position=seq.start_position,
        block_table=list(seq.block_table),
        sample=seq.sample,
        sampling=sampling_from_wire(seq.sampling.SerializeToString()) if seq.sample else SamplingParams(),
        store_load_block_ids=list(seq.store_load_block_ids) if seq.store_load_block_ids else [],
        store_load_hashes=list(seq.store_load_hashes) if seq.store_load_hashes else [],
        num_draft_tokens=seq.num_draft_tokens,
        prompt_logprob_token_ids=list(seq.prompt_logprob_token_ids) if seq.prompt_logprob_token_ids else [],
        prompt_top_logprobs=seq.prompt_top_logprobs,
    )


# Serialized parameters up to this size are remembered: those of plain, biased or penalized
# sampling; a constraint's token bitmask (6 KiB a step for a 49k vocabulary) changes every step.
CACHED_SAMPLING_BYTES = 1024


def sampling_from_wire(wire: bytes) -> SamplingParams:
    """The SamplingParams of a serialized ``executor_pb2.SamplingParams`` (immutable, so shared)."""
    return _cached_sampling(wire) if len(wire) <= CACHED_SAMPLING_BYTES else _parsed_sampling(wire)


def _parsed_sampling(wire: bytes) -> SamplingParams:
    s = executor_pb2.SamplingParams.FromString(wire)
    return SamplingParams(
        temperature=s.temperature,
        top_k=s.top_k,
        top_p=s.top_p,
        seed=s.seed if s.HasField("seed") else None,
        top_logprobs=s.top_logprobs,
        suppressed_token_ids=tuple(s.suppressed_token_ids),
        allowed_token_bitmask=s.allowed_token_bitmask,
        logit_bias_token_ids=tuple(s.logit_bias_token_ids),
        logit_bias_values=tuple(s.logit_bias_values),
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty,
        penalty_token_ids=tuple(s.penalty_token_ids),
        penalty_output_counts=tuple(s.penalty_output_counts),
        min_p=s.min_p,
    )


_cached_sampling = functools.lru_cache(maxsize=1024)(_parsed_sampling)


def store_orders_from_proto(request: executor_pb2.ExecuteRequest) -> StoreOrders | None:
    if not (request.store_save_block_ids or request.store_delete_hashes or request.store_save_hashes):
        return None
    return StoreOrders(list(request.store_save_block_ids), list(request.store_save_hashes),
                       list(request.store_save_keys), list(request.store_delete_hashes))


def response_from_step(out: StepOutput, total_ms: float, instance_id: str) -> executor_pb2.ExecuteResponse:
    reply = executor_pb2.ExecuteResponse(
        instance_id=instance_id,
        sampled_token_ids=out.sampled_token_ids,
        sampled_logprobs=out.sampled_logprobs,
        num_tokens=out.num_tokens,
        timings=executor_pb2.StepTimings(copy_ms=out.copy_ms, forward_ms=out.forward_ms,
                                         sample_ms=out.sample_ms, total_ms=total_ms, store_ms=out.store_ms),
        dropped_seq_ids=out.dropped_seq_ids,
        store_missing_hashes=out.store_missing_hashes,
        store_saves_ok=out.store_saves_ok,
        num_accepted_draft_tokens=out.num_accepted_draft_tokens,
    )
    if out.top_logprobs is not None and any(ids for ids, _ in out.top_logprobs):
        reply.top_logprobs.extend(executor_pb2.TopLogprobs(token_ids=ids, logprobs=lps) for ids, lps in out.top_logprobs)
    for scores in out.prompt_logprobs:
        reply.prompt_logprobs.add(logprobs=scores.logprobs, top_logprobs=[
            executor_pb2.TopLogprobs(token_ids=ids, logprobs=lps) for ids, lps in scores.top_logprobs])
    return reply


def run_step(runner: ModelRunner, request: executor_pb2.ExecuteRequest, started: float) -> executor_pb2.ExecuteResponse:
    """One step in the torch thread; ``started`` (``time.perf_counter()``) is when the request arrived."""
    if request.expected_instance_id and request.expected_instance_id != runner.info.instance_id:
        raise StaleStep(f"expected_instance_id: this step was ordered for executor instance "
                        f"{request.expected_instance_id}, this is {runner.info.instance_id} (it restarted)")
    sequences = [sequence_from_proto(s) for s in request.sequences]
    out = runner.execute(sequences, list(request.copy_src), list(request.copy_dst), store_orders_from_proto(request))
    return response_from_step(out, (time.perf_counter() - started) * 1e3, runner.info.instance_id)


class ExecutorServicer(executor_pb2_grpc.ExecutorServicer):
    def __init__(self, runner: ModelRunner, torch_thread: TorchThread, step_socket: str = ""):
        self.runner = runner
        self._torch_thread = torch_thread
        self._step_socket = step_socket

    async def Describe(self, request, context):
        return executor_pb2.DescribeResponse(**dataclasses.asdict(self.runner.info), step_socket=self._step_socket)

    async def Execute(self, request, context):
        return await self._step(request)

    async def ExecuteStream(self, request_iterator, context):
        # A refused step raises out of here: the interceptor ends the stream with its status.
        async for request in request_iterator:
            yield await self._step(request)

    async def _step(self, request: executor_pb2.ExecuteRequest) -> executor_pb2.ExecuteResponse:
        return await self._torch_thread.run(run_step, self.runner, request, time.perf_counter())
