"""KV events others can read: per-pool event ids, bounded replay, snapshots, and the
same events on ZeroMQ in vLLM's wire format (decoded here the way vLLM's documented
subscriber decodes them). Also: LookupPrefix with precomputed block hashes answers
what it answers from token ids."""
from __future__ import annotations

import random
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from kvmanager.events import AllBlocksCleared, BlockRemoved, BlockStored, EventsUnavailable
from kvserve.kv_medium import medium_for_device
from kvserve.prefix_hashes import prefix_block_hashes
from kvmanager.manager import KVManager
from kvmanager.pool import AllocationRequest as Req
from kvmanager.pool import PoolConfig
from kvserve.errors import FailedPrecondition, InvalidArgument
from tests.conftest import free_port, launch
from kvserve.v1 import kvmanager_pb2 as pb

try:  # the kv-events extra (in the test extra): only the ZeroMQ test needs it
    import msgspec
    import zmq
except ImportError:  # pragma: no cover
    msgspec = zmq = None
needs_zmq = pytest.mark.skipif(zmq is None, reason="pyzmq and msgspec (the kv-events extra) are not installed")

BS = 4


# -- the subscriber's side: an index built from events ------------------------------------


class Index:
    """What a router keeps: hash -> (parent hash, tokens, block size, adapter, medium)."""

    def __init__(self, strict: bool = True) -> None:
        self.blocks: dict[bytes, tuple] = {}
        self.last_event_id = 0
        self.strict = strict  # removals are of blocks it holds (it saw everything since a clear)

    def apply(self, batch) -> None:
        """A domain ``EventBatch``: numbered events must follow each other."""
        if not batch.snapshot:
            assert batch.first_event_id == self.last_event_id + 1, (batch.first_event_id, self.last_event_id)
            self.last_event_id = batch.last_event_id
        else:
            self.last_event_id = batch.snapshot_event_id
        for event in batch.events:
            self.apply_event(event, batch.medium)

    def apply_event(self, event, medium: str) -> None:
        if isinstance(event, BlockStored):
            bs = event.block_size
            tokens = list(event.token_ids)
            parent = event.parent_block_hash
            for i, h in enumerate(event.block_hashes):
                self.blocks[h] = (parent, tokens[i * bs:(i + 1) * bs], bs, event.adapter_id, medium)
                parent = h
        elif isinstance(event, BlockRemoved):
            for h in event.block_hashes:
                if self.strict:
                    del self.blocks[h]
                else:
                    self.blocks.pop(h, None)
        elif isinstance(event, AllBlocksCleared):
            self.blocks.clear()


def pool_index(manager: KVManager, pool_id: str) -> dict[bytes, tuple]:
    """The pool's own truth: every cached block's parent (empty for a first block) and tokens."""
    from kvserve.prefix_hashes import adapter_of_extra, split_key
    pool = manager.pools[pool_id]
    out = {}
    for h, block in pool.block_pool.cached_blocks.items():
        parent, extra, packed = split_key(block.block_key)
        tokens = [int.from_bytes(packed[i:i + 4], "little") for i in range(0, len(packed), 4)]
        out[h] = (b"" if parent == pool.root_hash else parent, tokens, pool.block_size, adapter_of_extra(extra),
                  pool.medium)
    return out


class Workload:
    """Random prompts sharing prefixes on a small pool: stores, evictions, resets."""

    def __init__(self, manager: KVManager, pool_id: str, seed: int = 0) -> None:
        self.manager, self.pool_id = manager, pool_id
        self.session = manager.open_session(pool_id).session_id
        self.rng = random.Random(seed)
        self.next_id = 0
        self.stems = [[self.rng.randrange(1000) for _ in range(12)] for _ in range(4)]

    def step(self) -> None:
        rng = self.rng
        if rng.random() < 0.03:
            self.manager.reset_prefix_cache(self.pool_id)
            return
        stem = rng.choice(self.stems)[:rng.randrange(0, 13)]
        prompt = stem + [rng.randrange(1000) for _ in range(rng.randrange(1, 10))]
        kw = {"adapter_id": "lora-a"} if rng.random() < 0.2 else {}
        self.next_id += 1
        results, _ = self.manager.allocate(self.pool_id, self.session, [],
                                           [Req(self.next_id, prompt, len(prompt), **kw)])
        if results[0].ok:
            self.manager.free(self.pool_id, self.session, [self.next_id], [self.next_id], [len(prompt)])


def make_manager(**kw) -> KVManager:
    manager = KVManager(**kw)
    manager.register_pool(PoolConfig("p", 12, BS, "model-a"), medium="CPU")
    manager.register_pool(PoolConfig("q", 12, BS, "model-a"))
    return manager


# -- ids, replay, snapshots (domain) -------------------------------------------------------


def test_event_ids_increase_per_pool_and_each_event_says_its_medium():
    manager = make_manager()
    got: dict[str, list] = {"p": [], "q": []}
    for pool_id in got:
        manager.subscribe(pool_id, got[pool_id].append)
    wp, wq = Workload(manager, "p", 1), Workload(manager, "q", 2)
    for _ in range(60):
        wp.step()
        wq.step()
    for pool_id, medium in (("p", "CPU"), ("q", "GPU")):
        ids = [b.first_event_id + i for b in got[pool_id] for i in range(len(b.events))]
        assert ids == list(range(1, len(ids) + 1)) and len(ids) > 10  # consecutive, from 1, per pool
        assert {b.medium for b in got[pool_id]} == {medium}
        assert {b.pool_id for b in got[pool_id]} == {pool_id}
        assert manager.hubs[pool_id].last_event_id == ids[-1]
    assert manager.hubs["p"].epoch != manager.hubs["q"].epoch
    # RegisterPool without a medium keeps the pool's; with one, records it (nothing else changes).
    last = manager.hubs["p"].last_event_id
    assert not manager.register_pool(PoolConfig("p", 12, BS, "model-a"))
    assert manager.pools["p"].medium == "CPU"
    assert not manager.register_pool(PoolConfig("p", 12, BS, "model-a"), medium="GPU")
    assert manager.pools["p"].medium == "GPU" and manager.hubs["p"].last_event_id == last
    assert medium_for_device("cuda:0") == "GPU" and medium_for_device("cpu") == "CPU" and medium_for_device("") == ""


def test_replay_from_an_id_returns_exactly_the_missed_events_then_the_live_ones():
    manager = make_manager()
    everything = []
    manager.subscribe("p", everything.append)
    work = Workload(manager, "p")
    for _ in range(40):
        work.step()
    flat = [(b.first_event_id + i, e) for b in everything for i, e in enumerate(b.events)]
    resume_at = flat[len(flat) // 2][0]
    later = []
    _, replayed = manager.watch("p", later.append, start_event_id=resume_at)
    replayed = list(replayed)
    got = [(b.first_event_id + i, e) for b in replayed for i, e in enumerate(b.events)]
    assert got == flat[resume_at - 1:]  # exactly the missed ones, the first batch cut to start there
    for _ in range(20):
        work.step()
    follower = Index(strict=False)  # joined mid-stream: only the numbering is checked
    follower.last_event_id = resume_at - 1
    for batch in replayed + later:
        follower.apply(batch)  # asserts no gap and no repeat between replay and live
    assert follower.last_event_id == manager.hubs["p"].last_event_id
    _, nothing = manager.watch("p", lambda b: None, start_event_id=follower.last_event_id + 1)
    assert nothing == []  # up to date: nothing to replay


def test_a_too_old_or_foreign_id_is_refused_or_answered_with_a_snapshot():
    manager = make_manager(event_buffer_size=5)
    work = Workload(manager, "p")
    while manager.hubs["p"].last_event_id < 30:
        work.step()
    hub = manager.hubs["p"]
    assert 5 <= hub.last_event_id - hub.oldest_buffered_event_id + 1 < 5 + 10  # at least N kept, whole batches
    for start, epoch in ((1, ""), (hub.last_event_id + 2, ""), (hub.last_event_id, "another-epoch")):
        with pytest.raises(EventsUnavailable) as info:
            manager.watch("p", lambda b: None, start_event_id=start, epoch=epoch)
        assert isinstance(info.value, FailedPrecondition) and "snapshot" in str(info.value)
        assert hub.num_subscribers == 0  # a refused watch subscribes nothing
    _, first = manager.watch("p", lambda b: None, start_event_id=1, snapshot=True)
    first = list(first)
    assert len(first) == 1 and first[0].snapshot and first[0].snapshot_event_id == hub.last_event_id
    _, ok = manager.watch("p", lambda b: None, start_event_id=hub.oldest_buffered_event_id, epoch=hub.epoch)
    ok = list(ok)
    assert ok and ok[-1].last_event_id == hub.last_event_id
    with pytest.raises(InvalidArgument):
        KVManager(event_buffer_size=-1)


@pytest.mark.parametrize("seed", range(4))
def test_snapshot_then_resume_rebuilds_the_index_of_a_follower_from_the_start(seed):
    manager = make_manager(event_buffer_size=10_000)
    from_start = Index()
    manager.subscribe("p", from_start.apply)
    work = Workload(manager, "p", seed)
    rejoined = None
    for step in range(150):
        work.step()
        if step == 70:  # a router restarts: snapshot, then the live events after it
            rejoined = Index()
            _, initial = manager.watch("p", rejoined.apply, snapshot=True)
            initial = list(initial)
            assert len(initial) == 1 and initial[0].snapshot and not initial[0].snapshot_continues
            snap = initial[0]
            assert isinstance(snap.events[0], AllBlocksCleared)
            rejoined.apply(snap)
            assert rejoined.blocks == from_start.blocks == pool_index(manager, "p")
        if step == 110:  # another one takes a snapshot and resumes from its id later
            (snap,) = manager.snapshot("p")
            late = Index()
            late.apply(snap)
    for _ in range(3):
        work.step()
    _, missed = manager.watch("p", late.apply, start_event_id=snap.snapshot_event_id + 1, epoch=snap.epoch)
    for batch in missed:
        late.apply(batch)
    truth = pool_index(manager, "p")
    assert from_start.blocks == rejoined.blocks == late.blocks == truth
    assert len(truth) > 0
    # Parents come before their children in a snapshot: a router can insert in order.
    seen = set()
    for event in next(manager.snapshot("p")).events:
        if isinstance(event, BlockStored):
            assert event.parent_block_hash in seen or event.parent_block_hash == b"" or \
                event.parent_block_hash not in truth
            seen.update(event.block_hashes)


def test_a_large_snapshot_comes_in_batches_and_does_not_see_later_changes(monkeypatch):
    import kvmanager.manager as manager_module
    monkeypatch.setattr(manager_module, "SNAPSHOT_BATCH_TOKENS", 10)
    manager = make_manager()
    from_start = Index()
    manager.subscribe("p", from_start.apply)
    work = Workload(manager, "p", 7)
    for _ in range(30):
        work.step()
    truth = pool_index(manager, "p")
    rejoined = Index()
    _, initial = manager.watch("p", rejoined.apply, snapshot=True)  # the state is taken here
    for _ in range(10):  # ... and the pool moves on before the snapshot is read
        work.step()
    batches = list(initial)
    assert len(batches) > 2 and [b.snapshot_continues for b in batches] == [True] * (len(batches) - 1) + [False]
    assert len({b.snapshot_event_id for b in batches}) == 1
    snapshot_only = Index()
    for batch in batches:
        snapshot_only.apply(batch)
    assert snapshot_only.blocks == truth  # the state at watch time
    late = Index()  # the snapshot, then the events after it: the pool now
    for batch in batches:
        late.apply(batch)
    _, rest = manager.watch("p", lambda b: None, start_event_id=batches[0].snapshot_event_id + 1)
    for batch in rest:
        late.apply(batch)
    assert late.blocks == from_start.blocks == pool_index(manager, "p")


# -- precomputed hashes in LookupPrefix (task: LookupPrefix under 1 ms) ---------------------


def test_lookup_with_block_hashes_answers_what_lookup_with_tokens_answers():
    manager = KVManager()
    manager.register_pool(PoolConfig("a", 64, BS, "model-a"))
    manager.register_pool(PoolConfig("b", 64, BS, "model-a"))  # hashes alike with a: one chain for both
    manager.register_pool(PoolConfig("c", 64, 2 * BS, "model-a"))
    manager.register_pool(PoolConfig("d", 64, BS, "model-b"))
    manager.register_pool(PoolConfig("e", 64, BS, "model-a", enable_prefix_caching=False))
    rng = random.Random(5)
    stem = [rng.randrange(50_000) for _ in range(40)]
    stored_hashes: list[bytes] = []
    manager.subscribe("a", lambda b: stored_hashes.extend(
        h for e in b.events if isinstance(e, BlockStored) for h in e.block_hashes))

    def publish(pool_id: str, prompt: list[int], salt: str = "") -> None:
        session = manager.open_session(pool_id).session_id
        seq_id = rng.randrange(1 << 40)
        manager.allocate(pool_id, session, [], [Req(seq_id, prompt, len(prompt), cache_salt=salt)])
        manager.free(pool_id, session, [seq_id], [seq_id], [len(prompt)])

    publish("a", stem[:33])
    publish("b", stem[:17])
    publish("c", stem[:40])
    publish("d", stem[:40])
    publish("e", stem[:40])
    publish("a", stem[:24], salt="s")

    @dataclass
    class Query:  # the attributes of a PrefixQuery
        token_ids: Sequence[int] = ()
        cache_salt: str = ""
        adapter_id: str = ""
        block_hashes: Sequence[bytes] = ()
        hashes_block_size: int = 0
        hashes_model_fingerprint: str = ""

    # The helper's hashes are the pool's (and the events') hashes.
    assert prefix_block_hashes("model-a", BS, stem[:33]) == stored_hashes[:8]
    pools = ["a", "b", "c", "d", "e"]
    for n in (0, 1, 4, 5, 9, 16, 17, 18, 25, 33, 40):
        for salt in ("", "s"):
            prompt = stem[:n]
            by_tokens = manager.lookup_prefix(pools, [Query(prompt, salt)])
            hashes = prefix_block_hashes("model-a", BS, prompt, salt)
            both = manager.lookup_prefix(pools, [Query(prompt, salt, block_hashes=hashes, hashes_block_size=BS,
                                                       hashes_model_fingerprint="model-a")])
            only = manager.lookup_prefix(pools, [Query((), salt, block_hashes=hashes, hashes_block_size=BS,
                                                       hashes_model_fingerprint="model-a")])
            assert both == by_tokens, (n, salt)
            # Hashes alone answer for the pools they were computed for; others cannot be asked.
            expected = [(p, c if p in ("a", "b") else 0) for p, c in by_tokens[0]]
            assert only == [expected], (n, salt)
            # Over gRPC message types as well.
            q = pb.PrefixQuery(token_ids=prompt, cache_salt=salt, block_hashes=hashes, hashes_block_size=BS,
                               hashes_model_fingerprint="model-a")
            assert manager.lookup_prefix(pools, [q]) == by_tokens
    assert manager.lookup_prefix(["a", "b"], [Query(stem[:40])]) == [[("a", 32), ("b", 16)]]
    # Wrong hashes with tokens: a miss where the hash is wrong, never a false hit.
    hashes = prefix_block_hashes("model-a", BS, stem[:40])
    hashes[3] = b"\x00" * 16
    got = manager.lookup_prefix(["a"], [Query(stem[:40], block_hashes=hashes, hashes_block_size=BS,
                                              hashes_model_fingerprint="model-a")])
    assert got == [[("a", 12)]]
    for bad in (dict(block_hashes=[b"x"], hashes_block_size=BS), dict(block_hashes=hashes, hashes_block_size=3)):
        with pytest.raises(InvalidArgument):
            manager.lookup_prefix(["a"], [Query(stem[:40], **bad)])


# -- over the wire: a real server, gRPC and ZeroMQ ----------------------------------------------

# The subscriber's types, defined here the way vLLM defines them (vllm/distributed/kv_events.py,
# examples/online_serving/kv_events_subscriber.py): array-like tagged structs.
if msgspec is not None:
    ExternalBlockHash = bytes | int

    class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list[Any]
        data_parallel_rank: int | None = None

    class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
        """Base class for all KV cache-related events"""

    class VBlockStored(KVCacheEvent, tag="BlockStored"):
        block_hashes: list[ExternalBlockHash]
        parent_block_hash: ExternalBlockHash | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None

    class VBlockRemoved(KVCacheEvent, tag="BlockRemoved"):
        block_hashes: list[ExternalBlockHash]
        medium: str | None

    class VAllBlocksCleared(KVCacheEvent, tag="AllBlocksCleared"):
        pass

    class KVEventBatch(EventBatch):
        events: list[VBlockStored | VBlockRemoved | VAllBlocksCleared]

    # An older vLLM subscriber (no medium, no data_parallel_rank) still decodes the stream.
    class OldBlockStored(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag="BlockStored"):
        block_hashes: list[int | bytes]
        parent_block_hash: int | bytes | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None

    class OldBlockRemoved(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag="BlockRemoved"):
        block_hashes: list[int | bytes]

    class OldAllBlocksCleared(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag="AllBlocksCleared"):
        pass

    class OldKVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list[OldBlockStored | OldBlockRemoved | OldAllBlocksCleared]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    pub, replay = free_port(), free_port()
    flags = ["--shutdown-grace", "1", "--kv-events-buffer", "8"]
    if zmq is not None:
        flags += ["--kv-events-zmq", f"tcp://127.0.0.1:{pub}", "--kv-events-replay", f"tcp://127.0.0.1:{replay}"]
    service = launch("kvmanager", flags, tmp_path_factory.mktemp("kvmanager"), timeout=60)
    service.zmq_pub, service.zmq_replay = f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}"
    yield service
    assert service.stop(signal.SIGTERM) == 0, service.logs()[-2000:]


def register(stub, pool_id: str, num_blocks: int = 6, medium: str = "") -> str:
    stub.RegisterPool(pb.RegisterPoolRequest(pool_id=pool_id, num_blocks=num_blocks, block_size=BS,
                                             model_fingerprint="m", enable_prefix_caching=True, medium=medium))
    return stub.OpenSession(pb.OpenSessionRequest(pool_id=pool_id)).session_id


def prefill(stub, pool_id: str, session: str, seq_id: int, tokens: list[int], adapter_id: str = "") -> None:
    """Allocate, then the written-KV report with the free, as the gateway does."""
    reply = stub.Allocate(pb.AllocateRequest(pool_id=pool_id, session_id=session, sequences=[
        pb.SequenceAllocation(seq_id=seq_id, token_ids=tokens, num_new_tokens=len(tokens),
                              enable_prefix_caching=True, adapter_id=adapter_id)]))
    assert reply.results[0].status == pb.ALLOCATION_STATUS_OK
    stub.Free(pb.FreeRequest(pool_id=pool_id, session_id=session, seq_ids=[seq_id],
                             written_seq_ids=[seq_id], written_num_tokens=[len(tokens)]))


def take(stream, n: int) -> list:
    out = []
    for batch in stream:
        out.append(batch)
        if len(out) == n:
            break
    stream.cancel()
    return out


def flatten(batches) -> list[tuple[int, str, Any]]:
    return [(e.event_id, e.WhichOneof("event"), getattr(e, e.WhichOneof("event"))) for b in batches for e in b.events]


def test_watch_events_resumes_by_id_and_snapshots_over_grpc(stub):
    session = register(stub, "resume", medium="CPU")
    live = stub.WatchEvents(pb.WatchEventsRequest(pool_id="resume"), timeout=30)
    live.initial_metadata()
    prefill(stub, "resume", session, 1, list(range(9)))  # stored: 2 blocks
    prefill(stub, "resume", session, 2, list(range(100, 109)))  # stored: 2 blocks, evicts 1 (5 usable)
    prefill(stub, "resume", session, 3, list(range(200, 209)))  # evicts seq 1's blocks
    batches = take(live, 4)  # stored, stored, removed (Allocate), stored (the report)
    events = flatten(batches)
    assert [i for i, _, _ in events] == list(range(1, len(events) + 1))
    assert {b.pool_id for b in batches} == {"resume"} and len({b.stream_epoch for b in batches}) == 1
    kinds = [k for _, k, _ in events]
    assert kinds == ["block_stored", "block_stored", "block_removed", "block_stored"]
    assert all(body.medium == "CPU" for _, k, body in events if k != "all_blocks_cleared")
    epoch = batches[0].stream_epoch

    # Resume from event 2: exactly events 2.. again (the buffer keeps the last 8).
    again = flatten(take(stub.WatchEvents(pb.WatchEventsRequest(pool_id="resume", start_event_id=2,
                                                                stream_epoch=epoch), timeout=30), 3))
    assert [(i, k, b.SerializeToString()) for i, k, b in again] == \
        [(i, k, b.SerializeToString()) for i, k, b in events[1:]]

    # Too old, or another epoch: FAILED_PRECONDITION, which says to take a snapshot.
    for _ in range(6):  # 10 events: the first two leave the buffer of 8
        stub.ResetPrefixCache(pb.ResetPrefixCacheRequest(pool_id="resume"))
    for request in (pb.WatchEventsRequest(pool_id="resume", start_event_id=1),
                    pb.WatchEventsRequest(pool_id="resume", start_event_id=3, stream_epoch="restarted")):
        with pytest.raises(grpc.RpcError) as info:
            take(stub.WatchEvents(request, timeout=30), 1)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "snapshot" in info.value.details()

    # A snapshot: what is cached now, and the id to resume after.
    prefill(stub, "resume", session, 4, list(range(300, 309)))
    snap = take(stub.WatchEvents(pb.WatchEventsRequest(pool_id="resume", start_event_id=1, snapshot=True),
                                 timeout=30), 1)[0]
    assert snap.snapshot and snap.stream_epoch == epoch
    kinds = [e.WhichOneof("event") for e in snap.events]
    assert kinds == ["all_blocks_cleared", "block_stored"] and all(e.event_id == 0 for e in snap.events)
    stored = snap.events[1].block_stored
    assert list(stored.token_ids) == list(range(300, 308)) and stored.parent_block_hash == b""
    assert stored.medium == "CPU" and len(stored.block_hashes) == 2
    resumed = take(stub.WatchEvents(pb.WatchEventsRequest(pool_id="resume", start_event_id=snap.snapshot_event_id,
                                                          stream_epoch=epoch), timeout=30), 1)
    assert flatten(resumed)[-1][0] == snap.snapshot_event_id  # the snapshot's last event is the one before


@needs_zmq
def test_zmq_stream_decodes_like_vllms_subscriber(server, stub):
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(server.zmq_pub)
    sub.setsockopt_string(zmq.SUBSCRIBE, "kv-events")
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    received: dict[int, tuple[bytes, bytes]] = {}  # seq -> (topic, payload)

    def drain(timeout_ms: int) -> None:
        while sub.poll(timeout_ms):
            topic, seq_bytes, payload = sub.recv_multipart()
            assert len(seq_bytes) == 8
            received[int.from_bytes(seq_bytes, "big")] = (topic, payload)
            timeout_ms = 50

    try:
        # PUB/SUB joins asynchronously: publish probe events until the subscriber sees one.
        probe = register(stub, "probe")
        deadline = time.monotonic() + 30
        n = 0
        while not received and time.monotonic() < deadline:
            n += 1
            prefill(stub, "probe", probe, n, [n * 10 + i for i in range(5)])
            drain(200)
        assert received, "no ZeroMQ message reached the subscriber"

        # The workload, through the normal Allocate / written-KV report path, watched over gRPC too.
        session = register(stub, "zmq", num_blocks=5, medium="CPU")
        watch = stub.WatchEvents(pb.WatchEventsRequest(pool_id="zmq"), timeout=30)
        watch.initial_metadata()
        prefill(stub, "zmq", session, 1, list(range(9)))
        prefill(stub, "zmq", session, 2, list(range(8)) + [50, 51, 52, 53, 54], adapter_id="")
        prefill(stub, "zmq", session, 3, list(range(100, 109)), adapter_id="lora-a")  # evicts
        stub.ResetPrefixCache(pb.ResetPrefixCacheRequest(pool_id="zmq"))
        grpc_batches = take(watch, 5)  # stored, stored, removed, stored, cleared
        deadline = time.monotonic() + 20
        while sum(t == b"kv-events/zmq" for t, _ in received.values()) < 5 and time.monotonic() < deadline:
            drain(200)
    finally:
        sub.close()

    seqs = sorted(received)
    assert seqs == list(range(seqs[0], seqs[-1] + 1))  # no gap once joined
    zmq_batches = [decoder.decode(received[s][1]) for s in seqs if received[s][0] == b"kv-events/zmq"]
    assert len(zmq_batches) == 5
    for batch in (decoder.decode(received[s][1]) for s in seqs):
        assert batch.data_parallel_rank == 0 and batch.ts > 1e9

    # Same events, field for field, as WatchEvents streams them.
    assert [len(b.events) for b in zmq_batches] == [len(b.events) for b in grpc_batches]
    lora_ids = set()
    for zb, gb in zip(zmq_batches, grpc_batches):
        assert zb.ts == pytest.approx(gb.timestamp)
        for ze, ge in zip(zb.events, gb.events):
            kind = ge.WhichOneof("event")
            if kind == "block_stored":
                g = ge.block_stored
                assert isinstance(ze, VBlockStored)
                assert ze.block_hashes == list(g.block_hashes) and all(len(h) == 16 for h in ze.block_hashes)
                assert ze.parent_block_hash == (g.parent_block_hash or None)
                assert ze.token_ids == list(g.token_ids) and ze.block_size == BS == g.block_size
                assert ze.medium == "CPU"
                assert (ze.lora_id is None) == (g.adapter_id == "")
                lora_ids.add(ze.lora_id)
            elif kind == "block_removed":
                assert isinstance(ze, VBlockRemoved) and ze.block_hashes == list(ge.block_removed.block_hashes)
                assert ze.medium == "CPU"
            else:
                assert isinstance(ze, VAllBlocksCleared)
    stored = [e for b in zmq_batches for e in b.events if isinstance(e, VBlockStored)]
    assert stored[0].parent_block_hash is None and stored[0].token_ids == list(range(8))
    assert stored[1].parent_block_hash == stored[0].block_hashes[1]  # continues the shared prefix
    assert stored[1].token_ids == [50, 51, 52, 53]
    assert len(lora_ids) == 2 and None in lora_ids
    assert isinstance(zmq_batches[-1].events[-1], VAllBlocksCleared)
    old = msgspec.msgpack.Decoder(type=OldKVEventBatch).decode(received[seqs[-1]][1])
    assert isinstance(old.events[-1], OldAllBlocksCleared)

    # Replay (ROUTER): a DEALER asks from a seq with REQ's envelope and reads every
    # buffered [seq, payload] from there, then the end marker (seq -1, empty payload).
    start = seqs[-3]
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(server.zmq_replay)
    try:
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        replayed = []
        while dealer.poll(10_000):
            empty, seq_bytes, payload = dealer.recv_multipart()
            assert empty == b""
            if not payload:
                assert int.from_bytes(seq_bytes, "big", signed=True) == -1
                break
            replayed.append((int.from_bytes(seq_bytes, "big"), payload))
        else:
            pytest.fail("no end-of-replay marker")
    finally:
        dealer.close()
    assert replayed == [(s, received[s][1]) for s in seqs if s >= start]

    # vLLM's example subscriber uses REQ: it gets the first replayed message.
    req = ctx.socket(zmq.REQ)
    req.setsockopt(zmq.LINGER, 0)
    req.connect(server.zmq_replay)
    try:
        req.send(seqs[-1].to_bytes(8, "big"))
        assert req.poll(10_000)
        seq_bytes, payload = req.recv_multipart()
        assert int.from_bytes(seq_bytes, "big") == seqs[-1] and payload == received[seqs[-1]][1]
    finally:
        req.close()


def test_the_zmq_flag_says_what_to_install_when_the_packages_are_missing(monkeypatch, capsys):
    import kvmanager.__main__ as main_module
    monkeypatch.setitem(sys.modules, "kvmanager.zmq_events", None)  # import fails as without pyzmq
    with pytest.raises(SystemExit) as info:
        main_module.main(["--kv-events-zmq", "tcp://127.0.0.1:0"])
    assert info.value.code == 2
    assert "pip install 'kvserve[kv-events]'" in capsys.readouterr().err
