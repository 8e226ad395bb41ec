"""Continuous batching at iteration level: which sequences run how many tokens each step.

Pure Python: no grpc, no tensors. One step is

1. ``schedule()``: running sequences first (decodes, then prefill chunks), then
   waiting ones FCFS, within ``max_num_seqs`` and ``max_num_batched_tokens``
   (a long prompt is split across steps, so decodes are never starved); the
   budget counts the tokens a step computes, a new prompt's after the prefix
   hit it is expected to get (``gateway.computed_prefixes``); a prompt whose
   first KV block equals one admitted in the same step waits a step, so that it
   hits that block instead of computing it again;
2. the engine sends the plan to kvmanager ``Allocate`` and hands the results to
   ``apply_allocation()``: NO_ROOM preempts the most recently admitted running
   sequence (recompute: freed, requeued at the head) and asks for a retry; a
   sequence that cannot fit even alone fails its request instead of looping;
3. the engine runs the ready entries on the executor and hands the sampled
   tokens to ``apply_samples()``, which appends them, checks stop conditions and
   collects per-request outputs; finished sequences are queued for freeing, and
   every executed entry for a written-KV report (``take_written_reports``), which
   the engine sends with the next Allocate or Free so that kvmanager publishes
   only blocks whose KV really is written. An entry the executor refused
   (``fail_refused``) fails its request and is never reported.

``batching="static"`` is the baseline: a batch is admitted only when nothing
runs, and runs to completion. ``n > 1`` prefills the prompt once (all but its
last token) in sequence 0, then the engine ``Fork``s the other choices from it.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from gateway.computed_prefixes import ComputedPrefixes
from gateway.prompt_lookup import DraftCost, cap_drafts, plan_drafts
from gateway.sequence import (
    FinishReason, GenerationRequest, PredictionTokens, PromptTokenLogprob, RequestOutput, Sequence, SeqStatus,
)
from gateway.stopping import append_token, finish_with, take_delta
from kvserve.errors import InvalidArgument, ResourceExhausted


def create_sequences(request: GenerationRequest, make_decoder: Callable[[], object],
                     new_seq_id: Callable[[], int]) -> None:
    """The request's ``n`` choices; with ``n > 1`` only choice 0 prefills, the others fork from it."""
    n = request.options.n
    request.fork_pending = n > 1 and request.num_prompt_tokens >= 2
    constraint = request.options.constraint
    for index in range(n):
        seq = Sequence(new_seq_id(), request, index, list(request.prompt_token_ids), make_decoder())
        if constraint is not None:
            seq.grammar = constraint.new_state()
        request.sequences.append(seq)


SPECULATIVE_MODES = ("off", "prompt-lookup")
MAX_SPECULATIVE_TOKENS = 64


class RequestTooLarge(ResourceExhausted):
    """A request that can never fit in the KV cache (HTTP 400, gRPC RESOURCE_EXHAUSTED)."""


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    batching: str = "continuous"  # or "static"
    speculative_decoding: str = "prompt-lookup"  # (gateway.prompt_lookup) or "off"
    num_speculative_tokens: int = 5  # the most drafts one sequence sends in a step
    # Drafts go only into steps of at most this many tokens (step's tokens + drafts): a big batch is
    # compute-bound already, where verifying guesses costs more than it saves.
    speculative_token_budget: int = 16

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise InvalidArgument(f"max_num_seqs: must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise InvalidArgument(f"max_num_batched_tokens: must be >= 1, got {self.max_num_batched_tokens}")
        if self.batching not in ("continuous", "static"):
            raise InvalidArgument(f"batching: must be 'continuous' or 'static', got {self.batching!r}")
        if self.speculative_decoding not in SPECULATIVE_MODES:
            raise InvalidArgument(f"speculative_decoding: must be one of {', '.join(SPECULATIVE_MODES)}, "
                                  f"got {self.speculative_decoding!r}")
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise InvalidArgument(f"num_speculative_tokens: must be 1..{MAX_SPECULATIVE_TOKENS}, "
                                  f"got {self.num_speculative_tokens}")
        if self.speculative_token_budget < 0:
            raise InvalidArgument(f"speculative_token_budget: must be >= 0, got {self.speculative_token_budget}")


@dataclass
class AllocationResult:
    """kvmanager's answer for one sequence of a step (a mirror of SequenceAllocationResult)."""

    ok: bool
    num_cached_tokens: int = 0
    start_position: int = 0
    num_tokens: int = 0
    block_table_offset: int = 0
    block_table: list[int] = field(default_factory=list)
    copy_src: list[int] = field(default_factory=list)
    copy_dst: list[int] = field(default_factory=list)
    num_store_tokens: int = 0
    store_load_block_ids: list[int] = field(default_factory=list)
    store_load_hashes: list[bytes] = field(default_factory=list)


@dataclass
class ScheduledSeq:
    """One sequence's part of a step: what to tell the kvmanager, then what to run."""

    seq: Sequence
    seq_id: int
    num_new_tokens: int
    new_token_ids: list[int]
    start_position: int = 0
    num_tokens: int = 0
    sample: bool = False
    copies: list[tuple[int, int]] = field(default_factory=list)
    num_lookahead_slots: int = 0  # asked of kvmanager so that the next decode step needs no new block
    store_load_block_ids: list[int] = field(default_factory=list)  # loaded from the store before the forward
    store_load_hashes: list[bytes] = field(default_factory=list)
    # Speculative decoding: guesses of the tokens after this decode's token, verified in the same
    # Execute (capped to the slots held once the allocation is known), and how many leading
    # new_token_ids are accepted drafts of an earlier step whose KV is written already.
    draft_token_ids: list[int] = field(default_factory=list)
    drafts_predicted: bool = False  # the drafts are the request's prediction's (not its own text's)
    num_precomputed_tokens: int = 0

    def compute_token_ids(self) -> list[int]:
        return self.seq.token_ids[self.start_position:self.start_position + self.num_tokens]

    def prompt_logprob_token_ids(self) -> list[int]:
        """When the request wants its prompt scored and is not yet: the prompt tokens that follow
        this entry's rows (the last prompt token follows none of its prompt's rows)."""
        request = self.seq.request
        if request.options.prompt_logprobs is None or request.prompt_logprobs_complete():
            return []
        start = self.start_position
        end = min(start + self.num_tokens, request.num_prompt_tokens - 1)
        return self.seq.token_ids[start + 1:end + 1] if end > start else []


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    # When the entry sent drafts: how many were accepted (this token is the first of them, unless
    # none was), and the tokens after this one (the other accepted drafts, then the sampled one).
    num_accepted_drafts: int = 0
    next_tokens: list["SampledToken"] = field(default_factory=list)


@dataclass
class AllocationVerdict:
    ready: list[ScheduledSeq]
    retry: list[ScheduledSeq]


@dataclass
class SchedulerCounters:
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    store_hits: int = 0  # prompt tokens loaded from the store tier instead of computed
    store_load_misses: int = 0  # sequences recomputed because a store load missed
    num_draft_tokens: int = 0  # speculative drafts sent for verification
    num_accepted_draft_tokens: int = 0  # of those, accepted


class Scheduler:
    """FCFS waiting queue + running set; the engine drives it one step at a time."""

    def __init__(self, config: SchedulerConfig, new_seq_id: Callable[[], int]):
        self.config = config
        self._new_seq_id = new_seq_id
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.requests: dict[str, GenerationRequest] = {}
        self.counters = SchedulerCounters()
        self._pending_frees: list[int] = []
        self._written: dict[int, int] = {}  # seq_id -> tokens whose KV an Execute that returned wrote
        # The blocks of prompts computed whole: kvmanager has them (the next Allocate reports them
        # written before it allocates), so prompts starting with them need not wait, and are
        # expected to hit them. Made for the executor's block size once it is known.
        self._computed_prefixes: ComputedPrefixes | None = None
        self._pending_forks: list[GenerationRequest] = []
        self._outputs: list[RequestOutput] = []
        self._admissions = 0
        # Tokens per KV block of the executor (the backend sets it); None: no same-step deferral.
        self.block_size: int | None = None
        # The same, set whether or not prefix caching is on: for predict_decodes.
        self.kv_block_size: int | None = None
        # Speculative drafts are sent: configured, and the executor verifies them (the backend sets it).
        self.drafts_enabled = False
        # Drafts may be sent while min_tokens suppresses EOS: the executor suppresses at every drafted row.
        self.drafts_before_min_tokens = False
        self.draft_cost = DraftCost()  # what drafts cost this executor (the backend reports step times)

    # --- requests in and out -------------------------------------------------

    def add_request(self, request: GenerationRequest, make_decoder: Callable[[], object]) -> None:
        """Creates the request's ``n`` sequences and queues what can start."""
        create_sequences(request, make_decoder, self._new_seq_id)
        self.adopt([request])

    def adopt(self, requests: list[GenerationRequest], *, front: bool = False) -> None:
        """Queues requests whose sequences exist: new ones (at the back), or ones that
        ran elsewhere and are recomputed from their tokens (``front``: ahead of the
        waiting ones, in the given order, as preempted sequences are)."""
        queued: list[Sequence] = []
        for request in requests:
            self.requests[request.request_id] = request
            unfinished = [seq for seq in request.sequences if not seq.is_finished]
            queued += unfinished[:1] if request.fork_pending else unfinished
        if front:
            self.waiting.extendleft(reversed(queued))
        else:
            self.waiting.extend(queued)

    def release(self, requests: list[GenerationRequest]) -> None:
        """Takes waiting requests out (to be adopted by another scheduler)."""
        leaving = {id(request) for request in requests}
        self.waiting = deque(seq for seq in self.waiting if id(seq.request) not in leaving)
        for request in requests:
            self.requests.pop(request.request_id, None)

    def evacuate(self) -> list[GenerationRequest]:
        """The executor or the session is gone: every unfinished request leaves with the
        tokens it has, oldest first, to be recomputed wherever it is adopted next."""
        self.preempt_all()
        self.forget_connection_state()
        requests = sorted((r for r in self.requests.values() if not r.finished), key=lambda r: r.arrival_time)
        self.release(requests)
        return requests

    def abort_request(self, request_id: str) -> bool:
        """Finishes every choice with ``abort``; blocks are freed with the next Allocate."""
        request = self.requests.get(request_id)
        if request is None:
            return False
        self._end_request(request, FinishReason.ABORT, None)
        return True

    def fail_request(self, request: GenerationRequest, error: Exception) -> None:
        self._end_request(request, FinishReason.ERROR, error)

    def fail_all(self, error: Exception) -> None:
        for request in list(self.requests.values()):
            self.fail_request(request, error)

    def _end_request(self, request: GenerationRequest, reason: FinishReason, error: Exception | None) -> None:
        for seq in request.sequences:
            if not seq.is_finished:
                finish_with(seq, reason)
                self._retire(seq)
        self._emit(request, error=error)

    # --- state the engine reads ------------------------------------------------

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._pending_forks)

    def pending_tokens(self) -> int:
        """Tokens to compute before a request queued now would run (prefills waiting or
        in progress): what the router weighs as this scheduler's queue."""
        return sum(seq.num_uncached_to_compute() for seq in self.waiting) + \
            sum(seq.num_to_compute() for seq in self.running if seq.num_to_compute() > 1)

    @property
    def num_waiting_requests(self) -> int:
        return len({seq.request.request_id for seq in self.waiting})

    def take_pending_frees(self) -> list[int]:
        frees, self._pending_frees = self._pending_frees, []
        return frees

    def take_written_reports(self) -> tuple[list[int], list[int]]:
        """(seq_ids, tokens written) of the entries executed since the last take."""
        written, self._written = self._written, {}
        return list(written), list(written.values())

    def forget_connection_state(self) -> None:
        """The kvmanager session is gone: nothing queued for it is worth sending."""
        self._pending_frees = []
        self._written = {}
        self._pending_forks = []

    def take_pending_forks(self) -> list[GenerationRequest]:
        forks, self._pending_forks = self._pending_forks, []
        return [r for r in forks if not r.finished and r.sequences[0].status is SeqStatus.RUNNING]

    def take_outputs(self) -> list[RequestOutput]:
        outputs, self._outputs = self._outputs, []
        return outputs

    # --- one step ------------------------------------------------------------

    def schedule(self) -> list[ScheduledSeq]:
        """Picks this step's batch: decodes, prefill chunks, then admissions."""
        budget = self.config.max_num_batched_tokens
        plan: list[ScheduledSeq] = []
        for seq in self.running:
            if seq.num_to_compute() == 1 and budget > 0:
                plan.append(self._entry(seq, 1))
                budget -= 1
        for seq in self.running:
            todo = seq.num_to_compute()
            if todo > 1 and budget > 0:
                plan.append(self._entry(seq, min(todo, budget)))
                budget -= plan[-1].num_new_tokens
        if self.config.batching == "static":
            if not self.running:
                while self.waiting and self._running_slots() < self.config.max_num_seqs:
                    seq = self.waiting.popleft()
                    self._admit(seq)
                    if budget > 0:
                        plan.append(self._entry(seq, min(seq.num_to_compute(), budget)))
                        budget -= plan[-1].num_new_tokens
            return plan
        deferred: list[Sequence] = []
        first_blocks: set[bytes] = set()  # of the prompts admitted in this step
        while self.waiting and budget > 0 and self._running_slots() + self._slots(self.waiting[0]) <= \
                self.config.max_num_seqs:
            seq = self.waiting.popleft()
            hashes = self._lookup_hashes(seq)
            cached_blocks = self._computed_prefixes.num_leading(hashes, refresh=True) if hashes else 0
            if hashes and not cached_blocks:  # its first block is not computed yet
                if hashes[0] in first_blocks:
                    deferred.append(seq)
                    continue
                first_blocks.add(hashes[0])
            self._admit(seq)
            expected_hit = self._expected_hit(seq, cached_blocks)
            plan.append(self._entry(seq, min(seq.num_to_compute() - expected_hit, budget), expected_hit))
            budget -= plan[-1].num_new_tokens
        self.waiting.extendleft(reversed(deferred))
        if self.drafts_enabled:
            self._plan_drafts(plan)
        return plan

    def _plan_drafts(self, plan: list[ScheduledSeq]) -> None:
        budget = self.config.speculative_token_budget - sum(e.num_new_tokens for e in plan)
        if budget > 0 and not self.draft_cost.wants_plain_step(len(plan)):
            plan_drafts(plan, self.config.num_speculative_tokens, budget, self.draft_cost.ratio(len(plan)),
                        self.drafts_before_min_tokens)

    def _cap_drafts(self, entry: ScheduledSeq) -> None:
        cap_drafts(entry, self.kv_block_size or 0)

    def _block_hashes(self, seq: Sequence, num_tokens: int) -> list[bytes]:
        """The hashes of the full blocks in the sequence's first ``num_tokens`` tokens, as kvmanager
        hashes them; [] where prefix caching is off for it."""
        bs = self.block_size
        options = seq.request.options
        if not bs or not options.enable_prefix_caching or num_tokens < bs:
            return []
        if self._computed_prefixes is None or self._computed_prefixes.block_size != bs:
            self._computed_prefixes = ComputedPrefixes(bs)
        return self._computed_prefixes.hashes(seq.token_ids, num_tokens // bs, options.cache_salt, options.tenant,
                                              options.num_shared_tokens)

    def _lookup_hashes(self, seq: Sequence) -> list[bytes]:
        """The blocks the Allocate that creates the sequence looks up (every full block but one that
        ends what it sends: a hit leaves the last token to compute). A prompt sharing its first
        block with one admitted in the same step waits one step, then hits what the first wrote
        (no same-step hits), instead of computing the same prefix again beside it."""
        return [] if seq.known_to_kvmanager else self._block_hashes(seq, seq.num_sendable() - 1)

    def _expected_hit(self, seq: Sequence, cached_blocks: int) -> int:
        """The prefix-cache hit planned for a new sequence: the blocks this scheduler saw computed,
        or the router's expectation where that is longer (whole blocks before the last token)."""
        if not self.block_size or seq.known_to_kvmanager or not seq.request.options.enable_prefix_caching:
            return 0
        bs = self.block_size
        most = max(0, seq.num_sendable() - 1) // bs * bs
        return min(most, max(cached_blocks * bs, seq.request.expected_cached_tokens // bs * bs))

    def _prompt_computed(self, seq: Sequence) -> None:
        """A prompt's last chunk was written: its blocks are kvmanager's once the next Allocate
        reports them, for prompts that start with them to hit."""
        hashes = self._block_hashes(seq, seq.num_prompt_tokens)
        if hashes:
            self._computed_prefixes.record(hashes)

    def predict_decodes(self, plan: list[ScheduledSeq]) -> list[tuple[int, int]] | None:
        """For a step of plain decodes, each into a slot its sequence already holds alone, kvmanager's
        answer is known before it comes: OK, the one token at ``num_computed``, no copy, the block
        table unchanged (or, for a lookahead, only added to). Returns each entry's start position
        and blocks held for ``apply_predicted`` then, or None when any entry needs the answer first
        (a new sequence, a prefill chunk, a new block, a request with forked choices, whose blocks
        may be shared until their first copy-on-write). Steps that end on a block boundary ask for
        a lookahead slot (``_entry``), so a decode rarely needs a new block."""
        bs = self.kv_block_size
        if not plan or not bs:
            return None
        for entry in plan:
            seq = entry.seq
            if (entry.num_new_tokens != 1 or not seq.known_to_kvmanager or seq.num_to_compute() != 1
                    or seq.request.options.n != 1 or seq.num_computed >= len(seq.block_table) * bs):
                return None
        return [(entry.seq.num_computed, len(entry.seq.block_table)) for entry in plan]

    def apply_predicted(self, plan: list[ScheduledSeq], predicted: list[tuple[int, int]]) -> list[ScheduledSeq]:
        """Fills in ``plan`` as ``apply_allocation`` would from the predicted answer; the entries to run."""
        for entry, (start, _) in zip(plan, predicted):
            entry.start_position, entry.num_tokens, entry.copies = start, 1, []
            entry.sample = True
            self._cap_drafts(entry)  # to the blocks held before this step: its Execute goes out now
        return list(plan)

    @staticmethod
    def answer_matches(predicted: list[tuple[int, int]], results: list[AllocationResult]) -> bool:
        """Whether kvmanager answered what ``predict_decodes`` said it would."""
        return len(results) == len(predicted) and all(
            r.ok and r.start_position == start and r.num_tokens == 1 and r.block_table_offset == held
            and not r.copy_src for r, (start, held) in zip(results, predicted))

    def apply_allocation(self, plan: list[ScheduledSeq], results: list[AllocationResult],
                         saves_in_transit: bool = False) -> AllocationVerdict:
        """Records kvmanager's answers; handles NO_ROOM by preemption or failure. ``saves_in_transit``:
        kvmanager holds blocks for store saves not yet reported; they come back within two steps, so
        a sequence that lacks room only for them waits instead of failing as too large."""
        if len(plan) != len(results):
            raise ValueError(f"{len(results)} allocation results for {len(plan)} sequences")
        ready: list[ScheduledSeq] = []
        no_room: list[ScheduledSeq] = []
        for entry, result in zip(plan, results):
            seq = entry.seq
            if seq.status is not SeqStatus.RUNNING or seq.seq_id != entry.seq_id:
                continue
            if not result.ok:
                no_room.append(entry)
                continue
            if not seq.known_to_kvmanager:
                self._record_prefix_lookup(seq, result.num_cached_tokens, result.num_store_tokens)
            entry.store_load_block_ids = result.store_load_block_ids
            entry.store_load_hashes = result.store_load_hashes
            seq.num_known_by_manager = seq.num_sendable()
            seq.apply_block_table_delta(result.block_table_offset, list(result.block_table))
            entry.start_position = result.start_position
            entry.num_tokens = result.num_tokens
            entry.copies = list(zip(result.copy_src, result.copy_dst))
            end = result.start_position + result.num_tokens
            entry.sample = end == len(seq.token_ids) and seq.request.options.max_tokens != 0
            self._cap_drafts(entry)
            if result.num_tokens > 0 or entry.copies:
                ready.append(entry)
        retry: list[ScheduledSeq] = []
        requeue: list[Sequence] = []
        preempted = False  # one victim per round: its blocks may be enough for the others
        for entry in no_room:
            seq = entry.seq
            if seq.status is not SeqStatus.RUNNING:
                continue  # already preempted as a victim this round
            others_hold = saves_in_transit or any(s.known_to_kvmanager for s in self.running if s is not seq)
            if not seq.known_to_kvmanager:
                if others_hold or self._pending_frees:  # wait for blocks held or being freed
                    self.running.remove(seq)
                    seq.status = SeqStatus.WAITING
                    requeue.append(seq)
                else:
                    self._fail_cannot_fit(seq, entry)
                continue
            if preempted:
                retry.append(entry)
                continue
            victim = self._pick_victim()
            if victim is seq and not others_hold:
                self._fail_cannot_fit(seq, entry)
                continue
            self._preempt(victim)
            preempted = True
            requeue.append(victim)
            if victim is not seq:
                retry.append(entry)
        requeue.sort(key=lambda s: s.admitted_order)
        self.waiting.extendleft(reversed(requeue))
        return AllocationVerdict(ready=self.prune(ready), retry=self.prune(retry))

    @staticmethod
    def prune(entries: list[ScheduledSeq]) -> list[ScheduledSeq]:
        """Drops entries whose sequence was preempted or finished since they were allocated."""
        return [e for e in entries if e.seq.status is SeqStatus.RUNNING and e.seq.seq_id == e.seq_id]

    def apply_samples(self, ready: list[ScheduledSeq], sampled: list[SampledToken],
                      prompt_logprobs: dict[int, list[PromptTokenLogprob]] | None = None) -> None:
        """Records computed KV, prompt scores (by seq_id) and appends sampled tokens; outputs go to
        ``take_outputs()``."""
        touched: dict[str, GenerationRequest] = {}
        samples = iter(sampled)
        for entry in ready:
            seq = entry.seq
            sample = next(samples) if entry.sample else None
            if seq.status is not SeqStatus.RUNNING:
                continue
            if prompt_logprobs and entry.seq_id in prompt_logprobs:
                seq.request.record_prompt_logprobs(entry.start_position, prompt_logprobs[entry.seq_id])
            seq.num_computed = entry.start_position + entry.num_tokens
            if entry.start_position < seq.num_prompt_tokens <= seq.num_computed:
                self._prompt_computed(seq)
            # What kvmanager knows of: accepted drafts are reported once it counts them (next step).
            self._written[entry.seq_id] = seq.num_computed
            request = seq.request
            if sample is not None:
                touched[request.request_id] = request
                if entry.draft_token_ids:
                    self._record_drafts(entry, sample.num_accepted_drafts)
                for token in [sample] + sample.next_tokens:  # one at a time through the stop checks
                    if append_token(seq, token.token_id, token.logprob, token.top_logprobs):
                        self._retire(seq)
                        break
            elif request.fork_pending and seq.index == 0 and seq.num_to_compute() == 0:
                self._pending_forks.append(request)
            elif request.options.max_tokens == 0 and seq.num_computed == len(seq.token_ids):
                finish_with(seq, FinishReason.LENGTH)  # the prompt alone was asked for (echo)
                self._retire(seq)
                touched[request.request_id] = request
        for request in touched.values():
            self._emit(request)

    def _record_drafts(self, entry: ScheduledSeq, num_accepted: int) -> None:
        """Accepted drafts have their KV written: the sequence counts them computed (kvmanager
        learns it from the next step's ``num_precomputed_tokens``)."""
        seq = entry.seq
        seq.num_computed += num_accepted
        seq.speculation.length.record(len(entry.draft_token_ids), num_accepted)
        self.counters.num_draft_tokens += len(entry.draft_token_ids)
        self.counters.num_accepted_draft_tokens += num_accepted
        if entry.drafts_predicted:
            seq.request.prediction_tokens += PredictionTokens(num_accepted, len(entry.draft_token_ids) - num_accepted)

    def preempt_all(self) -> None:
        """Every running sequence lost its KV: requeue all of them for recompute, in
        admission order, ahead of the waiting ones (no frees: their session is gone)."""
        victims = sorted(self.running, key=lambda s: s.admitted_order)
        for seq in victims:
            seq.reset_for_recompute(self._new_seq_id())
            seq.request.num_cached_tokens = None  # the hit it had read lost KV: usage reports the next one
            self.counters.num_preemptions += 1
        self.running = []
        self.waiting.extendleft(reversed(victims))
        self._pending_forks = []  # a parent that was about to fork is recomputed and forks again

    def drop_unloaded(self, entries: list[ScheduledSeq]) -> None:
        """The executor did not run these entries: a store load of theirs missed. Each sequence is
        preempted (freed, requeued ahead of the waiting ones); kvmanager, told of the miss, then
        finds less in the store and the sequence computes what it could not load."""
        victims = [e.seq for e in entries if e.seq.status is SeqStatus.RUNNING and e.seq.seq_id == e.seq_id]
        for seq in victims:
            self._preempt(seq)
            self.counters.store_load_misses += 1
        victims.sort(key=lambda s: s.admitted_order)
        self.waiting.extendleft(reversed(victims))

    def fail_refused(self, entries: list[ScheduledSeq], error: Exception) -> None:
        """A dependency refused these entries' step: their requests fail, the rest go on."""
        for request in {id(e.seq.request): e.seq.request for e in entries}.values():
            if not request.finished:
                self.fail_request(request, error)

    def complete_fork(self, request: GenerationRequest, block_table: list[int]) -> None:
        """The engine forked sequence 0 into the other choices: they join the running set."""
        parent = request.sequences[0]
        request.fork_pending = False
        for child in request.sequences[1:]:
            if child.is_finished:
                continue
            child.num_computed = parent.num_computed
            child.num_known_by_manager = parent.num_known_by_manager
            child.block_table = list(block_table)
            self._admit(child)

    # --- helpers -------------------------------------------------------------

    def _entry(self, seq: Sequence, num_new_tokens: int, expected_hit: int = 0) -> ScheduledSeq:
        """``num_new_tokens`` to compute after the ``expected_hit`` a new sequence is planned to
        get. A step that computes all a sequence knows and ends on a block boundary asks for one
        slot past its end: the next decode step then needs no new block, so its answer can be
        predicted (``predict_decodes``)."""
        num_sendable = seq.num_sendable()
        new_ids = seq.token_ids[seq.num_known_by_manager:num_sendable]
        end = seq.num_computed + expected_hit + num_new_tokens
        bs = self.kv_block_size
        lookahead = int(bool(bs) and end >= num_sendable and end % bs == 0 and seq.request.options.n == 1)
        # Accepted drafts of the last step: known here, not yet to kvmanager, their KV written.
        precomputed = max(0, seq.num_computed - seq.num_known_by_manager)
        return ScheduledSeq(seq, seq.seq_id, num_new_tokens, new_ids, num_lookahead_slots=lookahead,
                            num_precomputed_tokens=precomputed)

    def _slots(self, seq: Sequence) -> int:
        request = seq.request
        return request.options.n if request.fork_pending and seq.index == 0 else 1

    def _running_slots(self) -> int:
        return sum(self._slots(seq) for seq in self.running)

    def _admit(self, seq: Sequence) -> None:
        seq.status = SeqStatus.RUNNING
        seq.admitted_order = self._admissions
        self._admissions += 1
        self.running.append(seq)

    def _pick_victim(self) -> Sequence:
        holders = [s for s in self.running if s.known_to_kvmanager]
        return max(holders, key=lambda s: s.admitted_order)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._pending_frees.append(seq.seq_id)
        seq.reset_for_recompute(self._new_seq_id())
        self.counters.num_preemptions += 1

    def _record_prefix_lookup(self, seq: Sequence, num_cached_tokens: int, num_store_tokens: int = 0) -> None:
        """A first admission's hit is what usage reports as cached: the pool's and the store's."""
        request = seq.request
        if request.num_cached_tokens is None:
            request.num_cached_tokens = num_cached_tokens + num_store_tokens
            self.counters.prefix_cache_queries += request.num_prompt_tokens
            self.counters.prefix_cache_hits += num_cached_tokens + num_store_tokens
            self.counters.store_hits += num_store_tokens

    def _fail_cannot_fit(self, seq: Sequence, entry: ScheduledSeq) -> None:
        needed = seq.num_computed + entry.num_new_tokens
        self.fail_request(seq.request, RequestTooLarge(
            f"request {seq.request.request_id} cannot fit in the KV cache even alone "
            f"({needed} tokens of sequence {seq.index} need more blocks than the pool has free)"))

    def _retire(self, seq: Sequence) -> None:
        """A sequence is done: leave the queues, free its blocks with the next Allocate."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        if seq.known_to_kvmanager:
            self._pending_frees.append(seq.seq_id)
            seq.num_known_by_manager = 0
        seq.status = SeqStatus.FINISHED

    def _emit(self, request: GenerationRequest, error: Exception | None = None) -> None:
        if request.finished:
            return
        deltas = [d for d in (take_delta(seq) for seq in request.sequences) if d is not None]
        finished = request.all_finished()
        if finished:
            request.finished = True
            self.requests.pop(request.request_id, None)
        if not deltas and not finished:
            return
        self._outputs.append(RequestOutput(
            request_id=request.request_id, choices=deltas, finished=finished, error=error,
            prompt_tokens=request.num_prompt_tokens, completion_tokens=request.num_completion_tokens,
            cached_tokens=request.num_cached_tokens or 0, prediction_tokens=request.prediction_tokens,
        ))
