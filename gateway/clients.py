"""grpc.aio clients of kvmanager and executor: protobuf ⇄ the scheduler's domain objects.

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
from dataclasses import dataclass, fields
from pathlib import Path

import grpc
from google.protobuf.message import DecodeError

from gateway.allocate_socket import ALLOCATE, FREE, AllocateSocket, AllocateSocketBroken, AllocateSocketRefused
from gateway.sampling_fields import fill_sampling
from gateway.scheduler import AllocationResult, SampledToken, ScheduledSeq
from gateway.step_socket import StepSocket, StepSocketRefused
from gateway.store_exchange import StoreExchange
from kvserve.store_orders import StoreOrders
from kvserve.auth import bearer_call_interceptors, channel_credentials
from kvserve.errors import Unavailable
from kvserve.health import check_async
from kvserve.kv_medium import medium_for_device
from kvserve.logs import get_logger
from kvserve.server import MAX_MESSAGE_BYTES
from kvserve.step_frames import FrameTooLarge
from kvserve.v1 import executor_pb2, executor_pb2_grpc, kvmanager_pb2, kvmanager_pb2_grpc

CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # Reconnect quickly when a dependency comes back (the default backoff grows to 120 s).
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
STEP_SOCKET_OPEN_TIMEOUT_S = 3.0
# What a prompt token found in the store saves next to one found in the executor's pool: a load
# costs 4-5 % of the prefill it replaces (python -m bench.multiturn_store, docs/benchmarks.md).
STORE_TOKEN_WEIGHT = 0.95
OK = kvmanager_pb2.ALLOCATION_STATUS_OK
# Metadata of kvmanager's admin calls (its --admin-key).
ADMIN_METADATA_KEY = "kvserve-admin-key"
POLICIES = {"paged": kvmanager_pb2.ALLOCATION_POLICY_PAGED, "reserve": kvmanager_pb2.ALLOCATION_POLICY_RESERVE}
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
        return await asyncio.wait_for(call.code(), 1.0) == grpc.StatusCode.UNIMPLEMENTED
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
        return ExecuteOutput(sampled, timings.forward_ms / 1000.0, timings.total_ms / 1000.0, reply.instance_id,
                             frozenset(reply.dropped_seq_ids), tuple(reply.store_missing_hashes),
                             tuple(reply.store_saves_ok))

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
                                                      STEP_SOCKET_OPEN_TIMEOUT_S)
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


class KVManagerClient(_Client):
    service = "kvmanager"

    def __init__(self, address: str, timeout: float = 10.0, security: ChannelSecurity | None = None,
                 use_allocate_socket: bool = True):
        super().__init__(address, security)
        self._stub = kvmanager_pb2_grpc.KVManagerStub(self.channel)
        self._timeout = timeout
        self._service_token = (security or ChannelSecurity()).service_token
        self._use_allocate_socket = use_allocate_socket
        self._allocate_socket_offer: tuple[str, str] | None = None  # (path, instance id) from the last OpenSession
        self._allocate_socket: AllocateSocket | None = None
        self._allocate_socket_opening = asyncio.Lock()
        self.calls_over_allocate_socket = 0

    async def close(self) -> None:
        self._drop_allocate_socket()
        await super().close()

    async def register_pool(self, pool_id: str, info: ExecutorInfo, enable_prefix_caching: bool,
                            kv_allocation: str) -> bool:
        request = kvmanager_pb2.RegisterPoolRequest(
            pool_id=pool_id, num_blocks=info.num_blocks, block_size=info.block_size,
            model_fingerprint=info.model_fingerprint, enable_prefix_caching=enable_prefix_caching,
            allocation_policy=POLICIES[kv_allocation], max_model_len=info.max_model_len,
            executor_instance_id=info.instance_id, medium=medium_for_device(info.device),
            kv_store=info.kv_store, kv_store_namespace=info.kv_store_namespace,
            kv_store_capacity_blocks=info.kv_store_capacity_blocks,
        )
        return (await self._call(self._stub.RegisterPool, request, self._timeout)).created

    async def open_session(self, pool_id: str, ttl_ms: int, client_name: str) -> tuple[str, int]:
        request = kvmanager_pb2.OpenSessionRequest(pool_id=pool_id, ttl_ms=ttl_ms, client_name=client_name)
        reply = await self._call(self._stub.OpenSession, request, self._timeout)
        offer = (reply.allocate_socket, reply.instance_id) if reply.allocate_socket and self._use_allocate_socket \
            else None
        if offer != self._allocate_socket_offer:
            self._drop_allocate_socket()
            self._allocate_socket_offer = offer
        return reply.session_id, reply.ttl_ms

    async def renew_session(self, session_id: str) -> int:
        request = kvmanager_pb2.RenewSessionRequest(session_id=session_id)
        return (await self._call(self._stub.RenewSession, request, self._timeout)).expires_in_ms

    async def close_session(self, session_id: str, timeout: float | None = None) -> int:
        request = kvmanager_pb2.CloseSessionRequest(session_id=session_id)
        reply = await self._call(self._stub.CloseSession, request, timeout or self._timeout)
        return reply.num_sequences_freed

    async def allocate(self, pool_id: str, session_id: str, free_seq_ids: list[int], plan: list[ScheduledSeq],
                       prefix_caching: bool, written: tuple[list[int], list[int]] = ((), ()),
                       store: StoreExchange | None = None) -> tuple[list[AllocationResult], float]:
        """One Allocate; with ``store``, its report goes along and the orders it answers are kept there."""
        sequences = []
        for entry in plan:
            sequence = kvmanager_pb2.SequenceAllocation(
                seq_id=entry.seq_id, token_ids=entry.new_token_ids, num_new_tokens=entry.num_new_tokens,
                num_lookahead_slots=entry.num_lookahead_slots, num_precomputed_tokens=entry.num_precomputed_tokens)
            if not entry.seq.known_to_kvmanager:  # read only when a sequence is created: not sent per decode
                options = entry.seq.request.options
                sequence.enable_prefix_caching = prefix_caching and options.enable_prefix_caching
                sequence.cache_salt = options.cache_salt
                sequence.tenant = options.tenant
                sequence.num_shared_tokens = options.num_shared_tokens
                sequence.cache_ttl_ms = options.cache_ttl_ms
                if options.cache_priority_low:
                    sequence.cache_priority = kvmanager_pb2.CACHE_PRIORITY_LOW
            sequences.append(sequence)
        request = kvmanager_pb2.AllocateRequest(
            pool_id=pool_id, session_id=session_id, free_seq_ids=free_seq_ids, sequences=sequences,
            written_seq_ids=written[0], written_num_tokens=written[1])
        reply = await self._call_with_store(ALLOCATE, request, store)
        results = [
            AllocationResult(
                ok=r.status == OK, num_cached_tokens=r.num_cached_tokens, start_position=r.start_position,
                num_tokens=r.num_tokens, block_table_offset=r.block_table_offset,
                block_table=list(r.block_table), copy_src=list(r.copy_src), copy_dst=list(r.copy_dst),
                num_store_tokens=r.num_store_tokens, store_load_block_ids=list(r.store_load_block_ids),
                store_load_hashes=list(r.store_load_hashes),
            )
            for r in reply.results
        ]
        return results, reply.kv_cache_usage

    async def _call_with_store(self, method: int, request, store: StoreExchange | None):
        """An Allocate or Free carrying the store report (kept for the next call if this one
        fails); the store orders of its answer are kept for the next Execute."""
        report = store.take_report() if store is not None else None
        if report:
            request.store_report.saved_hashes.extend(report.saved_hashes)
            request.store_report.failed_hashes.extend(report.failed_hashes)
            request.store_report.missing_hashes.extend(report.missing_hashes)
        try:
            reply = await self._per_step_call(method, request)
        except DependencyError:
            if report:
                store.give_back_report(report)
            raise
        if store is not None and reply.HasField("store_orders"):
            store.orders.extend(reply.store_orders)
        return reply

    async def _per_step_call(self, method: int, request):
        """Allocate or Free: on the allocate socket where this kvmanager offers one this gateway
        can open, else over gRPC."""
        allocate_socket = await self._open_allocate_socket()
        if allocate_socket is None:
            grpc_method = self._stub.Allocate if method == ALLOCATE else self._stub.Free
            return await self._call(grpc_method, request, self._timeout)
        try:
            status, payload = await allocate_socket.call(method, request.SerializeToString(), self._timeout)
        except AllocateSocketBroken as exc:
            self._drop_allocate_socket()
            raise self._error(grpc.StatusCode.UNAVAILABLE, str(exc)) from exc
        except asyncio.TimeoutError as exc:
            self._drop_allocate_socket()
            raise self._error(grpc.StatusCode.DEADLINE_EXCEEDED,
                              f"no reply on the allocate socket within {self._timeout:.1f} s") from exc
        if status is not grpc.StatusCode.OK:
            raise self._error(status, payload.decode(errors="replace"))
        response_type = kvmanager_pb2.AllocateResponse if method == ALLOCATE else kvmanager_pb2.FreeResponse
        try:
            reply = response_type.FromString(payload)
        except DecodeError as exc:
            self._drop_allocate_socket()
            raise self._error(grpc.StatusCode.UNAVAILABLE, f"an unreadable reply on the allocate socket: {exc}") from exc
        self.calls_over_allocate_socket += 1
        return reply

    async def _open_allocate_socket(self) -> AllocateSocket | None:
        """The open allocate socket, opening it if need be; None (and gRPC until the next OpenSession)
        when the offered one cannot be opened here: another host's path, another kvmanager, no token."""
        if self._allocate_socket is not None or self._allocate_socket_offer is None:
            return self._allocate_socket
        async with self._allocate_socket_opening:
            if self._allocate_socket is not None or self._allocate_socket_offer is None:
                return self._allocate_socket
            path, instance_id = self._allocate_socket_offer
            try:
                self._allocate_socket = await AllocateSocket.open(path, self._service_token, instance_id,
                                                                  STEP_SOCKET_OPEN_TIMEOUT_S)
            except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, FrameTooLarge,
                    AllocateSocketRefused) as exc:
                self._allocate_socket_offer = None
                log.info("allocate_socket_not_used", kvmanager=self.address, path=path,
                         reason=str(exc) or type(exc).__name__)
                return None
            log.info("allocate_socket_open", kvmanager=self.address, path=path)
            return self._allocate_socket

    def _drop_allocate_socket(self) -> None:
        if self._allocate_socket is not None:
            self._allocate_socket.close()
            self._allocate_socket = None

    async def fork(self, pool_id: str, session_id: str, parent: int, children: list[int]) -> list[int]:
        request = kvmanager_pb2.ForkRequest(
            pool_id=pool_id, session_id=session_id, parent_seq_id=parent, child_seq_ids=children)
        return list((await self._call(self._stub.Fork, request, self._timeout)).block_table)

    async def free(self, pool_id: str, session_id: str, seq_ids: list[int],
                   written: tuple[list[int], list[int]] = ((), ()), store: StoreExchange | None = None) -> int:
        request = kvmanager_pb2.FreeRequest(pool_id=pool_id, session_id=session_id, seq_ids=seq_ids,
                                            written_seq_ids=written[0], written_num_tokens=written[1])
        return (await self._call_with_store(FREE, request, store)).num_blocks_freed

    async def get_stats(self, pool_id: str, timeout: float = 1.0) -> kvmanager_pb2.PoolStats:
        return await self._call(self._stub.GetStats, kvmanager_pb2.GetStatsRequest(pool_id=pool_id), timeout)

    async def lookup_prefix(self, pool_ids: list[str], token_ids: list[int], cache_salt: str = "",
                            timeout: float = 1.0, tenant: str = "", num_shared_tokens: int = 0) -> dict[str, int]:
        """Tokens of ``token_ids`` whose KV each pool has published (the routing question), a
        store hit after them counted at ``STORE_TOKEN_WEIGHT`` of a pool hit (it costs a load).
        Asked as ``tenant`` (with its shareable range): another tenant's blocks are never counted."""
        query = kvmanager_pb2.PrefixQuery(token_ids=token_ids, cache_salt=cache_salt, tenant=tenant,
                                          num_shared_tokens=num_shared_tokens)
        request = kvmanager_pb2.LookupPrefixRequest(pool_ids=pool_ids, queries=[query])
        reply = await self._call(self._stub.LookupPrefix, request, timeout)
        if not reply.matches:
            return {}
        return {hit.pool_id: hit.num_cached_tokens + int(hit.num_store_tokens * STORE_TOKEN_WEIGHT)
                for hit in reply.matches[0].pools}

    # --- admin calls (need kvmanager's --admin-key, sent as ADMIN_METADATA_KEY) ---------------

    async def _admin(self, method, request, admin_key: str, timeout: float | None = None):
        try:
            return await method(request, timeout=timeout or self._timeout,
                                metadata=((ADMIN_METADATA_KEY, admin_key),))
        except grpc.aio.AioRpcError as exc:
            raise DependencyError(self.service, self.address, exc) from exc

    async def set_tenant_policy(self, admin_key: str, tenant: str, weight: float, quota_blocks: int,
                                store_quota_blocks: int) -> None:
        request = kvmanager_pb2.SetTenantPolicyRequest(tenant=tenant, weight=weight, quota_blocks=quota_blocks,
                                                       store_quota_blocks=store_quota_blocks)
        await self._admin(self._stub.SetTenantPolicy, request, admin_key)

    async def pin_prefix(self, admin_key: str, pool_ids: list[str], tenant: str, token_ids: list[int],
                         shared: bool) -> kvmanager_pb2.PinPrefixResponse:
        request = kvmanager_pb2.PinPrefixRequest(pool_ids=pool_ids, tenant=tenant, token_ids=token_ids,
                                                 shared=shared)
        return await self._admin(self._stub.PinPrefix, request, admin_key)

    async def get_pin(self, admin_key: str, pin_id: int) -> kvmanager_pb2.PinPrefixResponse:
        return await self._admin(self._stub.GetPin, kvmanager_pb2.GetPinRequest(pin_id=pin_id), admin_key)

    async def unpin_prefix(self, admin_key: str, pin_id: int) -> int:
        reply = await self._admin(self._stub.UnpinPrefix, kvmanager_pb2.UnpinPrefixRequest(pin_id=pin_id), admin_key)
        return reply.num_blocks_released

    async def reset_prefix_cache(self, pool_id: str) -> int:
        request = kvmanager_pb2.ResetPrefixCacheRequest(pool_id=pool_id)
        return (await self._call(self._stub.ResetPrefixCache, request, self._timeout)).num_blocks_cleared


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
