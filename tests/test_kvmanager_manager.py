"""Unit tests of the KVManager facade: pools, sessions and leases, permissions,
validation, events fan-out, and hashing determinism."""
from __future__ import annotations

import subprocess
import sys

import pytest

from kvmanager.events import AllBlocksCleared, BlockRemoved, BlockStored, EventHub
from kvserve.prefix_hashes import block_key, extra_keys, hash_key, root_hash
from kvmanager.manager import KVManager
from kvmanager.pool import AllocationPolicy, AllocationRequest as Req, PoolConfig
from kvserve.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, PermissionDenied
from tests.kvmanager_support import FakeClock, check_invariants


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def manager(clock):
    m = KVManager(default_session_ttl_ms=1000, clock=clock)
    m.register_pool(PoolConfig("p", 17, 4, "fp"))
    return m


# -- pools -------------------------------------------------------------------------


def test_register_pool_is_idempotent_and_replaces_only_an_idle_pool(manager):
    assert manager.register_pool(PoolConfig("p", 17, 4, "fp")) is False
    assert manager.register_pool(PoolConfig("p", 17, 4, "fp", allocation_policy=0)) is False  # 0 = PAGED
    s = manager.open_session("p").session_id
    manager.allocate("p", s, [], [Req(1, [1, 2, 3], 3)])
    with pytest.raises(FailedPrecondition):
        manager.register_pool(PoolConfig("p", 33, 4, "fp"))
    events = []
    manager.subscribe("p", lambda b: events.extend(b.events))
    manager.free("p", s, [1])
    assert manager.register_pool(PoolConfig("p", 33, 4, "fp")) is True
    assert manager.stats("p").num_blocks == 33 and isinstance(events[-1], AllBlocksCleared)
    assert manager.register_pool(PoolConfig("q", 9, 16, "fp")) is True
    assert set(manager.pools) == {"p", "q"}


@pytest.mark.parametrize("config, field", [
    (PoolConfig("", 10, 4), "pool_id"),
    (PoolConfig("x", 1, 4), "num_blocks"),
    (PoolConfig("x", 1 << 30, 4), "num_blocks"),
    (PoolConfig("x", 10, 3), "block_size"),
    (PoolConfig("x", 10, 0), "block_size"),
    (PoolConfig("x", 10, 512), "block_size"),
    (PoolConfig("x", 10, 4, allocation_policy=7), "allocation_policy"),
    (PoolConfig("x", 10, 4, allocation_policy=AllocationPolicy.RESERVE), "max_model_len"),
])
def test_register_pool_rejects_malformed_configs(manager, config, field):
    with pytest.raises(InvalidArgument, match=field):
        manager.register_pool(config)


def test_unknown_pool_is_not_found_and_empty_pool_id_is_invalid(manager):
    with pytest.raises(NotFound, match="pool_id"):
        manager.stats("nope")
    with pytest.raises(InvalidArgument, match="pool_id"):
        manager.open_session("")


# -- sessions ------------------------------------------------------------------------


def test_session_lease_renew_and_expiry_frees_sequences(manager, clock):
    s = manager.open_session("p", ttl_ms=500, client_name="gw").session_id
    manager.allocate("p", s, [], [Req(1, list(range(10)), 10), Req(2, [1], 1)])
    assert manager.stats("p").num_used_blocks == 4
    clock.now += 0.4
    assert manager.renew_session(s) == 500
    clock.now += 0.4  # 0.8 s after open, 0.4 after renewal: alive
    assert manager.stats("p").num_sessions == 1
    clock.now += 0.2
    assert manager.reap_expired() == 1
    stats = manager.stats("p")
    assert (stats.num_used_blocks, stats.num_sequences, stats.num_sessions) == (0, 0, 0)
    with pytest.raises(NotFound, match="session_id"):
        manager.renew_session(s)
    check_invariants(manager.pools["p"])


def test_using_a_session_renews_it_and_expiry_is_lazy_too(manager, clock):
    s = manager.open_session("p").session_id  # default TTL 1000 ms
    for _ in range(5):
        clock.now += 0.8
        manager.allocate("p", s, [], [])
    clock.now += 1.5
    with pytest.raises(NotFound):  # no reaper ran: found expired on access
        manager.allocate("p", s, [], [Req(1, [1], 1)])


def test_close_session_frees_its_sequences_only(manager):
    a = manager.open_session("p").session_id
    b = manager.open_session("p").session_id
    manager.allocate("p", a, [], [Req(1, [1, 2], 2), Req(2, [3], 1)])
    manager.allocate("p", b, [], [Req(3, [4], 1)])
    manager.fork("p", a, 1, [4])
    assert manager.close_session(a) == 3
    assert set(manager.pools["p"].sequences) == {3}
    with pytest.raises(NotFound):
        manager.close_session(a)
    with pytest.raises(InvalidArgument, match="ttl_ms"):
        manager.open_session("p", ttl_ms=10**12)


def test_sessions_cannot_touch_each_others_sequences(manager):
    a = manager.open_session("p").session_id
    b = manager.open_session("p").session_id
    manager.allocate("p", a, [], [Req(1, [1, 2], 2)])
    with pytest.raises(PermissionDenied):
        manager.free("p", b, [1])
    with pytest.raises(PermissionDenied):
        manager.allocate("p", b, [], [Req(1, [3], 1)])  # extend
    with pytest.raises(PermissionDenied):
        manager.allocate("p", b, [1], [])  # piggybacked free
    with pytest.raises(PermissionDenied):
        manager.fork("p", b, 1, [9])
    assert manager.pools["p"].sequences[1].token_ids == [1, 2]


def test_a_session_is_bound_to_its_pool(manager):
    manager.register_pool(PoolConfig("q", 9, 4))
    s = manager.open_session("p").session_id
    with pytest.raises(InvalidArgument, match="session_id"):
        manager.allocate("q", s, [], [])


# -- validation and id rules -------------------------------------------------------


@pytest.mark.parametrize("request_, field", [
    (Req(1, [1, -1], 2), "sequences[1].token_ids"),
    (Req(1, [1 << 31], 1), "sequences[1].token_ids"),
    (Req(1, [1], -1), "sequences[1].num_new_tokens"),
    (Req(-1, [1], 1), "sequences[1].seq_id"),
    (Req(1, [1], 1, num_lookahead_slots=257), "sequences[1].num_lookahead_slots"),
])
def test_allocate_rejects_malformed_requests_before_changing_anything(manager, request_, field):
    s = manager.open_session("p").session_id
    with pytest.raises(InvalidArgument, match=field.replace("[", r"\[").replace("]", r"\]")):
        manager.allocate("p", s, [], [Req(7, [1, 2, 3], 3), request_])
    assert 7 not in manager.pools["p"].sequences


def test_allocate_rejects_a_duplicate_seq_id_in_one_step(manager):
    s = manager.open_session("p").session_id
    with pytest.raises(InvalidArgument, match="seq_id"):
        manager.allocate("p", s, [], [Req(1, [1], 1), Req(1, [2], 1)])


def test_free_is_all_or_nothing_and_piggybacked_frees_ignore_unknown_ids(manager):
    s = manager.open_session("p").session_id
    manager.allocate("p", s, [], [Req(1, [1], 1)])
    with pytest.raises(NotFound, match="seq_ids"):
        manager.free("p", s, [1, 99])
    assert 1 in manager.pools["p"].sequences
    manager.allocate("p", s, [99, 1], [])
    assert not manager.pools["p"].sequences
    with pytest.raises(InvalidArgument, match="session_id"):
        manager.free("p", "", [1])


def test_freed_then_reused_id_in_the_same_step_starts_a_new_sequence(manager):
    s = manager.open_session("p").session_id
    manager.allocate("p", s, [], [Req(1, list(range(9)), 9)])
    (r,), _ = manager.allocate("p", s, [1], [Req(1, [5, 6], 2)])  # preempted and re-admitted
    assert r.ok and r.start_position == 0 and manager.pools["p"].sequences[1].token_ids == [5, 6]


def test_fork_rules(manager):
    s = manager.open_session("p").session_id
    manager.allocate("p", s, [], [Req(1, [1, 2], 2), Req(2, [3], 1)])
    with pytest.raises(AlreadyExists):
        manager.fork("p", s, 1, [2])
    with pytest.raises(NotFound, match="parent_seq_id"):
        manager.fork("p", s, 42, [5])
    with pytest.raises(InvalidArgument, match="child_seq_ids"):
        manager.fork("p", s, 1, [5, 5])
    with pytest.raises(InvalidArgument, match="child_seq_ids"):
        manager.fork("p", s, 1, [])
    assert manager.fork("p", s, 1, [5, 6]) == [b.block_id for b in manager.pools["p"].sequences[1].block_table]
    check_invariants(manager.pools["p"])


# -- events --------------------------------------------------------------------------


def test_events_are_published_once_per_call_in_order(manager):
    batches = []
    manager.subscribe("p", batches.append)
    s = manager.open_session("p").session_id
    manager.allocate("p", s, [], [Req(1, list(range(9)), 9), Req(2, list(range(100, 104)), 4)])
    assert not batches  # allocated, not yet written: nothing is findable
    manager.allocate("p", s, [], [], [1, 2], [9, 4])
    assert len(batches) == 1
    stored = batches[0].events
    assert [type(e) for e in stored] == [BlockStored, BlockStored]
    assert len(stored[0].block_hashes) == 2 and stored[0].block_size == 4
    assert list(stored[1].token_ids) == list(range(100, 104))
    manager.allocate("p", s, [], [Req(1, [9, 10, 11], 3)])
    manager.free("p", s, [1, 2], [1], [12])  # reported, then freed, in one call
    assert len(batches) == 2  # freeing without eviction emits nothing
    third = batches[-1].events[0]
    assert third.parent_block_hash == stored[0].block_hashes[1] and list(third.token_ids) == [8, 9, 10, 11]


def test_event_hub_drops_a_failing_subscriber():
    hub = EventHub()
    got = []

    def broken(_):
        raise RuntimeError("gone")

    hub.subscribe(broken)
    token = hub.subscribe(got.append)
    hub.publish([BlockRemoved([b"x" * 16])])
    assert hub.num_subscribers == 1 and len(got) == 1
    hub.unsubscribe(token)
    hub.publish([AllBlocksCleared()])
    assert len(got) == 1


# -- hashing --------------------------------------------------------------------------


def test_hashes_are_128_bit_chained_and_keyed():
    root = root_hash("m")
    assert len(root) == 16 and root != root_hash("n")
    h1 = hash_key(block_key(root, b"", [1, 2, 3, 4]))
    assert len(h1) == 16
    assert h1 != hash_key(block_key(root_hash("n"), b"", [1, 2, 3, 4]))
    assert h1 != hash_key(block_key(root, extra_keys("salt", ""), [1, 2, 3, 4]))
    assert extra_keys("ab", "c") != extra_keys("a", "bc")
    assert hash_key(block_key(h1, b"", [5])) != hash_key(block_key(root, b"", [5]))


def test_hashes_are_deterministic_across_processes():
    code = ("from kvserve.prefix_hashes import *; r = root_hash('m'); "
            "print(hash_key(block_key(r, extra_keys('s', 'a'), [1, 2, 70000])).hex())")
    out = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env={"PYTHONHASHSEED": seed, "PATH": ""}, cwd=".").stdout.strip()
           for seed in ("1", "2")}
    local = hash_key(block_key(root_hash("m"), extra_keys("s", "a"), [1, 2, 70000])).hex()
    assert out == {local}


def test_freeze_gc_and_a_replaced_pool_is_unlinked():
    import gc

    manager = KVManager(freeze_gc=True)
    try:
        manager.register_pool(PoolConfig("p", 9, 4))
        assert gc.get_freeze_count() > 0
        old = manager.pools["p"].block_pool
        manager.register_pool(PoolConfig("p", 17, 4))  # idle: replaced
        # No reference cycles left: refcounting frees the old blocks although frozen.
        assert all(b.prev_free is None and b.next_free is None for b in old.blocks)
        check_invariants(manager.pools["p"])
    finally:
        gc.unfreeze()


def test_one_executor_instance_is_one_pool():
    """Two pools over one executor's KV cache would hand out its blocks twice (two gateways
    naming the same executor by two addresses): the second registration is refused."""
    from kvserve.errors import FailedPrecondition

    manager = KVManager()
    config = PoolConfig("executor@10.0.0.5:50053", 16, 4, "model", True)
    assert manager.register_pool(config, "instance-a")
    with pytest.raises(FailedPrecondition, match="already has the pool 'executor@10.0.0.5:50053'"):
        manager.register_pool(PoolConfig("executor@executor-0:50053", 16, 4, "model", True), "instance-a")
    assert manager.register_pool(PoolConfig("executor@executor-1:50053", 16, 4, "model", True), "instance-b")
    assert not manager.register_pool(config, "instance-c")  # the same pool, its executor restarted
