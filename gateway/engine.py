"""The gateway's engine: requests in, routed to executors, outputs out.

``Engine`` owns the per-request output streams, the router, the connection to
kvmanager and one ``Backend`` per executor (``gateway.backend``: its pool, its
kvmanager session, its scheduler and step loop). ``--executor-address`` may list
several executors and ``dns:///`` names that are resolved again while serving
(``gateway.discovery``); each executor gets its own pool in kvmanager, named
``<pool-id or "executor">@<address>`` (a single static address with ``--pool-id``
uses that name as is, so several gateways can share one pool). Two addresses that
reach the same executor (the same ``instance_id``) are used once.

A new request goes to the executor the router picks (``gateway.routing``). When a
backend fails (its executor died, restarted, outlasted its step deadline, or
kvmanager lost the session), every request it held comes back here with the tokens
it has and is *parked*: routed again as soon as any executor can serve, where it
is recomputed from those tokens, so greedy and seeded outputs are token-identical
to an uninterrupted run and clients see no error. Only when nothing could serve a
parked request for ``unavailable_timeout_s`` does it fail, with UNAVAILABLE (503)
and the reason. A new request while nothing can serve is parked the same way (within
``max_queue_len``): a restart of the executor or kvmanager costs it a wait, not an
error. Only a gateway that has never reached an executor answers 503 at once.

Several gateways may share one kvmanager: each has its own sessions (sequences
never mix), and on a shared pool the prefixes one writes are hits for the other.
"""
from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import time
import uuid
from dataclasses import dataclass, field
from types import SimpleNamespace


from kvserve.aio import wait_within
from gateway.backend import UNAVAILABLE_RETRY_S, Backend, BackendHooks
from gateway.clients import ChannelSecurity, DependencyError, ExecutorInfo, watch_for_breaks
from gateway.kvmanager_client import KVManagerClient
from gateway.detokenizer import ModelTokenizer
from gateway.discovery import ExecutorTarget, parse_targets, resolve_targets
from gateway.metrics import GatewayMetrics
from gateway.params import validate_request
from gateway.routing import ROUTING_POLICIES, RoutingDecision, Router
from gateway.scheduler import Scheduler, SchedulerConfig, SchedulerCounters, create_sequences
from gateway.sequence import GenerationRequest, RequestOutput, SamplingOptions
from gateway.streams import RequestStream
from kvserve.errors import (
    AlreadyExists, DeadlineExceeded, IncompatibleDependency, InvalidArgument, ResourceExhausted, Unavailable,
)
from kvserve.identity import tokenizer_fingerprint
from kvserve.logs import get_logger
from kvserve.ports import DEFAULT_EXECUTOR_ADDRESS, DEFAULT_KVMANAGER_ADDRESS

log = get_logger("gateway.engine")

DEADLINE_CHECK_S = 0.1


@dataclass(frozen=True)
class EngineConfig:
    kvmanager_address: str = DEFAULT_KVMANAGER_ADDRESS
    # Comma-separated host:port and dns:///name:port (see gateway.discovery).
    executor_address: str = DEFAULT_EXECUTOR_ADDRESS
    pool_id: str = ""
    routing: str = "kv"
    executor_discovery_interval_s: float = 5.0
    kv_allocation: str = "paged"
    enable_prefix_caching: bool = True
    session_ttl_ms: int = 10_000
    max_queue_len: int = 1024
    # Seconds a request may take from arrival to its last token; None: no limit.
    request_timeout_s: float | None = None
    # How long requests in flight wait (to be recomputed) while no executor can serve.
    unavailable_timeout_s: float = 30.0
    # How long an Execute may take; None: derived from the executor's observed steps (gateway.backend).
    step_timeout_s: float | None = None
    # Credentials of the channels to kvmanager and executor (service token, TLS CA).
    channel_security: ChannelSecurity = field(default_factory=ChannelSecurity)
    # Step an executor over the Unix socket its Describe offers, when it opens from here (gateway.step_socket).
    executor_step_socket: bool = True
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        parse_targets(self.executor_address)
        if self.routing not in ROUTING_POLICIES:
            raise InvalidArgument(f"routing: must be one of {', '.join(ROUTING_POLICIES)}, got {self.routing!r}")
        if self.request_timeout_s is not None and self.request_timeout_s <= 0:
            raise InvalidArgument("request_timeout_s: must be > 0")
        if self.step_timeout_s is not None and self.step_timeout_s <= 0:
            raise InvalidArgument("step_timeout_s: must be > 0")
        if self.executor_discovery_interval_s <= 0:
            raise InvalidArgument("executor_discovery_interval_s: must be > 0")

    @property
    def session_name(self) -> str:
        return f"gateway@{os.getpid()}"

    def pool_id_for(self, address: str) -> str:
        targets = parse_targets(self.executor_address)
        if self.pool_id and len(targets) == 1 and not targets[0].resolve:
            return self.pool_id
        return f"{self.pool_id or 'executor'}@{address}"

    @property
    def effective_pool_id(self) -> str:
        """The pool of a gateway with one static executor address."""
        return self.pool_id_for(parse_targets(self.executor_address)[0].static_address)


class Engine:
    def __init__(self, config: EngineConfig, tokenizer: ModelTokenizer, metrics: GatewayMetrics):
        self.config = config
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.kvmanager = KVManagerClient(config.kvmanager_address, security=config.channel_security)
        self.router = Router(config.routing)
        seq_prefix = random.getrandbits(30) << 32
        self._seq_counter = iter(range(seq_prefix + 1, seq_prefix + (1 << 32)))
        self._targets = parse_targets(config.executor_address)
        self._resolved: dict[ExecutorTarget, list[str]] = {}
        self.backends: dict[str, Backend] = {}
        for target in self._targets:
            if not target.resolve:
                self._add_backend(target.static_address)
        # Requests no executor holds now (theirs failed): a scheduler that never schedules.
        self.parking = Scheduler(config.scheduler, self._new_seq_id)
        self._parked_since: dict[str, float] = {}
        self._parked_reason = ""
        self._dispatch_wakeup = asyncio.Event()
        self._where: dict[str, Backend | None] = {}  # request id -> its backend (None: parked)
        self._live: dict[str, RequestStream] = {}
        self._expired: set[str] = set()
        self._accepting = True
        self._tasks: list[asyncio.Task] = []
        self._reported: dict[int, SchedulerCounters] = {}  # per scheduler: what the metrics were told
        self._tokenizer_fingerprint = tokenizer_fingerprint(tokenizer.model_dir)

    def _new_seq_id(self) -> int:
        return next(self._seq_counter)

    # --- lifecycle -------------------------------------------------------------

    async def start(self) -> None:
        if any(target.resolve for target in self._targets):
            await self._discover()
            self._tasks.append(asyncio.create_task(self._discovery_loop(), name="executor-discovery"))
        for backend in self.backends.values():
            backend.start()
        self._tasks.append(asyncio.create_task(self._dispatch_loop(), name="dispatch"))
        self._tasks.append(asyncio.create_task(watch_for_breaks(self.kvmanager.channel, self._kvmanager_broke),
                                               name="watch-kvmanager"))
        self._tasks.append(asyncio.create_task(self._deadline_loop(), name="request-deadlines"))
        try:
            await self.ensure_connected()
        except Unavailable as exc:
            log.info("dependencies_unavailable_at_start", reason=str(exc))

    async def shutdown(self, timeout: float = 5.0) -> None:
        """Stops accepting, aborts everything in flight, frees its blocks, closes the sessions."""
        self._accepting = False
        for request_id in list(self._live):
            self.abort(request_id)
        try:
            await wait_within(asyncio.gather(*(b.wait_idle() for b in self.backends.values())), timeout)
        except asyncio.TimeoutError:
            log.warning("shutdown_not_idle", live=len(self._live))
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(backend.stop() for backend in self.backends.values()), return_exceptions=True)
        await self.kvmanager.close()

    def _add_backend(self, address: str) -> Backend:
        hooks = BackendHooks(deliver=self._deliver, evacuated=self._evacuated, came_up=self._came_up,
                             accept=self._accept, on_step=self._on_step, publish_counters=self._publish_counters,
                             on_overlapped_step=self._on_overlapped_step)
        backend = Backend(address, self.config.pool_id_for(address), self.config, self.kvmanager,
                          self._new_seq_id, hooks)
        self.backends[address] = backend
        return backend

    async def _discover(self) -> None:
        """Resolves the dns:/// targets: new addresses join, vanished ones leave."""
        self._resolved = await resolve_targets(self._targets, self._resolved)
        wanted = {address for addresses in self._resolved.values() for address in addresses}
        started = bool(self._tasks)
        for address in sorted(wanted - set(self.backends)):
            log.info("executor_joined", executor=address)
            backend = self._add_backend(address)
            if started:
                backend.start()
        for address in sorted(set(self.backends) - wanted):
            log.warning("executor_left", executor=address)
            backend = self.backends.pop(address)
            await backend.stop()
            self.router.pending.forget(address)
            self.metrics.forget_executor(address)

    async def _discovery_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.executor_discovery_interval_s)
            await self._discover()

    # --- requests ----------------------------------------------------------------

    @property
    def model_name(self) -> str:
        return self.metrics.model_name

    @property
    def info(self) -> ExecutorInfo | None:
        """What an executor that can serve said of itself (any one: they serve one model)."""
        infos = [b.info for b in self.backends.values() if b.is_up] or \
            [b.info for b in self.backends.values() if b.info is not None]
        return infos[0] if infos else None

    @property
    def max_model_len(self) -> int | None:
        info = self.info
        return info.max_model_len if info else None

    async def submit(self, prompt_token_ids: list[int], options: SamplingOptions,
                     request_id: str | None = None, timeout_s: float | None = None,
                     pool_id: str | None = None) -> RequestStream:
        """Validates, routes and queues a request; raises InvalidArgument, ResourceExhausted or Unavailable.
        It fails with DEADLINE_EXCEEDED after ``timeout_s`` or ``request_timeout_s``, whichever is shorter.
        ``pool_id``: run it on that pool's executor (a pin's prefill, gateway.admin_api), not where the
        router would send it; Unavailable when that executor cannot serve now."""
        if not self._accepting:
            raise Unavailable("gateway is shutting down")
        try:
            await self.ensure_connected()
        except Unavailable:
            if self.info is None:  # never served: nothing to validate against, nothing to wait for
                raise
        request_id = request_id or f"req-{uuid.uuid4().hex}"
        if request_id in self._live:
            raise AlreadyExists(f"request_id {request_id!r} is already live")
        info = self.info
        eos = frozenset(info.eos_token_ids) or frozenset(self.tokenizer.eos_token_ids)
        validate_request(prompt_token_ids, options, info, max_num_seqs=self.config.scheduler.max_num_seqs,
                         kv_allocation=self.config.kv_allocation, eos_token_ids=eos)
        queued = self.num_waiting_requests()
        if queued >= self.config.max_queue_len:
            raise ResourceExhausted(f"queue full: {queued} requests waiting (max_queue_len "
                                    f"{self.config.max_queue_len}); retry later")
        request = GenerationRequest(request_id, list(prompt_token_ids), options, eos, info.max_model_len)
        request.max_stop_len = max((len(s) for s in options.stop), default=0)
        timeouts = [t for t in (timeout_s, self.config.request_timeout_s) if t is not None]
        if timeouts:
            request.deadline = request.arrival_time + min(timeouts)
        create_sequences(request, lambda: self.tokenizer.detokenizer(prompt_token_ids, options.skip_special_tokens),
                         self._new_seq_id)
        if pool_id is not None:
            backend = next((b for b in self._serving() if b.pool_id == pool_id), None)
            if backend is None:
                raise Unavailable(f"the executor of pool {pool_id} cannot serve now")
            decision = RoutingDecision(backend, "pinned", 0, 0)
        else:
            decision = await self._route(request)
        stream = RequestStream(request)
        request.sink = stream.queue.put_nowait
        self._live[request_id] = stream
        if decision is None:  # nothing can serve now: it waits as the requests in flight do
            self._park([request], self._unavailable_reason())
        else:
            self._where[request_id] = decision.candidate
            decision.candidate.enqueue([request])
        self._publish_queue()
        return stream

    def abort(self, request_id: str) -> bool:
        """Asks the request's backend to abort it (blocks are freed at its next step).
        False when not live."""
        if request_id not in self._live:
            return False
        backend = self._where.get(request_id)
        if backend is not None:
            backend.abort(request_id)
        else:
            self.parking.abort_request(request_id)
            self._deliver(self.parking.take_outputs())
        return True

    def _fail(self, request_id: str, error: Exception) -> None:
        """Ends a live request with ``error`` (its blocks are freed at its backend's next step)."""
        backend = self._where.get(request_id)
        if backend is not None:
            backend.abort(request_id, error)
        else:
            request = self.parking.requests.get(request_id)
            if request is not None:
                self.parking.fail_request(request, error)
                self._deliver(self.parking.take_outputs())

    async def _deadline_loop(self) -> None:
        while True:
            await asyncio.sleep(DEADLINE_CHECK_S)
            now = time.monotonic()
            for request_id, stream in list(self._live.items()):
                deadline = stream.request.deadline
                if deadline is not None and now >= deadline and request_id not in self._expired:
                    self._expired.add(request_id)
                    waited = now - stream.request.arrival_time
                    self._fail(request_id, DeadlineExceeded(f"request {request_id} did not finish within its "
                                                            f"timeout ({waited:.1f} s)"))
            self._expired &= set(self._live)

    def num_waiting_requests(self) -> int:
        return self.parking.num_waiting_requests + sum(
            b.scheduler.num_waiting_requests + len(b.inbox) + len(b.migrated) for b in self.backends.values())

    # --- routing -------------------------------------------------------------------

    def _serving(self) -> list[Backend]:
        return [backend for backend in self.backends.values() if backend.is_up]

    async def _route(self, request: GenerationRequest) -> RoutingDecision | None:
        """The backend for a request (new, or parked with the tokens it has); None when none can serve."""
        candidates = self._serving()
        request.expected_cached_tokens = 0
        if len(candidates) <= 1:
            return RoutingDecision(candidates[0], "only", 0, 0) if candidates else None
        options = request.options
        token_ids = request.sequences[0].token_ids if request.sequences else request.prompt_token_ids
        salt = options.cache_salt if options.enable_prefix_caching else None
        published = None
        if self.router.policy == "kv" and salt is not None:
            try:
                # The tenant's view (only asked when there is one: the default tenant's query is the same without).
                tenancy = {"tenant": options.tenant, "num_shared_tokens": min(options.num_shared_tokens,
                                                                              len(token_ids))} \
                    if options.tenant or options.num_shared_tokens else {}
                published = await self.kvmanager.lookup_prefix([b.pool_id for b in candidates], token_ids, salt,
                                                               **tenancy)
            except DependencyError as exc:
                log.info("lookup_prefix_failed", reason=str(exc))
            candidates = self._serving()  # it may have changed while kvmanager answered
            if not candidates:
                return None
        decision = self.router.choose(candidates, token_ids, options.routing_salt if salt is not None else "",
                                      published)
        request.expected_cached_tokens = decision.cached_tokens
        self.metrics.on_route(decision.candidate.address, decision.policy)
        return decision

    async def _dispatch_loop(self) -> None:
        while True:
            timeout = UNAVAILABLE_RETRY_S if self.parking.requests else None
            try:
                await wait_within(self._dispatch_wakeup.wait(), timeout)
            except asyncio.TimeoutError:
                pass
            self._dispatch_wakeup.clear()
            await self.dispatch()

    async def dispatch(self) -> None:
        """Routes parked requests to executors that can serve; fails those that waited too long."""
        parked = sorted(self.parking.requests.values(), key=lambda r: r.arrival_time)
        for request in parked:
            if request.finished or request.request_id not in self.parking.requests:
                continue
            decision = await self._route(request)
            if decision is not None:
                self.parking.release([request])
                self._parked_since.pop(request.request_id, None)
                self._where[request.request_id] = decision.candidate
                decision.candidate.enqueue([request], migrated=True)
                continue
            waited = time.monotonic() - self._parked_since.get(request.request_id, time.monotonic())
            if waited >= self.config.unavailable_timeout_s:
                reason = f"nothing could serve for {waited:.0f} s ({self._unavailable_reason()})"
                self.parking.fail_request(request, Unavailable(reason))
        self._deliver(self.parking.take_outputs())
        self._publish_queue()

    # --- what backends tell ----------------------------------------------------------

    def _evacuated(self, backend: Backend, requests: list[GenerationRequest], reason: str) -> None:
        self.router.pending.forget(backend.address)
        self._park(requests, reason)
        if requests:
            self.metrics.on_migrated(backend.address, len(requests))
        self.metrics.set_executor_up(backend.address, False)

    def _park(self, requests: list[GenerationRequest], reason: str) -> None:
        """Requests nothing can serve now wait in the engine, to be routed as soon as something
        can (``dispatch``), or to fail with 503 after ``unavailable_timeout_s``."""
        self._parked_reason = reason
        now = time.monotonic()
        for request in requests:
            self._where[request.request_id] = None
            self._parked_since.setdefault(request.request_id, now)
        self.parking.adopt(requests)
        self._dispatch_wakeup.set()

    def _came_up(self, backend: Backend) -> None:
        self.metrics.set_executor_up(backend.address, True)
        self._dispatch_wakeup.set()

    def _accept(self, backend: Backend, info: ExecutorInfo) -> None:
        """Token ids mean nothing across tokenizers, and blocks nothing across two pools of one cache."""
        if info.tokenizer_fingerprint and info.tokenizer_fingerprint != self._tokenizer_fingerprint:
            log.error("tokenizer_mismatch", executor=backend.address, executor_model=info.model_name,
                      executor_tokenizer=info.tokenizer_fingerprint, gateway_tokenizer=self._tokenizer_fingerprint,
                      gateway_model=str(self.tokenizer.model_dir))
            raise IncompatibleDependency(
                f"the executor serves {info.model_name!r} with another tokenizer than this gateway's "
                f"model directory {self.tokenizer.model_dir.name!r} (tokenizer.json sha256 "
                f"{info.tokenizer_fingerprint[:12]} vs {self._tokenizer_fingerprint[:12]}); start the gateway "
                "with the executor's model")
        for other in self.backends.values():
            if other is backend or other.info is None or not other.is_up:
                continue
            if info.model_fingerprint != other.info.model_fingerprint:
                raise IncompatibleDependency(
                    f"the executor at {backend.address} serves another model ({info.model_name!r}, "
                    f"{info.model_fingerprint[:12]}) than the one at {other.address} "
                    f"({other.info.model_name!r}, {other.info.model_fingerprint[:12]})")
            if info.instance_id and info.instance_id == other.info.instance_id:
                raise IncompatibleDependency(f"{backend.address} reaches the same executor as {other.address} "
                                             f"(instance {info.instance_id}); it is used once")

    def _on_overlapped_step(self, backend: Backend, matched: bool) -> None:
        self.metrics.on_overlapped_step(backend.address, matched)

    def _on_step(self, backend: Backend, **step) -> None:
        self.metrics.on_step(**step)
        self._publish_queue()
        self.metrics.on_executor_step(backend.address, backend.num_running(),
                                      backend.scheduler.num_waiting_requests + len(backend.inbox))

    # --- connection ---------------------------------------------------------------

    async def ensure_connected(self) -> None:
        """Returns when some executor can serve; else tries them all once and raises
        Unavailable with the reasons."""
        if self._serving():
            return
        backends = list(self.backends.values())
        await asyncio.gather(*(backend.connect() for backend in backends), return_exceptions=True)
        if not self._serving():
            raise Unavailable(f"cannot serve: {self._unavailable_reason()}")

    def _unavailable_reason(self) -> str:
        if not self.backends:
            return f"no executor found at {self.config.executor_address}"
        reasons = [f"{b.address}: {b.last_error}" for b in self.backends.values() if b.last_error]
        return "; ".join(reasons) or self._parked_reason or "no executor can serve"

    def _kvmanager_broke(self) -> None:
        """kvmanager restarted or went away: every session is lost."""
        for backend in self.backends.values():
            backend.connection_lost(f"kvmanager at {self.kvmanager.address}: connection lost")

    # --- outputs and metrics ----------------------------------------------------------

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        if any(output.finished for output in outputs):
            self._publish_queue()
        for output in outputs:
            stream = self._live.get(output.request_id)
            if stream is None:
                continue
            request = stream.request
            new_tokens = sum(len(c.token_ids) for c in output.choices)
            if new_tokens:
                self.metrics.on_tokens(new_tokens)
                if request.last_emit_time is None:  # prefill done
                    self.metrics.on_first_token(now - request.arrival_time, request.num_prompt_tokens)
                else:
                    per_choice = max(1, new_tokens // max(1, len(output.choices)))
                    self.metrics.on_inter_token((now - request.last_emit_time) / per_choice)
                request.last_emit_time = now
            if output.finished:
                self._live.pop(output.request_id, None)
                self._where.pop(output.request_id, None)
                self._parked_since.pop(output.request_id, None)
                reason = next((c.finish_reason.value for c in output.choices if c.finish_reason), "error")
                self.metrics.on_request_finished(e2e_s=now - request.arrival_time, reason=reason)
            request.sink(output)

    def _publish_counters(self) -> None:
        """The schedulers' counters since the last call, including what happened between
        steps (preemptions when the KV was lost)."""
        for scheduler in [b.scheduler for b in self.backends.values()] + [self.parking]:
            now = scheduler.counters
            before = self._reported.get(id(scheduler), SchedulerCounters())
            self.metrics.on_preemptions(now.num_preemptions - before.num_preemptions)
            self.metrics.on_prefix_lookup(now.prefix_cache_queries - before.prefix_cache_queries,
                                          now.prefix_cache_hits - before.prefix_cache_hits)
            self.metrics.on_store(now.store_hits - before.store_hits, now.store_load_misses - before.store_load_misses)
            self.metrics.on_spec_decode(now.num_draft_tokens - before.num_draft_tokens,
                                        now.num_accepted_draft_tokens - before.num_accepted_draft_tokens)
            self._reported[id(scheduler)] = dataclasses.replace(now)

    def _publish_queue(self) -> None:
        backends = self.backends.values()
        running = sum(len({seq.request.request_id for seq in b.scheduler.running}) for b in backends)
        running_seqs = sum(len(b.scheduler.running) for b in backends)
        self.metrics.set_queue(running, self.num_waiting_requests(), running_seqs)

    # --- introspection --------------------------------------------------------------

    def pool_ids(self) -> list[str]:
        """The kvmanager pools of the executors this gateway has described."""
        return [b.pool_id for b in self.backends.values() if b.info is not None]

    async def dependency_health(self) -> dict[str, bool]:
        """Whether kvmanager answers and whether some executor does (readiness: can serve)."""
        backends = list(self.backends.values())
        kv, *executors = await asyncio.gather(self.kvmanager.healthy(), *(b.executor.healthy() for b in backends))
        for backend, up in zip(backends, executors):
            self.metrics.set_executor_up(backend.address, up and backend.is_up)
        ex = any(executors)
        self.metrics.on_dependency("kvmanager", kv)
        self.metrics.on_dependency("executor", ex)
        return {"kvmanager": kv, "executor": ex}

    async def refresh_pool_stats(self):
        """Reads kvmanager's stats of every executor's pool into the metrics (summed); None when unreachable."""
        pool_ids = [b.pool_id for b in self.backends.values() if b.info is not None]
        try:
            stats = await asyncio.gather(*(self.kvmanager.get_stats(pool_id) for pool_id in pool_ids))
        except DependencyError:
            return None
        if not stats:
            return None
        total = SimpleNamespace(
            num_blocks=sum(s.num_blocks for s in stats), num_used_blocks=sum(s.num_used_blocks for s in stats),
            num_stored_tokens=sum(s.num_stored_tokens for s in stats),
            num_allocated_slots=sum(s.num_allocated_slots for s in stats))
        total.usage = total.num_used_blocks / max(1, total.num_blocks - len(stats))
        self.metrics.on_pool_stats(total)
        self.metrics.on_tenant_stats(stats)
        return total
