"""``SequenceAllocation.num_precomputed_tokens``: accepted speculative drafts counted computed.

Drafts never enter kvmanager's token list: a step asks for lookahead slots, the executor
writes the drafts' KV there, and the next step appends the accepted drafts (plus the token
sampled after them) saying how many already have KV. They must count as computed (the
step starts after them, takes no block for them), become findable only once a written-KV
report covers them, and nothing else about the pool may change.
"""
from __future__ import annotations

import pytest

from kvmanager.manager import KVManager
from kvmanager.pool import AllocationRequest as Req, PoolConfig
from kvserve.errors import InvalidArgument
from tests.kvmanager_support import FakeClock, check_invariants

BS = 4


@pytest.fixture
def manager():
    m = KVManager(default_session_ttl_ms=1000, clock=FakeClock())
    m.register_pool(PoolConfig("p", 9, BS, "fp"))  # 8 usable blocks
    return m


def step(manager, session, seq_id, tokens, num_new, lookahead=0, precomputed=0, written=()):
    results, _ = manager.allocate("p", session, [], [Req(seq_id, tokens, num_new, num_lookahead_slots=lookahead,
                                                         num_precomputed_tokens=precomputed)],
                                  [s for s, _ in written], [n for _, n in written])
    check_invariants(manager.pool("p"))
    return results[0]


def test_accepted_drafts_count_computed_and_publish_only_when_reported(manager):
    s = manager.open_session("p").session_id
    prompt = [10, 11, 12, 13, 14, 15]
    first = step(manager, s, 1, prompt, 6, lookahead=1)  # prefill; sample token 16 at position 6
    assert (first.start_position, first.num_tokens) == (0, 6)
    # Decode 16 at position 6 with 4 drafts at 7..10: lookahead slots for them.
    decode = step(manager, s, 1, [16], 1, lookahead=4, written=[(1, 6)])
    assert (decode.start_position, decode.num_tokens) == (6, 1)
    held = first.block_table + list(decode.block_table)
    assert len(held) * BS >= 11
    used_before = manager.stats("p").num_used_blocks
    # 3 drafts (17, 18, 19) accepted, 20 sampled after them: position 10 is the next to compute.
    # Written so far: 7 tokens (the report cannot yet cover the drafts: kvmanager does not know them).
    with pytest.raises(InvalidArgument, match="written_num_tokens"):
        step(manager, s, 1, [], 0, written=[(1, 10)])
    after = step(manager, s, 1, [17, 18, 19, 20], 1, precomputed=3, written=[(1, 7)])
    assert (after.start_position, after.num_tokens) == (10, 1)
    assert not after.copy_src and manager.stats("p").num_used_blocks == used_before  # no block for them
    pool = manager.pool("p")
    full = prompt + [16, 17, 18, 19, 20]
    assert pool.cached_prefix_length(full + [0]) == 4  # only the block reported written: [10..13]
    step(manager, s, 1, [21], 1, written=[(1, 11)])
    assert pool.cached_prefix_length(full + [21, 0]) == 8  # [14, 15, 16, 17] includes an accepted draft
    manager.free("p", s, [1])
    assert manager.stats("p").num_used_blocks == 0
    check_invariants(pool)


def test_a_rejected_draft_is_never_findable(manager):
    s = manager.open_session("p").session_id
    step(manager, s, 1, [10, 11, 12], 3, lookahead=1)
    step(manager, s, 1, [13], 1, lookahead=4, written=[(1, 3)])  # 13 at 3, drafts 50, 51, 52 at 4..6: all wrong
    step(manager, s, 1, [14], 1, written=[(1, 4)])  # the token sampled instead goes to position 4
    step(manager, s, 1, [15], 1, written=[(1, 5)])
    step(manager, s, 1, [16], 1, written=[(1, 6)])
    step(manager, s, 1, [], 0, written=[(1, 7)])
    pool = manager.pool("p")
    assert pool.cached_prefix_length([10, 11, 12, 13, 50, 51, 52, 0, 0]) == 4
    assert pool.cached_prefix_length([10, 11, 12, 13, 14, 15, 16, 0, 0]) == 4  # the second block is not full yet


def test_precomputed_tokens_are_refused_where_their_kv_cannot_be(manager):
    s = manager.open_session("p").session_id
    with pytest.raises(InvalidArgument, match=r"sequences\[0\].num_precomputed_tokens: only an existing"):
        step(manager, s, 1, [1, 2, 3], 1, precomputed=1)
    step(manager, s, 1, [1, 2, 3, 4, 5], 2)  # 3 known tokens not computed yet
    with pytest.raises(InvalidArgument, match="still to compute"):
        step(manager, s, 1, [6, 7], 1, precomputed=1)
    step(manager, s, 1, [], 3)  # all 5 computed; blocks hold 8 positions
    with pytest.raises(InvalidArgument, match="more than the 2 token_ids"):
        step(manager, s, 1, [6, 7], 1, precomputed=3)
    with pytest.raises(InvalidArgument, match="not all in the 2 blocks"):
        step(manager, s, 1, [6, 7, 8, 9], 1, precomputed=4)
    manager.fork("p", s, 1, [2])  # now its blocks are shared with sequence 2
    with pytest.raises(InvalidArgument, match="shares with another sequence"):
        step(manager, s, 1, [6, 7], 1, precomputed=1)
    pool = manager.pool("p")
    assert pool.sequences[1].num_computed == 5 and len(pool.sequences[1].token_ids) == 5  # refusals changed nothing


def test_no_room_after_precomputed_tokens_leaves_the_sequence_as_it_was(manager):
    s = manager.open_session("p").session_id
    step(manager, s, 1, [1, 2, 3], 3, lookahead=5)  # 2 blocks: positions 0..7
    step(manager, s, 2, list(range(24)), 24)  # the other 6 blocks
    assert manager.stats("p").num_free_blocks == 0
    # 5 accepted drafts fill positions 3..7; the token after them needs a 3rd block: none free.
    result = step(manager, s, 1, [4, 5, 6, 7, 8, 9], 1, precomputed=5)
    assert not result.ok
    seq = manager.pool("p").sequences[1]
    assert (seq.num_computed, seq.token_ids) == (3, [1, 2, 3])
    manager.free("p", s, [2])
    result = step(manager, s, 1, [4, 5, 6, 7, 8, 9], 1, precomputed=5)
    assert result.ok and (result.start_position, result.num_tokens) == (8, 1)
    manager.free("p", s, [1])
    assert manager.stats("p").num_used_blocks == 0
