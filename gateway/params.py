"""Validating generation parameters shared by the HTTP and gRPC front ends."""
from __future__ import annotations

from collections.abc import Iterable

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
