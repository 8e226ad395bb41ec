"""The sequences of one pool: Allocate (one step of one sequence), Fork, Free and
the written-KV reports that publish full blocks to the prefix cache.

Anchored on nano-vllm's ``BlockManager`` and vLLM v1's ``KVCacheManager``:

* a ``KVSequence`` owns a block table (append-only, except that copy-on-write
  replaces an entry), its known token ids, how many of them have slots
  (``num_computed``), how many the client reported written (``num_written``) and
  the chained hashes of its published full blocks;
* one step (``admit`` a new sequence, ``step`` an existing one) appends the tokens
  produced since the last step, looks a *new* sequence up in the prefix cache,
  and makes room for ``min(num_new_tokens, known - computed)`` tokens from
  ``num_computed`` on. It is check-then-apply (``_plan`` counts every block the
  step needs, ``_apply`` changes state only when they are there), so "no room"
  leaves the sequence, the refcounts and the cache untouched;
* a hit means the KV is there: a full block becomes findable only when
  ``report_written`` says the Execute that wrote it has returned, never in the
  step that hands it out. A sequence freed before that publishes nothing, and a
  sequence alive when the pool is invalidated never publishes again;
* with a store tier (``store``, a ``StoreIndex`` shared by the pools of one store and
  namespace) a new sequence's lookup goes on in the store where the pool's chain
  ends: those blocks are allocated with load orders instead of being computed. Saves
  are ordered (``save_orders``) for published blocks, by the save policy: ``all`` as
  they are published, ``free`` when their sequence is freed; a block whose save is
  ordered holds one more reference until the save is reported (``KVManager``).
"""
from __future__ import annotations

import enum
import itertools
import sys
import time
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from kvmanager.block_pool import BlockPool, KVCacheBlock
from kvmanager.events import AllBlocksCleared, BlockStored, EventRecorder, KVEvent
from kvserve.prefix_hashes import (
    DEFAULT_TENANT, HASH_BYTES, SHARED_NAMESPACE, BlockExtras, adapter_of_extra, hash_key, pack_tokens, root_hash,
    split_key,
)
from kvmanager.pins import PoolPins
from kvmanager.store_index import StoreIndex
from kvmanager.tenants import TenantLedger, TenantPolicies

# When published blocks are saved to the pool's store (kvmanager's --kv-store-save).
SAVE_POLICIES = ("all", "free", "off")
CACHE_PRIORITY_LOW = 1  # kvserve.v1.CachePriority: cached blocks evicted before others


class AllocationPolicy(enum.IntEnum):
    """Values match ``kvserve.v1.AllocationPolicy``."""

    PAGED = 1
    RESERVE = 2


@dataclass(frozen=True)
class PoolConfig:
    pool_id: str
    num_blocks: int
    block_size: int
    model_fingerprint: str = ""
    enable_prefix_caching: bool = True
    allocation_policy: AllocationPolicy = AllocationPolicy.PAGED
    max_model_len: int = 0  # 0: no limit (paged only)


@dataclass(slots=True)
class AllocationRequest:
    """One sequence's part of a step (see ``SequenceAllocation`` in the proto).

    The domain only reads these attributes, so the service passes the protobuf
    ``SequenceAllocation`` messages as they are (no copy on the hot path).
    """

    seq_id: int
    token_ids: list[int] = field(default_factory=list)
    num_new_tokens: int = 0
    enable_prefix_caching: bool = True
    cache_salt: str = ""
    adapter_id: str = ""
    num_lookahead_slots: int = 0
    tenant: str = ""
    num_shared_tokens: int = 0
    cache_ttl_ms: int = 0
    cache_priority: int = 0  # CachePriority: LOW (1) blocks are evicted first
    num_precomputed_tokens: int = 0  # leading token_ids whose KV is already in held slots (accepted drafts)


@dataclass(slots=True)
class StepAllocation:
    """What one step of one sequence got (``SequenceAllocationResult`` on the wire)."""

    seq_id: int
    ok: bool
    num_cached_tokens: int = 0
    start_position: int = 0
    num_tokens: int = 0
    block_table_offset: int = 0
    block_table: Sequence[int] = ()
    copy_src: Sequence[int] = ()
    copy_dst: Sequence[int] = ()
    num_store_tokens: int = 0
    store_load_block_ids: Sequence[int] = ()
    store_load_hashes: Sequence[bytes] = ()


@dataclass(slots=True)
class SaveOrder:
    """A published block to copy into the store; ``block`` holds a reference for it."""

    block: KVCacheBlock
    block_hash: bytes
    block_key: bytes


class KVSequence:
    """A sequence as the KV manager sees it: its block table and its published prefix.

    Owned and mutated only by ``KVPool``; the blocks in ``block_table`` are
    shared objects whose refcounts ``BlockPool`` owns.
    """

    __slots__ = ("seq_id", "session_id", "token_ids", "num_computed", "num_written", "block_table",
                 "block_hashes", "publishes", "extras", "adapter_id", "owner", "shared_owner", "cache_ttl_s",
                 "evict_first")

    def __init__(self, seq_id: int, session_id: str, publishes: bool, extras: BlockExtras, adapter_id: str,
                 owner: TenantLedger, shared_owner: TenantLedger | None = None):
        self.seq_id = seq_id
        self.session_id = session_id
        self.token_ids: list[int] = []
        self.num_computed = 0  # tokens with a slot that the client computes (or has computed)
        self.num_written = 0  # tokens whose KV the client reported written
        self.block_table: list[KVCacheBlock] = []
        self.block_hashes: list[bytes] = []  # chained hashes of block_table[:len], all published or tried
        self.publishes = publishes  # written full blocks become findable (prefix caching, not invalidated)
        self.extras = extras  # hashed into each block: cache salt, adapter id, tenant or the shared namespace
        self.adapter_id = adapter_id
        self.owner = owner  # the tenant: its published blocks, the evictions it causes
        self.shared_owner = shared_owner  # owns the published blocks of the shareable range
        self.cache_ttl_s: float | None = None  # published blocks stop being findable this long after
        self.evict_first = False  # published blocks are evicted before others once free

    def fork(self, seq_id: int) -> KVSequence:
        child = KVSequence(seq_id, self.session_id, self.publishes, self.extras, self.adapter_id, self.owner,
                           self.shared_owner)
        child.cache_ttl_s = self.cache_ttl_s
        child.evict_first = self.evict_first
        child.token_ids = self.token_ids.copy()
        child.num_computed = self.num_computed
        child.num_written = self.num_written
        child.block_table = self.block_table.copy()
        child.block_hashes = self.block_hashes.copy()
        return child


# Shared empty result fields: most decode steps add no block and copy nothing.
_EMPTY: tuple = ()


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks that hold ``num_tokens`` tokens (ceiling division)."""
    return -(-num_tokens // block_size)


class KVPool:
    """One paged KV cache: its blocks, its sequences and its counters."""

    def __init__(self, config: PoolConfig, policies: TenantPolicies | None = None,
                 clock=time.monotonic) -> None:
        self.config = config
        self.block_size = config.block_size
        self.events = EventRecorder()
        self.block_pool = BlockPool(config.num_blocks, config.block_size, self.events, policies)
        self.pins = PoolPins(self.block_pool)
        self.clock = clock
        self.root_hash = root_hash(config.model_fingerprint)
        self.sequences: dict[int, KVSequence] = {}
        self.session_seq_ids: dict[str, set[int]] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.num_copies = 0
        self.executor_instance_id = ""  # the executor whose KV the published blocks describe
        self.medium = ""  # where the KV lives, for KV events (RegisterPool.medium)
        self.store: StoreIndex | None = None  # the store tier's index, shared with the store's other pools
        self.save_policy = "all"
        self.save_orders: list[SaveOrder] = []  # ordered since the last take_save_orders
        # Saves handed to a session and not reported yet: session id -> hash -> order.
        self.pending_saves: dict[str, dict[bytes, SaveOrder]] = {}
        self.store_hits = 0
        self.num_store_saves = 0
        self.num_store_save_failures = 0
        self.num_store_load_failures = 0

    # -- allocate --------------------------------------------------------------

    def step(self, seq: KVSequence, new_token_ids: Sequence[int], num_new_tokens: int,
             num_lookahead_slots: int = 0, num_precomputed: int = 0) -> StepAllocation:
        """One step of an existing sequence. The caller (``KVManager.allocate``) has
        validated the request and checked that the sequence is the caller's."""
        if num_precomputed:
            return self._step_after_precomputed(seq, new_token_ids, num_new_tokens, num_lookahead_slots,
                                                num_precomputed)
        start = seq.num_computed
        if num_new_tokens == 1 and len(new_token_ids) == 1 and start == len(seq.token_ids):
            # Fast path for the most common call of all, a decode step: one token
            # into a block the sequence already holds alone, its lookahead held
            # too. (_plan/_apply do the same, with the general checks.)
            table = seq.block_table
            bs = self.block_size
            i = start // bs
            if (start + num_lookahead_slots) // bs < len(table) and table[i].ref_cnt == 1:  # holds block i too
                seq.token_ids.append(new_token_ids[0])
                self.block_pool.fill(table[i], start + 1 - i * bs)
                seq.num_computed = start + 1
                return StepAllocation(seq.seq_id, True, 0, start, 1, len(table), _EMPTY, _EMPTY, _EMPTY)
        return self._allocate(seq, new_token_ids, num_new_tokens, _EMPTY, is_new=False,
                              num_lookahead_slots=num_lookahead_slots)

    def _step_after_precomputed(self, seq: KVSequence, new_token_ids: Sequence[int], num_new_tokens: int,
                                num_lookahead_slots: int, num_precomputed: int) -> StepAllocation:
        """The first ``num_precomputed`` new tokens are accepted speculative drafts whose KV an
        Execute already wrote into slots this sequence held past its tokens (validated by the
        caller): they count as computed, then the step goes on from after them. NO_ROOM leaves
        the sequence as it was."""
        start = seq.num_computed
        end = start + num_precomputed
        seq.token_ids.extend(new_token_ids[:num_precomputed])
        seq.num_computed = end
        result = self._allocate(seq, new_token_ids[num_precomputed:], num_new_tokens, _EMPTY, is_new=False,
                                num_lookahead_slots=num_lookahead_slots)
        if not result.ok:
            del seq.token_ids[start:]
            seq.num_computed = start
            return result
        bs = self.block_size
        for i in range(start // bs, num_blocks_for(end, bs)):
            self.block_pool.fill(seq.block_table[i], min(bs, end - i * bs))
        return result

    def admit(self, session_id: str, request: AllocationRequest) -> StepAllocation:
        """Creates a sequence (prefix-cache lookup first), or returns NO_ROOM and creates nothing."""
        prefix_caching = self.config.enable_prefix_caching and request.enable_prefix_caching
        seq = self._new_sequence(session_id, request, prefix_caching)
        hit_blocks: list[KVCacheBlock] = []
        store_hashes: list[bytes] = []
        if prefix_caching:
            self.block_pool.expire(self.clock())
            hit_blocks, seq.block_hashes, store_hashes = self._find_cached_prefix(seq.extras, request.token_ids)
        bs = self.block_size
        seq.block_table = hit_blocks.copy()
        seq.num_written = len(hit_blocks) * bs
        seq.num_computed = seq.num_written + len(store_hashes) * bs  # loaded, not computed
        result = self._allocate(seq, request.token_ids, request.num_new_tokens, hit_blocks, is_new=True,
                                num_lookahead_slots=request.num_lookahead_slots)
        if result.ok:
            self.sequences[seq.seq_id] = seq
            self.session_seq_ids.setdefault(session_id, set()).add(seq.seq_id)
            if prefix_caching:
                self.prefix_cache_queries += len(request.token_ids)
                self.prefix_cache_hits += len(hit_blocks) * bs
                seq.owner.queries += len(request.token_ids)
                seq.owner.hits += len(hit_blocks) * bs
            result.num_cached_tokens = len(hit_blocks) * bs
            if hit_blocks and self.store is not None:  # a use of the prefix, in the store's recency too
                self.store.touch(seq.block_hashes[:len(hit_blocks)])
            if store_hashes:
                self._order_loads(seq, len(hit_blocks), store_hashes, result)
        return result

    def _new_sequence(self, session_id: str, request: AllocationRequest, prefix_caching: bool) -> KVSequence:
        """A sequence with its hashing and cache terms (validated by ``KVManager.allocate``)."""
        num_shared_blocks = getattr(request, "num_shared_tokens", 0) // self.block_size
        tenant = getattr(request, "tenant", "")
        extras = BlockExtras(request.cache_salt, request.adapter_id, tenant, num_shared_blocks)
        owner = self.block_pool.ledger(tenant or DEFAULT_TENANT)
        shared_owner = self.block_pool.ledger(SHARED_NAMESPACE) if extras.num_shared_blocks else None
        seq = KVSequence(request.seq_id, session_id, prefix_caching, extras, request.adapter_id, owner, shared_owner)
        ttl_ms = getattr(request, "cache_ttl_ms", 0)
        seq.cache_ttl_s = ttl_ms / 1000 if ttl_ms else None
        seq.evict_first = getattr(request, "cache_priority", 0) == CACHE_PRIORITY_LOW
        return seq

    def _order_loads(self, seq: KVSequence, first: int, store_hashes: list[bytes], result: StepAllocation) -> None:
        """The blocks after the pool's hit get the store's entries loaded instead of computed."""
        loaded = seq.block_table[first:first + len(store_hashes)]
        for block in loaded:
            self.block_pool.fill(block, self.block_size)
        self.store.touch(store_hashes)
        self.store_hits += len(store_hashes) * self.block_size
        result.num_store_tokens = len(store_hashes) * self.block_size
        result.store_load_block_ids = [b.block_id for b in loaded]
        result.store_load_hashes = store_hashes

    def cached_prefix_length(self, prompt: Sequence[int], cache_salt: str = "", adapter_id: str = "",
                             tenant: str = "", num_shared_tokens: int = 0) -> int:
        """Tokens of ``prompt`` an admission would find cached now (routing; changes nothing
        but expiring what has outlived its TTL)."""
        if not self.config.enable_prefix_caching:
            return 0
        self.block_pool.expire(self.clock())
        extras = BlockExtras(cache_salt, adapter_id, tenant, num_shared_tokens // self.block_size)
        hits, _, _ = self._find_cached_prefix(extras, prompt)
        return len(hits) * self.block_size

    def _find_cached_prefix(self, extras: BlockExtras, prompt: Sequence[int],
                            ) -> tuple[list[KVCacheBlock], list[bytes], list[bytes]]:
        """Longest run of consecutive published full blocks, leaving at least the last
        prompt token to compute (a hit covers at most len(prompt) - 1 tokens), with their
        hashes; then the hashes of the blocks after them that the store holds. Stops at
        the first miss: a chained hash can only hit if its parent did."""
        bs = self.block_size
        max_hit_blocks = max(0, (len(prompt) - 1) // bs)
        hits: list[KVCacheBlock] = []
        hashes: list[bytes] = []
        store_hashes: list[bytes] = []
        if not max_hit_blocks:
            return hits, hashes, store_hashes
        step = 4 * bs
        packed = pack_tokens(prompt)  # once, then byte slices: no per-token work per block
        lookup = self.block_pool.lookup
        tail = extras.tail
        parent = self.root_hash
        store = self.store
        for i in range(max_hit_blocks):
            offset = i * step
            key = parent + tail(i) + packed[offset:offset + step]
            parent = hash_key(key)
            if not store_hashes:
                block = lookup(parent, key)
                if block is not None:
                    hits.append(block)
                    hashes.append(parent)
                    continue
            if store is None or not store.holds(parent, key):
                break
            store_hashes.append(parent)
        return hits, hashes, store_hashes

    def store_extension(self, extras: BlockExtras, packed_tokens: bytes, num_tokens: int, num_hit_blocks: int) -> int:
        """Blocks after the first ``num_hit_blocks`` of a prompt that the store holds (routing;
        changes nothing)."""
        store = self.store
        bs = self.block_size
        max_blocks = max(0, (num_tokens - 1) // bs)
        if store is None or not len(store) or num_hit_blocks >= max_blocks:
            return 0
        step = 4 * bs
        parent = self.root_hash
        num_store_blocks = 0
        for i, offset in enumerate(range(0, max_blocks * step, step)):
            key = parent + extras.tail(i) + packed_tokens[offset:offset + step]
            parent = hash_key(key)
            if i < num_hit_blocks:
                continue
            if not store.holds(parent, key):
                break
            num_store_blocks += 1
        return num_store_blocks

    def _allocate(self, seq: KVSequence, new_token_ids: Sequence[int], num_new_tokens: int,
                  hit_blocks: list[KVCacheBlock], is_new: bool, num_lookahead_slots: int = 0) -> StepAllocation:
        start = seq.num_computed
        num_tokens = min(num_new_tokens, len(seq.token_ids) + len(new_token_ids) - start)  # computed <= known
        reserve = is_new and self.config.allocation_policy is AllocationPolicy.RESERVE
        num_append, cow_indices = self._plan(seq, start, start + num_tokens, reserve)
        if not self._can_take(num_append + len(cow_indices), hit_blocks):
            return StepAllocation(seq.seq_id, False)
        num_append += self._lookahead_blocks(start + num_tokens, num_lookahead_slots, len(seq.block_table) + num_append,
                                             num_append + len(cow_indices), hit_blocks)
        return self._apply(seq, new_token_ids, hit_blocks, start, num_tokens, num_append, cow_indices, is_new)

    def _lookahead_blocks(self, end: int, num_lookahead_slots: int, num_held: int, num_taken: int,
                          hit_blocks: list[KVCacheBlock]) -> int:
        """Blocks to append beyond the ``num_held`` the step's tokens need so that the next
        ``num_lookahead_slots`` slots after ``end`` are held: all of them when free blocks allow
        after the ``num_taken`` the step takes, else none. Within max_model_len."""
        if not num_lookahead_slots:
            return 0
        max_len = self.config.max_model_len
        held_end = min(end + num_lookahead_slots, max_len) if max_len else end + num_lookahead_slots
        num_extra = max(0, num_blocks_for(held_end, self.block_size) - num_held)
        return num_extra if num_extra and self._can_take(num_taken + num_extra, hit_blocks) else 0

    def _plan(self, seq: KVSequence, start: int, end: int, reserve: bool) -> tuple[int, list[int]]:
        """Blocks to append to the table, and indices of shared blocks this step writes
        into (each needs a private copy). Changes nothing."""
        bs = self.block_size
        table = seq.block_table
        required_slots = max(end, self.config.max_model_len) if reserve else end
        num_append = max(0, num_blocks_for(required_slots, bs) - len(table))
        first, last = start // bs, min(len(table), num_blocks_for(end, bs)) - 1
        cow_indices = [i for i in range(first, last + 1) if table[i].ref_cnt > 1] if end > start else []
        return num_append, cow_indices

    def _can_take(self, num_needed: int, hit_blocks: list[KVCacheBlock]) -> bool:
        if not num_needed:
            return True
        # Free hit blocks leave the queue when taken: they cannot also be evicted
        # to make room for the same sequence.
        num_free_hits = sum(1 for b in hit_blocks if b.ref_cnt == 0)
        return num_needed <= self.block_pool.num_free_blocks - num_free_hits

    def _apply(self, seq: KVSequence, new_token_ids: Sequence[int], hit_blocks: list[KVCacheBlock],
               start: int, num_tokens: int, num_append: int, cow_indices: list[int],
               is_new: bool) -> StepAllocation:
        bs = self.block_size
        pool = self.block_pool
        table = seq.block_table
        old_len = len(table)
        end = start + num_tokens
        if hit_blocks:
            pool.touch(hit_blocks)
        seq.token_ids.extend(new_token_ids)
        copy_src = copy_dst = _EMPTY
        if num_append or cow_indices:
            new_blocks = pool.get_new_blocks(num_append + len(cow_indices), seq.owner)
            if cow_indices:
                copy_src, copy_dst = self._copy_on_write(table, cow_indices, new_blocks, start)
            table.extend(new_blocks)
        for i in range(start // bs, num_blocks_for(end, bs)):  # these slots now hold (or will hold) KV
            pool.fill(table[i], min(bs, end - i * bs))
        seq.num_computed = end

        if is_new:
            offset = 0
        elif cow_indices:
            offset = min(cow_indices[0], old_len)
        else:
            offset = old_len
        block_table = [b.block_id for b in table[offset:]] if offset < len(table) else _EMPTY
        return StepAllocation(seq.seq_id, True, 0, start, num_tokens, offset, block_table, copy_src, copy_dst)

    def _copy_on_write(self, table: list[KVCacheBlock], cow_indices: list[int],
                       new_blocks: list[KVCacheBlock], start: int) -> tuple[list[int], list[int]]:
        """Gives the sequence private blocks for the shared ones it is about to write
        (taking them off the end of ``new_blocks``); returns the (src, dst) copies."""
        bs = self.block_size
        pool = self.block_pool
        copy_src: list[int] = []
        copy_dst: list[int] = []
        for i in cow_indices:
            shared, private = table[i], new_blocks.pop()
            if i * bs < start:  # the block holds KV this sequence reads: copy it first
                copy_src.append(shared.block_id)
                copy_dst.append(private.block_id)
                pool.fill(private, start - i * bs)
            table[i] = private
            pool.free_blocks((shared,))  # refcount > 1: stays used by the others
        self.num_copies += len(copy_src)
        return copy_src, copy_dst

    # -- written KV: publication ------------------------------------------------

    def report_written(self, seq: KVSequence, num_tokens: int) -> None:
        """The client's Execute computing ``seq``'s first ``num_tokens`` tokens returned:
        their full blocks become findable. The caller checked ``num_tokens <= num_computed``."""
        if num_tokens <= seq.num_written:
            return
        seq.num_written = num_tokens
        if seq.publishes:
            self._publish(seq, num_tokens // self.block_size)

    def _publish(self, seq: KVSequence, num_full_blocks: int) -> None:
        """Hashes full blocks ``len(block_hashes)..num_full_blocks`` and makes them
        findable; one ``BlockStored`` per run of consecutive newly cached blocks."""
        bs = self.block_size
        hashes = seq.block_hashes
        extras = seq.extras
        block_pool = self.block_pool
        cached = block_pool.cached_blocks
        expires_at = self.clock() + seq.cache_ttl_s if seq.cache_ttl_s else None
        run: BlockStored | None = None
        for i in range(len(hashes), num_full_blocks):
            parent = hashes[-1] if hashes else self.root_hash
            tokens = seq.token_ids[i * bs:(i + 1) * bs]
            key = parent + extras.tail(i) + pack_tokens(tokens)
            h = hash_key(key)
            hashes.append(h)
            owner = seq.shared_owner if i < extras.num_shared_blocks else seq.owner
            block = seq.block_table[i]
            # A block whose parent is not findable (refused by a quota, evicted) would never be found.
            if (i and parent not in cached) or not block_pool.cache_block(block, h, key, owner, seq.evict_first,
                                                                           expires_at):
                run = None  # identical content is already findable in another block, or not cached
                continue
            self.pins.on_published(h, block)
            if self.save_policy == "all":
                self._order_save(seq.block_table[i], h, key)
            if run is None:
                run = BlockStored([], parent if i else b"", array("i"), bs, seq.adapter_id)
                self.block_pool.record_stored(run)
            run.block_hashes.append(h)
            run.token_ids.extend(tokens)  # an int32 array: events are buffered for replay

    def _order_save(self, block: KVCacheBlock, block_hash: bytes, key: bytes) -> None:
        """Orders a published block saved to the store unless it is there or on its way;
        the block keeps one more reference until the save is reported."""
        store = self.store
        if store is None or not store.wants(block_hash):
            return
        store.saving.add(block_hash)
        self.block_pool.touch((block,))
        self.save_orders.append(SaveOrder(block, block_hash, key))

    def take_save_orders(self, session_id: str) -> list[SaveOrder]:
        """The saves ordered since the last call, handed to ``session_id`` to carry: they stay
        pending (their blocks held) until it reports them or ends."""
        orders, self.save_orders = self.save_orders, []
        if orders:
            pending = self.pending_saves.setdefault(session_id, {})
            for order in orders:
                pending[order.block_hash] = order
        return orders

    def report_saves(self, session_id: str, saved: Sequence[bytes], failed: Sequence[bytes],
                     ) -> list[tuple[bytes, bytes]]:
        """The session's executor wrote these saves whole (findable from now on) or did not.
        Hashes the session has no pending save for (released since) are ignored. Returns (hash,
        key) of the entries that became findable (with any parked below them: ``StoreIndex.add``)."""
        pending = self.pending_saves.get(session_id)
        if not pending:
            return []
        stored = []
        for hashes, ok in ((saved, True), (failed, False)):
            for block_hash in hashes:
                order = pending.pop(block_hash, None)
                if order is not None:
                    stored += self._release_save(order, ok)
        if not pending:
            del self.pending_saves[session_id]
        return stored

    def store_events(self, stored: list[tuple[bytes, bytes]]) -> list[KVEvent]:
        """``BlockStored`` of entries that became findable in the store, one per block (the
        entries of a chain may come from several sequences and reports)."""
        events: list[KVEvent] = []
        swap = sys.byteorder != "little"
        for block_hash, block_key in stored:
            parent, extra, tokens = split_key(block_key)
            token_ids = array("i")
            token_ids.frombytes(tokens)
            if swap:
                token_ids.byteswap()
            events.append(BlockStored([block_hash], b"" if parent == self.root_hash else parent, token_ids,
                                      self.block_size, adapter_of_extra(extra)))
        return events

    def release_saves(self, session_id: str | None = None) -> None:
        """Drops the pending saves of a session (all sessions: None), and those not yet handed
        out: never findable, their blocks released."""
        sessions = list(self.pending_saves) if session_id is None else [session_id]
        for sid in sessions:
            for order in self.pending_saves.pop(sid, {}).values():
                self._release_save(order, False)
        if session_id is None:
            for order in self.take_save_orders(""):
                self._release_save(order, False)
            self.pending_saves.pop("", None)

    def _release_save(self, order: SaveOrder, saved: bool) -> list[tuple[bytes, bytes]]:
        """Ends a pending save; returns the entries that became findable: its own (unless its
        parent is no longer in the store, or still on its way) and any parked below it."""
        store = self.store
        findable = []
        if store is not None:
            if saved:
                findable = store.add(order.block_hash, order.block_key)
            else:
                store.save_failed(order.block_hash)
        if saved:
            self.num_store_saves += 1
        else:
            self.num_store_save_failures += 1
        self.block_pool.free_blocks((order.block,))
        return findable

    def invalidate_prefix_cache(self) -> int:
        """Nothing in the pool is findable any more, used blocks included, and no live
        sequence publishes again (its KV may predate whatever made the cache invalid).
        Returns how many blocks were findable."""
        for seq in self.sequences.values():
            seq.publishes = False
        self.release_saves()  # their blocks' KV may be gone: never saved, never findable
        self.pins.on_invalidated()
        return self.block_pool.invalidate_prefix_cache()

    # -- fork / free --------------------------------------------------------

    def fork(self, parent: KVSequence, child_seq_ids: list[int]) -> list[int]:
        """Children share every block (refcount + 1), tokens and hashes."""
        for child_id in child_seq_ids:
            child = parent.fork(child_id)
            self.block_pool.touch(child.block_table)
            self.sequences[child_id] = child
            self.session_seq_ids.setdefault(parent.session_id, set()).add(child_id)
        return [b.block_id for b in parent.block_table]

    def free(self, seq_id: int, save: bool = True) -> int:
        """Frees a sequence; its blocks go to the LRU tail in reverse order, so
        that its tail blocks are evicted before its head. Returns blocks freed.
        With the ``free`` save policy its published blocks are ordered saved first
        (``save``: a client is there to carry the orders)."""
        seq = self.sequences.pop(seq_id)
        if save and self.save_policy == "free" and self.store is not None and seq.publishes:
            for block, block_hash in zip(seq.block_table, seq.block_hashes):
                if block.block_hash == block_hash:  # published by this sequence or an identical one
                    self._order_save(block, block_hash, block.block_key)
        owned = self.session_seq_ids.get(seq.session_id)
        if owned is not None:
            owned.discard(seq_id)
            if not owned:
                del self.session_seq_ids[seq.session_id]
        return self.block_pool.free_blocks(reversed(seq.block_table))

    def free_session(self, session_id: str) -> int:
        """Frees every sequence of a session; returns how many."""
        seq_ids = list(self.session_seq_ids.get(session_id, ()))
        for seq_id in seq_ids:
            self.free(seq_id, save=False)  # the session is gone: nobody carries save orders
        self.release_saves(session_id)
        return len(seq_ids)

    def drain_events(self) -> list:
        return self.events.drain()

    # -- snapshot ----------------------------------------------------------------

    def cached_block_keys(self) -> list[tuple[bytes, bytes]]:
        """(hash, key) of every cached block: a copy (keys are immutable bytes) that
        ``snapshot_events`` turns into events later, while the pool moves on."""
        return [(h, block.block_key) for h, block in self.block_pool.cached_blocks.items()]

    def snapshot_events(self) -> list[KVEvent]:
        """``snapshot_events`` of this pool now."""
        return list(snapshot_events(self.cached_block_keys(), self.root_hash, self.block_size))


def snapshot_events(keys: list[tuple[bytes, bytes]], root: bytes, block_size: int) -> Iterator[KVEvent]:
    """What a subscriber that followed a pool's events from the start holds, as events:
    ``AllBlocksCleared``, then one ``BlockStored`` per run of chained cached blocks,
    parents before children. ``keys`` are the pool's cached (hash, block key) pairs
    (``KVPool.cached_block_keys``): every block stored and not removed since
    the last clear, each with its parent hash (empty for a sequence's first block, as in
    the live events), tokens and adapter. Lazy: O(blocks) in all."""
    keys_of = dict(keys)
    step = 4 * block_size
    children: dict[bytes, list[bytes]] = {}
    starts: list[bytes] = []
    for h, key in keys:
        parent = key[:HASH_BYTES]
        if parent in keys_of and parent != h:
            children.setdefault(parent, []).append(h)
        else:
            starts.append(h)
    yield AllBlocksCleared()
    emitted: set[bytes] = set()
    swap = sys.byteorder != "little"
    for first in itertools.chain(starts, keys_of):  # then: only a hash collision could leave a cycle unreached
        stack = [first]
        while stack:
            h = stack.pop()
            if h in emitted:
                continue
            parent, extra, _ = split_key(keys_of[h])
            run = BlockStored([], b"" if parent == root else parent, array("i"), block_size, adapter_of_extra(extra))
            while h is not None and h not in emitted:
                emitted.add(h)
                run.block_hashes.append(h)
                run.token_ids.frombytes(keys_of[h][-step:])  # a full block: its key ends with its tokens
                kids = children.get(h)
                if kids:
                    stack.extend(reversed(kids[1:]))  # siblings start runs of their own, in order
                    h = kids[0]
                else:
                    h = None
            if swap:
                run.token_ids.byteswap()
            yield run


def match_cached_prefix(pools: Sequence[KVPool], extras: BlockExtras, packed_tokens: bytes | None,
                        num_tokens: int, block_hashes: Sequence[bytes] = ()) -> list[int]:
    """Cached prefix length in blocks, per pool, of one prompt, for pools that hash alike
    (same root hash, i.e. model fingerprint, and block size): the chain is hashed once
    for all of them, block by block, and stops at the first block no pool holds.
    Read-only (``LookupPrefix``).

    ``packed_tokens`` (``pack_tokens`` of the prompt, ``num_tokens`` ids) caps the hit at
    ``(num_tokens - 1) // block_size`` blocks and verifies every hit byte for byte
    against the cached block's key, as an admission does. ``block_hashes`` are the
    prompt's precomputed chained hashes (``kvserve.prefix_hashes.prefix_block_hashes``): with tokens
    they only save the hashing (the key check still applies, so a wrong hash is a miss);
    without tokens (None) they are all there is, the hit is capped at their number, and
    a cached block is trusted by hash alone (fine for routing: nothing reads KV on it).
    """
    first = pools[0]
    bs = first.block_size
    num_hashes = len(block_hashes)
    if packed_tokens is None:
        max_blocks = num_hashes
    else:
        max_blocks = max(0, (num_tokens - 1) // bs)
    caches = [pool.block_pool.cached_blocks for pool in pools]
    if not max_blocks:
        return [0] * len(pools)
    step = 4 * bs
    tail = extras.tail
    parent = first.root_hash
    digest = hash_key
    if len(caches) == 1:  # the common cases, without the per-pool bookkeeping
        get = caches[0].get
        if packed_tokens is None:
            for i in range(max_blocks):
                if get(block_hashes[i]) is None:
                    return [i]
            return [max_blocks]
        if not num_hashes:
            for i, offset in enumerate(range(0, max_blocks * step, step)):
                key = parent + tail(i) + packed_tokens[offset:offset + step]
                parent = digest(key)
                block = get(parent)
                if block is None or block.block_key != key:
                    return [i]
            return [max_blocks]
        for i, offset in enumerate(range(0, max_blocks * step, step)):
            key = parent + tail(i) + packed_tokens[offset:offset + step]
            parent = block_hashes[i] if i < num_hashes else digest(key)
            block = get(parent)
            if block is None or block.block_key != key:
                return [i]
        return [max_blocks]
    hits = [max_blocks] * len(caches)
    active = list(range(len(caches)))
    for i in range(max_blocks):
        if packed_tokens is None:
            key = None
            parent = block_hashes[i]
        else:
            offset = i * step
            key = parent + tail(i) + packed_tokens[offset:offset + step]
            parent = block_hashes[i] if i < num_hashes else digest(key)
        still = []
        for j in active:
            block = caches[j].get(parent)
            if block is None or (key is not None and block.block_key != key):
                hits[j] = i
            else:
                still.append(j)
        if not still:
            break
        active = still
    return hits
