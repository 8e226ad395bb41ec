"""Executor conformance rules: ``python -m kvserve.conformance executor HOST:PORT``.

The checker knows nothing about the model. It reads ``Describe`` (vocab_size,
block_size, num_blocks, max_model_len), draws token ids in ``[0, vocab_size)``
from a seeded generator and compares the executor against itself: the same
tokens through different KV layouts, batches and step splits must give the same
greedy tokens and log-probabilities.

Comparisons (``Comparison``): every run asks for greedy sampling (temperature 0)
with ``top_logprobs = 5``. Two results of the same position agree when

* the sampled token is the same, checked only where the reference's top-2
  log-probability gap exceeds twice the tolerance (a near tie may flip between
  two correct executors running in bfloat16);
* the sampled log-probability (when the tokens agree) and the log-probability of
  every token in both top-5 lists differ by at most ``atol + rtol * |reference|``
  (``--atol`` and ``--rtol``; by default 1e-3 and 0 for an executor whose Describe says
  float32, 0.25 and 0.02 for any other: ``Tolerance.for_dtype``);
* the top-5 lists agree as sets: a token one list ranks above the other list's
  last entry by more than the tolerance is in the other list too (so a near tie
  at the top cannot make a comparison vacuous).

Decode steps after the first sampled token are teacher-forced: every variant
feeds the reference's tokens, so one near tie does not derail the steps after it.

The checker writes KV into blocks ``1 .. num_blocks-1`` (never block 0, the null
block) and assumes that nobody else uses the executor while it runs. Each rule
takes the blocks it uses from that range afresh (``ExecutorContext.take``) and
writes before it reads; only sequence A of the ``invalid.*`` rules keeps its
blocks from one rule to the next.
"""
from __future__ import annotations

import math
import re
import struct
import threading
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvserve.conformance import Fail, RuleSet, Skip, expect_status, require, rpc_error_text
from kvserve.conformance.comparison import Comparison, Sampled, sampled_from
from kvserve.conformance.executor_context import (DECODE_STEPS, DESCRIBE_DEADLINE_S, TOPK, ExecutorContext,
                                                  Reference, blocks_for, greedy, sequence)
from kvserve.conformance.step_socket_client import open_greeted
from kvserve.v1 import executor_pb2 as pb
from kvserve.v1 import executor_pb2_grpc

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Executor"].full_name  # "kvserve.v1.Executor"
HEALTH_DEADLINE_S = 1.0
BUSY_SECONDS = 1.0
BUSY_MAX_TOKENS = 2048
INVALID = grpc.StatusCode.INVALID_ARGUMENT

rules = RuleSet()


# ---- describe and health -----------------------------------------------------------------


@rules.rule("describe.answers", f"Describe answers within {DESCRIBE_DEADLINE_S:.0f} s")
def describe_answers(ctx: ExecutorContext) -> str:
    try:
        grpc.channel_ready_future(ctx.channel).result(timeout=ctx.connect_timeout)
    except grpc.FutureTimeoutError:
        ctx._describe_error = f"cannot connect to {ctx.address}"
        raise Fail(f"cannot connect to {ctx.address} within {ctx.connect_timeout:.0f} s") from None
    t0 = time.monotonic()
    try:
        info = ctx.describe(timeout=DESCRIBE_DEADLINE_S)
    except grpc.RpcError as error:
        ctx._describe_error = rpc_error_text(error)
        raise Fail(f"Describe failed: {rpc_error_text(error)}") from None
    elapsed = time.monotonic() - t0
    ctx.set_info(info)
    tolerance = ctx.tolerance
    return (f"{elapsed * 1e3:.0f} ms: model {info.model_name!r} ({info.architecture}), dtype {info.dtype!r}, "
            f"device {info.device!r}, attention {info.attention_backend!r}, block_size {info.block_size}, "
            f"num_blocks {info.num_blocks}, max_model_len {info.max_model_len}, vocab_size {info.vocab_size}; "
            f"comparing with atol {tolerance.atol:g}, rtol {tolerance.rtol:g}")


HEX64 = re.compile(r"[0-9a-f]{64}")


@rules.rule("describe.fields", "Describe's fields are usable: instance_id set, sizes >= their minimum")
def describe_fields(ctx: ExecutorContext) -> str:
    info = ctx.info
    problems = []
    if not info.instance_id:
        problems.append("instance_id is empty")
    for name, minimum in (("block_size", 1), ("num_blocks", 2), ("max_model_len", 1), ("vocab_size", 1)):
        if getattr(info, name) < minimum:
            problems.append(f"{name} = {getattr(info, name)} < {minimum}")
    bad_eos = [t for t in info.eos_token_ids if not 0 <= t < info.vocab_size]
    if bad_eos:
        problems.append(f"eos_token_ids {bad_eos} outside [0, vocab_size)")
    if info.tokenizer_fingerprint and not HEX64.fullmatch(info.tokenizer_fingerprint):
        problems.append(f"tokenizer_fingerprint {info.tokenizer_fingerprint!r} is not lowercase hex sha256")
    require(not problems, "; ".join(problems))
    fingerprint = (f"tokenizer_fingerprint {info.tokenizer_fingerprint[:12]}…" if info.tokenizer_fingerprint
                   else "tokenizer_fingerprint empty (no tokenizer.json?)")
    return f"instance_id {info.instance_id!r}, {fingerprint}"


@rules.rule("describe.consistent", "two Describe calls give identical responses")
def describe_consistent(ctx: ExecutorContext) -> str:
    first = ctx.info
    second = ctx.describe()
    if second != first:
        changed = [f.name for f in pb.DescribeResponse.DESCRIPTOR.fields
                   if getattr(first, f.name) != getattr(second, f.name)]
        raise Fail(f"Describe changed between calls: {', '.join(changed)}")
    return "two Describe calls gave identical responses"


def health_check(stub: health_pb2_grpc.HealthStub, service: str) -> tuple[float, str]:
    """(seconds, status name or error) of one Check."""
    t0 = time.monotonic()
    try:
        reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=HEALTH_DEADLINE_S)
        status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    except grpc.RpcError as error:
        status = rpc_error_text(error)
    return time.monotonic() - t0, status


@rules.rule("health.serving", f'grpc.health.v1 answers SERVING for "" and "{SERVICE_NAME}"')
def health_serving(ctx: ExecutorContext) -> str:
    for service in ("", SERVICE_NAME):
        elapsed, status = health_check(ctx.health, service)
        require(status == "SERVING", f"Check(service={service!r}) gave {status}")
        require(elapsed <= HEALTH_DEADLINE_S, f"Check(service={service!r}) took {elapsed:.2f} s")
    return f'"" and "{SERVICE_NAME}" are SERVING'


@rules.rule("health.during_execute",
            f"health answers within {HEALTH_DEADLINE_S:.0f} s and Describe within {DESCRIBE_DEADLINE_S:.0f} s "
            "while long Executes run")
def health_during_execute(ctx: ExecutorContext) -> str:
    info = ctx.info
    bs, L = info.block_size, info.max_model_len
    cap = min(BUSY_MAX_TOKENS, (info.num_blocks - 1) * bs)
    seq_len = min(L, cap)
    per_seq = blocks_for(seq_len, bs)
    tables = [ctx.take(per_seq) for _ in range(max(1, min(cap // seq_len, (info.num_blocks - 1) // per_seq)))]
    cap = min(cap, len(tables) * seq_len)
    prompts = [ctx.tokens(seq_len) for _ in tables]

    def batch(total: int) -> list[pb.ExecuteSequence]:
        out = []
        for i, table in enumerate(tables):
            n = min(seq_len, total - i * seq_len)
            if n <= 0:
                break
            out.append(sequence(ctx.seq_id(), prompts[i][:n], 0, table[:blocks_for(n, bs)], greedy(0)))
        return out

    durations: list[tuple[int, float]] = []
    errors: list[str] = []
    in_flight = threading.Event()

    def worker() -> None:
        # Executes of growing size (one at a time) until one takes the health deadline or
        # the cap is reached, and at least BUSY_SECONDS have passed.
        size, start = min(cap, max(bs, 64)), time.monotonic()
        while not errors:
            in_flight.set()
            t0 = time.monotonic()
            try:
                ctx.execute(batch(size))
            except grpc.RpcError as error:
                errors.append(rpc_error_text(error))
            finally:
                in_flight.clear()
            took = time.monotonic() - t0
            durations.append((size, took))
            if time.monotonic() - start >= BUSY_SECONDS and (took >= HEALTH_DEADLINE_S or size >= cap):
                break
            if took < HEALTH_DEADLINE_S:
                size = min(cap, 2 * size)

    # A second channel: the health checks do not share the Executes' connection.
    with grpc.insecure_channel(ctx.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        describe = executor_pb2_grpc.ExecutorStub(channel)
        grpc.channel_ready_future(channel).result(timeout=ctx.connect_timeout)
        thread = threading.Thread(target=worker, daemon=True)
        thread.start()
        health_times: list[float] = []
        describe_times: list[float] = []
        during = 0
        problems: list[str] = []
        while thread.is_alive() and not problems:
            busy_before = in_flight.is_set()
            elapsed, status = health_check(health, "")
            health_times.append(elapsed)
            if status != "SERVING" or elapsed > HEALTH_DEADLINE_S:
                problems.append(f"health Check gave {status} after {elapsed:.2f} s during an Execute")
            t0 = time.monotonic()
            try:
                describe.Describe(pb.DescribeRequest(), timeout=DESCRIBE_DEADLINE_S)
            except grpc.RpcError as error:
                problems.append(f"Describe during an Execute: {rpc_error_text(error)}")
            describe_times.append(time.monotonic() - t0)
            during += busy_before and in_flight.is_set()
            time.sleep(0.02)
        thread.join(timeout=ctx.timeout)
    require(not errors, f"the long Execute failed: {errors[0]}" if errors else "")
    require(not problems, "; ".join(problems[:2]))
    size, longest = max(durations, key=lambda d: d[1])
    detail = (f"{len(health_times)} health checks (max {max(health_times, default=0) * 1e3:.0f} ms) and Describes "
              f"(max {max(describe_times, default=0) * 1e3:.0f} ms), {during} of them inside an Execute; "
              f"{len(durations)} Executes, the longest {longest:.2f} s ({size} tokens)")
    if longest < HEALTH_DEADLINE_S:
        detail += f"; no Execute of up to {cap} tokens lasted {HEALTH_DEADLINE_S:.0f} s, so this proves little"
    return detail


# ---- execute: shape and determinism ------------------------------------------------------


@rules.rule("execute.response_shape",
            "ExecuteResponse: one sampled token per sample=true sequence in order, top_logprobs aligned and "
            "sorted, greedy = argmax, num_tokens = tokens computed")
def execute_response_shape(ctx: ExecutorContext) -> str:
    info, bs = ctx.info, ctx.block_size
    lens = [min(5, info.max_model_len), min(3, info.max_model_len), min(bs + 2, info.max_model_len)]
    tables = [ctx.take(blocks_for(n, bs)) for n in lens]
    seqs = [
        sequence(ctx.seq_id(), ctx.tokens(lens[0]), 0, tables[0], greedy(3)),
        sequence(ctx.seq_id(), ctx.tokens(lens[1]), 0, tables[1]),  # not sampled
        sequence(ctx.seq_id(), ctx.tokens(lens[2]), 0, tables[2], greedy(0)),
    ]
    reply = ctx.execute(seqs)
    problems = []
    if len(reply.sampled_token_ids) != 2:
        problems.append(f"{len(reply.sampled_token_ids)} sampled_token_ids for 2 sampled sequences")
    if len(reply.sampled_logprobs) != len(reply.sampled_token_ids):
        problems.append("sampled_logprobs not index-aligned with sampled_token_ids")
    if len(reply.top_logprobs) != 2:
        problems.append(f"{len(reply.top_logprobs)} top_logprobs entries, expected 2 (one per sampled sequence)")
    else:
        first, second = reply.top_logprobs
        if len(first.token_ids) != 3 or len(first.logprobs) != 3:
            problems.append(f"top_logprobs[0] has {len(first.token_ids)} tokens / {len(first.logprobs)} logprobs, "
                            "expected 3")
        if len(second.token_ids) or len(second.logprobs):
            problems.append("top_logprobs[1] is not empty for a sequence that asked for none")
        lps = list(first.logprobs)
        if lps != sorted(lps, reverse=True):
            problems.append(f"top_logprobs[0] not most likely first: {lps}")
        if any(not 0 <= t < info.vocab_size for t in first.token_ids):
            problems.append(f"top_logprobs[0] token ids outside the vocabulary: {list(first.token_ids)}")
        if reply.sampled_token_ids and first.token_ids and len(lps) >= 2 and lps[0] - lps[1] > 1e-6:
            if reply.sampled_token_ids[0] != first.token_ids[0]:
                problems.append(f"greedy token {reply.sampled_token_ids[0]} is not the top-1 "
                                f"token {first.token_ids[0]}")
        if reply.sampled_logprobs and lps and not ctx.tolerance.close(reply.sampled_logprobs[0], lps[0]):
            problems.append(f"greedy logprob {reply.sampled_logprobs[0]} != top-1 logprob {lps[0]}")
    if any(not 0 <= t < info.vocab_size for t in reply.sampled_token_ids):
        problems.append(f"sampled token outside the vocabulary: {list(reply.sampled_token_ids)}")
    if any(not (lp <= 1e-4) for lp in reply.sampled_logprobs):
        problems.append(f"log-probabilities above 0: {list(reply.sampled_logprobs)}")
    if reply.num_tokens != sum(lens):
        problems.append(f"num_tokens {reply.num_tokens}, expected {sum(lens)}")
    plain = ctx.execute([sequence(ctx.seq_id(), ctx.tokens(2), 0, tables[0][:blocks_for(2, bs)], greedy(0))])
    if len(plain.top_logprobs):
        problems.append("top_logprobs not empty when no sequence asked for them")
    require(not problems, "; ".join(problems))
    return "sampled tokens, logprobs, top_logprobs and num_tokens as the proto says"


@rules.rule("execute.repeatable", "the reference run again in the same blocks gives the same tokens and logprobs")
def execute_repeatable(ctx: ExecutorContext) -> str:
    ref = ctx.reference()
    table = ref.table if not set(ref.table) & ctx._reserved else ctx.take(ctx.seq_blocks)
    again = ctx.run_reference(ref.prompt, table)
    comparison = Comparison(ctx.tolerance)
    comparison.add_all(ref.steps, again.steps, "second run")
    return comparison.verdict()


@rules.rule("execute.stream",
            "ExecuteStream (optional): the reference run as messages on one stream gives Execute's tokens and "
            "logprobs, one reply per step in order; a refused step ends the stream with INVALID_ARGUMENT")
def execute_stream(ctx: ExecutorContext) -> str:
    ref = ctx.reference()
    steps = reference_steps(ctx, ref)
    try:
        replies = list(ctx.stub.ExecuteStream(iter(steps), timeout=ctx.timeout))
    except grpc.RpcError as error:
        if error.code() == grpc.StatusCode.UNIMPLEMENTED:
            raise Skip("ExecuteStream is not implemented (the gateway then calls Execute)") from error
        raise Fail(f"ExecuteStream failed: {rpc_error_text(error)}") from error
    require(len(replies) == len(steps), f"{len(replies)} replies to {len(steps)} steps")
    for reply in replies:
        ctx.instance_ids[reply.instance_id] += 1
    comparison = Comparison(ctx.tolerance)
    comparison.add_all(ref.steps, [sampled_from(reply, 0) for reply in replies], "on a stream")
    verdict = comparison.verdict()
    expect_status(lambda: list(ctx.stub.ExecuteStream(iter([out_of_vocabulary_step(ctx), steps[0]]),
                                                      timeout=ctx.timeout)),
                  grpc.StatusCode.INVALID_ARGUMENT, "a step with a token outside the vocabulary")
    return verdict


def reference_steps(ctx: ExecutorContext, ref: Reference) -> list[pb.ExecuteRequest]:
    """The reference run's steps (teacher-forced) for a new sequence in fresh blocks, one request each."""
    table, seq_id = ctx.take(ctx.seq_blocks), ctx.seq_id()
    steps = [pb.ExecuteRequest(sequences=[sequence(seq_id, ref.prompt, 0, table, greedy())])]
    return steps + [pb.ExecuteRequest(sequences=[sequence(seq_id, [token], len(ref.prompt) + i, table, greedy())])
                    for i, token in enumerate(ref.fed)]


def out_of_vocabulary_step(ctx: ExecutorContext) -> pb.ExecuteRequest:
    return pb.ExecuteRequest(sequences=[sequence(ctx.seq_id(), [ctx.info.vocab_size], 0, ctx.take(1))])


@rules.rule("execute.step_socket",
            "the step socket (optional; SKIP where Describe offers none or it is on another host): the greeting "
            "names Describe's instance_id, the reference run on it gives Execute's tokens and logprobs, a refused "
            "step answers INVALID_ARGUMENT and the connection serves the next step")
def execute_step_socket(ctx: ExecutorContext) -> str:
    if not ctx.info.step_socket:
        raise Skip("Describe offers no step socket")
    client = open_greeted(ctx.info.step_socket, ctx.info.instance_id, "the step socket", "Describe's", ctx.timeout)
    try:
        ref = ctx.reference()
        steps, refused = reference_steps(ctx, ref), out_of_vocabulary_step(ctx)
        replies = []
        for i, step in enumerate(steps):
            if i == 1:
                status, body = client.step(refused)
                require(status == INVALID.value[0], f"a token outside the vocabulary answered status {status}")
            status, body = client.step(step)
            require(status == 0, f"step {i} answered status {status}: {body[:200].decode(errors='replace')}")
            replies.append(pb.ExecuteResponse.FromString(body))
    finally:
        client.close()
    comparison = Comparison(ctx.tolerance)
    comparison.add_all(ref.steps, [sampled_from(reply, 0) for reply in replies], "on the step socket")
    return comparison.verdict()


# ---- layout independence -----------------------------------------------------------------


@rules.rule("layout.scattered_blocks",
            "contiguous vs scattered (shuffled, non-contiguous) block ids: same tokens and logprobs")
def layout_scattered(ctx: ExecutorContext) -> str:
    ref = ctx.reference()
    table = ctx.take_scattered(ctx.seq_blocks)
    ctx.write_garbage(table)
    seq_id = ctx.seq_id()
    got = [ctx.prefill_greedy(seq_id, ref.prompt, 0, table)]
    got += ctx.decode_forced(seq_id, table, len(ref.prompt), ref.fed)
    comparison = Comparison(ctx.tolerance)
    comparison.add_all(ref.steps, got, f"block table {table}")
    return comparison.verdict()


def chunk_cuts(n: int) -> list[int]:
    """Chunk boundaries inside [1, n) for a chunked prefill (uneven, crossing block edges)."""
    return sorted({c for c in (max(1, n // 9), n // 3 + 1, (2 * n) // 3 - 1) if 0 < c < n})


@rules.rule("layout.chunked_prefill",
            "one-shot prefill vs chunked prefill (several Executes, start_position advancing, minimal block "
            "tables, sampling only at the end)")
def layout_chunked(ctx: ExecutorContext) -> str:
    ref = ctx.reference()
    bs = ctx.block_size
    table = ctx.take(ctx.seq_blocks)
    ctx.write_garbage(table)
    seq_id = ctx.seq_id()
    bounds = [0, *chunk_cuts(len(ref.prompt)), len(ref.prompt)]
    for a, b in zip(bounds[:-2], bounds[1:-1]):
        reply = ctx.execute([sequence(seq_id, ref.prompt[a:b], a, table[:blocks_for(b, bs)])])
        require(len(reply.sampled_token_ids) == 0, "a chunk with sample=false returned a sampled token")
    a = bounds[-2]
    got = [ctx.prefill_greedy(seq_id, ref.prompt[a:], a, table[:blocks_for(len(ref.prompt), bs)])]
    got += ctx.decode_forced(seq_id, table, len(ref.prompt), ref.fed)
    comparison = Comparison(ctx.tolerance)
    comparison.add_all(ref.steps, got, f"chunks {[b - a for a, b in zip(bounds, bounds[1:])]}")
    return comparison.verdict()


@rules.rule("layout.block_copy",
            "copy_src/copy_dst run before the forward: continuing from copied blocks gives the reference; "
            "the sources stay intact")
def layout_block_copy(ctx: ExecutorContext) -> str:
    ref = ctx.reference()
    bs, n = ctx.block_size, len(ref.prompt)
    # The writer computes a prefix that ends inside a block (when block_size > 1).
    prefix = ((n - 1) // bs) * bs - bs // 2 if bs > 1 else n - 2
    prefix = max(1, min(prefix, n - 1))
    last = (prefix - 1) // bs
    copied = sorted({last, max(0, last - 1)})
    writer = ctx.take(ctx.seq_blocks)
    fresh = ctx.take(len(copied))
    tail = ctx.take(ctx.seq_blocks - last - 1)
    ctx.write_garbage(fresh + tail)
    writer_id = ctx.seq_id()
    ctx.execute([sequence(writer_id, ref.prompt[:prefix], 0, writer[:blocks_for(prefix, bs)])])
    table = writer[:ctx.seq_blocks]
    for i, dst in zip(copied, fresh):
        table[i] = dst
    table[last + 1:] = tail
    reader_id = ctx.seq_id()
    # The copy and the first read of the copies in one Execute: copies come first.
    first = sampled_from(ctx.execute([sequence(reader_id, ref.prompt[prefix:], prefix, table, greedy())],
                                     copy_src=[writer[i] for i in copied], copy_dst=fresh), 0)
    got = [first] + ctx.decode_forced(reader_id, table, n, ref.fed)
    comparison = Comparison(ctx.tolerance)
    comparison.add_all(ref.steps, got, f"copies {[writer[i] for i in copied]}->{fresh}")
    # The writer continues from its own (source) blocks: the copy and the reader's writes
    # into the destinations left them as they were.
    source = [ctx.prefill_greedy(writer_id, ref.prompt[prefix:], prefix, writer)]
    comparison.add_all(ref.steps[:1], source, "source blocks")
    return comparison.verdict()


@rules.rule("layout.prefix_from_earlier_step",
            "a sequence whose block table starts with full blocks another sequence wrote in an earlier Execute, "
            "computing only its tail, gives the reference")
def layout_prefix(ctx: ExecutorContext) -> str:
    ref = ctx.reference()
    bs, n = ctx.block_size, len(ref.prompt)
    full = (n - 1) // bs
    if full == 0:
        raise Skip("the reference prompt has no full block")
    owner_table = ctx.take(ctx.seq_blocks)
    own_tail = ctx.take(ctx.seq_blocks - full)
    ctx.write_garbage(own_tail)
    # The owner shares the first `full` blocks' tokens and continues differently.
    owner_prompt = ref.prompt[:full * bs] + ctx.tokens(n - full * bs)
    ctx.prefill_greedy(ctx.seq_id(), owner_prompt, 0, owner_table)
    table = owner_table[:full] + own_tail
    seq_id = ctx.seq_id()
    got = [ctx.prefill_greedy(seq_id, ref.prompt[full * bs:], full * bs, table)]
    got += ctx.decode_forced(seq_id, table, n, ref.fed)
    comparison = Comparison(ctx.tolerance)
    comparison.add_all(ref.steps, got, f"{full} shared blocks")
    return comparison.verdict()


# ---- batching independence ---------------------------------------------------------------


@rules.rule("batching.mixed",
            "a sequence alone vs in batches with other sequences (prefill chunks and decodes mixed, in varying "
            "order): same tokens and logprobs")
def batching_mixed(ctx: ExecutorContext) -> str:
    ref = ctx.reference()
    bs, n = ctx.block_size, len(ref.prompt)
    # Z: a shorter sequence that is already decoding when X arrives.
    z_len = max(1, n // 2 + 1)
    z_blocks = blocks_for(z_len + DECODE_STEPS + 1, bs)
    ref_z = ctx.run_reference(ctx.tokens(z_len), ctx.take(z_blocks))
    # Y: a third sequence in prefill chunks, then decoding on its own tokens (not compared).
    y_len = max(2, n - 3)
    y_prompt = ctx.tokens(y_len)
    y_table = ctx.take(blocks_for(y_len + DECODE_STEPS + 1, bs))
    x_table = ctx.take(ctx.seq_blocks)
    z_table = ctx.take(z_blocks)
    ctx.write_garbage(x_table + z_table)
    x_id, y_id, z_id = ctx.seq_id(), ctx.seq_id(), ctx.seq_id()
    comparison = Comparison(ctx.tolerance)
    # Z's prefill runs alone, as in its reference.
    comparison.add(ref_z.steps[0], ctx.prefill_greedy(z_id, ref_z.prompt, 0, z_table), "Z prefill")
    y_cut = max(1, y_len // 2)
    y_next, y_pos = y_prompt[y_cut:], y_cut
    # Step 1: [Y chunk (no sample), X prefill, Z decode].
    reply = ctx.execute([sequence(y_id, y_prompt[:y_cut], 0, y_table),
                         sequence(x_id, ref.prompt, 0, x_table, greedy()),
                         sequence(z_id, [ref_z.steps[0].token], z_len, z_table, greedy())])
    comparison.add(ref.steps[0], sampled_from(reply, 0), "X prefill in a batch")
    comparison.add(ref_z.steps[1], sampled_from(reply, 1), "Z decode in a batch")
    # Decode steps of X and Z, with Y's rest and then Y's decodes; the order rotates.
    for i in range(DECODE_STEPS):
        parts = [
            ("x", sequence(x_id, [ref.steps[i].token], n + i, x_table, greedy())),
            ("y", sequence(y_id, y_next, y_pos, y_table, greedy())),
        ]
        if i + 1 < DECODE_STEPS:
            parts.append(("z", sequence(z_id, [ref_z.steps[i + 1].token], z_len + i + 1, z_table, greedy())))
        parts = parts[i % len(parts):] + parts[:i % len(parts)]
        reply = ctx.execute([p for _, p in parts])
        for k, (name, _) in enumerate(parts):
            result = sampled_from(reply, k)
            if name == "x":
                comparison.add(ref.steps[i + 1], result, f"X decode {i + 1} in a batch")
            elif name == "z":
                comparison.add(ref_z.steps[i + 2], result, f"Z decode {i + 2} in a batch")
            else:
                y_pos += len(y_next)
                y_next = [result.token]
    return comparison.verdict()


# ---- sampling ----------------------------------------------------------------------------


@rules.rule("sampling.suppressed", "suppressed_token_ids are never sampled (greedy picks the next best)")
def sampling_suppressed(ctx: ExecutorContext) -> str:
    ref = ctx.reference()
    table = ctx.take(ctx.seq_blocks)
    banned = ref.steps[0].token
    got = sampled_from(ctx.execute([sequence(ctx.seq_id(), ref.prompt, 0, table,
                                             greedy(suppressed_token_ids=[banned]))]), 0)
    require(got.token != banned, f"sampled the suppressed token {banned}")
    # The best of the rest (not necessarily top[1]: the greedy token may tie with another).
    rest = [(token, logprob) for token, logprob in ref.steps[0].top if token != banned]
    if len(rest) >= 2 and rest[0][1] - rest[1][1] > 2 * ctx.tolerance.bound(rest[0][1]):
        require(got.token == rest[0][0], f"sampled {got.token}, expected the next best {rest[0][0]}")
        return f"suppressing {banned} gave the next best {got.token}"
    return f"suppressing {banned} gave {got.token}"


SEEDS = ((1 << 64) - 1 - 12345, 0)  # one beyond int64 (read it as uint64), and 0 (a set seed of 0 is a seed)


def seeded(seed: int) -> pb.SamplingParams:
    return pb.SamplingParams(temperature=1.0, seed=seed, top_logprobs=TOPK)


@rules.rule("sampling.seeded",
            "temperature 1 with a seed: the same (seed, position) gives the same token alone, repeated, and in "
            "any batch (after unseeded draws)")
def sampling_seeded(ctx: ExecutorContext) -> str:
    ref = ctx.reference()
    bs, n = ctx.block_size, len(ref.prompt)
    tables = [ctx.take(ctx.seq_blocks) for _ in range(3)]
    short = max(1, n // 3)
    other_tables = [ctx.take(blocks_for(short + 1, bs)) for _ in range(2)]
    comparison = Comparison(ctx.tolerance)
    summary = []
    for seed in SEEDS:
        alone = sampled_from(ctx.execute([sequence(ctx.seq_id(), ref.prompt, 0, tables[0], seeded(seed))]), 0)
        again = sampled_from(ctx.execute([sequence(ctx.seq_id(), ref.prompt, 0, tables[1], seeded(seed))]), 0)
        require(again.token == alone.token,
                f"seed {seed}: the same request twice sampled {alone.token} then {again.token}")
        # In a batch: an unseeded draw first, another sequence with the same seed at another
        # position, then the sequence itself.
        batch = [sequence(ctx.seq_id(), ctx.tokens(short), 0, other_tables[0], pb.SamplingParams(temperature=1.0)),
                 sequence(ctx.seq_id(), ctx.tokens(short + 1), 0, other_tables[1], seeded(seed)),
                 sequence(ctx.seq_id(), ref.prompt, 0, tables[2], seeded(seed))]
        in_batch = sampled_from(ctx.execute(batch), 2)
        require(in_batch.token == alone.token,
                f"seed {seed}: sampled {alone.token} alone but {in_batch.token} in a batch")
        comparison.add(alone, in_batch, f"seed {seed} in a batch")
        # A decode step: position n, alone and in a batch behind an unseeded draw.
        step_alone = sampled_from(ctx.execute([sequence(ctx.seq_id(), [alone.token], n, tables[0],
                                                        seeded(seed))]), 0)
        step_batch = ctx.execute([
            sequence(ctx.seq_id(), ctx.tokens(1), short, other_tables[0], pb.SamplingParams(temperature=1.0)),
            sequence(ctx.seq_id(), [alone.token], n, tables[2], seeded(seed))])
        require(sampled_from(step_batch, 1).token == step_alone.token,
                f"seed {seed}, decode at position {n}: {step_alone.token} alone, "
                f"{sampled_from(step_batch, 1).token} in a batch")
        summary.append(f"seed {seed}: {alone.token}, {step_alone.token}")
    comparison.verdict()
    return "same tokens alone, repeated and in batches (" + "; ".join(summary) + ")"


# ---- logit edits: bitmask, logit_bias, penalties --------------------------------------------


def bitmask(allowed, vocab_size: int, padded: bool = False, junk: bool = False) -> bytes:
    """An ``allowed_token_bitmask`` (token t: bit t % 8 of byte t // 8) of ceil(vocab / 8) bytes, or
    rounded up to 4 (``padded``); ``junk`` sets every bit past the vocabulary (to be ignored)."""
    need = -(-vocab_size // 8)
    out = bytearray(-(-need // 4) * 4 if padded else need)
    for token in allowed:
        out[token // 8] |= 1 << (token % 8)
    if junk:
        for token in range(vocab_size, len(out) * 8):
            out[token // 8] |= 1 << (token % 8)
    return bytes(out)


def constraint_setup(ctx: ExecutorContext) -> tuple[Reference, list[int], list[tuple[int, float]], list[int]]:
    """(reference, a table for the reference prompt, its top-5 after the prompt, 3 tokens outside it)."""
    ref = ctx.reference()
    top = list(ref.steps[0].top)
    if ctx.info.vocab_size < 16 or len(top) < TOPK:
        raise Skip(f"needs vocab_size >= 16 and {TOPK} top logprobs (the reference has {len(top)})")
    listed = {token for token, _ in top}
    outside: list[int] = []
    while len(outside) < 3:
        token = ctx.rng.randrange(ctx.info.vocab_size)
        if token not in listed and token not in outside:
            outside.append(token)
    return ref, ctx.take(ctx.seq_blocks), top, outside


def clear_gap(ctx: ExecutorContext, better: float, worse: float) -> bool:
    return better - worse > 2 * ctx.tolerance.bound(better)


@rules.rule("sampling.bitmask",
            "allowed_token_bitmask: greedy and seeded draws pick allowed tokens only (greedy the best of them); "
            "a bitmask allowing one token yields it with logprob 0; padding to 4 bytes and bits past the "
            "vocabulary are accepted and ignored")
def sampling_bitmask(ctx: ExecutorContext) -> str:
    ref, table, top, outside = constraint_setup(ctx)
    V = ctx.info.vocab_size

    def pick(sampling: pb.SamplingParams) -> Sampled:
        return sampled_from(ctx.execute([sequence(ctx.seq_id(), ref.prompt, 0, table, sampling)]), 0)

    # A few allowed: the reference's 3rd and 4th best and three tokens outside its top 5.
    allowed = {top[2][0], top[3][0], *outside}
    best = pick(greedy(0, allowed_token_bitmask=bitmask(allowed, V))).token
    require(best in allowed, f"greedy sampled {best}, outside the allowed {sorted(allowed)}")
    if clear_gap(ctx, top[2][1], top[3][1]):
        require(best == top[2][0], f"greedy sampled {best}, expected the best allowed {top[2][0]}")
    draws = []
    for i, seed in enumerate(SEEDS + (7,)):
        mask = bitmask(allowed, V, padded=i > 0, junk=i == 2)
        draws.append(pick(pb.SamplingParams(temperature=1.0, seed=seed, allowed_token_bitmask=mask)).token)
    require(set(draws) <= allowed, f"seeded draws {draws}, outside the allowed {sorted(allowed)}")
    # Exactly one allowed: it is sampled, greedy or not, with probability 1.
    only = outside[0]
    for sampling in (greedy(0, allowed_token_bitmask=bitmask([only], V, padded=True, junk=True)),
                     pb.SamplingParams(temperature=1.0, seed=SEEDS[0], allowed_token_bitmask=bitmask([only], V))):
        got = pick(sampling)
        kind = "greedy" if sampling.temperature == 0 else "seeded"
        require(got.token == only, f"a bitmask allowing only {only}: {kind} sampled {got.token}")
        require(ctx.tolerance.close(got.logprob, 0.0),
                f"a bitmask allowing only {only}: logprob {got.logprob:.6g}, expected 0 (after the bitmask)")
    return f"greedy {best} and seeded draws {draws} among {sorted(allowed)}; only {only} allowed gave {only}"


@rules.rule("sampling.bitmask_invalid",
            "an allowed_token_bitmask of the wrong length, allowing nothing, or whose allowed tokens are all "
            "suppressed is INVALID_ARGUMENT naming it; the executor keeps serving")
def sampling_bitmask_invalid(ctx: ExecutorContext) -> str:
    ref, table, _, outside = constraint_setup(ctx)
    V = ctx.info.vocab_size
    need, most = len(bitmask([], V)), len(bitmask([], V, padded=True))
    past = " (every bit past the vocabulary set)" if most * 8 > V else ""
    cases = [(f"a bitmask of {most + 1} bytes (at most {most})", bitmask([0], V, padded=True) + b"\x00", ()),
             ("a bitmask allowing no token" + past, bitmask([], V, padded=True, junk=True), ()),
             ("a bitmask whose only allowed token is suppressed", bitmask([outside[0]], V), (outside[0],))]
    if need > 1:
        cases.insert(0, (f"a bitmask of {need - 1} bytes (at least {need})", bitmask([0], V)[:need - 1], ()))
    for what, mask, suppressed in cases:
        sampling = greedy(0, allowed_token_bitmask=mask, suppressed_token_ids=list(suppressed))
        request = pb.ExecuteRequest(sequences=[sequence(ctx.seq_id(), ref.prompt, 0, table, sampling)])
        error = expect_status(lambda r=request: ctx.stub.Execute(r, timeout=ctx.timeout), INVALID, what)
        require("allowed_token_bitmask" in (error.details() or ""),
                f"{what}: INVALID_ARGUMENT does not name allowed_token_bitmask: {error.details()!r}")
    comparison = Comparison(ctx.tolerance)
    comparison.add(ref.steps[0], ctx.prefill_greedy(ctx.seq_id(), ref.prompt, 0, table), "after the rejected calls")
    comparison.verdict()
    return f"{len(cases)} refused ({'; '.join(what for what, _, _ in cases)}); the next step agrees"


def logprob_after_shift(top: list[tuple[int, float]], index: int, shift: float, of: int) -> float:
    """The logprob of ``top[of]`` after adding ``shift`` to ``top[index]``'s logit (temperature 0:
    logprob differences are logit differences; the normalizer changes by 1 - p + p·e^shift)."""
    p = math.exp(top[index][1])
    log_norm = math.log1p(p * math.expm1(shift))
    return top[of][1] + (shift if of == index else 0.0) - log_norm


def as_float32(value: float) -> float:
    return struct.unpack("f", struct.pack("f", value))[0]


@rules.rule("sampling.logit_bias",
            "logit_bias: +100 on a token outside the top 5 (and -100 on the greedy one) makes greedy pick it; a "
            "bias lifting the 2nd best 1 above the best makes it the pick, with the logprob that bias implies")
def sampling_logit_bias(ctx: ExecutorContext) -> str:
    ref, table, top, outside = constraint_setup(ctx)
    lifted = outside[1]
    sampling = greedy(0, logit_bias_token_ids=[lifted, top[0][0]], logit_bias_values=[100.0, -100.0])
    got = sampled_from(ctx.execute([sequence(ctx.seq_id(), ref.prompt, 0, table, sampling)]), 0)
    require(got.token == lifted, f"a bias of +100 on {lifted}: greedy sampled {got.token}")
    # The 2nd best lifted 1 above the best: the pick and its logprob follow from the reference's.
    shift = as_float32(top[0][1] - top[1][1] + 1.0)
    if shift > 100.0:
        return f"+100 on {lifted} gave {lifted} (the 2nd best is too far behind to lift it by <= 100)"
    sampling = greedy(0, logit_bias_token_ids=[top[1][0]], logit_bias_values=[shift])
    got = sampled_from(ctx.execute([sequence(ctx.seq_id(), ref.prompt, 0, table, sampling)]), 0)
    require(got.token == top[1][0], f"a bias of {shift:.4g} on the 2nd best {top[1][0]}: greedy sampled {got.token}")
    expected = logprob_after_shift(top, 1, shift, 1)
    require(ctx.tolerance.close(got.logprob, expected),
            f"a bias of {shift:.4g} on {top[1][0]}: logprob {got.logprob:.6g}, expected {expected:.6g} "
            "(log-softmax after the bias)")
    return f"+100 on {lifted} gave {lifted}; {shift:+.3g} on {top[1][0]} gave it with logprob {got.logprob:.4g}"


@rules.rule("sampling.penalties",
            "penalties: frequency 2 x count 50 on the greedy token moves the pick off it (presence spares a listed "
            "token of count 0); presence 2 alone lowers the greedy token's logit by 2, as its logprob shows")
def sampling_penalties(ctx: ExecutorContext) -> str:
    ref, table, top, _ = constraint_setup(ctx)
    best, second = top[0][0], top[1][0]

    def pick(**penalties) -> Sampled:
        sampling = greedy(0, **penalties)
        return sampled_from(ctx.execute([sequence(ctx.seq_id(), ref.prompt, 0, table, sampling)]), 0)

    got = pick(frequency_penalty=2.0, presence_penalty=2.0, penalty_token_ids=[best, second],
               penalty_output_counts=[50, 0])
    require(got.token != best, f"frequency 2 x 50 on the greedy token {best}: still sampled it")
    if clear_gap(ctx, top[1][1], top[2][1]):
        require(got.token == second, f"the greedy token {best} penalized, {second} listed with count 0: sampled "
                                     f"{got.token}, expected {second} (presence applies to counts > 0 only)")
    # Presence alone, count 1: the best logit drops by 2.
    got = pick(presence_penalty=2.0, penalty_token_ids=[best], penalty_output_counts=[1])
    winner = 0 if top[0][1] - 2.0 > top[1][1] else 1
    if clear_gap(ctx, *sorted((top[0][1] - 2.0, top[1][1]), reverse=True)):
        require(got.token == top[winner][0], f"presence 2 on {best}: sampled {got.token}, expected {top[winner][0]}")
    if got.token == top[winner][0]:
        expected = logprob_after_shift(top, 0, -2.0, winner)
        require(ctx.tolerance.close(got.logprob, expected),
                f"presence 2 on {best}: logprob of {got.token} {got.logprob:.6g}, expected {expected:.6g}")
    return f"frequency moved the pick off {best}; presence 2 gave {got.token} (logprob {got.logprob:.4g})"


# ---- bad batches -------------------------------------------------------------------------


def make_invalid_rule(case: str, summary: str):
    def check(ctx: ExecutorContext) -> str:
        victim = ctx.victim()
        _, request, fields = ctx.bad_cases[case]
        error = expect_status(lambda: ctx.stub.Execute(request, timeout=ctx.timeout), INVALID, summary)
        details = error.details() or ""
        damage = victim.intact()
        require(damage is None, f"rejected, but A read back through its block table no longer gives the "
                                f"reference (its KV changed?): {damage}")
        require(any(f in details for f in fields),
                f"INVALID_ARGUMENT does not name the field ({' or '.join(fields)}): {details!r}")
        return f"INVALID_ARGUMENT ({details[:100]}); A's KV intact"
    return check


INVALID_CASES = (
    ("empty_batch", "an empty batch"),
    ("empty_token_ids", "a sequence with no token_ids"),
    ("token_id_vocab", "a token id >= vocab_size"),
    ("token_id_negative", "a negative token id"),
    ("block_id_range", "a block id >= num_blocks"),
    ("block_table_short", "a block table too short"),
    ("max_model_len", "positions beyond max_model_len"),
    ("copy_dst_repeated", "a repeated copy destination"),
    ("copy_dst_is_source", "a copy destination that is also a source"),
    ("copy_lengths", "copy lists of different lengths"),
    ("copy_block_range", "a copy block id >= num_blocks"),
    ("mixed_batch", "valid writes and copies into A next to an invalid sequence"),
)


for _case, _summary in INVALID_CASES:
    rules.add(f"invalid.{_case}",
              f"{_summary} is INVALID_ARGUMENT naming the field, and writes/copies nothing (A's KV intact)",
              make_invalid_rule(_case, _summary))


# ---- instance id -------------------------------------------------------------------------


@rules.rule("execute.instance_id",
            "every ExecuteResponse.instance_id equals Describe.instance_id, which did not change")
def execute_instance_id(ctx: ExecutorContext) -> str:
    info = ctx.info
    if not ctx.instance_ids:
        ctx.prefill_greedy(ctx.seq_id(), ctx.tokens(1), 0, ctx.take(1))
    now = ctx.describe()
    require(now.instance_id == info.instance_id,
            f"Describe.instance_id changed during the run: {info.instance_id!r} -> {now.instance_id!r} "
            "(did the executor restart?)")
    wrong = {k: v for k, v in ctx.instance_ids.items() if k != info.instance_id}
    require(not wrong, f"ExecuteResponse.instance_id differs from Describe's {info.instance_id!r}: "
                       + ", ".join(f"{k!r} x{v}" for k, v in list(wrong.items())[:3]))
    return f"{sum(ctx.instance_ids.values())} ExecuteResponses carried {info.instance_id!r}"


NOTES = (
    ("sampling.unchecked",
     "not checked: repetition_penalty (its effect depends on the sign of a logit, which logprobs do not show), "
     "min_p, top_k and top_p"),
    ("layout.same_step_visibility",
     "not checked: a batch in which one sequence reads KV that another sequence of the same Execute writes "
     "(the proto lets an executor run a batch's sequences in any order, so such a batch has no defined result)"),
)
