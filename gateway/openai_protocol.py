"""OpenAI-compatible request bodies and response shaping (JSON ⇄ domain), no I/O.

The bodies reject what cannot be served before anything else sees it: numbers
that are not finite, booleans where a number is expected, strings with lone
UTF-16 surrogates (JSON ``"\\ud800"``: not Unicode, so they can be neither
tokenized nor put in a protobuf string), and malformed prompts or chat content.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, field_validator

from gateway.detokenizer import ModelTokenizer
from gateway.sequence import ChoiceDelta, RequestOutput


def lone_surrogate_error(value: str) -> str | None:
    """Why ``value`` is not valid Unicode (a lone UTF-16 surrogate), or None when it is."""
    if value.isascii():
        return None
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        return (f"contains a lone UTF-16 surrogate (U+{ord(value[exc.start]):04X} at character {exc.start}); "
                f"strings must be valid Unicode")
    return None


def _unicode(value: str) -> str:
    error = lone_surrogate_error(value)
    if error:
        raise ValueError(error)
    return value


def _not_bool(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError(f"expected a number, got {str(value).lower()}")
    return value


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "boolean", int: "number", float: "number", str: "string", list: "array",
            dict: "object"}.get(type(value), type(value).__name__)


Text = Annotated[str, AfterValidator(_unicode)]
Int = Annotated[int, BeforeValidator(_not_bool)]
Float = Annotated[float, BeforeValidator(_not_bool)]


class StreamOptions(BaseModel):
    include_usage: bool = False


class _GenerationBody(BaseModel):
    # allow_inf_nan=False: NaN and ±Infinity (which Python's JSON parser accepts) are rejected.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: Text | None = None
    max_tokens: Int | None = None
    temperature: Float | None = None
    top_p: Float | None = None
    top_k: Int | None = None
    seed: Int | None = None
    stop: Text | list[Text] | None = None
    stop_token_ids: list[Int] | None = None
    n: Int | None = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: Int | None = 0
    user: Text | None = None
    cache_salt: Text | None = None
    skip_special_tokens: bool = True
    presence_penalty: Float | None = None
    frequency_penalty: Float | None = None
    repetition_penalty: Float | None = None

    def unsupported(self) -> str | None:
        """The first set parameter this server does not implement, if any."""
        for name, neutral in (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0)):
            value = getattr(self, name)
            if value is not None and value != neutral:
                return name
        return None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def _token_ids(value: list, where: str) -> list[int]:
    bad = next((i for i, t in enumerate(value) if type(t) is not int), None)
    if bad is not None:
        raise ValueError(f"{where}[{bad}]: token ids must be integers, got {_json_type(value[bad])}")
    return value


class CompletionBody(_GenerationBody):
    # str | list[str] | list[int] | list[list[int]], checked by hand for messages that say what is wrong
    prompt: Any
    logprobs: Int | None = None
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value: Any) -> str | list[str] | list[int] | list[list[int]]:
        if isinstance(value, str):
            return _unicode(value)
        if not isinstance(value, list):
            raise ValueError(f"must be a string, a list of strings, a list of token ids or a list of lists of "
                             f"token ids, got {_json_type(value)}")
        if not value:
            return value
        if isinstance(value[0], str):
            for i, item in enumerate(value):
                if not isinstance(item, str):
                    raise ValueError(f"[{i}]: a list of prompts must hold only strings, got {_json_type(item)}")
                error = lone_surrogate_error(item)
                if error:
                    raise ValueError(f"[{i}]: {error}")
            return value
        if isinstance(value[0], list):
            for i, item in enumerate(value):
                if not isinstance(item, list):
                    raise ValueError(f"[{i}]: a list of token-id prompts must hold only lists, got {_json_type(item)}")
                _token_ids(item, f"[{i}]")
            return value
        return _token_ids(value, "")


def _content(value: Any) -> str | list[dict] | None:
    if value is None:
        return None
    if isinstance(value, str):
        return _unicode(value)
    if not isinstance(value, list):
        raise ValueError(f"must be a string, a list of content parts or null, got {_json_type(value)}")
    for i, part in enumerate(value):
        if not isinstance(part, dict):
            raise ValueError(f"part {i}: expected an object like {{\"type\": \"text\", \"text\": \"...\"}}, "
                             f"got {_json_type(part)}")
        kind = part.get("type")
        if kind != "text":
            shown = repr(kind) if isinstance(kind, str) and not lone_surrogate_error(kind) else _json_type(kind)
            raise ValueError(f"part {i}: type {shown} is not supported (this server takes only \"text\" parts)")
        text = part.get("text")
        if not isinstance(text, str):
            raise ValueError(f"part {i}: \"text\" must be a string, got {_json_type(text)}")
        error = lone_surrogate_error(text)
        if error:
            raise ValueError(f"part {i}: text {error}")
    return value


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Text
    # a string, a list of {"type": "text", "text": ...} parts, or null
    content: Annotated[Any, AfterValidator(_content)] = None


class ChatCompletionBody(_GenerationBody):
    messages: list[ChatMessage]
    max_completion_tokens: Int | None = None
    logprobs: bool = False
    top_logprobs: Int | None = None
    add_generation_prompt: bool = True


def message_dicts(messages: list[ChatMessage]) -> list[dict]:
    """Messages for the chat template: content parts (all of type text, see ``_content``) are joined."""
    out = []
    for message in messages:
        content = message.content
        if isinstance(content, list):
            content = "".join(part["text"] for part in content)
        out.append({"role": message.role, "content": content or ""})
    return out


def usage_dict(output: RequestOutput) -> dict:
    return {
        "prompt_tokens": output.prompt_tokens,
        "completion_tokens": output.completion_tokens,
        "total_tokens": output.prompt_tokens + output.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": output.cached_tokens},
    }


def _finish(delta: ChoiceDelta) -> str | None:
    return delta.finish_reason.value if delta.finish_reason else None


@dataclass
class ChoiceAccumulator:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    def add(self, delta: ChoiceDelta) -> None:
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        self.logprobs.extend(delta.logprobs)
        self.top_logprobs.extend(delta.top_logprobs)
        if delta.finish_reason:
            self.finish_reason = delta.finish_reason.value
            self.stop_reason = delta.stop_reason


class ResponseFormatter:
    """Builds completion / chat.completion objects and their streamed chunks."""

    def __init__(self, kind: str, request_id: str, model: str, tokenizer: ModelTokenizer,
                 logprobs: bool, n: int):
        self.kind = kind  # "completion" or "chat"
        self.id = request_id
        self.model = model
        self.created = int(time.time())
        self.tokenizer = tokenizer
        self.logprobs = logprobs
        self._role_sent = [False] * n

    def _header(self, object_name: str) -> dict:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model}

    # --- logprobs ----------------------------------------------------------------

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _logprobs(self, token_ids, logprobs, top_logprobs, text_offset: int = 0):
        if not self.logprobs or not token_ids:
            return None
        if self.kind == "chat":
            content = []
            for token_id, lp, top in zip(token_ids, logprobs, top_logprobs):
                text = self._token_text(token_id)
                content.append({
                    "token": text, "logprob": lp, "bytes": list(text.encode()),
                    "top_logprobs": [{"token": self._token_text(t), "logprob": p,
                                      "bytes": list(self._token_text(t).encode())} for t, p in top],
                })
            return {"content": content}
        tokens = [self._token_text(t) for t in token_ids]
        offsets, offset = [], text_offset
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        return {"tokens": tokens, "token_logprobs": list(logprobs),
                "top_logprobs": [{self._token_text(t): p for t, p in top} for top in top_logprobs],
                "text_offset": offsets}

    # --- streaming -----------------------------------------------------------------

    def chunks(self, output: RequestOutput) -> list[dict]:
        out = []
        for delta in output.choices:
            lp = self._logprobs(delta.token_ids, delta.logprobs, delta.top_logprobs)
            if self.kind == "chat":
                message: dict = {}
                if not self._role_sent[delta.index]:
                    message["role"] = "assistant"
                    self._role_sent[delta.index] = True
                if delta.text or "role" in message:
                    message["content"] = delta.text
                choice = {"index": delta.index, "delta": message, "logprobs": lp,
                          "finish_reason": _finish(delta)}
                header = self._header("chat.completion.chunk")
            else:
                choice = {"index": delta.index, "text": delta.text, "logprobs": lp,
                          "finish_reason": _finish(delta)}
                header = self._header("text_completion")
            if delta.finish_reason:
                choice["stop_reason"] = delta.stop_reason
            out.append({**header, "choices": [choice]})
        return out

    def usage_chunk(self, output: RequestOutput) -> dict:
        name = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._header(name), "choices": [], "usage": usage_dict(output)}

    # --- whole responses -------------------------------------------------------------

    def response(self, choices: list[ChoiceAccumulator], last: RequestOutput) -> dict:
        body = []
        for index, choice in enumerate(choices):
            lp = self._logprobs(choice.token_ids, choice.logprobs, choice.top_logprobs)
            if self.kind == "chat":
                body.append({"index": index, "message": {"role": "assistant", "content": choice.text},
                             "logprobs": lp, "finish_reason": choice.finish_reason,
                             "stop_reason": choice.stop_reason})
            else:
                body.append({"index": index, "text": choice.text, "logprobs": lp,
                             "finish_reason": choice.finish_reason, "stop_reason": choice.stop_reason})
        name = "chat.completion" if self.kind == "chat" else "text_completion"
        return {**self._header(name), "choices": body, "usage": usage_dict(last)}
