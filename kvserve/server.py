"""gRPC server plumbing shared by the three services.

``GrpcServer`` wires a ``grpc.aio`` server with the standard health service,
server reflection and ``DomainErrorInterceptor`` (domain errors → status
codes), optionally with bearer-token authentication (``kvserve.auth``; health
and reflection stay open) and TLS; ``run_service`` runs a service's async main
until SIGTERM/SIGINT and turns start-up failures into a one-line error and exit
code 1.
"""
from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from kvserve.auth import BearerAuthInterceptor, BearerToken, server_credentials
from kvserve.errors import KVServeError, StartupError
from kvserve.logs import get_logger

log = get_logger("kvserve.server")

# 64 MiB: a batched Execute of long prompts carries many token ids.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
SERVER_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
]


@dataclass(frozen=True)
class Service:
    """One servicer to host: its full proto name and the generated ``add_*_to_server``."""

    full_name: str
    servicer: object
    add_to_server: Callable[[object, grpc.aio.Server], None]


def status_for(exc: KVServeError) -> grpc.StatusCode:
    return getattr(grpc.StatusCode, exc.code, grpc.StatusCode.INTERNAL)


class _Undecodable:
    """A request message protobuf could not parse (e.g. a string field that is not UTF-8)."""

    def __init__(self, error: Exception):
        self.error = error


def _lenient(deserializer):
    """grpc answers a deserializer's exception with UNKNOWN; keep it to answer INVALID_ARGUMENT."""
    if deserializer is None:
        return None

    def deserialize(data: bytes):
        try:
            return deserializer(data)
        except Exception as exc:  # noqa: BLE001 — any parse failure is the sender's
            return _Undecodable(exc)

    return deserialize


class DomainErrorInterceptor(grpc.aio.ServerInterceptor):
    """Aborts an RPC with the status code a raised ``KVServeError`` names.

    A request that does not parse is INVALID_ARGUMENT; any other exception becomes
    INTERNAL with its message, and is logged.
    """

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                self._wrap_unary(handler.unary_unary, method),
                request_deserializer=_lenient(handler.request_deserializer),
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                self._wrap_stream(handler.unary_stream, method),
                request_deserializer=_lenient(handler.request_deserializer),
                response_serializer=handler.response_serializer,
            )
        if handler.stream_stream is not None:
            return grpc.stream_stream_rpc_method_handler(
                self._wrap_bidi(handler.stream_stream, method),
                request_deserializer=_lenient(handler.request_deserializer),
                response_serializer=handler.response_serializer,
            )
        return handler

    @staticmethod
    async def _abort(context: grpc.aio.ServicerContext, exc: Exception, method: str) -> None:
        if isinstance(exc, KVServeError):
            await context.abort(status_for(exc), str(exc))
        log.error("rpc_failed", method=method, error=repr(exc), exc_info=exc)
        await context.abort(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")

    def _wrap_unary(self, behavior, method: str):
        async def unary(request, context):
            await _refuse_malformed(request, context)
            try:
                return await behavior(request, context)
            except grpc.aio.AbortError:
                raise
            except Exception as exc:  # noqa: BLE001 — every error gets a status code
                await self._abort(context, exc, method)

        return unary

    async def _relay(self, replies, context: grpc.aio.ServicerContext, method: str):
        """A streaming handler's replies, and its error as a status."""
        try:
            async for item in replies:
                yield item
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001
            await self._abort(context, exc, method)

    def _wrap_stream(self, behavior, method: str):
        async def stream(request, context):
            await _refuse_malformed(request, context)
            async for item in self._relay(behavior(request, context), context, method):
                yield item

        return stream

    def _wrap_bidi(self, behavior, method: str):
        async def bidi(request_iterator, context):
            async def requests():
                async for request in request_iterator:
                    await _refuse_malformed(request, context)
                    yield request

            async for item in self._relay(behavior(requests(), context), context, method):
                yield item

        return bidi


async def _refuse_malformed(request, context: grpc.aio.ServicerContext) -> None:
    if isinstance(request, _Undecodable):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed request message: {request.error}")


def check_port_free(address: str) -> None:
    """Fails early, in one line, where grpc would log a C-core error before failing."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]") or "0.0.0.0"
    if int(port) == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        # REUSEADDR: a port in TIME_WAIT is free; one with a listener still fails.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, int(port)))
        except OSError as exc:
            raise StartupError(f"cannot listen on {address}: {exc.strerror or exc}") from exc


@dataclass(frozen=True)
class TlsFiles:
    """PEM files of a server's certificate (chain) and private key."""

    cert_file: str
    key_file: str

    @classmethod
    def from_args(cls, args) -> TlsFiles | None:
        """From ``--tls-cert-file`` / ``--tls-key-file`` (see ``kvserve.config.add_server_flags``)."""
        return cls(args.tls_cert_file, args.tls_key_file) if args.tls_cert_file else None


class GrpcServer:
    """A ``grpc.aio`` server with health, reflection and the error interceptor.

    ``auth``: every RPC but health and reflection needs ``authorization: Bearer <token>``
    metadata (UNAUTHENTICATED otherwise; ``auth_what`` names the secret in that message).
    ``tls``: serve TLS instead of plaintext.
    """

    def __init__(self, name: str, host: str, port: int, services: Iterable[Service], *,
                 auth: BearerToken | None = None, auth_what: str = "token", tls: TlsFiles | None = None):
        self.name = name
        self.address = f"{host}:{port}"
        self.services = list(services)
        self.health = health_aio.HealthServicer()
        self._server: grpc.aio.Server | None = None
        self.port = port
        self.auth = auth
        self.auth_what = auth_what
        self.tls = tls

    async def start(self) -> None:
        credentials = server_credentials(self.tls.cert_file, self.tls.key_file) if self.tls else None
        # Authentication first: a refused caller's message is never parsed.
        interceptors = [BearerAuthInterceptor(self.auth, self.auth_what)] if self.auth else []
        interceptors.append(DomainErrorInterceptor())
        server = grpc.aio.server(interceptors=interceptors, options=SERVER_OPTIONS)
        for service in self.services:
            service.add_to_server(service.servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        names = [s.full_name for s in self.services]
        reflection.enable_server_reflection(
            [*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
            server,
        )
        check_port_free(self.address)
        try:
            if credentials is not None:
                self.port = server.add_secure_port(self.address, credentials)
            else:
                self.port = server.add_insecure_port(self.address)
        except RuntimeError as exc:
            raise StartupError(f"cannot listen on {self.address}: port in use or address invalid") from exc
        if self.port == 0:
            raise StartupError(f"cannot listen on {self.address}: port in use or address invalid")
        await server.start()
        self._server = server
        for full_name in ["", *names]:
            await self.health.set(full_name, health_pb2.HealthCheckResponse.SERVING)
        log.info("grpc_server_started", service=self.name, address=self.address, services=names,
                 tls=credentials is not None, auth=self.auth is not None)

    async def stop(self, grace: float) -> None:
        """Reports NOT_SERVING, stops accepting, gives in-flight RPCs ``grace`` seconds."""
        if self._server is None:
            return
        await self.health.enter_graceful_shutdown()
        await self._server.stop(grace)
        self._server = None
        log.info("grpc_server_stopped", service=self.name)


async def wait_for_shutdown_signal() -> signal.Signals:
    """Returns the first SIGTERM or SIGINT received."""
    loop = asyncio.get_running_loop()
    received: asyncio.Future[signal.Signals] = loop.create_future()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda s=sig: received.done() or received.set_result(s))
    try:
        return await received
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


LAUNCHER_PID_ENV = "KVSERVE_LAUNCHER_PID"


def _exit_with_launcher() -> None:
    """Started by ``kvserve.launcher``: ask the kernel for SIGTERM when the launcher dies,
    however it dies, so no orphaned service keeps ports and memory."""
    launcher_pid = os.environ.get(LAUNCHER_PID_ENV)
    if not launcher_pid or not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGTERM))
    if os.getppid() != int(launcher_pid):  # it died before we asked
        os.kill(os.getpid(), signal.SIGTERM)


def run_service(prog: str, main: Callable[[], Awaitable[None]]) -> int:
    """Runs ``main`` in a fresh event loop; a ``StartupError`` prints one line and returns 1."""
    _exit_with_launcher()
    try:
        asyncio.run(main())
    except StartupError as exc:
        sys.stderr.write(f"{prog}: error: {exc}\n")
        return 1
    except KeyboardInterrupt:
        pass
    return 0
