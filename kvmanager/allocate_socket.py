"""The allocate socket: Allocate and Free over a Unix domain socket, for a gateway on the same host.

A gateway calls Allocate once a step. Over gRPC a call costs kvmanager ~0.4 ms of CPU and the
gateway ~0.2 ms on a 2-core VM, almost all of it gRPC's own (a Health check costs as much), and on
a CPU executor's host that CPU is taken from the forward pass (docs/kvmanager.md, "The allocate
socket"). Here a call is one frame each way (kvserve/step_frames.py) on kvmanager's event loop,
answered by the same servicer methods as over gRPC, so each is applied atomically and in order.

A client's first frame is the greeting, its service token (UTF-8, empty without one), answered
with this kvmanager's instance id. Every later frame is a method number byte (``METHODS``) and
then the request message; the reply, a status byte (a gRPC status code number, 0 for OK) and the
response message, or the error's message. Replies come in request order; a refused call leaves
the connection open.
"""
from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
from google.protobuf.message import DecodeError

from kvserve.aio import wait_within
from kvserve.auth import BearerToken
from kvserve.errors import KVServeError
from kvserve.logs import get_logger
from kvserve.server import status_for
from kvserve.step_frames import FrameTooLarge, error_frame, reply_frame
from kvserve.unix_sockets import SocketPlace, read_frame, remove_socket
from kvserve.v1 import kvmanager_pb2 as pb

log = get_logger("kvmanager.allocate_socket")

ALLOCATE_SOCKET = SocketPlace("the allocate socket", "kvserve-kvmanager-", "allocate.sock")
# method number -> (servicer method, request message)
METHODS = {1: ("Allocate", pb.AllocateRequest), 2: ("Free", pb.FreeRequest)}
GREETING_TIMEOUT_S = 5.0
SEND_TIMEOUT_S = 10.0  # a client that reads no reply for this long is dropped
WRITE_BUFFER_HIGH_BYTES = 1 << 20


async def answer_call(servicer, payload: bytes) -> bytes:
    """A call frame's reply frame, from the servicer method the gRPC call would reach."""
    if not payload:
        return error_frame(grpc.StatusCode.INVALID_ARGUMENT, "an empty call frame (no method number)")
    method = METHODS.get(payload[0])
    if method is None:
        return error_frame(grpc.StatusCode.UNIMPLEMENTED,
                           f"no method number {payload[0]} on the allocate socket (known: {sorted(METHODS)})")
    name, request_type = method
    try:
        request = request_type.FromString(payload[1:])
    except (DecodeError, ValueError) as exc:
        return error_frame(grpc.StatusCode.INVALID_ARGUMENT, f"malformed {name} request message: {exc}")
    try:
        reply = await getattr(servicer, name)(request, None)
    except KVServeError as exc:
        return error_frame(status_for(exc), str(exc))
    except Exception as exc:  # noqa: BLE001 — every error gets a status code, as over gRPC
        log.error("allocate_socket_call_failed", method=name, error=repr(exc), exc_info=exc)
        return error_frame(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")
    return reply_frame(grpc.StatusCode.OK, reply.SerializeToString())


class AllocateSocketListener:
    """Serves the allocate socket on the event loop kvmanager's gRPC servicer runs on."""

    def __init__(self, path: Path, owned_dir: Path | None, instance_id: str, servicer,
                 token: BearerToken | None):
        self.path = path
        self.instance_id = instance_id
        self._owned_dir = owned_dir
        self._servicer = servicer
        self._token = token
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[asyncio.StreamWriter] = set()

    @classmethod
    def create(cls, where: str, instance_id: str, servicer, token: BearerToken | None,
               parent: Path | None = None) -> AllocateSocketListener | None:
        """``where``: ``off`` (None), ``auto`` (a private directory under ``parent``, by default the
        temp directory) or a path."""
        place = ALLOCATE_SOCKET.resolve(where, parent)
        if place is None:
            return None
        path, owned_dir = place
        return cls(path, owned_dir, instance_id, servicer, token)

    async def start(self) -> None:
        listener = ALLOCATE_SOCKET.listen(self.path)
        self._server = await asyncio.start_unix_server(self._serve, sock=listener)
        log.info("allocate_socket_ready", path=str(self.path))

    async def stop(self) -> None:
        """Stops serving and removes the socket (and the directory ``auto`` made); after a start that
        failed, whatever was at the path stays."""
        started = self._server is not None
        if started:
            self._server.close()
            for writer in list(self._connections):
                writer.close()
            await self._server.wait_closed()
            self._server = None
        remove_socket(self.path if started else None, self._owned_dir)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._connections.add(writer)
        try:
            if await self._greet(reader, writer):
                await self._answer_calls(reader, writer)
        except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError):
            pass  # the client went away, or stopped reading its replies: its connection ends
        except FrameTooLarge as exc:
            writer.write(error_frame(grpc.StatusCode.INVALID_ARGUMENT, str(exc)))  # the rest cannot be skipped
        finally:
            self._connections.discard(writer)
            writer.close()

    async def _greet(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        token = await wait_within(read_frame(reader), GREETING_TIMEOUT_S)
        if self._token is not None and not self._token.matches_secret(token):
            writer.write(error_frame(grpc.StatusCode.UNAUTHENTICATED,
                                     "the allocate socket needs kvmanager's service token"))
            return False
        writer.write(reply_frame(grpc.StatusCode.OK, self.instance_id.encode()))
        return True

    async def _answer_calls(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            payload = await read_frame(reader)
            writer.write(await answer_call(self._servicer, payload))
            if writer.transport.get_write_buffer_size() > WRITE_BUFFER_HIGH_BYTES:
                await wait_within(writer.drain(), SEND_TIMEOUT_S)
