"""Structured outputs and tool calls through the split (real processes).

The gateway compiles each constraint (llguidance) and sends every sampling step's allowed
tokens; the executor masks the logits. Every constrained answer must parse and validate
against its schema (the ``jsonschema`` library), greedy and sampled, with ``n > 1``, with
prefix-cache hits and under preemption (a small KV pool). The whole schema suite runs on the
tiny random-weight model (fast, and the least cooperative writer of JSON there is: only the
mask keeps it valid); a sample of it, ``json_object``, regexes, grammars and tool calls made
by the official ``openai`` client run on the embedded model, streamed and not.
"""
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import jsonschema
import openai
import pytest

from kvserve.v1 import gateway_pb2, gateway_pb2_grpc
from bench.structured_schemas import SCHEMAS

pytestmark = pytest.mark.timeout(900)

MAX_TOKENS = 400
# The tiny model fills every string to its maxLength; the suite's schemas stay well under this.
TINY_MAX_TOKENS = 1200
# Left alone, the tiny model repeats one digit of a date-time's fraction of a second forever (the
# format bounds nothing there); a frequency penalty ends the run, and tests the mask with penalties.
TINY_SAMPLING = {"frequency_penalty": 1.0}
# Small enough that the schema suite, run all at once on the tiny model, preempts.
TINY_NUM_BLOCKS = 150
# Schemas the embedded model answers in the test of real-model JSON (short answers).
REAL_MODEL_SCHEMAS = 4
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 40}},
                   "required": ["zone"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def stack(module_stack, default_model_dir):
    return module_stack(default_model_dir)


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.http_url + "/v1", api_key="unused", max_retries=0, timeout=600)


@pytest.fixture(scope="module")
def tiny_stack(module_stack, tiny_model_dir):
    return module_stack(tiny_model_dir, executor_args=["--num-blocks", str(TINY_NUM_BLOCKS)],
                        gateway_args=["--max-num-seqs", "64"])


@pytest.fixture(scope="module")
def tiny_client(tiny_stack):
    return openai.OpenAI(base_url=tiny_stack.http_url + "/v1", api_key="unused", max_retries=0, timeout=600)


def preemptions(stack) -> float:
    for line in httpx.get(stack.http_url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:num_preemptions_total"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("vllm:num_preemptions_total not in /metrics")


def schema_request(client, name: str, prompt: str, schema: dict, max_tokens: int = MAX_TOKENS, **extra):
    return client.chat.completions.create(
        model="", messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
        response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}},
        **extra)


def format_checker() -> jsonschema.FormatChecker:
    # llguidance's date-time and time admit a leap second (:60) at any hour and a lower-case z;
    # jsonschema's only 23:59:60 UTC. Every other format is checked.
    checker = jsonschema.FormatChecker()
    for name in ("date-time", "time"):
        checker.checkers.pop(name, None)
    return checker


def assert_valid(reply, schema: dict, what: str) -> None:
    validator = jsonschema.Draft202012Validator(schema, format_checker=format_checker())
    for choice in reply.choices:
        assert choice.finish_reason == "stop", f"{what}: {choice.finish_reason}: {choice.message.content!r}"
        value = json.loads(choice.message.content)
        errors = [e.message for e in validator.iter_errors(value)]
        assert not errors, f"{what}: {choice.message.content!r}: {errors}"


def test_schemas_are_many_and_of_real_world_shapes():
    assert len(SCHEMAS) >= 50
    text = json.dumps([schema for _, _, schema in SCHEMAS])
    for keyword in ("anyOf", "enum", "$ref", "format", "minimum", "items", "required", "pattern"):
        assert f'"{keyword}"' in text, keyword


def test_every_schema_validates_greedy_then_sampled_with_n_2_under_preemption(tiny_stack, tiny_client):
    before = preemptions(tiny_stack)
    with ThreadPoolExecutor(len(SCHEMAS)) as pool:
        greedy = list(pool.map(lambda s: schema_request(tiny_client, *s, TINY_MAX_TOKENS, temperature=0,
                                                        **TINY_SAMPLING), SCHEMAS))
        for (name, _, schema), reply in zip(SCHEMAS, greedy):
            assert_valid(reply, schema, f"{name} (greedy)")
        sampled = list(pool.map(lambda item: schema_request(tiny_client, *item[1], TINY_MAX_TOKENS, temperature=0.8,
                                                            seed=item[0], n=2, **TINY_SAMPLING), enumerate(SCHEMAS)))
    for (name, _, schema), reply in zip(SCHEMAS, sampled):
        assert len(reply.choices) == 2
        assert_valid(reply, schema, f"{name} (sampled, n=2)")
    assert preemptions(tiny_stack) > before  # the small pool really preempted constrained sequences


def test_a_prefix_cache_hit_gives_the_same_valid_answer(tiny_client):
    name, prompt, schema = SCHEMAS[0]
    first = schema_request(tiny_client, name, prompt, schema, TINY_MAX_TOKENS, temperature=0, **TINY_SAMPLING)
    again = schema_request(tiny_client, name, prompt, schema, TINY_MAX_TOKENS, temperature=0, **TINY_SAMPLING)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert again.choices[0].message.content == first.choices[0].message.content
    assert_valid(again, schema, name)


def test_the_embedded_model_answers_schemas_validly(client):
    sample = SCHEMAS[:REAL_MODEL_SCHEMAS]
    with ThreadPoolExecutor(len(sample)) as pool:
        replies = list(pool.map(lambda s: schema_request(client, *s, temperature=0), sample))
    for (name, _, schema), reply in zip(sample, replies):
        assert_valid(reply, schema, name)


# A free-text prompt under json_object can ramble inside one string until max_tokens (the grammar
# bounds no string), so these ask for JSON, as a client using json_object does.
@pytest.mark.parametrize("prompt", ["Give a JSON object with keys name and age.",
                                    "Describe a cat as JSON with keys color and age.",
                                    "Give a JSON object with a key city and a key country."])
def test_json_object_always_yields_a_json_object(client, prompt):
    reply = client.chat.completions.create(model="", messages=[{"role": "user", "content": prompt}],
                                           response_format={"type": "json_object"}, max_tokens=MAX_TOKENS,
                                           temperature=0, n=1)
    for choice in reply.choices:
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(json.loads(choice.message.content), dict)


def test_regex_choice_and_grammar_on_completions(stack):
    url = stack.http_url + "/v1/completions"
    date = httpx.post(url, timeout=120, json={"prompt": "Today's date is", "max_tokens": 20, "temperature": 0.9,
                                              "seed": 3, "guided_regex": r" \d{4}-\d{2}-\d{2}"}).json()
    assert re.fullmatch(r" \d{4}-\d{2}-\d{2}", date["choices"][0]["text"]), date
    choice = httpx.post(url, timeout=120, json={"prompt": "Is the sky blue? Answer:", "max_tokens": 10,
                                                "structured_outputs": {"choice": ["yes", "no"]}}).json()
    assert choice["choices"][0]["text"] in ("yes", "no") and choice["choices"][0]["finish_reason"] == "stop"
    gbnf = httpx.post(url, timeout=120, json={"prompt": "Count:", "max_tokens": 30, "temperature": 1.0, "seed": 5,
                                              "guided_grammar": 'root ::= "[" [0-9] ("," [0-9]){0,4} "]"'}).json()
    assert re.fullmatch(r"\[[0-9](,[0-9]){0,4}\]", gbnf["choices"][0]["text"]), gbnf


def test_grpc_generate_takes_a_constraint(stack):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    with grpc.insecure_channel(stack.gateway.address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        params = gateway_pb2.GenerationParams(max_tokens=40, constraint=gateway_pb2.OutputConstraint(
            json_schema=json.dumps(schema)))
        text = "".join(m.text for m in stub.Generate(gateway_pb2.GenerateRequest(text="Is it ok?", params=params)))
        assert json.loads(text) in ({"ok": True}, {"ok": False})
        bad = gateway_pb2.GenerationParams(constraint=gateway_pb2.OutputConstraint(regex="(unclosed"))
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Generate(gateway_pb2.GenerateRequest(text="x", params=bad)))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "constraint.regex" in refused.value.details()


def called(reply) -> list[tuple[str, dict]]:
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls", message
    return [(call.function.name, json.loads(call.function.arguments)) for call in message.tool_calls]


def streamed_calls(stream) -> tuple[list[tuple[str, dict]], str]:
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
            entry["name"] += call.function.name or ""
            entry["arguments"] += call.function.arguments or ""
            assert call.id is None or call.id.startswith("call_")
        finish = chunk.choices[0].finish_reason or finish
    return [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())], finish


ASK = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]
PARAMETERS = {WEATHER["function"]["name"]: WEATHER["function"]["parameters"],
              TIME["function"]["name"]: TIME["function"]["parameters"]}


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_required_and_named_tool_calls_always_parse(client, tool_choice):
    kwargs = dict(model="", messages=ASK, tools=[WEATHER, TIME], tool_choice=tool_choice,
                  max_tokens=MAX_TOKENS)
    for temperature, seed in ((0, None), (1.0, 7)):
        calls = called(client.chat.completions.create(temperature=temperature, seed=seed, **kwargs))
        streamed, finish = streamed_calls(client.chat.completions.create(temperature=temperature, seed=seed,
                                                                         stream=True, **kwargs))
        assert finish == "tool_calls" and streamed == calls
        for name, arguments in calls:
            jsonschema.validate(arguments, PARAMETERS[name])
            if isinstance(tool_choice, dict):
                assert name == "get_weather"


@pytest.mark.parametrize("stream", [False, True])
def test_a_required_call_cut_off_by_max_tokens_is_still_a_call(client, stream):
    """As OpenAI answers a forced call that ``max_tokens`` cuts off: ``tool_calls`` with the
    arguments' text as far as it came, ``finish_reason`` ``length``, no content."""
    kwargs = dict(model="", messages=ASK, tools=[WEATHER], tool_choice="required", temperature=0)
    whole = client.chat.completions.create(max_tokens=MAX_TOKENS, **kwargs)
    (name, arguments), = called(whole)
    # A little short of the whole answer: the cut falls inside the call's arguments.
    cut_at = whole.usage.completion_tokens - 3
    if stream:
        calls: dict[int, dict] = {}
        finish = None
        for chunk in client.chat.completions.create(max_tokens=cut_at, stream=True, **kwargs):
            for call in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
                entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
            if chunk.choices:
                assert not chunk.choices[0].delta.content
                finish = chunk.choices[0].finish_reason or finish
        (cut_name, cut_arguments), = [(c["name"], c["arguments"]) for c in calls.values()]
    else:
        cut = client.chat.completions.create(max_tokens=cut_at, **kwargs)
        finish, message = cut.choices[0].finish_reason, cut.choices[0].message
        assert message.content is None and len(message.tool_calls) == 1
        cut_name, cut_arguments = message.tool_calls[0].function.name, message.tool_calls[0].function.arguments
    assert finish == "length" and cut_name == name
    compact, cut_compact = json.dumps(arguments, separators=(",", ":")), "".join(cut_arguments.split())
    assert cut_compact and compact.startswith(cut_compact) and len(cut_compact) < len(compact)


def test_a_tool_result_is_answered(client):
    first = client.chat.completions.create(model="", messages=ASK, tools=[WEATHER], tool_choice="required",
                                           max_tokens=MAX_TOKENS, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    messages = [*ASK, first.choices[0].message.model_dump(exclude_none=False),
                {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "clear"}'}]
    answer = client.chat.completions.create(model="", messages=messages, tools=[WEATHER], max_tokens=40,
                                            temperature=0)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert answer.choices[0].message.content or answer.choices[0].message.tool_calls


def test_tool_choice_none_and_auto_answer_in_text(client):
    reply = client.chat.completions.create(model="", messages=[{"role": "user", "content": "Say hello."}],
                                           tools=[WEATHER], tool_choice="none", max_tokens=12, temperature=0)
    assert reply.choices[0].message.content and not reply.choices[0].message.tool_calls
    auto = client.chat.completions.create(model="", messages=[{"role": "user", "content": "Say hello."}],
                                          tools=[WEATHER], max_tokens=12, temperature=0, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in auto if chunk.choices)
    assert text


def test_a_bad_constraint_costs_only_its_sender(stack, client):
    name, prompt, schema = SCHEMAS[1]
    with ThreadPoolExecutor(2) as pool:
        good = pool.submit(schema_request, client, name, prompt, schema, temperature=0)
        bad = httpx.post(stack.http_url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "x"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}})
        assert bad.status_code == 400 and "response_format" in bad.json()["error"]["message"]
        assert_valid(good.result(), schema, name)


def strict_json(text: str):
    """json.loads that refuses what Python writes but JSON has not (Infinity, NaN), as a browser's or
    Go's parser would."""
    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")
    return json.loads(text, parse_constant=refuse)


def test_alternatives_the_mask_forbids_are_reported_at_the_floor_in_valid_json(stack):
    # Two choices allow fewer tokens at each step than the 20 alternatives asked for: the rest have
    # probability 0, reported as -9999 (OpenAI's and vLLM's floor), never -Infinity.
    chat = {"messages": [{"role": "user", "content": "Is the sky blue?"}], "max_tokens": 5, "temperature": 0,
            "guided_choice": ["yes", "no"], "logprobs": True, "top_logprobs": 20}
    url = stack.http_url + "/v1/chat/completions"
    reply = httpx.post(url, timeout=120, json=chat)
    assert reply.status_code == 200, reply.text
    items = strict_json(reply.text)["choices"][0]["logprobs"]["content"]
    alternatives = [alt["logprob"] for item in items for alt in item["top_logprobs"]]
    assert -9999.0 in alternatives and min(alternatives) == -9999.0
    assert all(-9999.0 < item["logprob"] <= 0 for item in items)  # what was sampled was allowed
    with httpx.stream("POST", url, timeout=120, json={**chat, "stream": True}) as streamed:
        events = [line[len("data: "):] for line in streamed.iter_lines() if line.startswith("data: ")]
    chunks = [strict_json(event) for event in events[:-1]]
    assert events[-1] == "[DONE]" and any(
        alt["logprob"] == -9999.0 for chunk in chunks for choice in chunk["choices"] if choice.get("logprobs")
        for item in choice["logprobs"]["content"] for alt in item["top_logprobs"])
    completion = httpx.post(stack.http_url + "/v1/completions", timeout=120, json={
        "prompt": "Is the sky blue? Answer:", "max_tokens": 5, "temperature": 0,
        "guided_choice": ["yes", "no"], "logprobs": 20})
    assert completion.status_code == 200, completion.text
    logprobs = strict_json(completion.text)["choices"][0]["logprobs"]
    assert min(p for top in logprobs["top_logprobs"] for p in top.values()) == -9999.0
