"""One sampling sequence's ``executor.proto`` SamplingParams, built from what the gateway holds.

Everything a step's sampling depends on travels in the step (the executor keeps no
per-sequence state): the structured-output mask of this position, the penalty counts of the
tokens generated so far, EOS suppressed until ``min_tokens``. A preempted, forked or
migrated sequence therefore samples exactly as it would have where it was.
"""
from __future__ import annotations

from collections import Counter

import numpy as np

from gateway.scheduler import ScheduledSeq
from gateway.sequence import Sequence
from gateway.stopping import suppressed_token_ids
from kvserve.v1 import executor_pb2


def fill_sampling(params: executor_pb2.SamplingParams, entry: ScheduledSeq, vocab_size: int) -> None:
    seq = entry.seq
    options = seq.request.options
    params.temperature = options.temperature
    params.top_k = options.top_k
    params.top_p = options.top_p
    params.min_p = options.min_p
    if options.seed is not None:  # each choice draws its own stream
        params.seed = (options.seed + seq.index) % (1 << 64)
    if options.logprobs:
        params.top_logprobs = options.logprobs
    suppressed = suppressed_token_ids(seq) if options.min_tokens else ()
    if seq.grammar is not None:
        mask = seq.grammar.allowed_bitmask(vocab_size)
        params.allowed_token_bitmask = mask
        if suppressed and not _allows_other_than(mask, suppressed, vocab_size):
            suppressed = ()  # the grammar is complete: ending it wins over min_tokens
    params.suppressed_token_ids.extend(suppressed)
    if options.logit_bias:
        params.logit_bias_token_ids.extend(t for t, _ in options.logit_bias)
        params.logit_bias_values.extend(b for _, b in options.logit_bias)
    if options.has_penalties:
        params.presence_penalty = options.presence_penalty
        params.frequency_penalty = options.frequency_penalty
        params.repetition_penalty = options.repetition_penalty
        ids, counts = penalty_counts(seq)
        params.penalty_token_ids.extend(ids)
        params.penalty_output_counts.extend(counts)


def penalty_counts(seq: Sequence) -> tuple[list[int], list[int]]:
    """Distinct tokens the penalties look at, with how often each was generated: the output
    tokens, and the prompt's too when the repetition penalty is on."""
    request = seq.request
    counts = Counter(seq.token_ids[request.num_prompt_tokens:])
    if request.options.repetition_penalty != 1.0:
        for token_id in request.distinct_prompt_token_ids():
            counts.setdefault(token_id, 0)
    return list(counts), list(counts.values())


def _allows_other_than(mask: bytes, excluded: tuple[int, ...], vocab_size: int) -> bool:
    bits = np.unpackbits(np.frombuffer(mask, dtype=np.uint8), bitorder="little")[:vocab_size]
    bits[np.asarray(excluded, dtype=np.int64)] = 0
    return bool(bits.any())
