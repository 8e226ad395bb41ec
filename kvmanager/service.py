"""``kvserve.v1.KVManager`` servicer: protobuf ⇄ domain, nothing else.

Domain errors raised by ``KVManager`` become status codes in
``kvserve.server.DomainErrorInterceptor``. Handlers never await in the middle
of a domain call, so each RPC is applied atomically on the event loop.
"""
from __future__ import annotations

import asyncio
import dataclasses

from kvmanager.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from kvmanager.manager import KVManager
from kvmanager.pool import PoolConfig
from kvserve.errors import ResourceExhausted
from kvserve.v1 import kvmanager_pb2 as pb
from kvserve.v1 import kvmanager_pb2_grpc

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["KVManager"].full_name
# A watcher that falls this many batches behind is dropped (it can reconnect and resync).
MAX_PENDING_EVENT_BATCHES = 10_000

_OK = pb.ALLOCATION_STATUS_OK
_NO_ROOM = pb.ALLOCATION_STATUS_NO_ROOM


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


class KVManagerService(kvmanager_pb2_grpc.KVManagerServicer):
    def __init__(self, manager: KVManager) -> None:
        self.manager = manager

    async def RegisterPool(self, request, context):
        created = self.manager.register_pool(PoolConfig(
            pool_id=request.pool_id, num_blocks=request.num_blocks, block_size=request.block_size,
            model_fingerprint=request.model_fingerprint,
            enable_prefix_caching=request.enable_prefix_caching,
            allocation_policy=request.allocation_policy, max_model_len=request.max_model_len,
        ), request.executor_instance_id, request.medium)
        return pb.RegisterPoolResponse(created=created)

    async def OpenSession(self, request, context):
        session = self.manager.open_session(request.pool_id, request.ttl_ms, request.client_name)
        return pb.OpenSessionResponse(session_id=session.session_id, ttl_ms=session.ttl_ms)

    async def RenewSession(self, request, context):
        return pb.RenewSessionResponse(expires_in_ms=self.manager.renew_session(request.session_id))

    async def CloseSession(self, request, context):
        return pb.CloseSessionResponse(num_sequences_freed=self.manager.close_session(request.session_id))

    async def Allocate(self, request, context):
        # The SequenceAllocation messages go to the domain as they are: it reads
        # the same attribute names as AllocationRequest's (no per-token copy).
        results, usage = self.manager.allocate(request.pool_id, request.session_id, request.free_seq_ids,
                                               request.sequences, request.written_seq_ids,
                                               request.written_num_tokens)
        response = pb.AllocateResponse(kv_cache_usage=usage)
        add = response.results.add
        for r in results:
            if not r.ok:
                add(seq_id=r.seq_id, status=_NO_ROOM)
            elif r.block_table or r.copy_src or r.num_cached_tokens:
                add(seq_id=r.seq_id, status=_OK, num_cached_tokens=r.num_cached_tokens,
                    start_position=r.start_position, num_tokens=r.num_tokens,
                    block_table_offset=r.block_table_offset, block_table=r.block_table,
                    copy_src=r.copy_src, copy_dst=r.copy_dst)
            else:  # the common decode step: nothing new in the table
                add(seq_id=r.seq_id, status=_OK, start_position=r.start_position, num_tokens=r.num_tokens,
                    block_table_offset=r.block_table_offset)
        return response

    async def Fork(self, request, context):
        table = self.manager.fork(request.pool_id, request.session_id, request.parent_seq_id,
                                  list(request.child_seq_ids))
        return pb.ForkResponse(block_table=table)

    async def Free(self, request, context):
        num = self.manager.free(request.pool_id, request.session_id, list(request.seq_ids),
                                request.written_seq_ids, request.written_num_tokens)
        return pb.FreeResponse(num_blocks_freed=num)

    async def GetStats(self, request, context):
        return pb.PoolStats(**dataclasses.asdict(self.manager.stats(request.pool_id)))

    async def ResetPrefixCache(self, request, context):
        return pb.ResetPrefixCacheResponse(num_blocks_cleared=self.manager.reset_prefix_cache(request.pool_id))

    async def LookupPrefix(self, request, context):
        matches = self.manager.lookup_prefix(list(request.pool_ids), request.queries)
        return pb.LookupPrefixResponse(matches=[
            pb.PrefixMatches(pools=[pb.PoolPrefixHit(pool_id=pool_id, num_cached_tokens=n) for pool_id, n in hits])
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
