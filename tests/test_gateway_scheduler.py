"""Scheduler unit tests: a fake block pool (or kvmanager's domain, where prefix hits matter) and a
fake paged 'model' drive it like the engine.

The fake model reads every token of a sequence back out of its KV slots through the
block table before it "samples", so a wrong block table, start position or
copy-on-write shows up as a different output.
"""
from __future__ import annotations

import math

import pytest

from gateway.block_chains import BlockChainIndex
from gateway.computed_prefixes import ComputedPrefixes
from gateway.scheduler import AllocationResult, SampledToken, Scheduler, SchedulerConfig
from gateway.sequence import FinishReason, GenerationRequest, SamplingOptions, SeqStatus, TextDecoder
from kvserve.prefix_hashes import prefix_block_hashes
from kvmanager.manager import KVManager
from kvmanager.pool import AllocationRequest, PoolConfig

BLOCK = 4
EOS = 0


class CharDecoder(TextDecoder):
    """Token t → chr(ord('a') + t % 26); enough to test stop strings."""

    def append(self, token_id: int) -> str:
        return chr(ord("a") + token_id % 26)

    def flush(self) -> str:
        return ""


class FakePool:
    """Allocate/Fork/free semantics of kvmanager (paged, copy-on-write, no prefix cache)."""

    def __init__(self, num_blocks: int):
        self.free = list(range(1, num_blocks))
        self.refs: dict[int, int] = {}
        self.seqs: dict[int, dict] = {}
        self.peak_used = 0

    def used(self) -> int:
        return len(self.refs)

    def _release(self, seq_id: int) -> None:
        for block in self.seqs.pop(seq_id)["table"]:
            self.refs[block] -= 1
            if self.refs[block] == 0:
                del self.refs[block]
                self.free.append(block)

    def allocate(self, frees, plan) -> list[AllocationResult]:
        for seq_id in frees:
            if seq_id in self.seqs:
                self._release(seq_id)
        results = []
        for entry in plan:
            state = self.seqs.get(entry.seq_id) or {"tokens": [], "computed": 0, "table": []}
            tokens = state["tokens"] + entry.new_token_ids
            start = state["computed"]
            num = min(entry.num_new_tokens, len(tokens) - start)
            table = list(state["table"])
            need_new = max(0, math.ceil((start + num) / BLOCK) - len(table))
            cow_index = start // BLOCK if num and start % BLOCK and start // BLOCK < len(table) else None
            needs_cow = cow_index is not None and self.refs[table[cow_index]] > 1
            if need_new + needs_cow > len(self.free):
                results.append(AllocationResult(ok=False))
                continue
            lookahead = max(0, math.ceil((start + num + entry.num_lookahead_slots) / BLOCK) - len(table) - need_new)
            if need_new + needs_cow + lookahead <= len(self.free):  # held if there is room, else not asked
                need_new += lookahead
            offset = len(table)
            copies = ([], [])
            if needs_cow:
                src, dst = table[cow_index], self.free.pop(0)
                self.refs[src] -= 1
                self.refs[dst] = 1
                table[cow_index] = dst
                copies = ([src], [dst])
                offset = cow_index
            for _ in range(need_new):
                block = self.free.pop(0)
                self.refs[block] = 1
                table.append(block)
            self.seqs[entry.seq_id] = {"tokens": tokens, "computed": start + num, "table": table}
            results.append(AllocationResult(ok=True, start_position=start, num_tokens=num,
                                            block_table_offset=offset, block_table=table[offset:],
                                            copy_src=copies[0], copy_dst=copies[1]))
        self.peak_used = max(self.peak_used, self.used())
        return results

    def fork(self, parent: int, children: list[int]) -> list[int]:
        state = self.seqs[parent]
        for child in children:
            self.seqs[child] = {"tokens": list(state["tokens"]), "computed": state["computed"],
                                "table": list(state["table"])}
            for block in state["table"]:
                self.refs[block] += 1
        return list(state["table"])


class FakeModel:
    """KV slots hold token ids; the next token is a hash of everything read back."""

    def __init__(self):
        self.slots: dict[int, int] = {}
        self.batch_sizes: list[int] = []
        self.tokens_per_step: list[int] = []

    def execute(self, ready) -> list[SampledToken]:
        for entry in ready:
            for src, dst in entry.copies:
                for i in range(BLOCK):
                    if src * BLOCK + i in self.slots:
                        self.slots[dst * BLOCK + i] = self.slots[src * BLOCK + i]
        sampled = []
        for entry in ready:
            table = entry.seq.block_table
            for i, token in enumerate(entry.compute_token_ids()):
                pos = entry.start_position + i
                self.slots[table[pos // BLOCK] * BLOCK + pos % BLOCK] = token
            if entry.sample:
                end = entry.start_position + entry.num_tokens
                seen = [self.slots[table[p // BLOCK] * BLOCK + p % BLOCK] for p in range(end)]
                sampled.append(SampledToken(reference_next(seen, entry.seq.index)))
        self.batch_sizes.append(len(ready))
        self.tokens_per_step.append(sum(e.num_tokens for e in ready))
        return sampled


def reference_next(tokens: list[int], index: int = 0) -> int:
    return (sum(t * (i + 1) for i, t in enumerate(tokens[-5:])) * 7 + len(tokens) * 3 + index) % 97 + 1


def reference_output(prompt: list[int], max_tokens: int, index: int = 0) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(reference_next(tokens, index))
    return tokens[len(prompt):]


def make_request(rid: str, prompt: list[int], max_tokens: int = 8, **options) -> GenerationRequest:
    opts = SamplingOptions(max_tokens=max_tokens, **options)
    request = GenerationRequest(rid, prompt, opts, frozenset({EOS}), max_model_len=1024)
    request.max_stop_len = max((len(s) for s in opts.stop), default=0)
    return request


def run_to_completion(scheduler: Scheduler, pool: FakePool, model: FakeModel, max_steps: int = 2000,
                      predicted_steps: list[int] | None = None):
    outputs: dict[str, dict[int, list[int]]] = {}
    texts: dict[str, dict[int, str]] = {}
    finish: dict[str, dict[int, FinishReason]] = {}
    errors: dict[str, Exception] = {}
    for _ in range(max_steps):
        if not scheduler.has_work():
            break
        for request in scheduler.take_pending_forks():
            parent = request.sequences[0]
            table = pool.fork(parent.seq_id, [c.seq_id for c in request.sequences[1:]])
            scheduler.complete_fork(request, table)
        plan = scheduler.schedule()
        ready = []
        predicted = scheduler.predict_decodes(plan) if predicted_steps is not None else None
        if predicted is not None:  # as the gateway runs it: Execute before kvmanager's answer
            predicted_steps.append(len(plan))
            ready = scheduler.apply_predicted(plan, predicted)
            results = pool.allocate(scheduler.take_pending_frees(), plan)
            assert Scheduler.answer_matches(predicted, results), (predicted, results)
            scheduler.apply_allocation(plan, results)
            plan = []
        while plan:
            verdict = scheduler.apply_allocation(plan, pool.allocate(scheduler.take_pending_frees(), plan))
            ready = scheduler.prune(ready + verdict.ready)
            plan = verdict.retry
        if ready:
            scheduler.apply_samples(ready, model.execute(ready))
        for out in scheduler.take_outputs():
            for choice in out.choices:
                outputs.setdefault(out.request_id, {}).setdefault(choice.index, []).extend(choice.token_ids)
                texts.setdefault(out.request_id, {}).setdefault(choice.index, "")
                texts[out.request_id][choice.index] += choice.text
                if choice.finish_reason:
                    finish.setdefault(out.request_id, {})[choice.index] = choice.finish_reason
            if out.error:
                errors[out.request_id] = out.error
    else:
        raise AssertionError("scheduler did not finish")
    pool.allocate(scheduler.take_pending_frees(), [])
    return outputs, texts, finish, errors


def new_scheduler(**config) -> Scheduler:
    counter = iter(range(1, 10**9))
    return Scheduler(SchedulerConfig(**config), lambda: next(counter))


def add(scheduler: Scheduler, request: GenerationRequest) -> GenerationRequest:
    scheduler.add_request(request, CharDecoder)
    return request


def test_continuous_batching_matches_reference_and_frees_everything():
    scheduler, pool, model = new_scheduler(max_num_seqs=8), FakePool(200), FakeModel()
    prompts = {f"r{i}": [i + 1] * (3 + i) for i in range(6)}
    for rid, prompt in prompts.items():
        add(scheduler, make_request(rid, prompt, max_tokens=10))
    outputs, _, finish, errors = run_to_completion(scheduler, pool, model)
    assert not errors
    for rid, prompt in prompts.items():
        assert outputs[rid][0] == reference_output(prompt, 10)
        assert finish[rid][0] is FinishReason.LENGTH
    assert max(model.batch_sizes) == 6
    assert pool.used() == 0


def test_chunked_prefill_does_not_starve_decodes():
    scheduler, pool, model = new_scheduler(max_num_seqs=8, max_num_batched_tokens=16), FakePool(200), FakeModel()
    add(scheduler, make_request("short", [5, 6, 7], max_tokens=20))
    run_steps = 0
    while scheduler.running or scheduler.waiting:
        plan = scheduler.schedule()
        verdict = scheduler.apply_allocation(plan, pool.allocate(scheduler.take_pending_frees(), plan))
        scheduler.apply_samples(verdict.ready, model.execute(verdict.ready))
        run_steps += 1
        if run_steps == 2:
            add(scheduler, make_request("long", list(range(1, 61)), max_tokens=2))
        if run_steps == 3:
            break
    # step 3: the decode of "short" ran next to a 15-token chunk of the 60-token prompt
    assert model.tokens_per_step[-1] == 16
    long_seq = scheduler.requests["long"].sequences[0]
    assert long_seq.num_computed == 15
    outputs, *_ = run_to_completion(scheduler, pool, model)
    assert outputs["long"][0] == reference_output(list(range(1, 61)), 2)
    assert max(model.tokens_per_step) <= 16


def test_preemption_recomputes_and_matches_unpreempted_output():
    prompts = {f"r{i}": [(i * 7 + j) % 50 + 1 for j in range(10)] for i in range(6)}
    scheduler, pool, model = new_scheduler(max_num_seqs=6), FakePool(16), FakeModel()  # 15 usable blocks
    for rid, prompt in prompts.items():
        add(scheduler, make_request(rid, prompt, max_tokens=12))
    outputs, _, _, errors = run_to_completion(scheduler, pool, model)
    assert not errors
    assert scheduler.counters.num_preemptions > 0
    for rid, prompt in prompts.items():
        assert outputs[rid][0] == reference_output(prompt, 12)
    assert pool.used() == 0


def test_preemption_victim_is_most_recently_admitted():
    scheduler, pool = new_scheduler(max_num_seqs=4), FakePool(7)  # 6 usable blocks
    reqs = [add(scheduler, make_request(f"r{i}", [1] * 8, max_tokens=20)) for i in range(3)]
    plan = scheduler.schedule()
    verdict = scheduler.apply_allocation(plan, pool.allocate([], plan))
    assert len(verdict.ready) == 3 and pool.used() == 6
    scheduler.apply_samples(verdict.ready, [SampledToken(3)] * 3)
    plan = scheduler.schedule()  # each needs block 3 for position 8
    verdict = scheduler.apply_allocation(plan, pool.allocate([], plan))
    first_victim = reqs[2].sequences[0]
    assert first_victim.status is SeqStatus.WAITING and scheduler.waiting[0] is first_victim
    assert scheduler.counters.num_preemptions >= 1
    assert reqs[0].sequences[0].status is SeqStatus.RUNNING


def test_request_that_cannot_fit_alone_fails_instead_of_looping():
    scheduler, pool, model = new_scheduler(), FakePool(4), FakeModel()  # 3 blocks = 12 tokens
    add(scheduler, make_request("big", [1] * 20, max_tokens=4))
    add(scheduler, make_request("grows", [1] * 6, max_tokens=20))
    outputs, _, finish, errors = run_to_completion(scheduler, pool, model)
    assert "cannot fit" in str(errors["big"]) and "cannot fit" in str(errors["grows"])
    assert finish["big"][0] is FinishReason.ERROR
    assert pool.used() == 0


def test_a_sequence_short_only_of_blocks_held_for_saves_waits_for_them():
    # kvmanager holds blocks for store saves in transit and frees them within two steps: a sequence
    # that fits once they are back waits (a new one in the queue, a running one preempted), not fails.
    scheduler, pool, model = new_scheduler(), FakePool(4), FakeModel()  # 3 blocks = 12 tokens
    new = add(scheduler, make_request("new", [1] * 6, max_tokens=6))
    held = [pool.free.pop(), pool.free.pop()]
    plan = scheduler.schedule()
    verdict = scheduler.apply_allocation(plan, pool.allocate([], plan), saves_in_transit=True)
    assert not verdict.ready and new.sequences[0].status is SeqStatus.WAITING and not new.finished
    pool.free += held
    outputs, _, _, errors = run_to_completion(scheduler, pool, model)
    assert not errors and outputs["new"][0] == reference_output([1] * 6, 6)

    grows = add(scheduler, make_request("grows", [2] * 6, max_tokens=6))
    plan = scheduler.schedule()
    verdict = scheduler.apply_allocation(plan, pool.allocate([], plan))
    scheduler.apply_samples(verdict.ready, model.execute(verdict.ready))
    held = list(pool.free)  # all but the two blocks it holds; it needs a third at position 8
    pool.free.clear()
    for _ in range(4):
        plan = scheduler.schedule()
        verdict = scheduler.apply_allocation(plan, pool.allocate(scheduler.take_pending_frees(), plan),
                                             saves_in_transit=True)
        if verdict.ready:
            scheduler.apply_samples(verdict.ready, model.execute(verdict.ready))
    assert grows.sequences[0].status is SeqStatus.WAITING and not grows.finished
    pool.free += held
    outputs, _, _, errors = run_to_completion(scheduler, pool, model)
    assert not errors and outputs["grows"][0] == reference_output([2] * 6, 6)
    assert pool.used() == 0


def test_static_batching_admits_next_batch_only_after_completion():
    scheduler, pool, model = new_scheduler(max_num_seqs=2, batching="static"), FakePool(200), FakeModel()
    add(scheduler, make_request("a", [1, 2, 3], max_tokens=3))
    add(scheduler, make_request("b", [4, 5, 6], max_tokens=8))
    add(scheduler, make_request("c", [7, 8, 9], max_tokens=3))
    outputs, *_ = run_to_completion(scheduler, pool, model)
    # a finishes at step 3 but c waits until b is done: batch sizes 2,2,2,1,...,1 then c alone
    assert model.batch_sizes[:3] == [2, 2, 2]
    assert model.batch_sizes[3:8] == [1] * 5
    assert len(model.batch_sizes) == 8 + 3
    assert outputs["c"][0] == reference_output([7, 8, 9], 3)


def test_stop_string_is_cut_and_not_streamed():
    prompt = [1, 2, 3]
    expected = "".join(chr(ord("a") + t % 26) for t in reference_output(prompt, 10))
    stop = expected[4:6]
    scheduler, pool, model = new_scheduler(), FakePool(50), FakeModel()
    add(scheduler, make_request("s", prompt, max_tokens=10, stop=(stop,)))
    _, texts, finish, _ = run_to_completion(scheduler, pool, model)
    assert texts["s"][0] == expected[: expected.index(stop)]
    assert finish["s"][0] is FinishReason.STOP


def test_stop_token_ids_min_tokens_and_abort():
    prompt = [1, 2, 3]
    ref = reference_output(prompt, 10)
    scheduler, pool, model = new_scheduler(), FakePool(50), FakeModel()
    add(scheduler, make_request("t", prompt, max_tokens=10, stop_token_ids=(ref[2],)))
    add(scheduler, make_request("x", prompt, max_tokens=10))
    scheduler.abort_request("x")
    outputs, texts, finish, _ = run_to_completion(scheduler, pool, model)
    assert outputs["t"][0] == ref[:3] and len(texts["t"][0]) == 2  # stop token's text left out
    assert finish["t"][0] is FinishReason.STOP and finish["x"][0] is FinishReason.ABORT
    assert pool.used() == 0


def test_parallel_sampling_forks_prompt_once():
    prompt = list(range(1, 11))  # 10 tokens: parent computes 9, then 3 choices compute the last
    scheduler, pool, model = new_scheduler(), FakePool(50), FakeModel()
    add(scheduler, make_request("n3", prompt, max_tokens=5, n=3))
    outputs, _, finish, errors = run_to_completion(scheduler, pool, model)
    assert not errors
    for index in range(3):
        assert outputs["n3"][index] == reference_output(prompt, 5, index)
    assert model.tokens_per_step[0] == 9 and model.tokens_per_step[1] == 3
    assert sum(model.tokens_per_step) == 9 + 3 + 3 * 4
    assert pool.used() == 0


def test_max_num_seqs_limits_running_set():
    scheduler, pool, model = new_scheduler(max_num_seqs=3), FakePool(200), FakeModel()
    for i in range(7):
        add(scheduler, make_request(f"r{i}", [i + 1, 2], max_tokens=4))
    run_to_completion(scheduler, pool, model)
    assert max(model.batch_sizes) == 3


@pytest.mark.parametrize("bad", [dict(max_num_seqs=0), dict(batching="dynamic")])
def test_bad_config_is_rejected(bad):
    with pytest.raises(ValueError):
        SchedulerConfig(**bad)


def test_prompt_sharing_a_first_block_admitted_this_step_waits_one_step_then_hits():
    scheduler = new_scheduler(max_num_seqs=8)
    scheduler.block_size = 4
    shared = [7, 7, 7, 7, 8, 8]
    first = add(scheduler, make_request("a", shared + [1]))
    second = add(scheduler, make_request("b", shared + [2]))
    other = add(scheduler, make_request("c", [9] * 7))
    salted = add(scheduler, make_request("d", shared + [3], cache_salt="tenant"))
    admitted = {entry.seq.request.request_id for entry in scheduler.schedule()}
    assert admitted == {"a", "c", "d"}, "b would compute a's first block beside it"
    assert [seq.request for seq in scheduler.waiting] == [second]
    assert {first, other, salted} <= {seq.request for seq in scheduler.running}
    assert "b" in {entry.seq.request.request_id for entry in scheduler.schedule()}, "b never admitted"


def test_once_a_prompt_sharing_the_first_block_is_computed_the_rest_are_admitted_together():
    """A shared system prompt is every prompt's first block: only until one of them is computed
    does another wait (one admission a step would make the 32nd of 32 prompts wait 32 steps)."""
    scheduler = new_scheduler(max_num_seqs=8)
    scheduler.block_size = 4
    pool, model = FakePool(64), FakeModel()
    shared = [7, 7, 7, 7, 8, 8]
    for rid in "abcd":
        add(scheduler, make_request(rid, shared + [ord(rid)]))
    plan = scheduler.schedule()
    assert [e.seq.request.request_id for e in plan] == ["a"]
    ready = scheduler.apply_allocation(plan, pool.allocate([], plan)).ready
    scheduler.apply_samples(ready, model.execute(ready))
    admitted = [e.seq.request.request_id for e in scheduler.schedule()]
    assert admitted == ["a", "b", "c", "d"] and not scheduler.waiting


def test_without_a_block_size_or_with_prefix_caching_off_nothing_waits():
    scheduler = new_scheduler(max_num_seqs=8)
    add(scheduler, make_request("a", [7] * 8))
    add(scheduler, make_request("b", [7] * 8))
    assert len(scheduler.schedule()) == 2
    scheduler = new_scheduler(max_num_seqs=8)
    scheduler.block_size = 4
    add(scheduler, make_request("a", [7] * 8, enable_prefix_caching=False))
    add(scheduler, make_request("b", [7] * 8, enable_prefix_caching=False))
    assert len(scheduler.schedule()) == 2


@pytest.mark.parametrize("num_blocks", [40, 12])
def test_predicted_decode_steps_get_exactly_the_predicted_answer(num_blocks):
    """``predict_decodes`` (the gateway sends such a step's Execute before kvmanager answers) over
    a mixed workload — forked choices (copy-on-write), block boundaries and the lookahead blocks
    held for them, admissions, and with 12 blocks preemptions and lookaheads refused for want of
    room: every predicted step gets the answer it predicted from a kvmanager with copy-on-write,
    and the outputs are the reference ones."""
    scheduler = new_scheduler(max_num_seqs=6)
    scheduler.kv_block_size = BLOCK
    pool, model = FakePool(num_blocks), FakeModel()
    requests = [add(scheduler, make_request("solo", [3, 1, 4, 1, 5], max_tokens=24)),
                add(scheduler, make_request("pair", [2, 7, 1, 8, 2, 8], max_tokens=4, n=2)),
                add(scheduler, make_request("late", [9] * 9, max_tokens=20))]
    predicted_steps: list[int] = []
    outputs, _, _, errors = run_to_completion(scheduler, pool, model, predicted_steps=predicted_steps)
    assert not errors and len(predicted_steps) >= 5, predicted_steps
    for request in requests:
        for index, tokens in outputs[request.request_id].items():
            assert tokens == reference_output(request.prompt_token_ids, request.options.max_tokens, index)


class ManagerPool:
    """kvmanager's own domain (``KVManager``: prefix cache, written-KV reports) behind the
    ``FakePool.allocate`` the tests drive, for what depends on real prefix hits."""

    def __init__(self, num_blocks: int):
        self.manager = KVManager()
        self.manager.register_pool(PoolConfig("p", num_blocks, BLOCK, "model"))
        self.session = self.manager.open_session("p").session_id
        self.scheduler: Scheduler | None = None  # whose written-KV reports go with each call
        self.hits: list[int] = []

    def allocate(self, frees, plan) -> list[AllocationResult]:
        requests = [AllocationRequest(e.seq_id, list(e.new_token_ids), e.num_new_tokens,
                                      e.seq.request.options.enable_prefix_caching,
                                      num_lookahead_slots=e.num_lookahead_slots) for e in plan]
        written = self.scheduler.take_written_reports()
        results, _ = self.manager.allocate("p", self.session, list(frees), requests, *written)
        self.hits += [r.num_cached_tokens for r in results if r.ok and r.num_cached_tokens]
        return [AllocationResult(r.ok, r.num_cached_tokens, r.start_position, r.num_tokens, r.block_table_offset,
                                 list(r.block_table), list(r.copy_src), list(r.copy_dst)) for r in results]


SYSTEM_PROMPT = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]  # three blocks


def shared_prompt_run(budget: int, reset_before_burst: bool = False):
    """Prompt "a", then seven prompts behind the same system prompt, against kvmanager's domain:
    (scheduler, pool, model, tokens computed per step, outputs)."""
    scheduler = new_scheduler(max_num_seqs=8, max_num_batched_tokens=budget)
    scheduler.block_size = scheduler.kv_block_size = BLOCK
    pool, model = ManagerPool(64), FakeModel()
    pool.scheduler = scheduler
    requests = [add(scheduler, make_request("a", SYSTEM_PROMPT + [40, 41, 42, 43, 44], max_tokens=3))]
    requests += [add(scheduler, make_request(f"b{i}", SYSTEM_PROMPT + [50 + i] * 5, max_tokens=3)) for i in range(7)]
    if reset_before_burst:
        plan = scheduler.schedule()  # "a" alone: the others share its first block
        ready = scheduler.apply_allocation(plan, pool.allocate(scheduler.take_pending_frees(), plan)).ready
        scheduler.apply_samples(ready, model.execute(ready))
        pool.manager.reset_prefix_cache("p")  # what the scheduler saw computed is gone from the cache
    outputs, _, _, errors = run_to_completion(scheduler, pool, model)
    assert not errors
    for request in requests:
        assert outputs[request.request_id][0] == reference_output(request.prompt_token_ids, 3)
    return pool, model


def test_a_step_budget_counts_the_tokens_computed_after_the_expected_prefix_hit():
    """Seven prompts whose 12-token system prompt an earlier prompt computed each have 5 tokens
    to compute: with 40 tokens a step they are admitted in one step (35 tokens computed beside
    a decode), where charging each its whole 17-token prompt took three steps."""
    pool, model = shared_prompt_run(budget=40)
    assert pool.hits == [12] * 7
    assert 36 in model.tokens_per_step, model.tokens_per_step  # 7 x 5 prompt tokens + 1 decode
    assert max(model.tokens_per_step) <= 40


def test_an_expected_hit_the_cache_no_longer_holds_costs_a_step_never_a_token():
    """The scheduler saw the system prompt computed, then the prefix cache was reset: each prompt
    gets the 5 tokens planned after the hit it expected, from position 0, and its rest in later
    steps; the outputs are the reference ones and no step computes past its budget."""
    pool, model = shared_prompt_run(budget=40, reset_before_burst=True)
    assert not pool.hits
    assert model.tokens_per_step[1] == 36, model.tokens_per_step  # 7 x 5 from position 0, and a decode
    assert max(model.tokens_per_step) <= 40, model.tokens_per_step


@pytest.mark.parametrize("salt,tenant,shared", [("", "", 0), ("s", "", 0), ("", "acme", 0), ("", "acme", 8),
                                                ("s", "globex", 4)])
def test_expected_hits_hash_blocks_as_kvmanager_does(salt, tenant, shared):
    """The scheduler's guess compares its own hashes only, but a tenant must never expect another
    tenant's blocks: they chain cache salt, tenant and shared range as kvmanager's lookups do."""
    tokens = list(range(100, 117))
    prefixes = ComputedPrefixes(BLOCK)
    assert prefixes.hashes(tokens, 4, salt, tenant, shared) == \
        prefix_block_hashes("", BLOCK, tokens, salt, "", tenant, shared)
    prefixes.record(prefixes.hashes(tokens, 4, salt, tenant, shared))
    assert prefixes.num_leading(prefixes.hashes(tokens, 4, salt, tenant, shared)) == 4
    assert prefixes.num_leading(prefixes.hashes(tokens, 4, salt + "x", tenant, shared)) == 0
    others = prefixes.hashes(tokens, 4, salt, tenant + "x", shared)
    assert prefixes.num_leading(others) == shared // BLOCK, "only the shared range is another tenant's hit"


def test_a_follow_up_prompt_expects_every_full_block_of_the_turn_before():
    """A conversation's next turn starts with the whole previous prompt: a prompt of exactly two
    blocks, once computed, is a hit of both for the prompt that extends it, which asks for its
    5 new tokens alone."""
    scheduler = new_scheduler(max_num_seqs=4, max_num_batched_tokens=64)
    scheduler.block_size = scheduler.kv_block_size = BLOCK
    pool, model = ManagerPool(64), FakeModel()
    pool.scheduler = scheduler
    first = add(scheduler, make_request("turn1", [11, 12, 13, 14, 15, 16, 17, 18], max_tokens=1))
    run_to_completion(scheduler, pool, model)
    follow_up = add(scheduler, make_request("turn2", first.prompt_token_ids + [30, 31, 32, 33, 34], max_tokens=1))
    (entry,) = scheduler.schedule()
    assert entry.seq.request is follow_up and entry.num_new_tokens == 5
    (result,) = pool.allocate(scheduler.take_pending_frees(), [entry])
    assert (result.num_cached_tokens, result.start_position, result.num_tokens) == (8, 8, 5)


def test_the_index_of_block_chains_forgets_the_least_recently_used_first():
    index = BlockChainIndex(3)
    index.record(["a", "b", "c"])
    assert index.num_leading(["a", "b", "x"], refresh=True) == 2  # a, b now the most recent
    index.record(["d"])  # forgets c
    assert len(index) == 3 and index.num_leading(["a", "b", "c"]) == 2
    index.record(["e"])  # forgets a: num_leading without refresh left it the oldest
    assert index.num_leading(["a"]) == 0 and index.num_leading(["b", "d", "e"]) == 3
