"""Tokenizer, chat template and incremental detokenization for one model directory.

Incremental decoding follows the prefix/read-offset scheme of vLLM and TGI:
decode a short window that ends with the new tokens and a second window without
them; the difference is the new text. A window whose text ends in U+FFFD (half
a UTF-8 character) is held back until the character completes, so a stream
never shows a broken character; decoding with a few tokens of left context
keeps the leading space a token carries.
"""
from __future__ import annotations

import asyncio
import functools
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer, decoders

from gateway.sequence import TextDecoder
from kvserve.errors import InvalidArgument, StartupError

REPLACEMENT_CHAR = "\ufffd"
# A UTF-8 character is at most 4 bytes; byte-level tokens carry at least one.
MAX_PENDING_TOKENS = 4
# Left context kept before the tokens being decoded.
CONTEXT_TOKENS = 6
# Texts (and chat renderings) at least this long are tokenized on a worker thread: the
# tokenizers library releases the GIL, so a huge prompt does not stall every stream on the
# event loop. Shorter ones are quicker inline than the hop to a thread.
OFF_LOOP_CHARS = 16_384
OFF_LOOP_MESSAGES = 64
TOKENIZE_THREADS = 2
# Before tokenizing a text of more than PREFIX_CHARS_PER_TOKEN * max_model_len characters in
# full, its first that many characters are: a prefix that alone is well over max_model_len
# tokens proves the prompt too long at a fraction of the cost.
PREFIX_CHARS_PER_TOKEN = 16


class IncrementalDetokenizer(TextDecoder):
    """Turns one sequence's tokens into text deltas, one token at a time."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self._read_offset = len(self._ids)
        self._prefix_offset = max(0, self._read_offset - CONTEXT_TOKENS)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def append(self, token_id: int) -> str:
        self._ids.append(token_id)
        return self._emit(final=False)

    def flush(self) -> str:
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if self._read_offset == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        pending = len(self._ids) - self._read_offset
        if new_text.endswith(REPLACEMENT_CHAR) and pending < MAX_PENDING_TOKENS and not final:
            return ""
        if len(new_text) > len(prefix_text) and new_text.startswith(prefix_text):
            delta = new_text[len(prefix_text):]
        elif len(new_text) > len(prefix_text):
            # The context decoded differently with the new tokens (rare with merges):
            # trust the common prefix only.
            common = _common_prefix_len(prefix_text, new_text)
            delta = new_text[common:]
        else:
            delta = ""
        if delta:
            self._prefix_offset = self._read_offset
        else:  # nothing visible (a skipped special token): keep the context short
            self._prefix_offset = max(self._prefix_offset, len(self._ids) - CONTEXT_TOKENS)
        self._read_offset = len(self._ids)
        self._trim()
        return delta

    def _trim(self) -> None:
        """Keeps the window short: drop ids before the prefix offset."""
        if self._prefix_offset > 64:
            drop = self._prefix_offset
            self._ids = self._ids[drop:]
            self._prefix_offset -= drop
            self._read_offset -= drop


@functools.cache
def _byte_level_alphabet() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's): the printable character that stands for each byte
    in a token's vocabulary entry, inverted."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


def _common_prefix_len(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class ModelTokenizer:
    """The model directory's tokenizer.json, chat template and special tokens."""

    def __init__(self, model_dir: Path):
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.exists():
            raise StartupError(f"no tokenizer.json in model directory {model_dir}")
        self.tokenizer = Tokenizer.from_file(str(path))
        self._byte_level = isinstance(self.tokenizer.decoder, decoders.ByteLevel)  # token_bytes' rule
        self.model_dir = model_dir
        self._pool: ThreadPoolExecutor | None = None
        self._workers_lock = threading.Lock()
        config = _read_json(model_dir / "tokenizer_config.json")
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.chat_template = _load_chat_template(model_dir, config)
        self._template = None
        if self.chat_template:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_template_error
            self._template = env.from_string(self.chat_template)
        generation = _read_json(model_dir / "generation_config.json")
        eos = generation.get("eos_token_id", [])
        self.eos_token_ids = {eos} if isinstance(eos, int) else set(eos)
        if self.eos_token:
            token_id = self.tokenizer.token_to_id(self.eos_token)
            if token_id is not None:
                self.eos_token_ids.add(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token_id stands for (OpenAI's logprobs ``bytes``). A byte-level BPE token can be
        part of a UTF-8 character, whose decoded text is U+FFFD: its vocabulary entry spells the
        bytes themselves. Other tokenizers: the UTF-8 of the token's decoded text."""
        if self._byte_level:
            piece = self.tokenizer.id_to_token(token_id) or ""
            alphabet = _byte_level_alphabet()
            if all(char in alphabet for char in piece):
                return bytes(alphabet[char] for char in piece)
        return self.tokenizer.decode([token_id], skip_special_tokens=False).encode()

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    async def encode_async(self, text: str, add_special_tokens: bool = False,
                           max_model_len: int | None = None) -> list[int]:
        """``encode`` without blocking the event loop on long texts.

        With ``max_model_len``, a text whose prefix alone is far over it is refused
        (InvalidArgument) without tokenizing the rest.
        """
        if len(text) < OFF_LOOP_CHARS:
            return self.encode(text, add_special_tokens)
        if max_model_len and len(text) > PREFIX_CHARS_PER_TOKEN * max_model_len:
            prefix_chars = PREFIX_CHARS_PER_TOKEN * max_model_len
            count = len(await self._off_loop(self.encode, text[:prefix_chars], add_special_tokens))
            # Generous slack: a prefix ends mid-word, so its last few tokens may differ from the text's.
            if count >= 2 * max_model_len + 64:
                raise InvalidArgument(f"prompt is too long: its first {prefix_chars} characters alone are "
                                      f"{count} tokens, but max_model_len is {max_model_len}")
        return await self._off_loop(self.encode, text, add_special_tokens)

    async def chat_prompt_async(self, messages: list[dict], add_generation_prompt: bool = True,
                                max_model_len: int | None = None, continue_final_message: bool = False) -> list[int]:
        """The chat template's token ids, rendered and tokenized off the event loop when large."""
        size = sum(len(m.get("content") or "") for m in messages)
        if size < OFF_LOOP_CHARS and len(messages) < OFF_LOOP_MESSAGES:
            return self.encode(self.apply_chat_template(messages, add_generation_prompt, continue_final_message))
        text = await self._off_loop(self.apply_chat_template, messages, add_generation_prompt, continue_final_message)
        return await self.encode_async(text, False, max_model_len)

    async def _off_loop(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._workers(), functools.partial(fn, *args))

    def _workers(self) -> ThreadPoolExecutor:
        with self._workers_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(TOKENIZE_THREADS, thread_name_prefix="tokenize")
            return self._pool

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str:
        return self.tokenizer.id_to_token(token_id) or ""

    def detokenizer(self, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.tokenizer, prompt_token_ids, skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            continue_final_message: bool = False) -> str:
        """The rendered chat; with ``continue_final_message`` it ends inside the final message, so
        that the model goes on writing it (an answer's prefix given by the client)."""
        if self._template is None:
            raise InvalidArgument("this model has no chat template; use /v1/completions")
        if continue_final_message and add_generation_prompt:
            raise InvalidArgument("continue_final_message: needs add_generation_prompt: false (the final "
                                  "message goes on, no new turn starts)")
        try:
            rendered = self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "",
            )
        except jinja2.TemplateError as exc:
            raise InvalidArgument(f"messages: chat template failed: {exc}") from exc
        return _open_final_message(rendered, messages[-1]) if continue_final_message else rendered


def _open_final_message(rendered: str, final: dict) -> str:
    """``rendered`` cut just after the final message's content: what the template writes after it
    closes the turn."""
    content = final.get("content") or ""
    if not content.strip():
        raise InvalidArgument("continue_final_message: the final message has no content to continue")
    for text in (content, content.strip()):  # some templates trim a message's whitespace
        at = rendered.rfind(text)
        if at >= 0:
            return rendered[:at + len(text)]
    raise InvalidArgument("continue_final_message: the chat template does not render the final message's "
                          "content as it is given")


def _raise_template_error(message: str):
    raise jinja2.TemplateError(message)


def _read_json(path: Path) -> dict:
    if not path.exists():
        return {}
    return json.loads(path.read_text())


def _token_text(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


def _load_chat_template(model_dir: Path, tokenizer_config: dict) -> str | None:
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.exists():
        return jinja_file.read_text()
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # named templates: take "default"
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    return template
