"""Where the executors are: ``--executor-address`` as a comma-separated list.

* ``host:port`` — one executor, used as written (a name is resolved by gRPC).
* ``dns:///name:port`` — every address the name resolves to is an executor, and the
  name is resolved again every ``--executor-discovery-interval`` seconds: a
  Kubernetes headless Service or compose replicas (``deploy.replicas``) grow and
  shrink the set while the gateway serves. An address that disappears leaves (its
  requests move to the others); a failed resolution keeps the last answer.
"""
from __future__ import annotations

import asyncio
import socket
from dataclasses import dataclass

from kvserve.errors import InvalidArgument
from kvserve.logs import get_logger

log = get_logger("gateway.discovery")

DNS_SCHEME = "dns:///"


@dataclass(frozen=True)
class ExecutorTarget:
    host: str
    port: int
    resolve: bool  # dns:/// — re-resolved, each address an executor

    @property
    def static_address(self) -> str:
        return f"{self.host}:{self.port}"


def parse_targets(value: str) -> list[ExecutorTarget]:
    targets = []
    for item in (part.strip() for part in value.split(",")):
        if not item:
            continue
        resolve = item.startswith(DNS_SCHEME)
        hostport = item[len(DNS_SCHEME):] if resolve else item
        host, sep, port = hostport.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise InvalidArgument(f"executor_address: {item!r} is not host:port or dns:///name:port")
        targets.append(ExecutorTarget(host.strip("[]"), int(port), resolve))
    if not targets:
        raise InvalidArgument("executor_address: no executor given")
    return targets


def _format(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def resolve_targets(targets: list[ExecutorTarget], previous: dict[ExecutorTarget, list[str]]
                          ) -> dict[ExecutorTarget, list[str]]:
    """Addresses per target; a dns target that fails to resolve keeps its previous answer."""
    loop = asyncio.get_running_loop()
    answers: dict[ExecutorTarget, list[str]] = {}
    for target in targets:
        if not target.resolve:
            answers[target] = [target.static_address]
            continue
        try:
            infos = await loop.getaddrinfo(target.host, target.port, type=socket.SOCK_STREAM)
        except OSError as exc:
            log.warning("executor_dns_failed", name=target.host, reason=str(exc))
            answers[target] = previous.get(target, [])
            continue
        answers[target] = sorted({_format(info[4][0], target.port) for info in infos})
    return answers
