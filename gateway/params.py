"""Validating generation parameters shared by the HTTP and gRPC front ends."""
from __future__ import annotations

from collections.abc import Iterable

from gateway.scheduler import RequestTooLarge
from gateway.sequence import SamplingOptions
from kvserve.errors import InvalidArgument

MAX_N = 128
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16


def build_options(*, max_tokens: int | None, temperature: float | None, top_p: float | None,
                  top_k: int | None, seed: int | None, stop: str | Iterable[str] | None,
                  stop_token_ids: Iterable[int] | None = None, ignore_eos: bool = False,
                  min_tokens: int | None = 0, n: int | None = 1, logprobs: int | None = None,
                  enable_prefix_caching: bool = True, cache_salt: str = "",
                  skip_special_tokens: bool = True, default_temperature: float = 1.0) -> SamplingOptions:
    """Checks every value and returns the options; InvalidArgument names the bad field."""
    if max_tokens is not None and max_tokens <= 0:
        raise InvalidArgument(f"max_tokens must be > 0, got {max_tokens}")
    temperature = default_temperature if temperature is None else float(temperature)
    if temperature < 0:
        raise InvalidArgument(f"temperature must be >= 0, got {temperature}")
    top_p = 1.0 if top_p is None or top_p == 0 else float(top_p)
    if not 0 < top_p <= 1:
        raise InvalidArgument(f"top_p must be in (0, 1], got {top_p}")
    top_k = 0 if top_k is None or top_k == -1 else int(top_k)
    if top_k < 0:
        raise InvalidArgument(f"top_k must be >= 0 (or -1 for off), got {top_k}")
    if seed is not None and not 0 <= int(seed) < 1 << 64:
        raise InvalidArgument(f"seed must be in [0, 2**64), got {seed}")
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if any(not isinstance(s, str) for s in stops):
        raise InvalidArgument("stop must be a string or a list of strings")
    stops = tuple(s for s in stops if s)
    if len(stops) > MAX_STOP_STRINGS:
        raise InvalidArgument(f"stop: at most {MAX_STOP_STRINGS} strings, got {len(stops)}")
    n = 1 if n is None else int(n)
    if not 1 <= n <= MAX_N:
        raise InvalidArgument(f"n must be in [1, {MAX_N}], got {n}")
    min_tokens = int(min_tokens or 0)
    if min_tokens < 0:
        raise InvalidArgument(f"min_tokens must be >= 0, got {min_tokens}")
    if max_tokens is not None and min_tokens > max_tokens:
        raise InvalidArgument(f"min_tokens ({min_tokens}) must be <= max_tokens ({max_tokens})")
    if logprobs is not None and not 0 <= int(logprobs) <= MAX_LOGPROBS:
        raise InvalidArgument(f"logprobs must be in [0, {MAX_LOGPROBS}], got {logprobs}")
    return SamplingOptions(
        max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
        seed=None if seed is None else int(seed), stop=stops,
        stop_token_ids=tuple(int(t) for t in (stop_token_ids or ())), ignore_eos=bool(ignore_eos),
        min_tokens=min_tokens, n=n, logprobs=None if logprobs is None else int(logprobs),
        enable_prefix_caching=enable_prefix_caching, cache_salt=cache_salt or "",
        skip_special_tokens=skip_special_tokens,
    )


def validate_request(prompt: list[int], options: SamplingOptions, info, *, max_num_seqs: int,
                     kv_allocation: str) -> None:
    """Checks a request against the served model (``info``: executor Describe); fills in max_tokens."""
    if not prompt:
        raise InvalidArgument("prompt: empty (at least one token is needed)")
    bad = next((t for t in prompt if t < 0 or t >= info.vocab_size), None)
    if bad is not None:
        raise InvalidArgument(f"prompt: token id {bad} is outside [0, {info.vocab_size})")
    length, limit = len(prompt), info.max_model_len
    if length >= limit:
        raise InvalidArgument(f"prompt is too long: {length} tokens, but max_model_len is {limit} "
                              f"(prompt + output), leaving no room to generate")
    if options.max_tokens is None or options.max_tokens == 0:
        options.max_tokens = limit - length
    elif length + options.max_tokens > limit:
        raise InvalidArgument(f"prompt ({length} tokens) + max_tokens ({options.max_tokens}) exceeds "
                              f"max_model_len {limit}")
    if options.n > max_num_seqs:
        raise InvalidArgument(f"n: {options.n} exceeds max_num_seqs {max_num_seqs}")
    usable = (info.num_blocks - 1) * info.block_size
    needed = limit if kv_allocation == "reserve" else length + 1
    if needed > usable:
        raise RequestTooLarge(f"request needs {needed} KV slots but the executor's cache has {usable} "
                              f"({info.num_blocks - 1} blocks of {info.block_size}); it can never fit")
    bad_stop = next((t for t in options.stop_token_ids if t < 0 or t >= info.vocab_size), None)
    if bad_stop is not None:
        raise InvalidArgument(f"stop_token_ids: {bad_stop} is outside [0, {info.vocab_size})")
