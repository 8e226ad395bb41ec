"""The step loop: one batched kvmanager Allocate and one executor Execute per step.

``Engine`` owns the scheduler, the connection to kvmanager (pool + session with a
renewed lease) and to the executor, and the per-request output queues that the
HTTP and gRPC front ends read. All scheduler state changes happen on the step
loop; ``submit`` and ``abort`` only leave notes in an inbox.

Failures have a bounded blast radius:

* a dependency that refuses a step (its content, not an outage: see
  ``clients.REFUSALS``) fails only the requests in it: the step is retried one
  request at a time (a refused call changes nothing on either service), and the
  requests that are refused again fail with the reason (HTTP 500);
* an executor that restarted (a new ``instance_id`` in an Execute reply) lost
  every block's KV: the step's output is dropped and every running sequence is
  recomputed from the tokens the gateway holds; nothing fails;
* an unreachable dependency (a killed executor or kvmanager, a lost session, an
  Execute that outlasts ``step_timeout_s`` because the executor is stopped or hung):
  the session is dropped and set up again as soon as both answer, and every
  running sequence is recomputed from its tokens, so greedy and seeded outputs
  are token-identical to an uninterrupted run. Only when nothing could serve for
  ``unavailable_timeout_s`` do the requests in flight fail, with UNAVAILABLE (503)
  and the reason. New requests while a dependency is down get 503 at once.

The pool is registered with the executor's ``instance_id``, so kvmanager drops
the hashes of a restarted executor's blocks, even those another session holds.
"""
from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import time
import uuid
from dataclasses import dataclass, field

import grpc

from gateway.clients import (
    ChannelSecurity, DependencyError, ExecuteOutput, ExecutorClient, ExecutorInfo, KVManagerClient,
)
from gateway.detokenizer import ModelTokenizer
from gateway.metrics import GatewayMetrics
from gateway.params import validate_request
from gateway.scheduler import AllocationResult, ScheduledSeq, Scheduler, SchedulerConfig, SchedulerCounters
from gateway.sequence import GenerationRequest, RequestOutput, SamplingOptions
from gateway.streams import RequestStream
from kvserve.errors import AlreadyExists, IncompatibleDependency, ResourceExhausted, StepRefused, Unavailable
from kvserve.identity import tokenizer_fingerprint
from kvserve.logs import get_logger
from kvserve.ports import DEFAULT_EXECUTOR_ADDRESS, DEFAULT_KVMANAGER_ADDRESS

log = get_logger("gateway.engine")


# Pause between attempts to set a session up again while a dependency is unreachable.
UNAVAILABLE_RETRY_S = 0.25


class KVStateLost(Unavailable):
    """The dependencies answer, but the KV of the running sequences is gone or cannot be
    trusted: start a new session and recompute them (nobody's request fails)."""


class ExecutorRestarted(KVStateLost):
    """The executor answered with a new instance_id: its KV cache is new and empty."""


@dataclass(frozen=True)
class EngineConfig:
    kvmanager_address: str = DEFAULT_KVMANAGER_ADDRESS
    executor_address: str = DEFAULT_EXECUTOR_ADDRESS
    pool_id: str = ""
    kv_allocation: str = "paged"
    enable_prefix_caching: bool = True
    session_ttl_ms: int = 10_000
    max_queue_len: int = 1024
    # How long requests in flight wait (to be recomputed) for an unreachable dependency.
    unavailable_timeout_s: float = 30.0
    # An Execute that takes longer counts as an unreachable executor (stopped, hung).
    step_timeout_s: float = 120.0
    # Credentials of the channels to kvmanager and executor (service token, TLS CA).
    channel_security: ChannelSecurity = field(default_factory=ChannelSecurity)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    @property
    def effective_pool_id(self) -> str:
        return self.pool_id or f"executor@{self.executor_address}"


class Engine:
    def __init__(self, config: EngineConfig, tokenizer: ModelTokenizer, metrics: GatewayMetrics):
        self.config = config
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.kvmanager = KVManagerClient(config.kvmanager_address, security=config.channel_security)
        self.executor = ExecutorClient(config.executor_address, execute_timeout=config.step_timeout_s,
                                       security=config.channel_security)
        self.info: ExecutorInfo | None = None
        seq_prefix = random.getrandbits(30) << 32
        self._seq_counter = iter(range(seq_prefix + 1, seq_prefix + (1 << 32)))
        self.scheduler = Scheduler(config.scheduler, lambda: next(self._seq_counter))
        self._session_id: str | None = None
        self._connection_lost: str | None = None
        self._connect_lock = asyncio.Lock()
        self._step_lock = asyncio.Lock()
        self._inbox: list[tuple[GenerationRequest, object]] = []
        self._aborts: set[str] = set()
        self._live: dict[str, RequestStream] = {}
        self._wakeup = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._accepting = True
        self._tasks: list[asyncio.Task] = []
        self._closing: asyncio.Task | None = None
        self._unavailable_since: float | None = None
        self._reported = SchedulerCounters()  # what the metrics have been told so far
        self._tokenizer_fingerprint = tokenizer_fingerprint(tokenizer.model_dir)

    # --- lifecycle -------------------------------------------------------------

    async def start(self) -> None:
        self._tasks.append(asyncio.create_task(self._loop(), name="engine-loop"))
        self._tasks.append(asyncio.create_task(self._renew_session_loop(), name="session-renewal"))
        for client in (self.kvmanager, self.executor):
            self._tasks.append(asyncio.create_task(self._watch_channel(client), name=f"watch-{client.service}"))
        try:
            await self.ensure_connected()
        except Unavailable as exc:
            log.info("dependencies_unavailable_at_start", reason=str(exc))

    async def shutdown(self, timeout: float = 5.0) -> None:
        """Stops accepting, aborts everything in flight, frees its blocks, closes the session."""
        self._accepting = False
        for request_id in list(self._live):
            self.abort(request_id)
        self._wakeup.set()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            log.warning("shutdown_not_idle", live=len(self._live))
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._close_session(timeout=2.0)
        await self.kvmanager.close()
        await self.executor.close()

    # --- requests ----------------------------------------------------------------

    @property
    def model_name(self) -> str:
        return self.metrics.model_name

    async def submit(self, prompt_token_ids: list[int], options: SamplingOptions,
                     request_id: str | None = None) -> RequestStream:
        """Validates and queues a request; raises InvalidArgument, ResourceExhausted or Unavailable."""
        if not self._accepting:
            raise Unavailable("gateway is shutting down")
        await self.ensure_connected()
        info = self.info
        request_id = request_id or f"req-{uuid.uuid4().hex}"
        if request_id in self._live:
            raise AlreadyExists(f"request_id {request_id!r} is already live")
        eos = frozenset(info.eos_token_ids) or frozenset(self.tokenizer.eos_token_ids)
        validate_request(prompt_token_ids, options, info, max_num_seqs=self.config.scheduler.max_num_seqs,
                         kv_allocation=self.config.kv_allocation, eos_token_ids=eos)
        queued = self.scheduler.num_waiting_requests + len(self._inbox)
        if queued >= self.config.max_queue_len:
            raise ResourceExhausted(f"queue full: {queued} requests waiting (max_queue_len "
                                    f"{self.config.max_queue_len}); retry later")
        request = GenerationRequest(request_id, list(prompt_token_ids), options, eos, info.max_model_len)
        request.max_stop_len = max((len(s) for s in options.stop), default=0)
        stream = RequestStream(request)
        request.sink = stream.queue.put_nowait
        self._live[request_id] = stream
        self._inbox.append((request, lambda: self.tokenizer.detokenizer(
            prompt_token_ids, options.skip_special_tokens)))
        self._idle.clear()
        self._wakeup.set()
        return stream

    def abort(self, request_id: str) -> bool:
        """Asks the loop to abort; blocks are freed at the next step. False when not live."""
        if request_id not in self._live:
            return False
        self._aborts.add(request_id)
        self._idle.clear()
        self._wakeup.set()
        return True

    # --- connection ---------------------------------------------------------------

    async def ensure_connected(self, *, in_step: bool = False) -> None:
        """Sets up pool and session when there is none; raises Unavailable with the reason."""
        if self._session_id is not None and self._connection_lost is None:
            return
        async with self._connect_lock:
            if self._connection_lost is not None:
                if in_step:
                    self._reset_connection(self._connection_lost)
                else:
                    async with self._step_lock:
                        if self._connection_lost is not None:
                            self._reset_connection(self._connection_lost)
            if self._session_id is not None:
                return
            if self._closing is not None:  # the old session's blocks must be free before the cache reset
                await asyncio.wait({self._closing}, timeout=3.0)
                self._closing = None
            try:
                info = await self.executor.describe()
                self._check_tokenizer(info)
                pool_id = self.config.effective_pool_id
                await self.kvmanager.register_pool(pool_id, info, self.config.enable_prefix_caching,
                                                   self.config.kv_allocation)
                if not info.instance_id:  # an executor that cannot say whether it restarted
                    await self.kvmanager.reset_prefix_cache(pool_id)
                session_id, ttl = await self.kvmanager.open_session(
                    pool_id, self.config.session_ttl_ms, f"gateway@{os.getpid()}")
            except DependencyError as exc:
                raise Unavailable(f"cannot serve: {exc}") from exc
            self.info = info
            self._session_id = session_id
            self._connection_lost = None
            self._unavailable_since = None
            log.info("connected", pool_id=pool_id, session_id=session_id, num_blocks=info.num_blocks,
                     block_size=info.block_size, max_model_len=info.max_model_len, model=info.model_name)

    def _check_tokenizer(self, info: ExecutorInfo) -> None:
        """Token ids mean nothing across tokenizers: refuse an executor that serves another one."""
        if info.tokenizer_fingerprint and info.tokenizer_fingerprint != self._tokenizer_fingerprint:
            log.error("tokenizer_mismatch", executor_model=info.model_name,
                      executor_tokenizer=info.tokenizer_fingerprint, gateway_tokenizer=self._tokenizer_fingerprint,
                      gateway_model=str(self.tokenizer.model_dir))
            raise IncompatibleDependency(
                f"the executor serves {info.model_name!r} with another tokenizer than this gateway's "
                f"model directory {self.tokenizer.model_dir.name!r} (tokenizer.json sha256 {info.tokenizer_fingerprint[:12]} "
                f"vs {self._tokenizer_fingerprint[:12]}); start the gateway with the executor's model")

    def _reset_connection(self, reason: str, *, recompute: bool = False) -> None:
        """Forgets the session and recomputes every running sequence once it is set up
        again: at once with ``recompute`` (the dependencies are up but the KV is gone),
        else while a dependency has been unreachable for less than
        ``unavailable_timeout_s``. After that, every live request fails with UNAVAILABLE."""
        if not recompute and (self._live or self.scheduler.has_work()):
            now = time.monotonic()
            if self._unavailable_since is None:
                self._unavailable_since = now
            waited = now - self._unavailable_since
            recompute = waited < self.config.unavailable_timeout_s
            if not recompute:
                reason = f"nothing could serve for {waited:.0f} s ({reason})"
        if recompute:
            self.scheduler.preempt_all()
            self._publish_counters()
        else:
            error = Unavailable(reason)
            for request, _ in self._inbox:
                request.sink(RequestOutput(request.request_id, [], finished=True, error=error))
                self._live.pop(request.request_id, None)
            self._inbox.clear()
            self.scheduler.fail_all(error)
        self.scheduler.forget_connection_state()
        self._deliver(self.scheduler.take_outputs())
        session_id, self._session_id = self._session_id, None
        self._connection_lost = None
        if session_id is not None:
            self._closing = asyncio.get_running_loop().create_task(self._close_session_id(session_id))
        log.warning("connection_reset", reason=reason, recompute=recompute)

    async def _close_session(self, timeout: float) -> None:
        session_id, self._session_id = self._session_id, None
        if session_id is not None:
            await self._close_session_id(session_id, timeout)

    async def _close_session_id(self, session_id: str, timeout: float = 2.0) -> None:
        try:
            await self.kvmanager.close_session(session_id, timeout=timeout)
        except DependencyError as exc:
            log.info("close_session_failed", reason=str(exc))

    async def _renew_session_loop(self) -> None:
        while True:
            await asyncio.sleep(max(self.config.session_ttl_ms / 3000.0, 0.05))
            session_id = self._session_id
            if session_id is None:
                continue
            try:
                await self.kvmanager.renew_session(session_id)
            except DependencyError as exc:
                if self._session_id == session_id:
                    self._connection_lost = f"kvmanager session lost: {exc}"
                    self._wakeup.set()

    async def _watch_channel(self, client) -> None:
        """A broken connection (process restarted or gone) means the session or KV content is lost."""
        channel = client.channel
        state = channel.get_state(try_to_connect=False)
        while True:
            await channel.wait_for_state_change(state)
            new_state = channel.get_state(try_to_connect=False)
            if state is grpc.ChannelConnectivity.READY and new_state in (
                    grpc.ChannelConnectivity.TRANSIENT_FAILURE, grpc.ChannelConnectivity.IDLE) \
                    and self._session_id is not None:
                self._connection_lost = f"{client.service} at {client.address}: connection lost"
                self._wakeup.set()
            state = new_state

    # --- the loop -------------------------------------------------------------------

    async def _loop(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while self._inbox or self._aborts or self.scheduler.has_work() or self._connection_lost:
                await self._run_step()
                # Let streams flush and requests arrive; while a dependency is down, retry calmly.
                await asyncio.sleep(0 if self._unavailable_since is None else UNAVAILABLE_RETRY_S)
            await self._flush_frees()
            self._publish_queue()
            self._idle.set()

    async def _run_step(self) -> None:
        """One step; a failure costs what it says (see the module docstring)."""
        async with self._step_lock:
            try:
                await self._step()
            except KVStateLost as exc:
                log.warning("kv_state_lost", reason=str(exc), num_running=len(self.scheduler.running))
                self._reset_connection(str(exc), recompute=True)
            except Unavailable as exc:
                self._reset_connection(str(exc))
            except Exception as exc:  # noqa: BLE001 — a bug must not kill the loop
                log.error("step_failed", error=repr(exc), exc_info=exc)
                self._reset_connection(f"internal error in the gateway step: {exc!r}")

    async def _step(self) -> None:
        started = time.perf_counter()
        if self._connection_lost is not None:
            raise Unavailable(self._connection_lost)
        scheduler = self.scheduler
        for request, make_decoder in self._inbox:
            scheduler.add_request(request, make_decoder)
        self._inbox.clear()
        for request_id in self._aborts:
            scheduler.abort_request(request_id)
        self._aborts.clear()
        if not scheduler.has_work():
            self._deliver(scheduler.take_outputs())
            return
        if self._session_id is None:
            await self.ensure_connected(in_step=True)
        pool_id, session_id = self.config.effective_pool_id, self._session_id
        kv_s = 0.0
        for request in scheduler.take_pending_forks():
            t0 = time.perf_counter()
            children = [seq.seq_id for seq in request.sequences[1:]]
            try:
                table = await self.kvmanager.fork(pool_id, session_id, request.sequences[0].seq_id, children)
            except DependencyError as exc:
                if not exc.refused:
                    raise
                scheduler.fail_request(request, self._refusal("kvmanager", exc))
                continue
            finally:
                kv_s += time.perf_counter() - t0
            scheduler.complete_fork(request, table)
        plan = scheduler.schedule()
        ready, usage = [], None
        while plan:
            t0 = time.perf_counter()
            results, usage = await self._allocate(pool_id, session_id, plan)
            kv_s += time.perf_counter() - t0
            verdict = scheduler.apply_allocation(plan, results)
            ready = scheduler.prune(ready + verdict.ready)
            plan = verdict.retry
        executor_s = forward_s = total_s = 0.0
        if ready:
            t0 = time.perf_counter()
            ready, result = await self._execute(ready)
            executor_s = time.perf_counter() - t0
            forward_s, total_s = result.forward_s, result.total_s
            scheduler.apply_samples(ready, result.sampled)
        self._deliver(scheduler.take_outputs())
        self._publish_counters()
        self._publish_queue()
        self.metrics.on_step(step_s=time.perf_counter() - started, kvmanager_s=kv_s, executor_s=executor_s,
                             forward_s=forward_s, executor_total_s=total_s, num_seqs=len(ready), kv_usage=usage)

    async def _allocate(self, pool_id: str, session_id: str, plan: list[ScheduledSeq]):
        """One Allocate carrying the pending frees and written-KV reports. When kvmanager
        refuses it (it validates a whole call before changing anything), the frees and
        reports go alone, then each entry alone; the requests refused again fail."""
        scheduler = self.scheduler
        frees, written = scheduler.take_pending_frees(), scheduler.take_written_reports()
        prefix_caching = self.config.enable_prefix_caching
        try:
            return await self.kvmanager.allocate(pool_id, session_id, frees, plan, prefix_caching, written)
        except DependencyError as exc:
            if not exc.refused:
                raise
            log.error("allocate_refused", reason=str(exc), num_seqs=len(plan))
        try:
            await self.kvmanager.free(pool_id, session_id, frees, written)
        except DependencyError as exc:  # our own bookkeeping is refused: start the session afresh
            raise KVStateLost(f"kvmanager refused this gateway's frees: {exc}") from exc
        results, usage = [], 0.0
        for entry in plan:
            if entry.seq.request.finished:
                results.append(AllocationResult(ok=False))  # its request failed: skipped by apply_allocation
                continue
            try:
                (result,), usage = await self.kvmanager.allocate(pool_id, session_id, [], [entry], prefix_caching)
            except DependencyError as exc:
                if not exc.refused:
                    raise
                scheduler.fail_refused([entry], self._refusal("kvmanager", exc))
                result = AllocationResult(ok=False)
            results.append(result)
        return results, usage

    async def _execute(self, ready: list[ScheduledSeq]) -> tuple[list[ScheduledSeq], ExecuteOutput]:
        """One Execute. When the executor refuses it (a refused Execute writes nothing),
        each request's entries run alone; the requests refused again fail. Returns the
        entries that ran and their output."""
        try:
            return ready, self._same_instance(await self.executor.execute(ready))
        except DependencyError as exc:
            if not exc.refused:
                raise
            log.error("execute_refused", reason=str(exc), num_seqs=len(ready))
        by_request: dict[int, list[ScheduledSeq]] = {}
        for entry in ready:
            by_request.setdefault(id(entry.seq.request), []).append(entry)
        ran: list[ScheduledSeq] = []
        sampled, forward_s, total_s = [], 0.0, 0.0
        for entries in by_request.values():
            try:
                output = self._same_instance(await self.executor.execute(entries))
            except DependencyError as exc:
                if not exc.refused:
                    raise
                self.scheduler.fail_refused(entries, self._refusal("executor", exc))
                continue
            ran += entries
            sampled += output.sampled
            forward_s += output.forward_s
            total_s += output.total_s
        return ran, ExecuteOutput(sampled, forward_s, total_s)

    def _same_instance(self, output: ExecuteOutput) -> ExecuteOutput:
        if output.instance_id and self.info is not None and output.instance_id != self.info.instance_id:
            raise ExecutorRestarted(f"executor restarted (instance {self.info.instance_id} is now "
                                    f"{output.instance_id}): recomputing every running sequence")
        return output

    @staticmethod
    def _refusal(service: str, exc: DependencyError) -> StepRefused:
        return StepRefused(f"the {service} refused a step with this request ({exc.status.name}: {exc.details}); "
                           "the request failed, others go on")

    async def _flush_frees(self) -> None:
        """Idle: free what finished in the last step and report what it wrote (nothing else will carry it)."""
        frees, written = self.scheduler.take_pending_frees(), self.scheduler.take_written_reports()
        if not (frees or written[0]) or self._session_id is None:
            return
        try:
            await self.kvmanager.free(self.config.effective_pool_id, self._session_id, frees, written)
        except DependencyError as exc:
            log.warning("free_failed", reason=str(exc), seq_ids=len(frees))
            self._connection_lost = f"free failed: {exc}"

    # --- outputs and metrics ----------------------------------------------------------

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
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
                reason = next((c.finish_reason.value for c in output.choices if c.finish_reason), "error")
                self.metrics.on_request_finished(e2e_s=now - request.arrival_time, reason=reason)
            request.sink(output)

    def _publish_counters(self) -> None:
        """The scheduler's counters since the last call, including what happened between
        steps (preemptions when the KV was lost)."""
        now, before = self.scheduler.counters, self._reported
        self.metrics.on_preemptions(now.num_preemptions - before.num_preemptions)
        self.metrics.on_prefix_lookup(now.prefix_cache_queries - before.prefix_cache_queries,
                                      now.prefix_cache_hits - before.prefix_cache_hits)
        self._reported = dataclasses.replace(now)

    def _publish_queue(self) -> None:
        running = {seq.request.request_id for seq in self.scheduler.running}
        self.metrics.set_queue(len(running), self.scheduler.num_waiting_requests + len(self._inbox),
                               len(self.scheduler.running))

    # --- introspection --------------------------------------------------------------

    async def dependency_health(self) -> dict[str, bool]:
        kv, ex = await asyncio.gather(self.kvmanager.healthy(), self.executor.healthy())
        self.metrics.on_dependency("kvmanager", kv)
        self.metrics.on_dependency("executor", ex)
        return {"kvmanager": kv, "executor": ex}

    async def refresh_pool_stats(self):
        """Reads kvmanager's pool stats into the metrics; None when unreachable."""
        try:
            stats = await self.kvmanager.get_stats(self.config.effective_pool_id)
        except DependencyError:
            return None
        self.metrics.on_pool_stats(stats)
        return stats

    @property
    def max_model_len(self) -> int | None:
        return self.info.max_model_len if self.info else None
