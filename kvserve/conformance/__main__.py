"""python -m kvserve.conformance {executor,kvmanager} HOST:PORT: check a running
service against the kvserve v1 contract; one verdict line per rule; exit 1 on any FAIL.
"""
from __future__ import annotations

import argparse
import sys

from kvserve.conformance import Reporter, run_rules

EPILOG = """\
Output: one line per rule, "PASS name: detail", "FAIL name: reason" or
"SKIP name: reason" (a rule this service is too small to check), "NOTE" lines for
what is deliberately not checked, then a summary line. Exit code: 0 when no rule
failed, 1 otherwise, 2 for bad arguments.

The executor checks write KV into blocks 1..num_blocks-1 of the executor: run them
against an executor nobody else is using. The kvmanager checks register pools of
their own (conformance-<run>-<rule>) and leave other pools alone.
See docs/executor-contract.md."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m kvserve.conformance", description=__doc__.split("\n\n")[0].strip(),
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="service", required=True, metavar="{executor,kvmanager}")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("address", nargs="?", help="HOST:PORT of the service to check")
    common.add_argument("--only", action="append", default=[], metavar="GLOB",
                        help="run only rules whose name matches (fnmatch; repeatable), e.g. 'invalid.*'")
    common.add_argument("--list", action="store_true", help="list the rules and exit")
    common.add_argument("--timeout", type=float, default=None, metavar="S",
                        help="deadline of one RPC in seconds (executor: 120, kvmanager: 30)")
    common.add_argument("--connect-timeout", type=float, default=30.0, metavar="S",
                        help="how long to wait for the service to accept a connection (30)")
    common.add_argument("--seed", type=int, default=20240601, help="seed of the token ids the kit draws")
    common.add_argument("-v", "--verbose", action="store_true", help="timings per rule; tracebacks of kit errors")
    ex = sub.add_parser("executor", parents=[common], help="check a kvserve.v1.Executor",
                        description="Check a kvserve.v1.Executor (health, Describe, layout and batching "
                                    "independence, sampling, bad batches).")
    ex.add_argument("--atol", type=float, default=None,
                    help="absolute tolerance on log-probabilities (default by Describe's dtype: 1e-3 for "
                         "float32, 0.25 otherwise)")
    ex.add_argument("--rtol", type=float, default=None,
                    help="relative tolerance on log-probabilities, times |reference| (default 0 for float32, "
                         "0.02 otherwise)")
    sub.add_parser("kvmanager", parents=[common], help="check a kvserve.v1.KVManager",
                   description="Check a kvserve.v1.KVManager (publication of written KV, invalidation, "
                               "stats invariants, bad input).")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.service == "executor":
        from kvserve.conformance import executor_checks as checks
        from kvserve.conformance import draft_checks  # noqa: F401 — registers the drafts.* rules
        from kvserve.conformance import prompt_logprob_checks  # noqa: F401 — registers prompt_logprobs.*
        from kvserve.conformance import store_checks  # noqa: F401 — registers the store.* rules
    else:
        from kvserve.conformance import kvmanager_checks as checks
    selected = checks.rules.select(args.only)
    if args.list:
        for rule in selected:
            print(f"{rule.name}: {rule.summary}")
        return 0
    if not args.address:
        parser.error("the address HOST:PORT is required")
    if not selected:
        parser.error(f"no rule matches {args.only}")
    reporter = Reporter(sys.stdout, verbose=args.verbose)
    if args.service == "executor":
        from kvserve.conformance.comparison import Tolerance
        from kvserve.conformance.executor_context import ExecutorContext

        given = args.atol is not None or args.rtol is not None
        tolerance = Tolerance(args.atol if args.atol is not None else Tolerance.atol,
                              args.rtol if args.rtol is not None else Tolerance.rtol) if given else None
        context = ExecutorContext(args.address, tolerance, timeout=args.timeout or 120.0,
                                  seed=args.seed, connect_timeout=args.connect_timeout)
        told = f"atol {tolerance.atol:g}, rtol {tolerance.rtol:g}" if given else "tolerance by Describe's dtype"
        reporter.line(f"checking executor {args.address} ({told})")
    else:
        context = checks.KVManagerContext(args.address, timeout=args.timeout or 30.0, seed=args.seed,
                                          connect_timeout=args.connect_timeout)
        reporter.line(f"checking kvmanager {args.address}")
    for name, text in checks.NOTES:
        reporter.note(name, text)
    try:
        failures = run_rules(selected, context, reporter)
    finally:
        context.close()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
