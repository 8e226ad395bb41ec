"""The KV manager: several pools (one per executor), client sessions, validation.

Every public method is one RPC's worth of work and is atomic with respect to
the others (the server calls them from one event-loop thread, and none of them
awaits). Input is validated completely before anything changes, so a malformed
request never leaves a half-applied batch. Errors are ``kvserve.errors`` types;
the server maps them to status codes.
"""
from __future__ import annotations

import dataclasses
import gc
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from kvmanager.events import (
    DEFAULT_EVENT_BUFFER, DEFAULT_MEDIUM, AllBlocksCleared, BlockRemoved, EventBatch, EventHub, Subscriber,
)
from kvmanager.governance import Governance, TenantStatsView
from kvserve.prefix_hashes import HASH_BYTES, BlockExtras, checked_pack_tokens, root_hash
from kvmanager.pool import (
    SAVE_POLICIES, AllocationPolicy, AllocationRequest, KVSequence, PoolConfig, KVPool,
    StepAllocation, match_cached_prefix, snapshot_events,
)
from kvmanager.sessions import Session, SessionRegistry
from kvmanager.store_index import StoreIndex
from kvmanager.tenants import TenantPolicies, check_tenant_name
from kvserve.errors import (
    AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, PermissionDenied, ResourceExhausted,
)
from kvserve.kv_store import describe_url as describe_store_url
from kvserve.store_orders import StoreOrders
from kvserve.logs import get_logger

log = get_logger("kvmanager")

# Upper bounds that only catch nonsense: 4M blocks x 256 tokens is far beyond any
# device today, and each block costs ~150 bytes of host memory here.
MAX_NUM_BLOCKS = 1 << 22
MAX_BLOCK_SIZE = 256
MAX_MODEL_LEN = 1 << 24
MAX_TTL_MS = 24 * 3600 * 1000
MAX_TOKEN_ID = (1 << 31) - 1
MAX_SEQ_ID = (1 << 64) - 1
# What one client may ask for at once: n > 1024 choices is not a use case, and
# each live sequence costs host memory whether or not it holds blocks.
MAX_FORK_CHILDREN = 1024
MAX_SEQUENCES_PER_POOL = 1 << 17
MAX_LOOKAHEAD_SLOTS = 256
MAX_PREFIX_QUERIES = 1024
MAX_MEDIUM_LEN = 64
MAX_STORE_URL_LEN = 4096
MAX_STORE_REPORT = 1 << 17  # hashes in one StoreReport field
MAX_CACHE_TTL_MS = 7 * 24 * 3600 * 1000  # a week: longer is a pin's job
# A snapshot is sent in batches of about this many tokens (~0.3 MB of protobuf): far
# below gRPC's default 4 MB message limit, and the event loop is free between batches.
SNAPSHOT_BATCH_TOKENS = 1 << 16

# Called with every numbered batch of every pool (the ZeroMQ publisher is one).
EventSink = Callable[[EventBatch], None]


@dataclass(slots=True)
class PoolStatsView:
    """Field names match ``kvserve.v1.PoolStats``."""

    pool_id: str
    num_blocks: int
    block_size: int
    num_free_blocks: int
    num_used_blocks: int
    num_cached_blocks: int
    usage: float
    num_sequences: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_evictions: int
    num_copies: int
    num_stored_tokens: int
    num_allocated_slots: int
    allocation_policy: int
    enable_prefix_caching: bool
    num_sessions: int
    kv_store: str = ""
    kv_store_medium: str = ""
    num_store_blocks: int = 0
    store_hits: int = 0
    num_store_saves: int = 0
    num_store_save_failures: int = 0
    num_store_load_failures: int = 0
    num_store_evictions: int = 0
    num_expired_blocks: int = 0
    num_pins: int = 0
    tenants: list[TenantStatsView] = dataclasses.field(default_factory=list)


@dataclass(frozen=True)
class StoreConfig:
    """A pool's store tier, as its executor describes it (RegisterPool's kv_store fields)."""

    url: str = ""
    namespace: str = ""
    capacity_blocks: int = 0
    medium: str = ""


def validate_pool_config(config: PoolConfig) -> PoolConfig:
    """Checks a RegisterPool's fields; returns the config with the policy normalized."""
    if not config.pool_id:
        raise InvalidArgument("pool_id: must not be empty")
    if not 2 <= config.num_blocks <= MAX_NUM_BLOCKS:
        raise InvalidArgument(f"num_blocks: must be 2..{MAX_NUM_BLOCKS} (block 0 is reserved), got {config.num_blocks}")
    bs = config.block_size
    if not 1 <= bs <= MAX_BLOCK_SIZE or bs & (bs - 1):
        raise InvalidArgument(f"block_size: must be a power of two from 1 to {MAX_BLOCK_SIZE}, got {bs}")
    if not 0 <= config.max_model_len <= MAX_MODEL_LEN:
        raise InvalidArgument(f"max_model_len: must be 0..{MAX_MODEL_LEN}, got {config.max_model_len}")
    policy = config.allocation_policy or AllocationPolicy.PAGED  # UNSPECIFIED (0) = PAGED
    try:
        policy = AllocationPolicy(policy)
    except ValueError:
        raise InvalidArgument(f"allocation_policy: unknown value {config.allocation_policy}") from None
    if policy is AllocationPolicy.RESERVE and config.max_model_len == 0:
        raise InvalidArgument("max_model_len: the RESERVE policy needs max_model_len > 0")
    return PoolConfig(config.pool_id, config.num_blocks, bs, config.model_fingerprint,
                      bool(config.enable_prefix_caching), policy, config.max_model_len)


def _tokens_in_range(tokens: Sequence[int]) -> bool:
    """All ids in 0..MAX_TOKEN_ID. A protobuf repeated field is read through numpy
    (min/max over one costs ~0.1 us a token in Python)."""
    if type(tokens) is not list and hasattr(tokens, "__array__"):
        array = np.asarray(tokens)
        return not array.size or (array.min() >= 0 and array.max() <= MAX_TOKEN_ID)
    return min(tokens) >= 0 and max(tokens) <= MAX_TOKEN_ID


def _check_seq_id(field: str, seq_id: int) -> None:
    if not 0 <= seq_id <= MAX_SEQ_ID:
        raise InvalidArgument(f"{field}: must be 0..2^64-1, got {seq_id}")


class KVManager:
    def __init__(self, default_session_ttl_ms: int = 30_000, clock: Callable[[], float] = time.monotonic,
                 freeze_gc: bool = False, event_buffer_size: int = DEFAULT_EVENT_BUFFER,
                 default_medium: str = DEFAULT_MEDIUM, store_save_policy: str = "all"):
        """``freeze_gc`` (the server sets it): after a pool is created, move every
        object alive into the cyclic GC's permanent generation. A pool's blocks live
        as long as the pool, and one full GC pass over a million of them stalls the
        event loop for ~0.2 s in the middle of some Allocate.
        ``event_buffer_size``: events each pool keeps for ``watch`` to replay (0: none).
        ``default_medium``: the KV events' medium of a pool registered without one.
        ``store_save_policy``: when published blocks are saved to a pool's store
        (``pool.SAVE_POLICIES``)."""
        if not 0 < default_session_ttl_ms <= MAX_TTL_MS:
            raise InvalidArgument(f"default_session_ttl_ms: must be 1..{MAX_TTL_MS}")
        if event_buffer_size < 0:
            raise InvalidArgument(f"event_buffer_size: must be >= 0, got {event_buffer_size}")
        if store_save_policy not in SAVE_POLICIES:
            raise InvalidArgument(f"store_save_policy: one of {', '.join(SAVE_POLICIES)}, got {store_save_policy!r}")
        self.store_save_policy = store_save_policy
        # The store tier: one index per (store URL, namespace), shared by the pools naming it.
        self.stores: dict[tuple[str, str], StoreIndex] = {}
        self._new_stores: list[StoreIndex] = []  # for the server to rebuild from the store itself

        self.default_session_ttl_ms = default_session_ttl_ms
        self.freeze_gc = freeze_gc
        self.event_buffer_size = event_buffer_size
        self.default_medium = default_medium
        self.pools: dict[str, KVPool] = {}
        self.sessions = SessionRegistry(clock)
        self.hubs: dict[str, EventHub] = {}
        self.event_sinks: list[EventSink] = []
        self.clock = clock
        self.tenant_policies = TenantPolicies()
        self.governance = Governance(self)

    # -- pools ---------------------------------------------------------------

    def register_pool(self, config: PoolConfig, executor_instance_id: str = "", medium: str = "",
                      store: StoreConfig = StoreConfig()) -> bool:
        """Creates a pool, keeps an identical one (False), or replaces an idle one.
        An identical pool registered for a new executor instance (the executor
        restarted: its KV is gone) is kept with its prefix cache invalidated. An executor
        instance that another pool already names is refused (FAILED_PRECONDITION).
        ``medium`` (where the KV lives, for KV events) is not a pool parameter: a new one
        is recorded, nothing else changes; empty keeps the pool's (a new pool's: the default).
        ``store`` (the executor's KV store, if any) attaches the pool to that store's index."""
        config = validate_pool_config(config)
        if len(medium) > MAX_MEDIUM_LEN:
            raise InvalidArgument(f"medium: at most {MAX_MEDIUM_LEN} characters")
        self._validate_store(store)
        if executor_instance_id:
            for other_id, other in self.pools.items():
                if other_id != config.pool_id and other.executor_instance_id == executor_instance_id:
                    raise FailedPrecondition(
                        f"executor instance {executor_instance_id} already has the pool {other_id!r}: one executor's "
                        f"KV cache is one pool (two would hand out its blocks twice); register {other_id!r}, e.g. "
                        "by naming the executor by the same address in every gateway")
        existing = self.pools.get(config.pool_id)
        if existing is not None:
            if existing.config == config:
                existing.medium = medium or existing.medium
                if executor_instance_id and executor_instance_id != existing.executor_instance_id:
                    self._invalidate(existing, reason="executor_restarted",
                                     previous=existing.executor_instance_id, current=executor_instance_id)
                    existing.executor_instance_id = executor_instance_id
                self._attach_store(existing, store)
                return False
            if existing.block_pool.num_used_blocks:
                raise FailedPrecondition(
                    f"pool {config.pool_id!r} has {existing.block_pool.num_used_blocks} blocks in use "
                    "and different parameters; free them before re-registering"
                )
            self._emit(config.pool_id, [AllBlocksCleared()], existing.medium)
            existing.block_pool.unlink()
        pool = self.pools[config.pool_id] = KVPool(config, self.tenant_policies, self.clock)
        pool.executor_instance_id = executor_instance_id
        pool.medium = medium or self.default_medium
        pool.save_policy = self.store_save_policy
        self._attach_store(pool, store)
        self._hub(config.pool_id)  # numbering starts with the pool (and survives its replacement)
        if self.freeze_gc:
            gc.collect()
            gc.freeze()
        log.info("pool_registered", pool_id=config.pool_id, num_blocks=config.num_blocks,
                 block_size=config.block_size, policy=config.allocation_policy.name,
                 prefix_caching=config.enable_prefix_caching, replaced=existing is not None)
        return True

    @staticmethod
    def _validate_store(store: StoreConfig) -> None:
        if not store.url:
            return
        if len(store.url) > MAX_STORE_URL_LEN:
            raise InvalidArgument(f"kv_store: at most {MAX_STORE_URL_LEN} characters")
        namespace = store.namespace
        if not namespace or len(namespace) > 128 or not all(c.isalnum() or c in "_.-" for c in namespace):
            raise InvalidArgument("kv_store_namespace: 1..128 characters of [0-9A-Za-z_.-], required with kv_store")
        if len(store.medium) > MAX_MEDIUM_LEN:
            raise InvalidArgument(f"kv_store medium: at most {MAX_MEDIUM_LEN} characters")

    def _attach_store(self, pool: KVPool, store: StoreConfig) -> None:
        """Points the pool at the index of its executor's store (shared by every pool naming
        the same store and namespace), or at none. A store seen for the first time is queued
        for ``take_new_stores``: the server lists what it already holds."""
        if not store.url:
            if pool.store is not None:
                pool.release_saves()
            pool.store = None
            return
        key = (store.url, store.namespace)
        index = self.stores.get(key)
        if index is None:
            index = self.stores[key] = StoreIndex(store.url, store.namespace, store.medium, store.capacity_blocks,
                                                  self.tenant_policies)
            self._new_stores.append(index)
            log.info("kv_store_attached", pool_id=pool.config.pool_id, namespace=store.namespace,
                     capacity_blocks=store.capacity_blocks, medium=store.medium)
        elif store.capacity_blocks:
            index.capacity_blocks = store.capacity_blocks
        index.roots.add(pool.root_hash)
        if pool.store is not None and pool.store is not index:
            pool.release_saves()
        pool.store = index

    def take_new_stores(self) -> list[StoreIndex]:
        """Store indexes created since the last call: the server fills them from the store."""
        stores, self._new_stores = self._new_stores, []
        return stores

    def rebuild_store(self, index: StoreIndex, entries) -> int:
        """Adds what the store itself holds ((hash, block key) pairs) to its index; returns how many joined."""
        joined = index.rebuild(entries)
        log.info("kv_store_index_rebuilt", namespace=index.namespace, joined=joined, entries=len(index))
        return joined

    def pool(self, pool_id: str) -> KVPool:
        if not pool_id:
            raise InvalidArgument("pool_id: must not be empty")
        pool = self.pools.get(pool_id)
        if pool is None:
            raise NotFound(f"pool_id: unknown pool {pool_id!r}")
        return pool

    def stats(self, pool_id: str) -> PoolStatsView:
        self.reap_expired()
        pool = self.pool(pool_id)
        blocks = pool.block_pool
        blocks.expire(self.clock())
        return PoolStatsView(
            pool_id=pool_id, num_blocks=blocks.num_blocks, block_size=blocks.block_size,
            num_free_blocks=blocks.num_free_blocks, num_used_blocks=blocks.num_used_blocks,
            num_cached_blocks=blocks.num_cached_free_blocks, usage=blocks.usage,
            num_sequences=len(pool.sequences), prefix_cache_queries=pool.prefix_cache_queries,
            prefix_cache_hits=pool.prefix_cache_hits, num_evictions=blocks.num_evictions,
            num_copies=pool.num_copies, num_stored_tokens=blocks.num_stored_tokens,
            num_allocated_slots=blocks.num_used_blocks * blocks.block_size,
            allocation_policy=int(pool.config.allocation_policy),
            enable_prefix_caching=pool.config.enable_prefix_caching,
            num_sessions=self.sessions.count_for_pool(pool_id),
            num_expired_blocks=blocks.num_expired, num_pins=len(pool.pins.pins),
            tenants=self.governance.tenant_stats(pool),
            **self._store_stats(pool),
        )

    @staticmethod
    def _store_stats(pool: KVPool) -> dict:
        store = pool.store
        if store is None:
            return {}
        return dict(kv_store=describe_store_url(store.store_url), kv_store_medium=store.medium,
                    num_store_blocks=len(store), store_hits=pool.store_hits, num_store_saves=pool.num_store_saves,
                    num_store_save_failures=pool.num_store_save_failures,
                    num_store_load_failures=pool.num_store_load_failures, num_store_evictions=store.num_evictions)

    def reset_prefix_cache(self, pool_id: str) -> int:
        """Makes nothing in the pool findable, blocks in use included; returns how many were."""
        self.reap_expired()
        return self._invalidate(self.pool(pool_id), reason="reset_requested")

    def _invalidate(self, pool: KVPool, reason: str, **details) -> int:
        num_cleared = pool.invalidate_prefix_cache()
        self._publish(pool)
        log.info("prefix_cache_invalidated", pool_id=pool.config.pool_id, reason=reason,
                 num_blocks_cleared=num_cleared, num_live_sequences=len(pool.sequences), **details)
        return num_cleared

    # -- sessions -----------------------------------------------------------

    def open_session(self, pool_id: str, ttl_ms: int = 0, client_name: str = "") -> Session:
        self.reap_expired()
        self.pool(pool_id)
        if not 0 <= ttl_ms <= MAX_TTL_MS:
            raise InvalidArgument(f"ttl_ms: must be 0..{MAX_TTL_MS}, got {ttl_ms}")
        session = self.sessions.open(pool_id, ttl_ms or self.default_session_ttl_ms, client_name)
        log.info("session_opened", session_id=session.session_id, pool_id=pool_id,
                 ttl_ms=session.ttl_ms, client=client_name)
        return session

    def renew_session(self, session_id: str) -> int:
        """Extends the lease; returns milliseconds until it expires."""
        self.reap_expired()
        session = self._session(session_id)
        self.sessions.renew(session)
        return session.ttl_ms

    def close_session(self, session_id: str) -> int:
        """Frees the session's sequences; returns how many."""
        self.reap_expired()
        session = self._session(session_id)
        self.sessions.remove(session_id)
        num_freed = self._free_session_sequences(session)
        log.info("session_closed", session_id=session_id, sequences_freed=num_freed)
        return num_freed

    def reap_expired(self) -> int:
        """Frees the sequences of every session whose lease ran out; returns how many sessions."""
        expired = self.sessions.pop_expired()
        for session in expired:
            num_freed = self._free_session_sequences(session)
            log.warning("session_expired", session_id=session.session_id, pool_id=session.pool_id,
                        client=session.client_name, sequences_freed=num_freed)
        return len(expired)

    def _free_session_sequences(self, session: Session) -> int:
        pool = self.pools.get(session.pool_id)
        if pool is None:
            return 0
        num_freed = pool.free_session(session.session_id)
        self._publish(pool)
        return num_freed

    def _session(self, session_id: str) -> Session:
        if not session_id:
            raise InvalidArgument("session_id: must not be empty")
        return self.sessions.get(session_id)

    def _pool_and_session(self, pool_id: str, session_id: str) -> tuple[KVPool, Session]:
        """The pool and the caller's live session on it; using it renews its lease."""
        self.reap_expired()
        pool = self.pool(pool_id)
        session = self._session(session_id)
        if session.pool_id != pool_id:
            raise InvalidArgument(f"session_id: session belongs to pool {session.pool_id!r}, not {pool_id!r}")
        self.sessions.renew(session)
        return pool, session

    # -- sequences -------------------------------------------------------------

    def allocate(self, pool_id: str, session_id: str, free_seq_ids: Iterable[int],
                 requests: Sequence[AllocationRequest], written_seq_ids: Sequence[int] = (),
                 written_num_tokens: Sequence[int] = (), store_report=None) -> tuple[list[StepAllocation], float]:
        """One scheduler step: the store report, written-KV reports, piggybacked frees, then
        each sequence in order. Returns the per-sequence results and the pool's usage
        afterwards; the store orders it gave rise to wait in ``take_store_orders``.
        ``requests`` may be any objects with ``AllocationRequest``'s attributes, and
        ``store_report`` one with ``StoreReport``'s."""
        pool, session = self._pool_and_session(pool_id, session_id)
        report = self._check_store_report(store_report)
        sequences = pool.sequences
        written = self._check_written(pool, session_id, written_seq_ids, written_num_tokens)
        to_free = []
        for seq_id in free_seq_ids:
            seq = sequences.get(seq_id)
            if seq is not None:  # unknown ids are ignored here, unlike Free
                if seq.session_id != session_id:
                    raise PermissionDenied(f"free_seq_ids: sequence {seq_id} belongs to another session")
                to_free.append(seq_id)
        freeing = set(to_free)
        seen: set[int] = set()
        max_len = pool.config.max_model_len
        num_admitted = 0
        # (existing sequence or None, request): validated in full before any change.
        plan = []
        for i, request in enumerate(requests):
            seq_id = request.seq_id
            if seq_id in seen or not 0 <= seq_id <= MAX_SEQ_ID:
                _check_seq_id(f"sequences[{i}].seq_id", seq_id)
                raise InvalidArgument(f"sequences[{i}].seq_id: {seq_id} appears twice in one step")
            seen.add(seq_id)
            tokens = request.token_ids
            num_tokens = len(tokens)
            if num_tokens == 1:  # a decode step: skip min/max, slow on protobuf containers
                if not 0 <= tokens[0] <= MAX_TOKEN_ID:
                    raise InvalidArgument(f"sequences[{i}].token_ids: token ids must be 0..{MAX_TOKEN_ID}")
            elif num_tokens and not _tokens_in_range(tokens):
                raise InvalidArgument(f"sequences[{i}].token_ids: token ids must be 0..{MAX_TOKEN_ID}")
            if request.num_new_tokens < 0:
                raise InvalidArgument(f"sequences[{i}].num_new_tokens: must be >= 0")
            if not 0 <= request.num_lookahead_slots <= MAX_LOOKAHEAD_SLOTS:
                raise InvalidArgument(f"sequences[{i}].num_lookahead_slots: must be 0..{MAX_LOOKAHEAD_SLOTS}")
            seq = sequences.get(seq_id)
            if seq is not None and (freeing and seq_id in freeing):
                seq = None  # freed first, then admitted afresh
            elif seq is not None and seq.session_id != session_id:
                raise PermissionDenied(f"sequences[{i}].seq_id: sequence {seq_id} belongs to another session")
            num_precomputed = getattr(request, "num_precomputed_tokens", 0)
            if num_precomputed:
                self._check_precomputed(i, seq, num_precomputed, num_tokens, pool.block_size)
            if max_len and num_tokens + (len(seq.token_ids) if seq is not None else 0) > max_len:
                raise InvalidArgument(f"sequences[{i}].token_ids: sequence {seq_id} would hold more than the "
                                      f"pool's max_model_len of {max_len} tokens")
            if seq is None:
                num_admitted += 1
                self._check_cache_terms(i, request, num_tokens)
            plan.append((seq, tokens, request))
        if num_admitted and len(sequences) - len(freeing) + num_admitted > MAX_SEQUENCES_PER_POOL:
            raise ResourceExhausted(f"sequences: the pool holds at most {MAX_SEQUENCES_PER_POOL} live sequences")

        self._apply_store_report(pool, session_id, report)
        for seq, num_tokens in written:
            pool.report_written(seq, num_tokens)
        for seq_id in dict.fromkeys(to_free):
            pool.free(seq_id)
        results = [pool.step(seq, tokens, request.num_new_tokens, request.num_lookahead_slots,
                             getattr(request, "num_precomputed_tokens", 0)) if seq is not None
                   else pool.admit(session_id, request) for seq, tokens, request in plan]
        self._publish(pool)
        return results, pool.block_pool.usage

    @staticmethod
    def _check_precomputed(i: int, seq: KVSequence | None, n: int, num_tokens: int, block_size: int) -> None:
        """Accepted drafts may only be counted computed where their KV can be: in slots right after
        a fully computed sequence's tokens, that it holds, alone (a shared block's slots were not
        its to write)."""
        where = f"sequences[{i}].num_precomputed_tokens"
        if seq is None:
            raise InvalidArgument(f"{where}: only an existing sequence has slots with KV written ahead")
        if n > num_tokens:
            raise InvalidArgument(f"{where}: {n} is more than the {num_tokens} token_ids sent")
        if seq.num_computed != len(seq.token_ids):
            raise InvalidArgument(f"{where}: sequence {seq.seq_id} has {len(seq.token_ids) - seq.num_computed} "
                                  "known tokens still to compute; precomputed tokens follow computed ones")
        start, end = seq.num_computed, seq.num_computed + n
        if end > len(seq.block_table) * block_size:
            raise InvalidArgument(f"{where}: positions {start}..{end - 1} are not all in the "
                                  f"{len(seq.block_table)} blocks sequence {seq.seq_id} holds")
        if any(seq.block_table[b].ref_cnt > 1 for b in range(start // block_size, -(-end // block_size))):
            raise InvalidArgument(f"{where}: positions {start}..{end - 1} lie in a block sequence {seq.seq_id} "
                                  "shares with another sequence")

    def _check_cache_terms(self, i: int, request, num_tokens: int) -> None:
        """A new sequence's tenant, shareable range, TTL and priority (read at creation only)."""
        tenant = getattr(request, "tenant", "")
        if tenant:
            check_tenant_name(f"sequences[{i}].tenant", tenant)
            self.tenant_policies.get(tenant)  # RESOURCE_EXHAUSTED past MAX_TENANTS, before any change
        if not 0 <= getattr(request, "num_shared_tokens", 0) <= num_tokens:
            raise InvalidArgument(f"sequences[{i}].num_shared_tokens: must be 0..len(token_ids) ({num_tokens})")
        if not 0 <= getattr(request, "cache_ttl_ms", 0) <= MAX_CACHE_TTL_MS:
            raise InvalidArgument(f"sequences[{i}].cache_ttl_ms: must be 0 (none) .. {MAX_CACHE_TTL_MS} (a week); "
                                  "pin what must stay longer")
        if getattr(request, "cache_priority", 0) not in (0, 1):
            raise InvalidArgument(f"sequences[{i}].cache_priority: CACHE_PRIORITY_UNSPECIFIED or CACHE_PRIORITY_LOW")

    def fork(self, pool_id: str, session_id: str, parent_seq_id: int, child_seq_ids: list[int]) -> list[int]:
        """Children share the parent's blocks; returns the shared block table."""
        pool, _ = self._pool_and_session(pool_id, session_id)
        parent = self._own_sequence(pool, session_id, parent_seq_id, "parent_seq_id")
        if not child_seq_ids:
            raise InvalidArgument("child_seq_ids: must not be empty")
        if len(child_seq_ids) > MAX_FORK_CHILDREN:
            raise InvalidArgument(f"child_seq_ids: at most {MAX_FORK_CHILDREN} children, got {len(child_seq_ids)}")
        if len(pool.sequences) + len(child_seq_ids) > MAX_SEQUENCES_PER_POOL:
            raise ResourceExhausted(f"child_seq_ids: the pool holds at most {MAX_SEQUENCES_PER_POOL} live sequences")
        if len(set(child_seq_ids)) != len(child_seq_ids):
            raise InvalidArgument("child_seq_ids: duplicate ids")
        for child_id in child_seq_ids:
            _check_seq_id("child_seq_ids", child_id)
            if child_id in pool.sequences:
                raise AlreadyExists(f"child_seq_ids: sequence {child_id} already exists")
        return pool.fork(parent, child_seq_ids)

    def free(self, pool_id: str, session_id: str, seq_ids: Iterable[int], written_seq_ids: Sequence[int] = (),
             written_num_tokens: Sequence[int] = (), store_report=None) -> int:
        """Applies the store report and written-KV reports, then frees sequences (all or
        none); returns blocks whose refcount reached 0. Store orders: ``take_store_orders``."""
        pool, _ = self._pool_and_session(pool_id, session_id)
        report = self._check_store_report(store_report)
        written = self._check_written(pool, session_id, written_seq_ids, written_num_tokens)
        unique = list(dict.fromkeys(seq_ids))
        for seq_id in unique:
            self._own_sequence(pool, session_id, seq_id, "seq_ids")
        self._apply_store_report(pool, session_id, report)
        for seq, num_tokens in written:
            pool.report_written(seq, num_tokens)
        num_blocks_freed = sum(pool.free(seq_id) for seq_id in unique)
        self._publish(pool)
        return num_blocks_freed

    def _check_written(self, pool: KVPool, session_id: str, seq_ids: Sequence[int],
                       num_tokens: Sequence[int]) -> list[tuple[KVSequence, int]]:
        """Validates written-KV reports; returns (sequence, tokens written) pairs."""
        if len(seq_ids) != len(num_tokens):
            raise InvalidArgument(f"written_num_tokens: {len(num_tokens)} entries for "
                                  f"{len(seq_ids)} written_seq_ids")
        written = []
        for i, (seq_id, n) in enumerate(zip(seq_ids, num_tokens)):
            seq = self._own_sequence(pool, session_id, seq_id, f"written_seq_ids[{i}]")
            if not 0 <= n <= seq.num_computed:
                raise InvalidArgument(f"written_num_tokens[{i}]: sequence {seq_id} has {seq.num_computed} "
                                      f"tokens allocated, cannot have {n} written")
            written.append((seq, n))
        return written

    # -- the store tier ------------------------------------------------------------

    @staticmethod
    def _check_store_report(report) -> tuple[list[bytes], list[bytes], list[bytes]]:
        """(saved, failed, missing) hashes of a StoreReport-like object (None: nothing)."""
        if report is None:
            return [], [], []
        fields = []
        for name in ("saved_hashes", "failed_hashes", "missing_hashes"):
            hashes = list(getattr(report, name, ()))
            if len(hashes) > MAX_STORE_REPORT:
                raise InvalidArgument(f"store_report.{name}: at most {MAX_STORE_REPORT} hashes")
            if any(len(h) != HASH_BYTES for h in hashes):
                raise InvalidArgument(f"store_report.{name}: each hash is {HASH_BYTES} bytes")
            fields.append(hashes)
        return fields[0], fields[1], fields[2]

    def _apply_store_report(self, pool: KVPool, session_id: str, report) -> None:
        """Saves written whole become findable, failed ones never do, and loads that missed
        stop being findable. Hashes of orders this session no longer has (the pool was
        invalidated, or the order went with an earlier session) are ignored."""
        saved, failed, missing = report
        events = pool.store_events(pool.report_saves(session_id, saved, failed))
        if missing and pool.store is not None:
            removed = [block_hash for block_hash in missing if pool.store.remove(block_hash)]
            pool.num_store_load_failures += len(missing)
            if removed:
                events.append(BlockRemoved(removed))
            log.warning("kv_store_loads_missed", pool_id=pool.config.pool_id, num_hashes=len(missing))
        if events:  # the store tier's changes, in the pool's event stream with the store's medium
            self._emit(pool.config.pool_id, events, pool.store.medium)

    def take_store_orders(self, pool_id: str, session_id: str) -> StoreOrders | None:
        """The saves and deletes the last Allocate or Free of this session gave rise to, for the
        client's next Execute; None when there are none. Each save stays pending (its block
        allocated) until the session reports it, or ends."""
        pool = self.pools.get(pool_id)
        if pool is None or pool.store is None:
            return None
        orders = pool.take_save_orders(session_id)
        deletes = pool.store.take_deletes()
        if not orders and not deletes:
            return None
        if deletes:  # evicted from the index: not findable in the store any more
            self._emit(pool_id, [BlockRemoved(list(deletes))], pool.store.medium)
        return StoreOrders([o.block.block_id for o in orders], [o.block_hash for o in orders],
                               [o.block_key for o in orders], deletes)

    @staticmethod
    def _own_sequence(pool: KVPool, session_id: str, seq_id: int, field: str) -> KVSequence:
        seq = pool.sequences.get(seq_id)
        if seq is None:
            raise NotFound(f"{field}: unknown sequence {seq_id}")
        if seq.session_id != session_id:
            raise PermissionDenied(f"{field}: sequence {seq_id} belongs to another session")
        return seq

    # -- routing -----------------------------------------------------------------

    def lookup_prefix(self, pool_ids: Sequence[str], queries: Sequence,
                      with_store: bool = False) -> list[list[tuple]]:
        """Per query (objects with ``token_ids``, ``cache_salt``, ``adapter_id`` and optionally
        ``block_hashes``, ``hashes_block_size``, ``hashes_model_fingerprint``, as
        ``PrefixQuery``), per pool: (pool_id, tokens it holds published KV for), and with
        ``with_store`` a third item: the tokens after those that its store holds. Read-only.

        Pools that hash alike (model fingerprint, block size) are looked up together:
        a query's chain is hashed once for all of them (or taken from its
        ``block_hashes`` when they were computed for that fingerprint and block size)."""
        if len(queries) > MAX_PREFIX_QUERIES:
            raise InvalidArgument(f"queries: at most {MAX_PREFIX_QUERIES} per call, got {len(queries)}")
        pools = [self.pool(pool_id) for pool_id in pool_ids] if pool_ids else \
            [self.pools[pool_id] for pool_id in sorted(self.pools)]
        # (root hash, block size) -> indices into pools of those with prefix caching on.
        groups: dict[tuple[bytes, int], list[int]] = {}
        for j, pool in enumerate(pools):
            if pool.config.enable_prefix_caching:
                groups.setdefault((pool.root_hash, pool.block_size), []).append(j)
        group_pools = {key: [pools[j] for j in members] for key, members in groups.items()}
        now = self.clock()
        for pool in pools:
            pool.block_pool.expire(now)
        roots: dict[str, bytes] = {}
        out = []
        for i, query in enumerate(queries):
            counts = [0] * len(pools)
            store_counts = [0] * len(pools)
            tokens = query.token_ids
            packed = None
            if len(tokens):
                packed = checked_pack_tokens(tokens)
                if packed is None:
                    raise InvalidArgument(f"queries[{i}].token_ids: token ids must be 0..{MAX_TOKEN_ID}")
            hashes = getattr(query, "block_hashes", ())
            hashes_for = None
            if len(hashes):
                hashes = list(hashes)  # one pass over a protobuf field, then plain indexing
                hashes_for = self._check_query_hashes(i, query, hashes, roots)
            tenant = getattr(query, "tenant", "")
            if tenant:
                check_tenant_name(f"queries[{i}].tenant", tenant)
            num_shared_tokens = getattr(query, "num_shared_tokens", 0)
            if packed is not None or hashes_for is not None:
                for key, members in groups.items():
                    extras = BlockExtras(query.cache_salt, query.adapter_id, tenant, num_shared_tokens // key[1])
                    given = hashes if key == hashes_for else ()
                    if packed is None and not given:
                        continue  # hashes for another fingerprint or block size, and no tokens: 0
                    hits = match_cached_prefix(group_pools[key], extras, packed, len(tokens), given)
                    for j, num_blocks in zip(members, hits):
                        counts[j] = num_blocks * key[1]
                        if with_store and packed is not None and pools[j].store is not None:
                            store_counts[j] = pools[j].store_extension(extras, packed, len(tokens),
                                                                       num_blocks) * key[1]
            if with_store:
                out.append([(pool.config.pool_id, n, m) for pool, n, m in zip(pools, counts, store_counts)])
            else:
                out.append([(pool.config.pool_id, n) for pool, n in zip(pools, counts)])
        return out

    @staticmethod
    def _check_query_hashes(i: int, query, hashes: Sequence[bytes], roots: dict[str, bytes]) -> tuple[bytes, int]:
        """Validates a query's precomputed hashes; returns the (root hash, block size) they are for."""
        bs = getattr(query, "hashes_block_size", 0)
        if not 1 <= bs <= MAX_BLOCK_SIZE or bs & (bs - 1):
            raise InvalidArgument(f"queries[{i}].hashes_block_size: the block size block_hashes were computed "
                                  f"for, a power of two from 1 to {MAX_BLOCK_SIZE}; got {bs}")
        if set(map(len, hashes)) != {HASH_BYTES}:
            raise InvalidArgument(f"queries[{i}].block_hashes: each hash is {HASH_BYTES} bytes")
        fingerprint = getattr(query, "hashes_model_fingerprint", "")
        root = roots.get(fingerprint)
        if root is None:
            root = roots[fingerprint] = root_hash(fingerprint)
        return root, bs

    # -- events ------------------------------------------------------------------

    def subscribe(self, pool_id: str, subscriber: Subscriber) -> int:
        """Live batches only, from now on (``watch`` with nothing to replay)."""
        self.pool(pool_id)
        return self._hub(pool_id).subscribe(subscriber)

    def watch(self, pool_id: str, subscriber: Subscriber, start_event_id: int = 0, snapshot: bool = False,
              epoch: str = "") -> tuple[int, Iterable[EventBatch]]:
        """Subscribes, and returns what the subscriber must see before the live batches,
        taken at the same moment (nothing can be published in between):

        * ``start_event_id`` > 0: the buffered batches from that event on; when they are
          not all there any more (or ``epoch`` is given and is not the hub's), a snapshot
          if ``snapshot``, else ``EventsUnavailable`` (FAILED_PRECONDITION) and no
          subscription;
        * ``start_event_id`` == 0: a snapshot if ``snapshot``, else nothing."""
        self.pool(pool_id)
        hub = self._hub(pool_id)
        initial: Iterable[EventBatch] = ()
        if start_event_id > 0:
            try:
                initial = hub.replay(start_event_id, epoch)
            except FailedPrecondition:
                if not snapshot:
                    raise
                initial = self.snapshot(pool_id)
        elif snapshot:
            initial = self.snapshot(pool_id)
        return hub.subscribe(subscriber), initial

    def snapshot(self, pool_id: str) -> Iterator[EventBatch]:
        """The pool's cached blocks now, as batches of events (``pool.snapshot_events``) of
        at most ~``SNAPSHOT_BATCH_TOKENS`` tokens each (all but the last say
        ``snapshot_continues``), each with the id of the last event the snapshot includes:
        resume after it (``start_event_id`` = ``snapshot_event_id + 1``) to follow the pool
        from there. The pool's state is copied now (O(cached blocks), fast); the events
        are built as the batches are taken, so the event loop is not held for all of it."""
        self.reap_expired()  # as any call: the snapshot must not predate an expiry's events
        pool = self.pool(pool_id)
        hub = self._hub(pool_id)
        events = snapshot_events(pool.cached_block_keys(), pool.root_hash, pool.block_size)
        template = EventBatch([], medium=pool.medium, pool_id=pool_id, epoch=hub.epoch, snapshot=True,
                              snapshot_event_id=hub.last_event_id)
        return self._snapshot_batches(events, template)

    @staticmethod
    def _snapshot_batches(events: Iterator, template: EventBatch) -> Iterator[EventBatch]:
        chunk: list = []
        num_tokens = 0
        for event in events:
            chunk.append(event)
            num_tokens += len(getattr(event, "token_ids", ()))
            if num_tokens >= SNAPSHOT_BATCH_TOKENS:
                yield dataclasses.replace(template, events=chunk, snapshot_continues=True)
                chunk, num_tokens = [], 0
        yield dataclasses.replace(template, events=chunk)

    def unsubscribe(self, pool_id: str, token: int) -> None:
        hub = self.hubs.get(pool_id)
        if hub is not None:
            hub.unsubscribe(token)

    def _hub(self, pool_id: str) -> EventHub:
        hub = self.hubs.get(pool_id)
        if hub is None:
            hub = self.hubs[pool_id] = EventHub(pool_id, self.event_buffer_size)
        return hub

    def publish_events(self, pool: KVPool) -> None:
        """Sends what the pool recorded (admin changes evict too)."""
        self._publish(pool)

    def _publish(self, pool: KVPool) -> None:
        events = pool.drain_events()
        if events:
            self._emit(pool.config.pool_id, events, pool.medium)

    def _emit(self, pool_id: str, events: list, medium: str) -> None:
        batch = self._hub(pool_id).publish(events, medium)
        for sink in self.event_sinks:
            try:
                sink(batch)
            except Exception as exc:  # noqa: BLE001 — a broken sink must never fail an Allocate
                log.error("event_sink_failed", pool_id=pool_id, error=repr(exc))
