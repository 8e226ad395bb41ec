"""Client-side health checks: wait until a service reports SERVING."""
from __future__ import annotations

import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(address: str, service: str = "", timeout: float = 1.0) -> bool:
    """True when ``address`` answers SERVING for ``service`` ("" = the whole server)."""
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def wait_until_serving(address: str, timeout: float, service: str = "", is_alive=lambda: True) -> None:
    """Polls until SERVING; raises ``TimeoutError`` after ``timeout`` s or ``RuntimeError``
    as soon as ``is_alive()`` turns false (the process died)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check(address, service, timeout=1.0):
            return
        if not is_alive():
            raise RuntimeError(f"{address}: process exited before it was healthy")
        time.sleep(0.1)
    raise TimeoutError(f"{address} not SERVING after {timeout:.0f}s")


async def check_async(channel: grpc.aio.Channel, service: str = "", timeout: float = 1.0) -> bool:
    """Async twin of ``check`` over an existing channel."""
    stub = health_pb2_grpc.HealthStub(channel)
    try:
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
    except grpc.RpcError:
        return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def main(argv: list[str] | None = None) -> int:
    """``python -m kvserve.health HOST:PORT [SERVICE]``: exit 0 when SERVING (container healthchecks)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m kvserve.health", description=main.__doc__)
    parser.add_argument("address", help="host:port of a kvserve service")
    parser.add_argument("service", nargs="?", default="", help="service name; empty = the whole server")
    parser.add_argument("--timeout", type=float, default=2.0)
    args = parser.parse_args(argv)
    serving = check(args.address, args.service, timeout=args.timeout)
    print("SERVING" if serving else "NOT_SERVING")
    return 0 if serving else 1


if __name__ == "__main__":
    raise SystemExit(main())
