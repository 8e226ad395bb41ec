"""kvmanager over gRPC against the real server process (``python -m kvmanager``)."""
from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest

from kvserve.v1 import kvmanager_pb2 as pb
from kvserve.v1 import kvmanager_pb2_grpc
from tests.conftest import REPO_ROOT, launch, service_env
BS = 4


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    service = launch("kvmanager", ["--reap-interval-ms", "50", "--shutdown-grace", "1"],
                     tmp_path_factory.mktemp("kvmanager"), timeout=60)
    yield service
    assert service.stop(signal.SIGTERM) == 0, service.logs()[-2000:]


_counter = iter(range(10**6))


@pytest.fixture
def pool(stub):
    """A fresh pool of 11 blocks of 4 tokens, and a session on it."""
    pool_id = f"pool-{next(_counter)}"
    assert stub.RegisterPool(pb.RegisterPoolRequest(
        pool_id=pool_id, num_blocks=11, block_size=BS, model_fingerprint="m",
        enable_prefix_caching=True, allocation_policy=pb.ALLOCATION_POLICY_PAGED, max_model_len=64)).created
    session = stub.OpenSession(pb.OpenSessionRequest(pool_id=pool_id, client_name="test")).session_id
    return pool_id, session


def seq(seq_id, tokens, n=None, **kw):
    return pb.SequenceAllocation(seq_id=seq_id, token_ids=tokens, num_new_tokens=len(tokens) if n is None else n,
                                 enable_prefix_caching=True, **kw)


def allocate(stub, pool, *sequences, free=(), report=True):
    """One step; then (``report``) the gateway's report that the step's KV is written."""
    pool_id, session = pool
    reply = stub.Allocate(pb.AllocateRequest(pool_id=pool_id, session_id=session, free_seq_ids=free,
                                             sequences=sequences))
    if report:
        done = [r for r in reply.results if r.status == pb.ALLOCATION_STATUS_OK]
        stub.Free(pb.FreeRequest(pool_id=pool_id, session_id=session, written_seq_ids=[r.seq_id for r in done],
                                 written_num_tokens=[r.start_position + r.num_tokens for r in done]))
    return reply


def stats(stub, pool):
    return stub.GetStats(pb.GetStatsRequest(pool_id=pool[0]))


def code_of(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details()


# -- scenarios ----------------------------------------------------------------------


def test_register_pool_again_returns_the_existing_pool(stub, pool):
    again = stub.RegisterPool(pb.RegisterPoolRequest(
        pool_id=pool[0], num_blocks=11, block_size=BS, model_fingerprint="m", enable_prefix_caching=True,
        allocation_policy=pb.ALLOCATION_POLICY_PAGED, max_model_len=64))
    assert again.created is False


def test_prefill_decode_prefix_hit_and_stats(stub, pool):
    r = allocate(stub, pool, seq(1, list(range(7)))).results[0]
    assert (r.status, r.start_position, r.num_tokens, r.block_table_offset, len(r.block_table)) == (
        pb.ALLOCATION_STATUS_OK, 0, 7, 0, 2)
    table = list(r.block_table)
    r = allocate(stub, pool, seq(1, [7])).results[0]
    assert (r.start_position, r.block_table_offset, list(r.block_table)) == (7, 2, [])
    r = allocate(stub, pool, seq(1, [8])).results[0]  # crosses into block 2
    assert (r.block_table_offset, len(r.block_table)) == (2, 1)
    table += list(r.block_table)
    response = allocate(stub, pool, seq(2, list(range(8)) + [50, 51]), free=[1])
    r = response.results[0]
    assert r.num_cached_tokens == 8 and list(r.block_table[:2]) == table[:2] and r.start_position == 8
    s = stats(stub, pool)
    assert (s.num_used_blocks, s.num_sequences, s.prefix_cache_hits, s.prefix_cache_queries) == (3, 1, 8, 17)
    assert response.kv_cache_usage == pytest.approx(0.3)
    assert s.num_stored_tokens == 10 and s.num_allocated_slots == 12 and s.num_sessions == 1
    assert s.allocation_policy == pb.ALLOCATION_POLICY_PAGED and s.enable_prefix_caching


def test_fork_copy_on_write_and_free(stub, pool):
    pool_id, session = pool
    table = list(allocate(stub, pool, seq(1, list(range(6)))).results[0].block_table)
    fork = stub.Fork(pb.ForkRequest(pool_id=pool_id, session_id=session, parent_seq_id=1, child_seq_ids=[2, 3]))
    assert list(fork.block_table) == table
    r2, r1 = allocate(stub, pool, seq(2, [90]), seq(1, [91])).results
    assert list(r2.copy_src) == [table[1]] and list(r2.block_table) == list(r2.copy_dst)
    assert list(r1.copy_src) == [table[1]] and r1.block_table_offset == 1
    assert stats(stub, pool).num_copies == 2
    freed = stub.Free(pb.FreeRequest(pool_id=pool_id, session_id=session, seq_ids=[1, 2, 3]))
    assert freed.num_blocks_freed == 4 and stats(stub, pool).num_used_blocks == 0


def test_eviction_order_and_hits_not_evicted_for_the_same_request(stub, pool):
    t1 = list(allocate(stub, pool, seq(1, list(range(0, 12)))).results[0].block_table)
    t2 = list(allocate(stub, pool, seq(2, list(range(100, 112)))).results[0].block_table)
    t3 = list(allocate(stub, pool, seq(3, list(range(200, 212)))).results[0].block_table)
    stub.Free(pb.FreeRequest(pool_id=pool[0], session_id=pool[1], seq_ids=[2]))
    stub.Free(pb.FreeRequest(pool_id=pool[0], session_id=pool[1], seq_ids=[1, 3]))
    # 10 usable blocks: 1 never used, then 2's tail first, then 1's and 3's.
    r = allocate(stub, pool, seq(4, list(range(300, 316)))).results[0]
    assert list(r.block_table) == [10] + t2[::-1]
    assert stats(stub, pool).num_evictions == 3
    # Hits on 1's two head blocks: 6 free blocks are left, 2 of them the hits,
    # so a request needing 2 hits + 5 new blocks does not fit...
    r = allocate(stub, pool, seq(5, list(range(0, 8)) + list(range(500, 520)))).results[0]
    assert r.status == pb.ALLOCATION_STATUS_NO_ROOM
    # ... and 2 hits + 4 new fits, evicting 1's tail and 3's blocks but not the hits.
    r = allocate(stub, pool, seq(6, list(range(0, 8)) + list(range(500, 516)))).results[0]
    assert r.num_cached_tokens == 8 and list(r.block_table) == t1[:2] + [t1[2]] + t3[::-1]
    assert stats(stub, pool).num_free_blocks == 0 and stats(stub, pool).num_evictions == 7


def test_no_room_is_a_result_not_an_error(stub, pool):
    big, small = allocate(stub, pool, seq(1, list(range(100, 145))), seq(2, [1, 2])).results
    assert big.status == pb.ALLOCATION_STATUS_NO_ROOM and small.status == pb.ALLOCATION_STATUS_OK
    assert stats(stub, pool).num_sequences == 1


def test_unwritten_blocks_are_not_findable_by_another_session(stub, pool):
    """Two gateways on one pool: B must not hit on blocks A allocated but nobody computed yet."""
    other = stub.OpenSession(pb.OpenSessionRequest(pool_id=pool[0], client_name="gateway-b")).session_id
    allocate(stub, pool, seq(1, list(range(9))), report=False)
    assert allocate(stub, (pool[0], other), seq(2, list(range(9))), report=False).results[0].num_cached_tokens == 0
    stub.Free(pb.FreeRequest(pool_id=pool[0], session_id=pool[1], written_seq_ids=[1], written_num_tokens=[9]))
    assert allocate(stub, (pool[0], other), seq(3, list(range(9)))).results[0].num_cached_tokens == 8


def test_written_reports_are_validated_and_a_bad_one_changes_nothing(stub, pool):
    allocate(stub, pool, seq(1, list(range(9))), report=False)
    other = stub.OpenSession(pb.OpenSessionRequest(pool_id=pool[0], client_name="other")).session_id
    before = stats(stub, pool)
    bad = {
        grpc.StatusCode.INVALID_ARGUMENT: [([1], [10]), ([1], []), ([1, 1], [4])],
        grpc.StatusCode.NOT_FOUND: [([99], [1])],
    }
    for code, cases in bad.items():
        for ids, nums in cases:
            request = pb.AllocateRequest(pool_id=pool[0], session_id=pool[1], written_seq_ids=ids,
                                         written_num_tokens=nums, sequences=[seq(2, list(range(9)))])
            assert code_of(lambda: stub.Allocate(request))[0] == code, (ids, nums)
    request = pb.FreeRequest(pool_id=pool[0], session_id=other, written_seq_ids=[1], written_num_tokens=[9])
    assert code_of(lambda: stub.Free(request))[0] == grpc.StatusCode.PERMISSION_DENIED
    assert stats(stub, pool) == before


def test_reset_works_while_blocks_are_in_use(stub, pool):
    allocate(stub, pool, seq(1, list(range(9))))
    assert stub.ResetPrefixCache(pb.ResetPrefixCacheRequest(pool_id=pool[0])).num_blocks_cleared == 2
    assert allocate(stub, pool, seq(2, list(range(9)))).results[0].num_cached_tokens == 0
    assert stats(stub, pool).num_sequences == 2


def test_a_restarted_executor_invalidates_blocks_another_session_holds(stub, pool):
    """The executor restarts while another session holds a block: the new gateway's
    RegisterPool (new executor_instance_id) makes its pool's old KV unfindable."""
    register = pb.RegisterPoolRequest(
        pool_id=pool[0], num_blocks=11, block_size=BS, model_fingerprint="m", enable_prefix_caching=True,
        allocation_policy=pb.ALLOCATION_POLICY_PAGED, max_model_len=64, executor_instance_id="first")
    assert not stub.RegisterPool(register).created
    allocate(stub, pool, seq(1, list(range(9))))  # the old gateway's session keeps holding these
    register.executor_instance_id = "second"
    assert not stub.RegisterPool(register).created
    fresh = stub.OpenSession(pb.OpenSessionRequest(pool_id=pool[0], client_name="new-gateway")).session_id
    assert allocate(stub, (pool[0], fresh), seq(2, list(range(9)))).results[0].num_cached_tokens == 0
    assert stats(stub, pool).num_sequences == 2


def test_cache_salt_isolates_tenants(stub, pool):
    allocate(stub, pool, seq(1, list(range(9)), cache_salt="a"))
    assert allocate(stub, pool, seq(2, list(range(9)), cache_salt="b")).results[0].num_cached_tokens == 0
    assert allocate(stub, pool, seq(3, list(range(9)), cache_salt="a")).results[0].num_cached_tokens == 8


def test_watch_events_streams_stored_removed_and_cleared(stub, pool):
    pool_id, session = pool
    stub.RegisterPool(pb.RegisterPoolRequest(pool_id=pool_id + "-small", num_blocks=3, block_size=BS,
                                             model_fingerprint="m", enable_prefix_caching=True))
    small = (pool_id + "-small", stub.OpenSession(pb.OpenSessionRequest(pool_id=pool_id + "-small")).session_id)
    stream = stub.WatchEvents(pb.WatchEventsRequest(pool_id=small[0]))
    stream.initial_metadata()  # subscribed once the server has sent headers
    batches = []

    def read():
        try:
            for batch in stream:
                batches.append(batch)
        except grpc.RpcError as exc:  # our cancel() below ends the stream
            assert exc.code() == grpc.StatusCode.CANCELLED

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    allocate(stub, small, seq(1, list(range(8))))
    allocate(stub, small, seq(2, [1]), free=[1])  # evicts the tail block
    stub.Free(pb.FreeRequest(pool_id=small[0], session_id=small[1], seq_ids=[2]))
    stub.ResetPrefixCache(pb.ResetPrefixCacheRequest(pool_id=small[0]))
    deadline = time.monotonic() + 10
    while len(batches) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    stream.cancel()
    reader.join(5)
    kinds = [[e.WhichOneof("event") for e in b.events] for b in batches]
    assert kinds == [["block_stored"], ["block_removed"], ["all_blocks_cleared"]]
    stored = batches[0].events[0].block_stored
    assert len(stored.block_hashes) == 2 and all(len(h) == 16 for h in stored.block_hashes)
    assert list(stored.token_ids) == list(range(8)) and stored.block_size == BS
    assert list(batches[1].events[0].block_removed.block_hashes) == [stored.block_hashes[1]]
    assert batches[0].timestamp > 1e9


# -- sessions -----------------------------------------------------------------------


def test_an_expired_session_frees_its_blocks(stub, pool):
    pool_id, _ = pool
    short = stub.OpenSession(pb.OpenSessionRequest(pool_id=pool_id, ttl_ms=300)).session_id
    allocate(stub, (pool_id, short), seq(1, list(range(10))))
    assert stats(stub, pool).num_used_blocks == 3
    assert stub.RenewSession(pb.RenewSessionRequest(session_id=short)).expires_in_ms == 300
    deadline = time.monotonic() + 5  # the server's reaper frees it; nobody calls in between
    while stats(stub, pool).num_used_blocks and time.monotonic() < deadline:
        time.sleep(0.05)
    s = stats(stub, pool)
    assert (s.num_used_blocks, s.num_sequences, s.num_sessions) == (0, 0, 1)
    code, _ = code_of(lambda: stub.RenewSession(pb.RenewSessionRequest(session_id=short)))
    assert code == grpc.StatusCode.NOT_FOUND


def test_two_clients_cannot_touch_each_others_sequences(stub, pool):
    pool_id, mine = pool
    other = stub.OpenSession(pb.OpenSessionRequest(pool_id=pool_id, client_name="other")).session_id
    allocate(stub, pool, seq(1, [1, 2, 3]))
    denied = [
        lambda: stub.Free(pb.FreeRequest(pool_id=pool_id, session_id=other, seq_ids=[1])),
        lambda: allocate(stub, (pool_id, other), seq(1, [4])),
        lambda: allocate(stub, (pool_id, other), free=[1]),
        lambda: stub.Fork(pb.ForkRequest(pool_id=pool_id, session_id=other, parent_seq_id=1, child_seq_ids=[9])),
    ]
    for call in denied:
        assert code_of(call)[0] == grpc.StatusCode.PERMISSION_DENIED
    assert stub.CloseSession(pb.CloseSessionRequest(session_id=mine)).num_sequences_freed == 1
    assert stats(stub, pool).num_used_blocks == 0


# -- bad input ----------------------------------------------------------------------


def test_bad_inputs_map_to_status_codes_naming_the_field(stub, pool):
    pool_id, session = pool
    cases = [
        (lambda: stub.RegisterPool(pb.RegisterPoolRequest(pool_id="x", num_blocks=10, block_size=3)),
         grpc.StatusCode.INVALID_ARGUMENT, "block_size"),
        (lambda: stub.RegisterPool(pb.RegisterPoolRequest(pool_id="", num_blocks=10, block_size=4)),
         grpc.StatusCode.INVALID_ARGUMENT, "pool_id"),
        (lambda: stub.RegisterPool(pb.RegisterPoolRequest(pool_id="x", num_blocks=4_000_000_000, block_size=4)),
         grpc.StatusCode.INVALID_ARGUMENT, "num_blocks"),
        (lambda: allocate(stub, pool, seq(1, [1, -5])), grpc.StatusCode.INVALID_ARGUMENT, "token_ids"),
        (lambda: allocate(stub, ("nope", session), seq(1, [1])), grpc.StatusCode.NOT_FOUND, "pool_id"),
        (lambda: allocate(stub, (pool_id, "nope"), seq(1, [1])), grpc.StatusCode.NOT_FOUND, "session_id"),
        (lambda: stub.Free(pb.FreeRequest(pool_id=pool_id, session_id=session, seq_ids=[77])),
         grpc.StatusCode.NOT_FOUND, "seq_ids"),
        (lambda: stub.Fork(pb.ForkRequest(pool_id=pool_id, session_id=session, parent_seq_id=77,
                                          child_seq_ids=[78])), grpc.StatusCode.NOT_FOUND, "parent_seq_id"),
        (lambda: stub.GetStats(pb.GetStatsRequest(pool_id="nope")), grpc.StatusCode.NOT_FOUND, "pool_id"),
        (lambda: stub.OpenSession(pb.OpenSessionRequest(pool_id="nope")), grpc.StatusCode.NOT_FOUND, "pool_id"),
        (lambda: stub.CloseSession(pb.CloseSessionRequest(session_id="nope")), grpc.StatusCode.NOT_FOUND,
         "session_id"),
        (lambda: list(stub.WatchEvents(pb.WatchEventsRequest(pool_id="nope"), timeout=5)),
         grpc.StatusCode.NOT_FOUND, "pool_id"),
        (lambda: stub.Fork(pb.ForkRequest(pool_id=pool_id, session_id=session, parent_seq_id=77)),
         grpc.StatusCode.NOT_FOUND, "parent_seq_id"),
    ]
    for call, expected, field in cases:
        code, details = code_of(call)
        assert (code, field in details) == (expected, True), details
    assert stats(stub, pool).num_sequences == 0


# -- process ------------------------------------------------------------------------


def run_cli(*args: str, env=None, timeout=30) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvmanager", *args], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=timeout, env=env or service_env())


def test_help_and_flag_errors():
    out = run_cli("--help")
    assert out.returncode == 0 and "--default-session-ttl-ms" in out.stdout
    assert "KVSERVE_DEFAULT_SESSION_TTL_MS" in out.stdout
    bad = run_cli("--default-session-ttl-ms", "0")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1


def test_port_in_use_is_a_one_line_startup_error(server):
    out = run_cli("--port", str(server.port))
    assert out.returncode == 1
    # (gRPC's C core may log its own line before ours.)
    assert out.stderr.strip().splitlines()[-1].startswith("kvmanager: error: cannot listen")


def test_sigint_and_env_flags(tmp_path):
    service = launch("kvmanager", [], tmp_path, env={"KVSERVE_DEFAULT_SESSION_TTL_MS": "1234"}, timeout=60)
    try:
        with grpc.insecure_channel(service.address) as channel:
            stub = kvmanager_pb2_grpc.KVManagerStub(channel)
            stub.RegisterPool(pb.RegisterPoolRequest(pool_id="p", num_blocks=4, block_size=1))
            assert stub.OpenSession(pb.OpenSessionRequest(pool_id="p")).ttl_ms == 1234
    finally:
        assert service.stop(signal.SIGINT) == 0
    assert "grpc_server_stopped" in service.logs()


def test_state_conflicts_map_to_status_codes(stub, pool):
    pool_id, session = pool
    allocate(stub, pool, seq(1, [1, 2]), seq(2, [3]))
    code, details = code_of(lambda: stub.Fork(pb.ForkRequest(pool_id=pool_id, session_id=session,
                                                               parent_seq_id=1, child_seq_ids=[2])))
    assert code == grpc.StatusCode.ALREADY_EXISTS and "child_seq_ids" in details
    code, _ = code_of(lambda: stub.RegisterPool(pb.RegisterPoolRequest(pool_id=pool_id, num_blocks=99,
                                                                       block_size=BS)))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    stub.CloseSession(pb.CloseSessionRequest(session_id=session))
    assert stub.RegisterPool(pb.RegisterPoolRequest(pool_id=pool_id, num_blocks=99, block_size=BS)).created
    assert stats(stub, pool).num_blocks == 99


def test_lookup_prefix_over_grpc(stub, pool):
    allocate(stub, pool, seq(1, list(range(9))))
    query = pb.PrefixQuery(token_ids=list(range(9)))
    reply = stub.LookupPrefix(pb.LookupPrefixRequest(pool_ids=[pool[0]], queries=[query, pb.PrefixQuery()]))
    assert [[(h.pool_id, h.num_cached_tokens) for h in m.pools] for m in reply.matches] == [[(pool[0], 8)], [(pool[0], 0)]]
    unknown = pb.LookupPrefixRequest(pool_ids=["no-such-pool"], queries=[query])
    assert code_of(lambda: stub.LookupPrefix(unknown))[0] == grpc.StatusCode.NOT_FOUND
    too_many = pb.LookupPrefixRequest(pool_ids=[pool[0]], queries=[query] * 1025)
    assert code_of(lambda: stub.LookupPrefix(too_many))[0] == grpc.StatusCode.INVALID_ARGUMENT
