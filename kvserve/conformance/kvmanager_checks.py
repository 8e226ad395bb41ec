"""KV manager conformance rules: ``python -m kvserve.conformance kvmanager HOST:PORT``.

Black box over gRPC, exactly as ``protos/kvserve/v1/kvmanager.proto`` states the
rules. Every rule registers pools of its own (``conformance-<run>-<rule>``, 16
blocks of 4 tokens, prefix caching on, PAGED) and opens a session on it, so the
rules do not see each other's cached blocks and the kit can run against a
kvmanager that serves other pools. Closing the session at the end of a rule
frees what the rule allocated; the pools themselves stay (the proto has no
call that deletes a pool).

After every call that changes a pool the kit reads ``GetStats`` and checks
``num_used_blocks + num_free_blocks == num_blocks - 1`` (block 0 is the null
block); after every CloseSession, ``num_used_blocks == 0`` and no sequence is
left. ``stats.invariants`` reports what it saw over the whole run.
"""
from __future__ import annotations

import random
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvserve.conformance import Fail, RuleSet, Skip, expect_status, require, rpc_error_text
from kvserve.conformance.step_socket_client import open_greeted
from kvserve.v1 import kvmanager_pb2 as pb
from kvserve.v1 import kvmanager_pb2_grpc

INVALID = grpc.StatusCode.INVALID_ARGUMENT
NOT_FOUND = grpc.StatusCode.NOT_FOUND
OK = pb.ALLOCATION_STATUS_OK
NUM_BLOCKS = 16
BLOCK_SIZE = 4
MAX_MODEL_LEN = 32
MAX_FORK_CHILDREN = 1024
PROMPT = 10  # two full blocks and half of one: a hit covers 8 tokens

rules = RuleSet()


@dataclass
class Seq:
    seq_id: int
    tokens: list[int]
    table: list[int] = field(default_factory=list)
    computed: int = 0


class Pool:
    """One pool of the run, with one session on it; every call checks the block invariant."""

    def __init__(self, ctx: KVManagerContext, pool_id: str, *, max_model_len: int = 0,
                 instance: str = "instance-a") -> None:
        self.ctx = ctx
        self.pool_id = pool_id
        self.max_model_len = max_model_len
        self.instance = instance
        self.session = ""
        self.opened = pb.OpenSessionResponse()
        self.seqs: dict[int, Seq] = {}

    # -- pool and session --
    def request(self, instance: str | None = None) -> pb.RegisterPoolRequest:
        return pb.RegisterPoolRequest(
            pool_id=self.pool_id, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, model_fingerprint="conformance",
            enable_prefix_caching=True, allocation_policy=pb.ALLOCATION_POLICY_PAGED,
            max_model_len=self.max_model_len,
            # Instance names are scoped to the pool: one executor instance is one pool.
            executor_instance_id=f"{self.pool_id}/{self.instance if instance is None else instance}")

    def register(self, instance: str | None = None) -> pb.RegisterPoolResponse:
        reply = self.ctx.stub.RegisterPool(self.request(instance), timeout=self.ctx.timeout)
        self.check_invariant("RegisterPool")
        return reply

    def __enter__(self) -> Pool:
        require(self.register().created, f"RegisterPool of a new pool {self.pool_id!r} said created=false")
        reply = self.ctx.stub.OpenSession(pb.OpenSessionRequest(pool_id=self.pool_id, ttl_ms=120_000,
                                                                client_name="kvserve.conformance"),
                                          timeout=self.ctx.timeout)
        require(bool(reply.session_id), "OpenSession returned an empty session_id")
        self.session = reply.session_id
        self.opened = reply
        return self

    def __exit__(self, *exc) -> None:
        if self.session:
            self.close()

    def close(self) -> None:
        self.ctx.stub.CloseSession(pb.CloseSessionRequest(session_id=self.session), timeout=self.ctx.timeout)
        self.session = ""
        s = self.stats()
        if s.num_used_blocks or s.num_sequences:
            self.ctx.violations.append(f"{self.ctx.rule_name}: after CloseSession {s.num_used_blocks} blocks used, "
                                       f"{s.num_sequences} sequences left")
        self.check_invariant("CloseSession", s)

    def stats(self) -> pb.PoolStats:
        return self.ctx.stub.GetStats(pb.GetStatsRequest(pool_id=self.pool_id), timeout=self.ctx.timeout)

    def check_invariant(self, what: str, stats: pb.PoolStats | None = None) -> None:
        s = stats or self.stats()
        self.ctx.num_checks += 1
        if s.num_used_blocks + s.num_free_blocks != s.num_blocks - 1:
            self.ctx.violations.append(f"{self.ctx.rule_name}: after {what}, used {s.num_used_blocks} + free "
                                       f"{s.num_free_blocks} != num_blocks {s.num_blocks} - 1")

    # -- sequences --
    def allocate_request(self, seqs: Iterable[tuple[int, Sequence[int], int]] = (), written=(), free=(),
                         written_ids=None, written_tokens=None) -> pb.AllocateRequest:
        written = list(written)
        return pb.AllocateRequest(
            pool_id=self.pool_id, session_id=self.session, free_seq_ids=list(free),
            sequences=[pb.SequenceAllocation(seq_id=i, token_ids=list(t), num_new_tokens=n, enable_prefix_caching=True)
                       for i, t, n in seqs],
            written_seq_ids=[i for i, _ in written] if written_ids is None else written_ids,
            written_num_tokens=[n for _, n in written] if written_tokens is None else written_tokens)

    def allocate(self, seqs=(), written=(), free=()) -> pb.AllocateResponse:
        seqs = list(seqs)
        reply = self.ctx.stub.Allocate(self.allocate_request(seqs, written, free), timeout=self.ctx.timeout)
        self.check_invariant("Allocate")
        require(len(reply.results) == len(seqs), f"Allocate returned {len(reply.results)} results for {len(seqs)}")
        for seq_id in free:
            self.seqs.pop(seq_id, None)
        for (seq_id, tokens, _), result in zip(seqs, reply.results):
            require(result.seq_id == seq_id, f"result for seq_id {result.seq_id}, expected {seq_id}")
            if result.status != OK:
                continue
            seq = self.seqs.setdefault(seq_id, Seq(seq_id, []))
            seq.tokens += list(tokens)
            seq.table = seq.table[:result.block_table_offset] + list(result.block_table)
            seq.computed = result.start_position + result.num_tokens
        return reply

    def admit(self, tokens: Sequence[int], num_new: int | None = None,
              written=()) -> tuple[Seq, pb.SequenceAllocationResult]:
        """A new sequence with ``tokens`` (computing ``num_new`` of them, default all)."""
        seq_id = self.ctx.seq_id()
        reply = self.allocate([(seq_id, tokens, len(tokens) if num_new is None else num_new)], written=written)
        result = reply.results[0]
        require(result.status == OK, f"Allocate of a {len(tokens)}-token sequence: no room in a pool of "
                                     f"{NUM_BLOCKS} blocks")
        return self.seqs[seq_id], result

    def step(self, seq: Seq, tokens: Sequence[int], num_new: int, written=()) -> pb.SequenceAllocationResult:
        result = self.allocate([(seq.seq_id, tokens, num_new)], written=written).results[0]
        require(result.status == OK, f"Allocate step of sequence {seq.seq_id}: no room")
        return result

    def report(self, seq: Seq, num_tokens: int) -> None:
        """An Allocate that only reports ``seq``'s first ``num_tokens`` tokens written."""
        self.allocate([], written=[(seq.seq_id, num_tokens)])

    def free(self, seq_ids: list[int], written=()) -> pb.FreeResponse:
        written = list(written)
        reply = self.ctx.stub.Free(pb.FreeRequest(pool_id=self.pool_id, session_id=self.session, seq_ids=seq_ids,
                                                  written_seq_ids=[i for i, _ in written],
                                                  written_num_tokens=[n for _, n in written]),
                                   timeout=self.ctx.timeout)
        self.check_invariant("Free")
        for seq_id in seq_ids:
            self.seqs.pop(seq_id, None)
        return reply

    def hit(self, tokens: Sequence[int], keep: bool = False) -> tuple[int, list[int]]:
        """Admits a probe sequence with ``tokens``: (num_cached_tokens, its block table); the probe
        is freed again (without a report) unless ``keep``."""
        seq, result = self.admit(tokens)
        if not keep:
            self.free([seq.seq_id])
        return result.num_cached_tokens, list(result.block_table)


class KVManagerContext:
    def __init__(self, address: str, timeout: float = 30.0, seed: int = 20240601,
                 connect_timeout: float = 30.0) -> None:
        self.address = address
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.channel = grpc.insecure_channel(address)
        self.stub = kvmanager_pb2_grpc.KVManagerStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.rng = random.Random(seed)
        self.run_id = uuid.uuid4().hex[:8]
        self._next_seq_id = (1 << 63) + self.rng.randrange(1 << 32)  # beyond 2^53 on purpose
        self.violations: list[str] = []
        self.num_checks = 0
        self.rule_name = ""
        self._pools = 0

    def close(self) -> None:
        self.channel.close()

    def begin_rule(self, name: str) -> None:
        self.rule_name = name

    def seq_id(self) -> int:
        self._next_seq_id += 1
        return self._next_seq_id

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(50_000) for _ in range(n)]

    def pool(self, **kwargs) -> Pool:
        self._pools += 1
        return Pool(self, f"conformance-{self.run_id}-{self.rule_name}-{self._pools}", **kwargs)


def cached_blocks(num_tokens: int) -> int:
    """Tokens a hit covers for a prompt of ``num_tokens`` whose blocks are all published."""
    return ((num_tokens - 1) // BLOCK_SIZE) * BLOCK_SIZE


def expect_hit(pool: Pool, tokens: list[int], expected: int, what: str, shared_with: list[int] | None = None) -> None:
    cached, table = pool.hit(tokens)
    require(cached == expected, f"{what}: num_cached_tokens {cached}, expected {expected}")
    if shared_with is not None and expected:
        n = expected // BLOCK_SIZE
        require(table[:n] == shared_with[:n],
                f"{what}: block table starts {table[:n]}, expected the shared blocks {shared_with[:n]}")


# ---- health and pools --------------------------------------------------------------------


@rules.rule("health.serving", 'grpc.health.v1 answers SERVING for ""')
def health_serving(ctx: KVManagerContext) -> str:
    try:
        grpc.channel_ready_future(ctx.channel).result(timeout=ctx.connect_timeout)
    except grpc.FutureTimeoutError:
        raise Fail(f"cannot connect to {ctx.address} within {ctx.connect_timeout:.0f} s") from None
    reply = ctx.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
    require(reply.status == health_pb2.HealthCheckResponse.SERVING,
            f"overall status {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}")
    return "SERVING"


@rules.rule("register.idempotent",
            "RegisterPool creates a pool (created=true), the same call again keeps it (created=false); GetStats "
            "shows its parameters and every block but the null block free")
def register_idempotent(ctx: KVManagerContext) -> str:
    with ctx.pool() as pool:
        again = pool.register()
        require(not again.created, "RegisterPool with the same parameters said created=true")
        s = pool.stats()
        require((s.num_blocks, s.block_size) == (NUM_BLOCKS, BLOCK_SIZE),
                f"GetStats: num_blocks {s.num_blocks}, block_size {s.block_size}")
        require(s.enable_prefix_caching, "GetStats: enable_prefix_caching false")
        require(s.allocation_policy == pb.ALLOCATION_POLICY_PAGED,
                f"GetStats: allocation_policy {s.allocation_policy}")
        require(s.num_used_blocks == 0 and s.num_free_blocks == NUM_BLOCKS - 1,
                f"a new pool: used {s.num_used_blocks}, free {s.num_free_blocks}")
        require(s.num_sessions == 1, f"num_sessions {s.num_sessions} with one session open")
    return "created, then kept; parameters and free blocks as registered"


# ---- publication -------------------------------------------------------------------------


@rules.rule("publish.not_in_handing_allocate",
            "two new sequences with the same prompt in one Allocate share nothing (a block is not findable in the "
            "Allocate that hands it out)")
def publish_same_allocate(ctx: KVManagerContext) -> str:
    with ctx.pool() as pool:
        prompt = ctx.tokens(PROMPT)
        a, b = ctx.seq_id(), ctx.seq_id()
        reply = pool.allocate([(a, prompt, PROMPT), (b, prompt, PROMPT)])
        ra, rb = reply.results
        require(ra.status == OK and rb.status == OK, "no room for two 10-token sequences in 15 blocks")
        require(rb.num_cached_tokens == 0, f"the second sequence got num_cached_tokens {rb.num_cached_tokens}")
        shared = set(ra.block_table) & set(rb.block_table)
        require(not shared, f"the two sequences share blocks {sorted(shared)}")
    return "num_cached_tokens 0, no shared block"


@rules.rule("publish.not_before_written",
            "a sequence admitted in a later Allocate, before any written_* report, gets num_cached_tokens 0")
def publish_not_before_written(ctx: KVManagerContext) -> str:
    with ctx.pool() as pool:
        prompt = ctx.tokens(PROMPT)
        first, _ = pool.admit(prompt)
        cached, table = pool.hit(prompt, keep=True)
        require(cached == 0, f"num_cached_tokens {cached} before the first sequence's KV was reported written")
        shared = set(table) & set(first.table)
        require(not shared, f"shares blocks {sorted(shared)} with an unreported sequence")
    return "num_cached_tokens 0, no shared block"


@rules.rule("publish.after_written",
            "after written_seq_ids/written_num_tokens in an Allocate, a new sequence with the same prompt (in the "
            "same Allocate, reports come first) gets the full blocks (at most len(prompt)-1 tokens) and shares them")
def publish_after_written(ctx: KVManagerContext) -> str:
    with ctx.pool() as pool:
        details = []
        for length in (PROMPT, 3 * BLOCK_SIZE):  # 10 tokens: 8 cached; 12 tokens: still 8 (len - 1 = 11)
            prompt = ctx.tokens(length)
            first, _ = pool.admit(prompt)
            second, result = pool.admit(prompt, written=[(first.seq_id, length)])
            expected = cached_blocks(length)
            require(result.num_cached_tokens == expected,
                    f"{length}-token prompt reported written: num_cached_tokens {result.num_cached_tokens}, "
                    f"expected {expected}")
            n = expected // BLOCK_SIZE
            require(second.table[:n] == first.table[:n],
                    f"{length}-token prompt: block table {second.table} does not start with {first.table[:n]}")
            require(result.start_position == expected and result.num_tokens == length - expected,
                    f"{length}-token prompt: start_position {result.start_position}, num_tokens "
                    f"{result.num_tokens}, expected {expected}, {length - expected}")
            details.append(f"{length} tokens -> {expected} cached")
    return "; ".join(details)


@rules.rule("publish.partial_written",
            "only the full blocks within written_num_tokens become findable (chunked prefill, then decode tokens)")
def publish_partial(ctx: KVManagerContext) -> str:
    with ctx.pool() as pool:
        prompt = ctx.tokens(PROMPT)
        seq, result = pool.admit(prompt, num_new=6)
        require(result.num_tokens == 6, f"num_new_tokens 6 gave num_tokens {result.num_tokens}")
        expect_hit(pool, prompt, 0, "nothing reported yet")
        pool.report(seq, 6)
        expect_hit(pool, prompt, BLOCK_SIZE, "6 tokens reported written", seq.table)
        pool.step(seq, [], PROMPT - 6)
        expect_hit(pool, prompt, BLOCK_SIZE, "the rest allocated, not yet reported", seq.table)
        extra = ctx.tokens(2)
        pool.step(seq, extra[:1], 1, written=[(seq.seq_id, PROMPT)])
        pool.step(seq, extra[1:], 1)
        full = prompt + extra  # 12 tokens: three full blocks
        expect_hit(pool, full + ctx.tokens(1), 2 * BLOCK_SIZE, "10 tokens reported, 12 allocated", seq.table)
        pool.report(seq, 3 * BLOCK_SIZE)
        expect_hit(pool, full + ctx.tokens(1), 3 * BLOCK_SIZE, "12 tokens (decode included) reported", seq.table)
    return "6 -> 4, 10 -> 8, 12 -> 12 cached tokens"


@rules.rule("publish.via_free",
            "written_* on Free publishes before the free; the freed blocks stay findable until reused")
def publish_via_free(ctx: KVManagerContext) -> str:
    with ctx.pool() as pool:
        prompt = ctx.tokens(PROMPT)
        seq, _ = pool.admit(prompt)
        table = list(seq.table)
        pool.free([seq.seq_id], written=[(seq.seq_id, PROMPT)])
        expect_hit(pool, prompt, cached_blocks(PROMPT), "reported and freed in one Free", table)
    return f"{cached_blocks(PROMPT)} cached tokens from the freed sequence's blocks"


@rules.rule("publish.report_and_free_in_one_allocate",
            "an Allocate reporting a sequence written and freeing it (free_seq_ids) publishes first")
def publish_report_and_free(ctx: KVManagerContext) -> str:
    with ctx.pool() as pool:
        prompt = ctx.tokens(PROMPT)
        seq, _ = pool.admit(prompt)
        table = list(seq.table)
        pool.allocate([], written=[(seq.seq_id, PROMPT)], free=[seq.seq_id])
        require(pool.stats().num_sequences == 0, "the sequence was not freed")
        expect_hit(pool, prompt, cached_blocks(PROMPT), "reported and freed in one Allocate", table)
    return f"{cached_blocks(PROMPT)} cached tokens"


@rules.rule("publish.freed_unreported", "a sequence freed without a written report publishes nothing")
def publish_freed_unreported(ctx: KVManagerContext) -> str:
    with ctx.pool() as pool:
        prompt = ctx.tokens(PROMPT)
        seq, _ = pool.admit(prompt)
        pool.free([seq.seq_id])
        expect_hit(pool, prompt, 0, "freed by Free without a report")
        other = ctx.tokens(PROMPT)
        seq, _ = pool.admit(other)
        pool.allocate([], free=[seq.seq_id])
        expect_hit(pool, other, 0, "freed by Allocate.free_seq_ids without a report")
    return "num_cached_tokens 0 after Free and after free_seq_ids"


def published(pool: Pool, ctx: KVManagerContext) -> Seq:
    """A live sequence whose PROMPT tokens are reported written (checked findable)."""
    prompt = ctx.tokens(PROMPT)
    seq, _ = pool.admit(prompt)
    pool.report(seq, PROMPT)
    expect_hit(pool, prompt, cached_blocks(PROMPT), "a reported sequence (before the invalidation)", seq.table)
    return seq


def after_invalidation(pool: Pool, ctx: KVManagerContext, live: Seq, unreported: Seq, what: str) -> None:
    """What an invalidation leaves: nothing findable; live sequences keep working but never
    publish again; new sequences publish as usual."""
    expect_hit(pool, live.tokens[:PROMPT], 0, f"after {what}, the in-use published blocks")
    extra = ctx.tokens(2)
    pool.step(live, extra, 2)  # fills its third block
    pool.report(live, PROMPT + 2)
    expect_hit(pool, live.tokens + ctx.tokens(1), 0, f"a sequence alive during {what}, reported written afterwards")
    pool.report(unreported, PROMPT)
    expect_hit(pool, unreported.tokens, 0, f"a sequence allocated before {what}, reported afterwards")
    fresh = ctx.tokens(PROMPT)
    seq, _ = pool.admit(fresh)
    pool.report(seq, PROMPT)
    expect_hit(pool, fresh, cached_blocks(PROMPT), f"a sequence admitted after {what}", seq.table)


@rules.rule("reset.in_use",
            "ResetPrefixCache works while blocks are in use, makes them unfindable, and sequences alive during it "
            "never publish again")
def reset_in_use(ctx: KVManagerContext) -> str:
    with ctx.pool() as pool:
        live = published(pool, ctx)
        unreported, _ = pool.admit(ctx.tokens(PROMPT))
        before = pool.stats()
        try:
            reply = ctx.stub.ResetPrefixCache(pb.ResetPrefixCacheRequest(pool_id=pool.pool_id), timeout=ctx.timeout)
        except grpc.RpcError as error:
            raise Fail(f"ResetPrefixCache with blocks in use: {rpc_error_text(error)}") from None
        pool.check_invariant("ResetPrefixCache")
        expected = cached_blocks(PROMPT) // BLOCK_SIZE
        require(reply.num_blocks_cleared >= expected,
                f"num_blocks_cleared {reply.num_blocks_cleared}, expected at least {expected}")
        after = pool.stats()
        require((after.num_used_blocks, after.num_sequences) == (before.num_used_blocks, before.num_sequences),
                f"the reset changed used blocks/sequences: {before.num_used_blocks}/{before.num_sequences} -> "
                f"{after.num_used_blocks}/{after.num_sequences}")
        after_invalidation(pool, ctx, live, unreported, "ResetPrefixCache")
    return f"cleared {reply.num_blocks_cleared} blocks; nothing findable, no late publication"


@rules.rule("register.new_instance_invalidates",
            "RegisterPool with the same parameters and another executor_instance_id keeps the pool (created=false) "
            "and its sequences, and makes no block findable; sequences alive then never publish again")
def register_new_instance(ctx: KVManagerContext) -> str:
    with ctx.pool(instance="instance-a") as pool:
        live = published(pool, ctx)
        unreported, _ = pool.admit(ctx.tokens(PROMPT))
        before = pool.stats()
        try:
            reply = pool.register(instance="instance-b")
        except grpc.RpcError as error:
            raise Fail(f"RegisterPool with a new executor_instance_id: {rpc_error_text(error)}") from None
        require(not reply.created, "created=true: the pool was replaced, not kept")
        after = pool.stats()
        require((after.num_used_blocks, after.num_sequences) == (before.num_used_blocks, before.num_sequences),
                f"the pool's sequences were not kept: used/sequences {before.num_used_blocks}/"
                f"{before.num_sequences} -> {after.num_used_blocks}/{after.num_sequences}")
        after_invalidation(pool, ctx, live, unreported, "the new executor_instance_id")
    return "pool and sequences kept, nothing findable, no late publication"


@rules.rule("register.same_instance_keeps_cache",
            "RegisterPool again with the same parameters and executor_instance_id keeps the cached blocks")
def register_same_instance(ctx: KVManagerContext) -> str:
    with ctx.pool(instance="instance-a") as pool:
        live = published(pool, ctx)
        require(not pool.register().created, "created=true for identical parameters")
        expect_hit(pool, live.tokens[:PROMPT], cached_blocks(PROMPT), "after the identical RegisterPool", live.table)
    return "still findable"


@rules.rule("register.one_pool_per_instance",
            "RegisterPool of another pool naming an executor_instance_id that a pool already has is "
            "FAILED_PRECONDITION (two pools over one KV cache would hand out its blocks twice)")
def register_one_pool_per_instance(ctx: KVManagerContext) -> str:
    with ctx.pool() as first:
        second = ctx.pool()
        request = second.request()
        request.executor_instance_id = first.request().executor_instance_id
        expect_status(lambda: ctx.stub.RegisterPool(request, timeout=ctx.timeout), grpc.StatusCode.FAILED_PRECONDITION,
                      "a second pool for one executor instance")
        expect_status(lambda: second.stats(), grpc.StatusCode.NOT_FOUND, "the refused pool")
    return "refused, and not created"


# ---- bad input ---------------------------------------------------------------------------


def unchanged(pool: Pool, before: pb.PoolStats, what: str) -> None:
    after = pool.stats()
    if after != before:
        changed = [f.name for f in pb.PoolStats.DESCRIPTOR.fields if getattr(after, f.name) != getattr(before, f.name)]
        raise Fail(f"{what} was rejected but changed the pool: {', '.join(changed)}")


def rejected(pool: Pool, request, what: str, code=INVALID, rpc: str = "Allocate") -> str:
    """Sends a bad request, requires ``code`` and unchanged stats; returns the error details."""
    before = pool.stats()
    method = getattr(pool.ctx.stub, rpc)
    error = expect_status(lambda: method(request, timeout=pool.ctx.timeout), code, what)
    unchanged(pool, before, what)
    return error.details() or ""


@rules.rule("invalid.negative_token_id",
            "a negative token id (in a prompt or a decode step) is INVALID_ARGUMENT and changes nothing")
def invalid_negative_token(ctx: KVManagerContext) -> str:
    with ctx.pool() as pool:
        seq, _ = pool.admit(ctx.tokens(PROMPT))
        rejected(pool, pool.allocate_request([(ctx.seq_id(), [5, 6, -1], 3)]), "a prompt with token -1")
        rejected(pool, pool.allocate_request([(ctx.seq_id(), [-(1 << 31)], 1)]), "a prompt with token -2^31")
        rejected(pool, pool.allocate_request([(seq.seq_id, [-1], 1)]), "a decode step with token -1")
    return "INVALID_ARGUMENT, stats unchanged (token ids are int32, so -1 is the only kind of 'huge' the wire carries)"


@rules.rule("invalid.written_beyond_allocated",
            "written_num_tokens beyond the tokens allocated so far is INVALID_ARGUMENT (Allocate and Free) and "
            "publishes nothing")
def invalid_written_beyond(ctx: KVManagerContext) -> str:
    with ctx.pool() as pool:
        prompt = ctx.tokens(PROMPT)
        seq, _ = pool.admit(prompt, num_new=6)  # 6 tokens allocated
        rejected(pool, pool.allocate_request(written=[(seq.seq_id, 7)]), "Allocate reporting 7 of 6 tokens")
        rejected(pool, pool.allocate_request([(ctx.seq_id(), ctx.tokens(3), 3)], written=[(seq.seq_id, PROMPT)]),
                 "Allocate reporting 10 of 6 tokens (with a valid new sequence)")
        free = pb.FreeRequest(pool_id=pool.pool_id, session_id=pool.session, seq_ids=[seq.seq_id],
                              written_seq_ids=[seq.seq_id], written_num_tokens=[7])
        rejected(pool, free, "Free reporting 7 of 6 tokens", rpc="Free")
        expect_hit(pool, prompt, 0, "after the rejected reports")
    return "INVALID_ARGUMENT, stats unchanged, nothing published, nothing freed"


@rules.rule("invalid.written_lengths",
            "written_seq_ids and written_num_tokens of different lengths are INVALID_ARGUMENT (Allocate and Free)")
def invalid_written_lengths(ctx: KVManagerContext) -> str:
    with ctx.pool() as pool:
        prompt = ctx.tokens(PROMPT)
        a, _ = pool.admit(prompt)
        b, _ = pool.admit(ctx.tokens(PROMPT))
        rejected(pool, pool.allocate_request(written_ids=[a.seq_id, b.seq_id], written_tokens=[PROMPT]),
                 "Allocate with 2 written_seq_ids and 1 written_num_tokens")
        rejected(pool, pool.allocate_request(written_ids=[a.seq_id], written_tokens=[PROMPT, PROMPT]),
                 "Allocate with 1 written_seq_id and 2 written_num_tokens")
        free = pb.FreeRequest(pool_id=pool.pool_id, session_id=pool.session, seq_ids=[b.seq_id],
                              written_seq_ids=[a.seq_id, b.seq_id], written_num_tokens=[PROMPT])
        rejected(pool, free, "Free with 2 written_seq_ids and 1 written_num_tokens", rpc="Free")
        expect_hit(pool, prompt, 0, "after the rejected reports")
    return "INVALID_ARGUMENT, stats unchanged, nothing published"


@rules.rule("invalid.max_model_len",
            "a sequence longer than the pool's max_model_len (admitted or grown) is INVALID_ARGUMENT")
def invalid_max_model_len(ctx: KVManagerContext) -> str:
    with ctx.pool(max_model_len=MAX_MODEL_LEN) as pool:
        seq, _ = pool.admit(ctx.tokens(MAX_MODEL_LEN - 2))
        rejected(pool, pool.allocate_request([(ctx.seq_id(), ctx.tokens(MAX_MODEL_LEN + 1), 4)]),
                 f"a new {MAX_MODEL_LEN + 1}-token sequence")
        rejected(pool, pool.allocate_request([(seq.seq_id, ctx.tokens(3), 3)]),
                 f"growing a sequence to {MAX_MODEL_LEN + 1} tokens")
        pool.step(seq, ctx.tokens(2), 2)  # exactly max_model_len is fine
    return f"INVALID_ARGUMENT beyond {MAX_MODEL_LEN} tokens, stats unchanged; exactly {MAX_MODEL_LEN} accepted"


@rules.rule("invalid.unknown_pool", "calls naming an unknown pool are NOT_FOUND")
def invalid_unknown_pool(ctx: KVManagerContext) -> str:
    name = f"conformance-{ctx.run_id}-no-such-pool"
    stub, t = ctx.stub, ctx.timeout
    calls = {
        "GetStats": lambda: stub.GetStats(pb.GetStatsRequest(pool_id=name), timeout=t),
        "OpenSession": lambda: stub.OpenSession(pb.OpenSessionRequest(pool_id=name), timeout=t),
        "ResetPrefixCache": lambda: stub.ResetPrefixCache(pb.ResetPrefixCacheRequest(pool_id=name), timeout=t),
    }
    with ctx.pool() as pool:
        calls["Allocate"] = lambda: stub.Allocate(pb.AllocateRequest(
            pool_id=name, session_id=pool.session,
            sequences=[pb.SequenceAllocation(seq_id=ctx.seq_id(), token_ids=[1, 2], num_new_tokens=2)]), timeout=t)
        calls["Free"] = lambda: stub.Free(pb.FreeRequest(pool_id=name, session_id=pool.session, seq_ids=[1]),
                                          timeout=t)
        for what, call in calls.items():
            expect_status(call, NOT_FOUND, f"{what} on an unknown pool")
    return ", ".join(calls) + ": NOT_FOUND"


@rules.rule("invalid.fork_children",
            f"a Fork of more than {MAX_FORK_CHILDREN} children is rejected and changes nothing; "
            f"{MAX_FORK_CHILDREN} are accepted")
def invalid_fork_children(ctx: KVManagerContext) -> str:
    with ctx.pool() as pool:
        parent, _ = pool.admit(ctx.tokens(PROMPT))

        def fork(n: int) -> pb.ForkRequest:
            return pb.ForkRequest(pool_id=pool.pool_id, session_id=pool.session, parent_seq_id=parent.seq_id,
                                  child_seq_ids=[ctx.seq_id() for _ in range(n)])

        details = rejected(pool, fork(MAX_FORK_CHILDREN + 1), f"a Fork of {MAX_FORK_CHILDREN + 1} children",
                           code=(INVALID, grpc.StatusCode.RESOURCE_EXHAUSTED), rpc="Fork")
        request = fork(MAX_FORK_CHILDREN)
        before = pool.stats()
        reply = ctx.stub.Fork(request, timeout=ctx.timeout)
        pool.check_invariant("Fork")
        require(list(reply.block_table) == parent.table,
                f"Fork's block_table {list(reply.block_table)} is not the parent's {parent.table}")
        after = pool.stats()
        require(after.num_sequences == before.num_sequences + MAX_FORK_CHILDREN,
                f"{MAX_FORK_CHILDREN} children: num_sequences {before.num_sequences} -> {after.num_sequences}")
        require(after.num_used_blocks == before.num_used_blocks, "a Fork took new blocks")
        pool.free(list(request.child_seq_ids))
    return f"{MAX_FORK_CHILDREN + 1} rejected ({details[:80]}), {MAX_FORK_CHILDREN} accepted"


@rules.rule("invalid.atomic_batch",
            "an Allocate with reports, frees and a valid new sequence next to an invalid one is INVALID_ARGUMENT "
            "and changes nothing: nothing published, freed or admitted")
def invalid_atomic_batch(ctx: KVManagerContext) -> str:
    with ctx.pool() as pool:
        prompt = ctx.tokens(PROMPT)
        reported, _ = pool.admit(prompt)
        to_free, _ = pool.admit(ctx.tokens(PROMPT))
        request = pool.allocate_request([(ctx.seq_id(), ctx.tokens(5), 5), (ctx.seq_id(), [1, -1], 2)],
                                        written=[(reported.seq_id, PROMPT)], free=[to_free.seq_id])
        rejected(pool, request, "a batch with one invalid sequence")
        expect_hit(pool, prompt, 0, "the report in the rejected Allocate")
    return "INVALID_ARGUMENT, stats unchanged, nothing published"


@rules.rule("invalid.free_unknown", "a Free naming an unknown sequence is NOT_FOUND and frees nothing")
def invalid_free_unknown(ctx: KVManagerContext) -> str:
    with ctx.pool() as pool:
        seq, _ = pool.admit(ctx.tokens(PROMPT))
        free = pb.FreeRequest(pool_id=pool.pool_id, session_id=pool.session, seq_ids=[seq.seq_id, ctx.seq_id()])
        rejected(pool, free, "Free of a known and an unknown sequence", code=NOT_FOUND, rpc="Free")
    return "NOT_FOUND, stats unchanged"


# ---- the allocate socket ------------------------------------------------------------------

SOCKET_ALLOCATE, SOCKET_FREE = 1, 2  # method numbers (docs/kvmanager.md, "The allocate socket")


@rules.rule("allocate.socket",
            "the allocate socket (optional; SKIP where OpenSession names none, it is on another host or wants a "
            "token): the greeting names OpenSession's instance_id; an Allocate on it is answered as over gRPC on a "
            "twin pool; an unknown method number is UNIMPLEMENTED and the connection serves the next call (a Free)")
def allocate_socket(ctx: KVManagerContext) -> str:
    with ctx.pool() as over_socket, ctx.pool() as over_grpc:
        offer = over_socket.opened
        if not offer.allocate_socket:
            raise Skip("OpenSession names no allocate socket")
        client = open_greeted(offer.allocate_socket, offer.instance_id, "the allocate socket", "OpenSession's",
                              ctx.timeout)
        try:
            seq_id, tokens = ctx.seq_id(), ctx.tokens(PROMPT)
            status, body = client.exchange(bytes((SOCKET_ALLOCATE,)) + over_socket.allocate_request(
                [(seq_id, tokens, PROMPT)]).SerializeToString())
            require(status == 0, f"an Allocate on the socket answered status {status}: {body[:200]!r}")
            got = pb.AllocateResponse.FromString(body).results
            expected = over_grpc.allocate([(ctx.seq_id(), tokens, PROMPT)]).results
            require(len(got) == 1 and (got[0].status, got[0].start_position, got[0].num_tokens, len(got[0].block_table))
                    == (expected[0].status, expected[0].start_position, expected[0].num_tokens,
                        len(expected[0].block_table)),
                    f"the socket's answer {got} differs from gRPC's {expected} on a twin pool")
            status, _ = client.exchange(bytes((9,)) + b"")
            require(status == grpc.StatusCode.UNIMPLEMENTED.value[0], f"method number 9 answered status {status}")
            free = pb.FreeRequest(pool_id=over_socket.pool_id, session_id=over_socket.session, seq_ids=[seq_id])
            status, body = client.exchange(bytes((SOCKET_FREE,)) + free.SerializeToString())
            require(status == 0, f"a Free on the socket answered status {status}: {body[:200]!r}")
            require(over_socket.stats().num_used_blocks == 0, "blocks still used after the Free on the socket")
        finally:
            client.close()
    return f"{len(got[0].block_table)} blocks as over gRPC, UNIMPLEMENTED for method 9, then a Free"


# ---- sessions and invariants -------------------------------------------------------------


@rules.rule("stats.close_session_frees",
            "CloseSession frees every sequence of the session (forks included): used == 0, free == num_blocks - 1")
def stats_close_session(ctx: KVManagerContext) -> str:
    pool = ctx.pool()
    with pool:
        seqs = [pool.admit(ctx.tokens(PROMPT))[0] for _ in range(3)]
        ctx.stub.Fork(pb.ForkRequest(pool_id=pool.pool_id, session_id=pool.session, parent_seq_id=seqs[0].seq_id,
                                     child_seq_ids=[ctx.seq_id(), ctx.seq_id()]), timeout=ctx.timeout)
        s = pool.stats()
        require(s.num_sequences == 5, f"num_sequences {s.num_sequences} with 3 sequences and 2 forks")
        reply = ctx.stub.CloseSession(pb.CloseSessionRequest(session_id=pool.session), timeout=ctx.timeout)
        pool.session = ""
        require(reply.num_sequences_freed == 5, f"num_sequences_freed {reply.num_sequences_freed}, expected 5")
        s = pool.stats()
        require(s.num_used_blocks == 0 and s.num_free_blocks == NUM_BLOCKS - 1 and s.num_sequences == 0,
                f"after CloseSession: used {s.num_used_blocks}, free {s.num_free_blocks}, "
                f"sequences {s.num_sequences}")
        require(s.num_sessions == 0, f"num_sessions {s.num_sessions} after CloseSession")
    return "5 sequences freed, every block free"


@rules.rule("stats.invariants",
            "over the whole run: used + free == num_blocks - 1 after every call, used == 0 after every CloseSession")
def stats_invariants(ctx: KVManagerContext) -> str:
    require(not ctx.violations, "; ".join(ctx.violations[:3])
            + (f" (+{len(ctx.violations) - 3} more)" if len(ctx.violations) > 3 else ""))
    return f"held at {ctx.num_checks} checks"


NOTES = (
    ("invalid.huge_token_id",
     "token ids are int32 on the wire and the proto only requires >= 0 (kvmanager does not know the vocabulary), "
     "so 'huge' ids are checked as negative ones"),
)
