"""The step socket: ExecuteStream's steps over a Unix domain socket, for a gateway on the same host.

A step over gRPC costs this executor's event loop, gRPC's own threads and the torch
thread a hand-over each way; on a small VM those wake-ups and gRPC's per-message work
add ~1 ms to every step (docs/executor.md, "The step socket"). Here the event loop only
accepts a connection and checks its greeting (the service token, when the executor
has one); then the torch thread watches the connection itself (``TorchThread.watch``),
reads each step, runs it and writes the reply. The frames are in kvserve/step_frames.py.

The socket lives in a directory only this user can enter (``auto``: a fresh one under
``--step-socket-dir``, by default the temp directory), is mode 0600, and goes when the
executor stops; the directories of executors killed before they could remove theirs go at
the next ``auto`` start in the same parent.
"""
from __future__ import annotations

import asyncio
import socket
import time
from functools import partial
from pathlib import Path

import grpc
from google.protobuf.message import DecodeError

from executor.runner import ModelRunner
from executor.service import run_step
from executor.torch_thread import TorchThread
from kvserve.aio import wait_within
from kvserve.auth import BearerToken
from kvserve.errors import KVServeError
from kvserve.logs import get_logger
from kvserve.server import status_for
from kvserve.step_frames import HEADER, FrameTooLarge, error_frame, frame_length, reply_frame
from kvserve.unix_sockets import SocketPlace, remove_socket
from kvserve.v1 import executor_pb2

log = get_logger("executor.step_socket")

GREETING_TIMEOUT_S = 5.0
STEP_SOCKET = SocketPlace("the step socket", "kvserve-executor-", "steps.sock")
SEND_TIMEOUT_S = 10.0  # a client that reads no reply for this long is dropped
RECV_BYTES = 64 * 1024


def answer_step(runner: ModelRunner, payload: bytes) -> bytes:
    """A step frame's reply frame (in the torch thread)."""
    started = time.perf_counter()
    try:
        request = executor_pb2.ExecuteRequest.FromString(payload)
    except (DecodeError, ValueError) as exc:
        return error_frame(grpc.StatusCode.INVALID_ARGUMENT, f"malformed request message: {exc}")
    try:
        reply = run_step(runner, request, started)
    except KVServeError as exc:
        return error_frame(status_for(exc), str(exc))
    except Exception as exc:  # noqa: BLE001 — every error gets a status code, as over gRPC
        log.error("step_failed", error=repr(exc), exc_info=exc)
        return error_frame(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")
    return reply_frame(grpc.StatusCode.OK, reply.SerializeToString())


class StepConnection:
    """One client's connection, served by the torch thread: frames in, replies out, in order."""

    def __init__(self, sock: socket.socket, answer):
        sock.settimeout(SEND_TIMEOUT_S)  # reads happen only when readable; sends wait at most this long
        self._sock = sock
        self._answer = answer
        self._buffer = bytearray()

    def fileno(self) -> int:
        return self._sock.fileno()

    def on_readable(self) -> bool:
        try:
            data = self._sock.recv(RECV_BYTES)
        except (BlockingIOError, InterruptedError):
            return True
        except OSError:
            return False
        if not data:
            return False
        self._buffer += data
        while len(self._buffer) >= HEADER.size:
            try:
                length = frame_length(bytes(self._buffer[:HEADER.size]))
            except FrameTooLarge as exc:
                self._send(error_frame(grpc.StatusCode.INVALID_ARGUMENT, str(exc)))
                return False  # the rest of that frame cannot be skipped safely
            end = HEADER.size + length
            if len(self._buffer) < end:
                break
            payload = bytes(self._buffer[HEADER.size:end])
            del self._buffer[:end]
            if not self._send(self._answer(payload)):
                return False
        return True

    def _send(self, data: bytes) -> bool:
        try:
            self._sock.sendall(data)
            return True
        except OSError:  # gone, or not reading (timeout): dropped
            return False

    def close(self) -> None:
        self._sock.close()


class StepSocketListener:
    """Accepts step-socket clients on the event loop, greets them, hands them to the torch thread."""

    def __init__(self, path: Path, owned_dir: Path | None, instance_id: str, runner: ModelRunner,
                 torch_thread: TorchThread, token: BearerToken | None):
        self.path = path
        self._owned_dir = owned_dir
        self._instance_id = instance_id
        self._answer = partial(answer_step, runner)
        self._torch_thread = torch_thread
        self._token = token
        self._listener: socket.socket | None = None
        self._tasks: set[asyncio.Task] = set()

    @classmethod
    def create(cls, where: str, runner: ModelRunner, torch_thread: TorchThread, token: BearerToken | None,
               parent: Path | None = None) -> StepSocketListener | None:
        """``where``: ``off`` (None), ``auto`` (a private directory under ``parent``, by default the
        temp directory) or a path."""
        place = STEP_SOCKET.resolve(where, parent)
        if place is None:
            return None
        path, owned_dir = place
        return cls(path, owned_dir, runner.info.instance_id, runner, torch_thread, token)

    async def start(self) -> None:
        self._listener = STEP_SOCKET.listen(self.path)
        self._spawn(self._accept())
        log.info("step_socket_ready", path=str(self.path))

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        remove_socket(self.path, self._owned_dir)

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(self._listener)
            except OSError as exc:  # e.g. out of file descriptors: keep the socket, try again soon
                log.warning("step_socket_accept_failed", error=str(exc))
                await asyncio.sleep(0.1)
                continue
            conn.setblocking(False)
            self._spawn(self._greet(conn))

    async def _greet(self, conn: socket.socket) -> None:
        """The client's first frame is its token; the answer, this executor's instance id."""
        loop = asyncio.get_running_loop()
        try:
            token = await wait_within(_read_frame(loop, conn), GREETING_TIMEOUT_S)
            if self._token is not None and not self._token.matches_secret(token):
                await loop.sock_sendall(conn, error_frame(grpc.StatusCode.UNAUTHENTICATED,
                                                          "the step socket needs the executor's service token"))
                conn.close()
                return
            await loop.sock_sendall(conn, reply_frame(grpc.StatusCode.OK, self._instance_id.encode()))
        except (OSError, EOFError, FrameTooLarge, asyncio.TimeoutError):
            conn.close()
            return
        except asyncio.CancelledError:
            conn.close()
            raise
        self._torch_thread.watch(StepConnection(conn, self._answer))


async def _read_frame(loop: asyncio.AbstractEventLoop, conn: socket.socket) -> bytes:
    length = frame_length(await _read_exactly(loop, conn, HEADER.size))
    return await _read_exactly(loop, conn, length)


async def _read_exactly(loop: asyncio.AbstractEventLoop, conn: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = await loop.sock_recv(conn, size - len(data))
        if not chunk:
            raise EOFError("the client closed the step socket")
        data += chunk
    return bytes(data)
