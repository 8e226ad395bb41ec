"""Structured outputs: a request's constraint compiled once, and each choice's grammar state.

The gateway owns the text, so it runs the grammar (llguidance: a Rust matcher with no torch,
bounded compile and per-token work through its parser limits, masks computed with the GIL
released) and sends the executor, with each sampling step, the tokens the grammar allows
(``SamplingParams.allowed_token_bitmask``); the executor only masks the logits. Preemption,
migration and executor restarts change nothing here: the state follows the tokens the
gateway already holds.

``ConstraintSpec`` is what a request asks for (hashable: compiled grammars are cached by it),
``GrammarCompiler`` turns it into a ``CompiledGrammar`` off the event loop or raises
InvalidArgument saying why, and ``GrammarState`` is one choice's matcher.
"""
from __future__ import annotations

import asyncio
import json
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import llguidance
import numpy as np
from llguidance.gbnf_to_lark import GbnfToLarkError, any_to_lark

from kvserve.aio import wait_within
from kvserve.errors import InvalidArgument

# The longest schema, regex or grammar text accepted.
MAX_CONSTRAINT_CHARS = 64 * 1024
MAX_CHOICES = 1024
# A compile (including the first mask, which proves the constraint satisfiable) that takes
# longer is refused; llguidance's own limits (LIMITS) bound the work of each step.
COMPILE_TIMEOUT_S = 10.0
COMPILED_CACHE_SIZE = 256
COMPILE_THREADS = 2
# JSON as models write it ("a": 1, "b": 2), no free whitespace a small model can loop on.
JSON_OPTIONS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
LIMITS = llguidance.LLParserLimits(max_grammar_size=200_000, step_lexer_fuel=200_000, step_max_items=50_000)
KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class ConstraintSpec:
    """``kind``: one of KINDS; ``value``: the schema as canonical JSON text, the regex, the
    grammar, or the choices as a JSON list (empty for json_object)."""

    kind: str
    value: str = ""
    # Where the request gave it (named in errors); not part of what is cached.
    source: str = field(default="", compare=False)

    def named(self, source: str) -> ConstraintSpec:
        return replace(self, source=source)

    @property
    def where(self) -> str:
        return self.source or self.kind

    @classmethod
    def json_schema(cls, schema) -> ConstraintSpec:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise InvalidArgument(f"json schema: not valid JSON ({exc})") from None
        if not isinstance(schema, (dict, bool)):
            raise InvalidArgument(f"json schema: must be a JSON object, got {type(schema).__name__}")
        # Key order kept: a schema's property order is the order the output is generated in.
        return cls("json_schema", json.dumps(schema, separators=(",", ":")))

    @classmethod
    def choice(cls, choices) -> ConstraintSpec:
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
            raise InvalidArgument("choice: must be a non-empty list of strings")
        if len(choices) > MAX_CHOICES:
            raise InvalidArgument(f"choice: at most {MAX_CHOICES} choices, got {len(choices)}")
        if "" in choices:
            raise InvalidArgument("choice: an empty string cannot be generated")
        return cls("choice", json.dumps(choices))

    def grammar_text(self) -> str:
        """llguidance's grammar (its JSON form) for this constraint."""
        matcher = llguidance.LLMatcher
        if self.kind == "json_schema":
            return matcher.grammar_from_json_schema(self.value, defaults=JSON_OPTIONS)
        if self.kind == "json_object":
            return matcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if self.kind == "regex":
            return matcher.grammar_from_regex(self.value)
        if self.kind == "choice":
            alternatives = " | ".join(json.dumps(c) for c in json.loads(self.value))
            return matcher.grammar_from_lark(f"start: {alternatives}")
        if self.kind == "grammar":
            try:  # Lark as it is; GBNF (llama.cpp's grammars) converted
                return matcher.grammar_from_lark(any_to_lark(self.value))
            except GbnfToLarkError as exc:
                raise InvalidArgument(f"grammar: {exc}") from None
        raise InvalidArgument(f"constraint kind {self.kind!r}: expected one of {', '.join(KINDS)}")


class GrammarState:
    """One choice's position in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher):
        self._matcher = matcher

    def allowed_bitmask(self, vocab_size: int) -> bytes:
        """The tokens allowed next, as executor.proto's ``allowed_token_bitmask`` for a model of
        ``vocab_size`` tokens (bits past the tokenizer's vocabulary are 0)."""
        mask = self._matcher.compute_bitmask()
        size = -(-vocab_size // 8)
        if len(mask) >= size:
            return mask[:size]
        return mask + bytes(size - len(mask))

    def consume(self, token_id: int) -> bool:
        """False when the grammar does not allow ``token_id`` (an executor that ignored the mask)."""
        return self._matcher.consume_token(token_id)

    def is_finished(self) -> bool:
        """The output is complete: nothing but EOS may follow."""
        return self._matcher.is_stopped()

    def error(self) -> str:
        return self._matcher.get_error()


class CompiledGrammar:
    """A validated, satisfiable constraint; ``new_state`` starts a choice at its beginning."""

    def __init__(self, spec: ConstraintSpec, matcher: llguidance.LLMatcher):
        self.spec = spec
        self._initial = matcher

    def new_state(self) -> GrammarState:
        return GrammarState(self._initial.deep_copy())


class GrammarCompiler:
    """Compiles constraints for one tokenizer; results are cached by spec.

    ``tokenizer_json``: the model's tokenizer.json text; ``eos_token_ids``: what ends a
    sequence (allowed once the grammar accepts). The llguidance tokenizer (about half a
    second to build) is built on first use, off the event loop.
    """

    def __init__(self, tokenizer_json: str, eos_token_ids, vocab_size: int):
        self._tokenizer_json = tokenizer_json
        self._eos = sorted(eos_token_ids)
        self._vocab_size = vocab_size
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._tokenizer_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar")
        self._cache: OrderedDict[ConstraintSpec, CompiledGrammar] = OrderedDict()

    @classmethod
    def for_tokenizer(cls, model_tokenizer) -> GrammarCompiler:
        return cls(model_tokenizer.tokenizer.to_str(), model_tokenizer.eos_token_ids, model_tokenizer.vocab_size)

    def _lltokenizer(self) -> llguidance.LLTokenizer:
        with self._tokenizer_lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.LLTokenizer(self._tokenizer_json, n_vocab=self._vocab_size,
                                                         eos_token=self._eos or None)
            return self._tokenizer

    async def compile(self, spec: ConstraintSpec) -> CompiledGrammar:
        """The compiled constraint, or InvalidArgument saying why it cannot be served."""
        cached = self._cache.get(spec)
        if cached is not None:
            self._cache.move_to_end(spec)
            return cached
        if len(spec.value) > MAX_CONSTRAINT_CHARS:
            raise InvalidArgument(f"{spec.where}: at most {MAX_CONSTRAINT_CHARS} characters, got {len(spec.value)}")
        loop = asyncio.get_running_loop()
        try:
            compiled = await wait_within(loop.run_in_executor(self._pool, self.compile_now, spec),
                                          COMPILE_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise InvalidArgument(f"{spec.where}: did not compile within {COMPILE_TIMEOUT_S:g} s; "
                                  f"simplify it") from None
        self._cache[spec] = compiled
        while len(self._cache) > COMPILED_CACHE_SIZE:
            self._cache.popitem(last=False)
        return compiled

    def compile_now(self, spec: ConstraintSpec) -> CompiledGrammar:
        """``compile`` on the calling thread."""
        try:
            grammar = spec.grammar_text()
        except ValueError as exc:
            raise InvalidArgument(f"{spec.where}: {exc}") from None
        tokenizer = self._lltokenizer()
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer, limits=LIMITS)
        if failed:
            raise InvalidArgument(f"{spec.where}: {_first_line(messages[0])}")
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=LIMITS)
        if matcher.is_error():
            raise InvalidArgument(f"{spec.where}: {_first_line(matcher.get_error())}")
        probe = matcher.deep_copy()
        mask = np.frombuffer(probe.compute_bitmask(), dtype=np.uint8)
        if probe.is_error() or not mask.any():
            reason = _first_line(probe.get_error()) or "no text satisfies it"
            raise InvalidArgument(f"{spec.where}: cannot be satisfied ({reason})")
        return CompiledGrammar(spec, matcher)


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0] if message and message.strip() else ""
