"""Incremental detokenization and the chat template, with the default model's real tokenizer."""
from __future__ import annotations

import shutil

import pytest
from pydantic import ValidationError

from gateway.detokenizer import ModelTokenizer
from gateway.openai_protocol import ChatCompletionBody, message_dicts
from gateway.tool_calls import render_tool_messages
from kvserve.errors import InvalidArgument

TEXTS = [
    "Hello world, how are you?",
    " leading space and  double  spaces",
    "ça va? déjà vu — naïve façade",
    "日本語のテキストと中文字符",
    "emoji 🎉🎉 and flags 🇫🇷 👩‍👩‍👧",
    "code:\n\tdef f(x):\n\t\treturn x ** 2\n",
    "<|im_end|> special in text",
]


@pytest.fixture(scope="module")
def tokenizer(default_model_dir) -> ModelTokenizer:
    return ModelTokenizer(default_model_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_deltas_equal_the_whole_decode_and_are_never_broken(tokenizer, text):
    prompt = tokenizer.encode("Say this:")
    ids = tokenizer.encode(text)
    decoder = tokenizer.detokenizer(prompt)
    deltas = [decoder.append(token_id) for token_id in ids] + [decoder.flush()]
    assert "".join(deltas) == tokenizer.decode(ids)
    assert not any("\ufffd" in delta for delta in deltas)


def test_byte_tokens_of_one_character_wait_for_the_character(tokenizer):
    ids = tokenizer.encode("🎉")
    assert len(ids) > 1  # the emoji is split into byte tokens
    decoder = tokenizer.detokenizer(tokenizer.encode("x"))
    deltas = [decoder.append(t) for t in ids]
    assert deltas[:-1] == [""] * (len(ids) - 1) and deltas[-1] == "🎉"


@pytest.mark.parametrize("text", TEXTS)
def test_token_bytes_join_into_the_texts_utf8(tokenizer, text):
    ids = tokenizer.encode(text)
    assert b"".join(tokenizer.token_bytes(t) for t in ids) == text.encode()


def test_a_token_that_is_part_of_a_character_has_its_own_bytes(tokenizer):
    pieces = [tokenizer.token_bytes(t) for t in tokenizer.encode("🎉")]
    assert len(pieces) > 1 and b"".join(pieces) == "🎉".encode()
    assert all(tokenizer.decode([t]) == "\ufffd" for t in tokenizer.encode("🎉")[1:])  # its text says nothing


def test_invalid_bytes_are_eventually_emitted_not_held_forever(tokenizer):
    lone_continuation = tokenizer.encode("é")[-1:]  # a continuation byte without its lead byte
    decoder = tokenizer.detokenizer([])
    out = "".join(decoder.append(t) for t in lone_continuation * 6) + decoder.flush()
    assert out  # replacement characters, but the stream moves on


def test_special_tokens_are_skipped(tokenizer):
    decoder = tokenizer.detokenizer(tokenizer.encode("a"))
    im_end = tokenizer.encode("<|im_end|>")
    assert [decoder.append(t) for t in im_end] == [""] * len(im_end)
    assert decoder.append(tokenizer.encode(" ok")[0]) == " ok"


def test_chat_template_renders_from_the_model_directory(tokenizer):
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    with_system = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert with_system.startswith("<|im_start|>system\nBe brief.<|im_end|>\n")
    assert 2 in tokenizer.eos_token_ids


def test_continue_final_message_leaves_the_assistant_turn_open_after_its_prefix(tokenizer):
    asked = [{"role": "user", "content": "Name a colour."}]
    opened = tokenizer.apply_chat_template(asked + [{"role": "assistant", "content": "My favourite is"}], False, True)
    assert opened == tokenizer.apply_chat_template(asked, True) + "My favourite is"
    for add_generation_prompt, final, needle in [(True, "Blue", "add_generation_prompt: false"),
                                                  (False, "  ", "no content to continue")]:
        with pytest.raises(InvalidArgument, match=needle):
            tokenizer.apply_chat_template(asked + [{"role": "assistant", "content": final}], add_generation_prompt, True)


def test_a_template_reads_the_name_and_tool_call_id_a_client_sends(default_model_dir, tmp_path):
    """OpenAI clients send a participant's ``name`` and a tool result's ``tool_call_id``; a chat
    template that renders them gets them as sent (the default model's ignores both)."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir / name, tmp_path / name)
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}[{{ m['role'] }}{% if m.name %} {{ m.name }}{% endif %}"
        "{% if m.tool_call_id %} answers {{ m.tool_call_id }}{% endif %}] {{ m['content'] }}\n{% endfor %}")
    body = ChatCompletionBody.model_validate({"model": "m", "messages": [
        {"role": "user", "name": "ada", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_7", "type": "function", "function": {"name": "weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_7", "content": "sunny"}]})
    rendered = ModelTokenizer(tmp_path).apply_chat_template(message_dicts(body.messages), False)
    assert "[user ada] Weather?" in rendered and "[tool answers call_7] sunny" in rendered
    assert "[assistant]" in rendered  # no name, no id: nothing added


def test_an_echoed_refusal_and_a_legacy_function_call_stay_in_the_history(tokenizer):
    """A history that carries an assistant turn as ``refusal`` (content null) or a call in the legacy
    ``function_call`` form renders that turn, as the same history with content or ``tool_calls``
    does; a malformed legacy call is a 400, as a malformed tool call is."""
    def rendered(*messages):
        body = ChatCompletionBody.model_validate({"model": "m", "messages": [
            {"role": "user", "content": "Weather in Oslo?"}, *messages]})
        return tokenizer.apply_chat_template(render_tool_messages(message_dicts(body.messages), None), True)

    call = {"name": "weather", "arguments": '{"city": "Oslo"}'}
    assert rendered({"role": "assistant", "content": None, "function_call": call}) == rendered(
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function", "function": call}]})
    assert '"weather"' in rendered({"role": "assistant", "content": None, "function_call": call})
    assert rendered({"role": "assistant", "content": None, "refusal": "I can't say."}) == rendered(
        {"role": "assistant", "content": "I can't say."})
    with pytest.raises(ValidationError, match="function_call"):
        ChatCompletionBody.model_validate({"model": "m", "messages": [
            {"role": "assistant", "function_call": {"name": "weather"}}]})
