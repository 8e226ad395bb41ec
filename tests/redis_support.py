"""A real ``redis-server`` for tests, on a free loopback port.

``start_redis(tmp_path)`` starts one (no persistence, data dir under ``tmp_path``) and waits
until it answers PING; ``.stop()``, ``.kill()`` and ``.restart()`` let a test take it away
and bring it back on the same port. The fixtures: ``redis_server`` (one per test module)
and ``redis_url`` (that server, emptied before each test). A test module uses them with
``from tests.redis_support import redis_server, redis_url``.

Without ``redis-server`` on PATH or the redis package the tests skip, except where
``CI=true``: there they fail, so that the Redis backend is never silently untested.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from loopback_ports import free_port

START_TIMEOUT_S = 10.0


def require_redis() -> str:
    """The path of ``redis-server``, after checking that redis-py imports; skips (fails in CI)
    otherwise."""
    binary = shutil.which("redis-server")
    if binary is None:
        _unavailable("redis-server not installed (apt-get install redis-server)")
    try:
        import redis  # noqa: F401
    except ImportError:
        _unavailable("the redis package is not installed (pip install 'redis>=5')")
    return binary


def _unavailable(reason: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason}; CI=true, where the Redis tests must run")
    pytest.skip(reason)


def _ping(port: int) -> bool:
    """Whether a Redis server answers PING on the port (plain RESP, no client library)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            reply = sock.recv(16)
            return reply.startswith(b"+PONG") or reply.startswith(b"-NOAUTH")
    except OSError:
        return False


class RedisServer:
    """One ``redis-server`` process; its port and data directory survive restarts."""

    def __init__(self, binary: str, data_dir: Path, port: int, extra_args: Sequence[str] = ()) -> None:
        self.binary = binary
        self.extra_args = list(extra_args)
        self.data_dir = data_dir
        self.port = port
        self.log_path = data_dir / "redis.log"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        """Starts the server and waits until it answers PING (RuntimeError with its log if not)."""
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", str(self.data_dir), "--daemonize", "no", *self.extra_args]
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _ping(self.port):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.kill()
                tail = self.log_path.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"redis-server on port {self.port} did not start:\n{tail}")
            time.sleep(0.02)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 5 s."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()

    def restart(self) -> None:
        """Stops it if it runs, then starts it again on the same port and directory."""
        self.stop()
        self.start()


def start_redis(tmp_path: Path, *extra_args: str) -> RedisServer:
    """A started server with its data and log in ``tmp_path/redis``; the caller stops it.
    ``extra_args`` go to redis-server (``"--requirepass", "pw"``: PING then answers NOAUTH,
    which still counts as up). A port taken between choosing and binding it is retried
    with another."""
    binary = require_redis()
    data_dir = tmp_path / "redis"
    data_dir.mkdir(parents=True, exist_ok=True)
    for attempt in range(3):
        server = RedisServer(binary, data_dir, free_port(), extra_args)
        try:
            server.start()
            return server
        except RuntimeError:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    """One server for a test module (stopped at its end)."""
    server = start_redis(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server) -> str:
    """The module's server, emptied (and started again if a test stopped it)."""
    import redis

    if not _ping(redis_server.port):
        redis_server.restart()
    with redis.Redis.from_url(redis_server.url) as client:
        client.flushall()
    return redis_server.url
