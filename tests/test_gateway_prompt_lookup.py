"""gateway.prompt_lookup: the n-gram index, the adaptive draft length, and which steps draft."""
from __future__ import annotations

import itertools

import pytest

from gateway.prompt_lookup import (COST_SAMPLES, MISSES_TO_STOP, REPROBE_STEPS, DraftCost, DraftLength, NgramIndex,
                                   PredictedOutput, SpeculationState)
from gateway.sampling_fields import fill_sampling
from gateway.scheduler import Scheduler, SchedulerConfig
from gateway.sequence import GenerationRequest, SamplingOptions
from kvserve.errors import InvalidArgument
from kvserve.v1 import executor_pb2


class Decoder:
    def append(self, token_id):
        return f"<{token_id}>"

    def flush(self):
        return ""


def test_the_longest_suffix_ngram_s_latest_earlier_occurrence_gives_the_drafts():
    index = NgramIndex()
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3]
    # "1 2 3" occurred at 0..2 (followed by 4 5 9); "2 3" more recently at 6..7 (followed by 7 8), but 3-grams win.
    assert index.propose(tokens, 3) == [4, 5, 9]
    tokens += [4, 5, 6, 2, 3]  # suffix 3-gram "6 2 3" never seen; "2 3" latest at 11..12 followed by 4 5 6
    assert index.propose(tokens, 2) == [4, 5]
    assert index.propose(tokens + [42], 4) == []  # 42 never occurred before
    assert index.propose([5], 4) == [] and index.propose([1, 2], 0) == []


def test_a_prediction_is_drafted_while_followed_and_realigned_after_an_edit():
    predicted = PredictedOutput.of([10, 11, 12, 13, 14, 15, 16, 10, 11, 12, 17])
    assert predicted.propose([], 3) == [10, 11, 12]  # nothing generated yet: its beginning
    assert predicted.propose([10, 11], 3) == [12, 13, 14]
    # An insertion (99) the prediction lacks: the output's last n-gram is nowhere in it, no drafts;
    # once the output is back on it ("13 14"), drafts go on from there.
    assert predicted.propose([10, 11, 12, 99], 3) == []
    assert predicted.propose([10, 11, 12, 99, 13, 14], 3) == [15, 16, 10]
    # A deletion (15 16 skipped): "10 11 12" occurs twice; the occurrence after where the two last
    # agreed is taken, not the first.
    assert predicted.propose([10, 11, 12, 99, 13, 14, 10, 11, 12], 5) == [17]
    assert predicted.propose([10, 11, 12, 99, 13, 14, 10, 11, 12, 17], 5) == []  # its end


def test_a_prediction_drafts_first_and_the_sequence_s_own_text_where_it_has_nothing():
    state = SpeculationState(NgramIndex(), DraftLength(4), PredictedOutput.of([7, 8, 9]))
    prompt = [1, 2, 3, 1, 2]
    assert state.propose(prompt + [7], len(prompt), 2) == ([8, 9], True)
    assert state.propose(prompt + [7, 5, 1, 2], len(prompt), 2) == ([7, 5], False)  # off the prediction: lookup


def test_the_index_matches_a_scan_as_tokens_are_appended():
    index = NgramIndex()
    tokens = []
    for token in itertools.islice(itertools.cycle([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]), 60):
        tokens.append(token)
        expected = []
        for n in (3, 2, 1):  # the scan: latest earlier occurrence of the longest suffix n-gram
            if len(tokens) <= n:
                continue
            starts = [i for i in range(len(tokens) - n) if tokens[i:i + n] == tokens[-n:]]
            if starts:
                expected = tokens[starts[-1] + n:starts[-1] + n + 3]
                break
        assert index.propose(tokens, 3) == expected, tokens


def test_draft_length_grows_on_success_shrinks_on_failure_and_reprobes():
    length = DraftLength(5)
    assert length.next() == 5
    length.record(5, 2)
    assert length.next() == 3  # what was accepted, plus one
    length.record(3, 3)
    assert length.next() == 4
    for _ in range(MISSES_TO_STOP):
        length.record(length.next(), 0)
    assert length.current == 0
    drafts = [length.next() for _ in range(REPROBE_STEPS)]
    assert drafts == [0] * (REPROBE_STEPS - 1) + [1]  # one probe after a quiet spell
    length.record(1, 1)
    assert length.next() == 2


def test_drafting_stops_where_drafted_steps_cost_more_than_their_accepted_tokens_bring():
    cost = DraftCost()
    assert cost.ratio(1) == 1.0 and not cost.wants_plain_step(1)  # unknown: draft, and so measure
    for _ in range(COST_SAMPLES):
        cost.observe(1, True, 0.25)
    assert cost.wants_plain_step(1)  # every step drafted so far: a plain one is needed to compare
    for _ in range(COST_SAMPLES):
        cost.observe(1, False, 0.10)
        cost.observe(8, False, 0.20)
    assert not cost.wants_plain_step(1)
    assert cost.ratio(1) == pytest.approx(2.5) and cost.ratio(8) == 1.0  # per batch size
    copying, chatty = DraftLength(5), DraftLength(5)
    for _ in range(10):
        copying.record(5, 5)
        chatty.record(4, 1)
    assert copying.next(cost.ratio(1)) == 5  # ~6 tokens a step for 2.5 steps' time
    assert chatty.tokens_per_step < 2.5  # 2 tokens a drafted step
    assert [chatty.next(cost.ratio(1)) for _ in range(REPROBE_STEPS)] == [0] * (REPROBE_STEPS - 1) + [2]
    assert chatty.next(1.0) == 2  # where drafting costs nothing extra, even a poor rate drafts


def make_scheduler(**config) -> Scheduler:
    ids = itertools.count(1)
    scheduler = Scheduler(SchedulerConfig(speculative_decoding="prompt-lookup", **config), lambda: next(ids))
    scheduler.kv_block_size = 4
    scheduler.drafts_enabled = True
    return scheduler


def running(scheduler: Scheduler, prompt: list[int], **options) -> GenerationRequest:
    request = GenerationRequest(f"r{len(scheduler.requests)}", prompt,
                                SamplingOptions(max_tokens=options.pop("max_tokens", 50), **options),
                                frozenset({2}), 4096)
    scheduler.add_request(request, Decoder)
    for seq in request.sequences:  # as if prefilled: every token but the last computed
        seq.num_computed = seq.num_known_by_manager = len(seq.token_ids) - 1
        seq.block_table = [1] * 8
    request.fork_pending = False
    scheduler.waiting.clear()
    scheduler.running += request.sequences
    for seq in request.sequences:
        seq.status = seq.status.RUNNING
    return request


COPYING = [7, 8, 9, 10, 11, 12, 5, 7, 8]  # ends with "7 8": drafts 9 10 11 ...


@pytest.mark.parametrize("options, drafts", [
    ({}, True),
    ({"temperature": 0.8}, False),
    ({"n": 2}, False),
    ({"logprobs": 1}, False),
    ({"min_tokens": 3}, False),
    ({"repetition_penalty": 1.2}, False),
    ({"logit_bias": ((5, 1.0),)}, False),
])
def test_only_plain_greedy_single_choice_requests_draft(options, drafts):
    scheduler = make_scheduler()
    running(scheduler, COPYING, **options)
    plan = scheduler.schedule()
    assert bool(any(e.draft_token_ids for e in plan)) is drafts
    if drafts:
        # Slots for the 5 drafts, and for the next step's token and its 5 drafts.
        assert plan[0].draft_token_ids == [9, 10, 11, 12, 5] and plan[0].num_lookahead_slots == 11


def test_the_step_token_budget_limits_drafts_and_a_big_batch_gets_none():
    scheduler = make_scheduler(speculative_token_budget=8)
    for _ in range(3):
        running(scheduler, COPYING)
    plan = scheduler.schedule()
    assert [len(e.draft_token_ids) for e in plan] == [5, 0, 0]  # 3 decodes + 5 drafts = the budget of 8
    scheduler = make_scheduler(speculative_token_budget=8)
    for _ in range(8):
        running(scheduler, COPYING)
    assert not any(e.draft_token_ids for e in scheduler.schedule())


def test_drafts_never_pass_max_tokens_and_are_cut_to_the_slots_held():
    scheduler = make_scheduler()
    request = running(scheduler, COPYING, max_tokens=3)
    seq = request.sequences[0]
    seq.token_ids.append(9)  # one output token so far, continuing the copy: "7 8 9" is followed by 10 11 ...
    seq.num_computed = seq.num_known_by_manager = len(COPYING)
    (entry,) = scheduler.schedule()
    assert entry.draft_token_ids == [10]  # 2 tokens left: 1 draft + the token after it
    scheduler = make_scheduler()
    request = running(scheduler, COPYING)
    (entry,) = scheduler.schedule()
    request.sequences[0].block_table = [1, 2, 3]  # 12 slots: the step's token at 8, room for 3 drafts
    entry.start_position, entry.num_tokens, entry.sample = 8, 1, True
    scheduler._cap_drafts(entry)
    assert entry.draft_token_ids == [9, 10, 11]


@pytest.mark.parametrize("min_tokens, drafts", [(50, [9, 10, 11, 12, 5]), (4, [9, 10, 11]), (1, [])])
def test_an_executor_that_verifies_suppressed_drafts_gets_drafts_up_to_min_tokens(min_tokens, drafts):
    """Until min_tokens exist EOS is suppressed at every position the step samples, so drafts stop
    where suppression would end inside the step (this step's token is output 0: with min_tokens 4,
    outputs 0..3 are suppressed, room for 3 drafts)."""
    scheduler = make_scheduler()
    scheduler.drafts_before_min_tokens = True
    running(scheduler, COPYING, min_tokens=min_tokens)
    (entry,) = scheduler.schedule()
    assert entry.draft_token_ids == drafts
    params = executor_pb2.SamplingParams()
    fill_sampling(params, entry, vocab_size=64)
    assert list(params.suppressed_token_ids) == [2]  # the same suppression at every drafted row


def test_speculation_flags_are_checked():
    with pytest.raises(InvalidArgument, match="speculative_decoding"):
        SchedulerConfig(speculative_decoding="medusa")
    with pytest.raises(InvalidArgument, match="num_speculative_tokens"):
        SchedulerConfig(num_speculative_tokens=0)
