"""One executor behind the gateway: its pool in kvmanager, a session on it, and the
scheduler of the requests routed there, driven by its own step loop (one batched
kvmanager Allocate and one Execute per step).

All scheduler state changes happen on this loop; the engine only leaves notes in
the inbox (requests routed here) and in ``aborts``.

Failures have a bounded blast radius:

* a dependency that refuses a step (its content, not an outage: see
  ``clients.REFUSALS``) fails only the requests in it: the step is retried one
  request at a time (a refused call changes nothing on either service), and the
  requests that are refused again fail with the reason (HTTP 500);
* anything else (the executor restarted with a new ``instance_id``, is unreachable,
  or outlasts its step deadline; kvmanager unreachable or lost the session; a bug in
  a step) *evacuates* the backend: every request it holds leaves with the tokens it
  has and is handed back to the engine, which routes it again (another executor, or
  this one once it is back) to be recomputed, so greedy and seeded outputs are
  token-identical to an uninterrupted run. The backend then closes its session
  and reconnects (Describe, RegisterPool, OpenSession) until it can serve again.

The step deadline (unless ``EngineConfig.step_timeout_s`` fixes it) is derived from
the steps this executor ran: ten times what the slowest recent step would take for
this step's tokens, at least ``MIN_STEP_DEADLINE_S`` and at most
``MAX_STEP_DEADLINE_S`` (which is also the deadline until ``DEADLINE_WARMUP_STEPS``
steps were seen, so a first compile or a cold cache is not mistaken for a hang).
"""
from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from gateway.clients import DependencyError, ExecuteOutput, ExecutorClient, ExecutorInfo, watch_for_breaks
from gateway.kvmanager_client import KVManagerClient
from gateway.scheduler import AllocationResult, ScheduledSeq, Scheduler
from gateway.sequence import GenerationRequest, RequestOutput
from gateway.store_exchange import StoreExchange
from kvserve.errors import IncompatibleDependency, StepRefused, Unavailable
from kvserve.logs import get_logger

log = get_logger("gateway.backend")

# Pause between attempts to set a session up again while a dependency is unreachable.
UNAVAILABLE_RETRY_S = 0.25
MIN_STEP_DEADLINE_S = 5.0
MAX_STEP_DEADLINE_S = 120.0
STEP_DEADLINE_FACTOR = 10.0
DEADLINE_WARMUP_STEPS = 8
DEADLINE_WINDOW_STEPS = 64


class KVStateLost(Unavailable):
    """The dependencies answer, but the KV of the running sequences is gone or cannot be
    trusted: the requests are recomputed (nobody's request fails)."""


class ExecutorRestarted(KVStateLost):
    """The executor answered with a new instance_id: its KV cache is new and empty."""


@dataclass
class BackendHooks:
    """What a backend tells the engine."""

    deliver: Callable[[list[RequestOutput]], None]
    evacuated: Callable[["Backend", list[GenerationRequest], str], None]
    came_up: Callable[["Backend"], None]
    accept: Callable[["Backend", ExecutorInfo], None]  # raises IncompatibleDependency to refuse it
    on_step: Callable[..., None]
    publish_counters: Callable[[], None]
    # After each overlapped decode step's Allocate answer: whether it was the predicted one.
    on_overlapped_step: Callable[["Backend", bool], None]


class StepDeadline:
    """How long this executor's next Execute may take (see the module docstring)."""

    def __init__(self, fixed_s: float | None = None):
        self.fixed_s = fixed_s
        self._steps: deque[tuple[float, int]] = deque(maxlen=DEADLINE_WINDOW_STEPS)

    def observe(self, seconds: float, num_tokens: int) -> None:
        self._steps.append((seconds, max(1, num_tokens)))

    def for_step(self, num_tokens: int) -> float:
        if self.fixed_s is not None:
            return self.fixed_s
        if len(self._steps) < DEADLINE_WARMUP_STEPS:
            return MAX_STEP_DEADLINE_S
        slowest = max(s for s, _ in self._steps)
        per_token = max(s / n for s, n in self._steps)
        expected = slowest + per_token * num_tokens
        return min(MAX_STEP_DEADLINE_S, max(MIN_STEP_DEADLINE_S, STEP_DEADLINE_FACTOR * expected))


class Backend:
    def __init__(self, address: str, pool_id: str, engine_config, kvmanager: KVManagerClient,
                 new_seq_id: Callable[[], int], hooks: BackendHooks):
        self.address = address
        self.pool_id = pool_id
        self.config = engine_config
        self.kvmanager = kvmanager
        self.executor = ExecutorClient(address, execute_timeout=MAX_STEP_DEADLINE_S,
                                       security=engine_config.channel_security,
                                       use_step_socket=engine_config.executor_step_socket)
        self.hooks = hooks
        self.scheduler = Scheduler(engine_config.scheduler, new_seq_id)
        self.info: ExecutorInfo | None = None
        self.store = StoreExchange()  # the store tier's orders and outcomes in transit (gateway.store_exchange)
        self.deadline = StepDeadline(engine_config.step_timeout_s)
        self.inbox: list[GenerationRequest] = []  # new requests routed here
        self.migrated: list[GenerationRequest] = []  # requests another backend held: run them first
        self.aborts: dict[str, Exception | None] = {}  # request id -> the error it fails with (None: abort)
        self.last_error: str = ""
        self.num_steps = 0
        self.num_executes = 0  # Execute calls made (a step's, or each request's after a refusal)
        self.num_overlapped_steps = 0  # decode steps whose Execute went out beside their Allocate
        self.num_mispredicted_steps = 0  # of those, kvmanager answered otherwise (a bug: recomputed)
        self._session_id: str | None = None
        self._connection_lost: str | None = None
        self._connect_lock = asyncio.Lock()
        self._wakeup = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._tasks: list[asyncio.Task] = []
        self._closing: asyncio.Task | None = None
        # A step's outputs and counters not yet handed to the engine (see _publish_after_next_write)
        self._unpublished_outputs: list[RequestOutput] = []
        self._unpublished_steps: list[dict] = []
        self._publish_scheduled = False

    # --- what the engine and the router read -------------------------------------

    @property
    def is_up(self) -> bool:
        return self._session_id is not None and self._connection_lost is None

    @property
    def block_size(self) -> int:
        return self.info.block_size if self.info else 16

    def pending_tokens(self) -> int:
        queued = sum(seq.num_uncached_to_compute() for r in self.inbox + self.migrated for seq in r.sequences
                     if not seq.is_finished)
        return self.scheduler.pending_tokens() + queued

    def num_running(self) -> int:
        return len(self.scheduler.running)

    # --- lifecycle ---------------------------------------------------------------

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._loop(), name=f"backend-{self.address}"),
                       asyncio.create_task(self._renew_session_loop(), name=f"renew-{self.address}"),
                       asyncio.create_task(watch_for_breaks(self.executor.channel, lambda: self.connection_lost(
                           f"executor at {self.address}: connection lost")), name=f"watch-{self.address}")]

    async def stop(self) -> None:
        """Hands back whatever it holds, closes its session and its channel."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._evacuate("executor left the gateway's executor list")
        if self._closing is not None:
            await asyncio.wait({self._closing}, timeout=3.0)
        await self.executor.close()

    async def wait_idle(self) -> None:
        await self._idle.wait()

    def enqueue(self, requests: list[GenerationRequest], *, migrated: bool = False) -> None:
        (self.migrated if migrated else self.inbox).extend(requests)
        self._idle.clear()
        self._wakeup.set()

    def abort(self, request_id: str, error: Exception | None = None) -> None:
        self.aborts[request_id] = error
        self._idle.clear()
        self._wakeup.set()

    def connection_lost(self, reason: str) -> None:
        """Something outside the step loop saw this backend's session or executor go."""
        if self._session_id is not None:
            self._connection_lost = reason
            self._wakeup.set()

    # --- connection --------------------------------------------------------------

    async def connect(self) -> None:
        """Sets up pool and session when there is none; raises Unavailable with the reason."""
        async with self._connect_lock:
            if self.is_up:
                return
            if self._connection_lost is not None:
                self._evacuate(self._connection_lost)
            if self._closing is not None:  # the old session's blocks must be free before the cache reset
                await asyncio.wait({self._closing}, timeout=3.0)
                self._closing = None
            try:
                info = await self.executor.describe()
                self.hooks.accept(self, info)
                await self.kvmanager.register_pool(self.pool_id, info, self.config.enable_prefix_caching,
                                                   self.config.kv_allocation)
                if not info.instance_id:  # an executor that cannot say whether it restarted
                    await self.kvmanager.reset_prefix_cache(self.pool_id)
                session_id, _ = await self.kvmanager.open_session(
                    self.pool_id, self.config.session_ttl_ms, self.config.session_name)
            except (DependencyError, IncompatibleDependency) as exc:
                self.last_error = str(exc)
                raise Unavailable(f"cannot serve: {exc}") from exc
            if self.info is not None and self.info.instance_id != info.instance_id:
                self.deadline = StepDeadline(self.config.step_timeout_s)
            self.info = info
            self.scheduler.block_size = info.block_size if self.config.enable_prefix_caching else None
            self.scheduler.kv_block_size = info.block_size
            # Drafts only to an executor that verifies them: another would sample after the last draft.
            self.scheduler.drafts_enabled = (self.config.scheduler.speculative_decoding != "off"
                                             and info.verifies_draft_tokens)
            self.scheduler.drafts_before_min_tokens = info.verifies_drafts_with_suppressed_tokens
            self._session_id = session_id
            self._connection_lost = None
            self.last_error = ""
            log.info("connected", executor=self.address, pool_id=self.pool_id, session_id=session_id,
                     num_blocks=info.num_blocks, block_size=info.block_size, max_model_len=info.max_model_len,
                     model=info.model_name, instance_id=info.instance_id)
        self.hooks.came_up(self)
        self._wakeup.set()

    def _evacuate(self, reason: str) -> None:
        """Hands every request back to the engine (to be recomputed) and forgets the session."""
        self._take_inbox()
        self._apply_aborts()
        self._deliver(self.scheduler.take_outputs())
        requests = self.scheduler.evacuate()
        self.store.reset()
        self.hooks.publish_counters()
        session_id, self._session_id = self._session_id, None
        self._connection_lost = None
        if session_id is not None:
            self._closing = asyncio.get_running_loop().create_task(self._close_session_id(session_id))
            log.warning("backend_evacuated", executor=self.address, reason=reason, num_requests=len(requests))
        self.hooks.evacuated(self, requests, reason)

    async def _close_session_id(self, session_id: str, timeout: float = 2.0) -> None:
        try:
            await self.kvmanager.close_session(session_id, timeout=timeout)
        except DependencyError as exc:
            log.info("close_session_failed", executor=self.address, reason=str(exc))

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
                    self.connection_lost(f"kvmanager session lost: {exc}")

    # --- the loop ----------------------------------------------------------------

    def _has_work(self) -> bool:
        return bool(self.inbox or self.migrated or self.aborts or self.scheduler.has_work() or self._connection_lost)

    async def _loop(self) -> None:
        while True:
            if not self.is_up:
                try:
                    await self.connect()
                except Unavailable:
                    await asyncio.sleep(UNAVAILABLE_RETRY_S)
                    continue
            if not self._has_work():
                self.publish()
                await self.flush_frees()
                self._idle.set()
                await self._wakeup.wait()
                self._wakeup.clear()
                continue
            executes = self.num_executes
            await self.run_step(publish_after_next_write=True)
            if self.num_executes == executes:  # else the Execute's wait let streams flush and requests arrive
                await asyncio.sleep(0)

    async def run_step(self, publish_after_next_write: bool = False) -> None:
        """One step; a failure costs what it says (see the module docstring). Its outputs reach the
        engine before it returns, or with ``publish_after_next_write`` (the loop's steps) once the
        next step's Execute is written."""
        try:
            await self._step()
            if not publish_after_next_write:
                self.publish()
        except KVStateLost as exc:
            log.warning("kv_state_lost", executor=self.address, reason=str(exc),
                        num_running=len(self.scheduler.running))
            self._evacuate(str(exc))
        except Unavailable as exc:
            self.last_error = str(exc)
            self._evacuate(str(exc))
        except Exception as exc:  # noqa: BLE001 — a bug must not kill the loop
            log.error("step_failed", executor=self.address, error=repr(exc), exc_info=exc)
            self._evacuate(f"internal error in the gateway step: {exc!r}")

    def _take_inbox(self) -> None:
        self.scheduler.adopt(self.migrated, front=True)
        self.scheduler.adopt(self.inbox)
        self.migrated, self.inbox = [], []

    def _apply_aborts(self) -> None:
        for request_id, error in self.aborts.items():
            request = self.scheduler.requests.get(request_id)
            if error is not None and request is not None:
                self.scheduler.fail_request(request, error)
            else:
                self.scheduler.abort_request(request_id)
        self.aborts.clear()

    async def _step(self) -> None:
        started = time.perf_counter()
        if self._connection_lost is not None:
            raise Unavailable(self._connection_lost)
        scheduler = self.scheduler
        self._take_inbox()
        self._apply_aborts()
        if not scheduler.has_work():
            self._deliver(scheduler.take_outputs())
            return
        if self._session_id is None:
            raise Unavailable(f"executor at {self.address}: no session")
        pool_id, session_id = self.pool_id, self._session_id
        kv_s = 0.0
        for request in scheduler.take_pending_forks():
            t0 = time.perf_counter()
            children = [seq.seq_id for seq in request.sequences[1:]]
            try:
                table = await self.kvmanager.fork(pool_id, session_id, request.sequences[0].seq_id, children)
            except DependencyError as exc:
                if not exc.refused:
                    raise
                scheduler.fail_request(request, refusal("kvmanager", exc))
                continue
            finally:
                kv_s += time.perf_counter() - t0
            scheduler.complete_fork(request, table)
        plan = scheduler.schedule()
        predicted = scheduler.predict_decodes(plan)
        ready, usage, result, executor_s = [], None, None, 0.0
        if predicted is not None:
            ready, result, usage, kv_wait_s, executor_s = await self._overlapped_decodes(
                pool_id, session_id, plan, predicted)
            kv_s += kv_wait_s
        else:
            while plan:
                t0 = time.perf_counter()
                results, usage = await self._allocate(pool_id, session_id, plan)
                kv_s += time.perf_counter() - t0
                verdict = scheduler.apply_allocation(plan, results, saves_in_transit=self.store.holds_blocks())
                ready = scheduler.prune(ready + verdict.ready)
                plan = verdict.retry
            if ready:
                t0 = time.perf_counter()
                ready, result = await self._execute(ready)
                executor_s = time.perf_counter() - t0
            elif self.store.orders:  # the waiting may wait for the blocks these saves hold
                await self._carry_store_orders()
        forward_s = total_s = 0.0
        if result is not None:
            self.deadline.observe(executor_s, sum(e.num_tokens for e in ready))
            if scheduler.drafts_enabled and all(e.num_tokens == 1 for e in ready):  # decodes: comparable
                scheduler.draft_cost.observe(len(ready), any(e.draft_token_ids for e in ready), executor_s)
            forward_s, total_s = result.forward_s, result.total_s
            scheduler.apply_samples(ready, result.sampled, result.prompt_logprobs)
        self.num_steps += 1
        self._publish_after_next_write(scheduler.take_outputs(), dict(
            step_s=time.perf_counter() - started, kvmanager_s=kv_s, executor_s=executor_s, forward_s=forward_s,
            executor_total_s=total_s, num_seqs=len(ready), kv_usage=usage))

    def _publish_after_next_write(self, outputs: list[RequestOutput], step: dict) -> None:
        """The step's outputs (to the request streams), the counters and the step's metrics go to
        the engine at the event loop's next turn, not now: the loop's next step runs first as far
        as its first wait, the write of its Execute (or its Allocate), so that this bookkeeping
        (~0.35 ms of a 19-sequence step on a 2-core box) runs while the executor computes instead
        of keeping it idle. Anything else that hands outputs over publishes these first, so a
        request's outputs keep their order."""
        self._unpublished_outputs += outputs
        self._unpublished_steps.append(step)
        if not self._publish_scheduled:
            self._publish_scheduled = True
            asyncio.get_running_loop().call_soon(self.publish)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Hands ``outputs`` to the engine now, after whatever earlier steps left unpublished."""
        self.publish()
        self.hooks.deliver(outputs)

    def publish(self) -> None:
        """Hands the engine what the steps so far left unpublished, in order."""
        self._publish_scheduled = False
        outputs, self._unpublished_outputs = self._unpublished_outputs, []
        steps, self._unpublished_steps = self._unpublished_steps, []
        if outputs:
            self.hooks.deliver(outputs)
        if steps:
            self.hooks.publish_counters()
        for step in steps:
            self.hooks.on_step(self, **step)

    async def _overlapped_decodes(self, pool_id: str, session_id: str, plan: list[ScheduledSeq],
                                  predicted: list[tuple[int, int]]):
        """A step of plain decodes whose Allocate answer is known ahead (``Scheduler.predict_decodes``):
        its Execute goes out beside the Allocate instead of after it, so the kvmanager round trip
        hides behind the forward pass. kvmanager still sees every step, in order (the frees and
        written-KV reports ride along as always). Its answer is checked once both are back; any other
        answer would be a bug, and loses this backend's KV state: every sequence is recomputed.
        Returns (entries run, their output, KV usage, seconds waited for kvmanager after the Execute,
        seconds of the Execute)."""
        ready = self.scheduler.apply_predicted(plan, predicted)
        self.num_overlapped_steps += 1
        started = time.perf_counter()
        # What the Allocate carries is taken now, before the Execute can change it: a request the
        # executor refuses at once is retired (its free queued) before the Allocate's task first runs,
        # and freeing it in this Allocate, which also steps it, would answer it as a new sequence.
        carried = self.scheduler.take_pending_frees(), self.scheduler.take_written_reports()
        allocate = asyncio.ensure_future(self._allocate(pool_id, session_id, plan, carried))
        try:
            ran, result = await self._execute(ready)
        except BaseException:
            allocate.cancel()  # the step failed: the session is dropped, its answer would change nothing
            await asyncio.gather(allocate, return_exceptions=True)
            raise
        executed = time.perf_counter()
        results, usage = await allocate
        matched = Scheduler.answer_matches(predicted, results)
        self.hooks.on_overlapped_step(self, matched)
        if not matched:
            self.num_mispredicted_steps += 1
            raise KVStateLost(f"kvmanager answered a step of {len(plan)} decodes otherwise than predicted "
                              f"({[(r.ok, r.start_position, r.num_tokens) for r in results][:4]}...): recomputing")
        self.scheduler.apply_allocation(plan, results)  # records what kvmanager knows, as any step does
        return ran, result, usage, time.perf_counter() - executed, executed - started

    async def _allocate(self, pool_id: str, session_id: str, plan: list[ScheduledSeq],
                        carried: tuple[list[int], tuple[list[int], list[int]]] | None = None):
        """One Allocate carrying the pending frees and written-KV reports (or ``carried``, taken
        earlier). When kvmanager refuses it (it validates a whole call before changing anything),
        the frees and reports go alone, then each entry alone; the requests refused again fail."""
        scheduler = self.scheduler
        frees, written = carried or (scheduler.take_pending_frees(), scheduler.take_written_reports())
        prefix_caching = self.config.enable_prefix_caching
        try:
            return await self.kvmanager.allocate(pool_id, session_id, frees, plan, prefix_caching, written, self.store)
        except DependencyError as exc:
            if not exc.refused:
                raise
            log.error("allocate_refused", executor=self.address, reason=str(exc), num_seqs=len(plan))
        try:
            await self.kvmanager.free(pool_id, session_id, frees, written, self.store)
        except DependencyError as exc:  # our own bookkeeping is refused: start the session afresh
            raise KVStateLost(f"kvmanager refused this gateway's frees: {exc}") from exc
        results, usage = [], 0.0
        for entry in plan:
            if entry.seq.request.finished:
                results.append(AllocationResult(ok=False))  # its request failed: skipped by apply_allocation
                continue
            try:
                (result,), usage = await self.kvmanager.allocate(pool_id, session_id, [], [entry], prefix_caching,
                                                                 store=self.store)
            except DependencyError as exc:
                if not exc.refused:
                    raise
                scheduler.fail_refused([entry], refusal("kvmanager", exc))
                result = AllocationResult(ok=False)
            results.append(result)
        return results, usage

    async def _execute(self, ready: list[ScheduledSeq]) -> tuple[list[ScheduledSeq], ExecuteOutput]:
        """One Execute. When the executor refuses it (a refused Execute writes nothing),
        each request's entries run alone; the requests refused again fail. Entries the
        executor dropped (a store load missed) are preempted. Returns the entries that ran
        and their output."""
        try:
            return self._without_dropped(ready, await self._execute_once(ready))
        except DependencyError as exc:
            if not exc.refused:
                raise
            log.error("execute_refused", executor=self.address, reason=str(exc), num_seqs=len(ready))
        by_request: dict[int, list[ScheduledSeq]] = {}
        for entry in ready:
            by_request.setdefault(id(entry.seq.request), []).append(entry)
        ran: list[ScheduledSeq] = []
        sampled, forward_s, total_s, prompt_logprobs = [], 0.0, 0.0, {}
        for entries in by_request.values():
            try:
                output = await self._execute_once(entries)
            except DependencyError as exc:
                if not exc.refused:
                    raise
                self.scheduler.fail_refused(entries, refusal("executor", exc))
                continue
            entries, output = self._without_dropped(entries, output)
            ran += entries
            sampled += output.sampled
            forward_s += output.forward_s
            total_s += output.total_s
            prompt_logprobs |= output.prompt_logprobs
        return ran, ExecuteOutput(sampled, forward_s, total_s, prompt_logprobs=prompt_logprobs)

    def _without_dropped(self, entries: list[ScheduledSeq], output: ExecuteOutput,
                         ) -> tuple[list[ScheduledSeq], ExecuteOutput]:
        if not output.dropped_seq_ids:
            return entries, output
        dropped = [e for e in entries if e.seq_id in output.dropped_seq_ids]
        log.warning("store_loads_missed", executor=self.address, num_seqs=len(dropped))
        self.scheduler.drop_unloaded(dropped)
        return [e for e in entries if e.seq_id not in output.dropped_seq_ids], output

    async def _execute_once(self, entries: list[ScheduledSeq]) -> ExecuteOutput:
        timeout = self.deadline.for_step(sum(e.num_tokens for e in entries))
        self.num_executes += 1
        orders = self.store.take_orders()
        try:
            output = await self.executor.execute(entries, timeout=timeout, store_orders=orders,
                                                 instance_id=self.info.instance_id if self.info else "")
        except DependencyError as exc:
            if exc.refused:
                self.store.not_executed(orders)
            if exc.status is grpc.StatusCode.DEADLINE_EXCEEDED:
                raise Unavailable(f"executor at {self.address} did not finish a step within its "
                                  f"{timeout:.1f} s deadline (stopped or hung)") from exc
            raise
        self.store.executed(orders, list(output.store_saves_ok), list(output.store_missing_hashes))
        if output.instance_id and self.info is not None and output.instance_id != self.info.instance_id:
            raise ExecutorRestarted(f"executor restarted at {self.address} (instance {self.info.instance_id} "
                                    f"is now {output.instance_id}): recomputing its sequences")
        return output

    async def flush_frees(self) -> None:
        """Idle: free what finished in the last step and report what it wrote and what became of
        the store operations, and carry out the store orders that gives rise to (nothing else
        will carry them; deletes give rise to no new orders, so this ends)."""
        for _ in range(4):
            frees, written = self.scheduler.take_pending_frees(), self.scheduler.take_written_reports()
            if not (frees or written[0] or self.store.report) or self._session_id is None:
                return
            try:
                await self.kvmanager.free(self.pool_id, self._session_id, frees, written, self.store)
            except DependencyError as exc:
                log.warning("free_failed", executor=self.address, reason=str(exc), seq_ids=len(frees))
                self.connection_lost(f"free failed: {exc}")
                return
            if not self.store.orders:
                return
            try:
                await self._carry_store_orders()
            except Unavailable as exc:
                self.connection_lost(f"a step of store operations failed: {exc}")
                return

    async def _carry_store_orders(self) -> None:
        """An Execute of no entries for store orders no step of work will carry (their saves hold
        blocks until they are reported). A refusal reports the saves failed, which frees them too."""
        try:
            await self._execute_once([])
        except DependencyError as exc:
            if not exc.refused:
                raise
            log.error("store_step_refused", executor=self.address, reason=str(exc))


def refusal(service: str, exc: DependencyError) -> StepRefused:
    return StepRefused(f"the {service} refused a step with this request ({exc.status.name}: {exc.details}); "
                       "the request failed, others go on")
