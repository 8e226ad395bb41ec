"""Appending sampled tokens to a sequence: detokenize, check stop conditions, cut deltas.

Stop conditions, in order: a stop token id or EOS (after ``min_tokens``, EOS
only without ``ignore_eos``) → ``stop``, its text left out; a token the
structured-output grammar refuses (the executor ignored the mask) → ``error``;
a stop string in the text → ``stop``, the text cut before it; the grammar
complete → ``stop``; ``max_tokens`` or ``max_model_len`` → ``length``. While a choice runs, the last ``len(longest stop) - 1``
characters are held back so that a stop string is never streamed in part.
"""
from __future__ import annotations

from gateway.sequence import ChoiceDelta, FinishReason, Sequence


def suppressed_token_ids(seq: Sequence) -> tuple[int, ...]:
    """EOS and stop token ids may not be sampled until ``min_tokens`` exist."""
    options = seq.request.options
    if seq.num_output_tokens >= options.min_tokens:
        return ()
    return seq.request.end_token_ids


def append_token(seq: Sequence, token_id: int, logprob: float | None = None,
                 top_logprobs: list[tuple[int, float]] | None = None) -> bool:
    """Appends one sampled token; returns True when the sequence finished with it."""
    request = seq.request
    options = request.options
    seq.token_ids.append(token_id)
    seq.pending_token_ids.append(token_id)
    if options.logprobs is not None:
        seq.pending_logprobs.append(float(logprob if logprob is not None else 0.0))
        seq.pending_top_logprobs.append(list(top_logprobs or []))

    past_min = seq.num_output_tokens > options.min_tokens
    if past_min and token_id in options.stop_token_ids:
        _finish(seq, FinishReason.STOP, token_id)
        return True
    if past_min and not options.ignore_eos and token_id in request.eos_token_ids:
        _finish(seq, FinishReason.STOP, None)
        return True

    grammar = seq.grammar
    if grammar is not None and not grammar.consume(token_id):
        # Only an executor that ignored the step's allowed-token bitmask gets here.
        _finish(seq, FinishReason.ERROR, None)
        return True
    previous_len = len(seq.output_text)
    seq.output_text += seq.decoder.append(token_id)
    if options.stop and _cut_at_stop_string(seq, previous_len):
        return True
    if grammar is not None and grammar.is_finished():
        _finish(seq, FinishReason.STOP, None)
        return True
    if seq.num_output_tokens >= options.max_tokens or len(seq.token_ids) >= request.max_model_len:
        _finish(seq, FinishReason.LENGTH, None)
        return True
    return False


def _cut_at_stop_string(seq: Sequence, previous_len: int) -> bool:
    text = seq.output_text
    search_from = max(0, previous_len - seq.request.max_stop_len + 1)
    best: tuple[int, str] | None = None
    for stop in seq.request.options.stop:
        index = text.find(stop, search_from)
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop)
    if best is None:
        return False
    seq.output_text = text[: best[0]]
    seq.finish_reason = FinishReason.STOP
    seq.stop_reason = best[1]
    return True


def _finish(seq: Sequence, reason: FinishReason, stop_reason: str | int | None) -> None:
    previous_len = len(seq.output_text)
    seq.output_text += seq.decoder.flush()
    if seq.request.options.stop and _cut_at_stop_string(seq, previous_len):
        return
    seq.finish_reason = reason
    seq.stop_reason = stop_reason


def finish_with(seq: Sequence, reason: FinishReason) -> None:
    """Ends a sequence from outside (abort, error), keeping the text produced so far."""
    if seq.finish_reason is None:
        seq.finish_reason = reason


def take_delta(seq: Sequence) -> ChoiceDelta | None:
    """What this choice has to say since its last delta, or None when nothing."""
    if seq.finish_reported:
        return None
    finished = seq.finish_reason is not None
    holdback = 0 if finished else max(seq.request.max_stop_len - 1, 0)
    end = max(seq.num_text_sent, len(seq.output_text) - holdback)
    text = seq.output_text[seq.num_text_sent:end]
    if not text and not seq.pending_token_ids and not finished:
        return None
    seq.num_text_sent = end
    delta = ChoiceDelta(
        index=seq.index,
        token_ids=seq.pending_token_ids,
        text=text,
        logprobs=seq.pending_logprobs,
        top_logprobs=seq.pending_top_logprobs,
        finish_reason=seq.finish_reason,
        stop_reason=seq.stop_reason,
    )
    if seq.request.options.prompt_logprobs is not None and not seq.prompt_logprobs_reported:
        # Whole once a token was sampled; a request that failed before has none to report.
        complete = seq.request.prompt_logprobs_complete()
        delta.prompt_logprobs = list(seq.request.prompt_logprobs) if complete else []
        seq.prompt_logprobs_reported = True
    seq.pending_token_ids, seq.pending_logprobs, seq.pending_top_logprobs = [], [], []
    seq.finish_reported = finished
    return delta
