"""Turns measured requests into table rows, and rows into a table, JSON and a plot."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from bench.client import RequestResult
from bench.cpu_usage import cpu_line
from bench.server_metrics import ServerMetrics

TABLE_COLUMNS = ("configuration", "max concurrency", "throughput tok/s", "TTFT P99", "KV memory utilization")


@dataclass
class Row:
    """One configuration's results (one line of the table, plus the details behind it)."""

    name: str
    completed: int = 0
    failed: int = 0
    duration_s: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int = 0
    output_throughput: float = 0.0  # generated tokens/s: the table's throughput
    total_throughput: float = 0.0  # prompt + generated tokens/s
    request_throughput: float = 0.0
    ttft_ms: dict = field(default_factory=dict)  # mean, median, p99
    itl_ms: dict = field(default_factory=dict)  # gaps between streamed chunks (a chunk may hold several tokens)
    # Per request, (E2E - TTFT) / (output tokens - 1): vLLM's TPOT. Equal to the mean ITL where each
    # chunk is one token; lower where a step streams several (accepted speculative drafts).
    tpot_ms: dict = field(default_factory=dict)
    e2e_ms: dict = field(default_factory=dict)
    # Peak requests streaming tokens at once (first token to last). The gateway's
    # vllm:num_requests_running is kept too, but in static batching it also counts,
    # for one step, requests admitted before kvmanager turned them away for lack of room.
    max_concurrency: int | None = None
    server_peak_running: int | None = None
    kv_utilization: float | None = None  # tokens stored / slots allocated
    unused_kv_slots: float | None = None  # 1 - kv_utilization: allocated slots holding no token
    internal_fragmentation: float | None = None  # paged rows: unused slots are all in partly filled last blocks
    kv_usage_mean: float | None = None  # fraction of the KV budget in use, while busy
    kv_usage_peak: float | None = None
    prefix_cache_hit_rate: float | None = None
    cached_prompt_tokens: int = 0
    preemptions: float | None = None
    kv_usage_series: list = field(default_factory=list)  # [(t, fraction of blocks in use)]
    running_series: list = field(default_factory=list)  # [(t, requests running)]
    running_high_water: float | None = None  # the gateway's own peak gauge
    profile: dict = field(default_factory=dict)  # scheduler steps and where their time went
    cpu_s: dict = field(default_factory=dict)  # CPU seconds per process over the measured run (bench/cpu_usage.py)
    # What the system is and how it ran, for the side-by-side table (bench/peers)
    system: str = ""  # kvserve, llama.cpp llama-server, OpenVINO GenAI ...
    weights: str = ""  # weights precision / format
    weight_bits: int | None = None  # 16, 8 or 4 (32 for float32): which peers' rows it is compared with
    threads: int | None = None  # compute threads
    kv_budget: str = ""  # the KV cache it was given
    transport: str = ""  # HTTP, gRPC or in-process
    notes: list = field(default_factory=list)
    errors: list = field(default_factory=list)
    round_index: int = 0  # with --rounds N, which of the N runs of every row this one is


def stats_ms(values: list[float]) -> dict:
    """mean / median / p99 of seconds, in milliseconds."""
    if not values:
        return {"mean": None, "median": None, "p99": None}
    array = np.asarray(values) * 1000.0
    return {"mean": float(array.mean()), "median": float(np.median(array)),
            "p99": float(np.percentile(array, 99))}


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def client_peak_concurrency(results: list[RequestResult]) -> int:
    """Most requests between first token and end at once (a fallback when /metrics is absent)."""
    events = []
    for r in results:
        if r.ok:
            events.append((r.sent_at + r.ttft, 1))
            events.append((r.sent_at + r.e2e, -1))
    peak = current = 0
    for _, delta in sorted(events, key=lambda e: (e[0], e[1])):
        current += delta
        peak = max(peak, current)
    return peak


def internal_fragmentation(stored_per_seq: list[int], block_size: int) -> float:
    """Empty slots in each sequence's last block over the slots its blocks hold."""
    allocated = sum(-(-n // block_size) * block_size for n in stored_per_seq)
    return (allocated - sum(stored_per_seq)) / allocated if allocated else 0.0


def row_from_results(name: str, results: list[RequestResult], wall_s: float,
              metrics: ServerMetrics | None = None) -> Row:
    """The row of one run: client-side latencies and throughput, server-side KV facts."""
    good = [r for r in results if r.ok]
    row = Row(name=name, completed=len(good), failed=len(results) - len(good), duration_s=wall_s)
    row.output_tokens = sum(r.output_tokens for r in good)
    row.prompt_tokens = sum(r.prompt_len for r in good)
    if wall_s > 0:
        row.output_throughput = row.output_tokens / wall_s
        row.total_throughput = (row.output_tokens + row.prompt_tokens) / wall_s
        row.request_throughput = len(good) / wall_s
    row.ttft_ms = stats_ms([r.ttft for r in good])
    row.itl_ms = stats_ms([gap for r in good for gap in r.itl])
    row.tpot_ms = stats_ms([(r.e2e - r.ttft) / (r.output_tokens - 1) for r in good if r.output_tokens > 1])
    row.e2e_ms = stats_ms([r.e2e for r in good])
    row.cached_prompt_tokens = sum(r.cached_tokens for r in good)
    row.errors = sorted({r.error for r in results if r.error})[:5]
    short = sum(1 for r in good if r.output_tokens != r.expected_output_len)
    if short:
        row.notes.append(f"{short} requests generated a different number of tokens than asked")
    row.max_concurrency = client_peak_concurrency(results)
    if metrics is not None and metrics.available:
        row.server_peak_running = metrics.peak_running()
        row.kv_utilization = metrics.kv_utilization()
        row.kv_usage_mean = metrics.mean_kv_usage()
        row.kv_usage_peak = metrics.peak_kv_usage()
        row.prefix_cache_hit_rate = metrics.prefix_hit_rate()
        row.preemptions = metrics.counters.get("preemptions")
        row.kv_usage_series = [(s.t, s.kv_usage) for s in metrics.samples if s.kv_usage is not None]
        row.running_series = [(s.t, s.running) for s in metrics.samples if s.running is not None]
        row.running_high_water = metrics.running_high_water
        row.profile = step_profile(metrics, wall_s)
    return row


def step_profile(metrics: ServerMetrics, wall_s: float) -> dict:
    """Steps run, sequences per step, and step time split by phase (the gateway's counters)."""
    steps = metrics.counters.get("steps") or 0.0
    phases = metrics.step_time_by_phase
    profile = {"steps": int(steps), "prefill_tokens": metrics.counters.get("prompt_tokens"),
               "step_time_by_phase_s": phases}
    if steps:
        profile["mean_seqs_per_step"] = (metrics.counters.get("step_seqs") or 0.0) / steps
        profile["mean_step_ms"] = 1000.0 * phases.get("step", 0.0) / steps
    if wall_s and "step" in phases:
        profile["busy_fraction"] = phases["step"] / wall_s  # the rest: engine idle or between steps
    return profile


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0f} ms"


def table_lines(rows: list[Row]) -> list[str]:
    """The seed table's columns, as a Markdown table."""
    lines = ["| " + " | ".join(TABLE_COLUMNS) + " |", "|" + "---|" * len(TABLE_COLUMNS)]
    for row in rows:
        lines.append(f"| {row.name} | {row.max_concurrency if row.max_concurrency is not None else 'n/a'} | "
                     f"{row.output_throughput:.1f} | {_ms(row.ttft_ms.get('p99'))} | {_pct(row.kv_utilization)} |")
    return lines


def system_lines(rows: list[Row]) -> list[str]:
    """One line per system/precision: what ran (weights, threads, KV budget, transport) and how fast."""
    head = ("system", "weights", "threads", "KV budget", "transport", "done/failed", "output tok/s",
            "TTFT median", "TTFT P99", "ITL median", "ITL P99", "E2E P99")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        shown = r.name if not r.system or r.system.split()[0].lower() in r.name.lower() else f"{r.system}: {r.name}"
        lines.append(f"| {shown} | {r.weights or 'n/a'} | {'n/a' if r.threads is None else r.threads} | "
                     f"{r.kv_budget or 'n/a'} | {r.transport or 'n/a'} | {r.completed}/{r.failed} | "
                     f"{r.output_throughput:.1f} | {_ms(r.ttft_ms.get('median'))} | {_ms(r.ttft_ms.get('p99'))} | "
                     f"{_ms(r.itl_ms.get('median'))} | {_ms(r.itl_ms.get('p99'))} | {_ms(r.e2e_ms.get('p99'))} |")
    return lines


def detail_lines(rows: list[Row]) -> list[str]:
    """The numbers behind the table: latencies, KV usage, cache hits, fragmentation."""
    head = ("configuration", "done/failed", "total tok/s", "TTFT mean", "ITL mean", "ITL P99", "E2E P99",
            "peak running (server)",
            "KV blocks used mean/peak", "unused allocated slots", "internal fragmentation", "prefix hits",
            "preemptions")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        usage = f"{_pct(r.kv_usage_mean)} / {_pct(r.kv_usage_peak)}"
        lines.append(f"| {r.name} | {r.completed}/{r.failed} | {r.total_throughput:.1f} | "
                     f"{_ms(r.ttft_ms.get('mean'))} | {_ms(r.itl_ms.get('mean'))} | {_ms(r.itl_ms.get('p99'))} | "
                     f"{_ms(r.e2e_ms.get('p99'))} | {'n/a' if r.server_peak_running is None else r.server_peak_running} | "
                     f"{usage} | {_pct(r.unused_kv_slots)} | {_pct(r.internal_fragmentation)} | "
                     f"{_pct(r.prefix_cache_hit_rate)} | "
                     f"{'n/a' if r.preemptions is None else int(r.preemptions)} |")
    return lines


def ratio_lines(rows: list[Row], baseline: Row) -> list[str]:
    """Each row against the baseline: throughput × and TTFT P99 reduction."""
    lines = []
    base_p99 = baseline.ttft_ms.get("p99")
    for row in rows:
        speedup = row.output_throughput / baseline.output_throughput if baseline.output_throughput else float("nan")
        p99 = row.ttft_ms.get("p99")
        reduction = (1 - p99 / base_p99) if (p99 is not None and base_p99) else float("nan")
        line = f"{row.name}: throughput {speedup:.2f}x baseline"
        if reduction == reduction:  # not NaN
            line += (f", TTFT P99 {100 * reduction:.0f}% lower" if reduction >= 0
                     else f", TTFT P99 {-100 * reduction:.0f}% higher")
        lines.append(line)
    return lines


def profile_lines(rows: list[Row]) -> list[str]:
    """Per configuration: steps, batch size, mean step time and its split by phase."""
    lines = []
    for r in rows:
        p = r.profile
        if not p.get("steps"):
            continue
        phases = p.get("step_time_by_phase_s", {})
        total = phases.get("step") or 0.0
        split = ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in phases.items() if k != "step" and total)
        lines.append(f"- {r.name}: {p['steps']} steps, {p.get('mean_seqs_per_step', 0):.1f} seqs/step, "
                     f"{p.get('mean_step_ms', 0):.0f} ms/step, engine busy {100 * p.get('busy_fraction', 0):.0f}% "
                     f"of the run; step time: {split}")
    return lines


def cpu_lines(rows: list[Row], num_cpus: int) -> list[str]:
    """Per row: the CPU seconds each of its processes (and the benchmark client) used over the run,
    against what ``num_cpus`` CPUs offer in that time."""
    return [f"- {r.name}: {cpu_line(r.cpu_s, r.duration_s, num_cpus)}" for r in rows if r.cpu_s and r.duration_s]


def write_json(path: Path, rows: list[Row], meta: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=2))


def load_json(path: Path) -> tuple[list[Row], dict]:
    data = json.loads(Path(path).read_text())
    return [Row(**row) for row in data["rows"]], data.get("meta", {})


def write_plot(path: Path, rows: list[Row], title: str = "") -> None:
    """Throughput and TTFT P99 per configuration (bars), KV usage over time (lines)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r.name for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(17, 5.2))
    positions = np.arange(len(rows))
    axes[0].barh(positions, [r.output_throughput for r in rows], color="tab:blue")
    axes[0].set_title("output throughput (tok/s, higher is better)")
    axes[1].barh(positions, [(r.ttft_ms.get("p99") or 0.0) / 1000.0 for r in rows], color="tab:orange")
    axes[1].set_title("TTFT P99 (s, lower is better)")
    for ax in axes[:2]:
        ax.set_yticks(positions, names, fontsize=8)
        ax.invert_yaxis()
        ax.grid(axis="x", alpha=0.3)
    axes[1].set_yticklabels([])
    for row in rows:
        if row.kv_usage_series:
            t, usage = zip(*row.kv_usage_series)
            axes[2].plot(t, [100 * u for u in usage], label=row.name, linewidth=1.2)
    axes[2].set_title("KV blocks in use over time (% of budget)")
    axes[2].set_xlabel("seconds since the run started")
    axes[2].set_ylim(0, 105)
    axes[2].grid(alpha=0.3)
    if any(r.kv_usage_series for r in rows):
        axes[2].legend(fontsize=7, loc="lower right")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
