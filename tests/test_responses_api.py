"""OpenAI's Responses API (POST /v1/responses) against real kvmanager + executor processes (tiny
model), through the ``openai`` package's own client and its typed stream events."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from gateway.responses_api import droppable_turns

pytestmark = pytest.mark.timeout(300)

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                          "additionalProperties": False}}


@pytest.fixture(scope="module")
def stack(module_stack, tiny_model_dir):
    return module_stack(tiny_model_dir, executor_args=["--dtype", "float32"], gateway_args=["--tenants", "alice,bob"])


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.http_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def chat_text(client, model, messages: list[dict], **kwargs) -> str:
    return client.chat.completions.create(model=model, messages=messages, temperature=0, **kwargs) \
        .choices[0].message.content


def test_a_response_is_the_chat_completion_of_its_input(client, model):
    response = client.responses.create(model=model, input="Say something.", instructions="Be brief.",
                                       max_output_tokens=12, temperature=0)
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert [(item.type, item.status) for item in response.output] == [("message", "incomplete")]
    expected = chat_text(client, model, [{"role": "system", "content": "Be brief."},
                                  {"role": "user", "content": "Say something."}], max_tokens=12)
    assert response.output_text == expected
    assert response.usage.output_tokens == 12 and response.usage.input_tokens > 0
    assert response.usage.total_tokens == response.usage.input_tokens + 12


def test_input_items_become_the_conversation(client, model):
    items = [{"role": "developer", "content": "Answer in French."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hello"}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Bonjour", "annotations": []}]},
             {"role": "user", "content": "And goodbye?"}]
    response = client.responses.create(model=model, input=items, max_output_tokens=8, temperature=0)
    expected = chat_text(client, model, [{"role": "system", "content": "Answer in French."},
                                  {"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Bonjour"},
                                  {"role": "user", "content": "And goodbye?"}], max_tokens=8)
    assert response.output_text == expected


def test_a_required_tool_call_comes_back_as_a_function_call_item_and_its_output_goes_on(client, model):
    response = client.responses.create(model=model, input="Weather in Paris?", tools=[WEATHER],
                                       tool_choice="required", max_output_tokens=64, temperature=0)
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls and response.status == "completed"
    assert calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
    assert isinstance(json.loads(calls[0].arguments)["city"], str)
    follow_up = client.responses.create(model=model, tools=[WEATHER], max_output_tokens=6, temperature=0, input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather", "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny, 21 C"}])
    assert follow_up.output and follow_up.usage.input_tokens > response.usage.input_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_cut_off_by_max_output_tokens_is_an_incomplete_function_call_item(client, model, stream):
    kwargs = dict(model=model, input="Weather in Paris?", tools=[WEATHER], tool_choice="required", temperature=0)
    whole = client.responses.create(max_output_tokens=64, **kwargs)
    assert whole.status == "completed" and whole.output[0].status == "completed"
    arguments = json.loads(whole.output[0].arguments)
    cut_at = whole.usage.output_tokens - 2
    if stream:
        cut = list(client.responses.create(max_output_tokens=cut_at, stream=True, **kwargs))[-1].response
    else:
        cut = client.responses.create(max_output_tokens=cut_at, **kwargs)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    (item,) = cut.output
    assert (item.type, item.name, item.status) == ("function_call", "get_weather", "incomplete")
    # As far as they came: the tiny model's last tokens may close the call after its arguments.
    assert json.dumps(arguments, separators=(",", ":")).startswith("".join(item.arguments.split()))


def test_text_format_json_schema_constrains_the_output(client, model):
    schema = {"type": "object", "properties": {"answer": {"enum": ["three", "four", "five"]}}, "required": ["answer"],
              "additionalProperties": False}
    response = client.responses.create(model=model, input="2 + 2?", max_output_tokens=40, temperature=0,
                                       text={"format": {"type": "json_schema", "name": "sum", "schema": schema}})
    assert response.status == "completed"
    assert json.loads(response.output_text)["answer"] in ("three", "four", "five")


def test_the_stream_sends_typed_events_that_add_up_to_the_response(client, model):
    whole = client.responses.create(model=model, input="Tell me a story.", max_output_tokens=10, temperature=0)
    events = list(client.responses.create(model=model, input="Tell me a story.", max_output_tokens=10,
                                          temperature=0, stream=True))
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    for kind in ("response.output_item.added", "response.content_part.added", "response.output_text.done",
                 "response.content_part.done", "response.output_item.done"):
        assert kinds.count(kind) == 1, kinds
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    assert events[-1].response.output_text == text and events[-1].response.usage.output_tokens == 10


def test_a_streamed_tool_call_arrives_as_one_function_call_item(client, model):
    events = list(client.responses.create(model=model, input="Weather?", tools=[WEATHER], tool_choice="required",
                                          max_output_tokens=64, temperature=0, stream=True))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) >= 1 and done[0].name == "get_weather"
    final = events[-1].response
    assert final.status == "completed" and final.output[0].type == "function_call"
    assert final.output[0].arguments == done[0].arguments


def test_output_text_logprobs_are_the_chat_completion_s(client, model):
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Count:"}],
                                          temperature=0, max_tokens=6, logprobs=True, top_logprobs=2)
    want = [(t.token, t.logprob, [a.token for a in t.top_logprobs]) for t in chat.choices[0].logprobs.content]
    response = client.responses.create(model=model, input="Count:", temperature=0, max_output_tokens=6,
                                       top_logprobs=2, include=["message.output_text.logprobs"])
    got = [(t.token, t.logprob, [a.token for a in t.top_logprobs]) for t in response.output[0].content[0].logprobs]
    assert got == want
    events = list(client.responses.create(model=model, input="Count:", temperature=0, max_output_tokens=6,
                                          top_logprobs=2, stream=True))
    streamed = [(t.token, t.logprob, [a.token for a in t.top_logprobs])
                for e in events if e.type == "response.output_text.delta" for t in e.logprobs]
    assert streamed == want
    plain = client.responses.create(model=model, input="Count:", temperature=0, max_output_tokens=6)
    assert plain.output[0].content[0].logprobs == []


@pytest.mark.parametrize("body, needle", [
    ({"input": "hi", "include": ["reasoning.encrypted_content"]}, "include"),
    ({"input": "hi", "previous_response_id": "resp_1"}, "Previous response with id 'resp_1' not found"),
    ({"input": "hi", "conversation": "conv_1"}, "conversation"),
    ({"input": "hi", "truncation": "middle"}, "truncation"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input[0].arguments"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "hi", "text": {"format": {"type": "xml"}}}, "text.format"),
    ({"input": "hi", "unknown": 1}, "unknown"),
    ({"input": []}, "input"),
    ({"input": "hi", "max_output_tokens": 0}, "max_tokens"),
])
def test_what_cannot_be_served_is_a_400_naming_it(stack, body, needle):
    reply = httpx.post(stack.http_url + "/v1/responses", json=body, timeout=30)
    assert reply.status_code == 400, reply.text
    assert needle in reply.json()["error"]["message"], reply.text


# ---- stored responses: store, previous_response_id, retrieve, input items, delete ----------------


def test_previous_response_id_goes_on_from_the_stored_conversation(client, model):
    """The second turn is the chat completion of the whole conversation (the first turn's
    instructions not carried over, as OpenAI's are not), and its earlier turns' KV comes from the
    prefix cache."""
    first = client.responses.create(model=model, input="My name is Ada. Say hello.", instructions="Be brief.",
                                    max_output_tokens=8, temperature=0)
    assert first.store is True and first.previous_response_id is None
    second = client.responses.create(model=model, input="What is my name?", previous_response_id=first.id,
                                     max_output_tokens=8, temperature=0)
    assert second.previous_response_id == first.id and second.store is True
    expected = client.chat.completions.create(model=model, temperature=0, max_tokens=8, messages=[
        {"role": "user", "content": "My name is Ada. Say hello."}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"}])
    assert second.output_text == expected.choices[0].message.content
    assert second.usage.input_tokens == expected.usage.prompt_tokens
    assert second.usage.input_tokens_details.cached_tokens >= 16  # at least the first turn's whole block
    third = client.responses.create(model=model, input="And again?", previous_response_id=second.id,
                                    max_output_tokens=4, temperature=0)
    assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens


def test_a_tool_call_s_output_goes_on_from_the_stored_call(client, model):
    """The call's output sent with previous_response_id is the conversation sent whole."""
    asked = client.responses.create(model=model, input="Weather in Paris?", tools=[WEATHER], tool_choice="required",
                                    max_output_tokens=64, temperature=0)
    call = asked.output[0]
    assert call.type == "function_call"
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}
    continued = client.responses.create(model=model, tools=[WEATHER], max_output_tokens=6, temperature=0,
                                        previous_response_id=asked.id, input=[output])
    whole = client.responses.create(model=model, tools=[WEATHER], max_output_tokens=6, temperature=0, store=False,
                                    input=[{"role": "user", "content": "Weather in Paris?"},
                                           {"type": "function_call", "call_id": call.call_id, "name": call.name,
                                            "arguments": call.arguments}, output])
    assert continued.output_text == whole.output_text
    assert continued.usage.input_tokens == whole.usage.input_tokens


def test_a_stored_response_is_retrieved_listed_and_deleted(client, model):
    items = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi"},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Bye"}], "id": "msg_mine"}]
    response = client.responses.create(model=model, input=items, max_output_tokens=5, temperature=0)
    assert client.responses.retrieve(response.id).model_dump() == response.model_dump()
    listed = client.responses.input_items.list(response.id, order="asc")
    assert [(item.role, item.content[0].text) for item in listed.data] == [("user", "Hello"), ("assistant", "Hi"),
                                                                           ("user", "Bye")]
    assert listed.data[2].id == "msg_mine" and len({item.id for item in listed.data}) == 3
    newest_first = client.responses.input_items.list(response.id, limit=2)
    assert [item.id for item in newest_first.data] == [listed.data[2].id, listed.data[1].id] and newest_first.has_more
    assert [item.id for item in client.responses.input_items.list(response.id, limit=2, after=listed.data[1].id).data] \
        == [listed.data[0].id]
    with pytest.raises(openai.BadRequestError, match="stream"):
        list(client.responses.retrieve(response.id, stream=True))
    client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(response.id)
    with pytest.raises(openai.BadRequestError, match="not found"):
        client.responses.create(model=model, input="Again", previous_response_id=response.id)


def test_a_streamed_response_is_stored_as_its_last_event_carries_it(client, model):
    events = list(client.responses.create(model=model, input="Count to three.", max_output_tokens=6, temperature=0,
                                          stream=True))
    final = events[-1].response
    assert events[0].response.store is True and final.store is True
    assert client.responses.retrieve(final.id).model_dump() == final.model_dump()


def test_store_false_keeps_nothing(stack, client, model):
    def stored() -> float:
        metrics = httpx.get(stack.http_url + "/metrics", params={"name[]": "kvserve:responses_stored"}).text
        line = next(line for line in metrics.splitlines() if line.startswith("kvserve:responses_stored{"))
        return float(line.split()[-1])

    before = stored()
    response = client.responses.create(model=model, input="Hello", max_output_tokens=3, store=False)
    assert stored() == before
    assert client.responses.create(model=model, input="Hello", max_output_tokens=3).store is True
    assert stored() == before + 1
    assert response.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    with pytest.raises(openai.BadRequestError, match="not found"):
        client.responses.create(model=model, input="Again", previous_response_id=response.id)


def test_a_tenant_s_stored_responses_do_not_exist_for_another(stack, model):
    alice, bob = ({"X-Kvserve-Tenant": name} for name in ("alice", "bob"))
    url = stack.http_url + "/v1/responses"
    stored = httpx.post(url, json={"input": "A secret.", "max_output_tokens": 3}, headers=alice, timeout=60).json()
    for headers in (bob, {}):
        assert httpx.get(f"{url}/{stored['id']}", headers=headers).status_code == 404
        assert httpx.get(f"{url}/{stored['id']}/input_items", headers=headers).status_code == 404
        assert httpx.delete(f"{url}/{stored['id']}", headers=headers).status_code == 404
        going_on = httpx.post(url, json={"input": "Tell me.", "previous_response_id": stored["id"]}, headers=headers)
        assert going_on.status_code == 400 and "not found" in going_on.json()["error"]["message"]
    assert httpx.get(f"{url}/{stored['id']}", headers=alice).json()["output"] == stored["output"]
    assert httpx.delete(f"{url}/{stored['id']}", headers=alice).json() == {"id": stored["id"], "object": "response",
                                                                           "deleted": True}


def test_truncation_auto_drops_the_oldest_turns_until_the_conversation_fits(client, model):
    """A conversation gone on past max_model_len: a 400 as it is, and with truncation auto the
    chat completion of its newest turns (the instructions kept), as few turns dropped as fit."""
    limit = client.models.list().data[0].model_extra["max_model_len"]
    long_text = "The quick brown fox jumps over the lazy dog. " * (limit // 16)  # ~5/8 of max_model_len
    first = client.responses.create(model=model, input="One: " + long_text, max_output_tokens=4, temperature=0)
    with pytest.raises(openai.BadRequestError, match="max_model_len"):
        client.responses.create(model=model, input="Two: " + long_text, previous_response_id=first.id,
                                max_output_tokens=4, temperature=0)
    cut = client.responses.create(model=model, input="Two: " + long_text, previous_response_id=first.id,
                                  instructions="Be brief.", truncation="auto", max_output_tokens=4, temperature=0)
    assert cut.truncation == "auto" and cut.usage.input_tokens + 4 <= limit
    expected = client.chat.completions.create(model=model, temperature=0, max_tokens=4, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "Two: " + long_text}])
    assert cut.output_text == expected.choices[0].message.content
    assert cut.usage.input_tokens == expected.usage.prompt_tokens
    short = client.responses.create(model=model, input="Hi", previous_response_id=first.id, truncation="auto",
                                    max_output_tokens=4, temperature=0)
    assert short.usage.input_tokens > limit // 2  # it fits: nothing dropped


def test_the_turns_truncation_may_drop_keep_a_call_with_its_results():
    assert droppable_turns(["system", "user", "assistant", "tool", "tool", "user"]) == (1, [1, 2, 5])
    assert droppable_turns(["user"]) == (0, [0])
    assert droppable_turns(["system", "system"]) == (2, [])
