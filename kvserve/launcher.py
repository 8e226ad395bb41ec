"""Starts kvmanager, executor and gateway as local processes and stops them.

Used by ``kvserve up`` (and so ``make run``), the benchmark sweep and the
tests. Each service is ``python -m <package>``; the launcher passes ports and
addresses on the command line, so ``KVSERVE_*`` variables still set the rest
(secrets go in the environment: ``KVSERVE_SERVICE_TOKEN``, ``KVSERVE_API_KEY``).

``start_stack`` starts all three at once and waits for them together, so a
stack is up about as soon as its slowest service (the executor's model load).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import grpc

from kvserve.auth import bearer_metadata
from kvserve.errors import StartupError
from kvserve.health import PROBE_OPTIONS, check
from kvserve.ports import (
    DEFAULT_EXECUTOR_PORT, DEFAULT_GATEWAY_PORT, DEFAULT_HOST, DEFAULT_HTTP_PORT, DEFAULT_KVMANAGER_PORT,
)
from kvserve.server import LAUNCHER_PID_ENV, check_port_free
from kvserve.v1 import gateway_pb2, gateway_pb2_grpc

REPO_ROOT = Path(__file__).resolve().parent.parent
SERVICE_TOKEN_ENV = "KVSERVE_SERVICE_TOKEN"
API_KEY_ENV = "KVSERVE_API_KEY"
# Health is polled every POLL_INTERVAL_S with a fresh check that gives up after PROBE_TIMEOUT_S.
POLL_INTERVAL_S = 0.1
PROBE_TIMEOUT_S = 0.5
GATEWAY_PROBE_TIMEOUT_S = 10.0


@dataclass
class ServiceProcess:
    """One running service."""

    module: str
    host: str
    port: int
    proc: subprocess.Popen
    log_path: Path | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def logs(self) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        """Sends ``sig``, waits, kills after ``timeout`` s; returns the exit code."""
        if self.alive():
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def with_huge_page_malloc(env: dict[str, str]) -> dict[str, str]:
    """``env`` with glibc's malloc asked to madvise its main heap and mmap'd chunks for huge pages
    (glibc 2.35+, ignored by older ones): those fault in as 2 MiB pages where the kernel's THP
    policy is ``madvise`` or ``always``, instead of being collapsed into them after the start
    (SmolLM2, 1 GiB of KV: 2.3 s of collapsing left instead of 3.9 s; docs/executor.md)."""
    tunables = [t for t in env.get("GLIBC_TUNABLES", "").split(":") if t]
    if any(t.startswith("glibc.malloc.hugetlb=") for t in tunables):
        return env
    return {**env, "GLIBC_TUNABLES": ":".join([*tunables, "glibc.malloc.hugetlb=1"])}


def spawn(module: str, args: list[str], *, host: str = DEFAULT_HOST, port: int,
          log_path: Path | None = None, env: dict[str, str] | None = None) -> ServiceProcess:
    """Starts ``python -m module --host H --port P *args`` without waiting."""
    child_env = dict(os.environ if env is None else env)
    child_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), child_env.get("PYTHONPATH")]))
    child_env[LAUNCHER_PID_ENV] = str(os.getpid())
    out: IO[bytes] | None = log_path.open("wb") if log_path else None
    proc = subprocess.Popen(
        [sys.executable, "-m", module, "--host", host, "--port", str(port), *args],
        env=child_env, stdout=out, stderr=subprocess.STDOUT if out else None,
        # Own session: a terminal's Ctrl-C reaches only the launcher, which stops the services
        # in order, once. (No preexec_fn: forking a threaded parent and running Python there can deadlock.)
        start_new_session=True,
    )
    return ServiceProcess(module, host, port, proc, log_path)


class StartupFailed(RuntimeError):
    """A service died or did not become healthy while the launcher waited for it."""

    def __init__(self, service: ServiceProcess, reason: str, tail_chars: int = 3000):
        self.service = service
        tail = service.logs()[-tail_chars:]
        super().__init__(f"{service.module} did not become healthy: {reason}" + (f"\n{tail}" if tail else ""))


def _exit_reason(service: ServiceProcess) -> str:
    code = service.proc.returncode
    how = f"signal {-code}" if code is not None and code < 0 else f"code {code}"
    return f"the process exited ({how}) during start-up"


def wait_healthy(services: list[ServiceProcess], timeout: float, *, interval: float = POLL_INTERVAL_S) -> None:
    """Waits until every one of ``services`` answers SERVING, polling them all in one loop.

    Each poll is a fresh short-timeout health check (``kvserve.health.check``). Raises
    ``StartupFailed`` naming the service, with its log tail, as soon as any of them exits
    (one already healthy included), or naming the first still pending after ``timeout`` s.
    """
    deadline = time.monotonic() + timeout
    pending = list(services)
    while True:
        for service in list(pending):
            if check(service.address, timeout=PROBE_TIMEOUT_S):
                pending.remove(service)
        for service in services:
            if not service.alive():
                raise StartupFailed(service, _exit_reason(service))
        if not pending:
            return
        if time.monotonic() >= deadline:
            raise StartupFailed(pending[0], f"{pending[0].address} not SERVING after {timeout:.0f}s")
        time.sleep(interval)


def _check_ports_free(host: str, named_ports: list[tuple[str, int]]) -> None:
    """Checked before anything starts: otherwise an older server on the port would answer the
    health check, and a clash found late would cost a model load."""
    for module, port in named_ports:
        try:
            check_port_free(f"{host}:{port}")
        except StartupError as exc:
            raise RuntimeError(f"{module}: {exc}") from exc


def start_healthy(module: str, args: list[str], *, timeout: float, **kwargs) -> ServiceProcess:
    """``spawn`` and wait for SERVING; on failure the process is killed and the error says why."""
    _check_ports_free(kwargs.get("host", DEFAULT_HOST), [(module, kwargs["port"])])
    service = spawn(module, args, **kwargs)
    try:
        wait_healthy([service], timeout)
    except BaseException:
        service.stop(signal.SIGKILL)
        raise
    return service


@dataclass
class StackConfig:
    """Where the three services listen and what each is given beyond that."""

    model_dir: Path
    host: str = DEFAULT_HOST
    kvmanager_port: int = DEFAULT_KVMANAGER_PORT
    executor_port: int = DEFAULT_EXECUTOR_PORT
    gateway_port: int = DEFAULT_GATEWAY_PORT
    http_port: int = DEFAULT_HTTP_PORT
    kvmanager_args: list[str] = field(default_factory=list)
    executor_args: list[str] = field(default_factory=list)
    gateway_args: list[str] = field(default_factory=list)
    log_dir: Path | None = None
    env: dict[str, str] | None = None
    timeout: float = 300.0
    # Given to all three (KVSERVE_SERVICE_TOKEN): kvmanager and executor require it, the gateway sends it.
    service_token: str | None = None
    # The gateway's --api-key (KVSERVE_API_KEY); the launcher's readiness probe sends it.
    api_key: str | None = None


@dataclass
class Stack:
    """kvmanager, executor and gateway, all healthy."""

    kvmanager: ServiceProcess
    executor: ServiceProcess
    gateway: ServiceProcess
    http_port: int
    # What the gateway serves (its GetModelInfo): None where an API key the launcher was not
    # told kept it from asking.
    model_info: gateway_pb2.ModelInfo | None = None

    @property
    def http_url(self) -> str:
        return f"http://{self.gateway.host}:{self.http_port}"

    @property
    def grpc_address(self) -> str:
        return self.gateway.address

    def services(self) -> list[ServiceProcess]:
        return [self.kvmanager, self.executor, self.gateway]

    def stop(self) -> dict[str, int]:
        """SIGTERM in reverse start order; returns each exit code."""
        return {s.module: s.stop() for s in reversed(self.services())}


def _wait_gateway_connected(gateway: ServiceProcess, services: list[ServiceProcess], api_key: str | None,
                            deadline: float, *, interval: float = POLL_INTERVAL_S) -> gateway_pb2.ModelInfo | None:
    """Until the gateway has its kvmanager pool and session: ``GetModelInfo`` sets them up when
    the gateway has none (it started before its dependencies answered) and fails UNAVAILABLE
    while one of them does not answer; returns its answer. UNAUTHENTICATED (an API key the
    launcher was not told) means the gateway serves (None); it connects on its first request.
    Any other error (e.g. a tokenizer that is not the executor's, or a dependency refusing the
    gateway's service token) means this stack cannot serve."""
    metadata = bearer_metadata(api_key)
    last = "no answer yet"
    with grpc.insecure_channel(gateway.address, options=PROBE_OPTIONS) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        while True:
            try:
                return stub.GetModelInfo(gateway_pb2.GetModelInfoRequest(), timeout=GATEWAY_PROBE_TIMEOUT_S,
                                         metadata=metadata)
            except grpc.RpcError as exc:
                code = exc.code()
                if code == grpc.StatusCode.UNAUTHENTICATED:
                    return None
                last = f"{code.name}: {exc.details()}"
                # A dependency refusing the gateway's service token will not change its mind.
                refused = ": UNAUTHENTICATED:" in (exc.details() or "")
                if refused or code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise StartupFailed(gateway, f"the gateway cannot serve: {last}") from exc
            for service in services:
                if not service.alive():
                    raise StartupFailed(service, _exit_reason(service))
            if time.monotonic() >= deadline:
                raise StartupFailed(gateway, f"not connected to kvmanager and executor in time: {last}")
            time.sleep(interval)


def start_stack(config: StackConfig) -> Stack:
    """Starts the three services at once and returns when the stack can serve.

    kvmanager, executor and gateway are spawned together (the gateway tolerates dependencies
    that do not answer yet), so start-up takes about as long as the slowest (the executor's
    model load). Then: all three SERVING, and the gateway connected to both (see
    ``_wait_gateway_connected``). If one dies or the timeout passes, all are stopped and the
    error names the service, with its log tail.
    """
    _check_ports_free(config.host, [("kvmanager", config.kvmanager_port), ("executor", config.executor_port),
                                    ("gateway", config.gateway_port), ("gateway (HTTP)", config.http_port)])
    env = dict(os.environ if config.env is None else config.env)
    if config.service_token:  # in the environment, not on command lines that `ps` shows
        env[SERVICE_TOKEN_ENV] = config.service_token
    gateway_env = dict(env)
    if config.api_key:
        gateway_env[API_KEY_ENV] = config.api_key
    deadline = time.monotonic() + config.timeout
    started: list[ServiceProcess] = []

    def start(module: str, port: int, args: list[str], service_env: dict[str, str]) -> ServiceProcess:
        log_path = config.log_dir / f"{module}-{port}.log" if config.log_dir else None
        service = spawn(module, args, host=config.host, port=port, log_path=log_path, env=service_env)
        started.append(service)
        return service

    try:
        kvmanager = start("kvmanager", config.kvmanager_port, config.kvmanager_args, env)
        executor = start("executor", config.executor_port,
                         ["--model", str(config.model_dir), *config.executor_args], with_huge_page_malloc(env))
        gateway = start(
            "gateway", config.gateway_port,
            ["--http-port", str(config.http_port), "--kvmanager-address", kvmanager.address,
             "--executor-address", executor.address, "--model", str(config.model_dir), *config.gateway_args],
            gateway_env,
        )
        wait_healthy(started, config.timeout)
        model_info = _wait_gateway_connected(gateway, started, config.api_key or gateway_env.get(API_KEY_ENV),
                                             deadline)
    except BaseException:
        for service in reversed(started):
            service.stop(timeout=10.0)
        raise
    return Stack(kvmanager, executor, gateway, config.http_port, model_info)
