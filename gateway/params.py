"""Validating generation parameters shared by the HTTP and gRPC front ends.

Whatever passes here must be servable: every number finite and in a range that
fits its wire field (executor.proto ``SamplingParams``: float temperature and
top_p, uint32 top_k and top_logprobs, uint64 seed, int32 suppressed ids), every
string valid Unicode, and nothing that makes the executor refuse a step (such as
a suppressed set covering the whole vocabulary) — a refused step would fail
every request batched with this one.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

from gateway.scheduler import RequestTooLarge
from gateway.sequence import SamplingOptions
from kvserve.errors import InvalidArgument

MAX_N = 128
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
# Largest temperature accepted (sampling is all but uniform long before this).
MAX_TEMPERATURE = 100.0
# A temperature in (0, MIN_TEMPERATURE) is greedy (as in vLLM): dividing float32 logits by a
# denormal temperature overflows to inf and the logprobs become NaN.
MIN_TEMPERATURE = 1e-5
# top_p in (0, MIN_TOP_P) keeps only the most likely token, exactly like MIN_TOP_P does as long as
# the vocabulary has at most 1/MIN_TOP_P tokens; raising it keeps float32 from rounding it to 0 (= off).
MIN_TOP_P = 1e-6
# top_k travels as uint32; anything at or above the vocabulary size means "all tokens" anyway.
MAX_TOP_K = (1 << 31) - 1
# stop_token_ids are checked against every sampled token and, until min_tokens, sent with every step.
MAX_STOP_TOKEN_IDS = 256
# Longer lists are refused before they are even deduplicated (no vocabulary is this large).
MAX_STOP_TOKEN_IDS_LISTED = 1 << 18
# cache_salt travels in every kvmanager Allocate entry of the request.
MAX_CACHE_SALT_CHARS = 256
# logit_bias travels with every sampling step (OpenAI allows 300 entries, values in [-100, 100]).
MAX_LOGIT_BIAS_ENTRIES = 300
MAX_LOGIT_BIAS = 100.0
MAX_PENALTY = 2.0  # presence and frequency, as in the OpenAI API
MAX_REPETITION_PENALTY = 100.0
# kv_cache_ttl_s: kvmanager takes at most a week (SequenceAllocation.cache_ttl_ms).
MAX_CACHE_TTL_S = 7 * 24 * 3600
CACHE_PRIORITIES = ("normal", "low")


def _finite(name: str, value) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        raise InvalidArgument(f"{name} must be a number, got {value!r}") from None
    if not math.isfinite(number):
        raise InvalidArgument(f"{name} must be a finite number, got {number}")
    return number


def _integer(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise InvalidArgument(f"{name} must be an integer, got {value!r}")
    return value


def _unicode(name: str, value: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidArgument(f"{name}: contains a lone UTF-16 surrogate (U+{ord(value[exc.start]):04X} at "
                              f"character {exc.start}); strings must be valid Unicode") from None
    return value


def build_options(*, max_tokens: int | None, temperature: float | None, top_p: float | None,
                  top_k: int | None, seed: int | None, stop: str | Iterable[str] | None,
                  stop_token_ids: Sequence[int] | None = None, ignore_eos: bool = False,
                  min_tokens: int | None = 0, n: int | None = 1, logprobs: int | None = None,
                  prompt_logprobs: int | None = None, prompt_only: bool = False,
                  enable_prefix_caching: bool = True, cache_salt: str = "",
                  skip_special_tokens: bool = True, default_temperature: float = 1.0,
                  presence_penalty: float | None = None, frequency_penalty: float | None = None,
                  repetition_penalty: float | None = None, logit_bias: Mapping | None = None,
                  min_p: float | None = None, constraint=None, tenant: str = "",
                  kv_shared_prefix_tokens: int | None = None, kv_cache_ttl_s: float | None = None,
                  kv_cache_priority: str | None = None,
                  predicted_token_ids: Sequence[int] | None = None) -> SamplingOptions:
    """Checks every value and returns the options; InvalidArgument names the bad field.

    ``top_p`` None means 1 (off); the gRPC front end passes None for its proto default 0.
    ``logit_bias``: token id (an int or its decimal string, as OpenAI's JSON keys) → bias.
    ``constraint``: a compiled structured-output constraint (gateway.constraints).
    ``prompt_logprobs``: report the prompt's log-probabilities with this many top alternatives;
    such a request computes its whole prompt, so it neither hits nor publishes cached blocks.
    ``prompt_only``: ``max_tokens`` may be 0 (completions' echo: the prompt, and its scores, alone).
    ``tenant``: already resolved and checked (gateway.tenants); the ``kv_*`` cache terms are
    checked here (``kv_shared_prefix_tokens`` against the prompt in ``validate_request``).
    ``predicted_token_ids``: OpenAI's ``prediction``, tokenized (drafts only; None: none sent).
    """
    if max_tokens is not None:
        max_tokens = _integer("max_tokens", max_tokens)
        if max_tokens < 0 or (max_tokens == 0 and not prompt_only):
            raise InvalidArgument(f"max_tokens must be > 0 (0 only with echo), got {max_tokens}")
        if max_tokens == 0 and n not in (None, 1):
            raise InvalidArgument("n: with max_tokens 0 every choice would be the prompt alone; ask for n 1")
    temperature = default_temperature if temperature is None else _finite("temperature", temperature)
    if not 0 <= temperature <= MAX_TEMPERATURE:
        raise InvalidArgument(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {temperature}")
    if temperature < MIN_TEMPERATURE:
        temperature = 0.0
    top_p = 1.0 if top_p is None else _finite("top_p", top_p)
    if not 0 < top_p <= 1:
        raise InvalidArgument(f"top_p must be in (0, 1], got {top_p}")
    top_p = max(top_p, MIN_TOP_P)
    top_k = 0 if top_k is None else _integer("top_k", top_k)
    top_k = 0 if top_k == -1 else top_k
    if not 0 <= top_k <= MAX_TOP_K:
        raise InvalidArgument(f"top_k must be in [0, {MAX_TOP_K}] (or -1 for off), got {top_k}")
    if seed is not None:
        seed = _integer("seed", seed)
        if not 0 <= seed < 1 << 64:
            raise InvalidArgument(f"seed must be in [0, 2**64), got {seed}")
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if len(stops) > 4 * MAX_STOP_STRINGS:
        raise InvalidArgument(f"stop: at most {MAX_STOP_STRINGS} strings, got {len(stops)}")
    if any(not isinstance(s, str) for s in stops):
        raise InvalidArgument("stop must be a string or a list of strings")
    stops = tuple(_unicode("stop", s) for s in stops if s)
    if len(stops) > MAX_STOP_STRINGS:
        raise InvalidArgument(f"stop: at most {MAX_STOP_STRINGS} strings, got {len(stops)}")
    stop_token_ids = stop_token_ids or ()
    if len(stop_token_ids) > MAX_STOP_TOKEN_IDS_LISTED:
        raise InvalidArgument(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} distinct ids, got a list of "
                              f"{len(stop_token_ids)}")
    stop_ids = tuple(sorted({_integer("stop_token_ids", t) for t in stop_token_ids}))
    n = 1 if n is None else _integer("n", n)
    if not 1 <= n <= MAX_N:
        raise InvalidArgument(f"n must be in [1, {MAX_N}], got {n}")
    min_tokens = _integer("min_tokens", min_tokens or 0)
    if min_tokens < 0:
        raise InvalidArgument(f"min_tokens must be >= 0, got {min_tokens}")
    if max_tokens is not None and min_tokens > max_tokens:
        raise InvalidArgument(f"min_tokens ({min_tokens}) must be <= max_tokens ({max_tokens})")
    if logprobs is not None:
        logprobs = _integer("logprobs", logprobs)
        if not 0 <= logprobs <= MAX_LOGPROBS:
            raise InvalidArgument(f"logprobs must be in [0, {MAX_LOGPROBS}], got {logprobs}")
    if prompt_logprobs is not None:
        prompt_logprobs = _integer("prompt_logprobs", prompt_logprobs)
        if not 0 <= prompt_logprobs <= MAX_LOGPROBS:
            raise InvalidArgument(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {prompt_logprobs}")
        enable_prefix_caching = False
    cache_salt = cache_salt or ""
    if len(cache_salt) > MAX_CACHE_SALT_CHARS:
        raise InvalidArgument(f"cache_salt: at most {MAX_CACHE_SALT_CHARS} characters, got {len(cache_salt)}")
    cache_salt = _unicode("cache_salt", cache_salt)
    penalties = _penalties(presence_penalty, frequency_penalty, repetition_penalty)
    min_p = 0.0 if min_p is None else _finite("min_p", min_p)
    if not 0 <= min_p <= 1:
        raise InvalidArgument(f"min_p must be in [0, 1], got {min_p}")
    shared, ttl_ms, low = cache_terms(kv_shared_prefix_tokens, kv_cache_ttl_s, kv_cache_priority)
    return SamplingOptions(
        tenant=tenant or "", num_shared_tokens=shared, cache_ttl_ms=ttl_ms, cache_priority_low=low,
        presence_penalty=penalties[0], frequency_penalty=penalties[1], repetition_penalty=penalties[2],
        logit_bias=_logit_bias(logit_bias), min_p=min_p, constraint=constraint,
        max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, stop=stops,
        stop_token_ids=stop_ids, ignore_eos=bool(ignore_eos), min_tokens=min_tokens, n=n, logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        enable_prefix_caching=enable_prefix_caching, cache_salt=cache_salt,
        skip_special_tokens=skip_special_tokens,
        predicted_token_ids=None if predicted_token_ids is None else tuple(predicted_token_ids),
    )


def cache_terms(shared_tokens, ttl_s, priority) -> tuple[int, int, bool]:
    """``kv_shared_prefix_tokens``, ``kv_cache_ttl_s``, ``kv_cache_priority`` → (tokens, ms, low)."""
    shared = 0
    if shared_tokens is not None:
        shared = _integer("kv_shared_prefix_tokens", shared_tokens)
        if shared < 0:
            raise InvalidArgument(f"kv_shared_prefix_tokens must be >= 0, got {shared}")
    ttl_ms = 0
    if ttl_s is not None:
        ttl = _finite("kv_cache_ttl_s", _integer_or_number(ttl_s, "kv_cache_ttl_s"))
        if not 0 < ttl <= MAX_CACHE_TTL_S:
            raise InvalidArgument(f"kv_cache_ttl_s must be > 0 and <= {MAX_CACHE_TTL_S} (a week), got {ttl:g}; "
                                  f"leave it out for no TTL")
        ttl_ms = max(1, round(ttl * 1000))
    if priority is None or priority == "":
        priority = "normal"
    if priority not in CACHE_PRIORITIES:
        shown = priority[:40] if isinstance(priority, str) else priority
        raise InvalidArgument(f"kv_cache_priority must be one of {', '.join(map(repr, CACHE_PRIORITIES))}, "
                              f"got {shown!r}")
    return shared, ttl_ms, priority == "low"


def _penalties(presence, frequency, repetition) -> tuple[float, float, float]:
    presence = 0.0 if presence is None else _finite("presence_penalty", presence)
    frequency = 0.0 if frequency is None else _finite("frequency_penalty", frequency)
    for name, value in (("presence_penalty", presence), ("frequency_penalty", frequency)):
        if not -MAX_PENALTY <= value <= MAX_PENALTY:
            raise InvalidArgument(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value}")
    repetition = 1.0 if repetition is None else _finite("repetition_penalty", repetition)
    if not 0 < repetition <= MAX_REPETITION_PENALTY:
        raise InvalidArgument(f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}] (1 = off), "
                              f"got {repetition}")
    return presence, frequency, repetition


def _logit_bias(bias: Mapping | None) -> tuple[tuple[int, float], ...]:
    if not bias:
        return ()
    if not isinstance(bias, Mapping):
        raise InvalidArgument("logit_bias must be an object mapping token ids to biases")
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidArgument(f"logit_bias: at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(bias)}")
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            token_id = key if isinstance(key, int) and not isinstance(key, bool) else int(str(key).strip())
        except ValueError:
            raise InvalidArgument(f"logit_bias: key {key!r} is not a token id") from None
        value = _finite(f"logit_bias[{key}]", _integer_or_number(value, f"logit_bias[{key}]"))
        if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise InvalidArgument(f"logit_bias[{key}] must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                                  f"got {value}")
        if token_id in out:
            raise InvalidArgument(f"logit_bias: token id {token_id} is given twice")
        out[token_id] = value
    return tuple(sorted(out.items()))


def _integer_or_number(value, name: str):
    if isinstance(value, bool):
        raise InvalidArgument(f"{name} must be a number, got {str(value).lower()}")
    return value


def validate_request(prompt: list[int], options: SamplingOptions, info, *, max_num_seqs: int,
                     kv_allocation: str, eos_token_ids: Iterable[int] | None = None) -> None:
    """Checks a request against the served model (``info``: executor Describe); fills in max_tokens.

    ``eos_token_ids``: the ids the engine will treat as EOS (default ``info.eos_token_ids``).
    """
    if not prompt:
        raise InvalidArgument("prompt: empty (at least one token is needed)")
    length, limit = len(prompt), info.max_model_len
    if length >= limit:  # before the per-token check: cheap, and bounds it
        raise InvalidArgument(f"prompt is too long: {length} tokens, but max_model_len is {limit} "
                              f"(prompt + output), leaving no room to generate")
    if min(prompt) < 0 or max(prompt) >= info.vocab_size:
        bad = next(t for t in prompt if t < 0 or t >= info.vocab_size)
        raise InvalidArgument(f"prompt: token id {bad} is outside [0, {info.vocab_size})")
    if options.max_tokens is None:
        options.max_tokens = limit - length
    elif length + options.max_tokens > limit:
        raise InvalidArgument(f"prompt ({length} tokens) + max_tokens ({options.max_tokens}) exceeds "
                              f"max_model_len {limit}")
    if options.min_tokens > options.max_tokens:
        raise InvalidArgument(f"min_tokens ({options.min_tokens}) exceeds max_tokens ({options.max_tokens}; "
                              f"at most max_model_len - prompt length)")
    if options.num_shared_tokens > length:
        raise InvalidArgument(f"kv_shared_prefix_tokens ({options.num_shared_tokens}) exceeds the prompt's "
                              f"{length} tokens")
    if options.n > max_num_seqs:
        raise InvalidArgument(f"n: {options.n} exceeds max_num_seqs {max_num_seqs}")
    if options.prompt_logprobs is not None and not info.returns_prompt_logprobs:
        raise InvalidArgument("prompt_logprobs: the executor does not return prompt log-probabilities "
                              "(its Describe lacks returns_prompt_logprobs)")
    usable = (info.num_blocks - 1) * info.block_size
    needed = limit if kv_allocation == "reserve" else length + 1
    if needed > usable:
        raise RequestTooLarge(f"request needs {needed} KV slots but the executor's cache has {usable} "
                              f"({info.num_blocks - 1} blocks of {info.block_size}); it can never fit")
    stop_ids = options.stop_token_ids
    if stop_ids and (stop_ids[0] < 0 or stop_ids[-1] >= info.vocab_size):
        bad = next(t for t in stop_ids if t < 0 or t >= info.vocab_size)
        raise InvalidArgument(f"stop_token_ids: {bad} is outside [0, {info.vocab_size})")
    if options.min_tokens > 0:
        # What gateway.stopping.suppressed_token_ids keeps from being sampled until min_tokens exist.
        eos = info.eos_token_ids if eos_token_ids is None else eos_token_ids
        suppressed = set(stop_ids) | {t for t in eos if 0 <= t < info.vocab_size}
        if len(suppressed) >= info.vocab_size:
            raise InvalidArgument(f"stop_token_ids: with the EOS ids they cover all {info.vocab_size} tokens of "
                                  f"the vocabulary, which min_tokens ({options.min_tokens}) keeps from being "
                                  f"sampled: nothing could be generated")
    bad_bias = next((t for t, _ in options.logit_bias if not 0 <= t < info.vocab_size), None)
    if bad_bias is not None:
        raise InvalidArgument(f"logit_bias: token id {bad_bias} is outside [0, {info.vocab_size})")
    if len(stop_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidArgument(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} distinct ids, got {len(stop_ids)}")
