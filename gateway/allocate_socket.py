"""The gateway's end of kvmanager's allocate socket (docs/kvmanager.md, "The allocate socket").

OpenSession may name a Unix socket on kvmanager's host that takes Allocate and Free framed
(kvmanager/allocate_socket.py). ``AllocateSocket.open`` connects, sends the service token and
checks that the kvmanager answering is the one whose OpenSession named it (its instance id).
Calls are pipelined: each is written at once and its reply is the next unanswered one in
order, so several backends (one per executor) share one connection, and a caller that gives up
leaves the order intact.
"""
from __future__ import annotations

import asyncio
import collections

import grpc

from kvserve.step_frames import FrameTooLarge, frame, split_reply
from kvserve.unix_sockets import open_greeted, read_frame

ALLOCATE, FREE = 1, 2  # method numbers (kvmanager/allocate_socket.py, METHODS)


class AllocateSocketRefused(Exception):
    """The socket answered, but not as the kvmanager that named it (or without the token)."""


class AllocateSocketBroken(Exception):
    """The connection ended or was closed; calls not yet answered may or may not have been applied."""


class AllocateSocketTimeout(AllocateSocketBroken):
    """A call had no reply in time: the connection is closed, and every call waiting on it fails."""


class AllocateSocket:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self._reader = reader
        self._writer = writer
        self._waiting: collections.deque[asyncio.Future] = collections.deque()
        self._broken: str | None = None
        self._reads: asyncio.Task | None = None

    @classmethod
    async def open(cls, path: str, service_token: str | None, instance_id: str, timeout: float) -> AllocateSocket:
        """Raises ``OSError``, ``asyncio.TimeoutError``, ``asyncio.IncompleteReadError``,
        ``FrameTooLarge`` or ``AllocateSocketRefused``."""
        allocate_socket = cls(*await open_greeted(path, service_token, instance_id, "kvmanager", timeout,
                                                  AllocateSocketRefused))
        allocate_socket._reads = asyncio.get_running_loop().create_task(allocate_socket._read_replies())
        return allocate_socket

    async def call(self, method: int, request_bytes: bytes, timeout: float) -> tuple[grpc.StatusCode, bytes]:
        """One call's status and payload. ``AllocateSocketBroken`` when the connection ends first;
        ``AllocateSocketTimeout`` after ``timeout`` (the connection is then closed: a kvmanager
        that does not answer in time is not waited for again). A caller cancelled while it waits
        cancels its reply, which is then skipped; it is never asyncio.wait_for, which on Python 3.11
        returns a result that came with the cancellation and so loses the cancellation."""
        if self._broken is not None:
            raise AllocateSocketBroken(self._broken)
        loop = asyncio.get_running_loop()
        reply = loop.create_future()
        self._waiting.append(reply)
        self._writer.write(frame(bytes((method,)) + request_bytes))  # on its way before the caller waits
        timer = loop.call_later(timeout, self.close, f"no reply within {timeout:.1f} s", AllocateSocketTimeout)
        try:
            return await reply
        finally:
            timer.cancel()

    async def _read_replies(self) -> None:
        try:
            while True:
                payload = await read_frame(self._reader)
                if not self._waiting:
                    raise AllocateSocketBroken("a reply to no call")
                reply = self._waiting.popleft()
                if not reply.done():
                    reply.set_result(split_reply(payload))
        except (OSError, asyncio.IncompleteReadError, FrameTooLarge, AllocateSocketBroken) as exc:
            self.close(f"the allocate socket failed: {exc!r}")

    def close(self, reason: str = "closed", error: type[AllocateSocketBroken] = AllocateSocketBroken) -> None:
        if self._broken is None:
            self._broken = reason
        self._writer.close()
        if self._reads is not None and self._reads is not asyncio.current_task():
            self._reads.cancel()
        while self._waiting:
            reply = self._waiting.popleft()
            if not reply.done():
                reply.set_exception(error(self._broken))
