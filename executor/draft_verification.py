"""Greedy verification of speculative drafts (``ExecuteSequence.num_draft_tokens``).

A sequence with n drafts sends ``[..., t, d1, ..., dn]``: the forward computes every
position as usual, and the logits after ``t, d1, ..., dn`` (n + 1 rows) give the argmax
``g0, ..., gn`` plain decoding would have picked at each step *if* the drafts before it
were right. Draft ``d(i+1)`` is accepted while it equals ``g(i)``; after ``a`` accepted
drafts the step emits ``d1..da`` and then ``g(a)``: token for token what ``a + 1``
plain greedy steps would produce. Only sampling that depends on nothing but the logits
at that position can be verified this way, so anything else is refused (the field that
prevents it is named) rather than silently sampled differently. ``suppressed_token_ids``
are applied at every drafted position alike: the client sends them with drafts only when
each position the step samples lies before ``min_tokens``
(``DescribeResponse.verifies_drafts_with_suppressed_tokens``).
"""
from __future__ import annotations

from dataclasses import dataclass

from kvserve.errors import InvalidArgument


def check_drafts(where: str, num_draft_tokens: int, num_tokens: int, sample: bool, sampling) -> None:
    """Raises InvalidArgument when the drafts of one sequence cannot be verified exactly."""
    if not num_draft_tokens:
        return
    if not sample:
        raise InvalidArgument(f"{where}.num_draft_tokens: drafts need sample = true")
    if num_draft_tokens > num_tokens - 1:
        raise InvalidArgument(f"{where}.num_draft_tokens: {num_draft_tokens} drafts in {num_tokens} token_ids "
                              f"(at most len(token_ids) - 1: a draft follows a token it is verified after)")
    # Each of these makes the pick at a position depend on more than its logits (penalties
    # count earlier tokens of the same step, a grammar's mask moves with each token) or asks
    # for what greedy verification does not compute.
    refused = (
        ("temperature", sampling.temperature != 0.0),
        ("top_logprobs", sampling.top_logprobs != 0),
        ("allowed_token_bitmask", bool(sampling.allowed_token_bitmask)),
        ("logit_bias_token_ids", bool(sampling.logit_bias_token_ids)),
        ("presence_penalty", sampling.presence_penalty != 0.0),
        ("frequency_penalty", sampling.frequency_penalty != 0.0),
        ("repetition_penalty", sampling.repetition_penalty not in (0.0, 1.0)),
    )
    for name, set_ in refused:
        if set_:
            raise InvalidArgument(f"{where}.sampling.{name}: drafts (num_draft_tokens "
                                  f"{num_draft_tokens}) are verified greedily only; {name} must be off")


@dataclass
class DraftRows:
    """Which rows of the step's hidden states to compute logits for, per sampled sequence."""

    token_rows: list[int]  # indices into the flattened [num_tokens] hidden states, sampled rows in order
    counts: list[int]  # per sampled sequence: its rows (num_draft_tokens + 1)


def logit_rows(ends: list[int], sample_rows: list[int], num_drafts: list[int]) -> DraftRows:
    """``ends[i]``: one past sequence i's last token in the flattened batch; a sequence with
    n drafts needs its last n + 1 rows, every other sampled sequence its last one."""
    rows: list[int] = []
    counts: list[int] = []
    for i in sample_rows:
        n = num_drafts[i]
        rows.extend(range(ends[i] - 1 - n, ends[i]))
        counts.append(n + 1)
    return DraftRows(rows, counts)


def accept(drafts: list[list[int]], picks: list[int], pick_logprobs: list[float], counts: list[int],
           ) -> tuple[list[int], list[float], list[int]]:
    """Greedy acceptance. ``picks``/``pick_logprobs``: the argmax (and its logprob) of every row
    of ``logit_rows``; ``drafts[j]``: sampled sequence j's drafts (len counts[j] - 1).
    Returns the emitted tokens and logprobs (accepted drafts + one pick per sequence, flattened
    in order) and the number accepted per sequence."""
    tokens: list[int] = []
    logprobs: list[float] = []
    accepted: list[int] = []
    offset = 0
    for seq_drafts, count in zip(drafts, counts):
        rows = picks[offset:offset + count]
        a = 0
        while a < len(seq_drafts) and seq_drafts[a] == rows[a]:
            a += 1
        # rows[i] == seq_drafts[i] for i < a: the accepted drafts are the picks themselves.
        tokens.extend(rows[:a + 1])
        logprobs.extend(pick_logprobs[offset:offset + a + 1])
        accepted.append(a)
        offset += count
    return tokens, logprobs, accepted
