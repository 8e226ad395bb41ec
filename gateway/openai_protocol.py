"""OpenAI-compatible request bodies and response shaping (JSON ⇄ domain), no I/O."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict

from gateway.detokenizer import ModelTokenizer
from gateway.sequence import ChoiceDelta, RequestOutput


class StreamOptions(BaseModel):
    include_usage: bool = False


class _GenerationBody(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int | None = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int | None = 0
    user: str | None = None
    cache_salt: str | None = None
    skip_special_tokens: bool = True
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None

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


class CompletionBody(_GenerationBody):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict] | None = None


class ChatCompletionBody(_GenerationBody):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True


def message_dicts(messages: list[ChatMessage]) -> list[dict]:
    """Messages for the chat template: content parts of type text are joined."""
    out = []
    for message in messages:
        content = message.content
        if isinstance(content, list):
            content = "".join(part.get("text", "") for part in content if part.get("type") == "text")
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
