"""bench.structured_outputs' pieces that decide its numbers (no server)."""
from __future__ import annotations

from bench.structured_outputs import plain_body, schema_body, validity
from bench.structured_schemas import SCHEMAS


def test_both_rows_ask_for_the_same_prompt_and_the_unconstrained_one_for_a_fixed_length():
    name, prompt, schema = SCHEMAS[0]
    constrained, plain = schema_body(name, prompt, schema, 256), plain_body(prompt, 37)
    assert constrained["messages"] == plain["messages"] and constrained["temperature"] == plain["temperature"] == 0
    assert constrained["response_format"]["json_schema"]["schema"] == schema
    assert "response_format" not in plain
    assert plain["max_tokens"] == plain["min_tokens"] == 37 and plain["ignore_eos"]


def test_validity_counts_replies_that_parse_and_validate():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    replies = [{"text": '{"a": 1}'}, {"text": '{"a": "x"}'}, {"text": '{"a": 1'}, {"text": '{"a": 2}'}]
    assert validity(replies, [schema] * 4) == 0.5
