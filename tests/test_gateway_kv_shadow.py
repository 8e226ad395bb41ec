"""The gateway's real engine and step loop (``Engine`` routing and migration,
``Backend._step``: scheduler, preemption, forks, written-KV reports, refused steps,
executor restarts and outages) driven against the real kvmanager domain, with one
or two shadow executors as the oracle.

The shadow executor keeps, per KV slot, the token id written there and whether it
was written with a valid context. Every Execute first checks that each position a
sequence attends to (``[0, start_position)`` through its block table) holds that
sequence's own token, validly written, then writes its tokens. It samples a
token from what it *read* (a function of every position's token), so a prefix hit
on KV nobody wrote shows as a failed read or as output that differs from the
reference computed from the prompt alone. Hypothesis drives submits, aborts,
steps, refused requests, executor restarts, executors becoming unreachable (their
requests move to the other executor, or wait for this one), another session holding
blocks and prefix-cache resets on tiny pools. Requests belong to tenants (one with a
quota, one with twice the weight) that may mark their system prompt shareable, with
cache TTLs and a low priority, while pins come and go: a hit is always the request's
own tenant's block or in its shared range, a pinned block stays cached.

With the store tier on (a shadow store both executors share, of a few blocks' capacity),
loads copy the saved slots back and saves copy them out, so a load of an entry that holds
other KV shows as a wrong read; entries lost behind kvmanager's back and saves that fail
must cost a recompute, never a wrong token.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
from types import SimpleNamespace

import grpc
import pytest
from collections import Counter

from hypothesis import HealthCheck, seed, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, run_state_machine_as_test

from gateway.clients import DependencyError, ExecuteOutput, ExecutorInfo
from gateway.detokenizer import ModelTokenizer
from gateway.engine import Engine, EngineConfig
from gateway.metrics import GatewayMetrics
from gateway.scheduler import AllocationResult, RequestTooLarge, SampledToken, SchedulerConfig
from gateway.sequence import FinishReason, PromptTokenLogprob, SamplingOptions
from gateway.stopping import suppressed_token_ids
from kvmanager.manager import KVManager, StoreConfig
from kvmanager.pool import AllocationRequest, PoolConfig
from kvserve.errors import KVServeError, StepRefused, Unavailable
from kvserve.identity import tokenizer_fingerprint
from tests.kvmanager_support import PinRules, check_invariants, key_tokens

POOL_ID = "shadow-pool"
FIRST_TOKEN = 300  # ids the fake samples from: plain text tokens of the real tokenizer
NUM_SAMPLED = 13
PREFIXES = [[], [400] * 8, list(range(410, 422)), list(range(410, 418)) + [450, 451]]
TENANTS = ["", "", "acme", "globex"]  # the default tenant twice as often; acme has a quota, globex twice the weight
SHADOW_SEED = int(os.environ.get("KVSERVE_SHADOW_SEED", "0"))  # another seed (and more examples) explores other runs
SHADOW_EXAMPLES = int(os.environ.get("KVSERVE_SHADOW_EXAMPLES", "300"))
prompts = st.builds(lambda head, tail: head + tail, st.sampled_from(PREFIXES),
                    st.lists(st.integers(500, 502), min_size=1, max_size=10))


def next_token(context: list[int], choice_seed: int) -> int:
    """What the fake model samples after ``context``: depends on every position."""
    return FIRST_TOKEN + (sum((i + 1) * t for i, t in enumerate(context)) + choice_seed) % NUM_SAMPLED


def copying_next_token(context: list[int], choice_seed: int) -> int:
    """A fake model that mostly copies (what followed the last token's previous occurrence, as
    prompt lookup guesses), else samples like ``next_token``: drafts are often right, often wrong.
    Still a function of every position."""
    h = sum((i + 1) * t for i, t in enumerate(context)) + choice_seed
    if h % 4:
        last = context[-1]
        for i in range(len(context) - 2, -1, -1):
            if context[i] == last:
                return context[i + 1]
    return FIRST_TOKEN + h % NUM_SAMPLED


def prompt_score(prefix: list[int], token: int) -> float:
    """What the fake model reports as the log-probability of ``token`` after ``prefix``: a function
    of every position, so a score computed over the wrong KV is a wrong score."""
    return -((sum((i + 3) * t for i, t in enumerate(prefix)) * 7 + token) % 997) / 100


def reference_output(prompt: list[int], max_tokens: int, choice_seed: int, model=next_token) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(model(tokens, choice_seed))
    return tokens[len(prompt):]


def rpc_error(exc: KVServeError) -> DependencyError:
    code = getattr(grpc.StatusCode, exc.code)
    return DependencyError("kvmanager", "in-process", grpc.aio.AioRpcError(
        code, grpc.aio.Metadata(), grpc.aio.Metadata(), str(exc)))


class InProcessKVManager:
    """``gateway.kvmanager_client.KVManagerClient``'s interface over the real ``KVManager`` domain."""

    def __init__(self, manager: KVManager, seen: Counter):
        self.seen = seen
        self.manager = manager
        self.violations: list[str] = []  # checks of kvmanager's answers that failed

    async def _call(self, fn, *args):
        try:
            return fn(*args)
        except KVServeError as exc:
            raise rpc_error(exc) from exc

    async def register_pool(self, pool_id, info, enable_prefix_caching, kv_allocation):
        config = PoolConfig(pool_id, info.num_blocks, info.block_size, info.model_fingerprint, enable_prefix_caching,
                            max_model_len=info.max_model_len)
        store = StoreConfig(info.kv_store, info.kv_store_namespace, info.kv_store_capacity_blocks, "SHADOW")
        return await self._call(self.manager.register_pool, config, info.instance_id, "", store)

    async def open_session(self, pool_id, ttl_ms, client_name):
        session = await self._call(self.manager.open_session, pool_id, ttl_ms, client_name)
        return session.session_id, session.ttl_ms

    async def close_session(self, session_id, timeout=None):
        return await self._call(self.manager.close_session, session_id)

    async def reset_prefix_cache(self, pool_id):
        return await self._call(self.manager.reset_prefix_cache, pool_id)

    async def _with_store(self, fn, pool_id, session_id, store, *args):
        """A call carrying the store report, its store orders kept for the next Execute (as the client does)."""
        report = store.take_report() if store is not None else None
        try:
            out = await self._call(fn, pool_id, session_id, *args, report)
        except DependencyError:
            if report:
                store.give_back_report(report)
            raise
        orders = self.manager.take_store_orders(pool_id, session_id)
        if store is not None and orders is not None:
            store.orders.extend(orders)
        return out

    async def allocate(self, pool_id, session_id, free_seq_ids, plan, prefix_caching, written=((), ()), store=None):
        requests = [AllocationRequest(e.seq_id, list(e.new_token_ids), e.num_new_tokens,
                                      prefix_caching and e.seq.request.options.enable_prefix_caching,
                                      e.seq.request.options.cache_salt, num_lookahead_slots=e.num_lookahead_slots,
                                      tenant=e.seq.request.options.tenant,
                                      num_shared_tokens=e.seq.request.options.num_shared_tokens,
                                      cache_ttl_ms=e.seq.request.options.cache_ttl_ms,
                                      cache_priority=int(e.seq.request.options.cache_priority_low),
                                      num_precomputed_tokens=e.num_precomputed_tokens)
                    for e in plan]
        results, usage = await self._with_store(self.manager.allocate, pool_id, session_id, store,
                                                list(free_seq_ids), requests, *written)
        self._check_hits_are_the_tenants_own(self.manager.pools[pool_id], results)
        for entry, result in zip(plan, results):
            # Asked for less than its prompt, it computed the rest: the scheduler planned the hit.
            if result.ok and result.num_cached_tokens and entry.num_new_tokens < entry.seq.num_sendable() == \
                    result.start_position + result.num_tokens:
                self.seen.update(["a prompt planned after its expected hit"])
        return [AllocationResult(r.ok, r.num_cached_tokens, r.start_position, r.num_tokens, r.block_table_offset,
                                 list(r.block_table), list(r.copy_src), list(r.copy_dst), r.num_store_tokens,
                                 list(r.store_load_block_ids), list(r.store_load_hashes)) for r in results], usage

    def _check_hits_are_the_tenants_own(self, pool, results) -> None:
        for result in results:
            if not (result.ok and result.num_cached_tokens):
                continue
            seq = pool.sequences[result.seq_id]
            for i, block in enumerate(seq.block_table[:result.num_cached_tokens // pool.block_size]):
                if block.block_hash is None:
                    continue  # a later admission of the same call expired its TTL: whose it was is gone
                shared = i < seq.extras.num_shared_blocks
                if block.owner is not (seq.shared_owner if shared else seq.owner):
                    # Raised here, it would be an error of the step, which the gateway recomputes.
                    self.violations.append(f"a block of {block.owner.name} hit by {seq.owner.name}")
                if shared:
                    self.seen.update(["a hit in the shared range"])

    async def lookup_prefix(self, pool_ids, token_ids, cache_salt="", timeout=1.0, tenant="", num_shared_tokens=0):
        query = SimpleNamespace(token_ids=list(token_ids), cache_salt=cache_salt, adapter_id="", tenant=tenant,
                                num_shared_tokens=num_shared_tokens)
        (matches,) = await self._call(self.manager.lookup_prefix, pool_ids, [query])
        return dict(matches)

    async def fork(self, pool_id, session_id, parent, children):
        return await self._call(self.manager.fork, pool_id, session_id, parent, children)

    async def free(self, pool_id, session_id, seq_ids, written=((), ()), store=None):
        return await self._with_store(self.manager.free, pool_id, session_id, store, list(seq_ids), *written)

    async def close(self):
        pass


class ShadowKVExecutor:
    """``gateway.clients.ExecutorClient``'s interface over a KV store of token ids."""

    def __init__(self, name: str, num_blocks: int, block_size: int, fingerprint: str, refused_requests: set[str],
                 store: dict | None = None, store_capacity: int = 0, model=next_token, verifies_drafts: bool = False,
                 max_batched_tokens: int | None = None):
        self.model = model
        self.max_batched_tokens = max_batched_tokens  # what one step may compute (the scheduler's budget)  # what it samples after a context (greedy: drafts are verified against it)
        self.verifies_drafts = verifies_drafts
        self.store = store  # hash -> a block's slots as saved; shared by the executors
        self.store_capacity = store_capacity
        self.fail_saves = False
        self.name = name
        self.down = False
        self.num_blocks, self.block_size = num_blocks, block_size
        self.slots: list[list[tuple[int, bool] | None]] = []
        self.instance = itertools.count()
        self.fingerprint = fingerprint
        self.refused_requests = refused_requests
        self.num_reads = 0
        self.drafts_short_of_min_tokens = 0  # drafted steps whose every sampled position had EOS suppressed
        self.violations: list[str] = []  # the shadow's own checks that failed inside a step
        self.restart()

    def restart(self) -> None:
        self.slots = [[None] * self.block_size for _ in range(self.num_blocks)]
        self.restarts = next(self.instance)
        self.instance_id = f"{self.name}-instance-{self.restarts}"
        self.fresh = True  # until the first Execute, whose output the gateway must drop

    def _check_up(self) -> None:
        if self.down:
            raise DependencyError("executor", self.name, grpc.aio.AioRpcError(
                grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "connection refused"))

    async def describe(self) -> ExecutorInfo:
        self._check_up()
        self.fresh = False
        store = dict(kv_store="shadow://store", kv_store_namespace="ns", kv_store_capacity_blocks=self.store_capacity) \
            if self.store is not None else {}
        return ExecutorInfo("shadow", "shadow-model", "float32", "cpu", "shadow", self.block_size,
                            self.num_blocks, 256, 49152, (2,), self.instance_id, self.fingerprint, **store,
                            verifies_draft_tokens=self.verifies_drafts,
                            verifies_drafts_with_suppressed_tokens=self.verifies_drafts,
                            returns_prompt_logprobs=True)

    def _refuse(self, status: grpc.StatusCode, message: str) -> DependencyError:
        return DependencyError("executor", "in-process", grpc.aio.AioRpcError(
            status, grpc.aio.Metadata(), grpc.aio.Metadata(), message))

    async def execute(self, ready, timeout=None, store_orders=None, instance_id="") -> ExecuteOutput:
        try:
            return await self._execute(ready, store_orders, instance_id)
        except AssertionError as exc:  # the gateway would take it for a failed step and recompute: keep it
            self.violations.append(str(exc))
            raise

    async def _execute(self, ready, store_orders, instance_id) -> ExecuteOutput:
        self._check_up()
        if store_orders and instance_id and instance_id != self.instance_id:
            raise self._refuse(grpc.StatusCode.ABORTED, "expected_instance_id: this instance restarted")
        if any(e.seq.request.request_id in self.refused_requests for e in ready):
            raise self._refuse(grpc.StatusCode.INVALID_ARGUMENT, "sequences[0].token_ids: refused")
        bs = self.block_size
        garbage = self.fresh  # restarted since the gateway last described it: reads are garbage
        dropped, missing = set(), []
        for entry in ready:  # store loads first; a sequence whose load misses is not run
            loads = list(zip(entry.store_load_block_ids, entry.store_load_hashes))
            absent = [h for _, h in loads if h not in self.store]
            if absent:
                dropped.add(entry.seq_id)
                missing += absent
                continue
            for block_id, h in loads:
                self.slots[block_id] = list(self.store[h])
        for h in store_orders.delete_hashes if store_orders else ():
            self.store.pop(h, None)
        for entry in ready:
            for src, dst in entry.copies:
                self.slots[dst] = list(self.slots[src])
        computed_in_step = sum(e.num_tokens for e in ready)
        assert self.max_batched_tokens is None or computed_in_step <= self.max_batched_tokens, (
            f"a step computes {computed_in_step} tokens, its budget is {self.max_batched_tokens}")
        sampled, prompt_logprobs = [], {}
        for entry in ready:
            if entry.seq_id in dropped:
                continue
            table = entry.seq.block_table
            context = []
            for pos in range(entry.start_position):
                slot = self.slots[table[pos // bs]][pos % bs]
                if not garbage:
                    assert slot is not None and slot[1], f"position {pos} of {entry.seq_id} was never written: {slot}"
                    assert slot[0] == entry.seq.token_ids[pos], (
                        f"seq {entry.seq_id} position {pos} attends to token {slot[0]}, "
                        f"its token is {entry.seq.token_ids[pos]}")
                context.append(slot[0] if slot else -1)
            self.num_reads += entry.start_position
            computed = entry.compute_token_ids()
            drafts = list(entry.draft_token_ids)
            assert not drafts or (self.verifies_drafts and entry.sample and len(computed) == 1), "unverifiable drafts"
            if drafts and suppressed_token_ids(entry.seq):
                # One suppression list holds for every row: each position the step samples is short of min_tokens.
                assert entry.seq.num_output_tokens + len(drafts) < entry.seq.request.options.min_tokens, \
                    "drafts reach past min_tokens while EOS is suppressed"
                self.drafts_short_of_min_tokens += 1
            targets = entry.prompt_logprob_token_ids()
            if targets:
                seq, start = entry.seq, entry.start_position
                assert start + len(targets) < seq.num_prompt_tokens and not drafts, "scores past the prompt"
                assert targets == seq.token_ids[start + 1:start + 1 + len(targets)], "names other tokens than next"
                rows = context + computed
                prompt_logprobs[entry.seq_id] = [PromptTokenLogprob(prompt_score(rows[:start + i + 1], t), [])
                                                 for i, t in enumerate(targets)]
            for i, token in enumerate(computed + drafts):  # a draft's KV is written, right or wrong
                pos = entry.start_position + i
                assert pos // bs < len(table), f"seq {entry.seq_id} writes position {pos} past its blocks"
                self.slots[table[pos // bs]][pos % bs] = (token, not garbage)
            if entry.sample:
                options = entry.seq.request.options
                sampled.append(self._verify(context + computed, drafts, (options.seed or 0) + entry.seq.index))
        saves_ok = []
        if store_orders:
            for block_id, h in zip(store_orders.save_block_ids, store_orders.save_hashes):
                if not self.fail_saves:
                    self.store[h] = list(self.slots[block_id])
                saves_ok.append(not self.fail_saves)
        return ExecuteOutput(sampled, 0.0, 0.0, self.instance_id, frozenset(dropped), tuple(missing), tuple(saves_ok),
                             prompt_logprobs)

    def _verify(self, context: list[int], drafts: list[int], choice_seed: int) -> SampledToken:
        """Greedy verification: drafts are accepted while each is what the model picks after the
        ones before it; then the model's own pick."""
        pick = self.model(context, choice_seed)
        accepted = 0
        for draft in drafts:
            if draft != pick:
                break
            context = context + [draft]
            accepted += 1
            pick = self.model(context, choice_seed)
        tokens = drafts[:accepted] + [pick]
        return SampledToken(tokens[0], num_accepted_drafts=accepted, next_tokens=[SampledToken(t) for t in tokens[1:]])

    async def close(self):
        pass


class GatewayKVMachine(RuleBasedStateMachine):
    tokenizer: ModelTokenizer = None
    seen: Counter = Counter()  # what the runs exercised, over all examples

    @initialize(block_size=st.sampled_from([1, 2, 4]), num_blocks=st.integers(6, 40),
                max_num_seqs=st.integers(1, 6), max_batched=st.integers(4, 40), num_executors=st.sampled_from([1, 2]),
                routing=st.sampled_from(["kv", "round-robin"]))
    def setup(self, block_size, num_blocks, max_num_seqs, max_batched, num_executors, routing):
        self.configure(block_size, num_blocks, max_num_seqs, max_batched, num_executors, routing)

    model = staticmethod(next_token)  # the shadow executors' model

    def configure(self, block_size, num_blocks, max_num_seqs, max_batched, num_executors, routing, store_capacity=0,
                  save_policy="all", speculative: dict | None = None):
        self.loop = asyncio.new_event_loop()
        self.manager = KVManager(default_session_ttl_ms=10**7, store_save_policy=save_policy)
        self.manager.governance.set_policy("acme", 1.0, 3, 2)
        self.manager.governance.set_policy("globex", 2.0, 0, 0)
        self.pins: dict[int, dict[str, set[int]]] = {}  # pin id -> pool id -> block ids held at the last check
        fingerprint = tokenizer_fingerprint(self.tokenizer.model_dir)
        refused: set[str] = set()
        self.store = {} if store_capacity else None  # the store tier, shared by the executors
        self.lost_store_hashes: set[bytes] = set()  # entries removed behind kvmanager's back
        self.executors = {f"shadow-{i}:1": ShadowKVExecutor(f"shadow-{i}", num_blocks, block_size, fingerprint, refused,
                                                            self.store, store_capacity, self.model,
                                                            verifies_drafts=bool(speculative),
                                                            max_batched_tokens=max_batched)
                          for i in range(num_executors)}
        self.executor = next(iter(self.executors.values()))
        config = EngineConfig(pool_id=POOL_ID, executor_address=",".join(self.executors), routing=routing,
                              session_ttl_ms=10**7, unavailable_timeout_s=10**6, scheduler=SchedulerConfig(
                                  max_num_seqs=max_num_seqs, max_num_batched_tokens=max_batched,
                                  **(speculative or {})))
        self.pool_ids = {address: config.pool_id_for(address) for address in self.executors}
        self.engine = self.run(self._make_engine(config))
        self.failures = 0
        self.streams = {}
        self.expected = {}
        self.prompt_scores = {}  # request id -> its prompt's scores, for those that asked
        self.lengths = {}
        self.restarts_seen = {}
        self.ids = itertools.count()
        self.other_session = None

    async def _make_engine(self, config):
        engine = Engine(config, self.tokenizer, GatewayMetrics("shadow"))
        await engine.kvmanager.close()
        engine.kvmanager = InProcessKVManager(self.manager, self.seen)
        for address, backend in engine.backends.items():
            await backend.executor.close()
            backend.kvmanager, backend.executor = engine.kvmanager, self.executors[address]
        return engine

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    @property
    def pool(self):
        """The first executor's pool (the one another gateway shares)."""
        return self.manager.pools.get(self.pool_ids[self.executor.name + ":1"])

    @rule(prompt=prompts, max_tokens=st.integers(1, 6), n=st.sampled_from([1, 1, 2]),
          salt=st.sampled_from(["", "", "tenant"]), seed=st.sampled_from([None, 7]))
    def submit(self, prompt, max_tokens, n, salt, seed, tenant="", share=False, ttl_ms=0, low_priority=False,
               min_tokens=0):
        shared = next((len(p) for p in PREFIXES[1:] if prompt[:len(p)] == p), 0) if share else 0
        # Prompt scoring (echo with logprobs) on a share of the requests, without a draw of its own;
        # a third of those ask for the prompt alone (max_tokens 0).
        scored = seed == 7 and salt == "tenant"
        if scored and max_tokens == 1 and n == 1:
            max_tokens = 0
        options = SamplingOptions(max_tokens=max_tokens, n=n, cache_salt=salt, seed=seed, ignore_eos=True,
                                  tenant=tenant, num_shared_tokens=shared, cache_ttl_ms=ttl_ms,
                                  cache_priority_low=low_priority, min_tokens=min_tokens,
                                  prompt_logprobs=0 if scored else None, enable_prefix_caching=not scored)
        request_id = f"r{next(self.ids)}"
        try:
            stream = self.run(self.engine.submit(prompt, options, request_id))
        except Unavailable as exc:  # nothing can serve: 503 at once
            assert all(executor.down for executor in self.executors.values()), exc
            self.seen.update(["refused: no executor up"])
            return
        except KVServeError as exc:  # a prompt that can never fit this pool: a clear 4xx
            assert any(reason in str(exc) for reason in ("KV slots", "max_model_len", "max_num_seqs")), exc
            self.seen.update(["refused at the edge"])
            return
        self.streams[request_id] = stream
        self.restarts_seen[request_id] = self.failures
        self.expected[request_id] = [reference_output(prompt, max_tokens, (seed or 0) + i, self.model)
                                     for i in range(n)]
        self.lengths[request_id] = len(prompt) + max_tokens
        if scored:
            self.prompt_scores[request_id] = [prompt_score(prompt[:p], prompt[p]) for p in range(1, len(prompt))]

    @rule(steps=st.integers(1, 4))
    def step(self, steps):
        for _ in range(steps):
            self.run(self._step())

    async def _step(self):
        for backend in self.engine.backends.values():
            if not backend.is_up:
                with contextlib.suppress(Unavailable):
                    await backend.connect()
        await self.engine.dispatch()
        for backend in self.engine.backends.values():
            if backend.is_up:
                await backend.run_step()
                await backend.flush_frees()

    @precondition(lambda self: self.streams)
    @rule(data=st.data())
    def abort(self, data):
        self.engine.abort(data.draw(st.sampled_from(sorted(self.streams))))

    @precondition(lambda self: self.streams)
    @rule(data=st.data())
    def refuse_request(self, data):
        """The executor refuses every step this request is in (it fails alone)."""
        self.executor.refused_requests.add(data.draw(st.sampled_from(sorted(self.streams))))

    @rule(which=st.integers(0, 1))
    def restart_executor(self, which):
        executors = list(self.executors.values())
        executors[which % len(executors)].restart()
        self.failures += 1

    @rule(which=st.integers(0, 1), down=st.booleans())
    def executor_unreachable(self, which, down):
        """An executor stops answering (its requests move to the other one) or comes back."""
        executors = list(self.executors.values())
        executors[which % len(executors)].down = down
        self.failures += down

    @precondition(lambda self: self.pool is not None)
    @rule(prompt=prompts, written=st.booleans())
    def other_gateway_holds_blocks(self, prompt, written):
        """Another gateway's session allocates (and maybe executes, its store loads first) a prompt
        on the pool, then stops: its blocks stay held until its lease would run out."""
        if self.other_session is None:
            self.other_session = self.manager.open_session(self.pool.config.pool_id).session_id
        seq_id = 10**12 + next(self.ids)
        try:
            results, _ = self.manager.allocate(self.pool.config.pool_id, self.other_session, [], [AllocationRequest(
                seq_id, prompt, len(prompt))])
        except KVServeError:
            return
        loads = list(zip(results[0].store_load_block_ids, results[0].store_load_hashes))
        if results[0].ok and written and all(h in self.store for _, h in loads):
            for block_id, h in loads:
                self.executor.slots[block_id] = list(self.store[h])
            table = list(results[0].block_table)
            bs = self.executor.block_size
            for pos in range(results[0].start_position, len(prompt)):
                self.executor.slots[table[pos // bs]][pos % bs] = (prompt[pos], True)
            self.manager.free(self.pool.config.pool_id, self.other_session, [], [seq_id], [len(prompt)])

    @precondition(lambda self: self.pool is not None)
    @rule()
    def reset_prefix_cache(self):
        self.manager.reset_prefix_cache(self.pool.config.pool_id)

    @precondition(lambda self: self.store)
    @rule(data=st.data())
    def lose_store_entries(self, data):
        """Entries vanish behind kvmanager's back (a wiped volume, Redis's own eviction, a corrupt file)."""
        for h in data.draw(st.lists(st.sampled_from(sorted(self.store)), min_size=1, unique=True)):
            del self.store[h]
            self.lost_store_hashes.add(h)

    @precondition(lambda self: self.store is not None)
    @rule(fail=st.booleans())
    def store_saves_fail(self, fail):
        """The store refuses writes (disk full, server down) or takes them again."""
        for executor in self.executors.values():
            executor.fail_saves = fail

    @invariant()
    def no_step_broke_the_shadow_executor_s_checks(self):
        """A step the shadow executor found wrong (unwritten KV read, a write past the blocks,
        unverifiable drafts) fails in the gateway, which recomputes; the violation must still fail the
        test. So must a hit on another tenant's block, found in kvmanager's answer."""
        for executor in getattr(self, "executors", {}).values():
            assert not executor.violations, executor.violations[0]
        if hasattr(self, "engine"):
            assert not self.engine.kvmanager.violations, self.engine.kvmanager.violations[0]

    @invariant()
    def findable_store_entries_hold_their_tokens(self):
        """An entry kvmanager's store index finds holds, validly written, the tokens of its key."""
        for index in getattr(self, "manager", SimpleNamespace(stores={})).stores.values():
            for h, key in index.entries.items():
                if h in self.store:  # one lost behind kvmanager's back is a miss when loaded
                    expected = [(t, True) for t in key_tokens(key, self.executor.block_size)]
                    assert self.store[h] == expected, f"findable store entry {h.hex()} holds other KV"

    @invariant()
    def evictions_never_cut_a_stored_chain(self):
        """A findable entry's parent is findable too, or is the chain's root: a chain is looked up
        from its first block, so evicting a parent before its children leaves them unreachable. Only
        an entry lost behind kvmanager's back (then missed by a load) may leave children behind."""
        manager = getattr(self, "manager", SimpleNamespace(stores={}, pools={}))
        roots = {pool.root_hash for pool in manager.pools.values()}
        for index in manager.stores.values():
            for h, key in index.entries.items():
                parent = key[:16]
                assert parent in roots or parent in index.entries or parent in self.lost_store_hashes, \
                    f"store entry {h.hex()} outlived its parent {parent.hex()}"

    @invariant()
    def findable_blocks_hold_their_tokens(self):
        if not hasattr(self, "manager"):
            return
        for address, executor in self.executors.items():
            pool = self.manager.pools.get(self.pool_ids[address])
            if pool is None or pool.executor_instance_id != executor.instance_id:
                continue  # kvmanager learns of a restart from the gateway's next step (Execute's instance_id)
            check_invariants(pool)
            for block in pool.block_pool.cached_blocks.values():
                expected = [(t, True) for t in key_tokens(block.block_key, pool.block_size)]
                assert executor.slots[block.block_id] == expected, f"findable block {block.block_id} holds other KV"

    def teardown(self):
        if not hasattr(self, "engine"):
            return
        for executor in self.executors.values():
            executor.down = False
        for _ in range(400):
            if not self.engine._live:
                break
            self.run(self._step())
        assert not self.engine._live, "requests stuck"
        self.no_step_broke_the_shadow_executor_s_checks()
        for request_id, stream in self.streams.items():
            self.check_outputs(request_id, stream)
        for address, backend in self.engine.backends.items():
            pool = self.manager.pools.get(self.pool_ids[address])
            if pool is not None and backend._session_id is not None:
                assert not pool.session_seq_ids.get(backend._session_id), "blocks leaked"
            self.seen.update({"decode steps overlapped with their Allocate": backend.num_overlapped_steps,
                              "prompt tokens loaded from the store": backend.scheduler.counters.store_hits,
                              "store loads that missed": backend.scheduler.counters.store_load_misses})
            counters = backend.scheduler.counters
            self.seen.update({"draft tokens accepted": counters.num_accepted_draft_tokens,
                              "draft tokens rejected": counters.num_draft_tokens - counters.num_accepted_draft_tokens})
            assert backend.num_mispredicted_steps == 0, "kvmanager answered a predicted decode step otherwise"
        self.seen.update({"drafted steps short of min_tokens": sum(e.drafts_short_of_min_tokens
                                                                   for e in self.executors.values())})
        self.loop.close()

    def most_blocks_pins_name(self) -> int:
        """The blocks the pins name in any one pool: at most that many are held from requests."""
        return max((sum(len(pin.hashes) for pin in pool.pins.pins.values()) for pool in self.manager.pools.values()),
                   default=0)

    def check_outputs(self, request_id, stream):
        outputs = []
        while not stream.queue.empty():
            outputs.append(stream.queue.get_nowait())
        assert outputs and outputs[-1].finished, f"{request_id} never finished"
        error = outputs[-1].error
        if isinstance(error, RequestTooLarge):  # longer than the pool, or the other gateway's blocks are in the way
            usable = (self.executor.num_blocks - 1 - self.most_blocks_pins_name()) * self.executor.block_size
            assert self.other_session is not None or self.lengths[request_id] > usable, error
            self.seen.update(["cannot fit beside the other gateway's blocks"])
            return
        assert error is None or (isinstance(error, StepRefused) and request_id in self.executor.refused_requests), error
        tokens: dict[int, list[int]] = {}
        reasons = {}
        scores = {}  # choice index -> the prompt scores on its first delta
        for output in outputs:
            for choice in output.choices:
                tokens.setdefault(choice.index, []).extend(choice.token_ids)
                reasons[choice.index] = choice.finish_reason or reasons.get(choice.index)
                if choice.prompt_logprobs is not None:
                    assert choice.index not in scores, f"{request_id}: prompt scores on two deltas"
                    scores[choice.index] = [s.logprob for s in choice.prompt_logprobs]
        for index, expected in enumerate(self.expected[request_id]):
            got = tokens.get(index, [])
            if error is not None or reasons.get(index) is FinishReason.ABORT:  # cut short: what came is right
                assert got == expected[:len(got)], f"{request_id} choice {index}: {got} is not a prefix of {expected}"
                self.seen.update(["refused request failed alone" if error else "aborted"])
                continue
            assert got == expected, f"{request_id} choice {index}: {got} != {expected}"
            if request_id in self.prompt_scores:
                assert scores.get(index) == self.prompt_scores[request_id], (
                    f"{request_id} choice {index}: prompt scores {scores.get(index)} != "
                    f"{self.prompt_scores[request_id]}")
                assert not outputs[-1].cached_tokens, f"{request_id}: a scored prompt hit the cache"
                self.seen.update(["prompt scored" if expected else "prompt scored alone (max_tokens 0)"])
            if outputs[-1].cached_tokens:
                self.seen.update(["finished after a prefix hit"])
            if self.restarts_seen.get(request_id, 0) != self.failures:
                self.seen.update(["finished across an executor failure"])
                if len(self.executors) > 1:
                    self.seen.update(["finished across a failure with two executors"])
            self.seen.update(["finished with the reference output"])


class GatewayKVStoreMachine(GatewayKVMachine):
    """The same machine with the store tier always on: a shadow store both executors share, of
    3 to 64 blocks, under either save policy."""

    seen: Counter = Counter()

    @initialize(block_size=st.sampled_from([1, 2, 4]), num_blocks=st.integers(6, 40),
                max_num_seqs=st.integers(1, 6), max_batched=st.integers(4, 40), num_executors=st.sampled_from([1, 2]),
                routing=st.sampled_from(["kv", "round-robin"]), store_capacity=st.sampled_from([3, 8, 64]),
                save_policy=st.sampled_from(["all", "free"]))
    def setup(self, block_size, num_blocks, max_num_seqs, max_batched, num_executors, routing, store_capacity,
              save_policy):
        self.configure(block_size, num_blocks, max_num_seqs, max_batched, num_executors, routing, store_capacity,
                       save_policy)


class GatewayKVSpecMachine(GatewayKVMachine):
    """The same machine with prompt-lookup speculative decoding on, against a fake model that
    mostly copies: drafts are accepted and rejected, their KV written into lookahead slots; no
    rejected draft's KV may ever be read as a token's (shadow reads) or be findable (invariant)."""

    seen: Counter = Counter()
    model = staticmethod(copying_next_token)

    @initialize(block_size=st.sampled_from([1, 2, 4]), num_blocks=st.integers(6, 40),
                max_num_seqs=st.integers(1, 6), max_batched=st.integers(4, 40), num_executors=st.sampled_from([1, 2]),
                routing=st.sampled_from(["kv", "round-robin"]), num_speculative=st.integers(1, 5),
                budget=st.sampled_from([3, 8, 64]))
    def setup(self, block_size, num_blocks, max_num_seqs, max_batched, num_executors, routing, num_speculative,
              budget):
        self.configure(block_size, num_blocks, max_num_seqs, max_batched, num_executors, routing, speculative=dict(
            speculative_decoding="prompt-lookup", num_speculative_tokens=num_speculative,
            speculative_token_budget=budget))

    @rule(prompt=prompts, max_tokens=st.integers(4, 14), n=st.sampled_from([1, 1, 1, 2]),
          salt=st.sampled_from(["", "", "tenant"]), seed=st.sampled_from([None, 7]),
          min_tokens=st.sampled_from([0, 0, 3, -1]))
    def submit_long(self, prompt, max_tokens, n, salt, seed, min_tokens):
        """Longer outputs: room for drafts to be accepted several steps in a row; some short of
        ``min_tokens`` for a while (-1: all of them, a fixed-length request), drafting only as far
        as EOS stays suppressed."""
        self.submit(prompt, max_tokens, n, salt, seed, min_tokens=max_tokens if min_tokens < 0 else min_tokens)


class GatewayKVTenantMachine(PinRules, GatewayKVMachine):
    """The same machine with requests of several tenants (one with a quota, one with twice the
    weight) that may mark their system prompt shareable, cache TTLs and a low priority, and pins
    coming and going: every hit is the request's own tenant's block or in its shared range (checked
    at each Allocate), a pinned block stays held, and every output is still the reference."""

    seen: Counter = Counter()

    @rule(prompt=prompts, max_tokens=st.integers(1, 6), tenant=st.sampled_from(TENANTS),
          share=st.sampled_from([True, True, False]),
          ttl_ms=st.sampled_from([0] * 7 + [1]), low_priority=st.sampled_from([False, False, True]))
    def submit_as_tenant(self, prompt, max_tokens, tenant, share, ttl_ms, low_priority):
        self.submit(prompt, max_tokens, 1, "", None, tenant, share, ttl_ms, low_priority)

    @rule(tenant=st.sampled_from(TENANTS), prefix=st.sampled_from(PREFIXES[1:]), shared=st.booleans(),
          now=st.integers(0, 3))
    def pin(self, tenant, prefix, shared, now):
        """An admin pins a system prompt in every pool (a rare event: one draw in four); requests of
        that tenant compute it."""
        if now:
            return
        try:
            pin_id, _ = self.manager.governance.pin([], tenant, prefix, shared)
        except KVServeError as exc:  # over a quota, over half a pool, no full block: refused whole
            self.seen.update([f"pin refused: {type(exc).__name__}"])
            return
        self.pins[pin_id] = {}

    @invariant()
    def pinned_blocks_stay_held(self):
        if not hasattr(self, "manager"):
            return
        for pin_id, held_before in self.pins.items():
            for pool_id, pool in self.manager.pools.items():
                pin = pool.pins.pins.get(pin_id)
                if pin is None:
                    continue
                held = {block.block_id for block in pin.held.values()}
                if pool.pins.generation == held_before.get(pool_id, (None, set()))[0]:
                    before = held_before[pool_id][1]
                    assert before <= held, f"pin {pin_id} lost blocks {before - held} in {pool_id}"
                if held:
                    self.seen.update(["a pin holds blocks"])
                held_before[pool_id] = (pool.pins.generation, held)


def run_machine(machine: type[GatewayKVMachine], model_dir, minimum_seen: dict[str, int]) -> None:
    """``SHADOW_EXAMPLES`` runs of ``machine`` from ``SHADOW_SEED``; then what they exercised, which
    must reach ``minimum_seen``: the checks only mean something if the runs went where the bugs live.
    The seed is given: derandomized alone, the runs change with any edit of the machine's source."""
    machine.tokenizer = ModelTokenizer(model_dir)
    machine.seen = Counter()
    seed(SHADOW_SEED)(machine)
    run_state_machine_as_test(machine, settings=settings(
        max_examples=SHADOW_EXAMPLES, stateful_step_count=40, deadline=None, derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]))
    print(dict(machine.seen))
    for what, at_least in minimum_seen.items():
        assert machine.seen[what] >= at_least, (what, dict(machine.seen))


@pytest.mark.timeout(600)
def test_with_the_store_tier_no_load_brings_kv_other_than_the_prompt_s(default_model_dir):
    """Loads copy saved slots back, so a findable entry holding other KV is a wrong read; entries lost
    behind kvmanager's back and failing saves cost a recompute, never a wrong token."""
    run_machine(GatewayKVStoreMachine, default_model_dir, {
        "finished with the reference output": 100, "finished after a prefix hit": 10,
        "finished across an executor failure": 10, "prompt tokens loaded from the store": 20,
        "store loads that missed": 1})


@pytest.mark.timeout(600)
def test_gateway_and_kvmanager_never_attend_to_unwritten_kv(default_model_dir):
    run_machine(GatewayKVMachine, default_model_dir, {
        "finished with the reference output": 200, "finished after a prefix hit": 20,
        "a prompt planned after its expected hit": 10,
        "finished across an executor failure": 10, "finished across a failure with two executors": 10,
        "refused request failed alone": 10, "aborted": 10, "decode steps overlapped with their Allocate": 20,
        "prompt scored": 10, "prompt scored alone (max_tokens 0)": 5})


@pytest.mark.timeout(600)
def test_speculative_drafts_never_make_a_rejected_draft_s_kv_readable_or_findable(default_model_dir):
    run_machine(GatewayKVSpecMachine, default_model_dir, {
        "finished with the reference output": 200, "finished after a prefix hit": 10,
        "finished across an executor failure": 10, "draft tokens accepted": 100, "draft tokens rejected": 50,
        "decode steps overlapped with their Allocate": 20, "drafted steps short of min_tokens": 20})


@pytest.mark.timeout(600)
def test_tenants_only_ever_hit_their_own_kv_or_the_shared_range(default_model_dir):
    run_machine(GatewayKVTenantMachine, default_model_dir, {
        "finished with the reference output": 200, "finished after a prefix hit": 10,
        "a hit in the shared range": 3, "a pin holds blocks": 10, "finished across an executor failure": 10})


def test_decode_steps_overlap_and_a_kvmanager_answer_other_than_predicted_is_recomputed(default_model_dir):
    """Plain decode steps send Execute beside Allocate (the shadow executor runs before kvmanager
    has even seen the step). When kvmanager's answer is not the predicted one, nothing sampled in
    that step is kept: the backend drops its KV state and recomputes, and every request still
    ends with the reference tokens."""
    GatewayKVMachine.tokenizer = ModelTokenizer(default_model_dir)
    machine = GatewayKVMachine()
    machine.setup(block_size=4, num_blocks=40, max_num_seqs=4, max_batched=40, num_executors=1, routing="kv")
    backend = next(iter(machine.engine.backends.values()))
    allocate = machine.engine.kvmanager.allocate
    tampered = []

    async def allocate_answering_otherwise_once(pool_id, session_id, free_seq_ids, plan, *args, **kwargs):
        results, usage = await allocate(pool_id, session_id, free_seq_ids, plan, *args, **kwargs)
        if not tampered and backend.num_overlapped_steps >= 3 and all(r.num_tokens == 1 for r in results):
            results[0].start_position += 1
            tampered.append(session_id)
        return results, usage

    machine.engine.kvmanager.allocate = allocate_answering_otherwise_once
    for prompt in ([400] * 8 + [500], [410, 411, 412, 501], [502] * 3):
        machine.submit(prompt=prompt, max_tokens=12, n=1, salt="", seed=None)
    for _ in range(20):
        machine.step(steps=1)
        if tampered:
            break
    assert tampered and backend.num_overlapped_steps >= 3
    metrics = machine.engine.metrics.render().decode()
    label = f'{{executor="{backend.address}",model_name="shadow"}}'
    assert f"kvserve:executor_mispredicted_steps_total{label} 1.0" in metrics, metrics
    assert f"kvserve:executor_overlapped_steps_total{label} {float(backend.num_overlapped_steps)}" in metrics
    backend.num_mispredicted_steps -= 1  # the one this test caused; teardown asserts there are no others
    machine.teardown()  # every request finished with its reference tokens, no block leaked
    assert backend._session_id != tampered[0]  # that step's KV state was dropped, not trusted


def test_decodes_crossing_block_boundaries_at_different_steps_still_overlap(default_model_dir):
    """Sequences of different lengths cross block boundaries at different steps, so without a
    lookahead almost every decode step would need a new block for one of them and wait for
    kvmanager's answer. A step that ends on a boundary holds the next block already, so every
    decode step overlaps its Allocate; each sequence holds at most one block beyond its tokens,
    and the outputs are the reference tokens (teardown)."""
    GatewayKVMachine.tokenizer = ModelTokenizer(default_model_dir)
    machine = GatewayKVMachine()
    machine.setup(block_size=4, num_blocks=40, max_num_seqs=4, max_batched=40, num_executors=1, routing="kv")
    backend = next(iter(machine.engine.backends.values()))
    for length in (5, 6, 7, 8):
        machine.submit(prompt=[300 + length] * length, max_tokens=12, n=1, salt="", seed=None)
    machine.step(steps=1)  # the four prompts in one step
    steps_before, overlapped_before = backend.num_steps, backend.num_overlapped_steps
    for _ in range(11):  # 11 more tokens each: every step has a sequence entering a new block
        machine.step(steps=1)
        for seq in machine.pool.sequences.values():
            assert len(seq.block_table) <= seq.num_computed // 4 + 1, "more than the lookahead's block held"
    assert backend.num_steps - steps_before == 11
    assert backend.num_overlapped_steps - overlapped_before == 11
    machine.teardown()


def test_the_step_loop_hands_outputs_over_once_the_next_execute_is_out(default_model_dir):
    """In the running engine (each backend's own step loop) a step's outputs reach the request
    streams after the next step's Execute has gone out, so that this bookkeeping overlaps the
    executor's work instead of delaying the next step; every stream still gets its reference
    tokens, in order, and ends once."""
    GatewayKVMachine.tokenizer = ModelTokenizer(default_model_dir)
    machine = GatewayKVMachine()
    machine.setup(block_size=4, num_blocks=40, max_num_seqs=4, max_batched=40, num_executors=1, routing="kv")
    backend = next(iter(machine.engine.backends.values()))
    events = []
    execute, deliver = machine.executor.execute, backend.hooks.deliver

    async def recording_execute(ready, timeout=None, **store):
        events.append("execute")
        return await execute(ready, timeout, **store)

    def recording_deliver(outputs):
        if any(choice.token_ids for output in outputs for choice in output.choices):
            events.append("tokens delivered")
        deliver(outputs)

    machine.executor.execute, backend.hooks.deliver = recording_execute, recording_deliver
    prompts = [[400] * 8 + [500], [410, 411, 501]]

    async def scenario():
        # The engine's dispatch loop and the backend's step loop, without the connection watchers
        # (the in-process fakes have no channel)
        loops = [asyncio.create_task(machine.engine._dispatch_loop()), asyncio.create_task(backend._loop())]
        options = SamplingOptions(max_tokens=5, ignore_eos=True)
        streams = [await machine.engine.submit(prompt, options, f"r{i}") for i, prompt in enumerate(prompts)]
        got = [[token for output in [o async for o in stream] for choice in output.choices
                for token in choice.token_ids] for stream in streams]
        for task in loops:
            task.cancel()
        await asyncio.gather(*loops, return_exceptions=True)
        return got

    try:
        got = machine.run(scenario())
    finally:
        machine.loop.close()
    assert got == [reference_output(prompt, 5, 0) for prompt in prompts]
    executes = events.count("execute")
    deliveries = [events[:i].count("execute") for i, event in enumerate(events) if event == "tokens delivered"]
    assert executes >= 5 and len(deliveries) >= 5, events
    # The i-th step's tokens went out after the (i+1)-th Execute; the last step's, after the last.
    assert all(seen >= min(i + 2, executes) for i, seen in enumerate(deliveries)), events
