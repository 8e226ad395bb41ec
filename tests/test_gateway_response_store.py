"""The Responses API's stores (gateway/response_store.py): per tenant; in memory bounded by bytes,
least recently used forgotten first; in a real Redis shared and expiring; with no capacity, asking
to store or to go on is a clear 400; a Redis that is gone is a 503, not a lost request."""
from __future__ import annotations

import asyncio

import pytest

from gateway.response_store import (MemoryResponseStore, RedisResponseStore, StoredResponse, items_page,
                                    open_response_store)
from kvserve.errors import InvalidArgument, NotFound, Unavailable
from tests.redis_support import redis_server, redis_url  # noqa: F401 — fixtures


def stored(rid: str, text: str = "x" * 100) -> StoredResponse:
    response = {"id": rid, "object": "response", "output": [{"type": "message", "content": [{"text": text}]}]}
    return StoredResponse(response, [{"id": f"msg_{rid}"}], [{"role": "user", "content": f"asked {rid}"},
                                                             {"role": "assistant", "content": f"answered {rid}"}])


def run(coroutine):
    return asyncio.run(coroutine)


def test_the_least_recently_used_go_first_once_the_bytes_pass_the_capacity():
    probe = MemoryResponseStore(1 << 20)
    run(probe.put("", stored("resp_a")))
    one = probe.stats()[1]
    store = MemoryResponseStore(3 * one + one // 2)  # room for three

    async def scenario():
        for rid in ("resp_a", "resp_b", "resp_c"):
            assert await store.put("", stored(rid))
        assert await store.previous("", "resp_a") == stored("resp_a").messages  # a is now the most recently used
        await store.put("", stored("resp_d"))
        assert store.stats()[0] == 3 and store.stats()[1] <= store.capacity_bytes
        with pytest.raises(NotFound):
            await store.get("", "resp_b")
        return [(await store.get("", rid)).response["id"] for rid in ("resp_a", "resp_c", "resp_d")]

    assert run(scenario()) == ["resp_a", "resp_c", "resp_d"]


def test_a_response_larger_than_the_whole_memory_store_is_not_kept_and_evicts_nothing():
    store = MemoryResponseStore(4096)

    async def scenario():
        assert await store.put("", stored("resp_small"))
        assert not await store.put("", stored("resp_big", text="y" * 8192))
        assert store.stats()[0] == 1 and await store.get("", "resp_small")
        with pytest.raises(InvalidArgument, match="not found"):
            await store.previous("", "resp_big")

    run(scenario())


def both_stores(redis_url):
    return [MemoryResponseStore(1 << 20), RedisResponseStore(redis_url)]


def test_tenants_do_not_see_each_other_s_responses(redis_url):
    async def scenario(store):
        await store.put("alice", stored("resp_1"))
        with pytest.raises(NotFound):
            await store.get("bob", "resp_1")
        with pytest.raises(NotFound):
            await store.delete("bob", "resp_1")
        with pytest.raises(InvalidArgument, match="Previous response with id 'resp_1' not found"):
            await store.previous("bob", "resp_1")
        assert (await store.get("alice", "resp_1")) == stored("resp_1")
        await store.delete("alice", "resp_1")
        with pytest.raises(NotFound):
            await store.get("alice", "resp_1")
        await store.close()

    for store in both_stores(redis_url):
        run(scenario(store))


def test_redis_keeps_a_response_for_every_gateway_until_its_ttl(redis_url):
    import redis

    async def write():
        store = RedisResponseStore(redis_url, ttl_s=600)
        assert await store.put("alice", stored("resp_shared"))
        await store.close()

    async def read():  # another gateway's store: another client, the same server
        store = RedisResponseStore(redis_url)
        try:
            return await store.get("alice", "resp_shared")
        finally:
            await store.close()

    run(write())
    assert run(read()) == stored("resp_shared")
    with redis.Redis.from_url(redis_url) as client:
        assert 590 <= client.ttl("kvserve:responses:alice:resp_shared") <= 600


def test_a_redis_that_is_gone_is_unavailable_and_a_response_it_cannot_keep_says_so(redis_server, redis_url):
    store = RedisResponseStore(redis_url)
    redis_server.stop()

    async def scenario():
        assert not await store.put("", stored("resp_lost"))
        with pytest.raises(Unavailable, match="responses store"):
            await store.get("", "resp_lost")
        with pytest.raises(Unavailable):
            await store.previous("", "resp_lost")
        await store.close()

    async def unreachable(store):
        try:
            return await store.unreachable()
        finally:
            await store.close()

    try:
        run(scenario())
        assert "responses store" in run(unreachable(RedisResponseStore(redis_url)))
    finally:
        redis_server.start()
    assert run(unreachable(RedisResponseStore(redis_url))) is None
    assert run(unreachable(MemoryResponseStore())) is None


def test_store_defaults_to_on_where_there_is_room_and_is_refused_where_there_is_none():
    assert MemoryResponseStore().keeps(None) and not MemoryResponseStore().keeps(False)
    empty = MemoryResponseStore(0)
    assert not empty.keeps(None) and not empty.keeps(False) and run(empty.previous("", None)) == []
    with pytest.raises(InvalidArgument, match="--responses-store-mib 0"):
        empty.keeps(True)
    with pytest.raises(InvalidArgument, match="previous_response_id: this gateway stores no responses"):
        run(empty.previous("", "resp_1"))


@pytest.mark.parametrize("place, mib, ttl, needle", [
    ("memory", -1, 60, "responses_store_mib"), ("redis://127.0.0.1:1/0", 64, 0, "responses_store_ttl"),
    ("s3://bucket", 64, 60, "responses_store: 'memory' or a Redis URL")])
def test_open_response_store_refuses_what_it_cannot_open(place, mib, ttl, needle):
    with pytest.raises(ValueError, match=needle):
        open_response_store(place, mib, ttl)


def test_input_items_page_as_openai_lists_them():
    items = [{"id": f"msg_{i}"} for i in range(5)]
    newest = items_page(items, "desc", 2, None)
    assert [i["id"] for i in newest["data"]] == ["msg_4", "msg_3"] and newest["has_more"]
    assert (newest["first_id"], newest["last_id"]) == ("msg_4", "msg_3")
    rest = items_page(items, "desc", 20, newest["last_id"])
    assert [i["id"] for i in rest["data"]] == ["msg_2", "msg_1", "msg_0"] and not rest["has_more"]
    assert items_page(items, "asc", 5, "msg_4") == {"object": "list", "data": [], "first_id": None, "last_id": None,
                                                     "has_more": False}
    for order, limit, after, needle in [("up", 5, None, "order"), ("asc", 0, None, "limit"),
                                        ("asc", 101, None, "limit"), ("asc", 5, "msg_9", "after")]:
        with pytest.raises(InvalidArgument, match=needle):
            items_page(items, order, limit, after)
