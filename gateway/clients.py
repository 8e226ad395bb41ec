"""grpc.aio client of the executor, and what both clients share (gateway/kvmanager_client.py
is kvmanager's): protobuf ⇄ the scheduler's domain objects.

Every RPC failure becomes ``DependencyError`` (an ``Unavailable``) naming the
service, its address and the status, so a request that fails because a
dependency is down says why.

``ChannelSecurity`` (the gateway's ``--service-token`` and ``--tls-ca-file``) is
what both channels carry: every call gets ``authorization: Bearer <token>``
metadata, and with a CA file the channels speak TLS. The engine passes it from
its config to both clients.
"""
from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field, fields
from pathlib import Path

import grpc
from google.protobuf.message import DecodeError

from gateway.sampling_fields import fill_sampling
from gateway.scheduler import SampledToken, ScheduledSeq
from gateway.sequence import PromptTokenLogprob
from gateway.step_socket import StepSocket, StepSocketRefused
from kvserve.aio import wait_within
from kvserve.store_orders import StoreOrders
from kvserve.auth import bearer_call_interceptors, channel_credentials
from kvserve.errors import Unavailable
from kvserve.health import check_async
from kvserve.logs import get_logger
from kvserve.server import MAX_MESSAGE_BYTES
from kvserve.step_frames import FrameTooLarge
from kvserve.v1 import executor_pb2, executor_pb2_grpc

CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # Reconnect quickly when a dependency comes back (the default backoff grows to 120 s).
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
SOCKET_OPEN_TIMEOUT_S = 3.0  # a step or allocate socket's connect and greeting
log = get_logger("gateway.clients")


# Status codes with which a dependency that is up refuses what it was sent: the
# fault is in the call (a gateway bug or a request the edge let through), so only
# the requests in it fail. Anything else means the dependency is unreachable or
# has lost this gateway's state (an unknown session after a kvmanager restart).
REFUSALS = {
    "executor": frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE,
                           grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED,
                           grpc.StatusCode.INTERNAL}),
    "kvmanager": frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE,
                            grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ALREADY_EXISTS,
                            grpc.StatusCode.INTERNAL}),
}


class DependencyError(Unavailable):
    """kvmanager or executor failed an RPC (unreachable, restarted, or refused the call)."""

    def __init__(self, service: str, address: str, exc: grpc.aio.AioRpcError):
        self.service = service
        self.status = exc.code()
        self.details = exc.details() or ""
        super().__init__(f"{service} at {address}: {exc.code().name}: {exc.details()}")

    @property
    def refused(self) -> bool:
        """The dependency is up and refused this call's content (see ``REFUSALS``)."""
        return self.status in REFUSALS.get(self.service, ())


@dataclass(frozen=True)
class ExecutorInfo:
    """What the gateway uses of the executor's Describe (same field names)."""

    model_name: str
    model_fingerprint: str
    dtype: str
    device: str
    attention_backend: str
    block_size: int
    num_blocks: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    instance_id: str = ""
    tokenizer_fingerprint: str = ""
    step_socket: str = ""
    kv_store: str = ""
    kv_store_namespace: str = ""
    kv_store_capacity_blocks: int = 0
    verifies_draft_tokens: bool = False
    verifies_drafts_with_suppressed_tokens: bool = False
    returns_prompt_logprobs: bool = False

    @classmethod
    def from_proto(cls, reply: executor_pb2.DescribeResponse) -> ExecutorInfo:
        values = {f.name: getattr(reply, f.name) for f in fields(cls)}
        values["eos_token_ids"] = tuple(reply.eos_token_ids)
        return cls(**values)


@dataclass(frozen=True)
class ExecuteOutput:
    sampled: list[SampledToken]
    forward_s: float
    total_s: float
    instance_id: str = ""
    dropped_seq_ids: frozenset[int] = frozenset()  # a store load missed: not run
    store_missing_hashes: tuple[bytes, ...] = ()
    store_saves_ok: tuple[bool, ...] = ()
    # seq_id → the scores of the prompt tokens its entry named (ScheduledSeq.prompt_logprob_token_ids).
    prompt_logprobs: dict[int, list[PromptTokenLogprob]] = field(default_factory=dict)


@dataclass(frozen=True)
class ChannelSecurity:
    """Credentials of the channels to kvmanager and executor."""

    service_token: str | None = None  # sent as ``authorization: Bearer <token>`` on every call
    tls_ca_file: str | Path | None = None  # TLS, trusting this PEM CA bundle

    def open_channel(self, address: str) -> grpc.aio.Channel:
        interceptors = bearer_call_interceptors(self.service_token) if self.service_token else None
        if self.tls_ca_file:
            return grpc.aio.secure_channel(address, channel_credentials(self.tls_ca_file), options=CHANNEL_OPTIONS,
                                           interceptors=interceptors)
        return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS, interceptors=interceptors)


class _Client:
    service = ""

    def __init__(self, address: str, security: ChannelSecurity | None = None):
        self.address = address
        self.channel = (security or ChannelSecurity()).open_channel(address)

    async def healthy(self, timeout: float = 1.0) -> bool:
        return await check_async(self.channel, timeout=timeout)

    async def close(self) -> None:
        await self.channel.close()

    async def _call(self, method, request, timeout: float):
        try:
            return await method(request, timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            raise DependencyError(self.service, self.address, exc) from exc

    def _error(self, status: grpc.StatusCode, details: str) -> DependencyError:
        """A failure outside gRPC (a fast-path socket's) as the same error a gRPC call raises."""
        return DependencyError(self.service, self.address, grpc.aio.AioRpcError(
            status, grpc.aio.Metadata(), grpc.aio.Metadata(), details))


async def _answered_unimplemented(call: grpc.aio.StreamStreamCall, exc: grpc.aio.AioRpcError) -> bool:
    """Whether the executor answered ExecuteStream UNIMPLEMENTED. A write racing the server's
    UNIMPLEMENTED can fail with INTERNAL "Internal error from Core" instead (grpc/grpc#36066):
    then the call's own status, which the server did send, says what happened."""
    if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
        return True
    if exc.code() != grpc.StatusCode.INTERNAL:
        return False
    try:
        return await wait_within(call.code(), 1.0) == grpc.StatusCode.UNIMPLEMENTED
    except (asyncio.TimeoutError, grpc.aio.AioRpcError):
        return False


class ExecutorClient(_Client):
    service = "executor"

    def __init__(self, address: str, execute_timeout: float = 300.0, security: ChannelSecurity | None = None,
                 use_step_socket: bool = True):
        super().__init__(address, security)
        self._stub = executor_pb2_grpc.ExecutorStub(self.channel)
        self._execute_timeout = execute_timeout
        self.block_size = 16
        self.vocab_size = 0  # from Describe, before any step
        self._steps: grpc.aio.StreamStreamCall | None = None  # the open ExecuteStream
        self._steps_lock = asyncio.Lock()
        self._streaming = True  # False once the executor answers ExecuteStream with UNIMPLEMENTED
        self._service_token = (security or ChannelSecurity()).service_token
        self._use_step_socket = use_step_socket
        self._step_socket_offer: tuple[str, str] | None = None  # (path, instance id) from the last Describe
        self._step_socket: StepSocket | None = None
        self.steps_over_step_socket = 0

    async def describe(self, timeout: float = 3.0) -> ExecutorInfo:
        reply = await self._call(self._stub.Describe, executor_pb2.DescribeRequest(), timeout)
        self.block_size = reply.block_size
        self.vocab_size = reply.vocab_size
        offer = (reply.step_socket, reply.instance_id) if reply.step_socket and self._use_step_socket else None
        if offer != self._step_socket_offer:
            self._drop_step_socket()
            self._step_socket_offer = offer
        return ExecutorInfo.from_proto(reply)

    async def close(self) -> None:
        self._drop_step_socket()
        await super().close()

    async def execute(self, ready: list[ScheduledSeq], timeout: float | None = None,
                      store_orders: StoreOrders | None = None, instance_id: str = "") -> ExecuteOutput:
        """One step; ``store_orders`` ride along, checked against the executor ``instance_id``
        they were ordered for."""
        copy_src: list[int] = []
        copy_dst: list[int] = []
        sequences = []
        block_size = self.block_size
        want_top = False
        scored: list[int] = []  # seq_ids whose prompt tokens this step scores
        for entry in ready:
            for src, dst in entry.copies:
                copy_src.append(src)
                copy_dst.append(dst)
            drafts = entry.draft_token_ids
            end = entry.start_position + entry.num_tokens + len(drafts)
            table = entry.seq.block_table[: -(-end // block_size)]
            sequence = executor_pb2.ExecuteSequence(
                seq_id=entry.seq_id, token_ids=entry.compute_token_ids() + drafts if drafts else
                entry.compute_token_ids(), start_position=entry.start_position, block_table=table,
                sample=entry.sample, num_draft_tokens=len(drafts),
            )
            if entry.sample:
                fill_sampling(sequence.sampling, entry, self.vocab_size)
                want_top = want_top or bool(entry.seq.request.options.logprobs)
            if entry.store_load_block_ids:
                sequence.store_load_block_ids.extend(entry.store_load_block_ids)
                sequence.store_load_hashes.extend(entry.store_load_hashes)
            prompt_targets = entry.prompt_logprob_token_ids()
            if prompt_targets:
                sequence.prompt_logprob_token_ids.extend(prompt_targets)
                sequence.prompt_top_logprobs = entry.seq.request.options.prompt_logprobs
                scored.append(entry.seq_id)
            sequences.append(sequence)
        request = executor_pb2.ExecuteRequest(copy_src=copy_src, copy_dst=copy_dst, sequences=sequences)
        if store_orders:
            request.store_save_block_ids.extend(store_orders.save_block_ids)
            request.store_save_hashes.extend(store_orders.save_hashes)
            request.store_save_keys.extend(store_orders.save_keys)
            request.store_delete_hashes.extend(store_orders.delete_hashes)
            request.expected_instance_id = instance_id
        reply = await self._step(request, timeout or self._execute_timeout)
        logprobs = list(reply.sampled_logprobs)
        sampled = []
        for i, token_id in enumerate(reply.sampled_token_ids):
            top = None
            if want_top and i < len(reply.top_logprobs):
                alt = reply.top_logprobs[i]
                top = list(zip(alt.token_ids, alt.logprobs))
            sampled.append(SampledToken(token_id, logprobs[i] if i < len(logprobs) else None, top))
        if reply.num_accepted_draft_tokens:
            sampled = group_accepted_drafts(sampled, list(reply.num_accepted_draft_tokens))
        timings = reply.timings
        dropped = frozenset(reply.dropped_seq_ids)
        scored = [seq_id for seq_id in scored if seq_id not in dropped]
        prompt_logprobs = {seq_id: [PromptTokenLogprob(lp, list(zip(top.token_ids, top.logprobs)) if top else [])
                                    for lp, top in itertools.zip_longest(scores.logprobs, scores.top_logprobs)]
                           for seq_id, scores in zip(scored, reply.prompt_logprobs)}
        return ExecuteOutput(sampled, timings.forward_ms / 1000.0, timings.total_ms / 1000.0, reply.instance_id,
                             dropped, tuple(reply.store_missing_hashes), tuple(reply.store_saves_ok),
                             prompt_logprobs)

    async def _step(self, request: executor_pb2.ExecuteRequest, timeout: float) -> executor_pb2.ExecuteResponse:
        """One step: on the executor's step socket where it offers one this gateway can open, else
        on the open ExecuteStream (half the round trip of a unary Execute on a loopback channel,
        docs/gateway.md), or through Execute where the executor has no stream."""
        if self._step_socket_offer is not None:
            async with self._steps_lock:
                step_socket = await self._open_step_socket()
                if step_socket is not None:
                    return await self._step_on_socket(step_socket, request, timeout)
        if not self._streaming:
            return await self._call(self._stub.Execute, request, timeout)
        async with self._steps_lock:
            if self._steps is None or self._steps.done():
                self._steps = self._stub.ExecuteStream()
            call = self._steps
            try:
                return await self._write_and_read(call, request, timeout)
            except asyncio.TimeoutError as exc:
                self._drop(call)
                raise self._error(grpc.StatusCode.DEADLINE_EXCEEDED,
                                  f"no reply to the step within {timeout:.1f} s") from exc
            except grpc.aio.AioRpcError as exc:
                unimplemented = await _answered_unimplemented(call, exc)
                self._drop(call)
                if not unimplemented:
                    raise DependencyError(self.service, self.address, exc) from exc
                self._streaming = False
            except BaseException:
                self._drop(call)
                raise
        return await self._call(self._stub.Execute, request, timeout)

    async def _open_step_socket(self) -> StepSocket | None:
        """The open step socket, opening it if need be; None (and gRPC until the next Describe)
        when the offered one cannot be opened here: another host's path, another executor, no token."""
        if self._step_socket is not None or self._step_socket_offer is None:
            return self._step_socket
        path, instance_id = self._step_socket_offer
        try:
            self._step_socket = await StepSocket.open(path, self._service_token, instance_id,
                                                      SOCKET_OPEN_TIMEOUT_S)
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, FrameTooLarge, StepSocketRefused) as exc:
            self._step_socket_offer = None
            log.info("step_socket_not_used", executor=self.address, path=path,
                     reason=str(exc) or type(exc).__name__)
            return None
        log.info("step_socket_open", executor=self.address, path=path)
        return self._step_socket

    async def _step_on_socket(self, step_socket: StepSocket, request: executor_pb2.ExecuteRequest,
                              timeout: float) -> executor_pb2.ExecuteResponse:
        step_socket.send(request.SerializeToString())  # on its way before anything queued on the loop runs
        expired = []

        def expire() -> None:  # closing the socket ends the read below
            expired.append(True)
            step_socket.close()

        timer = asyncio.get_running_loop().call_later(timeout, expire)
        try:
            status, payload = await step_socket.read_reply()
        except (OSError, asyncio.IncompleteReadError, FrameTooLarge) as exc:
            self._drop_step_socket()
            if expired:
                raise self._error(grpc.StatusCode.DEADLINE_EXCEEDED,
                                  f"no reply to the step within {timeout:.1f} s") from exc
            raise self._error(grpc.StatusCode.UNAVAILABLE, f"the step socket failed: {exc!r}") from exc
        except BaseException:
            self._drop_step_socket()  # cancelled: its reply may still come, and would be read as the next step's
            raise
        finally:
            timer.cancel()
        if status is not grpc.StatusCode.OK:
            raise self._error(status, payload.decode(errors="replace"))
        try:
            reply = executor_pb2.ExecuteResponse.FromString(payload)
        except DecodeError as exc:
            self._drop_step_socket()
            raise self._error(grpc.StatusCode.UNAVAILABLE, f"an unreadable reply on the step socket: {exc}") from exc
        self.steps_over_step_socket += 1
        return reply

    def _drop_step_socket(self) -> None:
        if self._step_socket is not None:
            self._step_socket.close()
            self._step_socket = None

    def _drop(self, call: grpc.aio.StreamStreamCall) -> None:
        """A step that did not complete may still be answered, and its reply would be read as the
        next step's: the stream is never used again."""
        self._steps = None
        call.cancel()

    @staticmethod
    async def _write_and_read(call: grpc.aio.StreamStreamCall, request: executor_pb2.ExecuteRequest,
                              timeout: float) -> executor_pb2.ExecuteResponse:
        """The step's write and read, in the caller's task: the request is on its way before anything
        queued on the loop runs (in a task of its own, as ``wait_within`` would run it, it would
        start after them — the streams of the previous step's tokens, ~1 ms at 32 sequences).
        ``asyncio.TimeoutError`` when ``timeout`` passes first: the deadline cancels the call."""
        expired = []

        def expire() -> None:
            expired.append(True)
            call.cancel()

        timer = asyncio.get_running_loop().call_later(timeout, expire)
        try:
            await call.write(request)
            reply = await call.read()
        except (asyncio.CancelledError, asyncio.InvalidStateError, grpc.aio.AioRpcError):
            if expired and not _cancelling(asyncio.current_task()):
                raise asyncio.TimeoutError from None  # only the deadline cancelled it
            raise
        finally:
            timer.cancel()
        if reply is grpc.aio.EOF:  # the executor closed the stream without answering (it stops)
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                       "the executor ended the step stream")
        return reply


def _cancelling(task: asyncio.Task | None) -> int:
    """Cancellations requested of ``task`` (Python 3.11+; on 3.10, where a task cannot tell, 0)."""
    return task.cancelling() if task is not None and hasattr(task, "cancelling") else 0


def group_accepted_drafts(tokens: list[SampledToken], accepted: list[int]) -> list[SampledToken]:
    """One ``SampledToken`` per sampled sequence: a sequence with ``a`` accepted drafts has ``a + 1``
    consecutive tokens in the reply (``ExecuteResponse.num_accepted_draft_tokens``)."""
    if sum(accepted) + len(accepted) != len(tokens):
        raise ValueError(f"the executor answered {len(tokens)} sampled tokens for {len(accepted)} sequences "
                         f"with {sum(accepted)} accepted drafts")
    grouped, offset = [], 0
    for a in accepted:
        first = tokens[offset]
        first.num_accepted_drafts = a
        first.next_tokens = tokens[offset + 1:offset + 1 + a]
        grouped.append(first)
        offset += a + 1
    return grouped


async def watch_for_breaks(channel: grpc.aio.Channel, on_break) -> None:
    """Calls ``on_break()`` each time a channel that was READY breaks (the process behind it
    restarted or went away): whatever that service held for us may be gone."""
    state = channel.get_state(try_to_connect=False)
    while True:
        await channel.wait_for_state_change(state)
        new_state = channel.get_state(try_to_connect=False)
        if state is grpc.ChannelConnectivity.READY and new_state in (
                grpc.ChannelConnectivity.TRANSIENT_FAILURE, grpc.ChannelConnectivity.IDLE):
            on_break()
        state = new_state
