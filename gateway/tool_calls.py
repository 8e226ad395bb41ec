"""Tool calls (OpenAI ``tools`` / ``tool_choice``) in one model-independent format.

The tools are described to the model in a system message, and a call is the whole answer as
one JSON object: ``{"tool_calls": [{"name": ..., "arguments": {...}}]}``. ``required`` and a
named function are enforced by a JSON-schema grammar (gateway.constraints), so their output
always parses unless ``max_tokens`` cuts it off; with ``auto`` the model chooses, and an answer in
that shape naming a listed function becomes ``message.tool_calls``. A call cut off by
``max_tokens`` is still a call, as OpenAI answers one: its arguments are the text that came, not
yet a JSON object (``calls_in``). Earlier calls (assistant ``tool_calls``) are rendered
back in the same shape and results arrive as ``role: tool`` messages, so multi-turn tool use
reads as one consistent format to the model.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from gateway.constraints import ConstraintSpec
from kvserve.errors import InvalidArgument

MAX_TOOLS = 128
# Most calls in one answer under ``required`` with parallel calls: bounded, so that a model that
# repeats itself still closes the array and the answer parses.
MAX_PARALLEL_CALLS = 8
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
CALL_PREFIX = "{"
# How an answer of calls begins, and how each call begins up to its arguments: the grammar keeps
# the schema's key order, so a call's name comes before its arguments.
_CALLS_START = re.compile(r'\s*\{\s*"tool_calls"\s*:\s*\[\s*')
_CALL_NAME = re.compile(r'\{\s*"name"\s*:\s*"([A-Za-z0-9_-]{1,64})"')
_ARGUMENTS_KEY = re.compile(r'\s*,\s*"arguments"\s*:\s*')


@dataclass(frozen=True)
class ToolFunction:
    name: str
    description: str
    parameters: dict


@dataclass(frozen=True)
class ToolCalling:
    """A request's tools and how it lets the model use them."""

    functions: tuple[ToolFunction, ...]
    choice: str  # "auto" or "required" (a named function is "required" with one function)
    parallel: bool = True

    @classmethod
    def parse(cls, tools, tool_choice, parallel_tool_calls) -> ToolCalling | None:
        """None when the request has no tools or ``tool_choice`` is ``none``; InvalidArgument
        naming the bad part otherwise."""
        if tools is None:
            if tool_choice not in (None, "none"):
                raise InvalidArgument("tool_choice: set without tools")
            return None
        if not isinstance(tools, list):
            raise InvalidArgument("tools: must be a list")
        if len(tools) > MAX_TOOLS:
            raise InvalidArgument(f"tools: at most {MAX_TOOLS}, got {len(tools)}")
        functions = tuple(_function(i, tool) for i, tool in enumerate(tools))
        names = [f.name for f in functions]
        if len(set(names)) != len(names):
            raise InvalidArgument("tools: function names must be distinct")
        parallel = True if parallel_tool_calls is None else bool(parallel_tool_calls)
        choice = "auto" if tool_choice is None else tool_choice
        if not functions:
            if choice in ("auto", "none"):
                return None
            raise InvalidArgument("tool_choice: needs at least one tool")
        if choice == "none":
            return None
        if choice in ("auto", "required"):
            return cls(functions, choice, parallel)
        if isinstance(choice, dict):
            function = choice.get("function")
            name = function.get("name") if isinstance(function, dict) else None
            if choice.get("type") != "function" or not isinstance(name, str):
                raise InvalidArgument('tool_choice: expected "none", "auto", "required" or '
                                      '{"type": "function", "function": {"name": ...}}')
            chosen = next((f for f in functions if f.name == name), None)
            if chosen is None:
                raise InvalidArgument(f"tool_choice: no tool named {name!r} (tools: {', '.join(names)})")
            return cls((chosen,), "required", False)
        raise InvalidArgument(f'tool_choice: expected "none", "auto", "required" or a function, got {choice!r}')

    def system_prompt(self) -> str:
        if self.choice == "required" and len(self.functions) == 1:
            rule = f"You must call the function {self.functions[0].name}: answer with only this JSON:"
        elif self.choice == "required":
            rule = "You must call one or more of these functions: answer with only this JSON:"
        else:
            rule = ("You can call these functions. To call one or more, answer with only this JSON and "
                    "nothing else; otherwise answer normally:")
        specs = [{"name": f.name, "description": f.description, "parameters": f.parameters}
                 for f in self.functions]
        return (f'{rule}\n{{"tool_calls": [{{"name": "<function name>", "arguments": {{<arguments>}}}}]}}\n'
                f"Functions (arguments as JSON Schema):\n{json.dumps(specs, ensure_ascii=False)}")

    def constraint(self) -> ConstraintSpec | None:
        """The grammar that makes ``required`` (and a named function) always parse."""
        if self.choice != "required":
            return None
        calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                  "properties": {"name": {"const": f.name}, "arguments": f.parameters}} for f in self.functions]
        items = calls[0] if len(calls) == 1 else {"anyOf": calls}
        array = {"type": "array", "items": items, "minItems": 1,
                 "maxItems": MAX_PARALLEL_CALLS if self.parallel else 1}
        return ConstraintSpec.json_schema({"type": "object", "additionalProperties": False,
                                           "required": ["tool_calls"], "properties": {"tool_calls": array}},
                                          ).named("tools (their parameters)")

    def calls_in(self, text: str, finish_reason: str | None) -> list[dict] | None:
        """The OpenAI ``tool_calls`` of a finished answer: a whole one (``stop``) that is a call of
        these tools, or one ``max_tokens`` cut off (``length``) inside a call; else None."""
        if finish_reason == "stop":
            return self.parse_calls(text)
        if finish_reason == "length":
            return self.parse_cut_calls(text)
        return None

    def parse_calls(self, text: str) -> list[dict] | None:
        """The OpenAI ``tool_calls`` in ``text``, or None when it is not a call of these tools."""
        try:
            value = json.loads(text)
        except ValueError:
            return None
        calls = value.get("tool_calls") if isinstance(value, dict) else None
        if not isinstance(calls, list) or not calls:
            return None
        out = [self._openai_call(call) for call in calls]
        return None if None in out else out

    def parse_cut_calls(self, text: str) -> list[dict] | None:
        """The calls of an answer cut off before its end: each whole call, then the cut one (its
        name whole) with the text of its arguments as far as it came. None when the text is not
        the beginning of calls of these tools, or is cut before the first call's name ends."""
        start = _CALLS_START.match(text)
        if start is None:
            return None
        decoder, position, calls = json.JSONDecoder(), start.end(), []
        while position < len(text) and text[position] == "{":
            try:
                call, position = decoder.raw_decode(text, position)
            except ValueError:
                cut = self._cut_call(text[position:])
                return calls + [cut] if cut else calls or None
            calls.append(self._openai_call(call))
            if None in calls:
                return None
            position = _skip_separator(text, position)
        return calls or None

    def _cut_call(self, text: str) -> dict | None:
        """The call an answer ends inside, its name whole: arguments as far as they came ("" if
        none yet). None when its name is not whole or not one of these tools'."""
        name = _CALL_NAME.match(text)
        if name is None or name.group(1) not in self._names():
            return None
        rest = text[name.end():]
        key = _ARGUMENTS_KEY.match(rest)
        if key is not None:
            return self._call_record(name.group(1), rest[key.end():])
        return self._call_record(name.group(1), "") if ',"arguments":'.startswith("".join(rest.split())) else None

    def _names(self) -> set[str]:
        return {f.name for f in self.functions}

    def _openai_call(self, call) -> dict | None:
        """A whole call of the answer as an OpenAI tool call; None when it is not one of these tools'."""
        if not (isinstance(call, dict) and call.get("name") in self._names() and isinstance(call.get("arguments"), dict)):
            return None
        return self._call_record(call["name"], json.dumps(call["arguments"], ensure_ascii=False))

    @staticmethod
    def _call_record(name: str, arguments: str) -> dict:
        return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": name, "arguments": arguments}}

    def may_be_call(self, text: str) -> bool:
        """Whether a choice whose text begins so may still turn out to be a call (streaming holds it)."""
        stripped = text.lstrip()
        return self.choice == "required" or not stripped or stripped.startswith(CALL_PREFIX)


def _skip_separator(text: str, position: int) -> int:
    """Past the whitespace and the comma after a call: where the next call would begin."""
    position = len(text) - len(text[position:].lstrip())
    if text.startswith(",", position):
        position = len(text) - len(text[position + 1:].lstrip())
    return position


def _function(index: int, tool) -> ToolFunction:
    where = f"tools[{index}]"
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise InvalidArgument(f'{where}: expected {{"type": "function", "function": {{"name": ...}}}}')
    function = tool["function"]
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise InvalidArgument(f"{where}.function.name: 1-64 letters, digits, '_' or '-', got {name!r}")
    description = function.get("description") or ""
    if not isinstance(description, str):
        raise InvalidArgument(f"{where}.function.description: must be a string")
    parameters = function.get("parameters")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise InvalidArgument(f"{where}.function.parameters: must be a JSON Schema object")
    return ToolFunction(name, description, parameters)


def render_tool_messages(messages: list[dict], calling: ToolCalling | None) -> list[dict]:
    """Messages for the chat template: the tools' system prompt first (joined to the client's
    own system message), earlier calls rendered in the call format."""
    out = []
    for message in messages:
        calls = message.pop("tool_calls", None)
        if calls:
            rendered = {"tool_calls": [{"name": c["function"]["name"], "arguments": _arguments(c)} for c in calls]}
            text = json.dumps(rendered, ensure_ascii=False)
            message["content"] = f"{message['content']}\n{text}" if message["content"] else text
        out.append(message)
    if calling is None:
        return out
    prompt = calling.system_prompt()
    if out and out[0]["role"] in ("system", "developer"):
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}" if out[0]["content"] else prompt}
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out


def _arguments(call: dict):
    arguments = call["function"]["arguments"]
    try:
        return json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        return arguments
