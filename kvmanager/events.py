"""KV cache events, shaped like vLLM's (``BlockStored`` / ``BlockRemoved`` /
``AllBlocksCleared``), so that a router can index which prefixes a pool holds.

Events are collected while one call runs and published as one batch per call
(Allocate, Free, session expiry, reset) to every watcher of the pool.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class BlockStored:
    """Full blocks became findable by prefix hash (one chain of one sequence)."""

    block_hashes: list[bytes]
    parent_block_hash: bytes  # b"" when the first block starts its sequence
    token_ids: list[int]  # all stored blocks' tokens, concatenated
    block_size: int
    adapter_id: str = ""


@dataclass
class BlockRemoved:
    """Cached blocks were evicted (reused); their hashes are gone."""

    block_hashes: list[bytes]


@dataclass
class AllBlocksCleared:
    """The whole prefix cache of the pool was dropped."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass
class EventBatch:
    events: list[KVEvent]
    timestamp: float = field(default_factory=time.time)


class EventRecorder:
    """Collects the events of one call; ``removed`` coalesces consecutive evictions."""

    __slots__ = ("events",)

    def __init__(self) -> None:
        self.events: list[KVEvent] = []

    def stored(self, event: BlockStored) -> None:
        self.events.append(event)

    def removed(self, block_hash: bytes) -> None:
        last = self.events[-1] if self.events else None
        if isinstance(last, BlockRemoved):
            last.block_hashes.append(block_hash)
        else:
            self.events.append(BlockRemoved([block_hash]))

    def cleared(self) -> None:
        self.events.append(AllBlocksCleared())

    def drain(self) -> list[KVEvent]:
        events, self.events = self.events, []
        return events


Subscriber = Callable[[EventBatch], None]


class EventHub:
    """Fans batches out to the subscribers of one pool id.

    Subscribers are plain callables (the service wraps an asyncio queue), so
    this module needs no event loop. A subscriber that raises is dropped: one
    slow or broken watcher must never fail an Allocate.
    """

    def __init__(self) -> None:
        self._subscribers: dict[int, Subscriber] = {}
        self._next_token = 0

    def subscribe(self, subscriber: Subscriber) -> int:
        self._next_token += 1
        self._subscribers[self._next_token] = subscriber
        return self._next_token

    def unsubscribe(self, token: int) -> None:
        self._subscribers.pop(token, None)

    @property
    def num_subscribers(self) -> int:
        return len(self._subscribers)

    def publish(self, events: list[KVEvent]) -> None:
        if not events or not self._subscribers:
            return
        batch = EventBatch(events)
        for token, subscriber in list(self._subscribers.items()):
            try:
                subscriber(batch)
            except Exception:  # noqa: BLE001 — see the class docstring
                self._subscribers.pop(token, None)
