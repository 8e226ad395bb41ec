"""The performance targets, printed by the bench: best against best — kvserve's fastest row of each
weight precision against each peer's fastest row of that precision (every system's thread counts
swept, so each is compared at its own best set-up) — round by round, and kvserve's own split and
memory targets.

On a shared machine one run's ratio says as much about the hour as about the engines (the
same row has swung 2x within an hour on the 2-core box of docs/benchmarks.md). With
``--rounds N`` every system runs N times, taking turns at going first, and each ratio is taken
between rows of the same round, minutes apart: a target is met when it holds in every round.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

from bench.report import Row

# Output throughput kvserve must reach, as a multiple of the peer's at the same weight precision.
THROUGHPUT_TARGETS = {"OpenVINO GenAI": 1.5, "llama.cpp llama-server": 5.0}
# Peers whose TTFT P99 under load kvserve's must stay within this fraction of.
TTFT_PEERS = ("OpenVINO GenAI",)
TTFT_RATIO = 0.8
# Single-stream time per output token (TPOT mean; the mean chunk gap for rows measured before TPOT
# was), of the best peer's of the precision: a chunk of several accepted drafts is one ITL gap.
TPOT_RATIO = 0.8
SPLIT_TARGET = 0.05  # scheduler + kvmanager RPC + executor transport, of a step
UTILIZATION_TARGET = 0.96  # tokens stored / KV slots allocated (paged rows)
FRAGMENTATION_TARGET = 0.04  # slots left empty in partly filled last blocks (paged rows)


def peer_family(row: Row) -> str | None:
    """The target table's name for the row's system (a prefix of it), or None when it has none."""
    return next((family for family in (*THROUGHPUT_TARGETS, *TTFT_PEERS) if row.system.startswith(family)), None)


def split_fraction(row: Row) -> float | None:
    """The split's own cost, of the gateway's step time: scheduling, the kvmanager RPC, and the
    executor RPC beyond the executor's own time (the transport)."""
    phases = row.profile.get("step_time_by_phase_s", {}) if row.profile else {}
    step = phases.get("step")
    if not step or "executor_total" not in phases:
        return None
    transport = max(0.0, phases.get("executor_rpc", 0.0) - phases["executor_total"])
    return (phases.get("scheduler", 0.0) + phases.get("kvmanager_rpc", 0.0) + transport) / step


@dataclass
class Check:
    """One target, measured in each round: ``values`` and ``met`` per round, in round order."""

    label: str
    values: list[str]
    met: list[bool]

    def line(self) -> str:
        verdict = ("met" if all(self.met) else "missed" if not any(self.met)
                   else f"met in {sum(self.met)} of {len(self.met)} rounds")
        return f"- {self.label}: {' / '.join(self.values)}: {verdict}"


class Checks(dict):
    """Checks by label, in the order first recorded."""

    def record(self, label: str, value: str, met: bool) -> None:
        check = self.setdefault(label, Check(label, [], []))
        check.values.append(value)
        check.met.append(met)


def rounds_of(rows: list[Row]) -> list[list[Row]]:
    """Rows grouped by round, in round order."""
    indices = sorted({r.round_index for r in rows})
    return [[r for r in rows if r.round_index == i] for i in indices]


def _fastest(rows: list[Row]) -> Row | None:
    return max(rows, key=lambda r: r.output_throughput, default=None)


def _usable(row: Row) -> bool:
    return bool(row.completed) and not row.failed and row.weight_bits is not None


def _best_kvserve(rows: list[Row], bits: int) -> Row | None:
    return _fastest([r for r in rows if r.system == "kvserve" and r.weight_bits == bits and _usable(r)])


def best_peers(rows: list[Row], bits: int) -> dict[str, Row]:
    """Each peer family's fastest completed row of ``bits``-bit weights, in first-seen order."""
    best: dict[str, Row] = {}
    for row in rows:
        family = peer_family(row)
        if family and row.weight_bits == bits and row.completed:
            if family not in best or row.output_throughput > best[family].output_throughput:
                best[family] = row
    return best


def per_token_ms(row: Row) -> float | None:
    """The row's mean time per output token after the first (TPOT); its mean ITL when it has none."""
    return (row.tpot_ms or {}).get("mean") or row.itl_ms.get("mean")


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0f} ms"


def peer_checks(rows: list[Row], concurrency: int | None) -> list[Check]:
    """Best against best: kvserve's fastest row of each weight precision against each peer family's
    fastest row of that precision: throughput and TTFT P99 under load, ITL for a single stream
    (``concurrency`` 1)."""
    checks = Checks()
    for round_rows in rounds_of(rows):
        precisions = sorted({r.weight_bits for r in round_rows if peer_family(r) and r.weight_bits}, reverse=True)
        for bits in precisions:
            ours = _best_kvserve(round_rows, bits)
            peers = best_peers(round_rows, bits)
            if ours is None or not peers:
                continue
            for family, peer in peers.items():
                target = THROUGHPUT_TARGETS.get(family)
                if target is not None and concurrency != 1:  # under load; one stream has ITL's target
                    ratio = ours.output_throughput / peer.output_throughput if peer.output_throughput else float("inf")
                    checks.record(f"{bits}-bit: output throughput >= {target:g}x {family}'s best", f"{ratio:.2f}x",
                                  ratio >= target)
                ours_p99, peer_p99 = ours.ttft_ms.get("p99"), peer.ttft_ms.get("p99")
                if family in TTFT_PEERS and concurrency != 1 and ours_p99 is not None and peer_p99 is not None:
                    checks.record(f"{bits}-bit: TTFT P99 <= {TTFT_RATIO:g}x {family}'s best row's",
                                  f"{_ms(ours_p99)} vs {_ms(peer_p99)}", ours_p99 <= TTFT_RATIO * peer_p99)
            if concurrency == 1:
                timed = [r for r in peers.values() if per_token_ms(r) is not None]
                if per_token_ms(ours) is None or not timed:
                    continue
                best = min(timed, key=per_token_ms)
                checks.record(f"{bits}-bit: single-stream time per output token (TPOT) <= {TPOT_RATIO:g}x the best "
                              f"peer's", f"{_ms(per_token_ms(ours))} vs {_ms(per_token_ms(best))} ({best.name})",
                              per_token_ms(ours) <= TPOT_RATIO * per_token_ms(best))
    return list(checks.values())


def best_against_best_lines(rows: list[Row], meta: dict) -> list[str]:
    """The headline table: per weight precision, each system's fastest row (kvserve first), with its
    threads, weights and KV; and what the executor's ``--num-threads auto`` picks on this machine."""
    systems = [r for r in rows if r.system and r.weight_bits and r.completed]
    if not systems:
        return []
    head = ("precision", "system", "fastest row", "threads", "weights", "KV", "output tok/s", "TTFT P99",
            "ITL mean", "TPOT mean")
    lines = ["best against best (each system's fastest row of each weight precision, every thread count "
             "swept; all rows in results.json):"]
    cpu = meta.get("lscpu") or {}
    if cpu:
        lines.append(f"machine: {cpu.get('Model name', '?')}, {cpu.get('CPU(s)', '?')} CPUs"
                     f"{', ' + cpu['Hypervisor vendor'] + ' guest' if cpu.get('Hypervisor vendor') else ''} "
                     "(lscpu.txt beside results.json)")
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for bits in sorted({r.weight_bits for r in systems}, reverse=True):
        ours = _fastest([r for r in systems if r.system == "kvserve" and r.weight_bits == bits])
        others = {}
        for row in systems:
            family = peer_family(row) or row.system
            if row.system != "kvserve" and row.weight_bits == bits:
                if family not in others or row.output_throughput > others[family].output_throughput:
                    others[family] = row
        for family, row in ([("kvserve", ours)] if ours else []) + list(others.items()):
            threads = "auto" if row.threads is None else row.threads
            lines.append(f"| {bits}-bit | {family} | {row.name} | {threads} | {row.weights or 'n/a'} | "
                         f"{row.kv_budget or 'n/a'} | {row.output_throughput:.1f} | {_ms(row.ttft_ms.get('p99'))} | "
                         f"{_ms(row.itl_ms.get('mean'))} | {_ms(per_token_ms(row))} |")
    for mode, probe in (meta.get("executor_auto_threads") or {}).items():
        weights = "unquantized weights" if mode == "none" else f"{mode} weights"
        if probe.get("chosen"):
            timings = ", ".join(f"{n}: {ms:.1f} ms" for n, ms in probe.get("decode_step_ms_by_threads", {}).items())
            lines.append(f"- kvserve's --num-threads auto picks {probe['chosen']} here ({weights}; probe step "
                         f"by threads: {timings})")
        elif probe.get("error"):
            lines.append(f"- kvserve's --num-threads auto probe ({weights}) failed: {probe['error']}")
    return lines


def own_checks(rows: list[Row]) -> list[Check]:
    """Per kvserve row: the split's cost, and for paged rows the KV memory targets."""
    checks = Checks()
    for round_rows in rounds_of(rows):
        for row in round_rows:
            if row.system != "kvserve" or not row.completed:
                continue
            split = split_fraction(row)
            if split is not None:
                checks.record(f"{row.name}: split (scheduler + both RPCs) <= {SPLIT_TARGET:.0%} of a step",
                              f"{split:.2%}", split <= SPLIT_TARGET)
            utilization, fragmentation = row.kv_utilization, row.internal_fragmentation
            if fragmentation is not None and utilization is not None:
                checks.record(f"{row.name}: KV utilization > {UTILIZATION_TARGET:.0%}, internal fragmentation < "
                              f"{FRAGMENTATION_TARGET:.0%}", f"{utilization:.1%}, {fragmentation:.1%}",
                              utilization > UTILIZATION_TARGET and fragmentation < FRAGMENTATION_TARGET)
    return list(checks.values())


def target_lines(rows: list[Row], concurrency: int | None) -> list[str]:
    """The targets section: one line per target, with its value in each round and the verdict."""
    checks = [*peer_checks(rows, concurrency), *own_checks(rows)]
    if not checks:
        return []
    count = len(rounds_of(rows))
    how = f"{count} rounds, each value within one round" if count > 1 else "one round"
    return [f"targets (best against best: kvserve's fastest row of each weight precision against each peer's "
            f"fastest row of that precision; {how}):",
            *(check.line() for check in checks)]


def representative_rows(rows: list[Row]) -> list[Row]:
    """Per row name, in first-seen order, the round with the median output throughput (the lower of
    the two middle ones for an even count): a run that happened, for the tables and the plot."""
    names = list(dict.fromkeys(r.name for r in rows))
    chosen = []
    for name in names:
        runs = sorted((r for r in rows if r.name == name), key=lambda r: r.output_throughput)
        chosen.append(runs[(len(runs) - 1) // 2])
    return chosen


def round_lines(rows: list[Row]) -> list[str]:
    """Each row's output throughput in every round, and their median."""
    count = len(rounds_of(rows))
    if count < 2:
        return []
    lines = [f"output tok/s in each of {count} rounds (the tables above show each row's median round):"]
    for name in dict.fromkeys(r.name for r in rows):
        values = [r.output_throughput for r in sorted((r for r in rows if r.name == name),
                                                      key=lambda r: r.round_index)]
        lines.append(f"- {name}: {' / '.join(f'{v:.1f}' for v in values)} (median "
                     f"{statistics.median(values):.1f})")
    return lines
