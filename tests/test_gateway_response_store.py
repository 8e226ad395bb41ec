"""The Responses API's store (gateway/response_store.py): per tenant, bounded by bytes, least
recently used forgotten first; with no capacity, asking to store or to go on is a clear 400."""
from __future__ import annotations

import pytest

from gateway.response_store import ResponseStore, items_page
from kvserve.errors import InvalidArgument, NotFound


def response(rid: str, text: str = "x" * 100) -> dict:
    return {"id": rid, "object": "response", "output": [{"type": "message", "content": [{"text": text}]}]}


def conversation(rid: str) -> list[dict]:
    return [{"role": "user", "content": f"asked {rid}"}, {"role": "assistant", "content": f"answered {rid}"}]


def put(store: ResponseStore, rid: str, tenant: str = "", **kwargs) -> bool:
    return store.put(tenant, response(rid, **kwargs), [{"id": f"msg_{rid}"}], conversation(rid))


def test_the_least_recently_used_go_first_once_the_bytes_pass_the_capacity():
    probe = ResponseStore(1 << 20)
    put(probe, "resp_a")
    one = probe.size_bytes
    store = ResponseStore(3 * one + one // 2)  # room for three
    for rid in ("resp_a", "resp_b", "resp_c"):
        assert put(store, rid)
    assert store.previous("", "resp_a") == conversation("resp_a")  # a is now the most recently used
    put(store, "resp_d")
    assert len(store) == 3 and store.size_bytes <= store.capacity_bytes
    with pytest.raises(NotFound):
        store.get("", "resp_b")
    assert [store.get("", rid).response["id"] for rid in ("resp_a", "resp_c", "resp_d")] == ["resp_a", "resp_c",
                                                                                               "resp_d"]


def test_a_response_larger_than_the_whole_store_is_not_kept_and_evicts_nothing():
    store = ResponseStore(4096)
    assert put(store, "resp_small")
    assert not put(store, "resp_big", text="y" * 8192)
    assert len(store) == 1 and store.get("", "resp_small")
    assert "not found" in str(pytest.raises(InvalidArgument, store.previous, "", "resp_big").value)


def test_tenants_do_not_see_each_other_s_responses():
    store = ResponseStore(1 << 20)
    put(store, "resp_1", tenant="alice")
    with pytest.raises(NotFound):
        store.get("bob", "resp_1")
    with pytest.raises(NotFound):
        store.delete("bob", "resp_1")
    with pytest.raises(InvalidArgument, match="Previous response with id 'resp_1' not found"):
        store.previous("bob", "resp_1")
    store.delete("alice", "resp_1")
    assert len(store) == 0 and store.size_bytes == 0


def test_store_defaults_to_on_where_there_is_room_and_is_refused_where_there_is_none():
    assert ResponseStore(1 << 20).keeps(None) and not ResponseStore(1 << 20).keeps(False)
    empty = ResponseStore(0)
    assert not empty.keeps(None) and not empty.keeps(False) and empty.previous("", None) == []
    with pytest.raises(InvalidArgument, match="--responses-store-mib 0"):
        empty.keeps(True)
    with pytest.raises(InvalidArgument, match="previous_response_id: this gateway stores no responses"):
        empty.previous("", "resp_1")
    with pytest.raises(ValueError):
        ResponseStore(-1)


def test_input_items_page_as_openai_lists_them():
    items = [{"id": f"msg_{i}"} for i in range(5)]
    newest = items_page(items, "desc", 2, None)
    assert [i["id"] for i in newest["data"]] == ["msg_4", "msg_3"] and newest["has_more"]
    assert (newest["first_id"], newest["last_id"]) == ("msg_4", "msg_3")
    rest = items_page(items, "desc", 20, newest["last_id"])
    assert [i["id"] for i in rest["data"]] == ["msg_2", "msg_1", "msg_0"] and not rest["has_more"]
    assert items_page(items, "asc", 5, "msg_4") == {"object": "list", "data": [], "first_id": None, "last_id": None,
                                                     "has_more": False}
    for order, limit, after, needle in [("up", 5, None, "order"), ("asc", 0, None, "limit"), ("asc", 101, None, "limit"),
                                        ("asc", 5, "msg_9", "after")]:
        with pytest.raises(InvalidArgument, match=needle):
            items_page(items, order, limit, after)
