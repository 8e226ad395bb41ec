"""Starts kvmanager, executor and gateway as local processes and stops them.

Used by ``kvserve up`` (and so ``make run``), the benchmark sweep and the
tests. Each service is ``python -m <package>``; the launcher passes ports and
addresses on the command line, so ``KVSERVE_*`` variables still set the rest.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from kvserve.errors import StartupError
from kvserve.health import wait_until_serving
from kvserve.ports import (
    DEFAULT_EXECUTOR_PORT, DEFAULT_GATEWAY_PORT, DEFAULT_HOST, DEFAULT_HTTP_PORT, DEFAULT_KVMANAGER_PORT,
)
from kvserve.server import LAUNCHER_PID_ENV, check_port_free

REPO_ROOT = Path(__file__).resolve().parent.parent


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


def start_healthy(module: str, args: list[str], *, timeout: float, **kwargs) -> ServiceProcess:
    """``spawn`` and wait for SERVING; on failure the process is killed and the error says why."""
    # Checked here too: otherwise an older server on the port would answer the health check.
    try:
        check_port_free(f"{kwargs.get('host', DEFAULT_HOST)}:{kwargs['port']}")
    except StartupError as exc:
        raise RuntimeError(f"{module}: {exc}") from exc
    service = spawn(module, args, **kwargs)
    try:
        wait_until_serving(service.address, timeout, is_alive=service.alive)
    except (TimeoutError, RuntimeError) as exc:
        service.stop(signal.SIGKILL)
        tail = service.logs()[-3000:]
        raise RuntimeError(f"{module} did not become healthy: {exc}" + (f"\n{tail}" if tail else "")) from exc
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


@dataclass
class Stack:
    """kvmanager, executor and gateway, all healthy."""

    kvmanager: ServiceProcess
    executor: ServiceProcess
    gateway: ServiceProcess
    http_port: int

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


def start_stack(config: StackConfig) -> Stack:
    """Starts the three services in dependency order; stops what started if one fails."""
    started: list[ServiceProcess] = []

    def start(module: str, port: int, args: list[str]) -> ServiceProcess:
        log_path = config.log_dir / f"{module}-{port}.log" if config.log_dir else None
        service = start_healthy(module, args, host=config.host, port=port, log_path=log_path,
                                env=config.env, timeout=config.timeout)
        started.append(service)
        return service

    try:
        kvmanager = start("kvmanager", config.kvmanager_port, config.kvmanager_args)
        executor = start("executor", config.executor_port, ["--model", str(config.model_dir), *config.executor_args])
        gateway = start(
            "gateway", config.gateway_port,
            ["--http-port", str(config.http_port), "--kvmanager-address", kvmanager.address,
             "--executor-address", executor.address, "--model", str(config.model_dir), *config.gateway_args],
        )
    except BaseException:
        for service in reversed(started):
            service.stop()
        raise
    return Stack(kvmanager, executor, gateway, config.http_port)
