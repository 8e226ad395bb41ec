"""OpenAI's Responses API (``POST /v1/responses``) over the chat path.

A request becomes a chat completion: ``instructions`` a system message, each input item a
message (``function_call`` items the assistant's tool calls, ``function_call_output`` items
tool messages), ``tools`` and ``text.format`` the chat path's tools and ``response_format``.
Its chat completion (or each streamed chunk of it) becomes a ``response`` object (or the
Responses stream's typed events), so tools, structured outputs and sampling behave exactly
as on ``/v1/chat/completions``. ``store`` and ``previous_response_id``: gateway/response_store.py.
Any input or tool this server cannot run is refused.
"""
from __future__ import annotations

import time
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from gateway.openai_protocol import ChatCompletionBody, Float, Int, Text, lone_surrogate_error
from kvserve.errors import InvalidArgument

MESSAGE_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
TEXT_PARTS = ("input_text", "output_text", "text")
# What clients send that changes nothing here at these values.
NEUTRAL = {"reasoning": (None,), "background": (None, False), "service_tier": (None, "auto", "default"),
           "max_tool_calls": (None,), "prompt": (None,), "conversation": (None,)}
# ``include`` values this server can add to a response.
TEXT_LOGPROBS = "message.output_text.logprobs"


class ResponsesBody(BaseModel):
    # Unknown fields are a 400 naming them, never dropped (as on the other routes).
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: Text | None = None
    input: Text | list[Any]
    instructions: Text | None = None
    max_output_tokens: Int | None = None
    temperature: Float | None = None
    top_p: Float | None = None
    stream: bool = False
    tools: list[Any] | None = None
    tool_choice: Text | dict | None = None
    parallel_tool_calls: bool | None = None
    text: dict | None = None
    user: Text | None = None
    safety_identifier: Text | None = None
    prompt_cache_key: Text | None = None  # a hint for OpenAI's cache routing; kvserve's cache needs none
    metadata: dict[str, Text] | None = None
    store: bool | None = None
    previous_response_id: Text | None = None
    reasoning: dict | None = None
    include: list[Text] | None = None
    truncation: Text | None = None
    background: bool | None = None
    service_tier: Text | None = None
    top_logprobs: Int | None = None
    max_tool_calls: Int | None = None
    prompt: dict | None = None
    conversation: Any = None

    def chat_body(self, previous: list[dict] = ()) -> ChatCompletionBody:
        """The chat completion this request asks for, going on from the ``previous`` conversation's
        messages (its ``previous_response_id``'s); InvalidArgument naming what cannot be one."""
        for name, allowed in NEUTRAL.items():
            if getattr(self, name) not in allowed:
                raise InvalidArgument(f"{name}: not supported by this server at {getattr(self, name)!r}")
        if self.truncation not in (None, "disabled", "auto"):
            raise InvalidArgument(f"truncation: disabled or auto, got {self.truncation!r}")
        unknown = next((value for value in self.include or () if value != TEXT_LOGPROBS), None)
        if unknown is not None:
            raise InvalidArgument(f"include: {unknown!r} is not supported (only {TEXT_LOGPROBS!r})")
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        messages = system + list(previous) + self.turn_messages()
        chat: dict[str, Any] = {"model": self.model, "messages": messages, "stream": self.stream,
                                "max_completion_tokens": self.max_output_tokens, "temperature": self.temperature,
                                "top_p": self.top_p, "user": self.user or self.safety_identifier}
        if self.wants_logprobs:
            chat["logprobs"], chat["top_logprobs"] = True, self.top_logprobs or 0
        if self.tools is not None:
            chat["tools"] = [_chat_tool(i, tool) for i, tool in enumerate(self.tools)]
        if self.tool_choice is not None:
            chat["tool_choice"] = _chat_tool_choice(self.tool_choice)
        if self.parallel_tool_calls is not None:
            chat["parallel_tool_calls"] = self.parallel_tool_calls
        response_format = _response_format(self.text)
        if response_format is not None:
            chat["response_format"] = response_format
        try:
            return ChatCompletionBody.model_validate({k: v for k, v in chat.items() if v is not None})
        except ValidationError as exc:
            error = exc.errors()[0]
            where = ".".join(str(p) for p in error.get("loc", ()))
            raise InvalidArgument(f"{where}: {error.get('msg', 'invalid')}") from None

    @property
    def wants_logprobs(self) -> bool:
        """Each output token's log-probability (``output_text.logprobs``): asked with ``include`` or
        ``top_logprobs``."""
        return TEXT_LOGPROBS in (self.include or ()) or self.top_logprobs is not None

    def input_items(self) -> list[dict]:
        """The input as items (a string is one user message)."""
        if isinstance(self.input, str):
            return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": self.input}]}]
        return self.input

    def stored_input_items(self) -> list[dict]:
        """The input items as a stored response lists them: each with an id (one made up where the
        client sent none), a message's type and a string content as a text part."""
        stored = []
        for item in self.input_items():
            kind = item.get("type", "message")
            item = {"id": f"{ITEM_ID_PREFIXES.get(kind, 'item')}_{uuid.uuid4().hex}", "type": kind, **item}
            if kind == "message" and isinstance(item.get("content"), str):
                part = "output_text" if item.get("role") == "assistant" else "input_text"
                item["content"] = [{"type": part, "text": item["content"]}]
            stored.append(item)
        return stored

    def turn_messages(self) -> list[dict]:
        """This request's input as chat messages (the instructions apart)."""
        if self.input == []:
            raise InvalidArgument("input: at least one item is needed")
        return messages_of(self.input_items(), "input")


def messages_of(items: list[Any], where: str) -> list[dict]:
    """Items (a request's input, or a response's output) as the chat messages they stand for."""
    messages: list[dict] = []
    for i, item in enumerate(items):
        at = f"{where}[{i}]"
        if not isinstance(item, dict):
            raise InvalidArgument(f"{at}: must be an object, got {type(item).__name__}")
        kind = item.get("type", "message")
        convert = ITEM_CONVERTERS.get(kind)
        if convert is None:
            raise InvalidArgument(f"{at}.type: {kind!r} is not supported ({', '.join(ITEM_CONVERTERS)} items are)")
        convert(at, item, messages)
    return messages


def droppable_turns(roles: list[str]) -> tuple[int, list[int]]:
    """For ``truncation: auto``: where the leading system messages end, and where each turn after
    them starts (a tool result belongs to the turn of the call it answers), oldest first."""
    lead = 0
    while lead < len(roles) and roles[lead] == "system":
        lead += 1
    return lead, [i for i in range(lead, len(roles)) if i == lead or roles[i] != "tool"]


def _message(where: str, item: dict, messages: list[dict]) -> None:
    _only(where, item, ("type", "role", "content", "id", "status"))
    role = MESSAGE_ROLES.get(item.get("role"))
    if role is None:
        raise InvalidArgument(f"{where}.role: must be one of {', '.join(MESSAGE_ROLES)}")
    messages.append({"role": role, "content": _text(f"{where}.content", item.get("content"))})


def _function_call(where: str, item: dict, messages: list[dict]) -> None:
    """An earlier call: the assistant's tool call (consecutive ones are one turn's parallel calls)."""
    _only(where, item, ("type", "call_id", "name", "arguments", "id", "status"))
    call = {"id": _string(where, item, "call_id"), "type": "function",
            "function": {"name": _string(where, item, "name"), "arguments": _string(where, item, "arguments")}}
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
        last["tool_calls"].append(call)
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _function_call_output(where: str, item: dict, messages: list[dict]) -> None:
    _only(where, item, ("type", "call_id", "output", "id", "status"))
    messages.append({"role": "tool", "tool_call_id": _string(where, item, "call_id"),
                     "content": _text(f"{where}.output", item.get("output"))})


ITEM_CONVERTERS = {"message": _message, "function_call": _function_call, "function_call_output": _function_call_output}
ITEM_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}


def _only(where: str, item: dict, allowed: tuple[str, ...]) -> None:
    extra = next((key for key in item if key not in allowed), None)
    if extra is not None:
        raise InvalidArgument(f"{where}.{extra}: not supported by this server")


def _string(where: str, item: dict, key: str) -> str:
    return _checked(f"{where}.{key}", item.get(key))


def _checked(where: str, value: Any) -> str:
    if not isinstance(value, str):
        raise InvalidArgument(f"{where}: must be a string")
    error = lone_surrogate_error(value)
    if error:
        raise InvalidArgument(f"{where}: {error}")
    return value


def _text(where: str, content: Any) -> str:
    """A string, or text content parts joined."""
    if isinstance(content, str):
        return _checked(where, content)
    if not isinstance(content, list):
        raise InvalidArgument(f"{where}: must be a string or a list of content parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS:
            raise InvalidArgument(f"{where}[{j}].type: {kind!r} is not supported (this server takes text parts: "
                                  f"{', '.join(TEXT_PARTS)})")
        texts.append(_string(f"{where}[{j}]", part, "text"))
    return "".join(texts)


def _chat_tool(index: int, tool: Any) -> dict:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
        raise InvalidArgument(f"tools[{index}].type: {kind!r} is not supported (function tools are)")
    _only(f"tools[{index}]", tool, ("type", "name", "description", "parameters", "strict"))
    function = {key: tool[key] for key in ("name", "description", "parameters", "strict") if key in tool}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: str | dict) -> str | dict:
    if isinstance(choice, str):
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise InvalidArgument("tool_choice: none, auto, required or {\"type\": \"function\", \"name\": ...}")
    return {"type": "function", "function": {"name": choice["name"]}}


def _item_status(finish_reason: str | None) -> str:
    """An output item's status: ``incomplete`` where max_output_tokens cut the answer off."""
    return "incomplete" if finish_reason == "length" else "completed"


def _response_format(text: dict | None) -> dict | None:
    if text is None:
        return None
    _only("text", text, ("format", "verbosity"))
    if text.get("verbosity") not in (None, "medium"):
        raise InvalidArgument(f"text.verbosity: not supported by this server at {text['verbosity']!r}")
    fmt = text.get("format")
    if fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text"):
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("json_object", "json_schema"):
        raise InvalidArgument("text.format.type: text, json_object or json_schema")
    if fmt["type"] == "json_object":
        return {"type": "json_object"}
    _only("text.format", fmt, ("type", "name", "schema", "strict", "description"))
    return {"type": "json_schema", "json_schema": {key: fmt[key] for key in ("name", "schema", "strict", "description")
                                                   if key in fmt}}


class ResponseWriter:
    """Builds one response object, whole or as the Responses stream's events, from the chat path's
    completion (``complete``) or its chunks (``start``, ``chunk``, ``finish``)."""

    def __init__(self, body: ResponsesBody, model: str, stored: bool = False):
        self.body = body
        self.stored = stored
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self.model = model
        self.output: list[dict] = []
        self._sequence = 0
        self._message: dict | None = None  # the message item being streamed
        self._held_logprobs: list[dict] = []  # of tokens whose text the chat path holds back (a possible call)

    def response(self, status: str = "in_progress", usage: dict | None = None, incomplete: str | None = None) -> dict:
        body = self.body
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "model": self.model, "output": self.output, "error": None,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "temperature": body.temperature, "top_p": body.top_p, "tools": body.tools or [],
            "tool_choice": body.tool_choice or ("auto" if body.tools else "none"),
            "parallel_tool_calls": body.parallel_tool_calls is not False, "text": body.text or {"format": {"type": "text"}},
            "previous_response_id": body.previous_response_id, "store": self.stored,
            "truncation": body.truncation or "disabled",
            "user": body.user,
            "metadata": body.metadata or {}, "usage": usage,
        }

    # --- whole ---------------------------------------------------------------------

    def complete(self, completion: dict) -> dict:
        """The response for a chat.completion object."""
        choice = completion["choices"][0]
        message, status = choice["message"], _item_status(choice["finish_reason"])
        for call in message.get("tool_calls") or ():
            self.output.append(self._call_item(call, status))
        if not message.get("tool_calls"):
            item = self._message_item(message.get("content") or "", status)
            item["content"][0]["logprobs"] = (choice.get("logprobs") or {}).get("content") or []
            self.output.append(item)
        return self._final(choice["finish_reason"], completion["usage"])

    # --- streamed --------------------------------------------------------------------

    def start(self) -> list[dict]:
        return [self._event("response.created", response=self.response()),
                self._event("response.in_progress", response=self.response())]

    def chunk(self, chunk: dict) -> list[dict]:
        """Events for one chat.completion.chunk."""
        choice = chunk["choices"][0]
        delta = choice["delta"]
        events = []
        self._held_logprobs += (choice.get("logprobs") or {}).get("content") or []
        if delta.get("content"):
            events += self._open_message()
            part = self._message["content"][0]
            logprobs, self._held_logprobs = self._held_logprobs, []
            part["text"] += delta["content"]
            part["logprobs"] += logprobs
            events.append(self._event("response.output_text.delta", item_id=self._message["id"],
                                      output_index=self.output.index(self._message), content_index=0,
                                      delta=delta["content"], logprobs=logprobs))
        for call in delta.get("tool_calls") or ():
            item = self._call_item(call, _item_status(choice["finish_reason"]))
            index = len(self.output)
            self.output.append(item)
            arguments = item["arguments"]
            events += [self._event("response.output_item.added", output_index=index,
                                   item={**item, "arguments": "", "status": "in_progress"}),
                       self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                                   delta=arguments),
                       self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                   name=item["name"], arguments=arguments),
                       self._event("response.output_item.done", output_index=index, item=item)]
        return events

    def finish(self, finish_reason: str | None, usage: dict) -> list[dict]:
        events = []
        if not self.output:  # an empty answer is an empty message
            events += self._open_message()
        if self._message is not None:
            item, index = self._message, self.output.index(self._message)
            part = item["content"][0]
            item["status"] = _item_status(finish_reason)
            events += [self._event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                                   text=part["text"], logprobs=part["logprobs"]),
                       self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                   content_index=0, part=part),
                       self._event("response.output_item.done", output_index=index, item=item)]
        final = self._final(finish_reason, usage)
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        return events + [self._event(kind, response=final)]

    def error(self, message: str, code: str) -> dict:
        return self._event("error", code=code, message=message, param=None)

    # --- pieces ------------------------------------------------------------------------

    def _event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    def _open_message(self) -> list[dict]:
        if self._message is not None:
            return []
        self._message = self._message_item("", "in_progress")
        index = len(self.output)
        self.output.append(self._message)
        return [self._event("response.output_item.added", output_index=index,
                            item={**self._message, "content": []}),
                self._event("response.content_part.added", item_id=self._message["id"], output_index=index,
                            content_index=0, part=dict(self._message["content"][0]))]

    @staticmethod
    def _message_item(text: str, status: str) -> dict:
        return {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}

    @staticmethod
    def _call_item(call: dict, status: str) -> dict:
        return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call["id"],
                "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": status}

    def _final(self, finish_reason: str | None, usage: dict) -> dict:
        details = usage.get("prompt_tokens_details") or {}
        totals = {"input_tokens": usage["prompt_tokens"],
                  "input_tokens_details": {"cached_tokens": details.get("cached_tokens", 0)},
                  "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": usage["total_tokens"]}
        if finish_reason == "length":
            return self.response("incomplete", totals, "max_output_tokens")
        return self.response("completed", totals)
