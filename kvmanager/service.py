"""``kvserve.v1.KVManager`` servicer: protobuf ⇄ domain, nothing else.

Domain errors raised by ``KVManager`` become status codes in
``kvserve.server.DomainErrorInterceptor``. Handlers never await in the middle
of a domain call, so each RPC is applied atomically on the event loop.
"""
from __future__ import annotations

import asyncio
import dataclasses

from kvmanager.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from kvmanager.manager import KVManager, StoreConfig
from kvmanager.pool import PoolConfig
from kvmanager.store_index import StoreIndex
from kvserve.auth import BearerToken
from kvserve.errors import FailedPrecondition, InvalidArgument, PermissionDenied, ResourceExhausted
from kvserve.kv_store import StoreError, describe_url, open_store
from kvserve.logs import get_logger
from kvserve.store_orders import StoreOrders
from kvserve.v1 import kvmanager_pb2 as pb
from kvserve.v1 import kvmanager_pb2_grpc

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["KVManager"].full_name
# A watcher that falls this many batches behind is dropped (it can reconnect and resync).
MAX_PENDING_EVENT_BATCHES = 10_000

# The admin calls' credential travels in this metadata key (the service token keeps "authorization").
ADMIN_METADATA_KEY = "kvserve-admin-key"

_OK = pb.ALLOCATION_STATUS_OK
_NO_ROOM = pb.ALLOCATION_STATUS_NO_ROOM
log = get_logger("kvmanager.service")


def store_config_from(request: pb.RegisterPoolRequest) -> StoreConfig:
    """The pool's store, its URL checked (opening one does no I/O)."""
    if not request.kv_store:
        return StoreConfig()
    try:
        store = open_store(request.kv_store)
    except ValueError as exc:
        raise InvalidArgument(f"kv_store: {exc}") from None
    medium = store.medium
    store.close()
    return StoreConfig(request.kv_store, request.kv_store_namespace, request.kv_store_capacity_blocks, medium)


def list_store(url: str, namespace: str) -> list[tuple[bytes, bytes]]:
    """(hash, block key) of every entry the store holds for a namespace (blocking I/O)."""
    store = open_store(url)
    try:
        return [(entry.block_hash, entry.block_key) for entry in store.list_entries(namespace)]
    finally:
        store.close()


def orders_to_proto(orders: StoreOrders | None) -> pb.StoreOrders | None:
    return None if orders is None else pb.StoreOrders(**dataclasses.asdict(orders))


def event_batch_to_proto(batch: EventBatch) -> pb.KVEventBatch:
    out = pb.KVEventBatch(timestamp=batch.timestamp, pool_id=batch.pool_id, stream_epoch=batch.epoch,
                          snapshot=batch.snapshot, snapshot_event_id=batch.snapshot_event_id,
                          snapshot_continues=batch.snapshot_continues)
    add = out.events.add
    medium = batch.medium
    event_id = batch.first_event_id
    for event in batch.events:
        if isinstance(event, BlockStored):
            add(event_id=event_id, block_stored=pb.BlockStored(
                block_hashes=event.block_hashes, parent_block_hash=event.parent_block_hash,
                token_ids=event.token_ids, block_size=event.block_size, adapter_id=event.adapter_id,
                medium=medium))
        elif isinstance(event, BlockRemoved):
            add(event_id=event_id, block_removed=pb.BlockRemoved(block_hashes=event.block_hashes, medium=medium))
        elif isinstance(event, AllBlocksCleared):
            add(event_id=event_id, all_blocks_cleared=pb.AllBlocksCleared())
        if event_id:
            event_id += 1
    return out


def check_admin(admin_key: BearerToken | None, context) -> None:
    """PERMISSION_DENIED unless the call carries the admin key; FAILED_PRECONDITION when none is set."""
    if admin_key is None:
        raise FailedPrecondition("admin calls are disabled: start kvmanager with --admin-key (KVSERVE_ADMIN_KEY)")
    values = [value for key, value in context.invocation_metadata() or () if key == ADMIN_METADATA_KEY]
    if len(values) != 1 or not admin_key.matches_secret(values[0]):
        raise PermissionDenied(f"an admin call: send the admin key as '{ADMIN_METADATA_KEY}' metadata")


def pinned_to_proto(pin_id: int, pools) -> pb.PinPrefixResponse:
    return pb.PinPrefixResponse(pin_id=pin_id, pools=[
        pb.PinnedPool(pool_id=p.pool_id, num_blocks=p.num_blocks, num_blocks_held=p.num_blocks_held) for p in pools])


class KVManagerService(kvmanager_pb2_grpc.KVManagerServicer):
    def __init__(self, manager: KVManager, admin_key: BearerToken | None = None) -> None:
        self.manager = manager
        self.admin_key = admin_key
        self._rebuilds: set[asyncio.Task] = set()
        self._allocate_socket = ""
        self._instance_id = ""

    def offer_allocate_socket(self, path: str, instance_id: str) -> None:
        """OpenSession names this socket (kvmanager/allocate_socket.py) and its greeting's instance id."""
        self._allocate_socket, self._instance_id = path, instance_id

    async def RegisterPool(self, request, context):
        created = self.manager.register_pool(PoolConfig(
            pool_id=request.pool_id, num_blocks=request.num_blocks, block_size=request.block_size,
            model_fingerprint=request.model_fingerprint,
            enable_prefix_caching=request.enable_prefix_caching,
            allocation_policy=request.allocation_policy, max_model_len=request.max_model_len,
        ), request.executor_instance_id, request.medium, store_config_from(request))
        for index in self.manager.take_new_stores():
            task = asyncio.get_running_loop().create_task(self._rebuild(index))
            self._rebuilds.add(task)
            task.add_done_callback(self._rebuilds.discard)
        return pb.RegisterPoolResponse(created=created)

    async def _rebuild(self, index: StoreIndex) -> None:
        """A store seen for the first time since this kvmanager started: what it already holds
        (saved before a restart, or by executors of another kvmanager) becomes findable. The
        listing runs off the event loop; a store it cannot read is logged and starts empty."""
        try:
            entries = await asyncio.to_thread(list_store, index.store_url, index.namespace)
        except (StoreError, OSError, ValueError) as exc:
            log.warning("kv_store_not_listed", store=describe_url(index.store_url), namespace=index.namespace,
                        reason=str(exc))
            return
        self.manager.rebuild_store(index, entries)

    async def OpenSession(self, request, context):
        session = self.manager.open_session(request.pool_id, request.ttl_ms, request.client_name)
        return pb.OpenSessionResponse(session_id=session.session_id, ttl_ms=session.ttl_ms,
                                      allocate_socket=self._allocate_socket, instance_id=self._instance_id)

    async def RenewSession(self, request, context):
        return pb.RenewSessionResponse(expires_in_ms=self.manager.renew_session(request.session_id))

    async def CloseSession(self, request, context):
        return pb.CloseSessionResponse(num_sequences_freed=self.manager.close_session(request.session_id))

    async def Allocate(self, request, context):
        # The SequenceAllocation messages go to the domain as they are: it reads
        # the same attribute names as AllocationRequest's (no per-token copy).
        report = request.store_report if request.HasField("store_report") else None
        results, usage = self.manager.allocate(request.pool_id, request.session_id, request.free_seq_ids,
                                               request.sequences, request.written_seq_ids,
                                               request.written_num_tokens, report)
        response = pb.AllocateResponse(
            kv_cache_usage=usage,
            store_orders=orders_to_proto(self.manager.take_store_orders(request.pool_id, request.session_id)))
        add = response.results.add
        for r in results:
            if not r.ok:
                add(seq_id=r.seq_id, status=_NO_ROOM)
            elif r.block_table or r.copy_src or r.num_cached_tokens:
                add(seq_id=r.seq_id, status=_OK, num_cached_tokens=r.num_cached_tokens,
                    start_position=r.start_position, num_tokens=r.num_tokens,
                    block_table_offset=r.block_table_offset, block_table=r.block_table,
                    copy_src=r.copy_src, copy_dst=r.copy_dst, num_store_tokens=r.num_store_tokens,
                    store_load_block_ids=r.store_load_block_ids, store_load_hashes=r.store_load_hashes)
            else:  # the common decode step: nothing new in the table
                add(seq_id=r.seq_id, status=_OK, start_position=r.start_position, num_tokens=r.num_tokens,
                    block_table_offset=r.block_table_offset)
        return response

    async def Fork(self, request, context):
        table = self.manager.fork(request.pool_id, request.session_id, request.parent_seq_id,
                                  list(request.child_seq_ids))
        return pb.ForkResponse(block_table=table)

    async def Free(self, request, context):
        report = request.store_report if request.HasField("store_report") else None
        num = self.manager.free(request.pool_id, request.session_id, list(request.seq_ids),
                                request.written_seq_ids, request.written_num_tokens, report)
        return pb.FreeResponse(num_blocks_freed=num, store_orders=orders_to_proto(
            self.manager.take_store_orders(request.pool_id, request.session_id)))

    async def GetStats(self, request, context):
        return pb.PoolStats(**dataclasses.asdict(self.manager.stats(request.pool_id)))

    async def SetTenantPolicy(self, request, context):
        check_admin(self.admin_key, context)
        self.manager.governance.set_policy(request.tenant, request.weight, request.quota_blocks,
                                           request.store_quota_blocks)
        return pb.SetTenantPolicyResponse()

    async def PinPrefix(self, request, context):
        check_admin(self.admin_key, context)
        pin_id, pools = self.manager.governance.pin(list(request.pool_ids), request.tenant, request.token_ids,
                                                    request.shared, request.cache_salt, request.adapter_id)
        return pinned_to_proto(pin_id, pools)

    async def GetPin(self, request, context):
        check_admin(self.admin_key, context)
        return pinned_to_proto(request.pin_id, self.manager.governance.pin_status(request.pin_id))

    async def UnpinPrefix(self, request, context):
        check_admin(self.admin_key, context)
        return pb.UnpinPrefixResponse(num_blocks_released=self.manager.governance.unpin(request.pin_id))

    async def ResetPrefixCache(self, request, context):
        return pb.ResetPrefixCacheResponse(num_blocks_cleared=self.manager.reset_prefix_cache(request.pool_id))

    async def LookupPrefix(self, request, context):
        matches = self.manager.lookup_prefix(list(request.pool_ids), request.queries, with_store=True)
        return pb.LookupPrefixResponse(matches=[
            pb.PrefixMatches(pools=[pb.PoolPrefixHit(pool_id=pool_id, num_cached_tokens=n, num_store_tokens=m)
                                    for pool_id, n, m in hits])
            for hits in matches])

    async def WatchEvents(self, request, context):
        queue: asyncio.Queue[EventBatch | None] = asyncio.Queue()
        last_sent = [0]  # id of the last event this watcher got, for the "fell behind" error

        def deliver(batch: EventBatch) -> None:
            if queue.qsize() >= MAX_PENDING_EVENT_BATCHES:
                queue.put_nowait(None)  # wakes the stream to end it
                raise OverflowError("watcher fell behind")  # the hub drops this subscriber
            queue.put_nowait(batch)

        # Replay or snapshot and subscription in one step: nothing published in between is lost.
        token, initial = self.manager.watch(request.pool_id, deliver, request.start_event_id, request.snapshot,
                                            request.stream_epoch)
        try:
            # Tell the client it is subscribed: events published from here on reach it.
            await context.send_initial_metadata(())
            for batch in initial:
                last_sent[0] = batch.last_event_id or batch.snapshot_event_id or last_sent[0]
                yield event_batch_to_proto(batch)
            while True:
                batch = await queue.get()
                if batch is None:
                    raise ResourceExhausted(
                        f"watcher fell more than {MAX_PENDING_EVENT_BATCHES} event batches behind; resubscribe "
                        f"with start_event_id={last_sent[0] + 1}")
                last_sent[0] = batch.last_event_id
                yield event_batch_to_proto(batch)
        finally:
            self.manager.unsubscribe(request.pool_id, token)
