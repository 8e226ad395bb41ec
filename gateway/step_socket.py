"""The gateway's end of an executor's step socket (docs/executor-contract.md, "The step socket").

An executor on the same host may offer, in Describe, a Unix socket that takes the steps
ExecuteStream takes, framed (kvserve/step_frames.py), without gRPC's per-message threads.
``StepSocket.open`` connects, sends the service token and checks that the executor
answering is the one Describe described (its instance id): a socket path that exists here
but belongs to another executor (or none) is never used.
"""
from __future__ import annotations

import asyncio

import grpc

from kvserve.step_frames import frame, split_reply
from kvserve.unix_sockets import open_greeted, read_frame


class StepSocketRefused(Exception):
    """The socket answered, but not as the executor Describe described (or without the token)."""


class StepSocket:
    """One open step socket: ``send`` a step, then ``read_reply``; one step at a time."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self._reader = reader
        self._writer = writer

    @classmethod
    async def open(cls, path: str, service_token: str | None, instance_id: str, timeout: float) -> StepSocket:
        """Raises ``OSError``, ``asyncio.TimeoutError``, ``asyncio.IncompleteReadError`` or
        ``StepSocketRefused`` when the socket is not this executor's or refuses the token."""
        return cls(*await open_greeted(path, service_token, instance_id, "executor", timeout, StepSocketRefused))

    def send(self, payload: bytes) -> None:
        """Queues one frame; the transport writes it before returning when the socket takes it."""
        self._writer.write(frame(payload))

    async def read_reply(self) -> tuple[grpc.StatusCode, bytes]:
        """The next reply frame's status and payload; ``asyncio.IncompleteReadError`` at EOF,
        ``FrameTooLarge`` for a length past the limit."""
        return split_reply(await read_frame(self._reader))

    def close(self) -> None:
        self._writer.close()
