"""Sequences of one pool: Allocate (one step of one sequence), Fork and Free.

Anchored on nano-vllm's ``BlockManager`` and vLLM v1's ``KVCacheManager``:

* a sequence owns a block table (append-only, except that copy-on-write replaces
  an entry), its known token ids, how many of them have KV (``num_computed``) and
  the chained hashes of its full computed blocks;
* one step (``admit`` a new sequence, ``step`` an existing one) appends the
  tokens produced since the last step, looks a *new* sequence up in the prefix
  cache, schedules
  ``min(num_new_tokens, known - computed)`` tokens from ``num_computed`` on, makes
  room for them, and caches the blocks those tokens fill. Blocks become findable
  in the step that computes them (as in vLLM: the executor writes a layer's K/V
  before it runs attention, so a hit in the same step reads valid data);
* it is atomic: every block it needs is counted before anything changes, and
  "no room" leaves the sequence (and refcounts, and the cache) untouched.
"""
from __future__ import annotations

import enum
from collections.abc import Sequence as Sequence_
from dataclasses import dataclass, field

from kvmanager.block_pool import BlockPool, KVCacheBlock
from kvmanager.events import BlockStored, EventRecorder
from kvmanager.hashing import block_key, extra_keys, hash_key, root_hash


class AllocationPolicy(enum.IntEnum):
    """Values match ``kvserve.v1.AllocationPolicy``."""

    PAGED = 1
    RESERVE = 2


@dataclass(frozen=True)
class PoolConfig:
    pool_id: str
    num_blocks: int
    block_size: int
    model_fingerprint: str = ""
    enable_prefix_caching: bool = True
    allocation_policy: AllocationPolicy = AllocationPolicy.PAGED
    max_model_len: int = 0  # 0: no limit (paged only)


@dataclass(slots=True)
class AllocationRequest:
    """One sequence's part of a step (see ``SequenceAllocation`` in the proto).

    The domain only reads these attributes, so the service passes the protobuf
    ``SequenceAllocation`` messages as they are (no copy on the hot path).
    """

    seq_id: int
    token_ids: list[int] = field(default_factory=list)
    num_new_tokens: int = 0
    enable_prefix_caching: bool = True
    cache_salt: str = ""
    adapter_id: str = ""


@dataclass(slots=True)
class AllocationResult:
    seq_id: int
    ok: bool
    num_cached_tokens: int = 0
    start_position: int = 0
    num_tokens: int = 0
    block_table_offset: int = 0
    block_table: Sequence_[int] = ()
    copy_src: Sequence_[int] = ()
    copy_dst: Sequence_[int] = ()


class Sequence:
    __slots__ = ("seq_id", "session_id", "token_ids", "num_computed", "block_table",
                 "block_hashes", "prefix_caching", "extra", "adapter_id")

    def __init__(self, seq_id: int, session_id: str, prefix_caching: bool, extra: bytes, adapter_id: str):
        self.seq_id = seq_id
        self.session_id = session_id
        self.token_ids: list[int] = []
        self.num_computed = 0  # tokens whose KV is (being) written
        self.block_table: list[KVCacheBlock] = []
        self.block_hashes: list[bytes] = []  # of block_table[i] for each full computed block i
        self.prefix_caching = prefix_caching
        self.extra = extra  # hashed into every block: cache salt, adapter id
        self.adapter_id = adapter_id

    def fork(self, seq_id: int) -> Sequence:
        child = Sequence(seq_id, self.session_id, self.prefix_caching, self.extra, self.adapter_id)
        child.token_ids = self.token_ids.copy()
        child.num_computed = self.num_computed
        child.block_table = self.block_table.copy()
        child.block_hashes = self.block_hashes.copy()
        return child


# Shared empty result fields: most decode steps add no block and copy nothing.
_EMPTY: tuple = ()


class KVPool:
    """One paged KV cache: its blocks, its sequences and its counters."""

    def __init__(self, config: PoolConfig) -> None:
        self.config = config
        self.block_size = config.block_size
        self.events = EventRecorder()
        self.block_pool = BlockPool(config.num_blocks, config.block_size, self.events)
        self.root_hash = root_hash(config.model_fingerprint)
        self.sequences: dict[int, Sequence] = {}
        self.session_seq_ids: dict[str, set[int]] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.num_copies = 0

    # -- allocate --------------------------------------------------------------

    def step(self, seq: Sequence, new_token_ids: Sequence_[int], num_new_tokens: int) -> AllocationResult:
        """One step of an existing sequence. The caller (``KVManager.allocate``) has
        validated the request and checked that the sequence is the caller's."""
        start = seq.num_computed
        if num_new_tokens == 1 and len(new_token_ids) == 1 and start == len(seq.token_ids):
            # Fast path for the most common call of all, a decode step: one token
            # into a block the sequence already holds alone. (_schedule does the
            # same, with the general checks.)
            table = seq.block_table
            i = start // self.block_size
            if i < len(table) and table[i].ref_cnt == 1:
                block = table[i]
                seq.token_ids.append(new_token_ids[0])
                filled = start + 1 - i * self.block_size
                if filled > block.num_tokens:
                    self.block_pool.num_stored_tokens += filled - block.num_tokens
                    block.num_tokens = filled
                seq.num_computed = start + 1
                if filled == self.block_size and seq.prefix_caching:
                    self._cache_full_blocks(seq, i + 1)
                return AllocationResult(seq.seq_id, True, 0, start, 1, len(table), _EMPTY, _EMPTY, _EMPTY)
        return self._schedule(seq, new_token_ids, num_new_tokens, _EMPTY, is_new=False)

    def admit(self, session_id: str, request: AllocationRequest) -> AllocationResult:
        """Creates a sequence (prefix-cache lookup first), or returns NO_ROOM and creates nothing."""
        prefix_caching = self.config.enable_prefix_caching and request.enable_prefix_caching
        seq = Sequence(request.seq_id, session_id, prefix_caching,
                       extra_keys(request.cache_salt, request.adapter_id), request.adapter_id)
        hit_blocks: list[KVCacheBlock] = []
        if prefix_caching:
            hit_blocks, seq.block_hashes = self._find_cached_prefix(seq, request.token_ids)
        seq.block_table = hit_blocks.copy()
        seq.num_computed = len(hit_blocks) * self.block_size
        result = self._schedule(seq, request.token_ids, request.num_new_tokens, hit_blocks, is_new=True)
        if result.ok:
            self.sequences[seq.seq_id] = seq
            self.session_seq_ids.setdefault(session_id, set()).add(seq.seq_id)
            if prefix_caching:
                self.prefix_cache_queries += len(request.token_ids)
                self.prefix_cache_hits += len(hit_blocks) * self.block_size
            result.num_cached_tokens = len(hit_blocks) * self.block_size
        return result

    def _find_cached_prefix(self, seq: Sequence, prompt: list[int]) -> tuple[list[KVCacheBlock], list[bytes]]:
        """Longest run of consecutive cached full blocks, leaving at least the last
        prompt token to compute (a hit covers at most len(prompt) - 1 tokens)."""
        bs = self.block_size
        max_hit_blocks = max(0, (len(prompt) - 1) // bs)
        parent = self.root_hash
        hits: list[KVCacheBlock] = []
        hashes: list[bytes] = []
        for i in range(max_hit_blocks):
            key = block_key(parent, seq.extra, prompt[i * bs:(i + 1) * bs])
            parent = hash_key(key)
            block = self.block_pool.lookup(parent, key)
            if block is None:
                break
            hits.append(block)
            hashes.append(parent)
        return hits, hashes

    def _schedule(self, seq: Sequence, new_token_ids: Sequence_[int], num_new_tokens: int,
                  hit_blocks: list[KVCacheBlock], is_new: bool) -> AllocationResult:
        # This runs once per sequence per scheduler step: plain locals, no helper
        # calls on the common decode path (one token, no new block, no copy).
        bs = self.block_size
        pool = self.block_pool
        table = seq.block_table
        old_len = len(table)
        start = seq.num_computed
        num_tokens = len(seq.token_ids) + len(new_token_ids) - start  # >= 0: computed <= known
        if num_new_tokens < num_tokens:
            num_tokens = num_new_tokens
        end = start + num_tokens

        # Count every block this step needs before changing anything.
        required_slots = end
        if is_new and self.config.allocation_policy is AllocationPolicy.RESERVE:
            required_slots = max(end, self.config.max_model_len)
        num_append = (required_slots + bs - 1) // bs - old_len
        if num_append < 0:
            num_append = 0
        cow_indices = _EMPTY
        first = start // bs
        if num_tokens and first < old_len:  # the write starts in a block we hold
            last = min(old_len - 1, (end - 1) // bs)
            if first == last:
                if table[first].ref_cnt > 1:
                    cow_indices = [first]
            else:
                cow_indices = [i for i in range(first, last + 1) if table[i].ref_cnt > 1]
        num_needed = num_append + len(cow_indices)
        if num_needed:
            num_available = pool.free_queue.num_free_blocks
            if hit_blocks:  # free hit blocks leave the queue when taken: they cannot
                # also be evicted to make room for the same sequence
                num_available -= sum(1 for b in hit_blocks if b.ref_cnt == 0)
            if num_needed > num_available:
                return AllocationResult(seq.seq_id, False)

        # Apply.
        if hit_blocks:
            pool.touch(hit_blocks)
        seq.token_ids.extend(new_token_ids)
        copy_src = copy_dst = _EMPTY
        if num_needed:
            new_blocks = pool.get_new_blocks(num_needed)
            if cow_indices:
                copy_src, copy_dst = self._copy_on_write(table, cow_indices, new_blocks, start)
            table.extend(new_blocks)
        if num_tokens:  # the slots this step writes now hold (or are about to hold) KV
            for i in range(start // bs, (end - 1) // bs + 1):
                block = table[i]
                filled = end - i * bs
                if filled > bs:
                    filled = bs
                if filled > block.num_tokens:
                    pool.num_stored_tokens += filled - block.num_tokens
                    block.num_tokens = filled
        seq.num_computed = end
        if seq.prefix_caching and end // bs > len(seq.block_hashes):
            self._cache_full_blocks(seq, end // bs)

        if is_new:
            offset = 0
        elif cow_indices:
            offset = min(cow_indices[0], old_len)
        else:
            offset = old_len
        block_table = [b.block_id for b in table[offset:]] if offset < len(table) else _EMPTY
        return AllocationResult(seq.seq_id, True, 0, start, num_tokens, offset, block_table, copy_src, copy_dst)

    def _copy_on_write(self, table: list[KVCacheBlock], cow_indices: list[int],
                       new_blocks: list[KVCacheBlock], start: int) -> tuple[list[int], list[int]]:
        """Gives the sequence private blocks for the shared ones it is about to write
        (taking them off the end of ``new_blocks``); returns the (src, dst) copies."""
        bs = self.block_size
        pool = self.block_pool
        copy_src: list[int] = []
        copy_dst: list[int] = []
        for i in cow_indices:
            shared, private = table[i], new_blocks.pop()
            if i * bs < start:  # the block holds KV this sequence reads: copy it first
                copy_src.append(shared.block_id)
                copy_dst.append(private.block_id)
                pool.add_tokens(private, start - i * bs)
            table[i] = private
            pool.free_blocks((shared,))  # refcount > 1: stays used by the others
        self.num_copies += len(copy_src)
        return copy_src, copy_dst

    def _cache_full_blocks(self, seq: Sequence, num_full_blocks: int) -> None:
        """Hashes the blocks this step filled and makes them findable; one
        ``BlockStored`` per run of consecutive newly cached blocks."""
        bs = self.block_size
        hashes = seq.block_hashes
        run: BlockStored | None = None
        for i in range(len(hashes), num_full_blocks):
            parent = hashes[-1] if hashes else self.root_hash
            tokens = seq.token_ids[i * bs:(i + 1) * bs]
            key = block_key(parent, seq.extra, tokens)
            h = hash_key(key)
            hashes.append(h)
            if not self.block_pool.cache_block(seq.block_table[i], h, key):
                run = None
                continue
            if run is None:
                run = BlockStored([], parent if i else b"", [], bs, seq.adapter_id)
                self.block_pool.record_stored(run)
            run.block_hashes.append(h)
            run.token_ids.extend(tokens)

    # -- fork / free --------------------------------------------------------

    def fork(self, parent: Sequence, child_seq_ids: list[int]) -> list[int]:
        """Children share every block (refcount + 1), tokens and hashes."""
        for child_id in child_seq_ids:
            child = parent.fork(child_id)
            self.block_pool.touch(child.block_table)
            self.sequences[child_id] = child
            self.session_seq_ids.setdefault(parent.session_id, set()).add(child_id)
        return [b.block_id for b in parent.block_table]

    def free(self, seq_id: int) -> int:
        """Frees a sequence; its blocks go to the LRU tail in reverse order, so
        that its tail blocks are evicted before its head. Returns blocks freed."""
        seq = self.sequences.pop(seq_id)
        owned = self.session_seq_ids.get(seq.session_id)
        if owned is not None:
            owned.discard(seq_id)
            if not owned:
                del self.session_seq_ids[seq.session_id]
        return self.block_pool.free_blocks(reversed(seq.block_table))

    def free_session(self, session_id: str) -> int:
        """Frees every sequence of a session; returns how many."""
        seq_ids = list(self.session_seq_ids.get(session_id, ()))
        for seq_id in seq_ids:
            self.free(seq_id)
        return len(seq_ids)

    def reset_prefix_cache(self) -> int:
        num_cleared = self.block_pool.reset_prefix_cache()
        for seq in self.sequences.values():  # none hold blocks; drop stale chains
            seq.block_hashes.clear()
        return num_cleared

    def drain_events(self) -> list:
        return self.events.drain()
