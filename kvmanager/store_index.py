"""The index of one KV store tier: which block hashes a store holds for one namespace.

A store (a directory, or a Redis server: ``kvserve.kv_store``) keeps KV blocks by their
chained prefix hash, within a namespace that the executors derive from everything that
makes their blocks byte-compatible (weights, dtypes, KV layout, block size). Every pool
(executor) that names the same store and namespace shares one ``StoreIndex``: a prefix
saved by one executor is a hit for all of them, and survives any executor's restart.

The rule that makes the device tier trustworthy holds here too: **an entry is findable
only once its save is reported written whole** (``add`` is called from the client's
``StoreReport``, never when the save is ordered), and a load that missed (absent, torn or
corrupt entry) is reported and removes it (``remove``). A hit is verified against the
entry's block key (parent hash, extra keys, tokens), as the pool's prefix cache does,
so a hash collision costs a miss, never another prompt's KV.

Eviction is LRU over entries (a hit refreshes one), bounded by the executors' declared
capacity; evicted hashes are queued for the executors to delete (``take_deletes``).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

# Deletes queued beyond this are dropped: the entries are unfindable already, and the
# executors' own store (or a later rebuild and eviction) reclaims them.
MAX_PENDING_DELETES = 1 << 16


class StoreIndex:
    """Entries of one (store, namespace): hash -> block key, least recently used first."""

    def __init__(self, store_url: str, namespace: str, medium: str, capacity_blocks: int = 0) -> None:
        self.store_url = store_url
        self.namespace = namespace
        self.medium = medium
        self.capacity_blocks = capacity_blocks  # 0: no limit
        self.entries: OrderedDict[bytes, bytes] = OrderedDict()
        self.saving: set[bytes] = set()  # saves ordered, not yet reported
        self._deletes: list[bytes] = []
        self.num_evictions = 0

    def __len__(self) -> int:
        return len(self.entries)

    def holds(self, block_hash: bytes, block_key: bytes) -> bool:
        """Whether a verified entry for this block is findable (changes nothing)."""
        return self.entries.get(block_hash) == block_key

    def touch(self, hashes: Iterable[bytes]) -> None:
        """Hits: these entries were just used, evict them last."""
        for block_hash in hashes:
            if block_hash in self.entries:
                self.entries.move_to_end(block_hash)

    def wants(self, block_hash: bytes) -> bool:
        """Whether a save of this block is worth ordering (not held, not being saved)."""
        return block_hash not in self.entries and block_hash not in self.saving

    def add(self, block_hash: bytes, block_key: bytes) -> None:
        """A save was reported written whole: the entry is findable from now on."""
        self.saving.discard(block_hash)
        self.entries[block_hash] = block_key
        self.entries.move_to_end(block_hash)
        self._evict_over_capacity()

    def remove(self, block_hash: bytes) -> bool:
        """A load missed: the entry is not findable any more. False when it was not."""
        return self.entries.pop(block_hash, None) is not None

    def rebuild(self, listed: Iterable[tuple[bytes, bytes]]) -> int:
        """Entries found in the store itself (a restarted kvmanager): those not known yet
        join as the least recently used. Returns how many joined."""
        known = self.entries
        joined = OrderedDict((h, k) for h, k in listed if h not in known)
        if joined:
            joined.update(known)
            self.entries = joined
            self._evict_over_capacity()
        return len(joined) - len(known) if joined else 0

    def take_deletes(self) -> list[bytes]:
        deletes, self._deletes = self._deletes, []
        return deletes

    def _evict_over_capacity(self) -> None:
        capacity = self.capacity_blocks
        while capacity and len(self.entries) > capacity:
            block_hash, _ = self.entries.popitem(last=False)
            self.num_evictions += 1
            if len(self._deletes) < MAX_PENDING_DELETES:
                self._deletes.append(block_hash)
