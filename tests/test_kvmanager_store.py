"""The store tier in kvmanager's domain: load orders on admission, save orders and their
reports, eviction, restarts, bad input. A shadow executor with a shadow store plays every
step back, so a findable entry that holds other tokens than its key's fails the test."""
from __future__ import annotations

import pytest

from kvserve.prefix_hashes import prefix_block_hashes
from kvmanager.manager import KVManager, StoreConfig
from kvmanager.pool import AllocationRequest as Req, PoolConfig
from kvserve.errors import InvalidArgument
from tests.kvmanager_support import ShadowExecutor, check_invariants

BS = 4
STORE = StoreConfig("file:///tmp/kvserve-test-store", "ns0", capacity_blocks=0, medium="DISK")


class Report:
    def __init__(self, saved=(), failed=(), missing=()):
        self.saved_hashes, self.failed_hashes, self.missing_hashes = list(saved), list(failed), list(missing)


class Executor:
    """One pool of the manager, its session and a shadow executor; the store is shared."""

    def __init__(self, manager: KVManager, pool_id: str, store: dict, num_blocks: int, instance: str = "i0",
                 store_config: StoreConfig = STORE):
        self.manager, self.pool_id = manager, pool_id
        manager.register_pool(PoolConfig(pool_id, num_blocks, BS, "model-a"), instance, store=store_config)
        self.pool = manager.pools[pool_id]
        self.session = manager.open_session(pool_id).session_id
        self.shadow = ShadowExecutor(num_blocks, BS)
        self.shadow.store = store  # one store for every executor
        self.report = Report()
        self.fail_saves = False

    def call(self, requests=(), free=(), written=((), ())):
        """One Allocate, its Execute on the shadow (saves included), and the outcomes kept for the next call."""
        results, _ = self.manager.allocate(self.pool_id, self.session, list(free), list(requests), *written,
                                           store_report=self.report)
        for seq_id in free:
            self.shadow.free(seq_id)
        self.shadow.allocated({r.seq_id: list(r.token_ids) for r in requests}, results)
        return results

    def execute(self):
        """The Execute: store loads, the step, then the store orders of the last call."""
        orders = self.manager.take_store_orders(self.pool_id, self.session)
        self.report = Report()
        done = self.shadow.execute()
        self.report.missing_hashes, self.shadow.missing = self.shadow.missing, []
        dropped, self.shadow.dropped = self.shadow.dropped, []
        self.carry(orders)
        return done, dropped

    def carry(self, orders) -> None:
        """The store orders, as the executor runs them (every save fails with ``fail_saves``)."""
        if orders is None:
            return
        if self.fail_saves:
            self.report.failed_hashes += list(orders.save_hashes)
        else:
            self.shadow.save(orders.save_block_ids, orders.save_hashes)
            self.report.saved_hashes += list(orders.save_hashes)
        for h in orders.delete_hashes:
            self.shadow.store.pop(h, None)

    def run(self, seq_id: int, tokens: list[int]):
        """Admits a prompt, runs it, reports its KV written (and the store outcomes) with a Free."""
        (result,) = self.call([Req(seq_id, tokens, len(tokens))])
        done, dropped = self.execute()
        written = ([s for s, _ in done], [n for _, n in done])
        self.manager.free(self.pool_id, self.session, [], *written, store_report=self.report)
        self.report = Report()
        self.flush()
        self.check()
        return result, dropped

    def finish(self, *seq_ids: int):
        self.manager.free(self.pool_id, self.session, list(seq_ids), store_report=self.report)
        self.report = Report()
        for seq_id in seq_ids:
            self.shadow.free(seq_id)
        self.flush()
        self.check()

    def flush(self):
        """Carries out pending orders and reports them (what the gateway does when idle)."""
        for _ in range(4):
            orders = self.manager.take_store_orders(self.pool_id, self.session)
            if orders is None and not self.report.saved_hashes and not self.report.failed_hashes:
                return
            self.carry(orders)
            self.manager.free(self.pool_id, self.session, [], store_report=self.report)
            self.report = Report()

    def check(self):
        check_invariants(self.pool)
        self.shadow.check(self.pool)
        if self.pool.store is not None:
            self.shadow.check_store(self.pool.store, self.pool.root_hash)


def prompt(n_blocks: int, base: int = 100) -> list[int]:
    return list(range(base, base + n_blocks * BS)) + [7]


def with_small_store(capacity_blocks: int, num_blocks: int) -> tuple[KVManager, dict, Executor]:
    """A manager, its shadow store and one executor whose store holds ``capacity_blocks``."""
    manager, store = KVManager(), {}
    small = StoreConfig(STORE.url, STORE.namespace, capacity_blocks=capacity_blocks, medium="DISK")
    return manager, store, Executor(manager, "a", store, num_blocks, store_config=small)


def restarted(old: Executor, store: dict, listed=None) -> tuple[Executor, object]:
    """A restarted kvmanager (its index rebuilt from ``listed``, by default what ``old``'s index
    holds) and an executor on the same store; with the rebuilt index."""
    fresh = KVManager()
    config = StoreConfig(STORE.url, STORE.namespace, capacity_blocks=old.pool.store.capacity_blocks, medium="DISK")
    new = Executor(fresh, "b", store, old.pool.block_pool.num_blocks, store_config=config)
    (index,) = fresh.take_new_stores()
    fresh.rebuild_store(index, list(old.pool.store.entries.items()) if listed is None else listed)
    return new, index


def test_a_prefix_saved_by_one_executor_is_loaded_by_another_and_is_never_findable_before_its_save():
    manager, store = KVManager(), {}
    a = Executor(manager, "a", store, 12)
    b = Executor(manager, "b", store, 12, instance="i1")
    tokens = prompt(3)
    (result,) = a.call([Req(1, tokens, len(tokens))])
    a.execute()
    assert len(a.pool.store) == 0  # written, not yet reported: nothing is findable anywhere
    a.manager.free("a", a.session, [], [1], [len(tokens)])
    orders = manager.take_store_orders("a", a.session)
    assert len(orders.save_hashes) == 3 and len(a.pool.store) == 0  # ordered, still not findable
    assert a.pool.block_pool.num_used_blocks == 4
    a.shadow.save(orders.save_block_ids, orders.save_hashes)
    a.report = Report(saved=orders.save_hashes)
    a.finish(1)
    assert len(a.pool.store) == 3 and a.pool.block_pool.num_used_blocks == 0

    result, dropped = b.run(2, tokens)
    assert (result.num_cached_tokens, result.num_store_tokens, result.start_position) == (0, 12, 12)
    assert len(result.store_load_block_ids) == 3 and not dropped
    assert b.manager.stats("b").store_hits == 12
    b.finish(2)
    assert manager.stats("b").num_used_blocks == 0


def test_the_pool_hit_comes_first_and_the_store_continues_the_chain():
    manager, store = KVManager(), {}
    a = Executor(manager, "a", store, 12)
    a.run(1, prompt(3))
    a.finish(1)
    manager.register_pool(PoolConfig("a", 12, BS, "model-a"), "i-restarted", store=STORE)  # pool invalidated
    a.shadow.restart()
    a.run(2, prompt(1))  # recomputes block 0 and publishes it in the pool again
    a.finish(2)
    result, _ = a.run(3, prompt(3))
    assert (result.num_cached_tokens, result.num_store_tokens) == (4, 8)
    assert manager.lookup_prefix(["a"], [Req(0, prompt(3))], with_store=True) == [[("a", 12, 0)]]


def test_a_failed_save_is_never_findable_and_releases_its_block():
    manager, store = KVManager(), {}
    a = Executor(manager, "a", store, 12)
    a.fail_saves = True
    a.run(1, prompt(2))
    a.finish(1)
    assert len(a.pool.store) == 0 and manager.stats("a").num_store_save_failures == 2
    assert manager.stats("a").num_used_blocks == 0


def two_executors_save_one_chain(parent_saved: bool):
    """Executor a computes a prompt's first block and is ordered its save; b, before a reports it,
    computes that block and the next and reports the next one's save (the first is a's to save).
    Then a reports its save (written whole, or failed). Returns the manager, a, b, the chain's
    hashes and the DISK ``BlockStored`` events."""
    manager, store = KVManager(), {}
    a = Executor(manager, "a", store, 12)
    b = Executor(manager, "b", store, 12, instance="i1")
    batches = []
    manager.subscribe("a", batches.append)
    manager.subscribe("b", batches.append)
    head, chain = prompt(1), prefix_block_hashes("model-a", BS, prompt(2))
    a.call([Req(1, head, len(head))])
    done, _ = a.execute()
    manager.free("a", a.session, [], [s for s, _ in done], [n for _, n in done])
    orders = manager.take_store_orders("a", a.session)
    assert list(orders.save_hashes) == chain[:1]
    b.run(2, prompt(2))
    b.finish(2)
    assert chain[1] not in b.pool.store.entries  # its parent is on its way: not findable yet
    if parent_saved:
        a.carry(orders)
    else:
        a.report = Report(failed=orders.save_hashes)
    a.finish(1)
    stored = [e.block_hashes[0] for batch in batches if batch.medium == "DISK" for e in batch.events
              if type(e).__name__ == "BlockStored"]
    return manager, a, b, chain, stored


def test_a_save_reported_before_its_parent_s_waits_for_it():
    manager, a, b, chain, stored = two_executors_save_one_chain(parent_saved=True)
    assert set(chain) <= set(a.pool.store.entries) and stored == chain  # parent first, then the child
    c = Executor(manager, "c", a.shadow.store, 12, instance="i2")
    result, dropped = c.run(3, prompt(2))
    assert result.num_store_tokens == 8 and not dropped  # the whole chain loads


def test_a_save_whose_parent_s_save_fails_is_deleted():
    manager, a, b, chain, stored = two_executors_save_one_chain(parent_saved=False)
    assert not a.pool.store.entries and stored == []
    assert chain[1] not in a.shadow.store  # its delete was ordered and carried out
    assert manager.stats("a").num_used_blocks == 0 and manager.stats("b").num_used_blocks == 0


def test_a_load_that_misses_drops_the_sequence_and_the_entry_then_recomputes():
    manager, store = KVManager(), {}
    a = Executor(manager, "a", store, 12)
    b = Executor(manager, "b", store, 12, instance="i1")
    a.run(1, prompt(2))
    a.finish(1)
    store.clear()  # the entries vanished behind kvmanager's back (a wiped volume, Redis eviction)
    result, dropped = b.run(2, prompt(2))  # admission orders the loads; they miss
    assert result.num_store_tokens == 8 and dropped == [2]
    b.finish(2)
    assert manager.stats("b").num_store_load_failures == 2 and len(b.pool.store) == 0
    result, dropped = b.run(3, prompt(2))
    assert result.num_store_tokens == 0 and result.start_position == 0 and not dropped


def test_capacity_evicts_the_least_recently_used_leaf_and_orders_deletes():
    manager, store, a = with_small_store(3, 20)
    a.run(1, prompt(2, base=100))
    a.finish(1)
    a.run(2, prompt(2, base=200))
    a.finish(2)
    assert len(a.pool.store) == 3 and len(store) == 3 and manager.stats("a").num_store_evictions == 1
    first, second = prefix_block_hashes("model-a", BS, prompt(2, base=100))
    # The oldest chain lost its tail, not its head: what is left of it is still found.
    assert first in a.pool.store.entries and second not in a.pool.store.entries


def test_a_prefix_served_from_the_device_tier_outlives_its_continuations_in_the_store():
    # One head block every prompt shares (a chat template's), saved once and then always hit in
    # the device tier, under a flood of younger continuations: it must stay in the store, or a
    # restarted kvmanager finds none of the continuations it heads.
    manager, store, a = with_small_store(6, 24)
    head = list(range(10, 10 + BS))
    for i in range(12):
        tokens = head + list(range(1000 + 100 * i, 1000 + 100 * i + 2 * BS)) + [7]
        result, _ = a.run(i + 1, tokens)
        assert i == 0 or result.num_cached_tokens >= BS  # the head: a device-tier hit
        a.finish(i + 1)
    assert len(a.pool.store) == 6 and prefix_block_hashes("model-a", BS, head + [7])[0] in a.pool.store.entries
    b, _ = restarted(a, store)
    result, _ = b.run(99, tokens)
    assert result.num_store_tokens == 3 * BS  # the head and the newest continuation, loaded


def test_a_prompt_hit_in_the_device_tier_stays_recent_in_the_store():
    _, _, a = with_small_store(4, 24)
    popular = prompt(2, base=100)
    for i in range(6):
        result, _ = a.run(2 * i + 1, popular)
        assert i == 0 or result.num_cached_tokens == 2 * BS
        a.finish(2 * i + 1)
        a.run(2 * i + 2, prompt(1, base=500 + 10 * i))  # a one-off, younger than the popular prompt's save
        a.finish(2 * i + 2)
    assert all(h in a.pool.store.entries for h in prefix_block_hashes("model-a", BS, popular))


def test_a_chain_longer_than_the_store_keeps_its_head_and_no_unreachable_entry():
    _, store, a = with_small_store(2, 20)
    tokens = prompt(4, base=100)
    a.run(1, tokens)
    a.finish(1)
    chain = prefix_block_hashes("model-a", BS, tokens)
    assert [h in a.pool.store.entries for h in chain] == [True, True, False, False]
    assert set(store) == set(chain[:2])  # the saves below the store's last block were deleted, not kept
    orphan = prefix_block_hashes("model-a", BS, prompt(2, base=900))[1]  # a file whose parent is gone
    b, index = restarted(a, store, [*a.pool.store.entries.items(), (orphan, b"\0" * 16 + b"\0" * 8)])
    assert len(index) == 2 and orphan not in index.entries and orphan in index.take_deletes()
    result, _ = b.run(2, tokens)
    assert result.num_store_tokens == 2 * BS


def test_a_long_chain_leaves_the_store_from_its_tail():
    _, _, a = with_small_store(8, 40)
    long = prompt(8, base=100)
    a.run(1, long)
    a.finish(1)
    chain = prefix_block_hashes("model-a", BS, long)
    for i in range(5):  # each a 1-block prompt: one eviction each
        a.run(10 + i, prompt(1, base=500 + 10 * i))
        a.finish(10 + i)
        assert [h in a.pool.store.entries for h in chain] == [True] * (7 - i) + [False] * (i + 1)


def test_a_closed_session_releases_the_blocks_its_saves_held():
    manager, store = KVManager(), {}
    a = Executor(manager, "a", store, 12)
    tokens = prompt(2)
    a.call([Req(1, tokens, len(tokens))])
    a.execute()
    a.manager.free("a", a.session, [1], [1], [len(tokens)])
    assert manager.take_store_orders("a", a.session) is not None
    assert manager.stats("a").num_used_blocks == 2  # held for the saves
    manager.close_session(a.session)
    assert manager.stats("a").num_used_blocks == 0 and len(a.pool.store) == 0


def test_the_free_policy_saves_when_a_sequence_ends():
    manager, store = KVManager(store_save_policy="free"), {}
    a = Executor(manager, "a", store, 12)
    a.run(1, prompt(2))
    assert len(a.pool.store) == 0
    a.finish(1)
    assert len(a.pool.store) == 2


def test_a_restarted_kvmanager_rebuilds_the_index_from_the_store():
    manager, store = KVManager(), {}
    a = Executor(manager, "a", store, 12)
    a.run(1, prompt(2))
    a.finish(1)
    listed = list(a.pool.store.entries.items())
    fresh = KVManager()
    b = Executor(fresh, "b", store, 12)
    (index,) = fresh.take_new_stores()
    assert fresh.rebuild_store(index, listed) == 2
    result, _ = b.run(2, prompt(2))
    assert result.num_store_tokens == 8


@pytest.mark.parametrize("report, message", [
    (Report(saved=[b"short"]), "store_report.saved_hashes"),
    (Report(missing=[b"x" * 17]), "store_report.missing_hashes"),
])
def test_a_malformed_store_report_changes_nothing(report, message):
    manager, store = KVManager(), {}
    a = Executor(manager, "a", store, 12)
    with pytest.raises(InvalidArgument, match=message):
        manager.allocate("a", a.session, [], [Req(1, prompt(1), 5)], store_report=report)
    assert 1 not in a.pool.sequences


def test_a_store_without_a_namespace_is_refused():
    with pytest.raises(InvalidArgument, match="kv_store_namespace"):
        KVManager().register_pool(PoolConfig("p", 8, BS, "m"), store=StoreConfig("file:///x", ""))


def test_kvserve_up_gives_the_executor_a_store_under_the_cache_dir_unless_told_otherwise(monkeypatch, tmp_path):
    from kvserve.cli import with_kv_store

    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    args = with_kv_store(["--num-blocks", "64"], "auto")
    assert args[:2] == ["--kv-store", str(tmp_path / "kv-store")] and args[-2:] == ["--num-blocks", "64"]
    assert with_kv_store(["--num-blocks", "64"], "off") == ["--num-blocks", "64"]
    assert with_kv_store([], "redis://r:6379/0") == ["--kv-store", "redis://r:6379/0"]
    assert with_kv_store(["--kv-store=/mine"], "auto") == ["--kv-store=/mine"]


def test_kv_events_say_which_tier_holds_a_block():
    """A save reported written is a BlockStored with the store's medium; an eviction from the store
    and a load that missed are BlockRemoved with it; the pool's own events keep the pool's medium."""
    manager, store = KVManager(), {}
    small = StoreConfig(STORE.url, STORE.namespace, capacity_blocks=2, medium="DISK")
    a = Executor(manager, "a", store, 20, store_config=small)
    batches = []
    manager.subscribe("a", batches.append)
    a.run(1, prompt(2, base=100))
    stored = [(b.medium, e) for b in batches for e in b.events if type(e).__name__ == "BlockStored"]
    assert {m for m, _ in stored} == {"GPU", "DISK"}
    pool_chain = [e for m, e in stored if m == "GPU"][0]
    store_blocks = [e for m, e in stored if m == "DISK"]
    assert [e.block_hashes[0] for e in store_blocks] == pool_chain.block_hashes  # the same hashes, tier by tier
    assert store_blocks[0].parent_block_hash == b"" and store_blocks[1].parent_block_hash == pool_chain.block_hashes[0]
    assert list(store_blocks[1].token_ids) == list(pool_chain.token_ids[BS:])
    a.finish(1)
    batches.clear()
    a.run(2, prompt(1, base=300))  # a third block: the least recently used leaf, the chain's tail, is evicted
    removed = [(b.medium, e) for b in batches for e in b.events if type(e).__name__ == "BlockRemoved"]
    assert [(m, e.block_hashes) for m, e in removed] == [("DISK", [pool_chain.block_hashes[1]])]
