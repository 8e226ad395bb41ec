"""Where the services listen by default, named once.

Every service's ``--port``, the gateway's ``--http-port`` and dependency
addresses, ``kvserve up`` and the launcher take their defaults from here;
the tests and benchmarks take a free loopback port from ``free_port``.
"""
from __future__ import annotations

import socket

DEFAULT_HOST = "127.0.0.1"

DEFAULT_GATEWAY_PORT = 50051  # gateway gRPC (kvserve.v1.Gateway)
DEFAULT_HTTP_PORT = 8000  # gateway OpenAI-compatible HTTP
DEFAULT_KVMANAGER_PORT = 50052
DEFAULT_EXECUTOR_PORT = 50053

# Where a gateway looks for its dependencies unless told otherwise.
DEFAULT_KVMANAGER_ADDRESS = f"localhost:{DEFAULT_KVMANAGER_PORT}"
DEFAULT_EXECUTOR_ADDRESS = f"localhost:{DEFAULT_EXECUTOR_PORT}"


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the OS picks it), for a service a test or bench starts."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
