"""Bearer-token authentication and TLS credentials shared by the three services.

* ``BearerToken``: one secret (the gateway's ``--api-key``, or the internal
  ``--service-token``), compared in constant time against an
  ``Authorization: Bearer <token>`` header or ``authorization`` gRPC metadata.
* ``BearerAuthInterceptor``: a ``grpc.aio`` server interceptor that answers
  UNAUTHENTICATED to every RPC without the token, except the health and
  reflection services (``OPEN_SERVICES``), so probes and ``grpcurl describe``
  keep working.
* ``bearer_call_interceptors``: the client side, adding the metadata to every call
  on a ``grpc.aio`` channel.
* ``server_credentials`` / ``channel_credentials``: TLS from PEM files.

Tokens are never logged or put in error messages.
"""
from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

import grpc

from kvserve.errors import StartupError

METADATA_KEY = "authorization"
SCHEME = "bearer"
# Services any client may call without a token: health probes (compose, k8s, the
# launcher) and reflection (it describes the public proto, nothing else).
OPEN_SERVICES = frozenset({
    "grpc.health.v1.Health",
    "grpc.reflection.v1alpha.ServerReflection",
    "grpc.reflection.v1.ServerReflection",
})


def _digest(value: str | bytes) -> bytes:
    return hashlib.sha256(value.encode() if isinstance(value, str) else value).digest()


class BearerToken:
    """A secret that ``Authorization: Bearer <secret>`` must carry.

    Both sides are hashed before ``hmac.compare_digest``, so the comparison takes the
    same time whatever the candidate (its length included)."""

    def __init__(self, secret: str):
        if not secret:
            raise ValueError("an empty token would accept nobody")
        self._digest = _digest(secret)

    def __repr__(self) -> str:  # never the secret
        return "BearerToken(***)"

    def matches_secret(self, candidate: str | bytes | None) -> bool:
        return candidate is not None and hmac.compare_digest(_digest(candidate), self._digest)

    def matches_header(self, value: str | bytes | None) -> bool:
        """True when ``value`` is ``Bearer <secret>`` (scheme case-insensitive)."""
        if value is None:
            return False
        is_bearer, credentials = split_authorization(value)
        ok = self.matches_secret(credentials)  # computed either way: no timing on the scheme
        return ok and is_bearer


def split_authorization(value: str | bytes) -> tuple[bool, str]:
    """An ``Authorization`` header or metadata value: (whether its scheme is Bearer, case-insensitive;
    its credentials). Callers check the credentials whatever the scheme, so that the time taken
    says nothing about it."""
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    scheme, _, credentials = value.strip().partition(" ")
    return scheme.lower() == SCHEME, credentials.strip()


def token_or_none(value: str | None) -> BearerToken | None:
    """A flag's value: unset or empty (``KVSERVE_API_KEY=``) means no authentication."""
    return BearerToken(value) if value else None


def _service_of(method: str) -> str:
    """``/grpc.health.v1.Health/Check`` → ``grpc.health.v1.Health``."""
    return method.lstrip("/").partition("/")[0]


class BearerAuthInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for every RPC whose ``authorization`` metadata is not
    ``Bearer <token>``, except the services in ``open_services``."""

    def __init__(self, token: BearerToken, what: str = "token", open_services=OPEN_SERVICES):
        self._token = token
        self._open = frozenset(open_services)
        self._message = (f"missing or invalid {what}: send gRPC metadata "
                         f"'{METADATA_KEY}: Bearer <{what.replace(' ', '-')}>'")

    async def intercept_service(self, continuation, handler_call_details):
        if _service_of(handler_call_details.method) in self._open:
            return await continuation(handler_call_details)
        values = [v for k, v in (handler_call_details.invocation_metadata or ()) if k == METADATA_KEY]
        if len(values) == 1 and self._token.matches_header(values[0]):
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        if handler is None:  # an unknown method stays UNIMPLEMENTED
            return None
        return self._refusal(handler)

    def _refusal(self, handler):
        message = self._message

        async def refuse(request_or_iterator, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

        # No deserializer: the message of a caller we refuse is never parsed.
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(refuse)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(refuse)
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(refuse)
        return grpc.stream_stream_rpc_method_handler(refuse)


class _BearerCallDetails:
    """Adds ``authorization: Bearer <token>`` to a call's details."""

    def __init__(self, secret: str):
        if not secret:
            raise ValueError("an empty token")
        self._entry = (METADATA_KEY, f"Bearer {secret}")

    def __repr__(self) -> str:  # never the secret
        return f"{type(self).__name__}(***)"

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*[(k, v) for k, v in (details.metadata or ()) if k != METADATA_KEY],
                                     self._entry)
        return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials,
                                          details.wait_for_ready)


class _BearerUnaryUnary(_BearerCallDetails, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


class _BearerUnaryStream(_BearerCallDetails, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


class _BearerStreamUnary(_BearerCallDetails, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return await continuation(self._details(client_call_details), request_iterator)


class _BearerStreamStream(_BearerCallDetails, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await continuation(self._details(client_call_details), request_iterator)


def bearer_call_interceptors(secret: str) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors that add ``authorization: Bearer <token>`` to every call on a grpc.aio channel.
    One per kind of call: a channel files an interceptor under the first kind it is an instance
    of, so one class of all four would see unary-unary calls only."""
    return [kind(secret) for kind in (_BearerUnaryUnary, _BearerUnaryStream, _BearerStreamUnary, _BearerStreamStream)]


def bearer_metadata(secret: str | None) -> tuple[tuple[str, str], ...]:
    """Per-call metadata for a synchronous stub (tests, tools): empty without a secret."""
    return ((METADATA_KEY, f"Bearer {secret}"),) if secret else ()


def _read(path: str | Path, flag: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise StartupError(f"{flag} {path}: {exc.strerror or exc}") from exc


def check_tls_flags(cert_file: str | None, key_file: str | None) -> str | None:
    """The error when only one of ``--tls-cert-file`` / ``--tls-key-file`` is given, else None."""
    if bool(cert_file) != bool(key_file):
        return "--tls-cert-file and --tls-key-file go together"
    return None


def server_credentials(cert_file: str | Path, key_file: str | Path) -> grpc.ServerCredentials:
    """TLS for a gRPC server from a PEM certificate (chain) and its private key."""
    key = _read(key_file, "--tls-key-file")
    cert = _read(cert_file, "--tls-cert-file")
    try:
        return grpc.ssl_server_credentials([(key, cert)])
    except Exception as exc:  # noqa: BLE001 — grpc's error, one line
        raise StartupError(f"--tls-cert-file/--tls-key-file: {exc}") from exc


def channel_credentials(ca_file: str | Path | None) -> grpc.ChannelCredentials:
    """TLS for a client: trust ``ca_file`` (PEM), or the system roots when None."""
    return grpc.ssl_channel_credentials(root_certificates=_read(ca_file, "--tls-ca-file") if ca_file else None)
