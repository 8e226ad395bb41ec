"""Tenants on one KV cache, in kvmanager: isolation with a shareable range, quotas,
weighted fair eviction, pins, TTLs, low priority, store quotas, per-tenant stats and the
admin calls' credential and errors."""
from __future__ import annotations

import grpc
import pytest

from kvserve.prefix_hashes import BlockExtras, block_key, hash_key, namespace_of_extra, split_key
from kvmanager.manager import KVManager
from kvmanager.pool import AllocationRequest as Req, PoolConfig
from kvmanager.store_index import StoreIndex
from kvmanager.tenants import TenantPolicies
from kvserve.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from tests.kvmanager_support import FakeClock, check_invariants

BS = 4
SYSTEM = list(range(100, 116))  # 4 blocks


@pytest.fixture
def clock():
    return FakeClock()


def make_manager(clock, num_blocks=41) -> KVManager:
    manager = KVManager(default_session_ttl_ms=10**7, clock=clock)
    manager.register_pool(PoolConfig("p", num_blocks, BS, "fp"))
    return manager


@pytest.fixture
def manager(clock):
    return make_manager(clock)


class Client:
    """Runs prompts to completion as a gateway would: admit, execute, report written, free."""

    def __init__(self, manager: KVManager) -> None:
        self.manager = manager
        self.session = manager.open_session("p").session_id
        self.next_id = 0

    def run(self, prompt, tenant="", num_shared_tokens=0, ttl_ms=0, priority=0, keep=False):
        self.next_id += 1
        seq_id = self.next_id
        req = Req(seq_id, list(prompt), len(prompt), True, tenant=tenant, num_shared_tokens=num_shared_tokens,
                  cache_ttl_ms=ttl_ms, cache_priority=priority)
        [result], _ = self.manager.allocate("p", self.session, [], [req])
        assert result.ok
        if keep:
            self.manager.free("p", self.session, [], [seq_id], [len(prompt)])
        else:
            self.manager.free("p", self.session, [seq_id], [seq_id], [len(prompt)])
        return result.num_cached_tokens


def tenant_stats(manager, name):
    return next(t for t in manager.stats("p").tenants if t.tenant == name)


def test_identical_prompts_of_two_tenants_share_nothing_but_the_marked_range(manager):
    client = Client(manager)
    prompt = SYSTEM + [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert client.run(prompt, "acme") == 0
    assert client.run(prompt, "acme") == 24  # its own cache: 6 full blocks, the last token computed
    assert client.run(prompt, "globex") == 0  # another tenant never hits it
    assert client.run(prompt) == 0  # nor does the default tenant
    pool = manager.pools["p"]
    check_invariants(pool)
    for block in pool.block_pool.cached_blocks.values():  # every cached block in its owner's namespace
        assert namespace_of_extra(split_key(block.block_key)[1]) == block.owner.name
    # Marked shareable: the system prompt is computed once for everyone, the rest stays private.
    assert client.run(prompt, "acme", num_shared_tokens=16) == 0  # shared namespace: new chain
    assert client.run(prompt, "globex", num_shared_tokens=16) == 16
    assert client.run(prompt, "initech", num_shared_tokens=18) == 16  # whole blocks only
    assert client.run(prompt, "globex", num_shared_tokens=16) == 24
    assert tenant_stats(manager, "shared").num_cached_blocks == 4
    assert pool.cached_prefix_length(prompt, tenant="initech", num_shared_tokens=16) == 24
    assert pool.cached_prefix_length(prompt, tenant="hooli", num_shared_tokens=16) == 16
    assert pool.cached_prefix_length(prompt, tenant="hooli") == 0
    check_invariants(pool)


def test_lookup_prefix_keys_queries_by_tenant(manager):
    client = Client(manager)
    prompt = SYSTEM + [1, 2, 3, 4, 5]
    client.run(prompt, "acme", num_shared_tokens=8)

    class Query:
        def __init__(self, tenant, shared=0):
            self.token_ids, self.cache_salt, self.adapter_id = prompt, "", ""
            self.tenant, self.num_shared_tokens = tenant, shared

    [[(_, acme)], [(_, other)], [(_, other_shared)]] = manager.lookup_prefix(
        ["p"], [Query("acme", 8), Query("globex"), Query("globex", 8)])
    assert (acme, other, other_shared) == (20, 0, 8)


def test_a_tenant_over_its_quota_evicts_its_own_cache_first_and_never_holds_more(manager):
    manager.governance.set_policy("acme", 1.0, 5, 0)
    client = Client(manager)
    client.run(list(range(1000, 1009)), "globex")  # 2 blocks of another tenant
    for i in range(6):
        client.run([i] * 9, "acme")  # 2 blocks each
        assert tenant_stats(manager, "acme").num_cached_blocks <= 5
        check_invariants(manager.pools["p"])
    acme = tenant_stats(manager, "acme")
    assert acme.num_cached_blocks == 5 and acme.num_evictions_suffered >= 7
    assert tenant_stats(manager, "globex").num_cached_blocks == 2  # untouched by acme's quota
    assert client.run([5] * 9, "acme") == 8  # the most recent stays
    assert client.run([0] * 9, "acme") == 0  # the oldest went first


def test_at_quota_with_everything_in_use_blocks_are_not_published_but_the_sequence_runs(manager):
    manager.governance.set_policy("acme", 1.0, 2, 0)
    client = Client(manager)
    client.run([1] * 17, "acme", keep=True)  # 4 full blocks written, held by the live sequence
    acme = tenant_stats(manager, "acme")
    assert acme.num_cached_blocks == 2 and acme.num_quota_refusals == 1  # refused once, the chain stops there
    check_invariants(manager.pools["p"])


def test_lowering_a_quota_applies_at_once(manager):
    client = Client(manager)
    for i in range(4):
        client.run([i] * 9, "acme")
    assert tenant_stats(manager, "acme").num_cached_blocks == 8
    manager.governance.set_policy("acme", 1.0, 3, 0)
    assert tenant_stats(manager, "acme").num_cached_blocks == 3
    check_invariants(manager.pools["p"])


def test_weighted_fair_eviction_keeps_a_quiet_tenant_cached_beside_a_noisy_one(clock):
    def quiet_hit_rate(fair: bool) -> float:
        manager = make_manager(clock, num_blocks=65)  # 64 usable; the quiet conversation reaches 22
        client = Client(manager)
        noisy = "noisy" if fair else ""  # unfair: both in one tenant, so plain LRU
        conversation = list(range(500, 509))
        hits = total = 0
        for turn in range(10):
            conversation = conversation + [600 + turn] * 8
            hits += client.run(conversation, "quiet" if fair else "")
            total += len(conversation) - 1
            for k in range(10):  # 10x the traffic, every prompt unique
                client.run([10_000 + turn * 100 + k] * 25, noisy)  # 7 blocks: 70 a turn
        check_invariants(manager.pools["p"])
        return hits / total

    governed, ungoverned = quiet_hit_rate(True), quiet_hit_rate(False)
    assert governed > 0.8 and ungoverned < 0.2, (governed, ungoverned)


def test_weights_set_each_tenants_share_under_pressure(clock):
    manager = make_manager(clock, num_blocks=31)  # 30 usable blocks
    manager.governance.set_policy("big", 2.0, 0, 0)
    client = Client(manager)
    for i in range(40):
        client.run([i] * 8, "big")  # 2 full blocks each, both cached once freed
        client.run([5000 + i] * 8, "small")
    big, small = tenant_stats(manager, "big"), tenant_stats(manager, "small")
    assert big.num_cached_blocks + small.num_cached_blocks == 30
    assert abs(big.num_cached_blocks - 20) <= 2  # two thirds, within one prompt's blocks


def test_a_pinned_prefix_is_held_once_computed_and_never_evicted(manager):
    manager.governance.set_policy("acme", 1.0, 10, 0)
    client = Client(manager)
    pin_id, [pinned] = manager.governance.pin([], "acme", SYSTEM, shared=False)
    assert (pinned.num_blocks, pinned.num_blocks_held) == (4, 0)  # not computed yet
    client.run(SYSTEM + [1], "acme")  # computes it once
    assert manager.governance.pin_status(pin_id)[0].num_blocks_held == 4
    for i in range(30):  # a flood from another tenant, and from acme itself (its quota)
        client.run([2000 + i] * 9, "globex")
        client.run([3000 + i] * 9, "acme")
        check_invariants(manager.pools["p"])
    assert client.run(SYSTEM + [9, 9], "acme") == 16
    assert client.run(SYSTEM + [9, 9], "globex") == 0  # pinned for acme only
    stats = tenant_stats(manager, "acme")
    assert stats.num_pinned_blocks == 4 and stats.num_cached_blocks <= 10
    assert manager.governance.unpin(pin_id) == 4
    assert tenant_stats(manager, "acme").num_pinned_blocks == 0
    with pytest.raises(NotFound):
        manager.governance.unpin(pin_id)
    check_invariants(manager.pools["p"])


def test_a_shared_pin_serves_every_tenant_that_marks_the_range(manager):
    client = Client(manager)
    pin_id, _ = manager.governance.pin([], "", SYSTEM, shared=True)
    client.run(SYSTEM + [1], "acme", num_shared_tokens=16)
    assert manager.governance.pin_status(pin_id)[0].num_blocks_held == 4
    assert client.run(SYSTEM + [7, 7], "globex", num_shared_tokens=16) == 16


def test_pins_are_refused_over_a_quota_larger_than_a_pool_or_half_of_it(manager):
    manager.governance.set_policy("acme", 1.0, 3, 0)
    with pytest.raises(ResourceExhausted, match="quota"):
        manager.governance.pin([], "acme", SYSTEM, shared=False)  # 4 blocks > 3
    with pytest.raises(InvalidArgument, match="larger than pool"):
        manager.governance.pin([], "globex", list(range(41 * BS)), shared=False)
    with pytest.raises(FailedPrecondition, match="50%"):
        manager.governance.pin([], "globex", list(range(21 * BS)), shared=False)
    with pytest.raises(InvalidArgument, match="no block"):
        manager.governance.pin([], "globex", [1, 2], shared=False)
    with pytest.raises(InvalidArgument, match="shared namespace"):
        manager.governance.pin([], "shared", SYSTEM, shared=False)
    with pytest.raises(NotFound):
        manager.governance.pin(["nope"], "globex", SYSTEM, shared=False)
    assert not manager.pools["p"].pins.pins  # nothing half-applied


def test_an_executor_restart_releases_pins_until_the_prefix_is_computed_again(manager):
    client = Client(manager)
    pin_id, _ = manager.governance.pin([], "acme", SYSTEM, shared=False)
    client.run(SYSTEM + [1], "acme")
    manager.register_pool(manager.pools["p"].config, "instance-2")  # the KV is gone
    assert manager.governance.pin_status(pin_id)[0].num_blocks_held == 0
    assert manager.stats("p").num_used_blocks == 0
    client.run(SYSTEM + [1], "acme")
    assert manager.governance.pin_status(pin_id)[0].num_blocks_held == 4


def test_cached_blocks_expire_after_their_ttl_and_low_priority_goes_first(manager, clock):
    client = Client(manager)
    client.run([1] * 9, "acme", ttl_ms=5000)
    clock.now += 4
    assert client.run([1] * 9, "acme") == 8
    clock.now += 2
    assert client.run([1] * 9, "acme") == 0  # expired; this run cached it again, without a TTL
    assert manager.stats("p").num_expired_blocks == 2
    clock.now += 100
    assert client.run([1] * 9, "acme") == 8

    small = make_manager(clock, num_blocks=9)  # 8 usable blocks
    c = Client(small)
    c.run([5] * 9, "acme")  # 2 blocks, normal
    c.run([6] * 9, "acme", priority=1)  # 2 blocks, scratch: evicted first though more recent
    c.run([7] * 17, "acme")  # needs 5 blocks: 4 free, then one eviction
    assert c.run([5] * 9, "acme") == 8 and small.pools["p"].cached_prefix_length([6] * 9, tenant="acme") < 8


@pytest.mark.parametrize("field, value, message", [
    ("tenant", "bad name!", "tenant name"),
    ("tenant", "x" * 65, "tenant name"),
    ("num_shared_tokens", 99, "num_shared_tokens"),
    ("cache_ttl_ms", 8 * 24 * 3600 * 1000, "cache_ttl_ms"),
    ("cache_priority", 2, "cache_priority"),
])
def test_bad_cache_terms_are_invalid_argument_and_change_nothing(manager, field, value, message):
    session = manager.open_session("p").session_id
    ok = Req(1, [1, 2, 3, 4, 5], 5)
    bad = Req(2, [1, 2, 3], 3, **{field: value})
    before = manager.stats("p")
    with pytest.raises(InvalidArgument, match=message):
        manager.allocate("p", session, [], [ok, bad])
    assert manager.stats("p") == before


def test_bad_policies_are_invalid_argument(manager):
    for args in [(0.0, 0, 0), (-1.0, 0, 0), (float("nan"), 0, 0), (1.0, -1, 0), (1.0, 0, -5)]:
        with pytest.raises(InvalidArgument):
            manager.governance.set_policy("acme", *args)
    with pytest.raises(InvalidArgument, match="tenant name"):
        manager.governance.set_policy("a b", 1.0, 0, 0)
    policies = TenantPolicies()
    with pytest.raises(InvalidArgument, match="unknown field"):
        policies.load({"tenants": {"acme": {"quota": 5}}})
    policies.load({"tenants": {"acme": {"weight": 3, "quota_blocks": 7}}})
    assert policies.get("acme").quota_blocks == 7 and policies.get("acme").weight == 3.0


def entry(tenant: str, tokens: list[int], parent: bytes = b"\0" * 16) -> tuple[bytes, bytes]:
    key = block_key(parent, BlockExtras(tenant=tenant).private, tokens)
    return hash_key(key), key


def test_the_store_keeps_quotas_per_tenant_and_evicts_fairly_for_capacity():
    policies = TenantPolicies()
    policies.set("acme", 1.0, 0, 3)
    index = StoreIndex("file:///x", "ns", "DISK", capacity_blocks=8, policies=policies, roots=[b"\0" * 16])
    for i in range(5):
        index.add(*entry("acme", [i] * 4))
    assert index.num_entries_of("acme") == 3 and index.quota_evictions["acme"] == 2
    assert index.holds(*entry("acme", [4] * 4)) and not index.holds(*entry("acme", [0] * 4))
    for i in range(10):  # a noisy tenant fills the capacity: it loses its own entries first
        index.add(*entry("noisy", [100 + i] * 4))
    assert len(index) == 8 and index.num_entries_of("acme") == 3 and index.num_entries_of("noisy") == 5
    deleted = set(index.take_deletes())
    assert entry("acme", [0] * 4)[0] in deleted and entry("noisy", [100] * 4)[0] in deleted
    rebuilt = StoreIndex("file:///x", "ns", "DISK", capacity_blocks=8, policies=policies, roots=[b"\0" * 16])
    assert rebuilt.rebuild([entry("acme", [i] * 4) for i in range(6)]) == 6
    assert rebuilt.num_entries_of("acme") == 3  # the quota holds for what a restart finds too


def test_admin_calls_need_the_admin_key_and_report_per_tenant_stats(tmp_path):
    """A real kvmanager process: --tenants at start, --admin-key on the admin calls."""
    import json
    import signal

    from tests.conftest import launch
    from kvserve.v1 import kvmanager_pb2 as pb, kvmanager_pb2_grpc

    tenants = tmp_path / "tenants.json"
    tenants.write_text(json.dumps({"tenants": {"acme": {"weight": 2, "quota_blocks": 10}}}))
    started = []
    try:
        for flags in (["--admin-key", "s3cret", "--tenants", str(tenants)], []):
            started.append(launch("kvmanager", flags + ["--shutdown-grace", "1"], tmp_path, timeout=60))
        with grpc.insecure_channel(started[0].address) as channel:
            stub = kvmanager_pb2_grpc.KVManagerStub(channel)
            stub.RegisterPool(pb.RegisterPoolRequest(pool_id="p", num_blocks=41, block_size=BS,
                                                     enable_prefix_caching=True))
            policy = pb.SetTenantPolicyRequest(tenant="acme", weight=2, quota_blocks=10)
            for metadata in [(), (("kvserve-admin-key", "wrong"),)]:
                with pytest.raises(grpc.RpcError) as err:
                    stub.SetTenantPolicy(policy, metadata=metadata)
                assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
            admin = (("kvserve-admin-key", "s3cret"),)
            with pytest.raises(grpc.RpcError) as err:
                stub.SetTenantPolicy(pb.SetTenantPolicyRequest(tenant="acme", weight=0), metadata=admin)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "weight" in err.value.details()
            pinned = stub.PinPrefix(pb.PinPrefixRequest(tenant="acme", token_ids=SYSTEM), metadata=admin)
            assert [(p.pool_id, p.num_blocks, p.num_blocks_held) for p in pinned.pools] == [("p", 4, 0)]
            with pytest.raises(grpc.RpcError) as err:  # 12 more blocks: over acme's quota of 10 (--tenants)
                stub.PinPrefix(pb.PinPrefixRequest(tenant="acme", token_ids=list(range(48))), metadata=admin)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            session = stub.OpenSession(pb.OpenSessionRequest(pool_id="p")).session_id
            stub.Allocate(pb.AllocateRequest(pool_id="p", session_id=session, sequences=[
                pb.SequenceAllocation(seq_id=1, token_ids=SYSTEM + [1], num_new_tokens=17, enable_prefix_caching=True,
                                      tenant="acme", cache_priority=pb.CACHE_PRIORITY_LOW)]))
            stub.Free(pb.FreeRequest(pool_id="p", session_id=session, seq_ids=[1], written_seq_ids=[1],
                                     written_num_tokens=[17]))
            assert stub.GetPin(pb.GetPinRequest(pin_id=pinned.pin_id), metadata=admin).pools[0].num_blocks_held == 4
            stats = stub.GetStats(pb.GetStatsRequest(pool_id="p"))
            acme = next(t for t in stats.tenants if t.tenant == "acme")
            assert (acme.weight, acme.quota_blocks, acme.num_cached_blocks, acme.num_pinned_blocks) == (2, 10, 4, 4)
            assert stats.num_pins == 1
            released = stub.UnpinPrefix(pb.UnpinPrefixRequest(pin_id=pinned.pin_id), metadata=admin)
            assert released.num_blocks_released == 4
            with pytest.raises(grpc.RpcError) as err:
                stub.UnpinPrefix(pb.UnpinPrefixRequest(pin_id=pinned.pin_id), metadata=admin)
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
        with grpc.insecure_channel(started[1].address) as channel:
            stub = kvmanager_pb2_grpc.KVManagerStub(channel)
            with pytest.raises(grpc.RpcError) as err:
                stub.UnpinPrefix(pb.UnpinPrefixRequest(pin_id=1), metadata=(("kvserve-admin-key", "x"),))
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "--admin-key" in err.value.details()
    finally:
        for service in started:
            assert service.stop(signal.SIGTERM) == 0, service.logs()[-2000:]
