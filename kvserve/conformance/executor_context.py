"""The executor conformance kit's context: its connection to the executor, the blocks each rule
takes, the reference run, and sequence A with the bad requests of the ``invalid.*`` rules.

The rules themselves are in ``executor_checks`` (and ``draft_checks``, ``prompt_logprob_checks``,
``store_checks``).
"""
from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2_grpc

from kvserve.conformance import Skip, rpc_error_text
from kvserve.conformance.comparison import Comparison, Sampled, Tolerance, sampled_from
from kvserve.v1 import executor_pb2 as pb
from kvserve.v1 import executor_pb2_grpc

TOPK = 5
DECODE_STEPS = 4
DESCRIBE_DEADLINE_S = 3.0


def greedy(top_logprobs: int = TOPK, **extra) -> pb.SamplingParams:
    return pb.SamplingParams(temperature=0.0, top_logprobs=top_logprobs, **extra)


def sequence(seq_id: int, tokens: list[int], start: int, table: list[int], sampling: pb.SamplingParams | None = None
             ) -> pb.ExecuteSequence:
    """One ExecuteSequence; it samples when ``sampling`` is given."""
    return pb.ExecuteSequence(seq_id=seq_id, token_ids=tokens, start_position=start, block_table=table,
                              sample=sampling is not None, sampling=sampling)


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


# ---- the context -------------------------------------------------------------------------


@dataclass
class Reference:
    """The reference run: one prompt, prefilled in one Execute into contiguous blocks
    and decoded ``DECODE_STEPS`` steps, alone. ``steps[0]`` is the token sampled after
    the prompt, ``steps[i]`` the one after feeding ``steps[i-1].token``."""

    prompt: list[int]
    steps: list[Sampled]
    table: list[int]

    @property
    def fed(self) -> list[int]:
        """The tokens a teacher-forced decode feeds (all but the last sampled)."""
        return [s.token for s in self.steps[:-1]]


class ExecutorContext:
    def __init__(self, address: str, tolerance: Tolerance | None, timeout: float = 120.0, seed: int = 20240601,
                 connect_timeout: float = 30.0) -> None:
        self.address = address
        self.connect_timeout = connect_timeout
        self._tolerance = tolerance  # None: by Describe's dtype (Tolerance.for_dtype)
        self.timeout = timeout
        self.seed = seed
        options = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
        self.channel = grpc.insecure_channel(address, options=options)
        self.stub = executor_pb2_grpc.ExecutorStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self._info: pb.DescribeResponse | None = None
        self._describe_error: str | None = None
        self.instance_ids: Counter[str] = Counter()
        self.rng = random.Random(seed)
        self._next_seq_id = (1 << 63) + self.rng.randrange(1 << 32)  # beyond 2^53 on purpose
        self._ref: Reference | None = None
        self._blocks: list[int] = []
        self._reserved: set[int] = set()
        self._victim: Victim | None = None
        self.bad_cases: dict[str, tuple] = {}
        self.rule_name = ""

    def close(self) -> None:
        self.channel.close()

    @property
    def tolerance(self) -> Tolerance:
        return self._tolerance or Tolerance.for_dtype(self.info.dtype)

    # -- per rule --
    def begin_rule(self, name: str) -> None:
        self.rule_name = name
        if self._info is not None:
            self._blocks = [b for b in range(1, self._info.num_blocks) if b not in self._reserved]

    def take(self, n: int) -> list[int]:
        """``n`` block ids not yet used by the current rule (ascending)."""
        if n > len(self._blocks):
            raise Skip(f"needs more KV blocks than the executor's {self.info.num_blocks}")
        taken, self._blocks = self._blocks[:n], self._blocks[n:]
        return taken

    def take_scattered(self, n: int) -> list[int]:
        """``n`` block ids, non-contiguous (every other id, where the cache is large enough)
        and out of order."""
        picked = self.take(2 * n)[::2] if len(self._blocks) >= 2 * n else self.take(n)
        self.rng.shuffle(picked)
        if n > 1 and picked == sorted(picked):
            picked.reverse()
        return picked

    def victim(self) -> "Victim":
        """Sequence A and the bad requests, set up once for all invalid.* rules; their
        blocks are kept out of every later rule's reach."""
        if self._victim is None:
            victim = Victim(self)
            spare = self.take(3)
            self.write_garbage(spare)
            self._victim = victim
            self.bad_cases = bad_cases(self, victim, spare)
            self._reserved = set(victim.table) | set(spare)
        return self._victim

    def seq_id(self) -> int:
        self._next_seq_id += 1
        return self._next_seq_id

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(self.info.vocab_size) for _ in range(n)]

    # -- describe --
    def describe(self, timeout: float = DESCRIBE_DEADLINE_S) -> pb.DescribeResponse:
        return self.stub.Describe(pb.DescribeRequest(), timeout=timeout)

    @property
    def info(self) -> pb.DescribeResponse:
        if self._info is None and self._describe_error is None:  # describe.answers not selected (--only)
            try:
                grpc.channel_ready_future(self.channel).result(timeout=self.connect_timeout)
                self.set_info(self.describe())
            except (grpc.RpcError, grpc.FutureTimeoutError) as error:
                self._describe_error = rpc_error_text(error) if isinstance(error, grpc.RpcError) else "cannot connect"
        if self._info is None:
            raise Skip(f"needs Describe ({self._describe_error})")
        return self._info

    def set_info(self, info: pb.DescribeResponse) -> None:
        self._info = info
        self._blocks = list(range(1, info.num_blocks))

    # -- sizes --
    @property
    def block_size(self) -> int:
        return self.info.block_size

    @property
    def prompt_len(self) -> int:
        """Reference prompt length: three full blocks and half of one when everything fits,
        so that prefixes, copies and chunks cross block boundaries."""
        info = self.info
        bs = info.block_size
        target = 3 * bs + max(1, bs // 2)
        # the largest rule holds ~4 sequences of this size plus a few spare blocks at once
        max_blocks_per_seq = (info.num_blocks - 1 - 4) // 4
        target = min(target, info.max_model_len - DECODE_STEPS, max_blocks_per_seq * bs - DECODE_STEPS, 1024)
        if target < 2:
            raise Skip(f"the executor is too small (num_blocks={info.num_blocks}, block_size={bs}, "
                       f"max_model_len={info.max_model_len}) for sequences of {2 + DECODE_STEPS} tokens")
        return target

    @property
    def seq_blocks(self) -> int:
        """Blocks one reference-sized sequence (prompt + decode steps) needs."""
        return blocks_for(self.prompt_len + DECODE_STEPS, self.block_size)

    # -- execute --
    def execute(self, sequences: list[pb.ExecuteSequence], copy_src=(), copy_dst=(),
                timeout: float | None = None) -> pb.ExecuteResponse:
        request = pb.ExecuteRequest(sequences=sequences, copy_src=list(copy_src), copy_dst=list(copy_dst))
        reply = self.stub.Execute(request, timeout=timeout or self.timeout)
        self.instance_ids[reply.instance_id] += 1
        return reply

    def prefill_greedy(self, seq_id: int, tokens: list[int], start: int, table: list[int]) -> Sampled:
        return sampled_from(self.execute([sequence(seq_id, tokens, start, table, greedy())]), 0)

    def decode_forced(self, seq_id: int, table: list[int], start: int, fed: list[int]) -> list[Sampled]:
        """Teacher-forced decode: feeds ``fed`` one token a step from ``start``."""
        return [self.prefill_greedy(seq_id, [token], start + i, table) for i, token in enumerate(fed)]

    def write_garbage(self, table: list[int]) -> None:
        """Fills every slot of ``table``'s blocks with KV of random tokens (poisoning them)."""
        n = min(len(table) * self.block_size, self.info.max_model_len)
        if n:
            self.execute([sequence(self.seq_id(), self.tokens(n), 0, table[:blocks_for(n, self.block_size)])])

    def run_reference(self, prompt: list[int], table: list[int]) -> Reference:
        """Prefill ``prompt`` in one Execute, then decode greedily (free running), alone."""
        seq_id = self.seq_id()
        steps = [self.prefill_greedy(seq_id, prompt, 0, table)]
        for i in range(DECODE_STEPS):
            steps.append(self.prefill_greedy(seq_id, [steps[-1].token], len(prompt) + i, table))
        return Reference(prompt, steps, table)

    def reference(self) -> Reference:
        """The reference run (computed once, into blocks taken by the current rule)."""
        if self._ref is None:
            prompt = self.tokens(self.prompt_len)
            self._ref = self.run_reference(prompt, self.take(self.seq_blocks))
        return self._ref


# ---- sequence A and the bad batches of the invalid.* rules --------------------------------


class Victim:
    """Sequence A: the reference prompt's KV in its own blocks, and a probe that reads all of
    it (the reference's first decode step, which rewrites one slot with the same value)."""

    def __init__(self, ctx: ExecutorContext) -> None:
        self.ctx = ctx
        self.ref = ctx.reference()
        self.table = ctx.take(ctx.seq_blocks)
        self.write()

    def write(self) -> None:
        got = self.ctx.prefill_greedy(self.ctx.seq_id(), self.ref.prompt, 0, self.table)
        comparison = Comparison(self.ctx.tolerance)
        comparison.add(self.ref.steps[0], got, "writing A")
        comparison.verdict()

    def intact(self) -> str | None:
        """None when A's KV still gives the reference, else what changed (and A is rewritten)."""
        n = len(self.ref.prompt)
        got = self.ctx.prefill_greedy(self.ctx.seq_id(), [self.ref.steps[0].token], n, self.table)
        comparison = Comparison(self.ctx.tolerance)
        comparison.add(self.ref.steps[1], got, "A after the rejected call")
        if comparison.problems:
            self.write()
            return "; ".join(comparison.problems[:2])
        return None


def bad_cases(ctx: ExecutorContext, victim: Victim, spare: list[int]) -> dict[str, tuple]:
    """name -> (summary, request, fields the error should name)."""
    info, bs = ctx.info, ctx.block_size
    V, N, L = info.vocab_size, info.num_blocks, info.max_model_len
    n = len(victim.ref.prompt)
    a = victim.table
    g1, g2, g3 = spare
    # A valid sequence that would overwrite all of A's KV: in every bad batch, before the bad part.
    clobber = sequence(ctx.seq_id(), ctx.tokens(n), 0, a[:blocks_for(n, bs)])
    ok = sequence(ctx.seq_id(), ctx.tokens(1), 0, [g3], greedy(0))
    past_end = blocks_for(L + 1, bs)

    def req(sequences, copy_src=(), copy_dst=()):
        return pb.ExecuteRequest(sequences=sequences, copy_src=list(copy_src), copy_dst=list(copy_dst))

    def bad(tokens, start=0, table=(g3,)):
        return sequence(ctx.seq_id(), tokens, start, list(table), greedy(0))

    return {
        "empty_batch": ("an empty batch (with a copy into A's blocks)",
                        req([], [g1], [a[0]]), ("sequences",)),
        "empty_token_ids": ("a sequence with no token_ids", req([clobber, bad([])]), ("token_ids",)),
        "token_id_vocab": ("a token id == vocab_size", req([clobber, bad([1, V])]), ("token_ids",)),
        "token_id_negative": ("a token id of -1", req([clobber, bad([-1])]), ("token_ids",)),
        "block_id_range": ("a block id == num_blocks", req([clobber, bad([1] * (bs + 1), 0, [g3, N])]),
                           ("block_table",)),
        "block_table_short": ("a block table too short for the positions",
                              req([clobber, bad([1] * (bs + 1), 0, [g3])]), ("block_table",)),
        "max_model_len": ("start_position + len(token_ids) > max_model_len",
                          req([clobber, bad([1, 1], L - 1, [g3] * past_end)]),
                          ("start_position", "token_ids", "max_model_len")),
        "copy_dst_repeated": ("a copy destination repeated (into A's block)",
                              req([ok], [g1, g2], [a[0], a[0]]), ("copy_dst",)),
        "copy_dst_is_source": ("a copy destination that is also a source (A's block)",
                               req([ok], [g1, a[0]], [a[0], g2]), ("copy_dst", "copy_src")),
        "copy_lengths": ("copy_src and copy_dst of different lengths",
                         req([ok], [g1, g2], [a[0]]), ("copy_src", "copy_dst")),
        "copy_block_range": ("a copy block id == num_blocks (after a valid copy into A's block)",
                             req([ok], [g1, N], [a[0], g2]), ("copy_src", "copy_dst")),
        "mixed_batch": ("a valid sequence writing A's blocks, a valid decode and a valid copy into A, then a "
                        "sequence with a bad block id",
                        req([clobber, ok, bad([1], 0, [N])], [g1], [a[(n - 1) // bs]]), ("block_table",)),
    }
