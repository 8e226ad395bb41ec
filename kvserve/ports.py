"""Where the services listen by default, named once.

Every service's ``--port``, the gateway's ``--http-port`` and dependency
addresses, ``kvserve up`` and the launcher take their defaults from here.
"""
from __future__ import annotations

DEFAULT_HOST = "127.0.0.1"

DEFAULT_GATEWAY_PORT = 50051  # gateway gRPC (kvserve.v1.Gateway)
DEFAULT_HTTP_PORT = 8000  # gateway OpenAI-compatible HTTP
DEFAULT_KVMANAGER_PORT = 50052
DEFAULT_EXECUTOR_PORT = 50053

# Where a gateway looks for its dependencies unless told otherwise.
DEFAULT_KVMANAGER_ADDRESS = f"localhost:{DEFAULT_KVMANAGER_PORT}"
DEFAULT_EXECUTOR_ADDRESS = f"localhost:{DEFAULT_EXECUTOR_PORT}"
