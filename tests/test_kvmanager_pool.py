"""Unit tests of the kvmanager domain: block pool, Allocate, Fork, Free, prefix
caching, copy-on-write and policies, including vLLM's block-pool scenarios."""
from __future__ import annotations

import pytest

from kvmanager.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock
from kvmanager.events import AllBlocksCleared, BlockRemoved, BlockStored, EventRecorder
from kvmanager.manager import KVManager
from kvmanager.pool import AllocationPolicy, AllocationRequest as Req, PoolConfig
from kvserve.errors import InvalidArgument, NotFound
from tests.kvmanager_support import ShadowExecutor, check_invariants

BS = 4


class Harness:
    """One pool, one session, a shadow executor and the pool's events."""

    def __init__(self, num_blocks: int = 11, block_size: int = BS, **config) -> None:
        self.manager = KVManager()
        self.manager.register_pool(PoolConfig("p", num_blocks, block_size, "model-a", **config))
        self.pool = self.manager.pools["p"]
        self.session = self.manager.open_session("p").session_id
        self.shadow = ShadowExecutor(num_blocks, block_size)
        self.events: list = []
        self.manager.subscribe("p", lambda batch: self.events.extend(batch.events))

    def step(self, *requests: Req, free: tuple[int, ...] = (), report: bool = True):
        """Allocate, run the step on the shadow executor, then (``report``) tell the
        manager the KV is written, as the gateway does after Execute returns."""
        for seq_id in free:
            self.shadow.free(seq_id) if seq_id in self.pool.sequences else None
        results, _ = self.manager.allocate("p", self.session, list(free), list(requests))
        for r in results:  # empty fields are shared tuples; compare as lists
            r.block_table, r.copy_src, r.copy_dst = list(r.block_table), list(r.copy_src), list(r.copy_dst)
        self.shadow.step({r.seq_id: r.token_ids for r in requests}, results)
        self.check()
        if report:
            self.report(*(r for r in results if r.ok))
        return results if len(results) != 1 else results[0]

    def report(self, *results):
        """Execute returned: the KV of these steps is written."""
        ids = [r.seq_id for r in results]
        self.manager.free("p", self.session, [], ids, [r.start_position + r.num_tokens for r in results])
        self.check()

    def prefill(self, seq_id: int, tokens: list[int], report: bool = True, **kw):
        return self.step(Req(seq_id, list(tokens), len(tokens), **kw), report=report)

    def decode(self, seq_id: int, token: int):
        return self.step(Req(seq_id, [token], 1))

    def fork(self, parent: int, *children: int):
        table = self.manager.fork("p", self.session, parent, list(children))
        self.shadow.fork(parent, list(children), table)
        self.check()
        return table

    def free(self, *seq_ids: int) -> int:
        n = self.manager.free("p", self.session, list(seq_ids))
        for s in seq_ids:
            self.shadow.free(s)
        self.check()
        return n

    def check(self) -> None:
        check_invariants(self.pool)
        self.shadow.check(self.pool)

    def table(self, seq_id: int) -> list[int]:
        return [b.block_id for b in self.pool.sequences[seq_id].block_table]

    @property
    def stats(self):
        return self.manager.stats("p")


# -- the free queue ----------------------------------------------------------------


def test_free_queue_is_lru_and_supports_removal_from_the_middle():
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[2])
    assert [b.block_id for b in queue] == [0, 1, 3, 4]
    assert queue.popleft() is blocks[0]
    queue.append(blocks[0])
    queue.append(blocks[2])
    assert [b.block_id for b in queue] == [1, 3, 4, 0, 2]
    assert len(queue) == 5


def test_block_pool_never_hands_out_the_null_block():
    pool = BlockPool(4, BS, EventRecorder())
    blocks = pool.get_new_blocks(3)
    assert sorted(b.block_id for b in blocks) == [1, 2, 3]
    assert pool.num_free_blocks == 0 and pool.num_used_blocks == 3
    with pytest.raises(AssertionError):
        pool.get_new_blocks(1)


# -- allocate ---------------------------------------------------------------------


def test_prefill_then_decode_crossing_a_block_boundary():
    h = Harness()
    r = h.prefill(1, list(range(7)))  # 7 tokens: 2 blocks, the second 3/4 full
    assert (r.ok, r.start_position, r.num_tokens, r.block_table_offset) == (True, 0, 7, 0)
    assert len(r.block_table) == 2
    r = h.decode(1, 7)  # fills block 1: no new block
    assert (r.start_position, r.num_tokens, r.block_table_offset, r.block_table) == (7, 1, 2, [])
    r = h.decode(1, 8)  # position 8 starts block 2
    assert (r.start_position, r.block_table_offset, len(r.block_table)) == (8, 2, 1)
    assert h.stats.num_used_blocks == 3
    assert h.stats.num_stored_tokens == 9 and h.stats.num_allocated_slots == 12


def test_lookahead_holds_the_next_block_so_the_next_decode_needs_none():
    h = Harness()
    r = h.prefill(1, list(range(8)), num_lookahead_slots=1)  # ends on a block boundary
    assert (r.start_position, r.num_tokens, r.block_table_offset, len(r.block_table)) == (0, 8, 0, 3)
    assert h.stats.num_stored_tokens == 8 and h.stats.num_allocated_slots == 12
    r = h.step(Req(1, [8], 1, num_lookahead_slots=1))  # position 8 is in the block already held
    assert (r.start_position, r.num_tokens, r.block_table_offset, r.block_table) == (8, 1, 3, [])
    for t in (9, 10):
        assert h.step(Req(1, [t], 1, num_lookahead_slots=1)).block_table == []
    r = h.step(Req(1, [11], 1, num_lookahead_slots=1))  # fills block 2: block 3 comes for position 12
    assert (r.start_position, r.block_table_offset, len(r.block_table)) == (11, 3, 1)
    assert h.decode(1, 12).block_table == []
    assert h.pool.sequences[1].num_computed == 13 and h.stats.num_used_blocks == 4


def test_lookahead_is_never_the_reason_for_no_room():
    h = Harness(num_blocks=4)  # 3 usable blocks
    r = h.prefill(1, list(range(8)), num_lookahead_slots=1)
    assert r.ok and len(r.block_table) == 3
    r = h.prefill(2, [5, 6, 7, 8], num_lookahead_slots=1)  # no block left at all
    assert not r.ok and 2 not in h.pool.sequences
    h.free(1)
    h.prefill(3, list(range(20, 28)))  # 2 blocks, 1 left
    r = h.prefill(4, [1, 2, 3, 4], num_lookahead_slots=1)  # its own block fits, the lookahead does not
    assert r.ok and len(r.block_table) == 1 and h.stats.num_free_blocks == 0
    r = h.step(Req(4, [5], 1, num_lookahead_slots=1))  # so now it needs one, and there is none
    assert not r.ok and h.pool.sequences[4].num_computed == 4


def test_lookahead_stays_within_max_model_len_and_is_freed_with_its_sequence():
    h = Harness(max_model_len=8)
    r = h.prefill(1, list(range(8)), num_lookahead_slots=4)
    assert len(r.block_table) == 2  # nothing past max_model_len
    r = h.prefill(2, list(range(3)), num_lookahead_slots=6)  # slots 3..8 → up to 8: blocks 0 and 1
    assert len(r.block_table) == 2 and h.stats.num_used_blocks == 4
    assert h.free(1, 2) == 4
    assert h.stats.num_used_blocks == 0 and h.stats.num_free_blocks == 10


def test_chunked_prefill_schedules_at_most_the_known_tokens():
    h = Harness()
    r = h.step(Req(1, list(range(10)), 4))
    assert (r.start_position, r.num_tokens, len(r.block_table)) == (0, 4, 1)
    r = h.step(Req(1, [], 100))  # capped at known - computed = 6
    assert (r.start_position, r.num_tokens, r.block_table_offset, len(r.block_table)) == (4, 6, 1, 2)
    r = h.step(Req(1, [], 5))  # nothing left to compute
    assert (r.ok, r.num_tokens, r.block_table) == (True, 0, [])


def test_prefill_with_partial_prefix_hit():
    h = Harness()
    h.prefill(1, list(range(10)))  # blocks [0..3] [4..7] cached, [8,9] partial
    h.free(1)
    r = h.prefill(2, list(range(8)) + [100, 101, 102, 103, 104])
    assert r.num_cached_tokens == 8 and r.start_position == 8 and r.num_tokens == 5
    assert r.block_table[:2] == h.shadow.tables[2][:2]
    assert h.stats.prefix_cache_queries == 10 + 13 and h.stats.prefix_cache_hits == 8


def test_hit_is_capped_so_the_last_prompt_token_is_recomputed():
    h = Harness()
    h.prefill(1, list(range(8)))  # two full blocks cached
    r = h.prefill(2, list(range(8)))  # same prompt: only block 0 may hit
    assert r.num_cached_tokens == 4 and r.start_position == 4 and r.num_tokens == 4
    r = h.prefill(3, list(range(9)))
    assert r.num_cached_tokens == 8 and r.num_tokens == 1


def test_blocks_are_findable_only_once_reported_written():
    h = Harness(num_blocks=20)
    r1, r2 = h.step(Req(1, list(range(9)), 9), Req(2, list(range(9)), 9), report=False)
    assert r2.num_cached_tokens == 0  # same step: nobody has written block 0 yet
    assert h.prefill(3, list(range(9)), report=False).num_cached_tokens == 0  # a later step, still unwritten
    h.report(r1)
    r4 = h.prefill(4, list(range(9)))
    assert r4.num_cached_tokens == 8 and r4.block_table[:2] == r1.block_table[:2]
    h.report(r2)  # identical content written twice: the first copy stays the findable one
    assert h.prefill(5, list(range(9))).block_table[:2] == r1.block_table[:2]


def test_a_partial_report_publishes_only_the_full_blocks_it_covers():
    h = Harness()
    r = h.prefill(1, list(range(12)), report=False)
    h.manager.free("p", h.session, [], [1], [6])  # one block and a half written
    assert h.prefill(2, list(range(12))).num_cached_tokens == 4
    h.report(r)
    assert h.prefill(3, list(range(12))).num_cached_tokens == 8


def test_a_sequence_freed_before_its_report_publishes_nothing():
    h = Harness()
    h.prefill(1, list(range(9)), report=False)
    h.free(1)
    assert not h.pool.block_pool.cached_blocks and h.stats.num_cached_blocks == 0
    assert not [e for e in h.events if isinstance(e, BlockStored)]
    assert h.prefill(2, list(range(9))).num_cached_tokens == 0


def test_prefix_caching_off_for_the_pool_or_the_sequence():
    h = Harness(enable_prefix_caching=False)
    h.prefill(1, list(range(9)))
    assert h.prefill(2, list(range(9))).num_cached_tokens == 0
    assert not h.pool.block_pool.cached_blocks
    h = Harness()
    h.prefill(1, list(range(9)), enable_prefix_caching=False)
    assert not h.pool.block_pool.cached_blocks
    h.prefill(2, list(range(9)))
    assert h.prefill(3, list(range(9)), enable_prefix_caching=False).num_cached_tokens == 0


def test_cache_salt_and_adapter_isolate_tenants():
    h = Harness()
    h.prefill(1, list(range(9)), cache_salt="tenant-a")
    assert h.prefill(2, list(range(9)), cache_salt="tenant-b").num_cached_tokens == 0
    assert h.prefill(3, list(range(9))).num_cached_tokens == 0
    assert h.prefill(4, list(range(9)), cache_salt="tenant-a").num_cached_tokens == 8
    assert h.prefill(5, list(range(9)), cache_salt="tenant-a", adapter_id="lora1").num_cached_tokens == 0


def test_different_model_fingerprints_never_share_blocks():
    a, b = Harness(), Harness()
    b.manager.register_pool(PoolConfig("q", 11, BS, "model-b"))
    a.prefill(1, list(range(9)))
    assert a.pool.root_hash != b.manager.pools["q"].root_hash
    assert set(a.pool.block_pool.cached_blocks).isdisjoint(
        {b.manager.pools["q"].root_hash})


def test_hash_collision_never_returns_another_prompts_kv(monkeypatch):
    import kvmanager.pool as pool_module

    monkeypatch.setattr(pool_module, "hash_key", lambda key: b"\x00" * 16)  # everything collides
    h = Harness()
    h.prefill(1, [1, 2, 3, 4, 5])
    r = h.prefill(2, [9, 9, 9, 9, 5])  # same (fake) hash, different tokens
    assert r.num_cached_tokens == 0
    assert h.prefill(3, [1, 2, 3, 4, 5]).num_cached_tokens == 4  # the real match still hits


# -- eviction --------------------------------------------------------------------


def test_eviction_order_after_freeing_several_requests():
    h = Harness(num_blocks=11)
    t1 = h.prefill(1, list(range(0, 12))).block_table  # 3 full blocks each
    t2 = h.prefill(2, list(range(100, 112))).block_table
    t3 = h.prefill(3, list(range(200, 212))).block_table
    h.free(2)
    h.free(1)
    h.free(3)
    # Never-used blocks first, then request by request in free order, each tail first.
    order = [b.block_id for b in h.pool.block_pool.free_queue]
    assert order == [10] + t2[::-1] + t1[::-1] + t3[::-1]
    # A 5-block request takes the untouched block, evicts request 2's blocks tail
    # first, then request 1's tail.
    r = h.prefill(4, list(range(300, 320)))
    assert r.block_table == [10] + t2[::-1] + [t1[2]]
    assert h.stats.num_evictions == 4
    r = h.prefill(6, list(range(0, 12)))  # 1's head survived; the new block evicts 3's tail
    assert r.num_cached_tokens == 8 and r.block_table == t1[:2] + [t3[2]]
    assert h.prefill(5, list(range(100, 112))).num_cached_tokens == 0  # 2's head is gone too


def test_a_hit_block_is_not_evicted_to_satisfy_the_same_request():
    h = Harness(num_blocks=4)  # 3 usable blocks
    h.prefill(1, list(range(8)))  # 2 cached blocks
    h.free(1)
    # 13 tokens: 2 hit blocks + 2 new; only 1 free block besides the hits.
    r = h.prefill(2, list(range(13)))
    assert not r.ok
    assert h.stats.num_cached_blocks == 2 and h.stats.num_evictions == 0
    r = h.prefill(3, list(range(12)))  # 2 hits + 1 new block: fits exactly
    assert r.ok and r.num_cached_tokens == 8 and h.stats.num_free_blocks == 0


def test_reuse_resets_the_blocks_hash_and_emits_block_removed():
    h = Harness(num_blocks=3)
    h.prefill(1, list(range(8)))
    stored = [e for e in h.events if isinstance(e, BlockStored)]
    assert len(stored) == 1 and len(stored[0].block_hashes) == 2
    assert list(stored[0].token_ids) == list(range(8)) and stored[0].parent_block_hash == b""
    h.free(1)
    h.prefill(2, [50, 51])
    block = h.pool.sequences[2].block_table[0]
    assert block.block_hash is None and block.block_key is None
    removed = [e for e in h.events if isinstance(e, BlockRemoved)]
    assert removed == [BlockRemoved([stored[0].block_hashes[1]])]  # the tail went first
    assert h.stats.num_cached_blocks == 1 and h.stats.num_evictions == 1


def test_no_room_leaves_everything_unchanged():
    h = Harness(num_blocks=5)
    h.prefill(1, list(range(6)))  # 2 blocks
    h.fork(1, 2)
    before = [(b.block_id, b.ref_cnt, b.block_hash) for b in h.pool.block_pool.blocks]
    free_order = [b.block_id for b in h.pool.block_pool.free_queue]
    r = h.prefill(3, list(range(100, 113)))  # needs 4 blocks, 2 free
    assert not r.ok and 3 not in h.pool.sequences
    r = h.step(Req(1, list(range(6, 20)), 14))  # needs CoW + 3 more
    assert not r.ok
    assert h.pool.sequences[1].token_ids == list(range(6)) and h.pool.sequences[1].num_computed == 6
    assert [(b.block_id, b.ref_cnt, b.block_hash) for b in h.pool.block_pool.blocks] == before
    assert [b.block_id for b in h.pool.block_pool.free_queue] == free_order
    assert h.stats.prefix_cache_queries == 6


def test_a_sequence_that_can_never_fit_is_no_room():
    h = Harness(num_blocks=3)  # 2 usable blocks = 8 slots
    r = h.prefill(1, list(range(9)))
    assert not r.ok and h.stats.num_sequences == 0


def test_batch_handles_sequences_in_order_and_frees_first():
    h = Harness(num_blocks=4)
    h.prefill(1, list(range(12)))  # all 3 usable blocks
    r1, r2 = h.step(Req(2, [7, 7, 7], 3), Req(3, [8, 8, 8, 8, 8], 5), free=(1,))
    assert r1.ok and r2.ok and 1 not in h.pool.sequences
    r1, r2 = h.step(Req(4, [1] * 8, 8), Req(2, [9], 1))
    assert not r1.ok and r2.ok


def test_empty_prompt_creates_an_empty_sequence():
    h = Harness()
    r = h.prefill(1, [])
    assert r.ok and r.num_tokens == 0 and r.block_table == []
    r = h.step(Req(1, [5, 6], 2))
    assert r.num_tokens == 2 and len(r.block_table) == 1


# -- fork / copy-on-write --------------------------------------------------------


def test_fork_shares_blocks_and_copy_on_write_copies_the_partial_block():
    h = Harness()
    table = h.prefill(1, list(range(6))).block_table
    assert h.fork(1, 2, 3) == table
    assert [b.ref_cnt for b in h.pool.sequences[1].block_table] == [3, 3]
    r = h.decode(2, 50)  # writes position 6 in shared block 1
    assert r.copy_src == [table[1]] and len(r.copy_dst) == 1
    assert r.block_table_offset == 1 and r.block_table == r.copy_dst
    assert h.pool.sequences[2].block_table[0].block_id == table[0]
    r = h.decode(1, 60)  # still shared with 3
    assert len(r.copy_src) == 1
    r = h.decode(3, 70)  # now the only holder of the original: writes in place
    assert r.copy_src == [] and r.block_table == []
    assert h.stats.num_copies == 2
    assert h.stats.num_stored_tokens == 4 + 3 * 3


def test_fork_at_a_block_boundary_needs_no_copy():
    h = Harness()
    table = h.prefill(1, list(range(8))).block_table
    h.fork(1, 2)
    r = h.decode(2, 99)
    assert r.copy_src == [] and r.block_table_offset == 2 and len(r.block_table) == 1
    assert h.table(2)[:2] == table


def test_children_diverge_and_cache_their_own_blocks():
    h = Harness()
    h.prefill(1, list(range(6)))
    h.fork(1, 2)
    h.step(Req(1, [6, 7], 2), Req(2, [16, 17], 2))
    assert h.prefill(3, list(range(8)) + [0]).num_cached_tokens == 8
    assert h.prefill(4, list(range(6)) + [16, 17, 0]).num_cached_tokens == 8


def test_free_of_a_forked_family_returns_every_block():
    h = Harness()
    h.prefill(1, list(range(6)))
    h.fork(1, 2, 3)
    h.decode(2, 1)
    assert h.free(1) == 0  # shared with 3; the partial block still with 3
    assert h.free(2, 3) == 3
    assert h.stats.num_used_blocks == 0


# -- policies, reset, stats ------------------------------------------------------


def test_reserve_policy_allocates_max_model_len_at_admission():
    h = Harness(num_blocks=11, allocation_policy=AllocationPolicy.RESERVE, max_model_len=16)
    r = h.prefill(1, list(range(3)))
    assert len(r.block_table) == 4 and r.num_tokens == 3
    for t in range(3, 16):
        assert h.decode(1, t).block_table == []
    assert h.stats.num_allocated_slots == 16 and h.stats.num_stored_tokens == 16
    h.prefill(2, [1])
    assert h.stats.num_stored_tokens == 17 and h.stats.num_allocated_slots == 32
    assert not h.prefill(3, [1]).ok  # 2 blocks left, 4 needed


def test_reset_works_while_blocks_are_used_and_live_sequences_never_publish_again():
    h = Harness()
    h.prefill(1, list(range(9)))
    h.prefill(9, list(range(50, 55)))
    h.free(9)  # one findable free block, two findable used ones
    assert h.manager.reset_prefix_cache("p") == 3
    assert isinstance(h.events[-1], AllBlocksCleared)
    assert h.stats.num_cached_blocks == 0 and not h.pool.block_pool.cached_blocks
    assert h.stats.num_used_blocks == 3  # sequence 1 keeps its blocks
    assert h.prefill(2, list(range(9))).num_cached_tokens == 0
    for t in range(9, 16):  # sequence 1 fills blocks 2 and 3 after the reset: they stay unfindable
        h.decode(1, t)
    assert h.prefill(3, list(range(17))).num_cached_tokens == 8  # sequence 2's blocks, written after it
    assert all(b not in h.table(1) for b in h.table(3))


def test_a_new_executor_instance_invalidates_the_pool_but_keeps_it():
    h = Harness()
    config = h.pool.config
    assert h.manager.register_pool(config, "instance-a") is False  # first id seen: nothing to drop
    h.prefill(1, list(range(9)))
    assert h.manager.register_pool(config, "instance-a") is False
    assert h.prefill(2, list(range(9))).num_cached_tokens == 8
    assert h.manager.register_pool(config, "instance-b") is False  # restarted: same pool, nothing findable
    assert h.manager.pools["p"] is h.pool and set(h.pool.sequences) == {1, 2}
    assert h.prefill(3, list(range(9))).num_cached_tokens == 0
    assert h.prefill(2, list(range(9))).num_cached_tokens == 0


def test_usage_counts_cached_free_blocks_as_free():
    h = Harness(num_blocks=11)
    h.prefill(1, list(range(20)))
    assert h.stats.usage == pytest.approx(0.5)
    h.free(1)
    s = h.stats
    assert (s.usage, s.num_free_blocks, s.num_cached_blocks, s.num_used_blocks) == (0.0, 10, 5, 0)


def test_lookup_prefix_sees_only_published_blocks_and_changes_nothing():
    h = Harness(num_blocks=20)
    h.manager.register_pool(PoolConfig("q", 20, BS, "model-a", enable_prefix_caching=False))
    r = h.prefill(1, list(range(9)), report=False)
    assert h.manager.lookup_prefix(["p"], [Req(0, list(range(9)))]) == [[("p", 0)]]  # allocated, not written
    h.report(r)
    stats = h.stats
    queries = [Req(0, list(range(9))), Req(0, list(range(8))), Req(0, list(range(12)), cache_salt="s"), Req(0, [])]
    assert h.manager.lookup_prefix([], queries) == [
        [("p", 8), ("q", 0)], [("p", 4), ("q", 0)], [("p", 0), ("q", 0)], [("p", 0), ("q", 0)]]
    assert h.stats == stats  # no counter, no refcount, no LRU position moved
    assert h.prefill(2, list(range(9))).num_cached_tokens == 8  # what the lookup promised
    with pytest.raises(NotFound):
        h.manager.lookup_prefix(["nope"], queries)
    with pytest.raises(InvalidArgument):
        h.manager.lookup_prefix(["p"], [Req(0, [-1])])
