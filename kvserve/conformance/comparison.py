"""Comparing an executor's results with a reference run (see ``executor_checks``, "Comparisons")."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvserve.conformance import Fail, require
from kvserve.v1 import executor_pb2 as pb


@dataclass(frozen=True)
class Tolerance:
    atol: float = 0.25
    rtol: float = 0.02

    @classmethod
    def for_dtype(cls, dtype: str) -> "Tolerance":
        """The default for an executor computing in ``dtype`` (Describe's, free-form): float32 runs agree
        to ~1e-6, so every comparison counts at 1e-3; anything else gets the 16-bit default. kvserve's
        bf16 executor (SmolLM2-135M, AMX) moves log-probabilities by up to 0.16 between a prompt in
        one chunk and in two, or a row decoded alone and in a mixed batch: rounding in bf16 hidden
        states over 30 layers, not the LM head's output (float32 logits move them as much)."""
        return cls(1e-3, 0.0) if dtype.strip().lower() in ("float32", "fp32", "torch.float32") else cls()

    def bound(self, reference: float) -> float:
        return self.atol + self.rtol * abs(reference) if math.isfinite(reference) else 0.0

    def close(self, value: float, reference: float) -> bool:
        if math.isnan(value) or math.isnan(reference):
            return False
        if math.isinf(value) or math.isinf(reference):
            return value == reference
        return abs(value - reference) <= self.bound(reference)


@dataclass(frozen=True)
class Sampled:
    """One sampled token: its id, its log-probability and the top alternatives."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()

    def margin(self) -> float:
        """Top-1 minus top-2 log-probability (inf when unknown)."""
        return self.top[0][1] - self.top[1][1] if len(self.top) >= 2 else math.inf


@dataclass
class Comparison:
    tolerance: Tolerance
    problems: list[str] = field(default_factory=list)
    tokens_compared: int = 0
    tokens_skipped: int = 0
    logprobs_compared: int = 0
    max_diff: float = 0.0

    def add(self, reference: Sampled, got: Sampled, where: str) -> None:
        tol = self.tolerance
        margin = reference.margin()
        clear = margin > 2 * tol.bound(reference.top[0][1] if reference.top else reference.logprob)
        if clear:
            self.tokens_compared += 1
            if got.token != reference.token:
                self.problems.append(f"{where}: token {got.token} != reference {reference.token} "
                                     f"(reference top-2 margin {margin:.3g})")
        else:
            self.tokens_skipped += 1
        pairs = []
        if got.token == reference.token:
            pairs.append((f"{where}: logprob of token {got.token}", got.logprob, reference.logprob))
        got_top = dict(got.top)
        for token, logprob in reference.top:
            if token in got_top:
                pairs.append((f"{where}: top logprob of token {token}", got_top[token], logprob))
        # The top lists agree as sets, within the tolerance: a token that one list ranks
        # clearly above the other list's last entry must be in the other list too. (This
        # keeps a near tie from making the comparison vacuous.)
        for name, a, b in (("reference", reference.top, got.top), ("result", got.top, reference.top)):
            if a and not b:
                self.problems.append(f"{where}: the {'result' if name == 'reference' else 'reference'} has no "
                                     "top_logprobs")
                continue
            if not a:
                continue
            b_tokens, b_last = dict(b), min(lp for _, lp in b)
            for token, logprob in a:
                if token not in b_tokens and logprob > b_last + tol.bound(logprob):
                    self.problems.append(f"{where}: token {token} (logprob {logprob:.6g} in the {name}) is missing "
                                         f"from the other top-{len(b)} list (last {b_last:.6g})")
        for what, value, ref in pairs:
            self.logprobs_compared += 1
            if math.isfinite(value) and math.isfinite(ref):
                self.max_diff = max(self.max_diff, abs(value - ref))
            if not tol.close(value, ref):
                self.problems.append(f"{what} {value:.6g} vs reference {ref:.6g} "
                                     f"(tolerance {tol.bound(ref):.3g})")

    def add_all(self, reference: list[Sampled], got: list[Sampled], where: str) -> None:
        require(len(got) == len(reference), f"{where}: {len(got)} results, expected {len(reference)}")
        for i, (r, g) in enumerate(zip(reference, got)):
            self.add(r, g, f"{where} step {i}")

    def verdict(self) -> str:
        if self.problems:
            more = f" (+{len(self.problems) - 3} more)" if len(self.problems) > 3 else ""
            raise Fail("; ".join(self.problems[:3]) + more)
        skipped = f", {self.tokens_skipped} near ties not compared" if self.tokens_skipped else ""
        return (f"{self.tokens_compared} greedy tokens and {self.logprobs_compared} logprobs agree "
                f"(max |diff| {self.max_diff:.2g}){skipped}")


def sampled_from(reply: pb.ExecuteResponse, index: int) -> Sampled:
    """The index-th sampled result of a reply."""
    require(index < len(reply.sampled_token_ids),
            f"reply has {len(reply.sampled_token_ids)} sampled tokens, expected at least {index + 1}")
    require(len(reply.sampled_logprobs) == len(reply.sampled_token_ids),
            "sampled_logprobs is not index-aligned with sampled_token_ids")
    top: tuple = ()
    if index < len(reply.top_logprobs):
        entry = reply.top_logprobs[index]
        top = tuple(zip(entry.token_ids, entry.logprobs))
    return Sampled(reply.sampled_token_ids[index], reply.sampled_logprobs[index], top)
