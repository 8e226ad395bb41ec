"""vLLM's tokenizer routes: ``POST /tokenize``, ``POST /detokenize``, ``GET /tokenizer_info``.

Clients that count or build token ids with the server's own tokenizer call them (lm-evaluation-
harness's ``local-completions`` looks for them first and then needs no tokenizer of its own). They
use the tokenizer and chat template the completions routes use, so the ids they give are the ids a
prompt becomes there.
"""
from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict

from gateway.detokenizer import ModelTokenizer
from gateway.model_name import check_model_name
from gateway.openai_protocol import ChatMessage, Int, Text, message_dicts
from gateway.tool_calls import render_tool_messages
from kvserve.errors import InvalidArgument

tokenizer_router = APIRouter()


class TokenizeBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False


class DetokenizeBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: Text | None = None
    tokens: list[Int]


def _served(request: Request) -> tuple[ModelTokenizer, int]:
    """The tokenizer and the longest sequence of the served model."""
    return request.app.state.tokenizer, request.app.state.engine.max_model_len


@tokenizer_router.post("/tokenize")
async def tokenize(body: TokenizeBody, request: Request):
    tokenizer, max_model_len = _served(request)
    check_model_name(body.model, request.app.state.engine.model_name)
    if (body.prompt is None) == (body.messages is None):
        raise InvalidArgument("prompt: give a prompt or messages, one of them")
    if body.messages is not None:
        if not body.messages:
            raise InvalidArgument("messages: at least one message is needed")
        # Earlier tool calls rendered as the chat route renders them.
        messages = render_tool_messages(message_dicts(body.messages), None)
        tokens = await tokenizer.chat_prompt_async(messages, body.add_generation_prompt, max_model_len,
                                                   body.continue_final_message)
    else:
        tokens = await tokenizer.encode_async(body.prompt, body.add_special_tokens, max_model_len)
    return {"count": len(tokens), "max_model_len": max_model_len, "tokens": tokens,
            "token_strs": [tokenizer.id_to_token(t) for t in tokens] if body.return_token_strs else None}


@tokenizer_router.post("/detokenize")
async def detokenize(body: DetokenizeBody, request: Request):
    tokenizer, _ = _served(request)
    check_model_name(body.model, request.app.state.engine.model_name)
    vocab = tokenizer.vocab_size
    bad = next((i for i, t in enumerate(body.tokens) if not 0 <= t < vocab), None)
    if bad is not None:
        raise InvalidArgument(f"tokens[{bad}]: {body.tokens[bad]} is outside the vocabulary [0, {vocab})")
    return {"prompt": tokenizer.decode(body.tokens, skip_special_tokens=False)}


@tokenizer_router.get("/tokenizer_info")
async def tokenizer_info(request: Request):
    tokenizer, max_model_len = _served(request)
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tokenizer.bos_token,
            "eos_token": tokenizer.eos_token, "pad_token": None, "chat_template": tokenizer.chat_template,
            "model_max_length": max_model_len, "vocab_size": tokenizer.vocab_size}
