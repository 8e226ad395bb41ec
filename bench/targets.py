"""The performance targets, printed by the bench: kvserve against each peer of the same weight
precision, round by round, and kvserve's own split and memory targets.

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
THROUGHPUT_TARGETS = {"OpenVINO GenAI": 1.5, "llama.cpp llama-server": 3.0}
# Peers whose TTFT P99 kvserve's must not exceed.
TTFT_PEERS = ("OpenVINO GenAI",)
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


def _best_kvserve(rows: list[Row], bits: int) -> Row | None:
    ours = [r for r in rows if r.system == "kvserve" and r.weight_bits == bits and r.completed and not r.failed]
    return max(ours, key=lambda r: r.output_throughput, default=None)


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0f} ms"


def peer_checks(rows: list[Row], concurrency: int | None) -> list[Check]:
    """kvserve's fastest row of each weight precision against each peer row of that precision: throughput
    and TTFT P99 under load, TTFT P99 and ITL for a single stream (``concurrency`` 1)."""
    checks = Checks()
    for round_rows in rounds_of(rows):
        for peer in round_rows:
            family = peer_family(peer)
            if family is None or peer.weight_bits is None or not peer.completed:
                continue
            ours = _best_kvserve(round_rows, peer.weight_bits)
            if ours is None:
                continue
            bits = f"{peer.weight_bits}-bit"
            target = THROUGHPUT_TARGETS.get(family)
            if target is not None and concurrency != 1:  # a throughput target under load; one stream has ITL's
                ratio = ours.output_throughput / peer.output_throughput if peer.output_throughput else float("inf")
                checks.record(f"{bits}: output throughput >= {target:g}x {peer.name}'s", f"{ratio:.2f}x",
                              ratio >= target)
            ours_p99, peer_p99 = ours.ttft_ms.get("p99"), peer.ttft_ms.get("p99")
            if family in TTFT_PEERS and ours_p99 is not None and peer_p99 is not None:
                checks.record(f"{bits}: TTFT P99 <= {peer.name}'s", f"{_ms(ours_p99)} vs {_ms(peer_p99)}",
                              ours_p99 <= peer_p99)
        if concurrency == 1:
            for bits in sorted({r.weight_bits for r in round_rows if peer_family(r) and r.weight_bits}, reverse=True):
                ours = _best_kvserve(round_rows, bits)
                peers = [r for r in round_rows if peer_family(r) and r.weight_bits == bits and r.completed
                         and r.itl_ms.get("mean") is not None]
                if ours is None or ours.itl_ms.get("mean") is None or not peers:
                    continue
                best = min(peers, key=lambda r: r.itl_ms["mean"])
                checks.record(f"{bits}-bit: single-stream ITL mean <= the best peer's",
                              f"{_ms(ours.itl_ms['mean'])} vs {_ms(best.itl_ms['mean'])} ({best.name})",
                              ours.itl_ms["mean"] <= best.itl_ms["mean"])
    return list(checks.values())


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
    return [f"targets (kvserve's fastest row of each weight precision against each peer of that precision; {how}):",
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
