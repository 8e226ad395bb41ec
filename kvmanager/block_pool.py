"""Blocks, refcounts, the free LRU queue and the prefix cache of one paged KV cache.

Anchored on vLLM v1's ``block_pool.py`` / ``FreeKVCacheBlockQueue``: every block
is a ``KVCacheBlock`` object that links itself into the free queue (an intrusive
doubly-linked list), so taking a cached block out of the middle of the queue on
a prefix hit, freeing and allocating are all O(1) per block; nothing scans the
pool. Block 0 is the null block: never handed out, never in the queue.

A block is in exactly one state:
  * null      — block 0;
  * used      — ``ref_cnt > 0``, in one or more block tables;
  * free      — ``ref_cnt == 0``, in the free queue; it may still carry a hash
                ("cached"), and then a prefix hit takes it back (``touch``).

A block carries a hash (is findable) only once its KV is written: ``KVPool``
calls ``cache_block`` when the client reports it, never when it hands it out.

A cached block belongs to a tenant (``owner``, a ``TenantLedger``): quotas cap how many
each tenant keeps, and when a new block has to evict a cached one and several tenants
have some, the victim is chosen fairly among tenants, LRU within one (``kvmanager.tenants``).
With one tenant this is plain LRU over the free queue.

Who owns what: ``BlockPool`` alone changes ``ref_cnt``, the free-queue links,
``block_hash``/``block_key``, ``owner`` and the counters; ``KVPool`` changes
``num_tokens`` only through ``fill``.
"""
from __future__ import annotations

import heapq
from collections.abc import Iterable

from kvmanager.events import BlockStored, EventRecorder
from kvmanager.tenants import TenantLedger, TenantPolicies

NULL_BLOCK_ID = 0


class KVCacheBlock:
    """One block of ``block_size`` KV slots; also a node of the free queue."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "block_key", "num_tokens", "prev_free", "next_free",
                 "owner", "evict_first", "num_pins")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        # Prefix-cache identity while the block is cached; None otherwise.
        self.block_hash: bytes | None = None
        # What block_hash was computed from (parent hash, extra keys, tokens),
        # kept so that a hit is verified, not trusted (see kvserve/prefix_hashes.py).
        self.block_key: bytes | None = None
        # Slots holding (or about to hold) KV: feeds PoolStats.num_stored_tokens.
        self.num_tokens = 0
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None
        self.owner: TenantLedger | None = None  # the tenant findable under, while cached
        self.evict_first = False  # cached for a low-priority request: freed to the queue's head
        self.num_pins = 0  # references held by pins (included in ref_cnt)

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeBlockQueue:
    """Free blocks, least recently freed first: the head is evicted first.

    Sentinel head/tail nodes keep ``append``/``popleft``/``remove`` branch-free.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail:
            raise AssertionError("popleft on an empty free queue")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def first(self) -> KVCacheBlock | None:
        block = self._head.next_free
        return None if block is self._tail else block

    def appendleft(self, block: KVCacheBlock) -> None:
        first = self._head.next_free
        first.prev_free = block
        block.next_free = first
        block.prev_free = self._head
        self._head.next_free = block
        self.num_free_blocks += 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def __iter__(self):
        """Head to tail (eviction order). O(n): for tests and debugging only."""
        block = self._head.next_free
        while block is not self._tail:
            yield block
            block = block.next_free

    def __len__(self) -> int:
        return self.num_free_blocks


class BlockPool:
    """All blocks of one pool, the free queue and the hash → block map."""

    def __init__(self, num_blocks: int, block_size: int, events: EventRecorder,
                 policies: TenantPolicies | None = None) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(b for b in self.blocks if b.block_id != NULL_BLOCK_ID)
        self.cached_blocks: dict[bytes, KVCacheBlock] = {}
        self.events = events
        self.num_cached_free_blocks = 0  # free blocks that still carry a hash
        self.num_stored_tokens = 0  # sum of num_tokens over used blocks
        self.num_evictions = 0
        self.num_expired = 0
        self.policies = policies if policies is not None else TenantPolicies()
        self.tenants: dict[str, TenantLedger] = {}
        # (expiry time, block id, hash) of blocks cached with a TTL, soonest first.
        self._expiries: list[tuple[float, int, bytes]] = []

    def ledger(self, name: str) -> TenantLedger:
        ledger = self.tenants.get(name)
        if ledger is None:
            ledger = self.tenants[name] = TenantLedger(name, self.policies.get(name))
        return ledger

    # -- counts -------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - 1 - self.free_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Used / usable blocks; cached free blocks count as free, as in vLLM."""
        return self.num_used_blocks / (self.num_blocks - 1)

    # -- allocation -----------------------------------------------------------

    def get_new_blocks(self, n: int, taker: TenantLedger | None = None) -> list[KVCacheBlock]:
        """Takes ``n`` free blocks, evicting any cached hash they carry: the head of the free
        queue (LRU), except that a cached block is taken from the tenant with the largest
        weighted share when several tenants have some. ``taker``: the tenant the blocks are
        for (counted as causing the evictions). The caller has checked ``n <= num_free_blocks``."""
        if n > self.free_queue.num_free_blocks:
            raise AssertionError(f"get_new_blocks({n}) with {self.free_queue.num_free_blocks} free")
        blocks = []
        queue = self.free_queue
        for _ in range(n):
            block = queue.first()
            if block.block_hash is not None and len(self.tenants) > 1:
                block = self._fair_victim(block)
            queue.remove(block)
            if block.block_hash is not None:
                self._evict(block, taker)
            block.ref_cnt = 1
            block.num_tokens = 0
            blocks.append(block)
        return blocks

    def _fair_victim(self, head: KVCacheBlock) -> KVCacheBlock:
        """The least recently used free cached block of the tenant holding the most cached
        blocks per unit of weight (``head``'s tenant on a tie)."""
        victim = head.owner
        for ledger in self.tenants.values():
            if ledger.free_cached and ledger.share > victim.share:
                victim = ledger
        return head if victim is head.owner else next(iter(victim.free_cached.values()))

    def _evict(self, block: KVCacheBlock, taker: TenantLedger | None = None) -> None:
        """Reuse resets a free block's hash: it is no longer findable by prefix."""
        owner = block.owner
        del owner.free_cached[block.block_id]
        owner.evictions_suffered += 1
        if taker is not None:
            taker.evictions_caused += 1
        self._drop_hash(block)
        self.num_cached_free_blocks -= 1
        self.num_evictions += 1

    def _drop_hash(self, block: KVCacheBlock) -> None:
        del self.cached_blocks[block.block_hash]
        self.events.removed(block.block_hash)
        block.owner.num_cached -= 1
        block.block_hash = block.block_key = block.owner = None
        block.evict_first = False

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Takes prefix-hit blocks: refcount + 1, out of the free queue if they were free."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
                del block.owner.free_cached[block.block_id]
                self.num_cached_free_blocks -= 1
                self.num_stored_tokens += block.num_tokens
            block.ref_cnt += 1

    def free_blocks(self, blocks_in_eviction_order: Iterable[KVCacheBlock]) -> int:
        """Refcount - 1; blocks reaching 0 join the queue's tail in the order given
        (callers pass a sequence's blocks tail first, so its tail is evicted before
        its head). Returns how many reached 0."""
        num_freed = 0
        for block in blocks_in_eviction_order:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.num_stored_tokens -= block.num_tokens
                num_freed += 1
                if block.block_hash is None:
                    self.free_queue.append(block)
                    continue
                self.num_cached_free_blocks += 1
                lru = block.owner.free_cached
                lru[block.block_id] = block
                if block.evict_first:
                    self.free_queue.appendleft(block)
                    lru.move_to_end(block.block_id, last=False)
                else:
                    self.free_queue.append(block)
        return num_freed

    def fill(self, block: KVCacheBlock, num_tokens: int) -> None:
        """The first ``num_tokens`` slots of a used block hold (or are about to hold) KV."""
        if num_tokens > block.num_tokens:
            self.num_stored_tokens += num_tokens - block.num_tokens
            block.num_tokens = num_tokens

    # -- prefix cache ----------------------------------------------------------

    def lookup(self, block_hash: bytes, block_key: bytes) -> KVCacheBlock | None:
        """The cached block for this hash, if its key (tokens and parent) is identical."""
        block = self.cached_blocks.get(block_hash)
        if block is None or block.block_key != block_key:
            return None
        return block

    def cache_block(self, block: KVCacheBlock, block_hash: bytes, block_key: bytes, owner: TenantLedger,
                    evict_first: bool = False, expires_at: float | None = None) -> bool:
        """Makes a full, used block whose KV is written findable under ``owner``. False when
        it already is, another block holds this hash (identical content computed twice: the
        first copy stays the cached one), or ``owner`` is at its quota with no free cached
        block of its own to evict for it (a quota refusal)."""
        if block.block_hash is not None or block_hash in self.cached_blocks:
            return False
        if owner.over_quota_by(1):
            if not owner.free_cached:
                owner.quota_refusals += 1
                return False
            self._uncache_free(next(iter(owner.free_cached.values())))
            owner.evictions_suffered += 1
            owner.evictions_caused += 1
            self.num_evictions += 1
        block.block_hash = block_hash
        block.block_key = block_key
        block.owner = owner
        block.evict_first = evict_first
        owner.num_cached += 1
        self.cached_blocks[block_hash] = block
        if expires_at is not None:
            heapq.heappush(self._expiries, (expires_at, block.block_id, block_hash))
        return True

    def _uncache_free(self, block: KVCacheBlock) -> None:
        """A free cached block stops being findable; it stays free where it is in the queue."""
        del block.owner.free_cached[block.block_id]
        self.num_cached_free_blocks -= 1
        self._drop_hash(block)

    def uncache(self, block: KVCacheBlock) -> None:
        """Drops a cached block's hash, free or in use (pinned blocks are not passed here)."""
        if block.ref_cnt == 0:
            self._uncache_free(block)
        else:
            self._drop_hash(block)

    def expire(self, now: float) -> int:
        """Blocks cached with a TTL that has passed stop being findable (pinned ones stay).
        Returns how many."""
        expiries = self._expiries
        num_expired = 0
        while expiries and expiries[0][0] <= now:
            _, block_id, block_hash = heapq.heappop(expiries)
            block = self.blocks[block_id]
            if block.block_hash == block_hash and not block.num_pins:
                self.uncache(block)
                num_expired += 1
        self.num_expired += num_expired
        return num_expired

    def enforce_quota(self, ledger: TenantLedger) -> int:
        """After a quota was lowered: the tenant's free cached blocks go first (LRU), then,
        if it still holds more, its unpinned used ones stop being findable. Returns how many."""
        num_dropped = 0
        while ledger.over_quota_by() and ledger.free_cached:
            self._uncache_free(next(iter(ledger.free_cached.values())))
            num_dropped += 1
        if ledger.over_quota_by():
            for block in [b for b in self.cached_blocks.values() if b.owner is ledger and not b.num_pins]:
                if not ledger.over_quota_by():
                    break
                self._drop_hash(block)
                num_dropped += 1
        ledger.evictions_suffered += num_dropped
        self.num_evictions += num_dropped
        return num_dropped

    def unlink(self) -> None:
        """Breaks the free queue's reference cycles, so that a dropped pool is freed
        by reference counting alone (its blocks may be frozen out of the cyclic GC)."""
        for block in self.blocks:
            block.prev_free = block.next_free = None
        self.free_queue = FreeBlockQueue(())

    def record_stored(self, event: BlockStored) -> None:
        self.events.stored(event)

    def invalidate_prefix_cache(self) -> int:
        """Drops every hash, from used blocks too: nothing is findable any more (the
        blocks themselves stay with their holders). Returns how many were findable."""
        num_cleared = len(self.cached_blocks)
        for block in self.cached_blocks.values():
            block.block_hash = block.block_key = block.owner = None
            block.evict_first = False
        self.cached_blocks.clear()
        self.num_cached_free_blocks = 0
        self._expiries.clear()
        for ledger in self.tenants.values():
            ledger.num_cached = 0
            ledger.free_cached.clear()
        self.events.cleared()
        return num_cleared
