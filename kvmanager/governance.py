"""The admin side of tenants: policies, pins and per-tenant statistics, across pools.

``KVManager`` owns the pools and the policies; this is the one place that changes them on
an administrator's behalf (kvserve.v1.KVManager's ``SetTenantPolicy``, ``PinPrefix``,
``UnpinPrefix``) and reads them per tenant (``PoolStats.tenants``). Like every
``KVManager`` method, each call is validated in full before anything changes.
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from kvserve.prefix_hashes import DEFAULT_TENANT, SHARED_NAMESPACE, BlockExtras, chain_hashes, checked_pack_tokens
from kvmanager.pins import Pin
from kvmanager.pool import KVPool
from kvmanager.tenants import check_tenant_name
from kvserve.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted

# Pins may hold at most this share of a pool: running sequences keep the rest.
MAX_PINNED_SHARE = 0.5
MAX_PINS = 4096


@dataclass(frozen=True)
class PinnedPool:
    pool_id: str
    num_blocks: int  # full blocks of the prefix
    num_blocks_held: int  # of those, cached and held now


@dataclass(frozen=True)
class TenantStatsView:
    """``kvserve.v1.TenantStats``."""

    tenant: str
    weight: float
    quota_blocks: int
    store_quota_blocks: int
    num_cached_blocks: int
    num_pinned_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_evictions_caused: int
    num_evictions_suffered: int
    num_quota_refusals: int
    num_store_blocks: int
    num_store_quota_evictions: int


class Governance:
    def __init__(self, manager) -> None:
        self.manager = manager
        self._pin_ids = itertools.count(1)
        self.pin_pools: dict[int, list[str]] = {}  # pin id -> pools it pins in

    def set_policy(self, tenant: str, weight: float, quota_blocks: int, store_quota_blocks: int) -> None:
        """Sets a tenant's weight and quotas; a lowered quota takes effect at once (its LRU
        cached blocks stop being findable until it is within it)."""
        name = check_tenant_name("tenant", tenant)  # the shared namespace has a policy too
        self.manager.tenant_policies.set(name, weight, quota_blocks, store_quota_blocks)
        for pool in self.manager.pools.values():
            ledger = pool.block_pool.tenants.get(name)
            if ledger is not None:
                pool.block_pool.enforce_quota(ledger)
            self.manager.publish_events(pool)

    def pin(self, pool_ids: Sequence[str], tenant: str, token_ids: Sequence[int], shared: bool,
            cache_salt: str = "", adapter_id: str = "") -> tuple[int, list[PinnedPool]]:
        """Pins the full blocks of a prefix, as ``tenant`` (or in the shared namespace) hashes
        them, in the given pools (all when empty). Returns the pin id and, per pool, how many
        blocks it names and holds now (the rest are held once computed)."""
        name = SHARED_NAMESPACE if shared else self._tenant(tenant)
        packed = checked_pack_tokens(token_ids)
        if packed is None:
            raise InvalidArgument("token_ids: token ids must be 0..2^31-1")
        if len(self.pin_pools) >= MAX_PINS:
            raise ResourceExhausted(f"pins: at most {MAX_PINS}; unpin one first")
        pools = self._pools(pool_ids)
        plans = []
        for pool in pools:
            bs = pool.block_size
            num_blocks = len(token_ids) // bs
            if not num_blocks:
                raise InvalidArgument(f"token_ids: {len(token_ids)} tokens fill no block of pool "
                                      f"{pool.config.pool_id!r} (block size {bs}); a pin holds full blocks")
            usable = pool.block_pool.num_blocks - 1
            if num_blocks > usable:
                raise InvalidArgument(f"token_ids: {num_blocks} blocks is larger than pool {pool.config.pool_id!r} "
                                      f"({usable} blocks)")
            if pool.pins.num_pinned_blocks + num_blocks > MAX_PINNED_SHARE * usable:
                raise FailedPrecondition(
                    f"pool {pool.config.pool_id!r}: pins would hold {pool.pins.num_pinned_blocks + num_blocks} of its "
                    f"{usable} blocks; at most {MAX_PINNED_SHARE:.0%} may be pinned")
            ledger = pool.block_pool.ledger(name)
            quota = ledger.policy.quota_blocks
            pinned = pool.pins.pinned_blocks_of(ledger)
            if quota and pinned + num_blocks > quota:
                raise ResourceExhausted(f"tenant {name!r}: pins would hold {pinned + num_blocks} blocks in pool "
                                        f"{pool.config.pool_id!r}, over its quota of {quota}")
            extras = BlockExtras(cache_salt, adapter_id, name)
            plans.append((pool, ledger, chain_hashes(pool.root_hash, extras, packed, bs, num_blocks)))
        pin_id = next(self._pin_ids)
        pinned_pools = []
        for pool, ledger, hashes in plans:
            pin = Pin(pin_id, ledger, hashes)
            pool.pins.add(pin)
            pinned_pools.append(PinnedPool(pool.config.pool_id, len(hashes), len(pin.held)))
        self.pin_pools[pin_id] = [pool.config.pool_id for pool, _, _ in plans]
        return pin_id, pinned_pools

    def pin_status(self, pin_id: int) -> list[PinnedPool]:
        """Per pool of the pin: blocks named, blocks held now."""
        status = []
        for pool_id in self._pin(pin_id):
            pool = self.manager.pools.get(pool_id)
            pin = pool.pins.pins.get(pin_id) if pool is not None else None
            if pin is not None:
                status.append(PinnedPool(pool_id, len(pin.hashes), len(pin.held)))
        return status

    def unpin(self, pin_id: int) -> int:
        """Releases a pin everywhere; returns how many blocks it held (now evictable)."""
        pools = self._pin(pin_id)
        del self.pin_pools[pin_id]
        num_released = 0
        for pool_id in pools:
            pool = self.manager.pools.get(pool_id)
            if pool is not None and pin_id in pool.pins.pins:
                num_released += pool.pins.remove(pin_id)
        return num_released

    def tenant_stats(self, pool: KVPool) -> list[TenantStatsView]:
        store = pool.store
        names = set(pool.block_pool.tenants)
        if store is not None:
            names.update(store.by_tenant)
        views = []
        for name in sorted(names):
            ledger = pool.block_pool.ledger(name)
            policy = ledger.policy
            views.append(TenantStatsView(
                tenant=name, weight=policy.weight, quota_blocks=policy.quota_blocks,
                store_quota_blocks=policy.store_quota_blocks, num_cached_blocks=ledger.num_cached,
                num_pinned_blocks=ledger.num_pinned, prefix_cache_queries=ledger.queries,
                prefix_cache_hits=ledger.hits, num_evictions_caused=ledger.evictions_caused,
                num_evictions_suffered=ledger.evictions_suffered, num_quota_refusals=ledger.quota_refusals,
                num_store_blocks=store.num_entries_of(name) if store is not None else 0,
                num_store_quota_evictions=store.quota_evictions.get(name, 0) if store is not None else 0))
        return views

    def _pools(self, pool_ids: Sequence[str]) -> list[KVPool]:
        if pool_ids:
            return [self.manager.pool(pool_id) for pool_id in dict.fromkeys(pool_ids)]
        if not self.manager.pools:
            raise FailedPrecondition("no pool is registered yet: start an executor first")
        return [self.manager.pools[pool_id] for pool_id in sorted(self.manager.pools)]

    def _pin(self, pin_id: int) -> list[str]:
        pools = self.pin_pools.get(pin_id)
        if pools is None:
            raise NotFound(f"pin_id: no pin {pin_id}")
        return pools

    @staticmethod
    def _tenant(tenant: str) -> str:
        name = check_tenant_name("tenant", tenant)
        if name == SHARED_NAMESPACE:
            raise InvalidArgument(f"tenant: {SHARED_NAMESPACE!r} is the shared namespace, not a tenant; "
                                  "pin with shared=true")
        return name or DEFAULT_TENANT
