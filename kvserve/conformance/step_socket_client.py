"""A client of the executor's step socket and kvmanager's allocate socket for the conformance kit,
written from the frame layout in docs/executor-contract.md ("The step socket") with the standard
library only."""
from __future__ import annotations

import socket
import struct

from kvserve.conformance import Skip, require
from kvserve.v1 import executor_pb2 as pb

HEADER = struct.Struct(">I")
UNAUTHENTICATED = 16  # gRPC's status code number


class StepSocketClient:
    def __init__(self, path: str, token: str = "", timeout: float = 120.0):
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout)
        try:
            self._sock.connect(path)
            self.greeting = self.exchange(token.encode())
        except BaseException:
            self._sock.close()
            raise

    def exchange(self, payload: bytes) -> tuple[int, bytes]:
        """Sends one frame; the reply's status byte and the rest."""
        self.send(payload)
        return self.read_reply()

    def send(self, payload: bytes) -> None:
        self._sock.sendall(HEADER.pack(len(payload)) + payload)

    def read_reply(self) -> tuple[int, bytes]:
        (length,) = HEADER.unpack(self._read_exactly(HEADER.size))
        body = self._read_exactly(length)
        if not body:
            raise ConnectionError("an empty reply frame")
        return body[0], body[1:]

    def step(self, request: pb.ExecuteRequest) -> tuple[int, bytes]:
        return self.exchange(request.SerializeToString())

    def _read_exactly(self, size: int) -> bytes:
        data = bytearray()
        while len(data) < size:
            chunk = self._sock.recv(size - len(data))
            if not chunk:
                raise ConnectionError("the executor closed the step socket")
            data += chunk
        return bytes(data)

    def close(self) -> None:
        self._sock.close()


def open_greeted(path: str, instance_id: str, what: str, whose: str, timeout: float) -> StepSocketClient:
    """A client whose greeting answered OK and ``instance_id`` (``whose``: where that id came from).
    SKIP where ``what`` cannot be opened from here or wants a service token."""
    try:
        client = StepSocketClient(path, timeout=timeout)
    except OSError as error:
        raise Skip(f"{what} {path} cannot be opened from here: {error}") from error
    try:
        status, body = client.greeting
        if status == UNAUTHENTICATED:
            raise Skip(f"{what} wants a service token")
        require(status == 0 and body.decode(errors="replace") == instance_id,
                f"the greeting answered status {status} {body[:80]!r}, not OK and {whose} instance_id")
    except BaseException:
        client.close()
        raise
    return client
