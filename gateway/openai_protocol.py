"""OpenAI-compatible request bodies and response shaping (JSON ⇄ domain), no I/O.

The bodies reject what cannot be served before anything else sees it: numbers
that are not finite, booleans where a number is expected, strings with lone
UTF-16 surrogates (JSON ``"\\ud800"``: not Unicode, so they can be neither
tokenized nor put in a protobuf string), and malformed prompts or chat content.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, field_validator

from gateway.constraints import ConstraintSpec
from gateway.detokenizer import ModelTokenizer
from gateway.sequence import ChoiceDelta, FinishReason, PromptTokenLogprob, RequestOutput
from gateway.tool_calls import ToolCalling
from kvserve.errors import InvalidArgument


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


class Prediction(BaseModel):
    """OpenAI's Predicted Outputs: ``{"type": "content", "content": text or text parts}``."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["content"]
    content: Annotated[Any, AfterValidator(_predicted_content)]

    def text(self) -> str:
        return content_text(self.content)


# Fields OpenAI clients send that change nothing here at these values; any other value is refused.
NEUTRAL_VALUES = {
    "store": (None, False),  # nothing is stored for distillation or evals
    "service_tier": (None, "auto", "default"),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "functions": (None, []),
    "function_call": (None, "none"),
}
STRUCTURED_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                     "structured_outputs")


class _GenerationBody(BaseModel):
    # allow_inf_nan=False: NaN and ±Infinity (which Python's JSON parser accepts) are rejected.
    # extra="forbid": a field this server does not implement is a 400 naming it, never dropped.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: Text | None = None
    max_tokens: Int | None = None
    temperature: Float | None = None
    top_p: Float | None = None
    top_k: Int | None = None
    min_p: Float | None = None
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
    # Cache terms (docs/gateway.md, Tenants): the leading prompt tokens every tenant may share,
    # the TTL of the blocks this request publishes, and "low" to have them evicted first.
    kv_shared_prefix_tokens: Int | None = None
    kv_cache_ttl_s: Float | None = None
    kv_cache_priority: Text | None = None
    skip_special_tokens: bool = True
    presence_penalty: Float | None = None
    frequency_penalty: Float | None = None
    repetition_penalty: Float | None = None
    logit_bias: dict[str, Float] | None = None
    # Structured outputs: OpenAI's response_format, and vLLM's guided_* and structured_outputs.
    response_format: dict | None = None
    guided_json: dict | Text | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None
    guided_decoding_backend: Text | None = None
    structured_outputs: dict | None = None
    metadata: dict[str, Text] | None = None  # kept by OpenAI only with store, which is off here
    store: bool | None = None
    service_tier: Text | None = None
    modalities: list[Text] | None = None
    audio: Any = None
    prediction: Prediction | None = None  # drafts for speculative decoding: gateway/prompt_lookup.py
    functions: Any = None
    function_call: Any = None

    def unsupported(self) -> str | None:
        """The first field set to a value this server does not implement, if any."""
        for name, allowed in NEUTRAL_VALUES.items():
            if name in type(self).model_fields and getattr(self, name) not in allowed:
                return name
        if self.guided_decoding_backend not in (None, "", "auto", "llguidance"):
            return "guided_decoding_backend"
        return None

    def constraint_spec(self) -> ConstraintSpec | None:
        """The structured-output constraint the body asks for (at most one way of asking)."""
        given = [name for name in STRUCTURED_FIELDS if getattr(self, name) is not None]
        specs = [spec for spec in (_structured(name, getattr(self, name)) for name in given) if spec is not None]
        if len(specs) > 1:
            raise InvalidArgument(f"{' and '.join(given)}: give one structured-output constraint, not several")
        return specs[0] if specs else None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def _structured(name: str, value: Any) -> ConstraintSpec | None:
    try:
        spec = _structured_spec(name, value)
    except InvalidArgument as exc:
        raise InvalidArgument(f"{name}: {exc}") from None
    return spec.named(name) if spec is not None else None


def _structured_spec(name: str, value: Any) -> ConstraintSpec | None:
    if name == "response_format":
        return _response_format(value)
    if name == "structured_outputs":
        return _structured_outputs(value)
    if name == "guided_json":
        return ConstraintSpec.json_schema(value)
    if name == "guided_choice":
        return ConstraintSpec.choice(value)
    return ConstraintSpec("regex" if name == "guided_regex" else "grammar", value)


def _response_format(value: dict) -> ConstraintSpec | None:
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return ConstraintSpec("json_object")
    if kind == "json_schema":
        inner = value.get("json_schema")
        if not isinstance(inner, dict) or "schema" not in inner:
            raise InvalidArgument('type json_schema needs "json_schema": {"name": ..., "schema": {...}}')
        return ConstraintSpec.json_schema(inner["schema"])
    raise InvalidArgument(f'type must be "text", "json_object" or "json_schema", got {kind!r}')


STRUCTURED_OUTPUT_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
                          "json_object": "json_object"}


def _structured_outputs(value: dict) -> ConstraintSpec | None:
    given = {k: v for k, v in value.items() if v is not None and v is not False}
    unknown = sorted(set(given) - set(STRUCTURED_OUTPUT_KEYS))
    if unknown:
        raise InvalidArgument(f"{unknown[0]}: not supported (one of {', '.join(STRUCTURED_OUTPUT_KEYS)})")
    if len(given) != 1:
        raise InvalidArgument(f"give exactly one of {', '.join(STRUCTURED_OUTPUT_KEYS)}")
    (key, item), = given.items()
    if key == "json":
        return ConstraintSpec.json_schema(item)
    if key == "choice":
        return ConstraintSpec.choice(item)
    if key == "json_object":
        return ConstraintSpec("json_object")
    if not isinstance(item, str):
        raise InvalidArgument(f"{key}: must be a string")
    return ConstraintSpec(STRUCTURED_OUTPUT_KEYS[key], item)


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


def content_text(content: str | list[dict] | None) -> str | None:
    """A content that ``_content`` accepted as its text: a string as it is, text parts joined."""
    return "".join(part["text"] for part in content) if isinstance(content, list) else content


def _predicted_content(value: Any) -> str | list[dict]:
    if value is None:
        raise ValueError("must be a string or a list of text parts")
    return _content(value)


def _tool_calls(value: Any) -> list[dict] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise ValueError(f"must be a list, got {_json_type(value)}")
    for i, call in enumerate(value):
        function = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(function, dict) and isinstance(function.get("name"), str)
                and isinstance(function.get("arguments"), (str, dict))):
            raise ValueError(f"[{i}]: expected {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                             f"\"arguments\": ...}}}}")
    return value


def _function_call(value: Any) -> dict | None:
    """The legacy form of one tool call on an assistant message: {"name": ..., "arguments": ...}."""
    if value is not None:
        _tool_calls([{"function": value}])
    return value


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Text
    # a string, a list of {"type": "text", "text": ...} parts, or null
    content: Annotated[Any, AfterValidator(_content)] = None
    name: Text | None = None
    tool_calls: Annotated[Any, AfterValidator(_tool_calls)] = None
    tool_call_id: Text | None = None
    # What a client echoes back from an earlier response: a refusal is the turn's text where it has
    # no content, a legacy function_call one more tool call; annotations and audio render nothing.
    refusal: Text | None = None
    annotations: list | None = None
    audio: dict | None = None
    function_call: Annotated[Any, AfterValidator(_function_call)] = None


class ChatCompletionBody(_GenerationBody):
    messages: list[ChatMessage]
    max_completion_tokens: Int | None = None
    logprobs: bool = False
    top_logprobs: Int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM's: the final (assistant) message is a prefix to go on from
    tools: list[dict] | None = None
    tool_choice: Text | dict | None = None
    parallel_tool_calls: bool | None = None
    # Share the rendered leading system message(s) with every tenant (kv_shared_prefix_tokens of them).
    kv_share_system_prompt: bool = False


def message_dicts(messages: list[ChatMessage]) -> list[dict]:
    """Messages for the chat template: content parts (all of type text, see ``_content``) are joined;
    ``name`` and ``tool_call_id`` go to the template as sent, for templates that render them (a
    participant's name, which call a tool result answers)."""
    out = []
    for message in messages:
        rendered = {"role": message.role, "content": content_text(message.content) or message.refusal or ""}
        calls = list(message.tool_calls or [])
        if message.function_call is not None:
            calls.append({"type": "function", "function": message.function_call})
        if calls:
            rendered["tool_calls"] = calls
        if message.name is not None:
            rendered["name"] = message.name
        if message.tool_call_id is not None:
            rendered["tool_call_id"] = message.tool_call_id
        out.append(rendered)
    return out


def usage_dict(output: RequestOutput) -> dict:
    usage = {
        "prompt_tokens": output.prompt_tokens,
        "completion_tokens": output.completion_tokens,
        "total_tokens": output.prompt_tokens + output.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": output.cached_tokens},
    }
    predicted = output.prediction_tokens
    if predicted is not None:
        usage["completion_tokens_details"] = {"accepted_prediction_tokens": predicted.accepted,
                                              "rejected_prediction_tokens": predicted.rejected}
    return usage


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
    prompt_logprobs: list[PromptTokenLogprob] | None = None  # echo's, from the choice's first delta

    def add(self, delta: ChoiceDelta) -> None:
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        self.logprobs.extend(delta.logprobs)
        self.top_logprobs.extend(delta.top_logprobs)
        if delta.finish_reason:
            self.finish_reason = delta.finish_reason.value
            self.stop_reason = delta.stop_reason


@dataclass(frozen=True)
class EchoedPrompt:
    """What completions' ``echo`` puts in front of each choice of one prompt: the prompt as the
    client sent it (its token ids decoded when it sent ids), and its token ids."""

    text: str
    token_ids: list[int]


# The lowest log-probability a response reports, as OpenAI's API and vLLM do: a token that a
# structured-output mask forbids has probability 0, whose log (-inf) JSON cannot carry.
MIN_REPORTED_LOGPROB = -9999.0


def reported_logprob(logprob: float | None) -> float | None:
    return None if logprob is None else max(logprob, MIN_REPORTED_LOGPROB)


class ResponseFormatter:
    """Builds completion / chat.completion objects and their streamed chunks."""

    def __init__(self, kind: str, request_id: str, model: str, tokenizer: ModelTokenizer,
                 logprobs: bool, n: int, tools: ToolCalling | None = None,
                 echo: list[EchoedPrompt] | None = None):
        self.kind = kind  # "completion" or "chat"
        # Completions' echo: per prompt (choice index // choices per prompt), what each choice starts with.
        self.echo = echo
        self._choices_per_prompt = n // len(echo) if echo else n
        self._echo_sent = [False] * n
        self.id = request_id
        self.model = model
        self.created = int(time.time())
        self.tokenizer = tokenizer
        self.logprobs = logprobs
        self.tools = tools
        self._role_sent = [False] * n
        # Streaming with tools: a choice's text is held while it may still be a call.
        self._held = [""] * n
        self._holding = [tools is not None] * n

    def _header(self, object_name: str) -> dict:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model}

    # --- logprobs ----------------------------------------------------------------

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _chat_logprob(self, token_id: int, logprob: float | None) -> dict:
        return {"token": self._token_text(token_id), "logprob": reported_logprob(logprob),
                "bytes": list(self.tokenizer.token_bytes(token_id))}

    def _logprobs(self, token_ids, logprobs, top_logprobs, text_offset: int = 0):
        if not self.logprobs or not token_ids:
            return None
        if self.kind == "chat":
            return {"content": [
                {**self._chat_logprob(token_id, lp), "top_logprobs": [self._chat_logprob(t, p) for t, p in top]}
                for token_id, lp, top in zip(token_ids, logprobs, top_logprobs)]}
        tokens = [self._token_text(t) for t in token_ids]
        offsets, offset = [], text_offset
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        return {"tokens": tokens, "token_logprobs": [reported_logprob(lp) for lp in logprobs],
                "top_logprobs": [None if top is None else {self._token_text(t): reported_logprob(p) for t, p in top}
                                 for top in top_logprobs],
                "text_offset": offsets}

    def _echoed(self, index: int, text: str, token_ids: list[int], logprobs: list, top_logprobs: list,
                prompt_logprobs: list[PromptTokenLogprob | None] | None):
        """A choice's first text and logprobs with the prompt in front (echo); unchanged otherwise."""
        if self.echo is None or self._echo_sent[index]:
            return text, token_ids, logprobs, top_logprobs
        self._echo_sent[index] = True
        prompt = self.echo[index // self._choices_per_prompt]
        scores = list(prompt_logprobs or [])
        scores += [None] * (len(prompt.token_ids) - 1 - len(scores))
        return (prompt.text + text, prompt.token_ids + token_ids,
                [None] + [s.logprob if s else None for s in scores] + logprobs,
                [None] + [s.top_logprobs if s else None for s in scores] + top_logprobs)

    # --- streaming -----------------------------------------------------------------

    def chunks(self, output: RequestOutput) -> list[dict]:
        out = []
        for delta in output.choices:
            text, token_ids, logprobs, top = self._echoed(delta.index, delta.text, delta.token_ids, delta.logprobs,
                                                          delta.top_logprobs, delta.prompt_logprobs)
            lp = self._logprobs(token_ids, logprobs, top)
            if self.kind == "chat":
                message: dict = {}
                if not self._role_sent[delta.index]:
                    message["role"] = "assistant"
                    self._role_sent[delta.index] = True
                text, calls = self._tool_filter(delta)
                if calls:
                    message["tool_calls"] = [{"index": k, **call} for k, call in enumerate(calls)]
                elif text or "role" in message:
                    message["content"] = text
                if not message and not delta.finish_reason and lp is None:
                    continue  # held back: nothing to say yet
                finish = "tool_calls" if calls and delta.finish_reason is FinishReason.STOP else _finish(delta)
                choice = {"index": delta.index, "delta": message, "logprobs": lp, "finish_reason": finish}
                header = self._header("chat.completion.chunk")
            else:
                choice = {"index": delta.index, "text": text, "logprobs": lp, "finish_reason": _finish(delta)}
                header = self._header("text_completion")
            if delta.finish_reason:
                choice["stop_reason"] = delta.stop_reason
            out.append({**header, "choices": [choice]})
        return out

    def _tool_filter(self, delta: ChoiceDelta) -> tuple[str, list[dict] | None]:
        """(content to stream now, tool calls) for one delta of a choice."""
        index = delta.index
        if not self._holding[index]:
            return delta.text, None
        self._held[index] += delta.text
        held = self._held[index]
        if delta.finish_reason is None and self.tools.may_be_call(held):
            return "", None
        self._holding[index] = False
        calls = self.tools.calls_in(held, _finish(delta))
        return ("", calls) if calls else (held, None)

    def usage_chunk(self, output: RequestOutput) -> dict:
        name = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._header(name), "choices": [], "usage": usage_dict(output)}

    # --- whole responses -------------------------------------------------------------

    def response(self, choices: list[ChoiceAccumulator], last: RequestOutput) -> dict:
        body = []
        for index, choice in enumerate(choices):
            text, token_ids, logprobs, top = self._echoed(index, choice.text, choice.token_ids, choice.logprobs,
                                                          choice.top_logprobs, choice.prompt_logprobs)
            lp = self._logprobs(token_ids, logprobs, top)
            if self.kind == "chat":
                message, finish = {"role": "assistant", "content": choice.text}, choice.finish_reason
                calls = self.tools.calls_in(choice.text, finish) if self.tools else None
                if calls:
                    message = {"role": "assistant", "content": None, "tool_calls": calls}
                    finish = "tool_calls" if finish == "stop" else finish
                body.append({"index": index, "message": message, "logprobs": lp, "finish_reason": finish,
                             "stop_reason": choice.stop_reason})
            else:
                body.append({"index": index, "text": text, "logprobs": lp,
                             "finish_reason": choice.finish_reason, "stop_reason": choice.stop_reason})
        name = "chat.completion" if self.kind == "chat" else "text_completion"
        return {**self._header(name), "choices": body, "usage": usage_dict(last)}
