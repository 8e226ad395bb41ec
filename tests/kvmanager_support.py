"""Helpers for the kvmanager tests: an invariant checker over the domain state,
and a shadow executor that plays back Allocate results on a fake KV cache."""
from __future__ import annotations

from collections import Counter

from kvmanager.block_pool import NULL_BLOCK_ID
import kvmanager.pool as pool_module
from kvmanager.hashing import block_key
from kvmanager.pool import AllocationResult, KVPool


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
    for seq in pool.sequences.values():
        ids = [b.block_id for b in seq.block_table]
        assert len(ids) == len(set(ids)), f"seq {seq.seq_id} holds a block twice"
        holders.update(ids)
        assert NULL_BLOCK_ID not in ids
        assert seq.num_computed <= len(seq.token_ids)
        assert seq.num_computed <= len(seq.block_table) * bs

    filled: Counter[int] = Counter()  # slots of each block below some holder's num_computed
    for seq in pool.sequences.values():
        for i, block in enumerate(seq.block_table):
            n = min(bs, max(0, seq.num_computed - i * bs))
            filled[block.block_id] = max(filled[block.block_id], n)

    for block in bp.blocks[1:]:
        if block.ref_cnt:
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

    for seq in pool.sequences.values():
        assert len(seq.block_hashes) <= seq.num_computed // bs
        if not seq.prefix_caching:
            assert not seq.block_hashes
        parent = pool.root_hash
        for i, h in enumerate(seq.block_hashes):
            key = block_key(parent, seq.extra, seq.token_ids[i * bs:(i + 1) * bs])
            assert pool_module.hash_key(key) == h, f"seq {seq.seq_id} block {i}: stale hash"
            block = seq.block_table[i]
            if block.block_hash is not None:  # a cached block holds exactly these tokens
                assert block.block_hash == h and block.block_key == key
            parent = h


class ShadowExecutor:
    """Plays Allocate results on a fake KV cache that stores token ids per slot,
    keeping the client's view of each block table as a gateway would. A wrong
    block id, a missing copy or a bad prefix hit shows as a wrong token."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.slots: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.tables: dict[int, list[int]] = {}
        self.tokens: dict[int, list[int]] = {}

    def step(self, new_tokens: dict[int, list[int]], results: list[AllocationResult]) -> None:
        """Copies first (for the whole batch), then every sequence's writes."""
        for r in results:
            for src, dst in zip(r.copy_src, r.copy_dst):
                self.slots[dst] = self.slots[src].copy()
        for r in results:
            if not r.ok:
                continue
            table = self.tables.get(r.seq_id, [])[:r.block_table_offset] + list(r.block_table)
            self.tables[r.seq_id] = table
            tokens = self.tokens.setdefault(r.seq_id, [])
            tokens.extend(new_tokens.get(r.seq_id, []))
            bs = self.block_size
            for pos in range(r.start_position, r.start_position + r.num_tokens):
                self.slots[table[pos // bs]][pos % bs] = tokens[pos]

    def fork(self, parent: int, children: list[int], table: list[int]) -> None:
        assert table == self.tables.get(parent, [])
        for child in children:
            self.tables[child] = list(table)
            self.tokens[child] = list(self.tokens[parent])

    def free(self, seq_id: int) -> None:
        self.tables.pop(seq_id, None)
        self.tokens.pop(seq_id, None)

    def check(self, pool: KVPool) -> None:
        """Every computed position of every live sequence reads its own token."""
        bs = self.block_size
        assert set(self.tables) == set(pool.sequences)
        for seq_id, seq in pool.sequences.items():
            assert self.tables[seq_id] == [b.block_id for b in seq.block_table], f"seq {seq_id}: table drift"
            assert self.tokens[seq_id] == seq.token_ids
            table = self.tables[seq_id]
            for pos in range(seq.num_computed):
                assert self.slots[table[pos // bs]][pos % bs] == seq.token_ids[pos], (
                    f"seq {seq_id} pos {pos}: KV holds {self.slots[table[pos // bs]][pos % bs]}, "
                    f"token is {seq.token_ids[pos]}")
