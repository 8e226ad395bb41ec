"""Picks the next token of each sampled sequence, vectorized over the batch.

Order of operations per row (one row per sequence that asked to sample):

1. the logit edits (``executor.logit_processors``): suppressed token ids → −inf; tokens the
   ``allowed_token_bitmask`` leaves out → −inf; ``+ logit_bias``; the repetition penalty over
   every penalty token id (a positive logit divided by it, a negative one multiplied); minus
   ``frequency_penalty · count`` and ``presence_penalty`` for those generated (count > 0);
2. divide by temperature (0 = greedy: argmax of the edited logits);
3. log-softmax → the reported logprobs (after the edits and temperature, before min_p);
4. min_p (drop tokens less likely than min_p times the most likely), top-k, then top-p
   (smallest set of most likely tokens whose probability reaches p); none changes a greedy pick;
5. draw by inverting the cumulative distribution: one uniform ``u`` a row, the token whose
   interval of ``cumsum(p)`` holds ``u · sum(p)``, which samples exactly from ``p``. A seeded
   row draws its ``u`` from a generator seeded by ``(seed, position)`` alone, so the same seed
   gives the same token whatever batch the sequence runs in; other rows share the executor's
   generator.

``position`` is the position the sampled token will occupy
(``start_position + len(token_ids)``).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from executor.logit_processors import edit_logits, min_p_filter, validate_logit_edits
from kvserve.errors import InvalidArgument

MAX_TOP_LOGPROBS = 20
GreedySampler = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 0.0
    seed: int | None = None
    top_logprobs: int = 0
    suppressed_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # Fields 7-15 of executor.proto's SamplingParams, as they arrive (validate() checks them).
    allowed_token_bitmask: bytes = b""
    logit_bias_token_ids: tuple[int, ...] = field(default_factory=tuple)
    logit_bias_values: tuple[float, ...] = field(default_factory=tuple)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 0.0
    penalty_token_ids: tuple[int, ...] = field(default_factory=tuple)
    penalty_output_counts: tuple[int, ...] = field(default_factory=tuple)
    min_p: float = 0.0

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, field_name: str, vocab_size: int) -> None:
        if not (self.temperature >= 0.0 and self.temperature != float("inf")):
            raise InvalidArgument(f"{field_name}.temperature: {self.temperature} must be a finite number >= 0")
        if not (0.0 <= self.top_p <= 1.0):
            raise InvalidArgument(f"{field_name}.top_p: {self.top_p} outside [0, 1]")
        if self.top_logprobs > MAX_TOP_LOGPROBS:
            raise InvalidArgument(f"{field_name}.top_logprobs: {self.top_logprobs} > {MAX_TOP_LOGPROBS}")
        for i, tid in enumerate(self.suppressed_token_ids):
            if not 0 <= tid < vocab_size:
                raise InvalidArgument(f"{field_name}.suppressed_token_ids[{i}]: {tid} outside [0, {vocab_size})")
        if len(set(self.suppressed_token_ids)) >= vocab_size:
            raise InvalidArgument(f"{field_name}.suppressed_token_ids: every token suppressed")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidArgument(f"{field_name}.min_p: {self.min_p} outside [0, 1]")
        validate_logit_edits(self, field_name, vocab_size)


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[float]
    # Per row (token ids, logprobs) most likely first; None when no row asked for any.
    top_logprobs: list[tuple[list[int], list[float]]] | None


def seed_for(seed: int, position: int) -> int:
    """Mixes (seed, position) into a 63-bit generator seed (splitmix64 finalizer)."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def _uniforms(params: list[SamplingParams], positions: list[int], generator: torch.Generator) -> torch.Tensor:
    """[rows] float64 uniforms on [0, 1): from a generator seeded by (seed, position) for seeded
    rows, from the shared ``generator`` otherwise."""
    draws = [torch.rand(1, dtype=torch.float64, generator=generator if p.seed is None
                        else torch.Generator().manual_seed(seed_for(p.seed, pos)))
             for p, pos in zip(params, positions)]
    return torch.cat(draws)


def _draw(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """probs [rows, vocab], uniforms [rows] → [rows] token ids: each row's token whose interval of
    the cumulative distribution holds ``u · total``. One uniform a row where the exponential race
    (``argmax(p / E)``) draws one per token of the vocabulary (bench/sampling_bench.py). The sums
    run in float64, so a token's interval is its probability to ~1e-16."""
    cdf = probs.double().cumsum_(dim=-1)  # [rows, vocab], non-decreasing
    target = uniforms.to(cdf.device).view(-1, 1) * cdf[:, -1:]
    # The first position whose sum exceeds the target: a token of probability 0 has an interval of
    # width 0 and is never it, unless u · total rounds up to the total (then: the last token).
    drawn = torch.searchsorted(cdf, target, right=True).view(-1).clamp_(max=probs.shape[-1] - 1)
    never = probs.gather(1, drawn.view(-1, 1)).view(-1) == 0
    if bool(never.any()):
        drawn = torch.where(never, probs.argmax(dim=-1), drawn)
    return drawn


# How many of the most likely tokens top-k / top-p look at first: a partial sort of these takes
# a few ms for 32 rows where sorting the vocabulary (49,152) takes ~100 ms on a CPU, and an LLM's
# next-token distribution has almost all its mass there. Rows it does not settle sort it all.
TOP_CANDIDATES = 1024


def _filter_sorted(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    # logits: [rows, vocab]; top_k: [rows] (0 = off); top_p: [rows] (1 = off)
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=logits.device).view(1, -1)
    k = torch.where(top_k > 0, top_k, vocab).view(-1, 1)
    sorted_logits = sorted_logits.masked_fill(rank >= k, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # Drop a token when the tokens before it already reach top_p; the first always stays.
    mass_before = probs.cumsum(dim=-1) - probs
    sorted_logits = sorted_logits.masked_fill(mass_before >= top_p.view(-1, 1), float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(-1, order, sorted_logits)


def _filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """``_filter_sorted``'s result, from the ``TOP_CANDIDATES`` most likely tokens of each row
    where they decide it: top-k keeps no more than them, or they already hold top_p of the
    mass (a token past them has at least that before it: dropped)."""
    vocab = logits.shape[-1]
    width = min(vocab, TOP_CANDIDATES)
    k = torch.where(top_k > 0, top_k, vocab)
    values, order = logits.topk(width, dim=-1)  # [rows, width], most likely first
    rank = torch.arange(width, device=logits.device).view(1, -1)
    values = values.masked_fill(rank >= k.view(-1, 1), float("-inf"))
    within = k <= width
    # Top-k's renormalization: over the kept tokens, all of them in ``values`` when k <= width;
    # otherwise over the whole row (rows with width < k < vocab are not settled here).
    norm = values.logsumexp(dim=-1, keepdim=True)
    if not bool(within.all()):
        norm = torch.where(within.view(-1, 1), norm, logits.logsumexp(dim=-1, keepdim=True))
    probs = (values - norm).exp()
    mass_before = probs.cumsum(dim=-1) - probs
    values = values.masked_fill(mass_before >= top_p.view(-1, 1), float("-inf"))
    unfiltered = (k >= vocab) & (top_p >= 1.0)
    settled = within | ((k >= vocab) & (probs.sum(dim=-1) >= top_p)) | unfiltered
    out = torch.full_like(logits, float("-inf")).scatter_(-1, order, values)
    if bool(unfiltered.any()):
        out = torch.where(unfiltered.view(-1, 1), logits, out)
    if not bool(settled.all()):
        rest = (~settled).nonzero().view(-1)
        out[rest] = _filter_sorted(logits[rest], top_k[rest], top_p[rest])
    return out


def sample(logits: torch.Tensor, params: list[SamplingParams], positions: list[int],
           generator: torch.Generator, greedy: GreedySampler | None = None) -> SampleResult:
    """logits: [rows, vocab] (float32 or the model's dtype) on the CPU or the device, one row per
    entry of ``params``. ``greedy``: a compiled pick for batches that are all plain greedy (see
    AttentionBackend.greedy_sample), which takes them in either dtype; the rest runs in float32."""
    rows, vocab = logits.shape
    logits = edit_logits(logits, params)  # a copy when any row edits its logits
    # Edited logits (-inf masks, biases, penalties) are plain logits: the compiled pick takes them
    # too, and min_p / top-k / top-p never change a greedy pick.
    if greedy is not None and all(p.is_greedy and not p.top_logprobs for p in params):
        token_ids, logprobs = greedy(logits)
        return SampleResult(token_ids.tolist(), logprobs.tolist(), None)
    logits = logits.float()
    if all(p.is_greedy for p in params):
        scaled = logits
    else:
        temperature = torch.tensor([p.temperature if not p.is_greedy else 1.0 for p in params],
                                   dtype=torch.float32, device=logits.device)
        scaled = logits / temperature.view(-1, 1)
    # One fused pass (on the CPU 2.6x faster than logsumexp, which takes four); the greedy pick
    # stays the argmax of the logits themselves, so ties break exactly as transformers does.
    logprobs = scaled.log_softmax(dim=-1)
    random_rows = [row for row, p in enumerate(params) if not p.is_greedy]
    all_random = len(random_rows) == rows > 0  # no greedy pick to make, no rows to pick out
    chosen = None if all_random else scaled.argmax(dim=-1)
    if random_rows:
        rand_params = [params[r] for r in random_rows]
        row_index = torch.tensor(random_rows, dtype=torch.long, device=logits.device)
        candidates = scaled if all_random else scaled.index_select(0, row_index)
        if any(p.min_p > 0.0 for p in rand_params):
            min_p = torch.tensor([p.min_p for p in rand_params], dtype=torch.float32, device=logits.device)
            candidates = min_p_filter(candidates, min_p)
        if any(p.top_k > 0 or 0.0 < p.top_p < 1.0 for p in rand_params):
            top_k = torch.tensor([p.top_k for p in rand_params], dtype=torch.long, device=logits.device)
            top_p = torch.tensor([p.top_p if 0.0 < p.top_p < 1.0 else 1.0 for p in rand_params],
                                 dtype=torch.float32, device=logits.device)
            candidates = _filter_top_k_top_p(candidates, top_k, top_p)
        uniforms = _uniforms(rand_params, [positions[r] for r in random_rows], generator)
        drawn = _draw(candidates.softmax(dim=-1), uniforms)
        chosen = drawn if all_random else chosen.index_copy(0, row_index, drawn)
    chosen_logprobs = logprobs.gather(1, chosen.view(-1, 1)).view(-1)
    top = None
    max_top = max(p.top_logprobs for p in params)
    if max_top > 0:
        top_values, top_ids = logprobs.topk(max_top, dim=-1)
        top_values, top_ids = top_values.tolist(), top_ids.tolist()
        top = [(top_ids[r][: p.top_logprobs], top_values[r][: p.top_logprobs]) for r, p in enumerate(params)]
    return SampleResult(chosen.tolist(), chosen_logprobs.tolist(), top)
