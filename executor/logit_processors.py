"""The logit edits of ``SamplingParams`` (fields 7-15 of executor.proto), vectorized over the batch.

``edit_logits`` applies, per row, in this order (executor.proto's contract):

1. ``suppressed_token_ids`` → −inf;
2. ``allowed_token_bitmask`` (when non-empty): every token whose bit is 0 → −inf;
3. ``+ logit_bias`` (value per listed id);
4. ``repetition_penalty`` (0 or 1 = off) over every id in ``penalty_token_ids``: a positive logit
   is divided by it, a negative one multiplied;
5. ``− frequency_penalty · count − presence_penalty`` for the listed ids whose output count is > 0.

Rows that set none of these cost one Python check each; a batch without any returns the
caller's tensor itself. Otherwise the result is a copy: the masks (1, 2) keep the logits' dtype
(−inf is exact in any dtype), the arithmetic (3-5) widens the batch to float32 first. ``min_p``
(after temperature, on the probabilities) is ``min_p_filter``.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from kvserve.errors import InvalidArgument

if TYPE_CHECKING:
    from executor.sampling import SamplingParams

MAX_LOGIT_BIAS = 100.0
MAX_PRESENCE_FREQUENCY = 2.0


def bitmask_bytes(vocab_size: int) -> tuple[int, int]:
    """(fewest, most) bytes of a valid ``allowed_token_bitmask``: ceil(vocab / 8), rounded up to 4."""
    need = -(-vocab_size // 8)
    return need, -(-need // 4) * 4


def allowed_mask(masks: list[bytes], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[len(masks), vocab] bool: token t allowed when bit t % 8 of byte t // 8 is set (LSB first)."""
    need = bitmask_bytes(vocab_size)[0]
    packed = torch.frombuffer(bytearray(b"".join(m[:need] for m in masks)), dtype=torch.uint8)
    packed = packed.view(len(masks), need).to(device)
    shifts = torch.arange(8, dtype=torch.uint8, device=device)
    bits = (packed.unsqueeze(-1) >> shifts) & 1  # [rows, bytes, 8]: bit i of byte b = token 8b + i
    return bits.view(len(masks), need * 8)[:, :vocab_size].bool()


def _finite_penalty(field: str, value: float) -> None:
    if not math.isfinite(value):
        raise InvalidArgument(f"{field}: {value} is not a finite number")


def validate_logit_edits(p: SamplingParams, field_name: str, vocab_size: int) -> None:
    """InvalidArgument naming the field for a bad bitmask, logit bias or penalty of ``p``."""
    f = field_name
    if p.allowed_token_bitmask:
        _validate_bitmask(p, f, vocab_size)
    ids, values = p.logit_bias_token_ids, p.logit_bias_values
    _distinct_aligned_ids(f, "logit_bias_token_ids", ids, "logit_bias_values", values, "values", vocab_size)
    if ids:
        for i, v in enumerate(values):
            if not -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS:
                raise InvalidArgument(f"{f}.logit_bias_values[{i}]: {v} is not a finite number in "
                                      f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(p, name)
        _finite_penalty(f"{f}.{name}", value)
        if not -MAX_PRESENCE_FREQUENCY <= value <= MAX_PRESENCE_FREQUENCY:
            raise InvalidArgument(f"{f}.{name}: {value} outside [-{MAX_PRESENCE_FREQUENCY:g}, "
                                  f"{MAX_PRESENCE_FREQUENCY:g}]")
    _finite_penalty(f"{f}.repetition_penalty", p.repetition_penalty)
    if p.repetition_penalty < 0:
        raise InvalidArgument(f"{f}.repetition_penalty: {p.repetition_penalty} < 0 (0 or 1 = off)")
    ids, counts = p.penalty_token_ids, p.penalty_output_counts
    _distinct_aligned_ids(f, "penalty_token_ids", ids, "penalty_output_counts", counts, "counts", vocab_size)
    if ids:
        if min(counts) < 0:
            i = next(i for i, c in enumerate(counts) if c < 0)
            raise InvalidArgument(f"{f}.penalty_output_counts[{i}]: {counts[i]} < 0")


def _distinct_aligned_ids(f: str, ids_name: str, ids, other_name: str, other, noun: str, vocab_size: int) -> None:
    """``ids``: distinct token ids in the vocabulary, index-aligned with ``other``."""
    if len(ids) != len(other):
        raise InvalidArgument(f"{f}.{other_name}: {len(other)} {noun} for {len(ids)} {ids_name}; "
                              "they are index-aligned")
    if ids:
        _ids_in_vocab(f"{f}.{ids_name}", ids, vocab_size)
        if len(set(ids)) != len(ids):
            raise InvalidArgument(f"{f}.{ids_name}: {_first_repeat(ids)} is listed twice")


def _validate_bitmask(p: SamplingParams, f: str, vocab_size: int) -> None:
    fewest, most = bitmask_bytes(vocab_size)
    size = len(p.allowed_token_bitmask)
    if not fewest <= size <= most:
        raise InvalidArgument(f"{f}.allowed_token_bitmask: {size} bytes; vocab_size {vocab_size} takes "
                              f"{fewest}" + (f" to {most}" if most > fewest else "") + " (1 bit per token)")
    allowed = int.from_bytes(p.allowed_token_bitmask, "little") & ((1 << vocab_size) - 1)
    if not allowed:
        raise InvalidArgument(f"{f}.allowed_token_bitmask: allows no token of the vocabulary [0, {vocab_size})")
    suppressed = set(p.suppressed_token_ids)
    if allowed.bit_count() <= len(suppressed):  # (suppressed ids are in the vocabulary by now)
        mask = p.allowed_token_bitmask
        if sum(mask[t >> 3] >> (t & 7) & 1 for t in suppressed) == allowed.bit_count():
            raise InvalidArgument(f"{f}.allowed_token_bitmask: every allowed token is in suppressed_token_ids")


def _ids_in_vocab(field: str, ids: tuple[int, ...], vocab_size: int) -> None:
    if min(ids) < 0 or max(ids) >= vocab_size:
        i, tid = next((i, t) for i, t in enumerate(ids) if not 0 <= t < vocab_size)
        raise InvalidArgument(f"{field}[{i}]: {tid} outside [0, {vocab_size})")


def _first_repeat(ids: tuple[int, ...]) -> int:
    seen = set()
    for t in ids:
        if t in seen:
            return t
        seen.add(t)
    raise AssertionError("no repeat")


def has_penalties(p: SamplingParams) -> bool:
    return bool(p.penalty_token_ids) and bool(p.presence_penalty or p.frequency_penalty
                                              or p.repetition_penalty not in (0.0, 1.0))


def edit_logits(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Steps 1-5 of the module docstring; ``logits`` [rows, vocab] itself when no row has any."""
    if not any(p.suppressed_token_ids or p.allowed_token_bitmask or p.logit_bias_token_ids or p.penalty_token_ids
               for p in params):
        return logits
    bias_rows = [row for row, p in enumerate(params) if p.logit_bias_token_ids]
    penalty_rows = [row for row, p in enumerate(params) if has_penalties(p)]
    mask_rows = [row for row, p in enumerate(params) if p.allowed_token_bitmask]
    if not (bias_rows or penalty_rows or mask_rows or any(p.suppressed_token_ids for p in params)):
        return logits  # penalty ids listed with every penalty off
    vocab, device = logits.shape[1], logits.device
    # One copy: widened when there is arithmetic to do, in the caller's dtype for masks alone.
    logits = logits.float() if (bias_rows or penalty_rows) and logits.dtype != torch.float32 else logits.clone()
    suppressed = [(row, tid) for row, p in enumerate(params) for tid in p.suppressed_token_ids]
    if suppressed:
        index = torch.tensor(suppressed, dtype=torch.long, device=device)
        logits[index[:, 0], index[:, 1]] = float("-inf")
    if mask_rows:
        allowed = allowed_mask([params[r].allowed_token_bitmask for r in mask_rows], vocab, device)
        if len(mask_rows) == len(params):
            logits.masked_fill_(~allowed, float("-inf"))
        else:
            rows = torch.tensor(mask_rows, dtype=torch.long, device=device)
            logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
    if bias_rows:
        rows, ids, values = _flatten([(r, params[r].logit_bias_token_ids, params[r].logit_bias_values)
                                      for r in bias_rows], device)
        logits.index_put_((rows, ids), values, accumulate=True)
    if penalty_rows:
        _apply_penalties(logits, params, penalty_rows)
    return logits


def _flatten(entries: list[tuple[int, tuple[int, ...], tuple[float, ...]]], device: torch.device
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row index, token id, value) tensors of per-row aligned id/value lists."""
    rows = [r for r, ids, _ in entries for _ in ids]
    ids = [t for _, row_ids, _ in entries for t in row_ids]
    values = [v for _, _, row_values in entries for v in row_values]
    return (torch.tensor(rows, dtype=torch.long, device=device), torch.tensor(ids, dtype=torch.long, device=device),
            torch.tensor(values, dtype=torch.float32, device=device))


def _apply_penalties(logits: torch.Tensor, params: list[SamplingParams], penalty_rows: list[int]) -> None:
    device = logits.device
    rows, ids, counts = _flatten([(r, params[r].penalty_token_ids, params[r].penalty_output_counts)
                                  for r in penalty_rows], device)
    per_row = torch.tensor([[p.repetition_penalty if p.repetition_penalty not in (0.0, 1.0) else 1.0,
                             p.frequency_penalty, p.presence_penalty] for p in params],
                           dtype=torch.float32, device=device)[rows]
    repetition, frequency, presence = per_row.unbind(-1)
    picked = logits[rows, ids]
    picked = torch.where(picked > 0, picked / repetition, picked * repetition)
    # Count 0 (a prompt token): frequency * 0 and presence * 0 subtract nothing.
    picked = picked - frequency * counts - presence * (counts > 0).float()
    logits[rows, ids] = picked


def min_p_filter(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """logits [rows, vocab] (after temperature), min_p [rows] (0 = off): tokens whose probability
    is below min_p times the row's largest → −inf."""
    probs = logits.softmax(dim=-1)
    threshold = min_p.view(-1, 1) * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < threshold, float("-inf"))
