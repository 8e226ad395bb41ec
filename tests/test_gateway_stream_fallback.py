"""The gateway falls back to unary Execute when an executor has no ExecuteStream, also when the
first write races the executor's UNIMPLEMENTED and fails with INTERNAL (grpc/grpc#36066)."""
from __future__ import annotations

import asyncio

import grpc

from gateway.clients import _answered_unimplemented


class FinishedCall:
    def __init__(self, code: grpc.StatusCode | None):
        self._code = code

    async def code(self):
        if self._code is None:
            await asyncio.sleep(10)  # a stream that never ends
        return self._code


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


def answered(call_code, error_code, details="") -> bool:
    return asyncio.run(_answered_unimplemented(FinishedCall(call_code), rpc_error(error_code, details)))


def test_unimplemented_or_an_internal_write_error_over_an_unimplemented_call_means_no_stream():
    assert answered(grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.UNIMPLEMENTED)
    assert answered(grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.INTERNAL, "Internal error from Core")


def test_any_other_failure_is_the_executors_error():
    assert not answered(grpc.StatusCode.INTERNAL, grpc.StatusCode.INTERNAL, "boom")
    assert not answered(grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE)
    assert not answered(grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.INVALID_ARGUMENT)
