"""Requests and their sequences: the scheduler's domain objects (no grpc, no I/O).

A ``GenerationRequest`` has ``n`` choices; each choice is a ``Sequence`` whose
``token_ids`` hold the prompt followed by the generated tokens. A sequence knows
how much of it the kvmanager has seen (``num_known_by_manager``) and how much has
KV in the cache (``num_computed``); the scheduler moves those forward step by step.
"""
from __future__ import annotations

import enum
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class SamplingOptions:
    """Everything a request asks about sampling and stopping, already validated."""

    max_tokens: int | None
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    n: int = 1
    logprobs: int | None = None
    # Prompt log-probabilities (completions' echo with logprobs): None, or how many top alternatives
    # each prompt position reports. Such a request computes its whole prompt (no prefix-cache hit).
    prompt_logprobs: int | None = None
    enable_prefix_caching: bool = True
    cache_salt: str = ""
    # Cache terms, read by kvmanager when a sequence is created (SequenceAllocation): the tenant
    # ("" default), the leading prompt tokens hashed in the shared namespace, the TTL of the
    # blocks it publishes (0 none) and whether they are evicted first.
    tenant: str = ""
    num_shared_tokens: int = 0
    cache_ttl_ms: int = 0
    cache_priority_low: bool = False
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ids distinct
    min_p: float = 0.0
    # A compiled structured-output constraint (gateway.constraints.CompiledGrammar) or None.
    constraint: object | None = None
    # OpenAI's ``prediction``: what the client expects the output to be, tokenized; a draft source
    # (gateway.prompt_lookup.PredictedOutput), never a constraint. None: the request sent none.
    predicted_token_ids: tuple[int, ...] | None = None

    @property
    def routing_salt(self) -> str:
        """The gateway-local key of what a prompt may hit (salt and tenant): never another tenant's."""
        return f"{self.cache_salt}\x00{self.tenant}" if self.tenant else self.cache_salt

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def can_draft(self) -> bool:
        """Whether speculative drafts can be verified exactly for this request: plain greedy, one
        choice (forked choices share blocks that drafts would write), nothing that makes a pick
        depend on more than its logits, no logprobs."""
        return (self.temperature == 0.0 and self.n == 1 and not self.has_penalties and not self.logit_bias
                and self.constraint is None and self.logprobs is None)


@dataclass
class ChoiceDelta:
    """What one choice produced since its previous delta."""

    index: int
    token_ids: list[int]
    text: str
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    # On a choice's first delta when the request asked for them: the prompt's log-probabilities,
    # positions 1.. (the first prompt token has none).
    prompt_logprobs: list[PromptTokenLogprob] | None = None


@dataclass
class PromptTokenLogprob:
    """How likely the model found one prompt token after the ones before it."""

    logprob: float
    top_logprobs: list[tuple[int, float]]


@dataclass
class RequestOutput:
    """One step's worth of output for one request; ``finished`` on the last one."""

    request_id: str
    choices: list[ChoiceDelta]
    finished: bool = False
    error: Exception | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    # With a ``prediction``: its drafted tokens the model accepted and rejected (OpenAI's
    # completion_tokens_details); None without one.
    prediction_tokens: PredictionTokens | None = None


@dataclass
class PredictionTokens:
    accepted: int = 0
    rejected: int = 0

    def __add__(self, other: PredictionTokens) -> PredictionTokens:
        return PredictionTokens(self.accepted + other.accepted, self.rejected + other.rejected)


class TextDecoder:
    """Interface the scheduler needs from a detokenizer (see ``gateway.detokenizer``)."""

    def append(self, token_id: int) -> str:  # pragma: no cover - interface
        raise NotImplementedError

    def flush(self) -> str:  # pragma: no cover - interface
        raise NotImplementedError


@dataclass(eq=False)
class Sequence:
    """One choice of a request, as the scheduler and the kvmanager see it."""

    seq_id: int
    request: GenerationRequest
    index: int
    token_ids: list[int]
    decoder: TextDecoder
    status: SeqStatus = SeqStatus.WAITING
    num_computed: int = 0
    num_known_by_manager: int = 0
    block_table: list[int] = field(default_factory=list)
    admitted_order: int = -1
    output_text: str = ""
    num_text_sent: int = 0
    pending_token_ids: list[int] = field(default_factory=list)
    pending_logprobs: list[float] = field(default_factory=list)
    pending_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    finish_reported: bool = False
    prompt_logprobs_reported: bool = False
    # The choice's structured-output state (gateway.constraints.GrammarState) when constrained.
    grammar: object | None = None
    # Prompt-lookup drafting (gateway.prompt_lookup.SpeculationState) once the scheduler drafted for it.
    speculation: object | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return self.request.num_prompt_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.request.num_prompt_tokens

    @property
    def known_to_kvmanager(self) -> bool:
        """Whether kvmanager knows this sequence (it has had an Allocate: it may hold blocks)."""
        return self.num_known_by_manager > 0

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    def num_sendable(self) -> int:
        """Tokens the kvmanager may know: all, except the last prompt token while a fork is pending."""
        if self.request.fork_pending and self.index == 0:
            return self.num_prompt_tokens - 1
        return len(self.token_ids)

    def num_to_compute(self) -> int:
        return self.num_sendable() - self.num_computed

    def num_uncached_to_compute(self) -> int:
        """What is left to compute, less the prefix the router expects a waiting sequence to hit."""
        expected_hit = 0 if self.known_to_kvmanager else self.request.expected_cached_tokens
        return max(1, self.num_to_compute() - expected_hit)

    def reset_for_recompute(self, new_seq_id: int) -> None:
        """Preemption by recompute: forget every block; the tokens stay."""
        self.seq_id = new_seq_id
        self.num_computed = 0
        self.num_known_by_manager = 0
        self.block_table = []
        self.status = SeqStatus.WAITING

    def apply_block_table_delta(self, offset: int, blocks: list[int]) -> None:
        del self.block_table[offset:]
        self.block_table.extend(blocks)


@dataclass(eq=False)
class GenerationRequest:
    """A client request: prompt, options, ``n`` sequences and where outputs go."""

    request_id: str
    prompt_token_ids: list[int]
    options: SamplingOptions
    eos_token_ids: frozenset[int]
    max_model_len: int
    sink: Callable[[RequestOutput], None] = lambda output: None
    arrival_time: float = field(default_factory=time.monotonic)
    last_emit_time: float | None = None
    sequences: list[Sequence] = field(default_factory=list)
    fork_pending: bool = False
    num_cached_tokens: int | None = None
    expected_cached_tokens: int = 0  # the prefix hit its router expected where it sent it
    deadline: float | None = None  # time.monotonic() by which it must have finished
    finished: bool = False
    max_stop_len: int = 0
    # Per prompt position 1.., once scored (options.prompt_logprobs): what the executor returned.
    prompt_logprobs: list[PromptTokenLogprob | None] | None = None
    # Drafts from options.predicted_token_ids, accepted and rejected (None without a prediction).
    prediction_tokens: PredictionTokens | None = None
    _distinct_prompt: list[int] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.options.predicted_token_ids is not None:
            self.prediction_tokens = PredictionTokens()

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def distinct_prompt_token_ids(self) -> list[int]:
        """The prompt's distinct token ids (for the repetition penalty), computed once."""
        if self._distinct_prompt is None:
            self._distinct_prompt = list(dict.fromkeys(self.prompt_token_ids))
        return self._distinct_prompt

    @functools.cached_property
    def end_token_ids(self) -> tuple[int, ...]:
        """EOS and the stop token ids, sorted: what ``min_tokens`` keeps from being sampled."""
        return tuple(sorted(set(self.eos_token_ids) | set(self.options.stop_token_ids)))

    def record_prompt_logprobs(self, first_position: int, scores: list[PromptTokenLogprob]) -> None:
        """Scores of the prompt tokens at ``first_position`` + 1 onwards (a recomputed chunk scores
        them again, alike)."""
        if self.prompt_logprobs is None:
            self.prompt_logprobs = [None] * (self.num_prompt_tokens - 1)
        self.prompt_logprobs[first_position:first_position + len(scores)] = scores

    def prompt_logprobs_complete(self) -> bool:
        return self.prompt_logprobs is not None and None not in self.prompt_logprobs

    @property
    def num_completion_tokens(self) -> int:
        return sum(seq.num_output_tokens for seq in self.sequences)

    def all_finished(self) -> bool:
        return all(seq.is_finished for seq in self.sequences)
