"""kvmanager's allocate socket (docs/kvmanager.md, "The allocate socket") against a real
``python -m kvmanager``: OpenSession names a private socket that goes with the process, each call
on it is answered as gRPC answers it (the oracle: a twin pool driven over gRPC), refusals and
garbage get their status and cost nothing, the service token guards it, and the gateway's client
uses it only when it is the kvmanager that named it, with calls pipelined in order.

The raw frames are written from the documented layout (4-byte big-endian length; a method number
byte before each request; replies start with a gRPC status byte), not with kvserve's helpers."""
from __future__ import annotations

import asyncio
import socket
import stat
import struct
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from google.protobuf.json_format import MessageToDict

from gateway.clients import DependencyError
from gateway.kvmanager_client import KVManagerClient
from kvserve.v1 import kvmanager_pb2 as pb
from kvserve.v1 import kvmanager_pb2_grpc

HEADER = struct.Struct(">I")
ALLOCATE, FREE = 1, 2
OK, INVALID_ARGUMENT, UNIMPLEMENTED, UNAUTHENTICATED = 0, 3, 12, 16
TOKEN = "allocate-socket-test-token"
BLOCK_SIZE = 16


class RawClient:
    """A client of the documented frame layout, standard library only."""

    def __init__(self, path: str, token: str = ""):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(10.0)
        self.sock.connect(path)
        self.greeting = self.exchange(token.encode())

    def exchange(self, payload: bytes) -> tuple[int, bytes]:
        self.sock.sendall(HEADER.pack(len(payload)) + payload)
        (length,) = HEADER.unpack(self._read(HEADER.size))
        body = self._read(length)
        return body[0], body[1:]

    def call(self, method: int, request) -> tuple[int, bytes]:
        return self.exchange(bytes((method,)) + request.SerializeToString())

    def _read(self, size: int) -> bytes:
        data = b""
        while len(data) < size:
            chunk = self.sock.recv(size - len(data))
            if not chunk:
                raise ConnectionError("kvmanager closed the allocate socket")
            data += chunk
        return data

    def closed_by_peer(self) -> bool:
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True


def grpc_stub(service) -> kvmanager_pb2_grpc.KVManagerStub:
    return kvmanager_pb2_grpc.KVManagerStub(grpc.insecure_channel(service.address))


def open_pool(stub, pool_id: str, metadata=()) -> pb.OpenSessionResponse:
    stub.RegisterPool(pb.RegisterPoolRequest(pool_id=pool_id, num_blocks=64, block_size=BLOCK_SIZE,
                                             enable_prefix_caching=True), metadata=metadata)
    return stub.OpenSession(pb.OpenSessionRequest(pool_id=pool_id), metadata=metadata)


@pytest.fixture
def kvmanager(start_service, short_tmp_path):
    return start_service("kvmanager", "--allocate-socket-dir", str(short_tmp_path))


def test_open_session_names_a_private_socket_that_goes_with_kvmanager(start_service, short_tmp_path):
    service = start_service("kvmanager", "--allocate-socket-dir", str(short_tmp_path))
    session = open_pool(grpc_stub(service), "p")
    path = Path(session.allocate_socket)
    assert path.parent.parent == short_tmp_path and path.parent.name.startswith("kvserve-kvmanager-")
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert stat.S_ISSOCK(path.stat().st_mode) and stat.S_IMODE(path.stat().st_mode) == 0o600
    client = RawClient(str(path))
    assert client.greeting == (OK, session.instance_id.encode()) and len(session.instance_id) >= 16
    service.stop()
    assert not path.parent.exists()

    off = start_service("kvmanager", "--allocate-socket", "off")
    assert open_pool(grpc_stub(off), "p").allocate_socket == ""


def test_calls_on_the_socket_are_answered_as_grpc_answers_them(kvmanager):
    """The same calls on two identical pools, one over the socket, one over gRPC: the same answers,
    the same pool afterwards (prefill, a shared prefix hit, decodes into a new block, frees)."""
    stub = grpc_stub(kvmanager)
    over_socket, over_grpc = open_pool(stub, "a"), open_pool(stub, "b")
    client = RawClient(over_socket.allocate_socket)
    prompt = list(range(1, 41))
    calls = [
        (ALLOCATE, dict(sequences=[pb.SequenceAllocation(seq_id=1, token_ids=prompt, num_new_tokens=40,
                                                         enable_prefix_caching=True)])),
        (ALLOCATE, dict(written_seq_ids=[1], written_num_tokens=[40],
                        sequences=[pb.SequenceAllocation(seq_id=1, token_ids=[7], num_new_tokens=1),
                                   pb.SequenceAllocation(seq_id=2, token_ids=prompt[:33] + [9], num_new_tokens=34,
                                                         enable_prefix_caching=True)])),
        *[(ALLOCATE, dict(sequences=[pb.SequenceAllocation(seq_id=1, token_ids=[8 + i], num_new_tokens=1)]))
          for i in range(9)],
        (FREE, dict(seq_ids=[2])),
        (ALLOCATE, dict(free_seq_ids=[1])),
    ]
    for method, fields in calls:
        request_type, grpc_call = ((pb.AllocateRequest, stub.Allocate) if method == ALLOCATE
                                   else (pb.FreeRequest, stub.Free))
        status, body = client.call(method, request_type(pool_id="a", session_id=over_socket.session_id, **fields))
        assert status == OK, body.decode()
        response_type = pb.AllocateResponse if method == ALLOCATE else pb.FreeResponse
        expected = grpc_call(request_type(pool_id="b", session_id=over_grpc.session_id, **fields))
        assert MessageToDict(response_type.FromString(body)) == MessageToDict(expected)
    stats = {pool: MessageToDict(stub.GetStats(pb.GetStatsRequest(pool_id=pool))) for pool in "ab"}
    stats["a"].pop("poolId"), stats["b"].pop("poolId")
    assert stats["a"] == stats["b"] and stats["a"].get("numCachedBlocks", 0) > 0


def test_refused_and_malformed_calls_get_their_status_cost_nothing_and_keep_the_connection(kvmanager):
    stub = grpc_stub(kvmanager)
    session = open_pool(stub, "p")
    client = RawClient(session.allocate_socket)
    good = pb.AllocateRequest(pool_id="p", session_id=session.session_id,
                              sequences=[pb.SequenceAllocation(seq_id=1, token_ids=[1, 2, 3], num_new_tokens=3)])
    unknown_session = pb.AllocateRequest(pool_id="p", session_id="nobody", sequences=good.sequences)
    twice = pb.AllocateRequest(pool_id="p", session_id=session.session_id,
                               sequences=[good.sequences[0], good.sequences[0]])
    for refused in (unknown_session, twice):
        with pytest.raises(grpc.RpcError) as over_grpc:
            stub.Allocate(refused)
        assert client.call(ALLOCATE, refused) == (over_grpc.value.code().value[0], over_grpc.value.details().encode())
    assert client.exchange(bytes((ALLOCATE,)) + b"\xff\xff\xff")[0] == INVALID_ARGUMENT
    assert client.exchange(b"")[0] == INVALID_ARGUMENT
    status, body = client.exchange(bytes((9,)) + good.SerializeToString())
    assert status == UNIMPLEMENTED and b"9" in body
    assert stub.GetStats(pb.GetStatsRequest(pool_id="p")).num_used_blocks == 0  # nothing any of them held
    status, body = client.call(ALLOCATE, good)  # the connection still serves
    assert status == OK and pb.AllocateResponse.FromString(body).results[0].status == pb.ALLOCATION_STATUS_OK
    assert stub.GetStats(pb.GetStatsRequest(pool_id="p")).num_used_blocks == 1

    client.sock.sendall(HEADER.pack(1 << 30))  # past the frame limit: refused, and the connection ends
    (length,) = HEADER.unpack(client._read(HEADER.size))
    assert client._read(length)[0] == INVALID_ARGUMENT and client.closed_by_peer()
    assert RawClient(session.allocate_socket).greeting[0] == OK  # others are still served


def test_the_service_token_guards_the_socket(start_service, short_tmp_path):
    service = start_service("kvmanager", "--allocate-socket-dir", str(short_tmp_path), env={"KVSERVE_SERVICE_TOKEN": TOKEN})
    metadata = (("authorization", f"Bearer {TOKEN}"),)
    session = open_pool(grpc_stub(service), "p", metadata)
    for wrong in ("", "not-the-token"):
        client = RawClient(session.allocate_socket, wrong)
        assert client.greeting[0] == UNAUTHENTICATED and client.closed_by_peer()
    assert RawClient(session.allocate_socket, TOKEN).greeting == (OK, session.instance_id.encode())


def test_the_gateways_client_pipelines_its_calls_on_the_socket_in_order(kvmanager):
    """Two backends' calls at once, one of them given up: each answer reaches its own caller."""
    async def scenario():
        client = KVManagerClient(kvmanager.address)
        stub = kvmanager_pb2_grpc.KVManagerStub(client.channel)
        for pool in ("a", "b"):
            await stub.RegisterPool(pb.RegisterPoolRequest(pool_id=pool, num_blocks=64, block_size=BLOCK_SIZE))
        (sa, _), (sb, _) = [await client.open_session(pool, 0, "test") for pool in ("a", "b")]

        def allocate(pool, session, seq_id, n):
            request = pb.AllocateRequest(pool_id=pool, session_id=session, sequences=[
                pb.SequenceAllocation(seq_id=seq_id, token_ids=list(range(n)), num_new_tokens=n)])
            return client._per_step_call(ALLOCATE, request)

        await client._per_step_call(FREE, pb.FreeRequest(pool_id="a", session_id=sa))  # the socket is open
        given_up = asyncio.ensure_future(allocate("a", sa, 1, 17))
        await asyncio.sleep(0)  # written, not yet answered
        given_up.cancel()
        answers = await asyncio.gather(allocate("b", sb, 2, 33), allocate("a", sa, 3, 5), allocate("b", sb, 4, 1))
        assert [len(a.results[0].block_table) for a in answers] == [3, 1, 1]
        assert [a.results[0].seq_id for a in answers] == [2, 3, 4]
        assert client.calls_over_allocate_socket == 4
        stats = await stub.GetStats(pb.GetStatsRequest(pool_id="a"))
        assert stats.num_used_blocks == 3  # the given-up call was applied (2 blocks) and so was seq 3's
        await client.close()

    asyncio.run(scenario())


def test_a_socket_that_is_not_the_named_kvmanagers_is_never_used(start_service, short_tmp_path):
    """A path that now belongs to another kvmanager (or none): the client keeps to gRPC."""
    first = start_service("kvmanager", "--allocate-socket", str(short_tmp_path / "shared.sock"))
    second = start_service("kvmanager", "--allocate-socket-dir", str(short_tmp_path))

    async def scenario():
        client = KVManagerClient(second.address)
        stub = kvmanager_pb2_grpc.KVManagerStub(client.channel)
        await stub.RegisterPool(pb.RegisterPoolRequest(pool_id="p", num_blocks=64, block_size=BLOCK_SIZE))
        session, _ = await client.open_session("p", 0, "test")
        client._allocate_socket_offer = (str(short_tmp_path / "shared.sock"), "an-instance-that-is-gone")
        request = pb.AllocateRequest(pool_id="p", session_id=session, sequences=[
            pb.SequenceAllocation(seq_id=1, token_ids=[1, 2], num_new_tokens=2)])
        reply = await client._per_step_call(ALLOCATE, request)
        assert reply.results[0].status == pb.ALLOCATION_STATUS_OK
        assert client.calls_over_allocate_socket == 0 and client._allocate_socket_offer is None
        await client.close()

    asyncio.run(scenario())
    assert first.proc.poll() is None


def test_kvmanager_gone_mid_session_is_unavailable_not_a_refusal(kvmanager):
    async def scenario():
        client = KVManagerClient(kvmanager.address, timeout=5.0)
        stub = kvmanager_pb2_grpc.KVManagerStub(client.channel)
        await stub.RegisterPool(pb.RegisterPoolRequest(pool_id="p", num_blocks=64, block_size=BLOCK_SIZE))
        session, _ = await client.open_session("p", 0, "test")
        request = pb.AllocateRequest(pool_id="p", session_id=session, sequences=[
            pb.SequenceAllocation(seq_id=1, token_ids=[1], num_new_tokens=1)])
        await client._per_step_call(ALLOCATE, request)
        assert client.calls_over_allocate_socket == 1
        kvmanager.stop()
        with pytest.raises(DependencyError) as failed:
            await client._per_step_call(ALLOCATE, request)
        assert not failed.value.refused
        await client.close()

    asyncio.run(scenario())


def test_a_path_taken_or_unusable_is_a_one_line_error_and_a_stale_socket_is_replaced(start_service, short_tmp_path):
    def start_failing(path: Path) -> str:
        done = subprocess.run([sys.executable, "-m", "kvmanager", "--port", "0", "--allocate-socket", str(path)],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 1, done.stderr
        return done.stderr.strip().splitlines()[-1]

    not_a_socket = short_tmp_path / "data.txt"
    not_a_socket.write_text("keep me")
    assert "a file that is not a socket is there" in start_failing(not_a_socket)
    assert not_a_socket.read_text() == "keep me"
    taken = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    taken.bind(str(short_tmp_path / "taken.sock"))
    taken.listen(1)
    assert "another process listens there" in start_failing(short_tmp_path / "taken.sock")
    assert (short_tmp_path / "taken.sock").exists()
    taken.close()

    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # a dead kvmanager's socket: nobody listens
    stale.bind(str(short_tmp_path / "stale.sock"))
    stale.close()
    service = start_service("kvmanager", "--allocate-socket", str(short_tmp_path / "stale.sock"))
    session = open_pool(grpc_stub(service), "p")
    assert session.allocate_socket == str(short_tmp_path / "stale.sock")
    assert RawClient(session.allocate_socket).greeting == (OK, session.instance_id.encode())


class _Writes:
    """A transport stand-in: keeps what is written."""

    def __init__(self):
        self.frames: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.frames.append(data)

    def close(self) -> None:
        pass


def test_a_caller_cancelled_as_its_reply_arrives_stays_cancelled():
    """A backend that stops cancels its step loop while an Allocate waits; the reply may arrive in
    the same turn of the event loop. The call must still end cancelled (Python 3.11's wait_for
    returned the reply instead, and the loop it ran in went on, never stopping)."""
    from gateway.allocate_socket import AllocateSocket

    async def scenario():
        allocate_socket = AllocateSocket(asyncio.StreamReader(), _Writes())
        call = asyncio.ensure_future(allocate_socket.call(ALLOCATE, b"", 5.0))
        await asyncio.sleep(0)  # written, waiting for its reply
        allocate_socket._waiting[0].set_result((grpc.StatusCode.OK, b""))  # the reply comes ...
        call.cancel()  # ... as the caller is cancelled, before it runs again
        with pytest.raises(asyncio.CancelledError):
            await call

    asyncio.run(scenario())


def test_a_call_without_a_reply_in_time_is_deadline_exceeded_and_fails_the_others_waiting():
    from gateway.allocate_socket import AllocateSocket, AllocateSocketBroken, AllocateSocketTimeout

    async def scenario():
        allocate_socket = AllocateSocket(asyncio.StreamReader(), _Writes())
        slow = asyncio.ensure_future(allocate_socket.call(ALLOCATE, b"", 0.05))
        other = asyncio.ensure_future(allocate_socket.call(FREE, b"", 5.0))
        with pytest.raises(AllocateSocketTimeout):
            await slow
        with pytest.raises(AllocateSocketBroken):
            await other
        with pytest.raises(AllocateSocketBroken):  # closed: no call is written on it again
            await allocate_socket.call(ALLOCATE, b"", 5.0)

    asyncio.run(scenario())
