"""vLLM's tokenizer routes (/tokenize, /detokenize, /tokenizer_info) against real processes (tiny
model): the ids they give are the ids a prompt becomes on the completions routes, and they answer
what lm-evaluation-harness's remote tokenizer asks."""
from __future__ import annotations

import httpx
import pytest

from gateway.detokenizer import ModelTokenizer

pytestmark = pytest.mark.timeout(300)

TEXT = "The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def stack(module_stack, tiny_model_dir):
    return module_stack(tiny_model_dir, executor_args=["--dtype", "float32"])


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return ModelTokenizer(tiny_model_dir)


def post(stack, path: str, body: dict) -> httpx.Response:
    return httpx.post(stack.http_url + path, json=body, timeout=60)


def test_tokenize_gives_the_ids_a_prompt_becomes(stack, tokenizer):
    reply = post(stack, "/tokenize", {"prompt": TEXT, "return_token_strs": True}).json()
    assert reply["tokens"] == tokenizer.encode(TEXT, True) and reply["count"] == len(reply["tokens"])
    assert reply["token_strs"] == [tokenizer.id_to_token(t) for t in reply["tokens"]]
    assert reply["max_model_len"] > 0
    # A completion of those ids is the completion of the text.
    by_text = post(stack, "/v1/completions", {"prompt": TEXT, "max_tokens": 4, "temperature": 0}).json()
    by_ids = post(stack, "/v1/completions", {"prompt": reply["tokens"], "max_tokens": 4, "temperature": 0}).json()
    assert by_ids["choices"][0]["text"] == by_text["choices"][0]["text"]
    assert by_ids["usage"]["prompt_tokens"] == by_text["usage"]["prompt_tokens"] == reply["count"]


def test_tokenize_renders_messages_with_the_chat_template(stack, tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXT}]
    reply = post(stack, "/tokenize", {"messages": messages}).json()
    assert reply["tokens"] == tokenizer.encode(tokenizer.apply_chat_template(messages, True))
    chat = post(stack, "/v1/chat/completions", {"messages": messages, "max_tokens": 1}).json()
    assert chat["usage"]["prompt_tokens"] == reply["count"]
    without = post(stack, "/tokenize", {"messages": messages, "add_generation_prompt": False}).json()
    assert without["count"] < reply["count"]
    call = {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": "{\"q\": \"fox\"}"}}
    turns = messages + [{"role": "assistant", "content": None, "tool_calls": [call]},
                        {"role": "tool", "tool_call_id": "call_1", "content": "a fox"}]
    counted = post(stack, "/tokenize", {"messages": turns}).json()["count"]
    assert counted == post(stack, "/v1/chat/completions", {"messages": turns, "max_tokens": 1}).json()["usage"][
        "prompt_tokens"]


def test_continue_final_message_goes_on_from_the_assistant_s_prefix(stack, tokenizer):
    """vLLM's ``continue_final_message``: the answer continues the final assistant message, as a
    completion of the rendered chat cut after that message's text would."""
    messages = [{"role": "user", "content": TEXT}, {"role": "assistant", "content": "The fox"}]
    flags = {"add_generation_prompt": False, "continue_final_message": True}
    rendered = tokenizer.apply_chat_template(messages, False, True)
    counted = post(stack, "/tokenize", {"messages": messages, **flags}).json()
    assert counted["tokens"] == tokenizer.encode(rendered)
    chat = post(stack, "/v1/chat/completions", {"messages": messages, "max_tokens": 6, "temperature": 0, **flags})
    completion = post(stack, "/v1/completions", {"prompt": counted["tokens"], "max_tokens": 6, "temperature": 0})
    assert chat.json()["usage"]["prompt_tokens"] == counted["count"]
    assert chat.json()["choices"][0]["message"]["content"] == completion.json()["choices"][0]["text"]
    refused = post(stack, "/v1/chat/completions", {"messages": messages, "continue_final_message": True})
    assert refused.status_code == 400 and "add_generation_prompt: false" in refused.json()["error"]["message"]


def test_detokenize_inverts_tokenize(stack):
    tokens = post(stack, "/tokenize", {"prompt": TEXT, "add_special_tokens": False}).json()["tokens"]
    assert post(stack, "/detokenize", {"tokens": tokens}).json() == {"prompt": TEXT}


def test_tokenizer_info_answers_what_a_remote_tokenizer_reads(stack, tokenizer):
    """lm-evaluation-harness's auto-detection: /tokenizer_info with an eos_token, then /tokenize."""
    info = httpx.get(stack.http_url + "/tokenizer_info", timeout=30).json()
    assert info["eos_token"] == tokenizer.eos_token and info["chat_template"] == tokenizer.chat_template
    probe = post(stack, "/tokenize", {"prompt": "test", "add_special_tokens": False}).json()
    assert probe["tokens"] == tokenizer.encode("test")


@pytest.mark.parametrize("path, body, needle", [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"prompt": "a", "model": "other"}, "model"),
    ("/tokenize", {"prompt": "a", "unknown": 1}, "unknown"),
    ("/detokenize", {"tokens": [1, 10**9]}, "tokens[1]"),
    ("/detokenize", {"tokens": [-1]}, "tokens[0]"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
])
def test_bad_tokenizer_requests_are_a_400_naming_the_field(stack, path, body, needle):
    reply = post(stack, path, body)
    assert reply.status_code == 400, reply.text
    assert needle in reply.json()["error"]["message"], reply.text
