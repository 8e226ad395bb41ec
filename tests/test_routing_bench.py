"""bench.routing_bench without services: the conversation replay and the result table."""
from __future__ import annotations

import asyncio

import pytest

from bench import routing_bench as rb


class WordTokenizer:
    """One token per whitespace-separated word; the 'chat template' joins role: content lines."""

    def encode(self, text: str) -> list[int]:
        return [hash(w) & 0xFFFF for w in text.split()]

    def decode(self, ids: list[int]) -> str:
        raise AssertionError("truncate decodes the original words, see below")

    def chat_ids(self, messages: list[dict]) -> list[int]:
        text = " ".join(f"<{m['role']}> {m['content']}" for m in messages) + " <assistant>"
        return self.encode(text)


class WordTokenizerWithDecode(WordTokenizer):
    """decode() needs the words back: keep a table."""

    def __init__(self):
        self.words: dict[int, str] = {}

    def encode(self, text: str) -> list[int]:
        ids = []
        for word in text.split():
            token = hash(word) & 0xFFFFFF
            self.words[token] = word
            ids.append(token)
        return ids

    def decode(self, ids: list[int]) -> str:
        return " ".join(self.words[i] for i in ids)


def record(*turns: tuple[str, str], first: str = "human") -> dict:
    convs = [{"from": first, "value": "lead-in"}] if first != "human" else []
    for user, answer in turns:
        convs += [{"from": "human", "value": user}, {"from": "gpt", "value": answer}]
    return {"id": "x", "conversations": convs}


def words(n: int, tag: str) -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


def test_exchanges_skip_a_leading_system_turn_and_stop_at_a_break():
    rec = record(("u1", "a1"), ("u2", "a2"), first="system")
    assert rb.exchanges_of(rec) == [("u1", "a1"), ("u2", "a2")]
    rec["conversations"].insert(3, {"from": "human", "value": "twice"})  # human, gpt, human, human
    assert rb.exchanges_of(rec) == [("u1", "a1")]
    assert rb.exchanges_of({"conversations": [{"from": "human", "value": "u"}, {"from": "gpt", "value": " "}]}) == []
    kept = rb.conversations_from_records([record(("u", "a")), record(("u", "a"), ("v", "b"))], min_turns=2)
    assert [len(c.exchanges) for c in kept] == [2]


def test_each_turn_resends_system_prompt_and_whole_history_with_the_dataset_answers():
    exchanges = [("u1", "a1"), ("u2", "a2"), ("u3", "a3")]
    turns = rb.build_turns(WordTokenizer(), 7, exchanges, system_prompt="SYS", max_turns=4, max_tokens=5,
                           max_prompt_len=10_000)
    assert [t.index for t in turns] == [0, 1, 2] and {t.conversation for t in turns} == {7}
    assert turns[2].messages == [
        {"role": "system", "content": "SYS"},
        {"role": "user", "content": "u1"}, {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "u2"}, {"role": "assistant", "content": "a2"},
        {"role": "user", "content": "u3"}]
    for earlier, later in zip(turns, turns[1:]):  # each prompt extends the previous one's messages
        assert later.messages[:len(earlier.messages)] == earlier.messages
        assert later.prompt_len > earlier.prompt_len
    assert all(t.max_tokens == 5 for t in turns)
    assert rb.turn_messages("", exchanges, 0) == [{"role": "user", "content": "u1"}]


def test_turns_stop_before_the_prompt_limit_and_at_max_turns():
    tok = WordTokenizer()
    exchanges = [(words(10, "u"), words(10, "a"))] * 5
    lens = [len(tok.chat_ids(rb.turn_messages("", exchanges, k))) for k in range(5)]
    limit = lens[2] + 8  # turn 2 fits with 8 output tokens, turn 3 does not
    turns = rb.build_turns(tok, 0, exchanges, system_prompt="", max_turns=5, max_tokens=8, max_prompt_len=limit)
    assert [t.prompt_len for t in turns] == lens[:3]
    assert len(rb.build_turns(tok, 0, exchanges, system_prompt="", max_turns=2, max_tokens=8,
                              max_prompt_len=10_000)) == 2


def test_workload_is_deterministic_truncated_and_keeps_only_multi_turn_conversations():
    conversations = [rb.Conversation(str(i), tuple((words(3 + i, f"u{i}_{k}_"), words(50, f"a{i}_{k}_"))
                                                   for k in range(1 + i % 4))) for i in range(40)]
    kwargs = dict(num_conversations=6, max_turns=3, max_tokens=4, max_message_tokens=12, max_prompt_len=10_000,
                  system_prompt="be brief", seed=3)
    a = rb.select_workload(conversations, WordTokenizerWithDecode(), **kwargs)
    b = rb.select_workload(conversations, WordTokenizerWithDecode(), **kwargs)
    assert [[t.messages for t in c] for c in a] == [[t.messages for t in c] for c in b]
    assert len(a) == 6 and all(2 <= len(c) <= 3 for c in a)
    assert [c[0].conversation for c in a] == list(range(6))
    for conversation in a:
        for message in conversation[-1].messages[1:]:
            assert len(message["content"].split()) <= 12  # answers of 50 words cut to 12
    other = rb.select_workload(conversations, WordTokenizerWithDecode(), **{**kwargs, "seed": 4})
    assert [[t.messages for t in c] for c in other] != [[t.messages for t in c] for c in a]
    with pytest.raises(ValueError):
        rb.select_workload(conversations, WordTokenizerWithDecode(), **{**kwargs, "num_conversations": 100})


def test_replay_sends_a_turn_only_after_the_previous_answer_and_bounds_conversations_in_flight():
    workload = [[rb.Turn(c, k, [], 10 * (k + 1), 4) for k in range(1 + c % 3)] for c in range(6)]
    log: list[tuple[str, int, int]] = []
    in_flight: set[int] = set()
    peak = [0]

    async def send(turn: rb.Turn, t0: float) -> rb.TurnResult:
        log.append(("start", turn.conversation, turn.index))
        in_flight.add(turn.conversation)
        peak[0] = max(peak[0], len(in_flight))
        await asyncio.sleep(0.001 * (1 + (turn.conversation * 7 + turn.index) % 3))
        in_flight.discard(turn.conversation)
        log.append(("end", turn.conversation, turn.index))
        return rb.TurnResult(turn.conversation, turn.index, turn.prompt_len, ok=True, output_tokens=4)

    results, wall = asyncio.run(rb.replay(workload, send, concurrency=2))
    assert len(results) == sum(len(c) for c in workload) and wall > 0
    assert peak[0] <= 2
    for conversation in workload:
        for turn in conversation[1:]:
            c, k = turn.conversation, turn.index
            assert log.index(("end", c, k - 1)) < log.index(("start", c, k))


def test_ideal_hit_rate_counts_whole_shared_blocks_of_the_previous_turn():
    system = list(range(100, 132))  # two blocks of 16
    turn0 = system + [1, 2, 3]
    turn1 = turn0 + [4] * 40
    other = system + [9]
    # turn0: nothing before it; other: system (32); turn1: 35 shared -> 32
    rate = rb.ideal_hit_rate([[turn0, turn1], [other]], block_size=16)
    assert rate == pytest.approx((32 + 32) / (len(turn0) + len(turn1) + len(other)))


def test_summary_and_table_formatting():
    row = rb.RowResult("kv, 2 executors", "kv", 2, 512, 1)
    results = [rb.TurnResult(0, k, 100, ttft=0.1 * (k + 1), e2e=1.0, output_tokens=32, cached_tokens=50, ok=True)
               for k in range(4)] + [rb.TurnResult(1, 0, 100, error="HTTP 503: busy")]
    rb.finish_row(row, results, wall=2.0)
    assert (row.completed, row.failed, row.prompt_tokens, row.cached_tokens) == (4, 1, 400, 200)
    assert row.hit_rate == 0.5 and row.output_tok_s == 64.0 and row.total_tok_s == 264.0
    assert row.ttft_p50_ms == pytest.approx(250.0) and row.ttft_p99_ms == pytest.approx(397.0)
    assert row.errors == ["HTTP 503: busy"]
    rb.apply_metrics(row, {"counters": {"prefix_cache_queries": 400.0, "prefix_cache_hits": 180.0},
                           "step_time": {"step": 10.0, "kvmanager_rpc": 0.25, "executor_rpc": 9.0},
                           "routed_by_executor": {"127.0.0.1:2": 3.0, "127.0.0.1:1": 2.0},
                           "routed_by_policy": {"kv": 5.0}})
    row.lookup_p50_ms, row.lookup_p99_ms = 0.4, 1.25
    single = rb.RowResult("single executor (2x KV)", "-", 1, 1024, 2)
    table = rb.format_table([row, single])
    lines = table.splitlines()
    assert lines[0].split("  ")[0].startswith("configuration") and set(lines[1]) <= {"-", " "}
    assert len({len(line) for line in lines}) == 1  # aligned
    assert "50.0%" in lines[2] and "2 x 512" in lines[2] and "2.50" in lines[2] and "0.40/1.25" in lines[2]
    assert "2/3" in lines[2] and lines[2].rstrip().endswith("1")
    assert "n/a" in lines[3] and "1 x 1024" in lines[3]
    md = rb.markdown_table([row, single]).splitlines()
    assert md[0].startswith("| configuration |") and md[1].startswith("|---|---:")
    assert len(md) == 4 and all(line.count("|") == len(rb.TABLE_COLUMNS) + 1 for line in md)
    json_row = row.to_json()
    assert json_row["hit_rate"] == 0.5 and json_row["metric_hit_rate"] == 0.45


def test_target_checks_say_holds_or_missed():
    def made(name, routing, executors, hit, p99):
        r = rb.RowResult(name, routing, executors, 512, 1, prompt_tokens=100, cached_tokens=int(hit * 100))
        r.ttft_p99_ms = p99
        return r

    rows = [made("single", "-", 1, 0.60, 100), made("kv", "kv", 2, 0.57, 200), made("rr", "round-robin", 2, 0.3, 500)]
    lines = rb.target_checks(rows)
    assert "HOLDS" in lines[0] and "HOLDS" in lines[1]
    rows[1].cached_tokens, rows[1].ttft_p99_ms = 40, 300
    lines = rb.target_checks(rows)
    assert "MISSED" in lines[0] and "MISSED" in lines[1]
