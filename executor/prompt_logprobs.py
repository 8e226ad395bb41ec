"""Prompt log-probabilities: how likely the model finds each prompt token after the ones before it.

What OpenAI's legacy completions return with ``echo`` and ``logprobs`` (lm-evaluation-harness's
loglikelihood tasks read them) and vLLM's ``prompt_logprobs``. A sequence names, for its first
rows of a step, the token that follows each (``ExecuteSequence.prompt_logprob_token_ids``); the
LM head runs over those rows too, and each named token's log-probability under the model's own
distribution (log_softmax of the float32 logits, nothing of sampling applied) comes back with the
top alternatives asked for.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from executor.sampling import MAX_TOP_LOGPROBS
from kvserve.errors import InvalidArgument

# Rows whose float32 logits exist at once: 256 x 49,152 (the default model's vocabulary) is 48 MiB.
LOGIT_ROWS_PER_PASS = 256


@dataclass
class PromptLogprobs:
    """One sequence's answer: index-aligned with its ``prompt_logprob_token_ids``."""

    logprobs: list[float]
    top_logprobs: list[tuple[list[int], list[float]]]  # empty unless top alternatives were asked for


def check_prompt_logprobs(where: str, token_ids: list[int], num_tokens: int, num_draft_tokens: int,
                          top_logprobs: int, vocab_size: int) -> None:
    """Raises InvalidArgument naming the field when a sequence's prompt log-probability request is bad."""
    if not token_ids:
        return
    if len(token_ids) > num_tokens:
        raise InvalidArgument(f"{where}.prompt_logprob_token_ids: {len(token_ids)} entries for {num_tokens} "
                              "token_ids (at most one per row)")
    if num_draft_tokens:
        raise InvalidArgument(f"{where}.prompt_logprob_token_ids: not with num_draft_tokens")
    if min(token_ids) < 0 or max(token_ids) >= vocab_size:
        j, tid = next((j, t) for j, t in enumerate(token_ids) if not 0 <= t < vocab_size)
        raise InvalidArgument(f"{where}.prompt_logprob_token_ids[{j}]: {tid} outside the vocabulary "
                              f"[0, {vocab_size})")
    if top_logprobs > MAX_TOP_LOGPROBS:
        raise InvalidArgument(f"{where}.prompt_top_logprobs: {top_logprobs} > {MAX_TOP_LOGPROBS}")


def score_rows(hidden: torch.Tensor, row_starts: list[int], targets: list[list[int]], top_counts: list[int],
               compute_logits: Callable[[torch.Tensor], torch.Tensor]) -> list[PromptLogprobs]:
    """hidden: [num_tokens, hidden_size], the step's last hidden states. For each asking sequence:
    its first row in ``hidden`` (``row_starts``), the tokens that follow its first ``len(targets[i])``
    rows, and how many top alternatives it wants. The LM head runs ``LOGIT_ROWS_PER_PASS`` rows at
    a time, so a long prompt's logits never exist whole."""
    rows = [start + offset for start, wanted in zip(row_starts, targets) for offset in range(len(wanted))]
    flat_targets = [t for wanted in targets for t in wanted]
    max_top = max(top_counts, default=0)
    logprobs: list[float] = []
    top_ids: list[list[int]] = []
    top_values: list[list[float]] = []
    for begin in range(0, len(rows), LOGIT_ROWS_PER_PASS):
        index = torch.tensor(rows[begin:begin + LOGIT_ROWS_PER_PASS], device=hidden.device)
        scores = compute_logits(hidden.index_select(0, index)).float().log_softmax(dim=-1)  # [rows, vocab]
        wanted = torch.tensor(flat_targets[begin:begin + LOGIT_ROWS_PER_PASS], device=hidden.device)
        logprobs += scores.gather(1, wanted.view(-1, 1)).view(-1).tolist()
        if max_top:
            values, ids = scores.topk(max_top, dim=-1)
            top_ids += ids.tolist()
            top_values += values.tolist()
    answers, offset = [], 0
    for wanted, top in zip(targets, top_counts):
        end = offset + len(wanted)
        alternatives = [(top_ids[r][:top], top_values[r][:top]) for r in range(offset, end)] if top else []
        answers.append(PromptLogprobs(logprobs[offset:end], alternatives))
        offset = end
    return answers
