"""OpenAI-compatible HTTP API (FastAPI): thin routes over the engine.

Routes are module-level functions on ``router`` that reach the engine and the
tokenizer through ``request.app.state``; ``create_app`` builds the app around
them. Routes convert JSON ⇄ domain objects only; errors use OpenAI's error JSON
(``{"error": {"message", "type", "param", "code"}}``) with the HTTP status of
the domain error. A request body over ``MAX_BODY_BYTES`` is refused with 413
before it is parsed; long prompts are tokenized off the event loop. With an API
key, ``/v1/*`` needs ``Authorization: Bearer <key>`` (401 otherwise, before the
body is read); ``/health`` and ``/metrics`` stay open, as in vLLM.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
import uuid
from dataclasses import dataclass, replace

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.constraints import ConstraintSpec, GrammarCompiler
from gateway.detokenizer import ModelTokenizer
from gateway.engine import Engine
from gateway.model_name import check_model_name
from gateway.openai_protocol import (
    ChatCompletionBody, ChoiceAccumulator, CompletionBody, EchoedPrompt, ResponseFormatter, message_dicts, usage_dict,
)
from gateway.params import build_options
from gateway.response_store import MemoryResponseStore, ResponseStore, StoredResponse, items_page
from gateway.responses_api import ResponsesBody, ResponseWriter, droppable_turns, messages_of
from gateway.scheduler import RequestTooLarge
from gateway.sequence import RequestOutput
from gateway.streams import MergedStream, RequestStream
from gateway.tenants import TENANT_HEADER, TenantResolver
from gateway.tokenizer_api import tokenizer_router
from gateway.tool_calls import ToolCalling, render_tool_messages
from kvserve.aio import wait_within
from kvserve.auth import BearerToken
from kvserve.errors import InvalidArgument, KVServeError
from kvserve.logs import get_logger

log = get_logger("gateway.http")

MAX_PROMPTS_PER_REQUEST = 64
# Largest request body accepted (HTTP 413 above it), checked before any JSON is parsed.
MAX_BODY_BYTES = 4 * 1024 * 1024
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
# Parts of a pydantic error location that name a member of a union, not a field.
_UNION_TAG = re.compile(r"^(str|int|float|bool|none|list|dict|list\[.*\]|dict\[.*\]|[\w-]+\[.*\])$")
_JSON_CONTENT = re.compile(r"^\s*application/([\w.+-]*\+)?json\s*(;|$)", re.IGNORECASE)
HTTP_STATUS = {
    "INVALID_ARGUMENT": (400, "invalid_request_error"),
    "NOT_FOUND": (404, "not_found_error"),
    "ALREADY_EXISTS": (409, "conflict_error"),
    "RESOURCE_EXHAUSTED": (429, "rate_limit_error"),
    "FAILED_PRECONDITION": (400, "invalid_request_error"),
    "UNAVAILABLE": (503, "service_unavailable_error"),
    "DEADLINE_EXCEEDED": (504, "timeout_error"),
}


# A 503 says when to try again: the gateway reconnects to its dependencies every quarter second.
RETRY_AFTER_S = 1


def error_response(status: int, message: str, error_type: str, param: str | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": error_type, "param": param, "code": status}}
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 503 else None
    return JSONResponse(body, status_code=status, headers=headers)


def error_for(exc: Exception) -> tuple[int, str]:
    if isinstance(exc, RequestTooLarge):
        return 400, "invalid_request_error"
    if isinstance(exc, KVServeError):
        return HTTP_STATUS.get(exc.code, (500, "internal_error"))
    return 500, "internal_error"


class BodySizeLimit:
    """ASGI middleware: a request body over ``max_bytes`` gets 413 before anything reads it.

    A declared Content-Length over the limit is refused at once; otherwise the body is
    counted as it arrives (chunked uploads have no Content-Length) and buffered, then
    handed to the app. uvicorn discards the rest of a refused body.
    """

    def __init__(self, app, max_bytes: int = MAX_BODY_BYTES):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] not in _BODY_METHODS:
            await self.app(scope, receive, send)
            return
        declared = next((value for name, value in scope["headers"] if name == b"content-length"), None)
        if declared is not None and declared.strip().isdigit() and int(declared) > self.max_bytes:
            await self._too_large(scope, receive, send, f"{int(declared)} bytes")
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._too_large(scope, receive, send, f"more than {self.max_bytes} bytes")
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, scope, receive, send, size: str) -> None:
        log.info("http_body_too_large", path=scope.get("path"), size=size)
        response = error_response(413, f"request body too large: {size}; the limit is {self.max_bytes} bytes "
                                       f"({self.max_bytes / 2**20:g} MiB)", "invalid_request_error")
        await response(scope, receive, send)


class ApiKeyAuth:
    """ASGI middleware: ``/v1/*`` and the tokenizer routes need ``Authorization: Bearer <key>``;
    401 with OpenAI's error JSON otherwise. Other paths (``/health``, ``/metrics``, ``/admin/*``,
    which has its own key) and CORS preflights pass. ``api_key``: a ``BearerToken`` or
    ``gateway.tenants.ApiKeys``."""

    PROTECTED_PREFIX = "/v1"
    PROTECTED_PATHS = ("/tokenize", "/detokenize", "/tokenizer_info")

    def __init__(self, app, api_key: BearerToken):
        self.app = app
        self.api_key = api_key

    def _protected(self, scope) -> bool:
        if scope["type"] != "http" or scope["method"] == "OPTIONS":
            return False
        path = scope["path"].removeprefix(scope.get("root_path", "")) or "/"
        return (path == self.PROTECTED_PREFIX or path.startswith(self.PROTECTED_PREFIX + "/")
                or path.rstrip("/") in self.PROTECTED_PATHS)

    async def __call__(self, scope, receive, send):
        if self._protected(scope):
            values = [value for name, value in scope["headers"] if name == b"authorization"]
            if len(values) != 1 or not self.api_key.matches_header(values[0]):
                log.info("http_unauthorized", path=scope.get("path"), header_present=bool(values))
                response = error_response(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                                          "authentication_error")
                response.headers["WWW-Authenticate"] = "Bearer"
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class AdminAuth:
    """ASGI middleware: ``/admin/*`` needs ``Authorization: Bearer <admin key>`` (401 otherwise,
    before the body is read); without ``--admin-key`` it answers 404 saying the admin API is off."""

    PREFIX = "/admin"

    def __init__(self, app, admin_key: BearerToken | None):
        self.app = app
        self.admin_key = admin_key

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            path = scope["path"].removeprefix(scope.get("root_path", "")) or "/"
            if path == self.PREFIX or path.startswith(self.PREFIX + "/"):
                response = None
                values = [value for name, value in scope["headers"] if name == b"authorization"]
                if self.admin_key is None:
                    response = error_response(404, "the admin API is off: start the gateway with --admin-key "
                                                   "(KVSERVE_ADMIN_KEY)", "not_found_error")
                elif len(values) != 1 or not self.admin_key.matches_header(values[0]):
                    log.info("http_admin_unauthorized", path=scope.get("path"), header_present=bool(values))
                    response = error_response(401, "invalid or missing admin key: send "
                                                   "'Authorization: Bearer <admin key>'", "authentication_error")
                    response.headers["WWW-Authenticate"] = "Bearer"
                if response is not None:
                    await response(scope, receive, send)
                    return
        await self.app(scope, receive, send)


def _validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """One readable message from pydantic's errors: our own value errors first, union tags left out."""
    if not errors:
        return "invalid request", None
    first = next((e for e in errors if e.get("type") == "value_error"), errors[0])
    where = ".".join(str(p) for p in first.get("loc", ()) if p != "body" and not _UNION_TAG.match(str(p)))
    message = first.get("msg", "invalid request")
    if first.get("type") == "value_error":
        message = message.removeprefix("Value error, ")
        if message.startswith("["):  # an index inside the field: prompt[3]: ...
            where, message = f"{where}{message.split(':', 1)[0]}", message.split(":", 1)[1].strip()
    elif first.get("type") == "extra_forbidden":
        message = "not supported by this server (the accepted fields are listed in docs/gateway.md)"
    elif first.get("type") == "json_invalid":
        return f"body is not valid JSON: {first.get('ctx', {}).get('error', message)}", None
    return (f"{where}: {message}" if where else message), where or None


def _engine(request: Request) -> Engine:
    return request.app.state.engine


def _tokenizer(request: Request) -> ModelTokenizer:
    return request.app.state.tokenizer


async def _validation(request: Request, exc: RequestValidationError):
    errors = list(exc.errors())
    content_type = request.headers.get("content-type", "")
    if not _JSON_CONTENT.match(content_type) and errors and tuple(errors[0].get("loc", ())) == ("body",):
        # FastAPI reads a body as JSON only when it says so; curl -d says form data.
        return error_response(400, "the body must be a JSON object sent with 'Content-Type: application/json' "
                                   f"(this request's: {content_type or 'none'})", "invalid_request_error")
    message, where = _validation_message(errors)
    return error_response(400, message, "invalid_request_error", where)


async def _http(request: Request, exc: StarletteHTTPException):
    if exc.status_code == 404 and exc.detail == "Not Found":  # no route matched (routes' own 404s say more)
        return error_response(404, f"no route {request.method} {request.url.path}; this server offers "
                                   f"{', '.join(_offered_routes())}", "not_found_error")
    if exc.status_code == 405:
        return error_response(405, f"{request.url.path} does not take {request.method}", "invalid_request_error")
    return error_response(exc.status_code, str(exc.detail), "invalid_request_error")


def _offered_routes() -> list[str]:
    """'POST /v1/completions', ... for the public routes (the admin API's are left out)."""
    return [f"{'/'.join(sorted(route.methods - {'HEAD'}))} {route.path.replace(':path}', '}')}"
            for routes in (router.routes, tokenizer_router.routes) for route in routes]


async def _domain(request: Request, exc: KVServeError):
    status, kind = error_for(exc)
    return error_response(status, str(exc), kind)


async def _internal(request: Request, exc: Exception):
    log.error("http_internal_error", error=repr(exc), exc_info=exc)
    return error_response(500, f"internal error: {exc!r}", "internal_error")


EXCEPTION_HANDLERS = {
    RequestValidationError: _validation,
    StarletteHTTPException: _http,
    KVServeError: _domain,
    Exception: _internal,
}

router = APIRouter()


def _model_entry(engine) -> dict:
    served_name = engine.model_name
    return {"id": served_name, "object": "model", "created": int(time.time()), "owned_by": "kvserve",
            "root": served_name, "parent": None, "max_model_len": engine.max_model_len}


@router.get("/v1/models")
async def models(request: Request):
    return {"object": "list", "data": [_model_entry(_engine(request))]}


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, request: Request):
    """OpenAI's "retrieve model" (``client.models.retrieve``): the served model, or 404 for another name."""
    entry = _model_entry(_engine(request))
    try:
        check_model_name(model_id, entry["id"])
    except InvalidArgument as exc:  # a body naming another model is a 400; a path naming none, a 404
        return error_response(404, str(exc), "invalid_request_error", "model")
    return entry


@router.get("/health")
async def health(request: Request):
    status = await _engine(request).dependency_health()
    ok = all(status.values())
    body = {"status": "ok" if ok else "unavailable",
            **{name: "SERVING" if up else "UNREACHABLE" for name, up in status.items()}}
    return JSONResponse(body, status_code=200 if ok else 503)


@router.get("/metrics")
async def metrics(request: Request):
    """Every metric, or with ``?name[]=...`` (repeatable) only those named, as Prometheus' own
    exposition handlers filter: a scraper polling a few gauges does not pay for every histogram."""
    engine, responses = _engine(request), _response_store(request)
    with contextlib.suppress(Exception):
        await wait_within(engine.refresh_pool_stats(), 1.0)
    stats = responses.stats()
    if stats is not None:
        engine.metrics.on_response_store(*stats)
    return Response(engine.metrics.render(request.query_params.getlist("name[]")), media_type=CONTENT_TYPE_LATEST)


@router.post("/v1/completions")
async def completions(body: CompletionBody, request: Request):
    engine, tokenizer = _engine(request), _tokenizer(request)
    check_model_name(body.model, engine.model_name)
    prompts = body.prompt
    if not (isinstance(prompts, list) and prompts and isinstance(prompts[0], (str, list))):
        prompts = [prompts]
    if len(prompts) > MAX_PROMPTS_PER_REQUEST:
        raise InvalidArgument(f"prompt: at most {MAX_PROMPTS_PER_REQUEST} prompts per request")
    tenant = _tenant(request)
    prompt_ids = [await tokenizer.encode_async(p, True, engine.max_model_len) if isinstance(p, str)
                  else list(p) for p in prompts]
    echo = None
    if body.echo:  # the prompt in front of each choice; with logprobs, each prompt token's as well
        echo = [EchoedPrompt(p if isinstance(p, str) else tokenizer.decode(ids, skip_special_tokens=False), ids)
                for p, ids in zip(prompts, prompt_ids)]
    started = await _start("completion", body, prompt_ids, body.logprobs, request, body.constraint_spec(),
                           tenant=tenant, echo=echo)
    return await _respond(body, request, started)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionBody, request: Request):
    return await _respond(body, request, await _start_chat(body, request))


@router.post("/v1/responses")
async def responses(body: ResponsesBody, request: Request):
    """OpenAI's Responses API as a chat completion (gateway/responses_api.py), kept and gone on
    from as gateway/response_store.py says."""
    store, tenant = _response_store(request), _tenant(request)
    previous = await store.previous(tenant, body.previous_response_id)
    kept = store.keeps(body.store)
    chat = body.chat_body(previous)
    if body.truncation == "auto":
        chat = await _fitted(chat, request, body.max_output_tokens)
    started = await _start_chat(chat, request)
    writer = ResponseWriter(body, started.engine.model_name, stored=kept)

    async def keep(response: dict) -> None:
        conversation = previous + body.turn_messages() + messages_of(response["output"], "output")
        if not await store.put(tenant, StoredResponse(response, body.stored_input_items(), conversation)):
            response["store"] = False  # the client learns it cannot go on from this one

    on_finished = keep if kept else None
    if body.stream:
        return StreamingResponse(_response_events(started, writer, on_finished), media_type="text/event-stream")
    choices, last = await _collect_choices(started, request)
    response = writer.complete(started.formatter.response(choices, last))
    if on_finished is not None:
        await on_finished(response)
    return JSONResponse(response)


@router.get("/v1/responses/{response_id}")
async def stored_response(response_id: str, request: Request, stream: bool = False):
    """A stored response as it was returned (404 where this tenant has none by that id)."""
    if stream:
        raise InvalidArgument("stream: a stored response is returned whole; its events are not replayed")
    return JSONResponse((await _response_store(request).get(_tenant(request), response_id)).response)


@router.get("/v1/responses/{response_id}/input_items")
async def stored_input_items(response_id: str, request: Request, order: str = "desc", limit: int = 20,
                             after: str | None = None):
    """A stored response's input items, a page of OpenAI's list (``items_page``)."""
    items = (await _response_store(request).get(_tenant(request), response_id)).input_items
    return JSONResponse(items_page(items, order, limit, after))


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request):
    """Forgets a stored response (404 where this tenant has none by that id)."""
    await _response_store(request).delete(_tenant(request), response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


async def _fitted(chat: ChatCompletionBody, request: Request, max_output_tokens: int | None) -> ChatCompletionBody:
    """``truncation: auto``: the chat without as few of its oldest turns after the system messages
    as it must lose to leave ``max_output_tokens`` (at least one) within max_model_len; its last
    turn always stays (a chat that does not fit even so fails as it would untruncated)."""
    engine, tokenizer = _engine(request), _tokenizer(request)
    tools = ToolCalling.parse(chat.tools, chat.tool_choice, chat.parallel_tool_calls)
    room = engine.max_model_len - (max_output_tokens or 1)
    lead, turns = droppable_turns([message.role for message in chat.messages])

    async def fits(dropped: int) -> bool:
        kept = chat.messages[:lead] + chat.messages[turns[dropped]:] if dropped else chat.messages
        rendered = render_tool_messages(message_dicts(kept), tools)
        return len(await tokenizer.chat_prompt_async(rendered, True)) <= room

    if len(turns) < 2 or await fits(0):
        return chat
    low, high = 1, len(turns) - 1  # the fewest turns dropped that fit, or all but the last
    while low < high:
        middle = (low + high) // 2
        if await fits(middle):
            high = middle
        else:
            low = middle + 1
    return chat.model_copy(update={"messages": chat.messages[:lead] + chat.messages[turns[low]:]})


def _response_store(request: Request) -> ResponseStore:
    return request.app.state.responses


async def _start_chat(body: ChatCompletionBody, request: Request) -> Started:
    engine, tokenizer = _engine(request), _tokenizer(request)
    check_model_name(body.model, engine.model_name)
    if not body.messages:
        raise InvalidArgument("messages: at least one message is needed")
    tools = ToolCalling.parse(body.tools, body.tool_choice, body.parallel_tool_calls)
    constraint = body.constraint_spec()
    call_grammar = tools.constraint() if tools is not None else None
    if call_grammar is not None:
        if constraint is not None:
            raise InvalidArgument("tool_choice: a required or named tool call cannot be combined with a "
                                  "structured-output constraint (response_format, guided_*)")
        constraint = call_grammar
    tenant = _tenant(request)
    messages = render_tool_messages(message_dicts(body.messages), tools)
    prompt_ids = await tokenizer.chat_prompt_async(messages, body.add_generation_prompt, engine.max_model_len,
                                                   body.continue_final_message)
    if body.kv_share_system_prompt:
        if body.kv_shared_prefix_tokens is not None:
            raise InvalidArgument("kv_share_system_prompt: give it or kv_shared_prefix_tokens, not both")
        body.kv_shared_prefix_tokens = await system_prompt_tokens(tokenizer, messages, prompt_ids)
    if body.max_completion_tokens is not None and body.max_tokens is None:
        body.max_tokens = body.max_completion_tokens
    if body.top_logprobs and not body.logprobs:
        raise InvalidArgument("top_logprobs: needs logprobs: true (alternatives come with each token's log-probability)")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    return await _start("chat", body, [prompt_ids], logprobs, request, constraint, tools, tenant=tenant)


def _tenant(request: Request) -> str:
    """The request's tenant: its API key's, else its X-Kvserve-Tenant header's (400 if unknown)."""
    resolver: TenantResolver = request.app.state.tenants
    return resolver.resolve(request.headers.get("authorization"), request.headers.get(TENANT_HEADER))


async def system_prompt_tokens(tokenizer: ModelTokenizer, messages: list[dict], prompt_ids: list[int]) -> int:
    """How many leading tokens of ``prompt_ids`` are the rendered leading system message(s):
    the common prefix with the chat prompt of those messages alone, without a generation prompt
    (0 when the conversation does not start with one)."""
    leading = []
    for message in messages:
        if message.get("role") != "system":
            break
        leading.append(message)
    if not leading:
        return 0
    system_ids = await tokenizer.chat_prompt_async(leading, False)
    shared = 0
    for a, b in zip(system_ids, prompt_ids):
        if a != b:
            break
        shared += 1
    return shared


@dataclass(frozen=True)
class Started:
    """A request submitted: its output stream and how to render it."""

    engine: Engine
    stream: RequestStream | MergedStream
    formatter: ResponseFormatter
    num_choices: int


async def _start(kind: str, body, prompts: list[list[int]], logprobs: int | None, request: Request,
                 constraint: ConstraintSpec | None, tools: ToolCalling | None = None, tenant: str = "",
                 echo: list[EchoedPrompt] | None = None) -> Started:
    engine = _engine(request)
    unsupported = body.unsupported()
    if unsupported:
        raise InvalidArgument(f"{unsupported}: not supported by this server at {getattr(body, unsupported)!r}")
    compiled = await request.app.state.grammars.compile(constraint) if constraint is not None else None
    predicted = None
    if body.prediction is not None:  # beyond max_model_len tokens it could never be the output
        predicted = (await _tokenizer(request).encode_async(body.prediction.text()))[:engine.max_model_len]
    options = build_options(
        max_tokens=body.max_tokens, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
        seed=body.seed, stop=body.stop, stop_token_ids=body.stop_token_ids, ignore_eos=body.ignore_eos,
        min_tokens=body.min_tokens, n=body.n, logprobs=logprobs, cache_salt=body.cache_salt or "",
        prompt_logprobs=logprobs if echo is not None else None, prompt_only=echo is not None,
        skip_special_tokens=body.skip_special_tokens, presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty, repetition_penalty=body.repetition_penalty,
        logit_bias=body.logit_bias, min_p=body.min_p, constraint=compiled, tenant=tenant,
        kv_shared_prefix_tokens=body.kv_shared_prefix_tokens, kv_cache_ttl_s=body.kv_cache_ttl_s,
        kv_cache_priority=body.kv_cache_priority, predicted_token_ids=predicted,
    )
    engine.metrics.on_tenant_request(tenant)
    prefix = "chatcmpl" if kind == "chat" else "cmpl"
    request_id = f"{prefix}-{uuid.uuid4().hex}"
    if len(prompts) == 1:
        stream = await engine.submit(prompts[0], options, request_id)
    else:
        stream = MergedStream(request_id, [], options.n)
        try:
            for i, prompt_ids in enumerate(prompts):
                stream.streams.append(await engine.submit(prompt_ids, replace(options), f"{request_id}-{i}"))
        except Exception:
            stream.abort_all(engine.abort)
            raise
    num_choices = options.n * len(prompts)
    formatter = ResponseFormatter(kind, request_id, engine.model_name, _tokenizer(request), logprobs is not None,
                                  num_choices, tools, echo)
    return Started(engine, stream, formatter, num_choices)


async def _respond(body, request: Request, started: Started):
    """The completion or chat completion, streamed (server-sent events) or whole."""
    if body.stream:
        return StreamingResponse(_sse(started, body.include_usage), media_type="text/event-stream")
    choices, last = await _collect_choices(started, request)
    return JSONResponse(started.formatter.response(choices, last))


def _abort(engine: Engine, stream: RequestStream | MergedStream) -> None:
    if isinstance(stream, MergedStream):
        stream.abort_all(engine.abort)
    else:
        engine.abort(stream.request_id)


async def _sse(started: Started, include_usage: bool):
    engine, stream, formatter = started.engine, started.stream, started.formatter
    finished = False
    try:
        async for output in stream:
            for chunk in formatter.chunks(output):
                yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
            if output.finished:
                finished = True
                if include_usage:
                    yield f"data: {json.dumps(formatter.usage_chunk(output))}\n\n"
        yield "data: [DONE]\n\n"
    except KVServeError as exc:
        finished = True
        status, kind = error_for(exc)
        error = {"error": {"message": str(exc), "type": kind, "param": None, "code": status}}
        yield f"data: {json.dumps(error)}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        if not finished:  # the client went away mid-stream
            _abort(engine, stream)


async def _collect_choices(started: Started, request: Request) -> tuple[list[ChoiceAccumulator], RequestOutput]:
    """Every choice whole, and the last output (usage); aborts when the client goes away."""
    engine, stream = started.engine, started.stream
    choices = [ChoiceAccumulator() for _ in range(started.num_choices)]

    async def drain():
        last = None
        async for output in stream:
            for delta in output.choices:
                choices[delta.index].add(delta)
            last = output
        return last

    task = asyncio.ensure_future(drain())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=1.0)
            if done:
                break
            if await request.is_disconnected():
                _abort(engine, stream)
        last = task.result()
    finally:
        if not task.done():
            task.cancel()
            _abort(engine, stream)
    return choices, last


async def _response_events(started: Started, writer: ResponseWriter, on_finished=None):
    """The Responses stream: the chat chunks as typed events, ``response.completed`` (or
    ``.incomplete``) last with usage; an ``error`` event when the request fails. ``on_finished``
    (if any) is given the finished response before its last event goes out."""
    engine, stream, formatter = started.engine, started.stream, started.formatter
    finished = False
    try:
        for event in writer.start():
            yield _event_line(event)
        async for output in stream:
            for chunk in formatter.chunks(output):
                for event in writer.chunk(chunk):
                    yield _event_line(event)
            if output.finished:
                finished = True
                reason = next((c.finish_reason.value for c in output.choices if c.finish_reason), None)
                events = writer.finish(reason, usage_dict(output))
                if on_finished is not None:
                    await on_finished(events[-1]["response"])
                for event in events:
                    yield _event_line(event)
    except KVServeError as exc:
        finished = True
        _, kind = error_for(exc)
        yield _event_line(writer.error(str(exc), kind))
    finally:
        if not finished:
            _abort(engine, stream)


def _event_line(event: dict) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


def create_app(engine: Engine, tokenizer: ModelTokenizer, *, max_body_bytes: int = MAX_BODY_BYTES,
               api_key=None, grammars: GrammarCompiler | None = None, tenants: TenantResolver | None = None,
               admin_key: str | None = None, responses: ResponseStore | None = None) -> FastAPI:
    """The app: the routes reach ``engine``, ``tokenizer`` and ``grammars`` (structured outputs)
    through ``request.app.state``. ``api_key``: ``/v1/*`` requires it (see ``ApiKeyAuth``): a
    ``BearerToken``, or ``gateway.tenants.ApiKeys`` whose keys name tenants. ``tenants``: how a
    request's tenant is found (default: the keys', or the default tenant). ``admin_key``: enables
    ``/admin/v1/*`` (``gateway.admin_api``). ``responses``: where the Responses API keeps what it
    stores (default: in memory, ``MemoryResponseStore``'s default capacity)."""
    from gateway.admin_api import admin_router  # it imports this module's error helpers

    app = FastAPI(title="kvserve gateway", docs_url=None, redoc_url=None)
    app.state.engine = engine
    app.state.tokenizer = tokenizer
    app.state.grammars = grammars or GrammarCompiler.for_tokenizer(tokenizer)
    app.state.tenants = tenants or TenantResolver(api_key if hasattr(api_key, "tenant_of_header") else None)
    app.state.admin_key = admin_key or None
    app.state.responses = responses if responses is not None else MemoryResponseStore()
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)
    # Added last = outermost: nobody unauthenticated gets a body buffered.
    app.add_middleware(AdminAuth, admin_key=BearerToken(admin_key) if admin_key else None)
    if api_key is not None:
        app.add_middleware(ApiKeyAuth, api_key=api_key)
    for exc_class, handler in EXCEPTION_HANDLERS.items():
        app.add_exception_handler(exc_class, handler)
    app.include_router(router)
    app.include_router(tokenizer_router)
    app.include_router(admin_router)
    return app
