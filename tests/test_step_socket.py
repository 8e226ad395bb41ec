"""The executor's step socket (docs/executor-contract.md, "The step socket") against a real
``python -m executor``: each step answered as gRPC's Execute answers it (the oracle: a twin
sequence stepped over gRPC), refusals with their status and no KV written, a client that stalls
or sends garbage costs nobody else anything, the service token, and the gateway's client using
it only when the socket is the described executor's.

The frames go through the conformance kit's client, written from the documented layout alone
(4-byte big-endian length; replies start with a gRPC status byte), not kvserve's own helpers."""
from __future__ import annotations

import asyncio
import os
import socket
import stat
import struct
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from gateway.clients import DependencyError, ExecutorClient
from gateway.scheduler import ScheduledSeq
from gateway.sequence import GenerationRequest, SamplingOptions, Sequence
from kvserve.conformance.step_socket_client import StepSocketClient
from kvserve.health import check
from kvserve.v1 import executor_pb2 as pb
from kvserve.v1 import executor_pb2_grpc
from tests.conftest import REPO_ROOT, free_port, service_env, tiny_executor_args
from tests.conftest import TINY_NUM_BLOCKS as NUM_BLOCKS
from tests.test_executor_service import BAD_REQUESTS, seq
from tests.test_gateway_executor_client import Decoder, decode_entry

TOKEN = "step-socket-test-token"


class RawStepClient(StepSocketClient):
    """The conformance kit's client (standard library only, from the documented frame layout),
    plus what these tests do that a well-behaved client does not."""

    def send_raw(self, data: bytes) -> None:
        self._sock.sendall(data)

    def answered(self, request: pb.ExecuteRequest) -> pb.ExecuteResponse:
        status, body = self.step(request)
        assert status == 0, body.decode()
        return pb.ExecuteResponse.FromString(body)

    def closed_by_peer(self) -> bool:
        try:
            return self._sock.recv(1) == b""
        except ConnectionResetError:
            return True


def test_describe_offers_a_private_socket_that_goes_with_the_executor(tiny_executor, start_service, tiny_model_dir):
    service, _, info = tiny_executor
    path = Path(info.step_socket)
    assert path.is_absolute() and stat.S_ISSOCK(path.stat().st_mode)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    client = RawStepClient(str(path))
    assert client.greeting == (0, info.instance_id.encode())
    client.close()
    assert service.stop() == 0
    assert not path.exists() and not path.parent.exists()
    off = start_service("executor", *tiny_executor_args(tiny_model_dir, "--step-socket", "off"))
    with grpc.insecure_channel(off.address) as channel:
        assert executor_pb2_grpc.ExecutorStub(channel).Describe(pb.DescribeRequest(), timeout=10).step_socket == ""


def test_a_step_socket_path_taken_or_unusable_is_a_one_line_error_and_a_stale_one_is_replaced(
        start_service, tiny_model_dir, tmp_path):
    path = tmp_path / "steps.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))  # what an executor killed with SIGKILL leaves: a socket file nobody listens on
    stale.close()
    first = start_service("executor", *tiny_executor_args(tiny_model_dir, "--step-socket", str(path)))
    with grpc.insecure_channel(first.address) as channel:
        info = executor_pb2_grpc.ExecutorStub(channel).Describe(pb.DescribeRequest(), timeout=10)
    client = RawStepClient(str(path))
    assert info.step_socket == str(path) and client.greeting == (0, info.instance_id.encode())
    client.close()
    not_a_socket = tmp_path / "plain-file"
    not_a_socket.write_text("keep me")
    cases = ((path, "another process listens there"), (tmp_path / "no-dir" / "s.sock", "No such file"),
             (not_a_socket, "not a socket"))
    # The three refused starts run at once: each spends its time loading the executor, not refusing.
    procs = [subprocess.Popen([sys.executable, "-m", "executor", *tiny_executor_args(tiny_model_dir),
                               "--port", str(free_port()), "--step-socket", str(where)],
                              cwd=REPO_ROOT, env=service_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for where, _ in cases]
    for proc, (_, reason) in zip(procs, cases):
        _, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 1 and stderr.strip().count("\n") == 0, stderr
        assert "step socket" in stderr and reason in stderr and "Traceback" not in stderr
    assert not_a_socket.read_text() == "keep me" and first.alive()


def _socket_dir(parent: Path, name: str, *, listening: bool | None, age_s: float) -> tuple[Path, socket.socket | None]:
    """A directory as ``auto`` makes them: with a live socket (``listening``), a dead one (False:
    bound, nobody listens: its executor was killed) or none (None); ``age_s`` old."""
    directory = parent / f"kvserve-executor-{name}"
    directory.mkdir(mode=0o700)
    sock = None
    if listening is not None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(str(directory / "steps.sock"))
        if listening:
            sock.listen(1)
        else:
            sock.close()
            sock = None
    old = os.stat(directory).st_mtime - age_s
    os.utime(directory, (old, old))
    return directory, sock


def test_auto_makes_its_directory_under_step_socket_dir_and_clears_dead_executors_ones(
        start_service, tiny_model_dir, short_tmp_path):
    """Several executors sharing one --step-socket-dir (compose: a volume the gateway mounts too):
    each gets its own directory, and what executors killed before they could clean up left there
    goes at the next start; a live executor's directory, or one made a moment ago, stays."""
    parent = short_tmp_path / "steps"
    parent.mkdir()
    dead, _ = _socket_dir(parent, "dead", listening=False, age_s=600)
    empty, _ = _socket_dir(parent, "empty", listening=None, age_s=600)
    young, _ = _socket_dir(parent, "young", listening=False, age_s=0)
    live, listener = _socket_dir(parent, "live", listening=True, age_s=600)
    unrelated = parent / "not-an-executors"
    unrelated.mkdir()
    os.utime(unrelated, (0, 0))  # old, and nobody listens in it either: only the name keeps it
    try:
        service = start_service("executor", *tiny_executor_args(tiny_model_dir, "--step-socket-dir", str(parent)))
        with grpc.insecure_channel(service.address) as channel:
            info = executor_pb2_grpc.ExecutorStub(channel).Describe(pb.DescribeRequest(), timeout=10)
        path = Path(info.step_socket)
        assert path.parent.parent == parent and path.parent.name.startswith("kvserve-executor-")
        client = RawStepClient(str(path))
        assert client.greeting == (0, info.instance_id.encode())
        client.close()
        assert not dead.exists() and not empty.exists()
        assert young.exists() and live.exists() and unrelated.exists()
        assert service.stop() == 0 and not path.parent.exists()
    finally:
        listener.close()
    proc = subprocess.run([sys.executable, "-m", "executor", *tiny_executor_args(tiny_model_dir),
                           "--port", str(free_port()), "--step-socket-dir", str(short_tmp_path / "missing")],
                          cwd=REPO_ROOT, env=service_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "step socket's directory" in proc.stderr and "Traceback" not in proc.stderr


def test_steps_on_the_socket_are_answered_as_execute_answers_them(shared_tiny_executor):
    """Sequence A steps over the socket, its twin B over gRPC: same tokens, log-probabilities and
    alternatives at every step, prefill in two chunks and decodes, with the executor's instance id."""
    _, stub, info = shared_tiny_executor
    client = RawStepClient(info.step_socket)
    prompt = list(range(300, 340))
    chunks = [(prompt[:24], 0), (prompt[24:], 24)]
    for tokens, start in chunks:
        over_socket = client.answered(pb.ExecuteRequest(sequences=[seq(tokens, start, [1, 2, 3], top_logprobs=3)]))
        over_grpc = stub.Execute(pb.ExecuteRequest(sequences=[seq(tokens, start, [4, 5, 6], top_logprobs=3)]))
    position = 40
    for _ in range(6):
        assert over_socket.sampled_token_ids == over_grpc.sampled_token_ids
        assert list(over_socket.sampled_logprobs) == list(over_grpc.sampled_logprobs)
        assert over_socket.top_logprobs == over_grpc.top_logprobs
        assert over_socket.instance_id == info.instance_id and over_socket.timings.total_ms > 0
        token = over_grpc.sampled_token_ids[0]
        over_socket = client.answered(pb.ExecuteRequest(sequences=[seq([token], position, [1, 2, 3], top_logprobs=3)]))
        over_grpc = stub.Execute(pb.ExecuteRequest(sequences=[seq([token], position, [4, 5, 6], top_logprobs=3)]))
        position += 1
    client.close()


def test_refused_and_malformed_steps_get_their_status_write_nothing_and_keep_the_connection(shared_tiny_executor):
    _, stub, info = shared_tiny_executor
    client = RawStepClient(info.step_socket)
    prompt = list(range(300, 340))
    first = client.answered(pb.ExecuteRequest(sequences=[seq(prompt, 0, [1, 2, 3]), seq(prompt, 0, [4, 5, 6])]))
    garbage = seq(list(range(1000, 1040)), 0, [1, 2, 3])  # would overwrite A's KV if it ran
    for name, (request, field) in BAD_REQUESTS.items():
        status, message = client.exchange(request.SerializeToString())
        assert status == grpc.StatusCode.INVALID_ARGUMENT.value[0], name
        assert field in message.decode(), (name, message)
    status, message = client.exchange(pb.ExecuteRequest(sequences=[garbage, seq([5, 49152], 0, [7])])
                                       .SerializeToString())
    assert status == grpc.StatusCode.INVALID_ARGUMENT.value[0] and b"token_ids[1]" in message
    status, message = client.exchange(b"\xff\xff")
    assert status == grpc.StatusCode.INVALID_ARGUMENT.value[0] and b"malformed" in message
    token = first.sampled_token_ids[0]
    after = client.answered(pb.ExecuteRequest(sequences=[seq([token], 40, [1, 2, 3], top_logprobs=5)]))
    twin = stub.Execute(pb.ExecuteRequest(sequences=[seq([token], 40, [4, 5, 6], top_logprobs=5)]))
    assert after.sampled_token_ids == twin.sampled_token_ids and after.top_logprobs == twin.top_logprobs
    # A length past the limit cannot be skipped: refused, and that connection closed.
    client.send_raw(struct.pack(">I", 0xFFFFFFFF))
    status, message = client.read_reply()
    assert status == grpc.StatusCode.INVALID_ARGUMENT.value[0] and b"limit" in message
    assert client.closed_by_peer()
    client.close()


def test_a_stalled_or_silent_client_holds_up_nobody(shared_tiny_executor):
    service, stub, info = shared_tiny_executor
    half = RawStepClient(info.step_socket)
    half.send_raw(struct.pack(">I", 100) + b"\x0a\x05")  # a frame's header and 2 of its 100 bytes
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    silent.connect(info.step_socket)  # never greets
    other = RawStepClient(info.step_socket, timeout=5.0)  # a thread stuck on the half frame would wait 10 s
    request = pb.ExecuteRequest(sequences=[seq(list(range(300, 310)), 0, [1])])
    assert other.answered(request).sampled_token_ids == stub.Execute(request, timeout=30).sampled_token_ids
    assert check(service.address, timeout=5)
    for client in (half, other):
        client.close()
    silent.close()
    assert service.alive()


def test_the_service_token_guards_the_socket(start_service, tiny_model_dir):
    env = {**os.environ, "KVSERVE_SERVICE_TOKEN": TOKEN}
    service = start_service("executor", *tiny_executor_args(tiny_model_dir), env=env)
    path = None
    with grpc.insecure_channel(service.address) as channel:
        stub = executor_pb2_grpc.ExecutorStub(channel)
        info = stub.Describe(pb.DescribeRequest(), timeout=10, metadata=[("authorization", f"Bearer {TOKEN}")])
        path = info.step_socket
    for wrong in ("", "not-" + TOKEN):
        client = RawStepClient(path, wrong)
        assert client.greeting[0] == grpc.StatusCode.UNAUTHENTICATED.value[0]
        assert TOKEN.encode() not in client.greeting[1] and client.closed_by_peer()
        client.close()
    client = RawStepClient(path, TOKEN)
    assert client.greeting == (0, info.instance_id.encode())
    assert client.answered(pb.ExecuteRequest(sequences=[seq([5, 6, 7], 0, [1])])).sampled_token_ids
    client.close()


def prompt_entry(seq_id: int, block: int) -> ScheduledSeq:
    """A 4-token prompt's prefill in ``block``, greedy."""
    prompt = [300, 301, 302, 303]
    request = GenerationRequest(f"r{seq_id}", prompt, SamplingOptions(max_tokens=8), frozenset(), 64)
    sequence = Sequence(seq_id, request, 0, list(prompt), Decoder(), block_table=[block])
    return ScheduledSeq(sequence, seq_id, 4, list(prompt), start_position=0, num_tokens=4, sample=True)


def advance(entry: ScheduledSeq, token_id: int) -> None:
    """The entry's next step: a decode of the token just sampled."""
    entry.seq.token_ids.append(token_id)
    entry.start_position += entry.num_tokens
    entry.num_tokens = 1


def test_the_gateway_steps_on_the_socket_and_agrees_with_its_stream(shared_tiny_executor):
    """The gateway's client steps over the socket once Describe offered it, with the tokens its
    gRPC stream gives; a refusal arrives as the same DependencyError and the socket serves on."""
    service, _, _ = shared_tiny_executor

    async def scenario():
        over_socket = ExecutorClient(service.address)
        over_stream = ExecutorClient(service.address, use_step_socket=False)
        try:
            for client in (over_socket, over_stream):
                await client.describe()
            a, b = prompt_entry(1, block=7), prompt_entry(2, block=8)
            for _ in range(4):
                out_a, out_b = await over_socket.execute([a]), await over_stream.execute([b])
                assert [(t.token_id, t.logprob) for t in out_a.sampled] == \
                    [(t.token_id, t.logprob) for t in out_b.sampled]
                advance(a, out_a.sampled[0].token_id)
                advance(b, out_b.sampled[0].token_id)
            assert (over_socket.steps_over_step_socket, over_stream.steps_over_step_socket) == (4, 0)
            bad = prompt_entry(3, block=NUM_BLOCKS + 5)
            for client in (over_socket, over_stream):
                with pytest.raises(DependencyError) as info:
                    await client.execute([bad])
                assert info.value.refused and info.value.status == grpc.StatusCode.INVALID_ARGUMENT
                assert "block_table[0]" in info.value.details
            out_a, out_b = await over_socket.execute([a]), await over_stream.execute([b])
            assert out_a.sampled[0].token_id == out_b.sampled[0].token_id
            assert over_socket.steps_over_step_socket == 5
        finally:
            await over_socket.close()
            await over_stream.close()

    asyncio.run(scenario())


class OffersAForeignSocket(executor_pb2_grpc.ExecutorServicer):
    """An executor whose Describe names a socket that another instance answers (or nobody)."""

    def __init__(self, path: str):
        self.path = path
        self.steps = 0

    async def Describe(self, request, context):
        return pb.DescribeResponse(instance_id="mine", step_socket=self.path, block_size=16)

    async def ExecuteStream(self, request_iterator, context):
        async for request in request_iterator:
            self.steps += 1
            yield pb.ExecuteResponse(instance_id="mine", sampled_token_ids=[request.sequences[0].seq_id])


@pytest.mark.parametrize("socket_answer", ["another instance", "nobody"])
def test_a_socket_that_is_not_the_described_executors_is_never_used(tmp_path, socket_answer):
    path = str(tmp_path / "steps.sock")

    async def greet_as_another(reader, writer):
        (length,) = struct.unpack(">I", await reader.readexactly(4))
        await reader.readexactly(length)
        writer.write(struct.pack(">I", 1 + len(b"theirs")) + b"\x00theirs")
        await reader.read()  # a step must never come

    async def scenario():
        unix_server = await asyncio.start_unix_server(greet_as_another, path) if socket_answer != "nobody" else None
        servicer = OffersAForeignSocket(path)
        server = grpc.aio.server()
        executor_pb2_grpc.add_ExecutorServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        client = ExecutorClient(f"127.0.0.1:{port}")
        try:
            await client.describe()
            out = await client.execute([decode_entry(7)], timeout=5)
            assert [t.token_id for t in out.sampled] == [7]
            assert servicer.steps == 1 and client.steps_over_step_socket == 0
        finally:
            await client.close()
            await server.stop(None)
            if unix_server is not None:
                unix_server.close()

    asyncio.run(scenario())


def test_a_step_past_its_deadline_on_the_socket_is_deadline_exceeded_and_the_next_reconnects(tmp_path):
    """A step socket that greets correctly but holds the step marked 2: the gateway's deadline
    fires, that connection is dropped (its late reply would be read as the next step's), and the
    next step opens a new one."""
    path = str(tmp_path / "steps.sock")
    connections = []

    async def serve_steps(reader, writer):
        connections.append(writer)
        (length,) = struct.unpack(">I", await reader.readexactly(4))
        await reader.readexactly(length)
        writer.write(struct.pack(">I", 1 + len(b"mine")) + b"\x00mine")
        while True:
            try:
                (length,) = struct.unpack(">I", await reader.readexactly(4))
            except asyncio.IncompleteReadError:
                return
            request = pb.ExecuteRequest.FromString(await reader.readexactly(length))
            seq_id = request.sequences[0].seq_id
            if seq_id == 2:
                await asyncio.sleep(3600)
            body = pb.ExecuteResponse(instance_id="mine", sampled_token_ids=[seq_id]).SerializeToString()
            writer.write(struct.pack(">I", 1 + len(body)) + b"\x00" + body)

    async def scenario():
        unix_server = await asyncio.start_unix_server(serve_steps, path)
        server = grpc.aio.server()
        executor_pb2_grpc.add_ExecutorServicer_to_server(OffersAForeignSocket(path), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        client = ExecutorClient(f"127.0.0.1:{port}")
        try:
            await client.describe()
            assert [t.token_id for t in (await client.execute([decode_entry(1)], timeout=5)).sampled] == [1]
            with pytest.raises(DependencyError) as info:
                await client.execute([decode_entry(2)], timeout=0.3)
            assert info.value.status == grpc.StatusCode.DEADLINE_EXCEEDED and not info.value.refused
            assert [t.token_id for t in (await client.execute([decode_entry(3)], timeout=5)).sampled] == [3]
            assert len(connections) == 2 and client.steps_over_step_socket == 2
        finally:
            await client.close()
            await server.stop(None)
            unix_server.close()

    asyncio.run(scenario())
