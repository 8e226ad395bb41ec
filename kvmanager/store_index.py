"""The index of one KV store tier: which block hashes a store holds for one namespace.

A store (a directory, or a Redis server: ``kvserve.kv_store``) keeps KV blocks by their
chained prefix hash, within a namespace that the executors derive from everything that
makes their blocks byte-compatible (weights, dtypes, KV layout, block size). Every pool
(executor) that names the same store and namespace shares one ``StoreIndex``: a prefix
saved by one executor is a hit for all of them, and survives any executor's restart.

The rule that makes the device tier trustworthy holds here too: **an entry is findable
only once its save is reported written whole** (``add`` is called from the client's
``StoreReport``, never when the save is ordered), and its parent's too (a save reported first
waits for its parent's, parked), and a load that missed (absent, torn or corrupt entry) is
reported and removes it (``remove``). A hit is verified against the
entry's block key (parent hash, extra keys, tokens), as the pool's prefix cache does,
so a hash collision costs a miss, never another prompt's KV.

Eviction takes the least recently used **leaf**, bounded by the executors' declared capacity:
an entry that other entries name as their parent stays while they do. A chain is found from
its first block, so a prefix aged out under its continuations would leave every one of them
unreachable; with plain LRU that is what happened to the most popular block of all, a chat
template's first 16 tokens, saved once and then served from the device tier by every request
while thousands of younger saves pushed it out. A hit in either tier refreshes an entry's
recency (``touch``; the pool touches its device-tier hits too): a prefix in use is what a
restart will want. Leaves wait in a heap per tenant by last use (stale items are skipped when
popped), so an eviction costs O(log n) however long the chains. Evicted hashes are queued for
the executors to delete (``take_deletes``). Each entry belongs to the tenant its block was
hashed for (read from its key, so a rebuilt index knows it too): a tenant over its
``store_quota_blocks`` evicts its own least recently used leaf, and when capacity forces an
eviction and several tenants hold entries, the victim is the tenant with the most entries per
unit of weight (``kvmanager.tenants``).
"""
from __future__ import annotations

import heapq
import struct
from collections import OrderedDict
from collections.abc import Iterable

from kvserve.prefix_hashes import DEFAULT_TENANT, HASH_BYTES, namespace_of_extra, split_key
from kvmanager.tenants import TenantPolicies

# Deletes queued beyond this are dropped: the entries are unfindable already, and the
# executors' own store (or a later rebuild and eviction) reclaims them.
MAX_PENDING_DELETES = 1 << 16
# A tenant's leaf heap is rebuilt from its live leaves once stale items outnumber them this much.
STALE_HEAP_FACTOR = 2


class StoreIndex:
    """Entries of one (store, namespace): hash -> block key, least recently used first."""

    def __init__(self, store_url: str, namespace: str, medium: str, capacity_blocks: int = 0,
                 policies: TenantPolicies | None = None, roots: Iterable[bytes] = ()) -> None:
        self.store_url = store_url
        # The root hashes of the pools that use the index: the parents of chains' first blocks.
        self.roots: set[bytes] = set(roots)
        self.namespace = namespace
        self.medium = medium
        self.capacity_blocks = capacity_blocks  # 0: no limit
        self.entries: OrderedDict[bytes, bytes] = OrderedDict()
        self.saving: set[bytes] = set()  # saves ordered, not yet reported
        # Saves reported written whose parent's save was still in transit (ordered to another
        # executor or gateway, whose report comes later): per parent hash, (hash, key) of each.
        self._parked: dict[bytes, list[tuple[bytes, bytes]]] = {}
        self._parked_hashes: set[bytes] = set()
        self._deletes: list[bytes] = []
        self.num_evictions = 0
        self.policies = policies if policies is not None else TenantPolicies()
        # Per tenant, its entries least recently used first (the same hashes as ``entries``).
        self.by_tenant: dict[str, OrderedDict[bytes, None]] = {}
        self.quota_evictions: dict[str, int] = {}
        # Per parent hash, how many entries name it as their parent (split_key's first field).
        self.num_children: dict[bytes, int] = {}
        # Per entry, when it was last used (a counter); per tenant, (last use, hash) of its leaves,
        # with stale items (used again since, or a parent now) among them.
        self._last_used: dict[bytes, int] = {}
        self._clock = 0
        self._leaves: dict[str, list[tuple[int, bytes]]] = {}

    def num_entries_of(self, tenant: str) -> int:
        return len(self.by_tenant.get(tenant, ()))

    def __len__(self) -> int:
        return len(self.entries)

    def holds(self, block_hash: bytes, block_key: bytes) -> bool:
        """Whether a verified entry for this block is findable (changes nothing)."""
        return self.entries.get(block_hash) == block_key

    def touch(self, hashes: Iterable[bytes]) -> None:
        """Hits: these entries were just used, evict them last."""
        for block_hash in hashes:
            key = self.entries.get(block_hash)
            if key is not None:
                tenant = _tenant_of(key)
                self.entries.move_to_end(block_hash)
                self.by_tenant[tenant].move_to_end(block_hash)
                self._used(block_hash, tenant)

    def wants(self, block_hash: bytes) -> bool:
        """Whether a save of this block is worth ordering (not held, not being saved)."""
        return block_hash not in self.entries and block_hash not in self.saving and block_hash not in self._parked_hashes

    def add(self, block_hash: bytes, block_key: bytes) -> list[tuple[bytes, bytes]]:
        """A save was reported written whole: the entry is findable from now on, unless its parent
        is not. A parent whose own save is still in transit (two executors saving one chain, each
        reporting through its own steps) parks it until that save is reported; a parent gone
        (evicted, or its save failed) leaves nothing that could reach it, and it is queued for
        deletion. Returns (hash, key) of each entry that became findable: this one, then those
        parked below it."""
        self.saving.discard(block_hash)
        self.remove(block_hash)
        if not self._reachable(block_key):
            parent = block_key[:HASH_BYTES]
            if parent in self.saving or parent in self._parked_hashes:
                self._parked.setdefault(parent, []).append((block_hash, block_key))
                self._parked_hashes.add(block_hash)
            else:
                self._queue_delete(block_hash)
            return []
        added = []
        pending = [(block_hash, block_key)]
        while pending:
            entry_hash, key = pending.pop()
            if not self._reachable(key):  # its parent, parked with it, was evicted on the way
                self._queue_delete(entry_hash)
                self._drop_parked_below(entry_hash)
                continue
            self._insert(entry_hash, key)
            added.append((entry_hash, key))
            for child in self._parked.pop(entry_hash, ()):
                self._parked_hashes.discard(child[0])
                pending.append(child)
        return added

    def save_failed(self, block_hash: bytes) -> None:
        """A save ended unwritten (it failed, or its session ended first): the entries parked below
        it can never be reached, and are queued for deletion."""
        self.saving.discard(block_hash)
        self._drop_parked_below(block_hash)

    def _drop_parked_below(self, block_hash: bytes) -> None:
        below = [block_hash]
        while below:
            for child, _ in self._parked.pop(below.pop(), ()):
                self._parked_hashes.discard(child)
                self._queue_delete(child)
                below.append(child)

    def _insert(self, block_hash: bytes, block_key: bytes) -> None:
        tenant = _tenant_of(block_key)
        self._count_child(block_key, 1)  # before any eviction: its parent is in use from now on
        quota = self.policies.get(tenant).store_quota_blocks
        while quota and self.num_entries_of(tenant) >= quota:
            self._evict(self._least_recent_leaf(tenant) or next(iter(self.by_tenant[tenant])))
            self.quota_evictions[tenant] = self.quota_evictions.get(tenant, 0) + 1
        self.entries[block_hash] = block_key
        self.by_tenant.setdefault(tenant, OrderedDict())[block_hash] = None
        self._used(block_hash, tenant)
        self._evict_over_capacity()

    def remove(self, block_hash: bytes) -> bool:
        """A load missed: the entry is not findable any more. False when it was not."""
        key = self.entries.pop(block_hash, None)
        if key is None:
            return False
        del self._last_used[block_hash]
        tenant = _tenant_of(key)
        owned = self.by_tenant[tenant]
        del owned[block_hash]
        if not owned:
            del self.by_tenant[tenant]
            self._leaves.pop(tenant, None)
        self._count_child(key, -1)
        return True

    def rebuild(self, listed: Iterable[tuple[bytes, bytes]]) -> int:
        """Entries found in the store itself (a restarted kvmanager): those not known yet
        join as the least recently used; those no chain from a root reaches (their parent was
        lost) are queued for deletion. Returns how many joined."""
        known = self.entries
        joined = OrderedDict((h, k) for h, k in listed if h not in known)
        if not joined:
            return 0
        joined.update(known)
        reachable = self._reached_from_roots(joined)
        for block_hash in [h for h in joined if h not in reachable]:
            del joined[block_hash]
            self._queue_delete(block_hash)
        num_joined = sum(1 for block_hash in joined if block_hash not in known)
        self.entries = joined
        self.by_tenant, self.num_children, self._last_used, self._leaves = {}, {}, {}, {}
        for block_hash, key in joined.items():
            self.by_tenant.setdefault(_tenant_of(key), OrderedDict())[block_hash] = None
            self._count_child(key, 1)
        for tenant, owned in self.by_tenant.items():
            for block_hash in owned:
                self._used(block_hash, tenant)
        for tenant in list(self.by_tenant):
            quota = self.policies.get(tenant).store_quota_blocks
            while quota and self.num_entries_of(tenant) > quota:
                self._evict(self._least_recent_leaf(tenant) or next(iter(self.by_tenant[tenant])))
        self._evict_over_capacity()
        return num_joined

    def take_deletes(self) -> list[bytes]:
        deletes, self._deletes = self._deletes, []
        return deletes

    def _evict_over_capacity(self) -> None:
        capacity = self.capacity_blocks
        while capacity and len(self.entries) > capacity:
            tenant, _ = max(self.by_tenant.items(), key=lambda item: len(item[1]) / self.policies.get(item[0]).weight)
            # A tenant whose every entry is a parent (a shared prefix, continued in other
            # tenants' hashes) gives way to the least recent leaf of any tenant.
            victim = self._least_recent_leaf(tenant) or min(
                (leaf for leaf in map(self._least_recent_leaf, list(self.by_tenant)) if leaf),
                key=self._last_used.__getitem__, default=None)
            self._evict(victim or next(iter(self.entries)))

    def _least_recent_leaf(self, tenant: str) -> bytes | None:
        """The tenant's least recently used entry that no entry names as its parent (left in
        its heap), or None."""
        heap = self._leaves.get(tenant)
        while heap:
            used, block_hash = heap[0]
            if self._last_used.get(block_hash) == used and not self.num_children.get(block_hash):
                return block_hash
            heapq.heappop(heap)
        return None

    def _used(self, block_hash: bytes, tenant: str) -> None:
        self._clock += 1
        self._last_used[block_hash] = self._clock
        if not self.num_children.get(block_hash):
            self._push_leaf(block_hash, tenant)

    def _push_leaf(self, block_hash: bytes, tenant: str) -> None:
        heap = self._leaves.setdefault(tenant, [])
        heapq.heappush(heap, (self._last_used[block_hash], block_hash))
        if len(heap) > STALE_HEAP_FACTOR * len(self.by_tenant.get(tenant, ())) + 64:
            heap[:] = [(self._last_used[h], h) for h in self.by_tenant[tenant] if not self.num_children.get(h)]
            heapq.heapify(heap)

    def _count_child(self, block_key: bytes, delta: int) -> None:
        """One entry more (or fewer) names block_key's parent; a parent left with none is a leaf
        again, as recent as its own last use."""
        parent = block_key[:HASH_BYTES]
        count = self.num_children.get(parent, 0) + delta
        if count > 0:
            self.num_children[parent] = count
            return
        self.num_children.pop(parent, None)
        key = self.entries.get(parent)
        if key is not None:
            self._push_leaf(parent, _tenant_of(key))

    def _reachable(self, block_key: bytes) -> bool:
        parent = block_key[:HASH_BYTES]
        return parent in self.roots or parent in self.entries

    def _reached_from_roots(self, entries: dict[bytes, bytes]) -> set[bytes]:
        children: dict[bytes, list[bytes]] = {}
        for block_hash, key in entries.items():
            children.setdefault(key[:HASH_BYTES], []).append(block_hash)
        reached: set[bytes] = set()
        frontier = [h for root in self.roots for h in children.get(root, ())]
        while frontier:
            block_hash = frontier.pop()
            if block_hash not in reached:
                reached.add(block_hash)
                frontier.extend(children.get(block_hash, ()))
        return reached

    def _evict(self, block_hash: bytes) -> None:
        self.remove(block_hash)
        self.num_evictions += 1
        self._queue_delete(block_hash)

    def _queue_delete(self, block_hash: bytes) -> None:
        if len(self._deletes) < MAX_PENDING_DELETES:
            self._deletes.append(block_hash)


def _tenant_of(block_key: bytes) -> str:
    """The tenant (or shared namespace) whose hash an entry's block key carries; a key
    that does not parse (never written by kvserve) counts as the default tenant's."""
    try:
        return namespace_of_extra(split_key(block_key)[1])
    except (struct.error, UnicodeDecodeError):
        return DEFAULT_TENANT
