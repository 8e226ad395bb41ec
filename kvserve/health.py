"""Client-side health checks: wait until a service reports SERVING.

Health is open on every service (no token needed, see ``kvserve.auth``). Each
``check`` uses a fresh channel with a subchannel of its own: by default grpc
shares subchannels between the channels of a process to the same address, so
while any other channel to it is open (a client, an earlier probe's channel not
yet collected), a probe inherits that subchannel's reconnect backoff (1 s growing
to 120 s) and keeps failing fast after the server is up (3.8 s late after 12 s
of refused probes, measured).
"""
from __future__ import annotations

import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

PROBE_OPTIONS = [
    ("grpc.use_local_subchannel_pool", 1),
    ("grpc.enable_retries", 0),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
]


def _channel(address: str, root_certificates: bytes | None) -> grpc.Channel:
    if root_certificates is not None:
        return grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates), options=PROBE_OPTIONS)
    return grpc.insecure_channel(address, options=PROBE_OPTIONS)


def check(address: str, service: str = "", timeout: float = 1.0, *, root_certificates: bytes | None = None) -> bool:
    """True when ``address`` answers SERVING for ``service`` ("" = the whole server).

    ``root_certificates``: PEM CA bundle of a TLS server (plaintext when None)."""
    with _channel(address, root_certificates) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def wait_until_serving(address: str, timeout: float, service: str = "", is_alive=lambda: True, *,
                       root_certificates: bytes | None = None, interval: float = 0.1) -> None:
    """Polls until SERVING; raises ``TimeoutError`` after ``timeout`` s or ``RuntimeError``
    as soon as ``is_alive()`` turns false (the process died)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check(address, service, timeout=min(1.0, max(0.1, deadline - time.monotonic())),
                 root_certificates=root_certificates):
            return
        if not is_alive():
            raise RuntimeError(f"{address}: process exited before it was healthy")
        time.sleep(interval)
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
    parser.add_argument("--tls-ca-file", type=Path, default=None,
                        help="the service serves TLS: PEM CA bundle to verify it with")
    args = parser.parse_args(argv)
    roots = args.tls_ca_file.read_bytes() if args.tls_ca_file else None
    serving = check(args.address, args.service, timeout=args.timeout, root_certificates=roots)
    print("SERVING" if serving else "NOT_SERVING")
    return 0 if serving else 1


if __name__ == "__main__":
    raise SystemExit(main())
