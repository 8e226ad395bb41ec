"""The gateway's executor client on the step stream: the step's deadline, cancellation, and that a
step is on its way before whatever was queued on the event loop runs (the streams of the previous
step's tokens), against a real gRPC server that can hold a step."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from gateway.clients import DependencyError, ExecutorClient
from gateway.scheduler import ScheduledSeq
from gateway.sequence import GenerationRequest, SamplingOptions, Sequence, TextDecoder
from kvserve.v1 import executor_pb2, executor_pb2_grpc


class HoldsMarkedSteps(executor_pb2_grpc.ExecutorServicer):
    """Answers each step with its first sequence's seq_id as the sampled token; a step whose
    seq_id is in ``held`` gets no answer until the stream ends."""

    def __init__(self, held: set[int]):
        self.held = held
        self.streams = 0

    async def ExecuteStream(self, request_iterator, context):
        self.streams += 1
        async for request in request_iterator:
            seq_id = request.sequences[0].seq_id
            if seq_id in self.held:
                await asyncio.Event().wait()  # never answered; cancelled with the stream
            yield executor_pb2.ExecuteResponse(instance_id="i", sampled_token_ids=[seq_id])


class Decoder(TextDecoder):
    def append(self, token_id: int) -> str:
        return ""

    def flush(self) -> str:
        return ""


def decode_entry(seq_id: int) -> ScheduledSeq:
    request = GenerationRequest(f"r{seq_id}", [1, 2, 3], SamplingOptions(max_tokens=4), frozenset(), 64)
    seq = Sequence(seq_id, request, 0, [1, 2, 3, 4], Decoder(), block_table=[7])
    return ScheduledSeq(seq, seq_id, 1, [4], start_position=3, num_tokens=1, sample=True)


async def serve(servicer):
    server = grpc.aio.server()
    executor_pb2_grpc.add_ExecutorServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, ExecutorClient(f"127.0.0.1:{port}")


def test_a_step_past_its_deadline_is_deadline_exceeded_and_the_next_goes_on_a_new_stream():
    async def scenario():
        servicer = HoldsMarkedSteps(held={2})
        server, client = await serve(servicer)
        try:
            assert [s.token_id for s in (await client.execute([decode_entry(1)], timeout=5)).sampled] == [1]
            with pytest.raises(DependencyError) as raised:
                await client.execute([decode_entry(2)], timeout=0.3)
            assert raised.value.status is grpc.StatusCode.DEADLINE_EXCEEDED
            assert "within 0.3 s" in str(raised.value)
            # the held step's late answer could be read as the next step's: that stream is dropped
            assert [s.token_id for s in (await client.execute([decode_entry(3)], timeout=5)).sampled] == [3]
            return servicer.streams
        finally:
            await client.close()
            await server.stop(0)

    assert asyncio.run(scenario()) == 2


def test_a_step_cancelled_by_its_caller_stays_cancelled():
    async def scenario():
        server, client = await serve(HoldsMarkedSteps(held={2}))
        try:
            step = asyncio.ensure_future(client.execute([decode_entry(2)], timeout=30))
            await asyncio.sleep(0.2)
            step.cancel()
            with pytest.raises(asyncio.CancelledError):
                await step
            assert [s.token_id for s in (await client.execute([decode_entry(4)], timeout=5)).sampled] == [4]
        finally:
            await client.close()
            await server.stop(0)

    asyncio.run(scenario())


class RecordingCall:
    """A step stream's write/read, recording when the write starts."""

    def __init__(self, events: list[str]):
        self.events = events

    async def write(self, request):
        self.events.append("write")
        await asyncio.sleep(0)

    async def read(self):
        return executor_pb2.ExecuteResponse(instance_id="i")

    def cancel(self) -> bool:
        return True


def test_the_step_is_written_before_what_was_queued_on_the_loop_runs():
    async def scenario():
        events: list[str] = []
        asyncio.get_running_loop().call_soon(events.append, "queued before the step")
        await ExecutorClient._write_and_read(RecordingCall(events), executor_pb2.ExecuteRequest(), 5.0)
        return events

    assert asyncio.run(scenario()) == ["write", "queued before the step"]
