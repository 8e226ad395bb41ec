"""Stored responses of the Responses API: ``store`` keeps a response, ``previous_response_id``
goes on from it, ``GET`` / ``DELETE /v1/responses/{id}`` read and forget it.

A stored response keeps the response object as it was returned, the input items of its request,
and the conversation it ends: the chat messages of every turn before it, its own input's, and its
output as the assistant's turn (never the ``instructions``, which OpenAI does not carry over to
the next response either). A request that names it as ``previous_response_id`` is that
conversation followed by its own input, so it renders to the same prompt as before plus the new
turn, and its KV is the prefix cache's.

Each tenant's responses are apart from another's: a tenant cannot read, continue or delete
another's (to it they do not exist). Two places keep them (``open_response_store``):

* ``memory``: this gateway's memory, the least recently used going first once their size passes
  the capacity; a gateway restart forgets them, another gateway does not see them.
* a Redis URL: one JSON string a response, ``kvserve:responses:{tenant}:{id}``, expiring after
  the TTL (OpenAI keeps responses 30 days); every gateway on that Redis sees them, and they
  outlive a gateway's restart.
"""
from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import asdict, dataclass

from kvserve.errors import InvalidArgument, NotFound, Unavailable
from kvserve.kv_store import describe_url
from kvserve.logs import get_logger

log = get_logger("gateway.response_store")

DEFAULT_CAPACITY_BYTES = 64 << 20  # --responses-store-mib's default
DEFAULT_TTL_S = 30 * 24 * 3600  # --responses-store-ttl's default: OpenAI's 30 days
REDIS_KEY_PREFIX = "kvserve:responses"
REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


@dataclass(frozen=True)
class StoredResponse:
    response: dict  # the response object as returned
    input_items: list[dict]  # its request's input, as items
    messages: list[dict]  # the conversation's chat messages, this response's output last


class ResponseStore(ABC):
    """Stored responses by (tenant, response id)."""

    enabled = True  # whether it stores anything

    @abstractmethod
    async def put(self, tenant: str, stored: StoredResponse) -> bool:
        """Keeps a finished response; False where it was not kept (it says why in the log)."""

    @abstractmethod
    async def get(self, tenant: str, response_id: str) -> StoredResponse:
        """The tenant's stored response; NotFound where it has none by that id."""

    @abstractmethod
    async def delete(self, tenant: str, response_id: str) -> None:
        """Forgets the tenant's stored response; NotFound where it has none by that id."""

    def stats(self) -> tuple[int, int] | None:
        """(responses, bytes) kept, where this store knows them without asking a server."""
        return None

    async def close(self) -> None:
        """Lets go of connections (nothing for the memory store)."""

    async def unreachable(self) -> str | None:
        """Why the store cannot be reached now (None: it can), for the start-up log."""
        return None

    def keeps(self, store: bool | None) -> bool:
        """Whether a request's response is kept: ``store`` as sent, by default (OpenAI's) yes where
        this gateway stores responses."""
        if store and not self.enabled:
            raise InvalidArgument("store: this gateway stores no responses (started with --responses-store-mib 0); "
                                  "send store: false and each turn's whole input")
        return self.enabled if store is None else store

    async def previous(self, tenant: str, response_id: str | None) -> list[dict]:
        """The conversation a request's ``previous_response_id`` goes on from ([] for none)."""
        if response_id is None:
            return []
        if not self.enabled:
            raise InvalidArgument("previous_response_id: this gateway stores no responses (started with "
                                  "--responses-store-mib 0); send each turn's whole input")
        try:
            return (await self.get(tenant, response_id)).messages
        except NotFound:
            raise InvalidArgument(f"previous_response_id: Previous response with id {response_id!r} not found "
                                  f"(never stored, deleted, or forgotten: {self.forgets})") from None

    @property
    @abstractmethod
    def forgets(self) -> str:
        """When this store forgets a response, for the not-found message."""


class MemoryResponseStore(ResponseStore):
    """In this gateway's memory, at most ``capacity_bytes`` of them (their JSON size), the least
    recently used (stored, read or gone on from) forgotten first; 0 stores none."""

    def __init__(self, capacity_bytes: int = DEFAULT_CAPACITY_BYTES):
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes: must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.enabled = capacity_bytes > 0
        self._entries: OrderedDict[tuple[str, str], tuple[StoredResponse, int]] = OrderedDict()
        self._bytes = 0

    @property
    def forgets(self) -> str:
        return ("this gateway keeps the most recently used within --responses-store-mib, in its memory: a "
                "restart forgets them, another gateway does not have them")

    def stats(self) -> tuple[int, int]:
        return len(self._entries), self._bytes

    async def put(self, tenant: str, stored: StoredResponse) -> bool:
        size = len(json.dumps(asdict(stored), ensure_ascii=False).encode())
        response_id = stored.response["id"]
        if size > self.capacity_bytes:
            log.warning("response_not_stored", response_id=response_id, bytes=size, capacity=self.capacity_bytes)
            return False
        key = (tenant, response_id)
        self._drop(key)
        self._entries[key] = (stored, size)
        self._bytes += size
        while self._bytes > self.capacity_bytes:
            self._drop(next(iter(self._entries)))
        return True

    async def get(self, tenant: str, response_id: str) -> StoredResponse:
        key = (tenant, response_id)
        entry = self._entries.get(key)
        if entry is None:
            raise NotFound(f"no stored response with id {response_id!r}")
        self._entries.move_to_end(key)
        return entry[0]

    async def delete(self, tenant: str, response_id: str) -> None:
        if not self._drop((tenant, response_id)):
            raise NotFound(f"no stored response with id {response_id!r}")

    def _drop(self, key: tuple[str, str]) -> bool:
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        self._bytes -= entry[1]
        return True


class RedisResponseStore(ResponseStore):
    """In Redis, shared by every gateway that names it, each response expiring ``ttl_s`` after it
    was stored. A Redis that does not answer is a 503 for what needs it; a response that could not
    be stored is returned all the same, with ``store: false``."""

    def __init__(self, url: str, ttl_s: int = DEFAULT_TTL_S):
        if ttl_s <= 0:
            raise ValueError(f"ttl_s: must be > 0, got {ttl_s}")
        try:
            import redis.asyncio
            from redis.asyncio.retry import Retry
            from redis.backoff import NoBackoff
        except ImportError as exc:
            raise ValueError(f"responses store {describe_url(url)!r} needs the redis package "
                             "(pip install 'redis>=5')") from exc
        self.url, self.ttl_s = url, ttl_s
        self._errors = (redis.exceptions.RedisError, OSError)
        self._client = redis.asyncio.Redis.from_url(
            url, socket_timeout=2, socket_connect_timeout=2,
            retry=Retry(NoBackoff(), 1, supported_errors=(redis.exceptions.ConnectionError,)))

    @property
    def forgets(self) -> str:
        return f"responses expire {self.ttl_s} s after they were stored in {describe_url(self.url)}"

    @staticmethod
    def key(tenant: str, response_id: str) -> str:
        # Tenant names have no ':' (gateway/tenants.py), so the tenant's part ends where it seems to.
        return f"{REDIS_KEY_PREFIX}:{tenant}:{response_id}"

    async def put(self, tenant: str, stored: StoredResponse) -> bool:
        value = json.dumps(asdict(stored), ensure_ascii=False)
        try:
            await self._client.set(self.key(tenant, stored.response["id"]), value, ex=self.ttl_s)
        except self._errors as exc:
            log.error("response_not_stored", response_id=stored.response["id"], store=describe_url(self.url),
                      error=f"{type(exc).__name__}: {exc}")
            return False
        return True

    async def get(self, tenant: str, response_id: str) -> StoredResponse:
        value = await self._call("read", self._client.get(self.key(tenant, response_id)))
        if value is None:
            raise NotFound(f"no stored response with id {response_id!r}")
        return StoredResponse(**json.loads(value))

    async def delete(self, tenant: str, response_id: str) -> None:
        if not await self._call("delete", self._client.delete(self.key(tenant, response_id))):
            raise NotFound(f"no stored response with id {response_id!r}")

    async def close(self) -> None:
        await self._client.aclose()

    async def unreachable(self) -> str | None:
        try:
            await self._call("answer", self._client.ping())
        except Unavailable as exc:
            return str(exc)
        return None

    async def _call(self, what: str, command):
        try:
            return await command
        except self._errors as exc:
            raise Unavailable(f"the responses store {describe_url(self.url)} failed to {what}: "
                              f"{type(exc).__name__}: {exc}") from exc


def open_response_store(place: str, capacity_mib: int, ttl_s: int) -> ResponseStore:
    """``--responses-store``: ``memory`` (``capacity_mib`` of it; 0 stores none) or a Redis URL
    (responses expiring after ``ttl_s``)."""
    if place == "memory":
        if capacity_mib < 0:
            raise ValueError(f"responses_store_mib: must be >= 0, got {capacity_mib}")
        return MemoryResponseStore(capacity_mib << 20)
    if place.startswith(REDIS_SCHEMES):
        if ttl_s <= 0:
            raise ValueError(f"responses_store_ttl: must be > 0, got {ttl_s}")
        return RedisResponseStore(place, ttl_s)
    raise ValueError(f"responses_store: 'memory' or a Redis URL (redis://host:port/db, rediss://..., "
                     f"unix:///path.sock), got {place!r}")


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
