"""A kvserve cluster for benchmarks that need more than ``kvserve.launcher.start_stack`` gives:
several executors behind one gateway, each service with its own flags and environment.

``start_cluster`` spawns kvmanager, the executors and a gateway on free ports and returns once
the gateway's /health is 200 with every executor up (``kvserve:executor_up``); a service that
dies during start-up stops the others and raises with its log's tail.
"""
from __future__ import annotations

import signal
import time
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

from kvserve.config import without_flag_env
from kvserve.ports import free_port

EXECUTOR_UP = ("kvserve:executor_up",)


def service_env(threads: int | None = None) -> dict[str, str]:
    """This environment without ``KVSERVE_*`` flag variables (only the bench's flags apply);
    with ``threads``, OpenMP/MKL limited to that many."""
    env = without_flag_env()
    if threads:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    return env


@dataclass
class Cluster:
    kvmanager: object  # kvserve.launcher.Service, like each executor and the gateway
    executors: list
    gateway: object
    http_url: str

    def services(self) -> list:
        return [self.kvmanager, *self.executors, self.gateway]

    def stop(self) -> None:
        for service in reversed(self.services()):
            service.stop(timeout=20.0)


def wait_ready(cluster: Cluster, deadline: float) -> None:
    """Until the gateway's /health is 200 with every executor up (``kvserve:executor_up``)."""
    import httpx

    from bench.server_metrics import parse_labeled

    with httpx.Client(timeout=10) as client:
        while time.monotonic() < deadline:
            with suppress(httpx.HTTPError):
                if client.get(cluster.http_url + "/health").status_code == 200:  # sets kvserve:executor_up
                    up = parse_labeled(client.get(cluster.http_url + "/metrics").text, EXECUTOR_UP, "executor")
                    if all(up.get(e.address) == 1 for e in cluster.executors):
                        return
            if dead := [s for s in cluster.services() if not s.alive()]:
                raise RuntimeError(f"{dead[0].module} exited during start-up:\n{dead[0].logs()[-2000:]}")
            time.sleep(0.2)
    raise RuntimeError("the gateway does not have every executor up in time")


def start_cluster(executor_flags: list[list[str]], gateway_flags: list[str], log_dir: Path, *,
                  executor_env: dict[str, str] | None = None, env: dict[str, str] | None = None,
                  startup_timeout: float = 300.0, extra_flags: list[str] = ()) -> Cluster:
    """kvmanager, one executor per entry of ``executor_flags`` (its flags, ``executor_env`` or
    ``env``) and a gateway with all of them in ``--executor-address`` plus ``gateway_flags``;
    ``extra_flags`` go to every service (e.g. ``--log-level warning``)."""
    from kvserve.launcher import spawn

    env = service_env() if env is None else env
    log_dir.mkdir(parents=True, exist_ok=True)
    started = []

    def start(module: str, flags: list[str], service_env: dict[str, str], tag: str):
        port = free_port()
        started.append(spawn(module, [*flags, *extra_flags], port=port, log_path=log_dir / f"{tag}-{port}.log",
                             env=service_env))
        return started[-1]

    try:
        kvmanager = start("kvmanager", [], env, "kvmanager")
        executors = [start("executor", flags, executor_env or env, f"executor{i}")
                     for i, flags in enumerate(executor_flags)]
        http_port = free_port()
        gateway = start("gateway", ["--http-port", str(http_port), "--kvmanager-address", kvmanager.address,
                                    "--executor-address", ",".join(e.address for e in executors), *gateway_flags],
                        env, "gateway")
        cluster = Cluster(kvmanager, executors, gateway, f"http://{gateway.host}:{http_port}")
        wait_ready(cluster, time.monotonic() + startup_timeout)
    except BaseException:
        for service in reversed(started):
            service.stop(signal.SIGKILL)
        raise
    return cluster
