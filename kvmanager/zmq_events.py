"""KV events on ZeroMQ in vLLM's wire format, for routers built for vLLM.

``python -m kvmanager --kv-events-zmq tcp://*:5557 [--kv-events-replay tcp://*:5558]``
publishes every pool's event batches (the same ones ``WatchEvents`` streams) the way
vLLM's ``ZmqEventPublisher`` does (``vllm/distributed/kv_events.py``, the version with
``medium`` and ``data_parallel_rank``, array-like structs):

* a PUB socket sends one multipart message per batch: ``[topic, seq, payload]``;
  ``seq`` is 8 bytes big-endian, 0 for the first message, + 1 per message (one
  counter for the socket, all pools together); ``topic`` is ``<--kv-events-topic>/<pool_id>``
  (just the pool id when the topic is empty), so a subscriber that filters on the
  topic prefix gets every pool and can still tell them apart;
* ``payload`` is msgpack of ``KVEventBatch`` = ``[ts, events, data_parallel_rank]``,
  each event a tagged array ``["BlockStored", block_hashes, parent_block_hash,
  token_ids, block_size, lora_id, medium]``, ``["BlockRemoved", block_hashes, medium]``
  or ``["AllBlocksCleared"]`` (msgspec ``Struct(array_like=True, tag=True)``). Block
  hashes are kvserve's 16-byte hashes (msgpack bin; vLLM's ``ExternalBlockHash`` is
  ``bytes | int``); ``parent_block_hash`` is nil at the start of a sequence;
  ``lora_id`` is nil without an adapter, else a stable 63-bit number derived from the
  adapter id (xxh3-64 of its UTF-8 bytes): kvserve adapters are named, not numbered;
* the replay socket (ROUTER) answers a request whose last frame is a start ``seq``
  (8 bytes big-endian) with one ``[seq, payload]`` message per buffered batch from
  that seq on (the last ``--kv-events-replay-buffer`` batches), then the end marker
  ``[seq = -1 (8 bytes, signed big-endian), b""]``, each behind the requester's
  envelope. A DEALER socket reads them all; a REQ socket (vLLM's example subscriber)
  only gets the first message of the answer, as with vLLM itself.

Encoding and sending run on a thread of their own: the event loop only enqueues.
This module needs ``pyzmq`` and ``msgspec`` (``pip install 'kvserve[kv-events]'``);
nothing imports it unless the flag is given.
"""
from __future__ import annotations

import queue
import threading
from array import array

import msgspec
import xxhash
import zmq

from kvmanager import events as ev
from kvserve.logs import get_logger

log = get_logger("kvmanager")

DEFAULT_TOPIC = "kv-events"
DEFAULT_REPLAY_BUFFER = 10_000  # batches, as vLLM's buffer_steps
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
_MAX_QUEUED = 100_000


# The wire schema (vLLM's field order; the tag is the class name).
class _Batch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: int | None = None


class _Event(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(_Event):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(_Event):
    block_hashes: list[bytes]
    medium: str | None


class AllBlocksCleared(_Event):
    pass


class KVEventBatch(_Batch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def lora_id_of(adapter_id: str) -> int | None:
    """vLLM numbers LoRA adapters; kvserve names them: a stable number for a name."""
    if not adapter_id:
        return None
    return xxhash.xxh3_64_intdigest(adapter_id.encode("utf-8")) & ((1 << 63) - 1)


def to_wire(batch: ev.EventBatch, data_parallel_rank: int | None = 0) -> KVEventBatch:
    medium = batch.medium or None
    out = []
    for event in batch.events:
        if isinstance(event, ev.BlockStored):
            tokens = event.token_ids
            out.append(BlockStored(
                block_hashes=list(event.block_hashes), parent_block_hash=event.parent_block_hash or None,
                token_ids=tokens.tolist() if isinstance(tokens, array) else list(tokens),
                block_size=event.block_size, lora_id=lora_id_of(event.adapter_id), medium=medium))
        elif isinstance(event, ev.BlockRemoved):
            out.append(BlockRemoved(block_hashes=list(event.block_hashes), medium=medium))
        elif isinstance(event, ev.AllBlocksCleared):
            out.append(AllBlocksCleared())
    return KVEventBatch(ts=batch.timestamp, events=out, data_parallel_rank=data_parallel_rank)


def _open(socket: zmq.Socket, endpoint: str) -> None:
    """ZeroMQ's convention: ``>endpoint`` connects, ``@endpoint`` or a plain one binds."""
    if endpoint.startswith(">"):
        socket.connect(endpoint[1:])
    else:
        socket.bind(endpoint.removeprefix("@"))


class ZmqEventPublisher:
    """A ``KVManager.event_sinks`` entry: PUB (+ optional ROUTER replay), one thread."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = DEFAULT_TOPIC,
                 replay_buffer: int = DEFAULT_REPLAY_BUFFER, data_parallel_rank: int = 0,
                 pool_id: str | None = None, hwm: int = 100_000) -> None:
        self.topic = topic
        self.pool_id = pool_id  # publish only this pool's events (None: every pool)
        self.data_parallel_rank = data_parallel_rank
        self._queue: queue.Queue[ev.EventBatch | None] = queue.Queue(_MAX_QUEUED)
        self._buffer: list[tuple[int, bytes]] = []
        self._buffer_size = replay_buffer
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay = None
        try:
            self._pub.setsockopt(zmq.SNDHWM, hwm)
            self._pub.setsockopt(zmq.LINGER, 0)
            _open(self._pub, endpoint)
            if replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                _open(self._replay, replay_endpoint)
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT) if self._replay else None
        self.num_dropped = 0
        self._thread = threading.Thread(target=self._run, name="kv-events-zmq", daemon=True)
        self._thread.start()

    # -- the event loop's side --------------------------------------------------------

    def __call__(self, batch: ev.EventBatch) -> None:
        """Enqueues a batch (never blocks: a full queue drops it, and says so)."""
        if self.pool_id is not None and batch.pool_id != self.pool_id:
            return
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.num_dropped += 1
            log.error("kv_events_zmq_queue_full", dropped=self.num_dropped)

    def close(self, timeout: float = 2.0) -> None:
        """Sends what is queued (within ``timeout``), then closes the sockets."""
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)
        if not self._thread.is_alive():  # a socket is never closed under the thread using it
            self._close_sockets()

    # -- the thread's side ----------------------------------------------------------------

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def _run(self) -> None:
        encode = msgspec.msgpack.Encoder().encode
        topic = f"{self.topic}/" if self.topic else ""
        seq = 0
        while True:
            if self._replay is not None:
                try:
                    while self._replay.poll(0):
                        self._answer_replay()
                except zmq.ZMQError as exc:
                    log.error("kv_events_replay_failed", error=repr(exc))
            try:
                batch = self._queue.get(timeout=0.02)
            except queue.Empty:
                continue
            if batch is None:
                return
            try:
                payload = encode(to_wire(batch, self.data_parallel_rank))
                seq_bytes = seq.to_bytes(8, "big")
                self._pub.send_multipart([(topic + batch.pool_id).encode("utf-8"), seq_bytes, payload])
            except Exception as exc:  # noqa: BLE001 — one bad batch must not stop the stream
                log.error("kv_events_publish_failed", error=repr(exc))
                continue
            if self._buffer_size > 0:
                self._buffer.append((seq, payload))
                if len(self._buffer) > 2 * self._buffer_size:  # trim in bulk: O(1) amortized
                    del self._buffer[:-self._buffer_size]
            seq += 1

    def _answer_replay(self) -> None:
        frames = self._replay.recv_multipart()
        # [identity, b"", start] from REQ (or a DEALER that sends the empty delimiter),
        # [identity, start] from a DEALER that does not.
        if len(frames) < 2 or len(frames[-1]) != 8:
            log.warning("kv_events_bad_replay_request", frames=len(frames))
            return
        envelope = frames[:-1]
        start = int.from_bytes(frames[-1], "big")
        buffered = self._buffer[-self._buffer_size:] if self._buffer_size > 0 else []
        for seq, payload in buffered:
            if seq >= start:
                self._replay.send_multipart([*envelope, seq.to_bytes(8, "big"), payload])
        self._replay.send_multipart([*envelope, END_OF_REPLAY, b""])
