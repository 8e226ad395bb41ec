"""The router's choice (gateway.routing) and executor discovery (gateway.discovery), without services."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from gateway.discovery import ExecutorTarget, parse_targets, resolve_targets
from gateway.routing import DECODE_COST_TOKENS, Router, block_chain
from kvserve.errors import InvalidArgument


@dataclass
class FakeExecutor:
    address: str
    pending: int = 0
    running: int = 0
    block_size: int = 4

    @property
    def pool_id(self) -> str:
        return f"executor@{self.address}"

    def pending_tokens(self) -> int:
        return self.pending

    def num_running(self) -> int:
        return self.running


PROMPT = list(range(100, 164))  # 16 blocks of 4


def test_kv_routing_goes_where_the_prefix_is_published():
    a, b = FakeExecutor("a:1"), FakeExecutor("b:1")
    decision = Router("kv").choose([a, b], PROMPT, "", {a.pool_id: 0, b.pool_id: 60})
    assert decision.candidate is b and decision.cached_tokens == 60 and decision.policy == "kv"


def test_kv_routing_remembers_what_it_routed_before_it_is_published():
    a, b = FakeExecutor("a:1"), FakeExecutor("b:1")
    router = Router("kv")
    first = router.choose([a, b], PROMPT, "", {})
    second = router.choose([a, b], PROMPT[:40] + [7] * 24, "", {})
    assert second.candidate is first.candidate and second.cached_tokens == 40
    other_salt = router.choose([a, b], PROMPT, "tenant", {})
    assert other_salt.cached_tokens == 0
    router.pending.forget(first.candidate.address)  # its KV is gone
    assert router.choose([first.candidate], PROMPT, "", {}).cached_tokens == 0


def test_load_outweighs_a_short_prefix_but_not_a_long_one():
    busy, idle = FakeExecutor("a:1", pending=200, running=4), FakeExecutor("b:1")
    assert Router("kv").choose([busy, idle], PROMPT, "", {busy.pool_id: 8}).candidate is idle
    busy.pending, busy.running = 0, 2
    assert Router("kv").choose([busy, idle], PROMPT, "", {busy.pool_id: 60}).candidate is busy
    cost = Router("kv").choose([busy], PROMPT, "", {busy.pool_id: 60}).cost
    assert cost == len(PROMPT) - 60 + DECODE_COST_TOKENS * 2


def test_kv_without_kvmanager_routes_by_load_and_says_so():
    busy, idle = FakeExecutor("a:1", running=3), FakeExecutor("b:1")
    decision = Router("kv").choose([busy, idle], PROMPT, "", None)
    assert decision.candidate is idle and decision.policy == "least-loaded" and decision.cached_tokens == 0


def test_round_robin_and_least_loaded():
    executors = [FakeExecutor("a:1"), FakeExecutor("b:1"), FakeExecutor("c:1")]
    router = Router("round-robin")
    assert [router.choose(executors, PROMPT, "", None).candidate.address for _ in range(4)] == \
        ["a:1", "b:1", "c:1", "a:1"]
    executors[0].running = 1
    least = Router("least-loaded")
    chosen = {least.choose(executors, PROMPT, "", {executors[0].pool_id: 60}).candidate.address for _ in range(4)}
    assert chosen == {"b:1", "c:1"}, "ties go round-robin; the prefix does not count"
    with pytest.raises(ValueError):
        Router("random")


def test_block_chain_keys_depend_on_every_earlier_token():
    chain = block_chain(PROMPT, 4, "")
    assert len(chain) == 16
    changed = block_chain([0] + PROMPT[1:], 4, "")
    assert all(x != y for x, y in zip(chain, changed))
    assert block_chain(PROMPT[:3], 4, "") == []


def test_executor_addresses_parse():
    assert parse_targets("a:1, dns:///executor:50053") == [ExecutorTarget("a", 1, False),
                                                           ExecutorTarget("executor", 50053, True)]
    assert parse_targets("[::1]:7")[0].host == "::1"
    for bad in ("", "a", "a:x", "dns:///:5", "a:70000", ","):
        with pytest.raises(InvalidArgument, match="executor_address"):
            parse_targets(bad)


def test_dns_targets_give_every_address_and_keep_the_last_answer_on_failure(monkeypatch):
    answers = {"executor": [("10.0.0.2", 0), ("10.0.0.1", 0), ("10.0.0.2", 0)]}

    async def fake_getaddrinfo(host, port, **kwargs):
        if host not in answers:
            raise OSError("no such name")
        return [(None, None, None, "", addr) for addr in answers[host]]

    async def resolve(previous):
        monkeypatch.setattr(asyncio.get_running_loop(), "getaddrinfo", fake_getaddrinfo)
        return await resolve_targets(parse_targets("dns:///executor:50053,static:9"), previous)

    first = asyncio.run(resolve({}))
    target = ExecutorTarget("executor", 50053, True)
    assert first[target] == ["10.0.0.1:50053", "10.0.0.2:50053"]
    assert first[ExecutorTarget("static", 9, False)] == ["static:9"]
    del answers["executor"]
    assert asyncio.run(resolve(first))[target] == ["10.0.0.1:50053", "10.0.0.2:50053"]
