"""The admin HTTP API (``/admin/v1/*``, on with ``--admin-key``): tenant policies, per-tenant
stats and pinned prefixes, over kvmanager's admin calls.

``gateway.http_api.AdminAuth`` has checked ``Authorization: Bearer <admin key>`` before a
route here runs; the same key goes to kvmanager as ``kvserve-admin-key`` metadata (kvmanager
runs with the same ``--admin-key``). kvmanager's refusals become HTTP statuses
(``KVMANAGER_STATUS``) with its message.

A pin (``POST /admin/v1/pins``) is asked of kvmanager on every pool of this gateway; kvmanager
holds the prefix's full blocks as soon as they are cached. Where a pool does not hold them
yet, the gateway computes the prefix there once (a one-token generation over exactly those
tokens, as the pin's tenant; all of them shareable for a shared pin), then answers what each
pool holds (``GetPin``).
"""
from __future__ import annotations

import asyncio
import math
import time

import grpc
from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict

from gateway.clients import DependencyError
from gateway.http_api import error_response
from gateway.openai_protocol import ChatMessage, Float, Int, Text, message_dicts
from gateway.params import build_options
from gateway.tenants import SHARED_NAMESPACE, check_tenant_name
from kvserve.errors import InvalidArgument, Unavailable
from kvserve.logs import get_logger

log = get_logger("gateway.admin")

# The default tenant in a path (no tenant name starts with "_").
DEFAULT_TENANT_PATH = "_default"
UINT32_MAX = (1 << 32) - 1
MAX_WEIGHT = 1e6
# How long a pin's answer waits for the blocks its prefill computed to be published.
PIN_SETTLE_S = 3.0
# kvmanager's refusals of admin calls, as HTTP: (status, OpenAI-style error type).
KVMANAGER_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    # Over a tenant's quota: retrying the same pin will not help until the quota or pins change.
    grpc.StatusCode.RESOURCE_EXHAUSTED: (409, "conflict_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (409, "conflict_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "conflict_error"),
    # kvmanager refused the gateway's admin key (they were started with different keys).
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.UNAUTHENTICATED: (403, "permission_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
}

admin_router = APIRouter(prefix="/admin/v1")


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class TenantPolicyBody(_Body):
    weight: Float = 1.0
    quota_blocks: Int = 0
    store_quota_blocks: Int = 0


class PinBody(_Body):
    tenant: Text | None = None
    shared: bool = False
    text: Text | None = None
    token_ids: list[Int] | None = None
    messages: list[ChatMessage] | None = None


def _kvmanager_error(exc: DependencyError):
    status, kind = KVMANAGER_STATUS.get(exc.status, (502, "bad_gateway_error"))
    if exc.status == grpc.StatusCode.PERMISSION_DENIED:
        message = ("kvmanager refused the gateway's admin key: start kvmanager with the same --admin-key as "
                   f"the gateway ({exc.details})")
    elif exc.status == grpc.StatusCode.FAILED_PRECONDITION and "--admin-key" in exc.details:
        status, kind = 503, "service_unavailable_error"
        message = f"kvmanager has no --admin-key: start it with the gateway's ({exc.details})"
    else:
        message = f"kvmanager: {exc.details}" if exc.details else f"kvmanager: {exc.status.name}"
    log.info("admin_refused", status=exc.status.name, http=status)
    return error_response(status, message, kind)


def _tenant_of_path(name: str) -> str:
    if name == DEFAULT_TENANT_PATH:
        return ""
    return check_tenant_name("tenant", name, allow_shared=True)


def _count(field: str, value: int) -> int:
    if not 0 <= value <= UINT32_MAX:
        raise InvalidArgument(f"{field} must be in [0, {UINT32_MAX}] (0: no quota), got {value}")
    return value


@admin_router.put("/tenants/{name}")
async def set_tenant_policy(name: str, body: TenantPolicyBody, request: Request):
    tenant = _tenant_of_path(name)
    if not (math.isfinite(body.weight) and 0 < body.weight <= MAX_WEIGHT):
        raise InvalidArgument(f"weight must be > 0 and <= {MAX_WEIGHT:g}, got {body.weight}")
    quota = _count("quota_blocks", body.quota_blocks)
    store_quota = _count("store_quota_blocks", body.store_quota_blocks)
    engine = request.app.state.engine
    try:
        await engine.kvmanager.set_tenant_policy(request.app.state.admin_key, tenant, body.weight, quota, store_quota)
    except DependencyError as exc:
        return _kvmanager_error(exc)
    log.info("tenant_policy_set", tenant=tenant or "default", weight=body.weight, quota_blocks=quota,
             store_quota_blocks=store_quota)
    return {"tenant": tenant, "weight": body.weight, "quota_blocks": quota, "store_quota_blocks": store_quota}


TENANT_FIELDS = ("tenant", "weight", "quota_blocks", "store_quota_blocks", "num_cached_blocks", "num_pinned_blocks",
                 "prefix_cache_queries", "prefix_cache_hits", "num_evictions_caused", "num_evictions_suffered",
                 "num_quota_refusals", "num_store_blocks", "num_store_quota_evictions")


@admin_router.get("/tenants")
async def tenants(request: Request):
    engine = request.app.state.engine
    await _connected(engine)
    pools = []
    for pool_id in engine.pool_ids():
        try:
            stats = await engine.kvmanager.get_stats(pool_id, timeout=5.0)
        except DependencyError as exc:
            return _kvmanager_error(exc)
        pools.append({"pool_id": pool_id, "num_blocks": stats.num_blocks, "num_pins": stats.num_pins,
                      "tenants": [{field: getattr(t, field) for field in TENANT_FIELDS} for t in stats.tenants]})
    return {"pools": pools}


async def _connected(engine) -> None:
    if not engine.pool_ids():
        await engine.ensure_connected()
    if not engine.pool_ids():
        raise Unavailable("no executor described yet: no pool to ask")


def _pin_json(reply) -> dict:
    return {"pin_id": str(reply.pin_id),
            "pools": [{"pool_id": p.pool_id, "num_blocks": p.num_blocks, "num_blocks_held": p.num_blocks_held}
                      for p in reply.pools]}


async def _pin_tokens(body: PinBody, request: Request) -> list[int]:
    given = [name for name in ("text", "token_ids", "messages") if getattr(body, name) is not None]
    if len(given) != 1:
        raise InvalidArgument("give exactly one of text, token_ids, messages (the prefix to pin)")
    engine, tokenizer = request.app.state.engine, request.app.state.tokenizer
    limit = engine.max_model_len
    if body.text is not None:
        tokens = await tokenizer.encode_async(body.text, True, limit)  # as /v1/completions tokenizes a prompt
    elif body.messages is not None:
        if not body.messages:
            raise InvalidArgument("messages: at least one message is needed")
        tokens = await tokenizer.chat_prompt_async(message_dicts(body.messages), False, limit)
    else:
        tokens = list(body.token_ids)
        vocab = engine.info.vocab_size if engine.info is not None else None
        bad = next((t for t in tokens if t < 0 or (vocab is not None and t >= vocab)), None)
        if bad is not None:
            raise InvalidArgument(f"token_ids: token id {bad} is outside [0, {vocab})")
    if not tokens:
        raise InvalidArgument(f"{given[0]}: empty (nothing to pin)")
    if limit and len(tokens) >= limit:
        raise InvalidArgument(f"{given[0]}: {len(tokens)} tokens, but max_model_len is {limit}")
    return tokens


def _pin_id(pin_id: str) -> int:
    if not pin_id.isdigit() or int(pin_id) >= 1 << 64:
        raise InvalidArgument(f"pin id must be a decimal number (as POST /admin/v1/pins answered), got {pin_id[:40]!r}")
    return int(pin_id)


@admin_router.post("/pins")
async def pin(body: PinBody, request: Request):
    engine, admin_key = request.app.state.engine, request.app.state.admin_key
    tenant = check_tenant_name("tenant", body.tenant or "")
    await _connected(engine)
    tokens = await _pin_tokens(body, request)
    pool_ids = engine.pool_ids()
    try:
        reply = await engine.kvmanager.pin_prefix(admin_key, pool_ids, tenant, tokens, body.shared)
    except DependencyError as exc:
        return _kvmanager_error(exc)
    missing = [p.pool_id for p in reply.pools if p.num_blocks_held < p.num_blocks]
    errors = await asyncio.gather(*(_prefill(engine, pool_id, tokens, tenant, body.shared) for pool_id in missing))
    failed = {pool_id: error for pool_id, error in zip(missing, errors) if error}
    deadline = time.monotonic() + PIN_SETTLE_S
    while True:  # the prefill's blocks are published when the executor reports them written
        try:
            held = await engine.kvmanager.get_pin(admin_key, reply.pin_id)
        except DependencyError as exc:
            return _kvmanager_error(exc)
        if not missing or all(p.num_blocks_held >= p.num_blocks for p in held.pools) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.05)
    log.info("prefix_pinned", pin_id=reply.pin_id, tenant=(SHARED_NAMESPACE if body.shared else tenant or "default"),
             tokens=len(tokens), prefilled=len(missing) - len(failed), prefill_failed=len(failed))
    answer = _pin_json(held)
    answer["num_tokens"] = len(tokens)
    if failed:
        answer["prefill_errors"] = failed
    return answer


async def _prefill(engine, pool_id: str, tokens: list[int], tenant: str, shared: bool) -> str | None:
    """Computes ``tokens`` once on ``pool_id``'s executor; the error's message, or None."""
    options = build_options(max_tokens=1, temperature=0.0, top_p=None, top_k=None, seed=None, stop=None,
                            ignore_eos=True, tenant=tenant, kv_shared_prefix_tokens=len(tokens) if shared else 0)
    try:
        stream = await engine.submit(tokens, options, pool_id=pool_id)
        async for output in stream:
            if output.error is not None:
                return str(output.error)
    except Exception as exc:  # noqa: BLE001 — reported in the answer, the pin stays
        return str(exc)
    return None


@admin_router.get("/pins/{pin_id}")
async def get_pin(pin_id: str, request: Request):
    try:
        reply = await request.app.state.engine.kvmanager.get_pin(request.app.state.admin_key, _pin_id(pin_id))
    except DependencyError as exc:
        return _kvmanager_error(exc)
    return _pin_json(reply)


@admin_router.delete("/pins/{pin_id}")
async def unpin(pin_id: str, request: Request):
    number = _pin_id(pin_id)
    try:
        released = await request.app.state.engine.kvmanager.unpin_prefix(request.app.state.admin_key, number)
    except DependencyError as exc:
        return _kvmanager_error(exc)
    log.info("prefix_unpinned", pin_id=number, blocks_released=released)
    return {"pin_id": str(number), "num_blocks_released": released}
