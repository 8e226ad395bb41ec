"""A black-box conformance kit for the kvserve v1 wire contract.

``python -m kvserve.conformance executor HOST:PORT`` and
``python -m kvserve.conformance kvmanager HOST:PORT`` check a running service
against the rules stated in ``protos/kvserve/v1/*.proto`` (and explained in
``docs/executor-contract.md``), one verdict line per rule::

    PASS describe.consistent: two Describe calls gave identical responses
    FAIL layout.block_copy: step 0: token 812 != 77 (reference margin 1.2)
    SKIP sampling.seeded: needs 12 blocks, the executor has 8

The exit code is 1 when any rule fails, 0 otherwise. The kit talks to the
service only over gRPC, through the generated stubs in ``kvserve.v1`` and the
standard health service: it imports nothing from the reference implementations
(``executor/``, ``kvmanager/``, ``gateway/``), so an implementation in any
language can be checked with it.

This module holds what both checkers share: rule registration, verdicts and
the runner.
"""
from __future__ import annotations

import fnmatch
import sys
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TextIO

import grpc


class Fail(Exception):
    """A rule is broken; the message says how."""


class Skip(Exception):
    """A rule cannot be checked here (e.g. the cache is too small, or a prerequisite failed)."""


def require(condition: bool, message: str) -> None:
    """Raises ``Fail(message)`` unless ``condition``."""
    if not condition:
        raise Fail(message)


def rpc_error_text(error: grpc.RpcError) -> str:
    """``CODE: details`` of a failed call."""
    try:
        return f"{error.code().name}: {error.details()}"
    except Exception:  # noqa: BLE001 - a channel-level error without code()/details()
        return repr(error)


def expect_status(call: Callable[[], Any], code: grpc.StatusCode | Iterable[grpc.StatusCode],
                  what: str) -> grpc.RpcError:
    """Runs ``call`` and requires it to fail with ``code`` (or one of several); returns the error."""
    codes = (code,) if isinstance(code, grpc.StatusCode) else tuple(code)
    try:
        call()
    except grpc.RpcError as error:
        if error.code() not in codes:
            raise Fail(f"{what}: expected {'/'.join(c.name for c in codes)}, got {rpc_error_text(error)}") from None
        return error
    raise Fail(f"{what}: accepted, expected {'/'.join(c.name for c in codes)}")


@dataclass(frozen=True)
class Rule:
    name: str
    summary: str
    fn: Callable[[Any], str | None]


class RuleSet:
    """An ordered list of rules; ``@rules.rule(name, summary)`` registers a function
    that takes the checker's context and returns a detail line (PASS) or raises
    ``Fail`` / ``Skip``."""

    def __init__(self) -> None:
        self.rules: list[Rule] = []

    def rule(self, name: str, summary: str) -> Callable:
        def register(fn: Callable[[Any], str | None]) -> Callable[[Any], str | None]:
            if any(r.name == name for r in self.rules):
                raise ValueError(f"rule {name} registered twice")
            self.rules.append(Rule(name, summary, fn))
            return fn
        return register

    def add(self, name: str, summary: str, fn: Callable[[Any], str | None]) -> None:
        self.rule(name, summary)(fn)

    def select(self, patterns: Iterable[str] = ()) -> list[Rule]:
        patterns = list(patterns)
        if not patterns:
            return list(self.rules)
        return [r for r in self.rules if any(fnmatch.fnmatchcase(r.name, p) for p in patterns)]


class Reporter:
    """Prints verdict lines (PASS/FAIL/SKIP), notes and the summary, flushing each."""

    def __init__(self, out: TextIO = sys.stdout, verbose: bool = False) -> None:
        self.out = out
        self.verbose = verbose
        self.counts = {"PASS": 0, "FAIL": 0, "SKIP": 0}
        self.failed: list[str] = []

    def line(self, text: str) -> None:
        self.out.write(text.rstrip("\n") + "\n")
        self.out.flush()

    def verdict(self, kind: str, name: str, text: str) -> None:
        self.counts[kind] += 1
        if kind == "FAIL":
            self.failed.append(name)
        text = " ".join(str(text).split()) if text else ""
        self.line(f"{kind} {name}" + (f": {text}" if text else ""))

    def note(self, name: str, text: str) -> None:
        self.line(f"NOTE {name}: {text}")


def run_rules(rules: list[Rule], context: Any, reporter: Reporter) -> int:
    """Runs each rule in order; returns the number of failures.

    ``context.begin_rule(name)`` (when present) is called before each rule, so a
    checker can reset per-rule state (e.g. which KV blocks the rule may use)."""
    start = time.monotonic()
    for rule in rules:
        begin = getattr(context, "begin_rule", None)
        if begin is not None:
            begin(rule.name)
        t0 = time.monotonic()
        try:
            detail = rule.fn(context)
        except Fail as failure:
            reporter.verdict("FAIL", rule.name, str(failure) or rule.summary)
        except Skip as skip:
            reporter.verdict("SKIP", rule.name, str(skip))
        except grpc.RpcError as error:
            reporter.verdict("FAIL", rule.name, f"unexpected RPC error {rpc_error_text(error)}")
        except Exception as error:  # noqa: BLE001 - a bug in the kit or a nonsensical reply
            if reporter.verbose:
                traceback.print_exc()
            reporter.verdict("FAIL", rule.name, f"{type(error).__name__}: {error}")
        else:
            elapsed = time.monotonic() - t0
            suffix = f" ({elapsed:.2f} s)" if reporter.verbose else ""
            reporter.verdict("PASS", rule.name, (detail or rule.summary) + suffix)
    c = reporter.counts
    reporter.line(f"summary: {c['PASS']} passed, {c['FAIL']} failed, {c['SKIP']} skipped "
                  f"in {time.monotonic() - start:.1f} s"
                  + (f" (failed: {', '.join(reporter.failed)})" if reporter.failed else ""))
    return c["FAIL"]
