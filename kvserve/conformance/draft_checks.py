"""Conformance rules for speculative drafts (``docs/executor-contract.md``, "Speculative drafts").

They run only against an executor whose ``Describe`` says it verifies drafts (an executor may
decline them: kvserve's gateway then never sends any, and these rules SKIP). The reference run's
greedy tokens ``s0, s1, ...`` are the right drafts: after ``s0`` the executor must pick ``s1``,
after ``s1`` ``s2``, and so on. Where two candidates are near a tie (the reference's top-2 gap
within twice the tolerance) a correct executor may pick either, so the exact checks apply only
where the reference is clear.

Importing this module registers the rules in ``executor_checks.rules``, after the others.
"""
from __future__ import annotations

from kvserve.conformance import Skip, require
from kvserve.conformance.comparison import Sampled, sampled_from
from kvserve.conformance.executor_checks import rules
from kvserve.conformance.executor_context import TOPK, ExecutorContext, Reference, greedy, sequence
from kvserve.v1 import executor_pb2 as pb


def _clear(ctx: ExecutorContext, step: Sampled) -> bool:
    return step.margin() > 2 * ctx.tolerance.bound(step.top[0][1]) if step.top else False


def _near_top(ctx: ExecutorContext, step: Sampled) -> set[int]:
    """Tokens a correct executor may pick at the step: the top one and any within twice the tolerance."""
    best = step.top[0][1]
    return {token for token, logprob in step.top if best - logprob <= 2 * ctx.tolerance.bound(best)}


def _drafted_step(ctx: ExecutorContext, prompt: list[int], table: list[int], tokens: list[int], num_drafts: int,
                  sampling: pb.SamplingParams) -> tuple[list[int], int]:
    """One step of ``tokens`` (its last ``num_drafts`` drafts) after ``prompt``'s KV in ``table``: returns
    the tokens it emitted and the drafts it accepted, after checking the reply's layout."""
    drafts = tokens[len(tokens) - num_drafts:]
    step = sequence(ctx.seq_id(), tokens, len(prompt), table, sampling)
    step.num_draft_tokens = num_drafts
    reply = ctx.execute([step])
    require(len(reply.num_accepted_draft_tokens) == 1,
            f"num_accepted_draft_tokens has {len(reply.num_accepted_draft_tokens)} entries for one drafted sequence")
    accepted = reply.num_accepted_draft_tokens[0]
    emitted = list(reply.sampled_token_ids)
    require(accepted <= num_drafts, f"accepted {accepted} of {num_drafts} drafts")
    require(len(emitted) == accepted + 1 == len(reply.sampled_logprobs),
            f"{len(emitted)} tokens and {len(reply.sampled_logprobs)} logprobs for {accepted} accepted drafts "
            f"(expected accepted + 1 of each)")
    require(emitted[:accepted] == drafts[:accepted], f"emitted {emitted} does not begin with the accepted drafts")
    return emitted, accepted


def _prefilled(ctx: ExecutorContext, ref: Reference) -> list[int]:
    """Fresh blocks holding the reference prompt's KV (and room for its decode steps)."""
    table = ctx.take(ctx.seq_blocks)
    ctx.execute([sequence(ctx.seq_id(), ref.prompt, 0, table)])
    return table


@rules.rule("drafts.verified", "right drafts are accepted and a wrong one is not; the step emits what greedy "
                               "decoding would")
def drafts_verified(ctx: ExecutorContext) -> str:
    if not ctx.info.verifies_draft_tokens:
        raise Skip("the executor does not verify drafts (Describe.verifies_draft_tokens is false)")
    ref = ctx.reference()
    s = [step.token for step in ref.steps]
    near = _near_top(ctx, ref.steps[3])  # at most TOPK tokens: one of the next TOPK + 1 ids is not among them
    wrong = next(t for t in ((s[3] + d) % ctx.info.vocab_size for d in range(1, TOPK + 2)) if t not in near)
    drafts = [s[1], s[2], wrong]
    emitted, accepted = _drafted_step(ctx, ref.prompt, _prefilled(ctx, ref), [s[0], *drafts], 3,
                                      pb.SamplingParams(temperature=0.0))
    require(accepted < 3, f"accepted the draft {wrong}, far from the top of the reference's pick {s[3]}")
    if all(_clear(ctx, ref.steps[i]) for i in (1, 2, 3)):
        require(accepted == 2, f"accepted {accepted} of the drafts {drafts}, expected the right two (the "
                               f"reference decodes {s[1:4]})")
        require(emitted == s[1:4], f"emitted {emitted}, expected {s[1:4]}")
        return f"drafts {s[1]}, {s[2]} accepted, {wrong} rejected for {s[3]}"
    return f"accepted {accepted} of 3 drafts, not the wrong one (a near tie in the reference: not checked exactly)"


@rules.rule("drafts.suppressed", "suppressed_token_ids hold at every drafted position: a draft of a "
                                 "suppressed token is rejected")
def drafts_suppressed(ctx: ExecutorContext) -> str:
    """With ``s1`` (the reference's pick after ``s0``) suppressed the executor picks ``z`` after ``s0``;
    after ``s0 z`` it picks ``w`` freely. A step ``s0`` + drafts ``z w``, with ``s1`` and ``w`` suppressed,
    must accept ``z`` (suppression leaves it the best) and reject ``w`` (suppressed at the drafted row)."""
    if not ctx.info.verifies_drafts_with_suppressed_tokens:
        raise Skip("the executor does not take drafts with suppressed_token_ids "
                   "(Describe.verifies_drafts_with_suppressed_tokens is false)")
    ref = ctx.reference()
    s0, s1 = ref.steps[0].token, ref.steps[1].token
    table = _prefilled(ctx, ref)
    at = len(ref.prompt)
    probe = ctx.seq_id()
    z = sampled_from(ctx.execute([sequence(probe, [s0], at, table, greedy(suppressed_token_ids=[s1]))]), 0)
    require(z.token != s1, f"sampled the suppressed token {s1}")
    w = ctx.prefill_greedy(probe, [z.token], at + 1, table).token
    if w == z.token:
        raise Skip(f"after {s0} {z.token} the executor picks {w} again: no token a drafted row alone would pick")
    banned = sorted({s1, w})
    emitted, accepted = _drafted_step(ctx, ref.prompt, table, [s0, z.token, w], 2,
                                      pb.SamplingParams(temperature=0.0, suppressed_token_ids=banned))
    require(not set(banned) & set(emitted), f"emitted a suppressed token ({banned}): {emitted}")
    require(accepted <= 1, f"accepted the draft {w}, which suppressed_token_ids suppresses")
    if _clear(ctx, z):
        require(accepted == 1, f"rejected the draft {z.token}, the best token suppression leaves")
    return f"after {s0}: draft {z.token} accepted, draft of suppressed {w} rejected"
