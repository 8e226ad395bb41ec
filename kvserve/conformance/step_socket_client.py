"""A step-socket client for the conformance kit, written from the frame layout in
docs/executor-contract.md ("The step socket") with the standard library only."""
from __future__ import annotations

import socket
import struct

from kvserve.v1 import executor_pb2 as pb

HEADER = struct.Struct(">I")


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
