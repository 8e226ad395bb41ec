"""grpc.aio client of kvmanager (and its allocate socket): protobuf ⇄ the scheduler's domain objects.

Failures are ``DependencyError``s, as the executor's client raises them (gateway/clients.py).
"""
from __future__ import annotations

import asyncio

import grpc
from google.protobuf.message import DecodeError

from gateway.allocate_socket import (ALLOCATE, FREE, AllocateSocket, AllocateSocketBroken, AllocateSocketRefused,
                                     AllocateSocketTimeout)
from gateway.clients import SOCKET_OPEN_TIMEOUT_S, ChannelSecurity, DependencyError, ExecutorInfo, _Client
from gateway.scheduler import AllocationResult, ScheduledSeq
from gateway.store_exchange import StoreExchange
from kvserve.kv_medium import medium_for_device
from kvserve.logs import get_logger
from kvserve.step_frames import FrameTooLarge
from kvserve.v1 import kvmanager_pb2, kvmanager_pb2_grpc

# What a prompt token found in the store saves next to one found in the executor's pool: a load
# costs 4-5 % of the prefill it replaces (python -m bench.multiturn_store, docs/benchmarks.md).
STORE_TOKEN_WEIGHT = 0.95
OK = kvmanager_pb2.ALLOCATION_STATUS_OK
# Metadata of kvmanager's admin calls (its --admin-key).
ADMIN_METADATA_KEY = "kvserve-admin-key"
POLICIES = {"paged": kvmanager_pb2.ALLOCATION_POLICY_PAGED, "reserve": kvmanager_pb2.ALLOCATION_POLICY_RESERVE}
log = get_logger("gateway.kvmanager_client")


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
        except AllocateSocketTimeout as exc:
            self._drop_allocate_socket()
            raise self._error(grpc.StatusCode.DEADLINE_EXCEEDED, f"the allocate socket: {exc}") from exc
        except AllocateSocketBroken as exc:
            self._drop_allocate_socket()
            raise self._error(grpc.StatusCode.UNAVAILABLE, str(exc)) from exc
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
                                                                  SOCKET_OPEN_TIMEOUT_S)
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
