"""Tenants of one KV cache: their policies (weight, quotas) and, per pool, what each holds.

A tenant is a name the gateway resolves from the API key that authenticated a request
(``SequenceAllocation.tenant``); the default tenant is ``kvserve.prefix_hashes.DEFAULT_TENANT`` and
``prefix_hashes.SHARED_NAMESPACE`` holds the blocks of shareable ranges (a system prompt cached
once for everyone). Hashing keeps tenants apart (``prefix_hashes.BlockExtras``); this module
governs how much of the cache each may keep:

* **Quota** (``quota_blocks``, per pool; ``store_quota_blocks`` in each store): the most
  blocks findable under the tenant at once, in use or not, pinned included. A block the
  tenant would publish beyond it evicts the tenant's own least recently used free cached
  block; with none to evict it is not published (a quota refusal). Running sequences never
  wait on a quota: their blocks are allocated whatever the cache holds.
* **Weighted fair eviction**: when an allocation must evict a cached block and several
  tenants have some, the victim is the tenant holding the most cached blocks per unit of
  weight; within a tenant, least recently used first.

Cardinality is bounded: at most ``MAX_TENANTS`` names (a policy each), so metrics labelled
by tenant stay bounded too.
"""
from __future__ import annotations

import math
import re
from collections import OrderedDict
from dataclasses import dataclass

from kvserve.prefix_hashes import DEFAULT_TENANT, SHARED_NAMESPACE
from kvserve.errors import InvalidArgument, ResourceExhausted

MAX_TENANTS = 1024
MAX_WEIGHT = 1e6
TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def check_tenant_name(field: str, name: str) -> str:
    """A tenant name as the wire carries it ("" is the default tenant)."""
    if not name:
        return DEFAULT_TENANT
    if not TENANT_NAME.fullmatch(name):
        raise InvalidArgument(f"{field}: a tenant name is 1..64 characters of [A-Za-z0-9._-], starting with a "
                              f"letter or digit; got {name[:80]!r}")
    return name


@dataclass
class TenantPolicy:
    """Mutable in place: every pool's ledger of the tenant reads the same object."""

    weight: float = 1.0
    quota_blocks: int = 0  # per device pool; 0: no quota
    store_quota_blocks: int = 0  # per store; 0: no quota


class TenantPolicies:
    """The policy of every tenant kvmanager has seen or been told about."""

    def __init__(self) -> None:
        self._policies: dict[str, TenantPolicy] = {}

    def get(self, name: str) -> TenantPolicy:
        policy = self._policies.get(name)
        if policy is None:
            if len(self._policies) >= MAX_TENANTS:
                raise ResourceExhausted(f"tenant: at most {MAX_TENANTS} tenants; {name!r} would be one more")
            policy = self._policies[name] = TenantPolicy()
        return policy

    def names(self) -> list[str]:
        return sorted(self._policies)

    def set(self, name: str, weight: float, quota_blocks: int, store_quota_blocks: int) -> TenantPolicy:
        if not (math.isfinite(weight) and 0 < weight <= MAX_WEIGHT):
            raise InvalidArgument(f"weight: must be > 0 and <= {MAX_WEIGHT:g}, got {weight}")
        for field, value in (("quota_blocks", quota_blocks), ("store_quota_blocks", store_quota_blocks)):
            if value < 0:
                raise InvalidArgument(f"{field}: must be >= 0 (0: no quota), got {value}")
        policy = self.get(name)
        policy.weight, policy.quota_blocks, policy.store_quota_blocks = weight, quota_blocks, store_quota_blocks
        return policy

    def load(self, config: dict) -> None:
        """``{"tenants": {name: {"weight", "quota_blocks", "store_quota_blocks"}}}`` (kvmanager's
        ``--tenants`` file); unknown keys are errors, so that a typo is not a silent default."""
        tenants = config.get("tenants")
        if not isinstance(tenants, dict) or set(config) - {"tenants"}:
            raise InvalidArgument('tenants file: expected {"tenants": {"<name>": {"weight": ..., '
                                  '"quota_blocks": ..., "store_quota_blocks": ...}}}')
        for name, fields in tenants.items():
            check_tenant_name(f"tenants[{name!r}]", name)
            if not isinstance(fields, dict):
                raise InvalidArgument(f"tenants[{name!r}]: expected an object of weight / quota_blocks / "
                                      "store_quota_blocks")
            unknown = set(fields) - {"weight", "quota_blocks", "store_quota_blocks"}
            if unknown:
                raise InvalidArgument(f"tenants[{name!r}]: unknown field(s) {sorted(unknown)}")
            self.set(name, float(fields.get("weight", 1.0)), int(fields.get("quota_blocks", 0)),
                     int(fields.get("store_quota_blocks", 0)))


class TenantLedger:
    """One tenant's share of one pool: its cached blocks and its counters."""

    __slots__ = ("name", "policy", "num_cached", "num_pinned", "free_cached", "hits", "queries",
                 "evictions_caused", "evictions_suffered", "quota_refusals")

    def __init__(self, name: str, policy: TenantPolicy) -> None:
        self.name = name
        self.policy = policy
        self.num_cached = 0  # blocks findable under this tenant, used or free
        self.num_pinned = 0
        # The tenant's free cached blocks, least recently used first: block id -> block.
        self.free_cached: OrderedDict = OrderedDict()
        self.hits = 0  # prompt tokens found cached
        self.queries = 0  # prompt tokens looked up
        self.evictions_caused = 0
        self.evictions_suffered = 0
        self.quota_refusals = 0

    @property
    def share(self) -> float:
        """Cached blocks per unit of weight: the fair-eviction victim has the largest."""
        return self.num_cached / self.policy.weight

    def over_quota_by(self, extra: int = 0) -> int:
        quota = self.policy.quota_blocks
        return max(0, self.num_cached + extra - quota) if quota else 0


def is_reserved(name: str) -> bool:
    """Names a client may not take: the shared namespace."""
    return name == SHARED_NAMESPACE
