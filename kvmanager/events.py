"""KV cache events, shaped like vLLM's (``BlockStored`` / ``BlockRemoved`` /
``AllBlocksCleared``), so that a router can index which prefixes a pool holds.

Events are collected while one call runs and published as one batch per call
(Allocate, Free, session expiry, reset) to every watcher of the pool. Each pool's
hub numbers its events (``event_id``: 1, 2, 3, ... per pool, consecutive, never
reused while the process lives; ``epoch`` tells one process's numbering from the
next) and keeps the last ones for replay, so a watcher that reconnects resumes
where it stopped, or learns that it must take a snapshot instead.
"""
from __future__ import annotations

import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvserve.errors import FailedPrecondition

# Events each pool keeps for replay (python -m kvmanager --kv-events-buffer).
DEFAULT_EVENT_BUFFER = 10_000
# What a pool's KV is reported as when RegisterPool does not say (--kv-events-medium):
# vLLM's name for the device KV cache.
DEFAULT_MEDIUM = "GPU"


@dataclass
class BlockStored:
    """Full blocks became findable by prefix hash (one chain of one sequence)."""

    block_hashes: list[bytes]
    parent_block_hash: bytes  # b"" when the first block starts its sequence
    # All stored blocks' tokens, concatenated: an ``array("i")`` from the pool (4 bytes a
    # token in the replay buffer, not a Python int each), any int sequence otherwise.
    token_ids: Sequence[int]
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
    # Id of events[0]; events[i] has first_event_id + i. 0: not numbered (a snapshot).
    first_event_id: int = 0
    medium: str = ""  # where the pool's KV lives (RegisterPool.medium or the default)
    pool_id: str = ""
    epoch: str = ""  # the hub's epoch: event ids are comparable within one epoch only
    snapshot: bool = False  # the events recreate the pool's cached blocks (see pool.snapshot_events)
    snapshot_event_id: int = 0  # for a snapshot: the last event id it includes (0: none yet)
    snapshot_continues: bool = False  # more batches of the same snapshot follow this one

    @property
    def last_event_id(self) -> int:
        return self.first_event_id + len(self.events) - 1 if self.first_event_id else 0

    def tail_from(self, event_id: int) -> EventBatch:
        """This batch without its events numbered below ``event_id``."""
        skip = event_id - self.first_event_id
        if skip <= 0:
            return self
        return EventBatch(self.events[skip:], self.timestamp, event_id, self.medium, self.pool_id, self.epoch)


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


class EventsUnavailable(FailedPrecondition):
    """A watcher asked to resume from an event this hub no longer has (or never had):
    it must take a snapshot instead."""


class EventHub:
    """Numbers the batches of one pool id, keeps the last ones and fans them out.

    Subscribers are plain callables (the service wraps an asyncio queue), so
    this module needs no event loop. A subscriber that raises is dropped: one
    slow or broken watcher must never fail an Allocate.

    The replay buffer keeps whole batches, at least the last ``buffer_size`` events
    (the oldest batch goes once the others hold that many).
    """

    def __init__(self, pool_id: str = "", buffer_size: int = DEFAULT_EVENT_BUFFER) -> None:
        self.pool_id = pool_id
        self.epoch = uuid.uuid4().hex
        self.next_event_id = 1
        self.buffer_size = buffer_size
        self._buffer: deque[EventBatch] = deque()
        self._buffered_events = 0
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

    @property
    def last_event_id(self) -> int:
        """Id of the last event published (0: none yet)."""
        return self.next_event_id - 1

    @property
    def oldest_buffered_event_id(self) -> int:
        """The first id ``replay`` can start from."""
        return self._buffer[0].first_event_id if self._buffer else self.next_event_id

    def publish(self, events: list[KVEvent], medium: str = "") -> EventBatch | None:
        """Numbers, buffers and delivers one call's events; returns the batch (None if empty)."""
        if not events:
            return None
        batch = EventBatch(events, first_event_id=self.next_event_id, medium=medium, pool_id=self.pool_id,
                           epoch=self.epoch)
        self.next_event_id += len(events)
        if self.buffer_size > 0:
            buffer = self._buffer
            buffer.append(batch)
            self._buffered_events += len(events)
            while self._buffered_events - len(buffer[0].events) >= self.buffer_size:
                self._buffered_events -= len(buffer.popleft().events)
        for token, subscriber in list(self._subscribers.items()):
            try:
                subscriber(batch)
            except Exception:  # noqa: BLE001 — see the class docstring
                self._subscribers.pop(token, None)
        return batch

    def check_resumable(self, start_event_id: int, epoch: str = "") -> None:
        """Raises ``EventsUnavailable`` unless ``replay(start_event_id)`` can return every
        event from ``start_event_id`` on."""
        if epoch and epoch != self.epoch:
            raise EventsUnavailable(
                f"start_event_id: stream_epoch {epoch!r} is not the current one ({self.epoch!r}; the kvmanager "
                "restarted): take a snapshot")
        if start_event_id > self.next_event_id:
            raise EventsUnavailable(
                f"start_event_id: {start_event_id} is beyond the last event id {self.last_event_id} of pool "
                f"{self.pool_id!r} (the kvmanager restarted?): take a snapshot")
        oldest = self.oldest_buffered_event_id
        if start_event_id < oldest:
            raise EventsUnavailable(
                f"start_event_id: event {start_event_id} of pool {self.pool_id!r} is no longer buffered "
                f"(oldest kept: {oldest}, --kv-events-buffer {self.buffer_size}): take a snapshot")

    def replay(self, start_event_id: int, epoch: str = "") -> list[EventBatch]:
        """The buffered batches from event ``start_event_id`` on (the first one cut to start
        there). ``EventsUnavailable`` when some of them are gone (see ``check_resumable``)."""
        self.check_resumable(start_event_id, epoch)
        return [batch.tail_from(start_event_id) for batch in self._buffer
                if batch.last_event_id >= start_event_id]
