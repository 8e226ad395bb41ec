"""Frames of the executor's step socket (docs/executor-contract.md, "The step socket") and of
kvmanager's allocate socket (docs/kvmanager.md, "The allocate socket").

Every frame is a 4-byte big-endian length, then that many bytes. The client's
frames carry a greeting (its service token, UTF-8, empty without one) and then
one request each (the step socket: an ``ExecuteRequest``; the allocate socket: a
method number byte and its request). The server's frames start with a status byte
(a gRPC status code number, 0 for OK) followed by the greeting's answer (its
``instance_id``) or the response message when OK, else a UTF-8 error message.
Replies come in request order, one per frame; a refused call leaves the
connection open.
"""
from __future__ import annotations

import struct

import grpc

from kvserve.server import MAX_MESSAGE_BYTES

HEADER = struct.Struct(">I")
MAX_FRAME_BYTES = MAX_MESSAGE_BYTES
OK = 0
STATUS_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}


class FrameTooLarge(ValueError):
    pass


def frame(payload: bytes) -> bytes:
    return HEADER.pack(len(payload)) + payload


def reply_frame(status: grpc.StatusCode, payload: bytes) -> bytes:
    return frame(bytes((status.value[0],)) + payload)


def error_frame(status: grpc.StatusCode, message: str) -> bytes:
    return reply_frame(status, message.encode())


def frame_length(header: bytes) -> int:
    """The payload length a header announces; ``FrameTooLarge`` past ``MAX_FRAME_BYTES``."""
    (length,) = HEADER.unpack(header)
    if length > MAX_FRAME_BYTES:
        raise FrameTooLarge(f"a frame of {length} bytes is over the {MAX_FRAME_BYTES}-byte limit")
    return length


def split_reply(payload: bytes) -> tuple[grpc.StatusCode, bytes]:
    """A reply frame's status and the rest; an empty or unknown status is INTERNAL."""
    if not payload:
        return grpc.StatusCode.INTERNAL, b"an empty reply frame"
    status = STATUS_BY_NUMBER.get(payload[0])
    if status is None:
        return grpc.StatusCode.INTERNAL, f"a reply with unknown status {payload[0]}".encode()
    return status, payload[1:]
