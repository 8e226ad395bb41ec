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
import os
import shutil
import socket
import stat
import tempfile
import time
from functools import partial
from pathlib import Path

import grpc
from google.protobuf.message import DecodeError

from executor.runner import ModelRunner
from executor.service import run_step
from executor.torch_thread import TorchThread
from kvserve.auth import BearerToken
from kvserve.errors import KVServeError, StartupError
from kvserve.logs import get_logger
from kvserve.server import status_for
from kvserve.step_frames import HEADER, FrameTooLarge, error_frame, frame_length, reply_frame
from kvserve.v1 import executor_pb2

log = get_logger("executor.step_socket")

GREETING_TIMEOUT_S = 5.0
# ``auto``: <parent>/kvserve-executor-XXXXXXXX/steps.sock
OWNED_DIR_PREFIX = "kvserve-executor-"
SOCKET_NAME = "steps.sock"
# A directory of ``auto``'s this old with no listener is a dead executor's: a live one binds its
# socket right after making the directory.
DEAD_DIR_AGE_S = 60.0
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
        if where == "off":
            return None
        if where == "auto":
            parent = Path(parent or tempfile.gettempdir())
            removed = remove_dead_socket_dirs(parent)
            if removed:
                log.info("step_socket_dirs_removed", parent=str(parent), count=removed)
            try:
                owned = Path(tempfile.mkdtemp(prefix=OWNED_DIR_PREFIX, dir=parent))  # mode 0700
            except OSError as exc:
                raise StartupError(f"cannot make the step socket's directory under {parent}: "
                                   f"{exc.strerror or exc}") from exc
            return cls(owned / SOCKET_NAME, owned, runner.info.instance_id, runner, torch_thread, token)
        return cls(Path(where), None, runner.info.instance_id, runner, torch_thread, token)

    async def start(self) -> None:
        _clear_stale_socket(self.path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(str(self.path))
            os.chmod(self.path, 0o600)
            listener.listen(16)
        except OSError as exc:
            listener.close()
            raise StartupError(f"cannot listen on the step socket {self.path}: {exc.strerror or exc}") from exc
        listener.setblocking(False)
        self._listener = listener
        self._spawn(self._accept())
        log.info("step_socket_ready", path=str(self.path))

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        self.path.unlink(missing_ok=True)
        if self._owned_dir is not None:
            shutil.rmtree(self._owned_dir, ignore_errors=True)

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
            token = await asyncio.wait_for(_read_frame(loop, conn), GREETING_TIMEOUT_S)
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


def _clear_stale_socket(path: Path) -> None:
    """A socket file nobody listens on (an executor that died) is removed; anything else stops the start."""
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise StartupError(f"cannot listen on the step socket {path}: a file that is not a socket is there")
    if someone_listens(path):
        raise StartupError(f"cannot listen on the step socket {path}: another process listens there")
    path.unlink(missing_ok=True)


def someone_listens(path: Path) -> bool:
    """Whether a process accepts connections on the socket at ``path``. Only "no such socket" and
    "refused" say no: a listener too busy to answer within a second still counts as there."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(str(path))
    except (FileNotFoundError, ConnectionRefusedError, NotADirectoryError):
        return False
    except OSError:
        return True
    finally:
        probe.close()
    return True


def remove_dead_socket_dirs(parent: Path) -> int:
    """Removes the directories ``auto`` made under ``parent`` for executors that are gone without
    removing theirs (SIGKILL, OOM; in a volume shared by several executors they would pile up):
    this user's, older than DEAD_DIR_AGE_S (never one an executor is starting in), whose socket
    is missing or refused. Another executor's live directory stays. Returns how many went."""
    now = time.time()
    removed = 0
    for entry in parent.glob(OWNED_DIR_PREFIX + "*"):
        try:
            info = entry.lstat()
        except OSError:
            continue
        if (not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid()
                or now - info.st_mtime < DEAD_DIR_AGE_S or someone_listens(entry / SOCKET_NAME)):
            continue
        shutil.rmtree(entry, ignore_errors=True)
        removed += not entry.exists()
    return removed
