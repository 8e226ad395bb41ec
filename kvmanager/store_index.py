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
capacity; evicted hashes are queued for the executors to delete (``take_deletes``). Each
entry belongs to the tenant its block was hashed for (read from its key, so a rebuilt
index knows it too): a tenant over its ``store_quota_blocks`` evicts its own least
recently used entry, and when capacity forces an eviction and several tenants hold
entries, the victim is the tenant with the most entries per unit of weight
(``kvmanager.tenants``).
"""
from __future__ import annotations

import struct
from collections import OrderedDict
from collections.abc import Iterable

from kvmanager.hashing import DEFAULT_TENANT, namespace_of_extra, split_key
from kvmanager.tenants import TenantPolicies

# Deletes queued beyond this are dropped: the entries are unfindable already, and the
# executors' own store (or a later rebuild and eviction) reclaims them.
MAX_PENDING_DELETES = 1 << 16


class StoreIndex:
    """Entries of one (store, namespace): hash -> block key, least recently used first."""

    def __init__(self, store_url: str, namespace: str, medium: str, capacity_blocks: int = 0,
                 policies: TenantPolicies | None = None) -> None:
        self.store_url = store_url
        self.namespace = namespace
        self.medium = medium
        self.capacity_blocks = capacity_blocks  # 0: no limit
        self.entries: OrderedDict[bytes, bytes] = OrderedDict()
        self.saving: set[bytes] = set()  # saves ordered, not yet reported
        self._deletes: list[bytes] = []
        self.num_evictions = 0
        self.policies = policies if policies is not None else TenantPolicies()
        # Per tenant, its entries least recently used first (the same hashes as ``entries``).
        self.by_tenant: dict[str, OrderedDict[bytes, None]] = {}
        self.quota_evictions: dict[str, int] = {}

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
                self.entries.move_to_end(block_hash)
                self.by_tenant[_tenant_of(key)].move_to_end(block_hash)

    def wants(self, block_hash: bytes) -> bool:
        """Whether a save of this block is worth ordering (not held, not being saved)."""
        return block_hash not in self.entries and block_hash not in self.saving

    def add(self, block_hash: bytes, block_key: bytes) -> None:
        """A save was reported written whole: the entry is findable from now on."""
        self.saving.discard(block_hash)
        self.remove(block_hash)
        tenant = _tenant_of(block_key)
        quota = self.policies.get(tenant).store_quota_blocks
        owned = self.by_tenant.setdefault(tenant, OrderedDict())
        while quota and len(owned) >= quota:
            self._evict(next(iter(owned)))
            self.quota_evictions[tenant] = self.quota_evictions.get(tenant, 0) + 1
        self.entries[block_hash] = block_key
        owned[block_hash] = None
        self._evict_over_capacity()

    def remove(self, block_hash: bytes) -> bool:
        """A load missed: the entry is not findable any more. False when it was not."""
        key = self.entries.pop(block_hash, None)
        if key is None:
            return False
        tenant = _tenant_of(key)
        owned = self.by_tenant[tenant]
        del owned[block_hash]
        if not owned:
            del self.by_tenant[tenant]
        return True

    def rebuild(self, listed: Iterable[tuple[bytes, bytes]]) -> int:
        """Entries found in the store itself (a restarted kvmanager): those not known yet
        join as the least recently used. Returns how many joined."""
        known = self.entries
        joined = OrderedDict((h, k) for h, k in listed if h not in known)
        if not joined:
            return 0
        num_joined = len(joined)
        joined.update(known)
        self.entries = joined
        by_tenant: dict[str, OrderedDict[bytes, None]] = {}
        for block_hash, key in joined.items():
            by_tenant.setdefault(_tenant_of(key), OrderedDict())[block_hash] = None
        self.by_tenant = by_tenant
        for tenant, owned in list(by_tenant.items()):
            quota = self.policies.get(tenant).store_quota_blocks
            while quota and len(owned) > quota:
                self._evict(next(iter(owned)))
        self._evict_over_capacity()
        return num_joined

    def take_deletes(self) -> list[bytes]:
        deletes, self._deletes = self._deletes, []
        return deletes

    def _evict_over_capacity(self) -> None:
        capacity = self.capacity_blocks
        while capacity and len(self.entries) > capacity:
            if len(self.by_tenant) > 1:
                victim = max(self.by_tenant.items(), key=lambda item: len(item[1]) / self.policies.get(item[0]).weight)
                self._evict(next(iter(victim[1])))
            else:
                self._evict(next(iter(self.entries)))

    def _evict(self, block_hash: bytes) -> None:
        self.remove(block_hash)
        self.num_evictions += 1
        if len(self._deletes) < MAX_PENDING_DELETES:
            self._deletes.append(block_hash)


def _tenant_of(block_key: bytes) -> str:
    """The tenant (or shared namespace) whose hash an entry's block key carries; a key
    that does not parse (never written by kvserve) counts as the default tenant's."""
    try:
        return namespace_of_extra(split_key(block_key)[1])
    except (struct.error, UnicodeDecodeError):
        return DEFAULT_TENANT
