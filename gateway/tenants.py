"""Who a request belongs to: its tenant, from the API key that authenticated it or a header.

A tenant is a kvmanager hash key (``SequenceAllocation.tenant``): tenants never share
cached KV, except the range of a prompt a request marks shareable. The gateway names
the tenant of each request in one of three ways:

* ``--api-keys-file FILE``: a JSON object ``{"<key>": "<tenant>", ...}``; the key in
  ``Authorization: Bearer <key>`` (gRPC metadata ``authorization``) names the tenant, and
  the ``X-Kvserve-Tenant`` header is ignored. ``--api-key`` may be given beside it: its key
  is the default tenant's.
* ``--tenants a,b,c`` (no keys): the ``X-Kvserve-Tenant`` header (gRPC metadata
  ``x-kvserve-tenant``) picks one of the listed names; absent = the default tenant.
* neither: every request is the default tenant's ("" on the wire).

Names are checked as kvmanager checks them (``kvmanager.tenants.TENANT_NAME``, copied here:
the services never import each other); "shared" (kvmanager's shared namespace) is refused.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

from kvserve.auth import split_authorization
from kvserve.errors import InvalidArgument, StartupError

TENANT_HEADER = "x-kvserve-tenant"
TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
SHARED_NAMESPACE = "shared"  # kvmanager's namespace of shareable ranges: no tenant's name
DEFAULT_TENANT = ""
# Tenants labelled in metrics; the rest are summed under OTHER_LABEL.
MAX_TENANT_LABELS = 64
OTHER_LABEL = "other"
DEFAULT_LABEL = "default"


def check_tenant_name(field: str, name: str, *, allow_shared: bool = False) -> str:
    """A tenant name ("" is the default tenant); InvalidArgument naming ``field`` otherwise."""
    if not name:
        return DEFAULT_TENANT
    if not isinstance(name, str) or not TENANT_NAME.fullmatch(name):
        shown = name[:80] if isinstance(name, str) else name
        raise InvalidArgument(f"{field}: a tenant name is 1..64 characters of [A-Za-z0-9._-], starting with a "
                              f"letter or digit; got {shown!r}")
    if name == SHARED_NAMESPACE and not allow_shared:
        raise InvalidArgument(f"{field}: {SHARED_NAMESPACE!r} is reserved (the shared namespace), not a tenant")
    return name


def tenant_label(name: str) -> str:
    return name or DEFAULT_LABEL


def _digest(value: str | bytes) -> bytes:
    return hashlib.sha256(value.encode() if isinstance(value, str) else value).digest()


class ApiKeys:
    """Several API keys, each naming a tenant. ``matches_header`` (what
    ``kvserve.auth.BearerAuthInterceptor`` and ``ApiKeyAuth`` call) accepts any of them.

    Every candidate is compared with every key (``hmac.compare_digest`` of SHA-256 digests),
    so the time taken does not depend on which key matched, or on how much of one did."""

    def __init__(self, keys: Mapping[str, str]):
        if not keys:
            raise ValueError("no API keys")
        self._keys = [(_digest(key), tenant) for key, tenant in keys.items()]

    def __repr__(self) -> str:  # never a key
        return f"ApiKeys({len(self._keys)} keys)"

    @property
    def tenants(self) -> set[str]:
        return {tenant for _, tenant in self._keys}

    def tenant_of_secret(self, candidate: str | bytes | None) -> str | None:
        """The tenant the key names; None when it is no key."""
        if candidate is None:
            return None
        digest = _digest(candidate)
        found = None
        for key, tenant in self._keys:  # no early exit
            if hmac.compare_digest(digest, key) and found is None:
                found = tenant
        return found

    def tenant_of_header(self, value: str | bytes | None) -> str | None:
        """The tenant of ``Authorization: Bearer <key>``; None for no key or another scheme."""
        if value is None:
            return None
        is_bearer, credentials = split_authorization(value)
        tenant = self.tenant_of_secret(credentials)  # computed either way: no timing on the scheme
        return tenant if is_bearer else None

    def matches_header(self, value: str | bytes | None) -> bool:
        return self.tenant_of_header(value) is not None


def load_api_keys(path: str | Path, default_key: str | None = None) -> ApiKeys:
    """``--api-keys-file``: a JSON object of key → tenant name; ``default_key`` (``--api-key``)
    joins it as the default tenant's. StartupError saying what is wrong (never a key)."""
    flag = "--api-keys-file"
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise StartupError(f"{flag} {path}: {exc.strerror or exc}") from exc
    except ValueError as exc:
        raise StartupError(f"{flag} {path}: not valid JSON ({exc})") from exc
    if not isinstance(data, dict) or not data:
        raise StartupError(f'{flag} {path}: must be a non-empty JSON object {{"<key>": "<tenant>", ...}}')
    keys: dict[str, str] = {}
    for number, (key, tenant) in enumerate(data.items(), 1):
        if not key or not isinstance(tenant, str):
            raise StartupError(f"{flag} {path}: entry {number}: the key must be a non-empty string and its "
                               f"tenant a string")
        try:
            keys[key] = check_tenant_name(f"entry {number}", tenant)
        except InvalidArgument as exc:
            raise StartupError(f"{flag} {path}: {exc}") from None
    if default_key:
        if default_key in keys and keys[default_key] != DEFAULT_TENANT:
            raise StartupError(f"--api-key is also in {flag} {path} with another tenant")
        keys[default_key] = DEFAULT_TENANT
    return ApiKeys(keys)


def parse_tenant_list(value: str | None) -> frozenset[str]:
    """``--tenants a,b,c``."""
    names = [name.strip() for name in (value or "").split(",") if name.strip()]
    try:
        return frozenset(check_tenant_name("--tenants", name) for name in names)
    except InvalidArgument as exc:
        raise StartupError(str(exc)) from None


class TenantResolver:
    """The tenant of a request from its ``authorization`` and ``x-kvserve-tenant`` values.

    Authentication itself happens before (``ApiKeyAuth``, ``BearerAuthInterceptor``): here a
    request with keys configured carries a valid key."""

    def __init__(self, api_keys: ApiKeys | None = None, tenants: Iterable[str] = ()):
        self.api_keys = api_keys
        self.tenants = frozenset(tenants)

    @property
    def by_key(self) -> bool:
        return self.api_keys is not None

    def resolve(self, authorization: str | bytes | None, header: str | bytes | None) -> str:
        if self.api_keys is not None:
            return self.api_keys.tenant_of_header(authorization) or DEFAULT_TENANT
        if header is None:
            return DEFAULT_TENANT
        if isinstance(header, bytes):
            header = header.decode("latin-1")
        header = header.strip()
        if not header:
            return DEFAULT_TENANT
        name = check_tenant_name(f"{TENANT_HEADER} header", header)
        if name not in self.tenants:
            if not self.tenants:
                raise InvalidArgument(f"{TENANT_HEADER} header: this gateway has no tenants (start it with "
                                      f"--tenants or --api-keys-file); leave the header out")
            raise InvalidArgument(f"{TENANT_HEADER} header: unknown tenant {name!r}")
        return name


class TenantLabels:
    """Bounded label values: the first ``limit`` tenants seen keep their name, later ones are
    ``other`` (a tenant's label never changes while the process lives)."""

    def __init__(self, limit: int = MAX_TENANT_LABELS):
        self.limit = limit
        self._named: set[str] = set()

    def __call__(self, tenant: str) -> str:
        label = tenant_label(tenant)
        if label in self._named:
            return label
        if len(self._named) < self.limit and label != OTHER_LABEL:
            self._named.add(label)
            return label
        return OTHER_LABEL
