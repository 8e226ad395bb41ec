"""Conformance rules for prompt log-probabilities (``docs/executor-contract.md``, "Prompt
log-probabilities").

They run only against an executor whose ``Describe`` says it returns them (kvserve's gateway
asks no other). The reference run's greedy steps say what a scored row must give: the row
before ``s_i`` scores ``s_i`` with the log-probability (and top alternatives) the reference
sampled it with, since a greedy pick without edits is the model's own distribution.

Importing this module registers the rules in ``executor_checks.rules``, after the others.
"""
from __future__ import annotations

import grpc

from kvserve.conformance import Skip, expect_status, require
from kvserve.conformance.comparison import Comparison, Sampled
from kvserve.conformance.executor_checks import rules
from kvserve.conformance.executor_context import TOPK, ExecutorContext, sequence
from kvserve.v1 import executor_pb2 as pb


def _scored(reply: pb.ExecuteResponse, index: int, targets: list[int], top: int) -> list[Sampled]:
    """The index-th prompt_logprobs entry of a reply as one Sampled per named token, after checking its shape."""
    require(index < len(reply.prompt_logprobs),
            f"prompt_logprobs has {len(reply.prompt_logprobs)} entries, expected at least {index + 1} (one per "
            "sequence that named tokens)")
    entry = reply.prompt_logprobs[index]
    require(len(entry.logprobs) == len(targets),
            f"prompt_logprobs[{index}] has {len(entry.logprobs)} logprobs for {len(targets)} named tokens")
    require(len(entry.top_logprobs) == (len(targets) if top else 0),
            f"prompt_logprobs[{index}] has {len(entry.top_logprobs)} top lists, expected "
            f"{len(targets) if top else 0}")
    rows = []
    for row, (token, logprob) in enumerate(zip(targets, entry.logprobs)):
        require(logprob <= 1e-3, f"prompt_logprobs[{index}] row {row}: logprob {logprob} > 0")
        alternatives: tuple = ()
        if top:
            best = entry.top_logprobs[row]
            require(len(best.token_ids) == len(best.logprobs) == top,
                    f"prompt_logprobs[{index}] row {row}: {len(best.token_ids)} alternatives, asked for {top}")
            require(list(best.logprobs) == sorted(best.logprobs, reverse=True),
                    f"prompt_logprobs[{index}] row {row}: top alternatives not sorted")
            alternatives = tuple(zip(best.token_ids, best.logprobs))
        rows.append(Sampled(token, logprob, alternatives))
    return rows


def _asking(seq_id: int, tokens: list[int], start: int, table: list[int], targets: list[int],
            top: int = TOPK) -> pb.ExecuteSequence:
    step = sequence(seq_id, tokens, start, table)
    step.prompt_logprob_token_ids.extend(targets)
    step.prompt_top_logprobs = top
    return step


@rules.rule("prompt_logprobs.scored",
            "prompt_logprob_token_ids: each named token scored as the reference sampled it, alike in one chunk or "
            "two, one entry per asking sequence in order; too many names is INVALID_ARGUMENT")
def prompt_logprobs_scored(ctx: ExecutorContext) -> str:
    if not ctx.info.returns_prompt_logprobs:
        raise Skip("the executor does not return prompt log-probabilities (Describe.returns_prompt_logprobs is "
                   "false)")
    ref = ctx.reference()
    text = ref.prompt + ref.fed  # the prompt and the reference's greedy tokens after it
    n, p = len(text), len(ref.prompt)
    whole = ctx.execute([_asking(ctx.seq_id(), text, 0, ctx.take(ctx.seq_blocks), text[1:])])
    one_shot = _scored(whole, 0, text[1:], TOPK)
    comparison = Comparison(ctx.tolerance)
    for i, step in enumerate(ref.steps[:len(ref.fed)]):
        comparison.add(step, one_shot[p - 1 + i], f"the row before reference step {i}")
    # Two chunks split inside a block, the first naming the second's first token, beside a
    # sequence that names none (it gets no entry) and one that names a few.
    split = p // 2 + 1
    table, other = ctx.take(ctx.seq_blocks), ctx.take(ctx.seq_blocks)
    first = ctx.execute([sequence(ctx.seq_id(), text[:split], 0, other),
                         _asking(ctx.seq_id(), text[:split], 0, table, text[1:split + 1]),
                         _asking(ctx.seq_id(), text[:3], 0, ctx.take(1), text[1:3], top=0)])
    require(len(first.prompt_logprobs) == 2,
            f"a step with two sequences naming tokens (and one naming none) has {len(first.prompt_logprobs)} "
            "prompt_logprobs entries")
    chunked = _scored(first, 0, text[1:split + 1], TOPK)
    few = _scored(first, 1, text[1:3], 0)
    chunked += _scored(ctx.execute([_asking(ctx.seq_id(), text[split:], split, table, text[split + 1:])]), 0,
                       text[split + 1:], TOPK)
    for row, (a, b) in enumerate(zip(one_shot, chunked)):
        comparison.add(a, b, f"row {row} chunked at {split}")
    for row, (a, b) in enumerate(zip(one_shot, few)):
        require(ctx.tolerance.close(b.logprob, a.logprob),
                f"row {row} of a 3-token prompt: {b.logprob:.6g} vs {a.logprob:.6g} in the whole sequence")
    bad = pb.ExecuteRequest(sequences=[_asking(ctx.seq_id(), text[:2], 0, ctx.take(1), text[1:4])])
    error = expect_status(lambda: ctx.stub.Execute(bad, timeout=ctx.timeout), grpc.StatusCode.INVALID_ARGUMENT,
                          "3 prompt_logprob_token_ids for 2 token_ids")
    require("prompt_logprob_token_ids" in (error.details() or ""),
            f"INVALID_ARGUMENT does not name prompt_logprob_token_ids: {error.details()!r}")
    return f"{n - 1} rows scored in one chunk and in two: {comparison.verdict()}"
