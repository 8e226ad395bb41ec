"""The gateway's side of structured outputs, tool calls and penalties, in process (no model):
compiling constraints, each step's SamplingParams, parsing and streaming tool calls."""
from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from gateway.constraints import ConstraintSpec, GrammarCompiler
from gateway.detokenizer import ModelTokenizer
from gateway.openai_protocol import ChatCompletionBody, ResponseFormatter
from gateway.params import build_options
from gateway.sampling_fields import fill_sampling, penalty_counts
from gateway.scheduler import ScheduledSeq, create_sequences
from gateway.sequence import ChoiceDelta, FinishReason, GenerationRequest, RequestOutput
from gateway.stopping import append_token
from gateway.tool_calls import ToolCalling, render_tool_messages
from kvserve.errors import InvalidArgument
from kvserve.v1 import executor_pb2

EOS = 2
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def tokenizer(default_model_dir) -> ModelTokenizer:
    return ModelTokenizer(default_model_dir)


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler.for_tokenizer(tokenizer)


def allowed(mask: bytes, vocab: int) -> set[int]:
    return set(np.flatnonzero(np.unpackbits(np.frombuffer(mask, dtype=np.uint8), bitorder="little")[:vocab]))


def request_with(tokenizer, prompt: list[int], **options) -> GenerationRequest:
    opts = build_options(max_tokens=options.pop("max_tokens", 50), temperature=0, top_p=None, top_k=None, seed=None,
                         stop=None, **options)
    request = GenerationRequest("r", prompt, opts, frozenset({EOS}), 2048)
    create_sequences(request, lambda: tokenizer.detokenizer(prompt), iter(range(100)).__next__)
    return request


def test_a_choice_grammar_allows_exactly_its_words_then_only_eos(tokenizer, compiler):
    compiled = compiler.compile_now(ConstraintSpec.choice(["yes", "no"]))
    request = request_with(tokenizer, [1, 2, 3], constraint=compiled)
    seq = request.sequences[0]
    vocab = tokenizer.vocab_size
    first = allowed(seq.grammar.allowed_bitmask(vocab), vocab)
    assert tokenizer.encode("yes")[0] in first and tokenizer.encode("no")[0] in first and EOS not in first
    for token in tokenizer.encode("yes"):
        finished = append_token(seq, token)
    assert finished and seq.finish_reason is FinishReason.STOP and seq.output_text == "yes"


def test_a_token_the_grammar_refuses_ends_the_choice_with_error(tokenizer, compiler):
    request = request_with(tokenizer, [1, 2, 3], constraint=compiler.compile_now(ConstraintSpec("regex", "[0-9]+")))
    seq = request.sequences[0]
    assert append_token(seq, tokenizer.encode("abc")[0])
    assert seq.finish_reason is FinishReason.ERROR


def test_the_mask_fits_the_models_vocabulary(tokenizer, compiler):
    state = compiler.compile_now(ConstraintSpec("json_object")).new_state()
    for vocab in (tokenizer.vocab_size, tokenizer.vocab_size + 100, tokenizer.vocab_size - 5):
        assert len(state.allowed_bitmask(vocab)) == -(-vocab // 8)


@pytest.mark.parametrize("spec,needle", [
    (ConstraintSpec("regex", "(open"), "regex"),
    (ConstraintSpec("grammar", "start: nothing_defined"), "grammar"),
    (ConstraintSpec.json_schema({"type": "string", "minLength": 5, "maxLength": 2}), "nsatisfiable"),
    (ConstraintSpec("regex", "x" * 70_000), "at most"),
])
def test_bad_constraints_are_invalid_argument(compiler, spec, needle):
    with pytest.raises(InvalidArgument, match=needle):
        asyncio.run(compiler.compile(spec))


def test_compiled_constraints_are_cached_by_what_they_say(compiler):
    async def twice():
        return (await compiler.compile(ConstraintSpec("regex", "[ab]+", "guided_regex")),
                await compiler.compile(ConstraintSpec("regex", "[ab]+", "structured_outputs")))
    first, second = asyncio.run(twice())
    assert first is second


def test_step_carries_mask_bias_and_penalty_counts(tokenizer, compiler):
    request = request_with(tokenizer, [5, 6, 6, 7], constraint=compiler.compile_now(ConstraintSpec("regex", "[0-9]+")),
                           logit_bias={"9": 2.5}, frequency_penalty=0.5, repetition_penalty=1.2)
    seq = request.sequences[0]
    digit = tokenizer.encode("4")[0]
    append_token(seq, digit)
    append_token(seq, digit)
    params = executor_pb2.SamplingParams()
    fill_sampling(params, ScheduledSeq(seq, seq.seq_id, 1, [], sample=True), tokenizer.vocab_size)
    assert list(params.logit_bias_token_ids) == [9] and list(params.logit_bias_values) == [2.5]
    counts = dict(zip(params.penalty_token_ids, params.penalty_output_counts))
    assert counts == {digit: 2, 5: 0, 6: 0, 7: 0}  # the prompt's tokens too: repetition_penalty is on
    assert params.frequency_penalty == 0.5 and params.repetition_penalty == pytest.approx(1.2)
    assert allowed(params.allowed_token_bitmask, tokenizer.vocab_size) <= {
        t for t in range(tokenizer.vocab_size) if tokenizer.tokenizer.decode([t]).isdigit()} | {EOS}


def test_presence_alone_sends_only_the_generated_tokens(tokenizer):
    request = request_with(tokenizer, [5, 6, 7], presence_penalty=1.0)
    seq = request.sequences[0]
    append_token(seq, 11)
    assert penalty_counts(seq) == ([11], [1])


def test_min_tokens_yields_to_a_complete_grammar(tokenizer, compiler):
    request = request_with(tokenizer, [1, 2], constraint=compiler.compile_now(ConstraintSpec.choice(["ok"])),
                           min_tokens=5, ignore_eos=False)
    seq = request.sequences[0]
    for token in tokenizer.encode("ok")[:-1]:
        append_token(seq, token)
    params = executor_pb2.SamplingParams()
    fill_sampling(params, ScheduledSeq(seq, seq.seq_id, 1, [], sample=True), tokenizer.vocab_size)
    assert EOS in params.suppressed_token_ids  # more than EOS is still allowed: min_tokens holds


def test_tool_choice_rules():
    assert ToolCalling.parse(None, None, None) is None
    assert ToolCalling.parse([TOOL], "none", None) is None
    auto = ToolCalling.parse([TOOL], None, None)
    assert auto.choice == "auto" and auto.constraint() is None
    named = ToolCalling.parse([TOOL], {"type": "function", "function": {"name": "get_weather"}}, None)
    schema = json.loads(named.constraint().value)
    assert schema["properties"]["tool_calls"]["maxItems"] == 1
    for tools, choice, needle in [([TOOL], {"type": "function", "function": {"name": "x"}}, "no tool named"),
                                  (None, "required", "without tools"), ([TOOL, TOOL], None, "distinct"),
                                  ([{"type": "function", "function": {"name": "a b"}}], None, "name")]:
        with pytest.raises(InvalidArgument, match=needle):
            ToolCalling.parse(tools, choice, None)


def test_calls_parse_only_when_they_name_listed_tools():
    calling = ToolCalling.parse([TOOL], "required", None)
    calls = calling.parse_calls('{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}]}')
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    assert calls[0]["id"].startswith("call_") and calls[0]["type"] == "function"
    assert calling.parse_calls('{"tool_calls": [{"name": "other", "arguments": {}}]}') is None
    assert calling.parse_calls("plain text") is None


def test_a_call_cut_off_by_max_tokens_is_still_a_call_with_the_arguments_that_came():
    calling = ToolCalling.parse([TOOL, {**TOOL, "function": {**TOOL["function"], "name": "get_time"}}], "required", None)
    whole = '{"tool_calls": [{"name": "get_time", "arguments": {"zone": "UTC"}}, '
    cut = calling.calls_in(whole + '{"name": "get_weather", "arguments": {"city": "Os', "length")
    assert [call["function"] for call in cut] == [{"name": "get_time", "arguments": '{"zone": "UTC"}'},
                                                  {"name": "get_weather", "arguments": '{"city": "Os'}]
    assert all(call["id"].startswith("call_") and call["type"] == "function" for call in cut)
    # Cut after the last call: every call whole.
    assert [c["function"]["name"] for c in calling.calls_in(whole.rstrip(", ") + "]", "length")] == ["get_time"]
    for before_arguments in ('"arguments": ', '"argu', "", " "):
        cut_before = calling.calls_in(whole + '{"name": "get_weather",' + before_arguments, "length")
        assert cut_before[1]["function"] == {"name": "get_weather", "arguments": ""}
    assert calling.calls_in(whole + '{"name": "get_weather", "x', "length")[1:] == []
    # Not yet a call's name, another tool's name, not a call at all, or a whole call that names no tool.
    for text in ('{"tool_calls": [{"na', '{"tool_calls": [{"name": "get_wea', '{"tool_calls": [{"name": "other", "arguments": {',
                 "The weather is", '{"tool_calls": [{"name": "other", "arguments": {}}, {"name": "get_time", "arguments": {'):
        assert calling.calls_in(text, "length") is None, text
    # A cut answer is not a whole one, and an aborted one is neither.
    assert calling.calls_in(whole + '{"name": "get_weather", "arguments": {"city": "Os', "stop") is None
    assert calling.calls_in(whole.rstrip(", ") + "]}", "abort") is None


def test_earlier_calls_and_the_tools_prompt_are_rendered():
    calling = ToolCalling.parse([TOOL], None, None)
    messages = render_tool_messages([
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "content": "sunny"}], calling)
    assert messages[0]["content"].startswith("Be brief.") and "get_weather" in messages[0]["content"]
    assert json.loads(messages[2]["content"]) == {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}]}
    assert messages[3] == {"role": "tool", "content": "sunny"}


def test_unknown_and_echoed_fields_of_a_chat_body():
    body = ChatCompletionBody.model_validate({"messages": [
        {"role": "assistant", "content": None, "refusal": None, "annotations": [], "audio": None,
         "function_call": None, "tool_calls": [{"id": "c", "type": "function",
                                                "function": {"name": "f", "arguments": "{}"}}]}]})
    assert body.messages[0].tool_calls
    with pytest.raises(ValueError, match="Extra inputs"):
        ChatCompletionBody.model_validate({"messages": [], "frobnicate": True})
    assert ChatCompletionBody.model_validate({"messages": [], "store": True}).unsupported() == "store"


def delta(index: int, text: str, finish: FinishReason | None = None) -> RequestOutput:
    return RequestOutput("r", [ChoiceDelta(index, [1], text, [], [], finish)])


def test_streaming_holds_a_possible_call_and_streams_plain_text_at_once(tokenizer):
    calling = ToolCalling.parse([TOOL], None, None)
    formatter = ResponseFormatter("chat", "r", "m", tokenizer, False, 2, calling)
    plain = formatter.chunks(delta(0, "Hello"))
    assert plain[0]["choices"][0]["delta"]["content"] == "Hello"
    assert formatter.chunks(delta(1, ' {"tool_calls": [{"name": "get_weather", ')) == [
        {**formatter._header("chat.completion.chunk"),
         "choices": [{"index": 1, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]}]
    last = formatter.chunks(delta(1, '"arguments": {"city": "Oslo"}}]}', FinishReason.STOP))[0]["choices"][0]
    assert last["finish_reason"] == "tool_calls"
    call = last["delta"]["tool_calls"][0]
    assert call["index"] == 0 and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Oslo"}


def test_a_streamed_call_cut_off_by_max_tokens_ends_as_a_call_with_finish_reason_length(tokenizer):
    formatter = ResponseFormatter("chat", "r", "m", tokenizer, False, 1, ToolCalling.parse([TOOL], "required", None))
    assert formatter.chunks(delta(0, '{"tool_calls": [{"name": "get_weather", '))[0]["choices"][0]["delta"] == {
        "role": "assistant", "content": ""}
    last = formatter.chunks(delta(0, '"arguments": {"ci', FinishReason.LENGTH))[0]["choices"][0]
    assert last["finish_reason"] == "length" and "content" not in last["delta"]
    assert last["delta"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"ci'}


def test_a_held_answer_that_is_not_a_call_is_sent_as_content(tokenizer):
    formatter = ResponseFormatter("chat", "r", "m", tokenizer, False, 1, ToolCalling.parse([TOOL], None, None))
    assert formatter.chunks(delta(0, '{"a": 1'))[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    last = formatter.chunks(delta(0, "}", FinishReason.STOP))[0]["choices"][0]
    assert last["delta"]["content"] == '{"a": 1}' and last["finish_reason"] == "stop"
