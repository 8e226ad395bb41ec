"""Prompt-lookup (n-gram) drafts for speculative decoding, and how many to send.

A sequence whose output copies its input (quote, repeat, edit code, fill a template)
keeps producing n-grams that already occur earlier in its prompt or output; the tokens
that followed the most recent earlier occurrence of its last n-gram (n = 3, then 2,
then 1) are a cheap guess of what comes next. The executor verifies the guesses in the
same forward as the step's token (``ExecuteSequence.num_draft_tokens``); right ones cost
almost nothing on a memory-bound decode, wrong ones cost compute, so:

* ``DraftLength`` adapts per sequence: it grows while drafts are accepted whole, shrinks
  to what was accepted, drops to 0 after repeated misses and re-probes with a single draft
  every ``REPROBE_STEPS`` steps;
* the scheduler sends drafts only within a per-step token budget, so a large decode batch
  (compute-bound already) gets none;
* ``DraftCost`` measures what a step with drafts costs next to one without, at the same
  batch size, on this executor (on a CPU whose one-row matmuls take a GEMV path a step of
  several tokens can cost 2.5 steps of one): a sequence drafts only while the tokens its
  drafted steps emit (a running average) pay for that.

A request that sends OpenAI's ``prediction`` (the output it expects: code with a small edit,
a document to rewrite) drafts from it first (``PredictedOutput``), from its own text where the
prediction has nothing to offer.

Pure Python, no I/O: the index is updated incrementally as tokens are appended, so a
proposal costs O(1) per step, not a scan of the sequence.
"""
from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field

MAX_NGRAM = 3
MISSES_TO_STOP = 2  # consecutive steps with no accepted draft before drafting stops
REPROBE_STEPS = 8  # steps without drafts before a stopped sequence tries one draft again
COST_SAMPLES = 4  # steps of each kind (with and without drafts) before their cost ratio is trusted
EWMA = 0.25  # weight of the newest observation in the running averages


@dataclass
class NgramIndex:
    """For each n-gram (n <= MAX_NGRAM) of ``tokens[:indexed]``, where the tokens after its most
    recent occurrence start."""

    continuation: dict[tuple[int, ...], int] = field(default_factory=dict)
    indexed: int = 0  # n-grams ending before this position are in the index

    def update(self, tokens: list[int]) -> None:
        # The n-grams ending at the last token are left out: their continuation is still unknown,
        # and looking up the suffix must find an *earlier* occurrence.
        end = len(tokens) - 1
        cont = self.continuation
        for last in range(self.indexed, end):
            for n in range(1, MAX_NGRAM + 1):
                if last - n + 1 < 0:
                    break
                cont[tuple(tokens[last - n + 1:last + 1])] = last + 1
        self.indexed = max(self.indexed, end)

    def propose(self, tokens: list[int], max_drafts: int) -> list[int]:
        """Up to ``max_drafts`` tokens that followed the latest earlier occurrence of the longest
        suffix n-gram of ``tokens`` that occurred before; [] when none did."""
        if max_drafts <= 0 or len(tokens) < 2:
            return []
        self.update(tokens)
        for n in range(min(MAX_NGRAM, len(tokens) - 1), 0, -1):
            start = self.continuation.get(tuple(tokens[-n:]))
            if start is not None:
                return tokens[start:start + max_drafts]
        return []


@dataclass
class PredictedOutput:
    """The client's predicted output as drafts: while the output follows the prediction, the
    prediction's next tokens; where it departs, the prediction after the occurrence of the
    output's last n-gram (n = 3, then 2, then 1) nearest after where they last agreed, as a diff
    realigns two texts."""

    tokens: tuple[int, ...]
    # n-gram -> the positions right after each of its occurrences in ``tokens``, ascending
    continuations: dict[tuple[int, ...], list[int]]
    cursor: int = 0  # the prediction's token the output's next one should be; -1 where they parted
    hint: int = 0  # where they last agreed (realignment looks from here)
    walked: int = 0  # output tokens compared with the prediction so far

    @classmethod
    def of(cls, tokens: Sequence[int]) -> PredictedOutput:
        continuations: dict[tuple[int, ...], list[int]] = {}
        for end in range(1, len(tokens) + 1):
            for n in range(1, min(MAX_NGRAM, end) + 1):
                continuations.setdefault(tuple(tokens[end - n:end]), []).append(end)
        return cls(tuple(tokens), continuations)

    def propose(self, output: Sequence[int], max_drafts: int) -> list[int]:
        """Up to ``max_drafts`` tokens of the prediction that should follow ``output`` (the
        sequence's generated tokens so far); [] where none does."""
        for token in output[self.walked:]:
            if 0 <= self.cursor < len(self.tokens) and self.tokens[self.cursor] == token:
                self.cursor += 1
                self.hint = self.cursor
            else:
                self.cursor = -1
        self.walked = len(output)
        if self.cursor < 0:
            self.cursor = self._realigned(output)
            if self.cursor >= 0:
                self.hint = self.cursor
        if max_drafts <= 0 or self.cursor < 0:
            return []
        return list(self.tokens[self.cursor:self.cursor + max_drafts])

    def _realigned(self, output: Sequence[int]) -> int:
        for n in range(min(MAX_NGRAM, len(output)), 0, -1):
            positions = self.continuations.get(tuple(output[-n:]))
            if positions:
                after = bisect.bisect_left(positions, self.hint)
                return positions[after] if after < len(positions) else positions[-1]
        return -1


@dataclass
class DraftLength:
    """How many drafts one sequence sends next, from how its recent drafts fared."""

    maximum: int
    current: int = 0
    misses: int = 0
    idle_steps: int = 0
    tokens_per_step: float = 0.0  # running average of tokens a drafted step emitted (accepted + 1)

    def __post_init__(self) -> None:
        self.current = self.maximum
        self.tokens_per_step = float(self.maximum)  # optimistic until measured

    def next(self, cost_ratio: float = 1.0) -> int:
        """Drafts to send now; ``cost_ratio``: a drafted step's time over a plain one's."""
        if self.current and self.tokens_per_step >= cost_ratio:
            return self.current
        self.idle_steps += 1
        if self.idle_steps >= REPROBE_STEPS:  # try again: the text may have turned to copying
            self.idle_steps = 0
            return max(1, self.current)
        return 0

    def record(self, num_drafted: int, num_accepted: int) -> None:
        if not num_drafted:
            return
        self.tokens_per_step += EWMA * (num_accepted + 1 - self.tokens_per_step)
        if num_accepted == num_drafted:
            self.misses = 0
            self.current = min(self.maximum, max(self.current, num_drafted) + 1)
        elif num_accepted == 0:
            self.misses += 1
            self.current = 0 if self.misses >= MISSES_TO_STOP else max(1, self.current // 2)
        else:
            self.misses = 0
            self.current = max(1, num_accepted + 1)


class DraftCost:
    """Running averages of the executor's step time with and without drafts, per number of
    sequences in the step: how much dearer drafting makes a step on this executor."""

    def __init__(self) -> None:
        self._seconds: dict[tuple[int, bool], tuple[float, int]] = {}  # (seqs, drafted) -> (ewma, samples)

    def observe(self, num_seqs: int, drafted: bool, seconds: float) -> None:
        mean, n = self._seconds.get((num_seqs, drafted), (seconds, 0))
        self._seconds[(num_seqs, drafted)] = (mean + EWMA * (seconds - mean), n + 1)

    def wants_plain_step(self, num_seqs: int) -> bool:
        """Drafted steps of this size were measured but not enough plain ones: a step without
        drafts now, or the ratio would never be known where every step drafts."""
        return self._seconds.get((num_seqs, True), (0.0, 0))[1] >= COST_SAMPLES > \
            self._seconds.get((num_seqs, False), (0.0, 0))[1]

    def ratio(self, num_seqs: int) -> float:
        """A drafted step's time over a plain one's; 1.0 (draft, and so measure) until both are known."""
        drafted, n_drafted = self._seconds.get((num_seqs, True), (0.0, 0))
        plain, n_plain = self._seconds.get((num_seqs, False), (0.0, 0))
        if min(n_drafted, n_plain) < COST_SAMPLES or plain <= 0.0:
            return 1.0
        return drafted / plain


@dataclass
class SpeculationState:
    """One sequence's drafting state (``Sequence.speculation``)."""

    index: NgramIndex
    length: DraftLength
    prediction: PredictedOutput | None = None

    def propose(self, tokens: list[int], num_prompt_tokens: int, max_drafts: int) -> tuple[list[int], bool]:
        """Drafts for the sequence's ``tokens`` (prompt, then output), and whether they are the
        prediction's."""
        if self.prediction is not None:
            drafts = self.prediction.propose(tokens[num_prompt_tokens:], max_drafts)
            if drafts:
                return drafts, True
        return self.index.propose(tokens, max_drafts), False


def plan_drafts(entries, num_speculative_tokens: int, budget: int, cost_ratio: float = 1.0,
                before_min_tokens: bool = False) -> None:
    """Prompt-lookup drafts for the decode entries (``gateway.scheduler.ScheduledSeq``) of a step,
    at most ``budget`` in all (``SchedulerConfig.speculative_token_budget`` less the step's tokens);
    each entry asks for lookahead slots to hold its drafts. ``before_min_tokens``: the executor
    verifies drafts with ``suppressed_token_ids``, so a sequence still short of ``min_tokens``
    drafts as far as its suppression holds alike at every row."""
    for entry in entries:
        if budget <= 0:
            return
        seq = entry.seq
        options = seq.request.options
        if entry.num_new_tokens != 1 or seq.num_to_compute() != 1 or not options.can_draft:
            continue
        # Room after this step's token: at least one output token left after the drafts.
        room = seq.request.max_model_len - len(seq.token_ids) - 1
        if options.max_tokens is not None:
            room = min(room, options.max_tokens - seq.num_output_tokens - 1)
        if seq.num_output_tokens < options.min_tokens:
            if not before_min_tokens:
                continue
            # The step samples output tokens num_output_tokens .. + drafts: each one suppressed.
            room = min(room, options.min_tokens - seq.num_output_tokens - 1)
            if room <= 0:
                continue
        if seq.speculation is None:
            predicted = options.predicted_token_ids
            seq.speculation = SpeculationState(NgramIndex(), DraftLength(num_speculative_tokens),
                                               PredictedOutput.of(predicted) if predicted else None)
        drafts, entry.drafts_predicted = seq.speculation.propose(
            seq.token_ids, seq.num_prompt_tokens, min(seq.speculation.length.next(cost_ratio), budget, room))
        if drafts:
            entry.draft_token_ids = drafts
            # Slots for these drafts and for the next step's (an overlapped step has only the blocks
            # held before it): this step's token, accepted drafts, the next token and its drafts.
            entry.num_lookahead_slots = max(entry.num_lookahead_slots, len(drafts) + 1 + num_speculative_tokens)
            budget -= len(drafts)


def cap_drafts(entry, block_size: int) -> None:
    """Drafts fit in the slots the sequence holds past this step's token (lookahead slots are
    best-effort, and an overlapped step only has the blocks held before it), and only follow a
    decode that samples."""
    if not entry.draft_token_ids:
        return
    if not entry.sample or entry.num_tokens != 1:
        entry.draft_token_ids = []
        return
    room = len(entry.seq.block_table) * block_size - (entry.start_position + 1)
    del entry.draft_token_ids[max(0, room):]
