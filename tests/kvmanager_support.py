"""Helpers for the kvmanager tests: an invariant checker over the domain state,
and a shadow executor that plays back Allocate results on a fake KV cache."""
from __future__ import annotations

from collections import Counter

from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from kvmanager.block_pool import NULL_BLOCK_ID
import kvmanager.pool as pool_module
from kvserve.prefix_hashes import block_key
import struct

from kvmanager.pool import KVPool, StepAllocation


def check_invariants(pool: KVPool) -> None:
    """Every block in exactly one state; refcount = tables holding it; counters exact.
    (Hashes via ``pool_module.hash_key`` so that a test may monkeypatch it.)"""
    bp = pool.block_pool
    bs = bp.block_size
    null = bp.blocks[NULL_BLOCK_ID]
    assert null.ref_cnt == 0 and null.block_hash is None and null.prev_free is None

    queued = [b.block_id for b in bp.free_queue]
    assert len(queued) == len(set(queued)) == bp.num_free_blocks
    assert NULL_BLOCK_ID not in queued
    in_queue = set(queued)

    holders: Counter[int] = Counter()
    saving: Counter[int] = Counter()  # blocks held for store saves (ordered, not reported)
    for order in pool.save_orders + [o for pending in pool.pending_saves.values() for o in pending.values()]:
        saving[order.block.block_id] += 1
    holders.update(saving)
    pinned = Counter(b.block_id for pin in pool.pins.pins.values() for b in pin.held.values())
    holders.update(pinned)
    for seq in pool.sequences.values():
        ids = [b.block_id for b in seq.block_table]
        assert len(ids) == len(set(ids)), f"seq {seq.seq_id} holds a block twice"
        holders.update(ids)
        assert NULL_BLOCK_ID not in ids
        assert seq.num_written <= seq.num_computed <= len(seq.token_ids)
        assert seq.num_computed <= len(seq.block_table) * bs

    filled: Counter[int] = Counter()  # slots of each block below some holder's num_computed
    for seq in pool.sequences.values():
        for i, block in enumerate(seq.block_table):
            n = min(bs, max(0, seq.num_computed - i * bs))
            filled[block.block_id] = max(filled[block.block_id], n)

    for block in bp.blocks[1:]:
        if block.ref_cnt and not saving[block.block_id] and not pinned[block.block_id]:
            assert block.num_tokens == filled[block.block_id], block
        assert block.ref_cnt >= 0
        assert block.ref_cnt == holders[block.block_id], (block, holders[block.block_id])
        assert (block.ref_cnt == 0) == (block.block_id in in_queue), block
        assert 0 <= block.num_tokens <= bs
    num_used = sum(1 for b in bp.blocks[1:] if b.ref_cnt > 0)
    assert bp.num_used_blocks == num_used
    assert bp.num_free_blocks + bp.num_used_blocks + 1 == bp.num_blocks
    assert bp.num_stored_tokens == sum(b.num_tokens for b in bp.blocks[1:] if b.ref_cnt > 0)

    hashed = [b for b in bp.blocks if b.block_hash is not None]
    assert len(hashed) == len(bp.cached_blocks)
    for h, block in bp.cached_blocks.items():
        assert block.block_hash == h and pool_module.hash_key(block.block_key) == h
    assert bp.num_cached_free_blocks == sum(1 for b in hashed if b.ref_cnt == 0)
    for name, ledger in bp.tenants.items():  # tenants: what each holds, and its quota
        owned = [b for b in hashed if b.owner is ledger]
        assert ledger.num_cached == len(owned), f"tenant {name}: cached count"
        assert set(ledger.free_cached) == {b.block_id for b in owned if b.ref_cnt == 0}, f"tenant {name}: free LRU"
        quota = ledger.policy.quota_blocks
        assert not quota or ledger.num_cached <= quota, f"tenant {name} holds {ledger.num_cached} > quota {quota}"
        assert ledger.num_pinned == sum(b.num_pins for b in owned)
    assert all(b.owner is not None for b in hashed)
    assert all(b.num_pins == pinned[b.block_id] for b in bp.blocks)
    for pin in pool.pins.pins.values():  # a pin holds blocks cached under its tenant, with its hashes
        for block_hash, block in pin.held.items():
            assert block.block_hash == block_hash and block.owner is pin.ledger

    for seq in pool.sequences.values():
        assert len(seq.block_hashes) <= seq.num_written // bs  # only written blocks are ever hashed
        parent = pool.root_hash
        for i, h in enumerate(seq.block_hashes):
            key = block_key(parent, seq.extras.of_block(i), seq.token_ids[i * bs:(i + 1) * bs])
            assert pool_module.hash_key(key) == h, f"seq {seq.seq_id} block {i}: stale hash"
            block = seq.block_table[i]
            if block.block_hash is not None:  # a cached block holds exactly these tokens
                assert block.block_hash == h and block.block_key == key
            parent = h


class FakeClock:
    """A clock the test moves by hand (``clock.now += seconds``)."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class ShadowExecutor:
    """A fake KV cache that stores, per slot, the token id written there and whether
    the writer's context was valid; it plays Allocate results back as a gateway and
    an executor would. A wrong block id, a missing copy or a bad prefix hit shows
    as a sequence reading another token than its own, or a findable block that
    holds something else than the tokens it is found by.

    Two phases, as in the real system: ``allocated`` records a step's table changes
    (the gateway's view) and queues its copies and writes; ``execute`` runs what is
    queued (the Execute call) and returns the written-KV reports; ``drop`` forgets
    it (a rejected step). ``step`` does both at once.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        # slot -> (token, written with a valid context)
        self.slots: list[list[tuple[int, bool] | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.tables: dict[int, list[int]] = {}
        self.tokens: dict[int, list[int]] = {}
        self.pending: dict[int, tuple[list[tuple[int, int]], int, int]] = {}  # seq -> (copies, start, end)
        self.stale: set[int] = set()  # sequences whose KV predates an executor restart
        # The store tier: hash -> the block's slots as saved; loads queued per sequence; hashes that missed.
        self.store: dict[bytes, list] = {}
        self.pending_loads: dict[int, list[tuple[int, bytes]]] = {}
        self.missing: list[bytes] = []
        self.dropped: list[int] = []

    def allocated(self, new_tokens: dict[int, list[int]], results: list[StepAllocation]) -> None:
        for r in results:
            if not r.ok:
                continue
            assert r.seq_id not in self.pending, "two allocations of one sequence before its Execute"
            table = self.tables.get(r.seq_id, [])[:r.block_table_offset] + list(r.block_table)
            self.tables[r.seq_id] = table
            self.tokens.setdefault(r.seq_id, []).extend(new_tokens.get(r.seq_id, []))
            if r.store_load_block_ids:
                self.pending_loads[r.seq_id] = list(zip(r.store_load_block_ids, r.store_load_hashes))
            if r.num_tokens or r.copy_src:
                copies = list(zip(r.copy_src, r.copy_dst))
                self.pending[r.seq_id] = (copies, r.start_position, r.start_position + r.num_tokens)

    def execute(self) -> list[tuple[int, int]]:
        """Store loads, then copies (for the whole batch), then every sequence's writes; returns
        (seq_id, tokens written) for each sequence it ran. A sequence whose load misses is not run
        (``dropped``; the hashes in ``missing``), as the executor does."""
        bs = self.block_size
        for seq_id, loads in self.pending_loads.items():
            missed = [h for _, h in loads if h not in self.store]
            if missed:
                self.missing += missed
                self.dropped.append(seq_id)
                self.pending.pop(seq_id, None)
                continue
            for block_id, h in loads:
                self.slots[block_id] = [(t, ok and seq_id not in self.stale) for t, ok in self.store[h]]
        self.pending_loads.clear()
        for copies, _, _ in self.pending.values():
            for src, dst in copies:
                self.slots[dst] = self.slots[src].copy()
        for seq_id, (_, start, end) in self.pending.items():
            table, tokens = self.tables[seq_id], self.tokens[seq_id]
            for pos in range(start, end):
                self.slots[table[pos // bs]][pos % bs] = (tokens[pos], seq_id not in self.stale)
        done = [(seq_id, end) for seq_id, (_, _, end) in self.pending.items()]
        self.pending.clear()
        return done

    def drop(self) -> list[int]:
        """A rejected step: nothing queued runs; returns the sequences it held."""
        seq_ids = list(self.pending)
        self.pending.clear()
        self.pending_loads.clear()
        return seq_ids

    def save(self, block_ids, hashes) -> None:
        """Store saves: each block's slots as they are now."""
        for block_id, h in zip(block_ids, hashes):
            self.store[h] = list(self.slots[block_id])

    def check_store(self, index, root_hash: bytes) -> None:
        """An entry findable in the store (a ``StoreIndex``) holds, written with a valid context,
        the tokens it is found by; and its parent is findable too (or is the chain's root), since
        a chain is looked up from its first block: an entry below a missing one is unreachable."""
        for h, key in index.entries.items():
            expected = [(t, True) for t in key_tokens(key, self.block_size)]
            assert self.store.get(h) == expected, f"store entry {h.hex()} is findable but holds {self.store.get(h)}"
            parent = key[:len(root_hash)]
            assert parent == root_hash or parent in index.entries, f"store entry {h.hex()} outlived its parent"

    def step(self, new_tokens: dict[int, list[int]], results: list[StepAllocation]) -> list[tuple[int, int]]:
        self.allocated(new_tokens, results)
        return self.execute()

    def restart(self) -> None:
        """The executor restarted: every slot is garbage, every live sequence stale."""
        self.slots = [[None] * self.block_size for _ in range(self.num_blocks)]
        self.stale.update(self.tables)
        self.pending.clear()

    def fork(self, parent: int, children: list[int], table: list[int]) -> None:
        assert table == self.tables.get(parent, [])
        for child in children:
            self.tables[child] = list(table)
            self.tokens[child] = list(self.tokens[parent])
            if parent in self.stale:
                self.stale.add(child)

    def free(self, seq_id: int) -> None:
        self.tables.pop(seq_id, None)
        self.tokens.pop(seq_id, None)
        self.pending.pop(seq_id, None)
        self.pending_loads.pop(seq_id, None)
        self.stale.discard(seq_id)

    def check(self, pool: KVPool) -> None:
        """Every written position of every live sequence reads its own token, and
        every findable block holds what it is found by."""
        bs = self.block_size
        assert set(self.tables) == set(pool.sequences)
        for seq_id, seq in pool.sequences.items():
            assert self.tables[seq_id] == [b.block_id for b in seq.block_table], f"seq {seq_id}: table drift"
            assert self.tokens[seq_id] == seq.token_ids
            if seq_id in self.stale or seq_id in self.pending:
                continue  # garbage after a restart; or a copy-on-write copy not run yet
            table = self.tables[seq_id]
            for pos in range(seq.num_written):
                slot = self.slots[table[pos // bs]][pos % bs]
                assert slot is not None and slot[0] == seq.token_ids[pos], (
                    f"seq {seq_id} pos {pos}: KV holds {slot}, token is {seq.token_ids[pos]}")
        self.check_findable(pool)

    def check_findable(self, pool: KVPool) -> None:
        """A hit means the KV is there: every findable block holds, written with a
        valid context, the tokens it is found by."""
        for block in pool.block_pool.cached_blocks.values():
            expected = [(t, True) for t in key_tokens(block.block_key, self.block_size)]
            assert self.slots[block.block_id] == expected, (
                f"block {block.block_id} is findable but holds {self.slots[block.block_id]}")


def key_tokens(key: bytes, block_size: int) -> list[int]:
    """The token ids a block key (``prefix_hashes.block_key``) was computed from."""
    return list(struct.unpack(f"<{block_size}i", key[len(key) - 4 * block_size:]))


class PinRules:
    """The unpin rule of the kvmanager state machines that pin prefixes (tests/test_kvmanager_stateful.py,
    tests/test_gateway_kv_shadow.py): each keeps ``self.pins`` (pin id -> what the pin held) and
    ``self.manager``, and checks that pinned blocks stay held."""

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def unpin(self, data):
        pin_id = data.draw(st.sampled_from(sorted(self.pins)))
        self.manager.governance.unpin(pin_id)
        del self.pins[pin_id]
