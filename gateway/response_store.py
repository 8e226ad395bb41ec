"""Stored responses of the Responses API: ``store`` keeps a response, ``previous_response_id``
goes on from it, ``GET`` / ``DELETE /v1/responses/{id}`` read and forget it.

A stored response keeps the response object as it was returned, the input items of its request,
and the conversation it ends: the chat messages of every turn before it, its own input's, and its
output as the assistant's turn (never the ``instructions``, which OpenAI does not carry over to
the next response either). A request that names it as ``previous_response_id`` is that
conversation followed by its own input, so it renders to the same prompt as before plus the new
turn, and its KV is the prefix cache's.

Responses live in this gateway's memory, one tenant's apart from another's (a tenant cannot read,
continue or delete another's: to it they do not exist), the least recently used going first once
their size passes the capacity. A gateway restart forgets them.
"""
from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass

from kvserve.errors import InvalidArgument, NotFound
from kvserve.logs import get_logger

log = get_logger("gateway.response_store")

DEFAULT_CAPACITY_BYTES = 64 << 20  # --responses-store-mib's default


@dataclass(frozen=True)
class StoredResponse:
    response: dict  # the response object as returned
    input_items: list[dict]  # its request's input, as items
    messages: list[dict]  # the conversation's chat messages, this response's output last
    size: int  # bytes of the three as JSON: what the capacity counts


class ResponseStore:
    """Stored responses by (tenant, id), at most ``capacity_bytes`` of them; 0 stores none."""

    def __init__(self, capacity_bytes: int):
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes: must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[tuple[str, str], StoredResponse] = OrderedDict()
        self._bytes = 0

    @property
    def enabled(self) -> bool:
        return self.capacity_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def size_bytes(self) -> int:
        return self._bytes

    def keeps(self, store: bool | None) -> bool:
        """Whether a request's response is kept: ``store`` as sent, by default (OpenAI's) yes where
        this gateway stores responses."""
        if store and not self.enabled:
            raise InvalidArgument("store: this gateway stores no responses (started with --responses-store-mib 0); "
                                  "send store: false and each turn's whole input")
        return self.enabled if store is None else store

    def put(self, tenant: str, response: dict, input_items: list[dict], messages: list[dict]) -> bool:
        """Keeps a finished response; False where it alone is larger than the capacity."""
        size = len(json.dumps([response, input_items, messages], ensure_ascii=False).encode())
        if size > self.capacity_bytes:
            log.warning("response_not_stored", response_id=response["id"], bytes=size, capacity=self.capacity_bytes)
            return False
        key = (tenant, response["id"])
        self._drop(key)
        self._entries[key] = StoredResponse(response, input_items, messages, size)
        self._bytes += size
        while self._bytes > self.capacity_bytes:
            self._drop(next(iter(self._entries)))
        return True

    def get(self, tenant: str, response_id: str) -> StoredResponse:
        """The tenant's stored response (now the most recently used); NotFound where it has none by that id."""
        key = (tenant, response_id)
        stored = self._entries.get(key)
        if stored is None:
            raise NotFound(f"no stored response with id {response_id!r}")
        self._entries.move_to_end(key)
        return stored

    def previous(self, tenant: str, response_id: str | None) -> list[dict]:
        """The conversation a request's ``previous_response_id`` goes on from ([] for none)."""
        if response_id is None:
            return []
        if not self.enabled:
            raise InvalidArgument("previous_response_id: this gateway stores no responses (started with "
                                  "--responses-store-mib 0); send each turn's whole input")
        try:
            return self.get(tenant, response_id).messages
        except NotFound:
            raise InvalidArgument(f"previous_response_id: Previous response with id {response_id!r} not found "
                                  "(never stored, deleted, or forgotten: the store keeps the most recently used "
                                  "within its capacity, and a gateway restart forgets them)") from None

    def delete(self, tenant: str, response_id: str) -> None:
        """Forgets the tenant's stored response; NotFound where it has none by that id."""
        if not self._drop((tenant, response_id)):
            raise NotFound(f"no stored response with id {response_id!r}")

    def _drop(self, key: tuple[str, str]) -> bool:
        stored = self._entries.pop(key, None)
        if stored is None:
            return False
        self._bytes -= stored.size
        return True


def items_page(items: list[dict], order: str, limit: int, after: str | None) -> dict:
    """A page of OpenAI's list of ``items`` (each with an ``id``): ``order`` asc or desc, at most
    ``limit`` (1-100) of them, those after the item ``after`` (the previous page's last)."""
    if order not in ("asc", "desc"):
        raise InvalidArgument(f"order: asc or desc, got {order!r}")
    if not 1 <= limit <= 100:
        raise InvalidArgument(f"limit: between 1 and 100, got {limit}")
    ordered = items if order == "asc" else items[::-1]
    if after is not None:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise InvalidArgument(f"after: no input item {after!r} in this response")
        ordered = ordered[ids.index(after) + 1:]
    page = ordered[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(ordered) > limit}
