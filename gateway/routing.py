"""Which executor a request goes to: ``--routing kv`` (default), ``least-loaded``, ``round-robin``.

The ``kv`` score of executor *e* for a request of *P* prompt tokens, in tokens of
work that stand between the request and its first token there::

    cost(e) = (P - cached(e)) + queued(e) + DECODE_COST_TOKENS * running(e)

* ``cached(e)``: the longest prefix of the prompt whose KV *e* holds: what kvmanager's
  ``LookupPrefix`` says *e*'s pool has published, or what this gateway routed to *e*
  and is still being prefilled there (published only once written, so without this
  the second request of a burst with a shared system prompt would not see it);
* ``queued(e)``: prompt tokens waiting or half-prefilled in *e*'s scheduler, less the
  prefix hits the router expected for the waiting ones when it sent them there;
* ``running(e)``: sequences decoding on *e*; each slows every step a little, counted
  as ``DECODE_COST_TOKENS`` tokens of prefill.

The lowest cost wins; ties go round-robin. ``least-loaded`` is the same score with
``cached`` always 0; ``round-robin`` ignores everything. When kvmanager cannot
answer, ``kv`` routes as ``least-loaded`` and the decision is counted as such.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Protocol

from gateway.block_chains import BlockChainIndex

ROUTING_POLICIES = ("kv", "least-loaded", "round-robin")
DECODE_COST_TOKENS = 16
# Prompts routed per executor whose prefill may not be published yet.
PENDING_PREFIXES_PER_EXECUTOR = 4096


class Candidate(Protocol):
    """What the router reads of an executor backend."""

    address: str
    pool_id: str
    block_size: int

    def pending_tokens(self) -> int: ...

    def num_running(self) -> int: ...


@dataclass(frozen=True)
class RoutingDecision:
    candidate: Candidate
    policy: str  # the policy that decided: "kv", "least-loaded" (also kv without kvmanager), "round-robin"
    cached_tokens: int  # the prefix the router expects to hit there
    cost: int


def block_chain(token_ids: list[int], block_size: int, salt: str) -> list[int]:
    """One key per full block of the prompt, each depending on every token before it
    (a gateway-local index key, not kvmanager's hash)."""
    keys, key = [], hash(salt)
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        key = hash((key, tuple(token_ids[start:start + block_size])))
        keys.append(key)
    return keys


class PendingPrefixes:
    """Per executor: block chains of prompts routed there recently (bounded LRU).
    Forgets nothing on publication: a published prefix is also in kvmanager; one that
    was evicted costs a misroute, never a wrong token (kvmanager decides hits)."""

    def __init__(self, capacity: int = PENDING_PREFIXES_PER_EXECUTOR):
        self.capacity = capacity
        self._keys: dict[str, BlockChainIndex] = {}

    def record(self, address: str, keys: list[int]) -> None:
        known = self._keys.get(address)
        if known is None:
            known = self._keys[address] = BlockChainIndex(self.capacity)
        known.record(keys)

    def matched_blocks(self, address: str, keys: list[int]) -> int:
        known = self._keys.get(address)
        return known.num_leading(keys) if known is not None else 0

    def forget(self, address: str) -> None:
        """The executor's KV is gone (restart, departure)."""
        self._keys.pop(address, None)


class Router:
    def __init__(self, policy: str = "kv"):
        if policy not in ROUTING_POLICIES:
            raise ValueError(f"routing: must be one of {', '.join(ROUTING_POLICIES)}, got {policy!r}")
        self.policy = policy
        self.pending = PendingPrefixes()
        self._turn = itertools.count()

    def choose(self, candidates: list[Candidate], token_ids: list[int], salt: str,
               published: dict[str, int] | None) -> RoutingDecision:
        """``published``: kvmanager's cached tokens per pool id (None: kvmanager did not answer)."""
        turn = next(self._turn)
        if self.policy == "round-robin":
            return RoutingDecision(candidates[turn % len(candidates)], "round-robin", 0, 0)
        use_prefix = self.policy == "kv" and published is not None
        best: tuple[int, int, Candidate, int] | None = None
        chains: dict[int, list[int]] = {}
        for order, candidate in enumerate(candidates):
            cached = 0
            if use_prefix:
                bs = candidate.block_size
                keys = chains.setdefault(bs, block_chain(token_ids, bs, salt))
                local = self.pending.matched_blocks(candidate.address, keys) * bs
                cached = min(max(published.get(candidate.pool_id, 0), local), max(0, len(token_ids) - 1))
            cost = (len(token_ids) - cached) + candidate.pending_tokens() + \
                DECODE_COST_TOKENS * candidate.num_running()
            rank = (order - turn) % len(candidates)  # ties: round-robin
            if best is None or (cost, rank) < (best[0], best[1]):
                best = (cost, rank, candidate, cached)
        cost, _, chosen, cached = best
        if self.policy == "kv":
            self.pending.record(chosen.address, chains.get(chosen.block_size) or
                                block_chain(token_ids, chosen.block_size, salt))
        return RoutingDecision(chosen, "kv" if use_prefix else "least-loaded", cached, cost)
