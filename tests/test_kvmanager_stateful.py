"""Hypothesis stateful test: random allocate / append / fork / free / expire /
execute / reject / reset / executor restart on small pools, with the invariants
and a shadow executor checked after every step. Sequences belong to tenants (one
with a quota, one with twice the weight), may mark their system prompt shareable,
carry cache TTLs and a low priority; pins come and go and time passes.

The shadow executor replays every result on a fake KV cache (token id per slot)
only when the step is executed, and the written-KV reports reach the manager only
after that, as the gateway sends them. A wrong block id, a missed copy-on-write
or a prefix hit on KV nobody wrote shows up as a sequence reading another token
than its own, or a findable block holding something else.
"""
from __future__ import annotations

import copy

import pytest
from hypothesis import HealthCheck, event, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvmanager.manager import KVManager
from kvmanager.pool import AllocationPolicy, AllocationRequest as Req, PoolConfig
from kvserve.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from tests.kvmanager_support import PinRules, ShadowExecutor, check_invariants

# Prompts are a shared system prompt (or none) plus a tail over a 3-letter
# alphabet, so prefix hits and identical blocks computed twice are common.
SYSTEM_PROMPTS = [[], [7] * 8, list(range(10, 22)), list(range(10, 18)) + [5, 5]]
tokens = st.builds(lambda head, tail: head + tail, st.sampled_from(SYSTEM_PROMPTS),
                   st.lists(st.integers(0, 2), max_size=12))
lookaheads = st.sampled_from([0, 0, 1, 6])  # slots held past a step's tokens, when there is room
TENANTS = ["", "a", "b"]  # the default tenant; "a" has a quota; "b" twice the weight


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class KVManagerMachine(PinRules, RuleBasedStateMachine):
    @initialize(
        block_size=st.sampled_from([1, 2, 4, 8]),
        num_blocks=st.integers(2, 40),
        prefix_caching=st.booleans(),
        reserve=st.booleans(),
        max_model_len=st.integers(4, 40),
        paged_limit=st.booleans(),
        quota=st.sampled_from([0, 1, 3]),
    )
    def setup(self, block_size, num_blocks, prefix_caching, reserve, max_model_len, paged_limit, quota):
        if not reserve and not paged_limit:
            max_model_len = 0  # no limit
        self.clock = FakeClock()
        self.manager = KVManager(default_session_ttl_ms=1000, clock=self.clock)
        self.manager.governance.set_policy("a", 1.0, quota, 0)
        self.manager.governance.set_policy("b", 2.0, 0, 0)
        self.pins: dict[int, dict] = {}  # pin id -> {pool: block ids it held at the last check}
        policy = AllocationPolicy.RESERVE if reserve else AllocationPolicy.PAGED
        self.manager.register_pool(PoolConfig("p", num_blocks, block_size, "fp", prefix_caching,
                                              policy, max_model_len))
        self.pool = self.manager.pools["p"]
        self.shadow = ShadowExecutor(num_blocks, block_size)
        # Session 0 is short-lived (the one "expire" kills); session 1 lives long.
        self.sessions = [self.manager.open_session("p", ttl_ms=1000).session_id,
                         self.manager.open_session("p", ttl_ms=10**7).session_id]
        self.next_id = 0
        self.reports: list[dict[int, int]] = [{}, {}]  # per session: seq -> tokens written, not yet sent
        self.instance = 0

    def _new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    def _owned(self, who: int) -> list[int]:
        return sorted(self.pool.session_seq_ids.get(self.sessions[who], ()))

    def _steppable(self, who: int) -> list[int]:
        """The session's sequences with no step waiting for its Execute."""
        return [s for s in self._owned(who) if s not in self.shadow.pending]

    def _take_reports(self, who: int) -> tuple[list[int], list[int]]:
        reports, self.reports[who] = self.reports[who], {}
        live = [s for s in reports if s in self.pool.sequences]
        return live, [reports[s] for s in live]

    def _forget(self, seq_ids) -> None:
        for seq_id in seq_ids:
            self.shadow.free(seq_id)
            for reports in self.reports:
                reports.pop(seq_id, None)

    def _allocate(self, who: int, free: list[int], requests: list[Req]) -> None:
        snapshot = {r.seq_id: copy.copy(self.pool.sequences.get(r.seq_id)) for r in requests}
        before = {r.seq_id: (list(s.token_ids), s.num_computed, [b.block_id for b in s.block_table])
                  for r in requests if (s := self.pool.sequences.get(r.seq_id)) is not None}
        max_len = self.pool.config.max_model_len or float("inf")
        too_long = [r for r in requests if len(r.token_ids) + (
            len(self.pool.sequences[r.seq_id].token_ids) if r.seq_id in self.pool.sequences and r.seq_id not in free
            else 0) > max_len]
        if too_long:
            stats = self.manager.stats("p")
            with pytest.raises(InvalidArgument, match="max_model_len"):
                self.manager.allocate("p", self.sessions[who], free, requests, *self._take_reports(who))
            event("longer than max_model_len")
            assert self.manager.stats("p") == stats
            return
        written = self._take_reports(who)
        self._forget(free)
        results, _ = self.manager.allocate("p", self.sessions[who], free, requests, *written)
        assert [r.seq_id for r in results] == [r.seq_id for r in requests]
        for request, result in zip(requests, results):
            seq = self.pool.sequences.get(request.seq_id)
            if result.ok and result.num_cached_tokens:  # a hit is the tenant's own, or in its shared range
                for i, block in enumerate(seq.block_table[:result.num_cached_tokens // self.pool.block_size]):
                    expected = seq.shared_owner if i < seq.extras.num_shared_blocks else seq.owner
                    assert block.owner is expected, f"block {i} of tenant {block.owner.name} hit by {seq.owner.name}"
                    if i < seq.extras.num_shared_blocks:
                        event("hit in the shared range")
            if result.ok:
                event("ok") if not result.num_cached_tokens else event("prefix hit")
                if result.copy_src:
                    event("copy-on-write")
                assert result.num_cached_tokens % self.pool.block_size == 0
                if result.num_cached_tokens:  # a hit leaves the last prompt token to compute
                    assert snapshot[request.seq_id] is None and seq.publishes
                    assert result.num_cached_tokens <= len(request.token_ids) - 1
                    assert result.start_position == result.num_cached_tokens
                continue
            event("no room")
            if snapshot[request.seq_id] is None or request.seq_id in free:
                assert seq is None, "a new sequence with no room must not exist"
            else:  # no room: exactly as before
                assert (list(seq.token_ids), seq.num_computed,
                        [b.block_id for b in seq.block_table]) == before[request.seq_id]
        self.shadow.allocated({r.seq_id: r.token_ids for r in requests}, results)

    @rule()
    def execute(self):
        """The Execute of every pending step returns; its reports wait for the next call."""
        for seq_id, end in self.shadow.execute():
            owner = self.sessions.index(self.pool.sequences[seq_id].session_id)
            self.reports[owner][seq_id] = end

    @rule(who=st.integers(0, 1))
    def flush_reports(self, who):
        """An idle gateway sends its reports with a Free of nothing."""
        self.manager.free("p", self.sessions[who], [], *self._take_reports(who))

    @precondition(lambda self: self.shadow.pending)
    @rule()
    def reject(self):
        """The executor refuses the step: its sequences fail and are freed, never executed."""
        for seq_id in self.shadow.drop():
            owner = self.sessions.index(self.pool.sequences[seq_id].session_id)
            self.manager.free("p", self.sessions[owner], [seq_id], *self._take_reports(owner))
            self._forget([seq_id])

    @rule()
    def restart_executor(self):
        """The executor restarts; session 1's gateway notices (new instance id), registers
        the pool again and recomputes its sequences; session 0's gateway is dead and its
        sequences linger until its lease runs out."""
        self.shadow.restart()
        self.instance += 1
        self.manager.register_pool(self.pool.config, f"instance-{self.instance}")
        self._pins_released()
        doomed = self._owned(1)
        self.reports[1].clear()
        self.manager.free("p", self.sessions[1], doomed)
        self._forget(doomed)

    @rule(who=st.integers(0, 1), prompt=tokens, chunk=st.integers(0, 30), salt=st.sampled_from(["", "", "s"]),
          caching=st.booleans(), run=st.booleans(), lookahead=lookaheads, tenant=st.sampled_from(TENANTS),
          share=st.booleans(), ttl_ms=st.sampled_from([0, 0, 300]), priority=st.sampled_from([0, 0, 1]))
    def admit(self, who, prompt, chunk, salt, caching, run, lookahead, tenant, share, ttl_ms, priority):
        """A new sequence; with ``run``, its step is executed at once (as the gateway does).
        With ``share`` its system prompt (the head of ``prompt``) is marked shareable."""
        shared = next((len(p) for p in SYSTEM_PROMPTS[1:] if prompt[:len(p)] == p), 0) if share else 0
        self._allocate(who, [], [Req(self._new_id(), prompt, chunk, caching, salt, num_lookahead_slots=lookahead,
                                     tenant=tenant, num_shared_tokens=shared, cache_ttl_ms=ttl_ms,
                                     cache_priority=priority)])
        if run:
            self.execute()

    @rule(tenant=st.sampled_from(TENANTS), system=st.sampled_from(SYSTEM_PROMPTS[1:]), shared=st.booleans())
    def pin(self, tenant, system, shared):
        try:
            pin_id, _ = self.manager.governance.pin([], tenant, system, shared)
        except (ResourceExhausted, FailedPrecondition, InvalidArgument) as exc:
            event(f"pin refused: {type(exc).__name__}")
            return
        self.pins[pin_id] = set()
        # As the gateway's pin endpoint: compute the prefix once, as that tenant (or shared).
        self._allocate(1, [], [Req(self._new_id(), system + [0], len(system) + 1, True, tenant=tenant,
                                   num_shared_tokens=len(system) if shared else 0)])
        self.execute()
        self.flush_reports(1)

    @rule()
    def time_passes(self):
        """Cache TTLs run out (the sessions' leases are renewed first)."""
        for session_id in self.sessions:
            self.manager.renew_session(session_id)
        self.clock.now += 0.2

    def _pins_released(self) -> None:
        for pin_id in self.pins:
            self.pins[pin_id] = set()

    @precondition(lambda self: self.pool.sequences)
    @rule(who=st.integers(0, 1), data=st.data(), run=st.booleans())
    def readmit(self, who, data, run):
        """A new sequence whose prompt repeats a live one's tokens: a prefix hit is
        due exactly where that sequence's KV was reported written."""
        source = self.pool.sequences[data.draw(st.sampled_from(sorted(self.pool.sequences)))]
        prompt = source.token_ids[:data.draw(st.integers(0, len(source.token_ids)))]
        self._allocate(who, [], [Req(self._new_id(), prompt, len(prompt), True)])
        if run:
            self.execute()

    @rule(who=st.integers(0, 1), data=st.data())
    def step_batch(self, who, data):
        """One scheduler step over some of the session's sequences, maybe with frees."""
        owned = self._steppable(who)
        chosen = data.draw(st.lists(st.sampled_from(owned), unique=True) if owned else st.just([]))
        everything = self._owned(who)
        free = data.draw(st.lists(st.sampled_from(everything), unique=True, max_size=2) if everything
                         else st.just([]))
        free = [s for s in free if s not in chosen] + [self._new_id() + 1000]  # unknown ids are ignored
        requests = [Req(s, data.draw(st.lists(st.integers(0, 2), max_size=3)), data.draw(st.integers(0, 9)),
                        num_lookahead_slots=data.draw(lookaheads)) for s in chosen]
        if data.draw(st.booleans()):
            requests.append(Req(self._new_id(), data.draw(tokens), data.draw(st.integers(0, 30))))
        self._allocate(who, free, requests)

    @rule(who=st.integers(0, 1), token=st.integers(0, 2), lookahead=lookaheads)
    def decode(self, who, token, lookahead):
        """The common step: one sampled token for every sequence of the session (holding the
        next ``lookahead`` slots, as the gateway asks at a block boundary)."""
        # Siblings get different tokens, so that a write into a shared block shows.
        requests = [Req(s, [(token + k) % 3], 1, num_lookahead_slots=lookahead)
                    for k, s in enumerate(self._steppable(who))]
        self._allocate(who, [], requests)

    @precondition(lambda self: set(self.pool.sequences) - set(self.shadow.pending))
    @rule(data=st.data(), num_children=st.integers(1, 3))
    def fork(self, data, num_children):
        parent = data.draw(st.sampled_from(sorted(set(self.pool.sequences) - set(self.shadow.pending))))
        owner = self.sessions.index(self.pool.sequences[parent].session_id)
        children = [self._new_id() for _ in range(num_children)]
        table = self.manager.fork("p", self.sessions[owner], parent, children)
        self.shadow.fork(parent, children, table)

    @precondition(lambda self: self.pool.sequences)
    @rule(data=st.data())
    def free(self, data):
        seq_ids = data.draw(st.lists(st.sampled_from(sorted(self.pool.sequences)), min_size=1, max_size=3,
                                     unique=True))
        by_session: dict[str, list[int]] = {}
        for s in seq_ids:
            by_session.setdefault(self.pool.sequences[s].session_id, []).append(s)
        for session_id, ids in by_session.items():
            self.manager.free("p", session_id, ids, *self._take_reports(self.sessions.index(session_id)))
            self._forget(ids)

    @rule()
    def expire_short_session(self):
        self.manager.renew_session(self.sessions[1])
        doomed = set(self._owned(0))
        self.clock.now += 1.5
        assert self.manager.reap_expired() == 1
        self._forget(doomed)
        assert not doomed & set(self.pool.sequences)
        self.sessions[0] = self.manager.open_session("p", ttl_ms=1000).session_id

    @rule()
    def reset_prefix_cache(self):
        self.manager.reset_prefix_cache("p")
        self._pins_released()
        assert not self.pool.block_pool.cached_blocks

    @invariant()
    def consistent(self):
        if not hasattr(self, "pool"):
            return
        check_invariants(self.pool)
        self.shadow.check(self.pool)
        for pin_id, held_before in self.pins.items():  # a pinned block stays held (and cached)
            held = {block.block_id for block in self.pool.pins.pins[pin_id].held.values()}
            assert held_before <= held, f"pin {pin_id} lost blocks {held_before - held}"
            if held:
                event("a pin holds blocks")
            self.pins[pin_id] = held
        ledger = self.pool.block_pool.tenants.get("a")
        if ledger is not None and ledger.policy.quota_blocks and ledger.num_cached == ledger.policy.quota_blocks:
            event("tenant a at its quota")

    def teardown(self):
        if not hasattr(self, "pool"):
            return
        for session_id in self.sessions:
            self.manager.close_session(session_id)
        for pin_id in self.pins:
            self.manager.governance.unpin(pin_id)
        check_invariants(self.pool)
        stats = self.manager.stats("p")
        assert stats.num_used_blocks == 0 and stats.num_sequences == 0 and stats.num_stored_tokens == 0
        assert stats.num_free_blocks == stats.num_blocks - 1


KVManagerMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow], derandomize=True,
)
test_kvmanager_state_machine = KVManagerMachine.TestCase
