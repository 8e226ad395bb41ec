"""Samples the server's Prometheus ``/metrics`` during a run.

Gauges (running requests, KV usage, stored tokens vs allocated slots) are
sampled every ``interval`` seconds to get peaks and time averages; counters
(prefix-cache queries and hits, preemptions) are read as end minus start.
Metric names are vLLM's where vLLM has one; the KV-utilization pair is kvserve's
own, and a few spellings are accepted so the tool survives a rename.
"""
from __future__ import annotations

import asyncio
import math
import re
import time
from dataclasses import dataclass, field

import httpx

RUNNING = ("vllm:num_requests_running",)
WAITING = ("vllm:num_requests_waiting",)
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
# Tokens whose K/V are held in the cache (each physical slot counted once) and
# slots handed out to sequences (used blocks x block size, reserved or not).
KV_STORED = ("kvserve:kv_stored_tokens", "kvserve:kv_cache_stored_tokens", "kvserve:kv_tokens_stored")
KV_ALLOCATED = ("kvserve:kv_allocated_slots", "kvserve:kv_cache_allocated_slots", "kvserve:kv_slots_allocated")
PREFIX_QUERIES = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_queries")
PREFIX_HITS = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_hits")
PREEMPTIONS = ("vllm:num_preemptions_total", "vllm:num_preemptions")
PROMPT_TOKENS = ("vllm:prompt_tokens_total", "vllm:prompt_tokens")
GENERATION_TOKENS = ("vllm:generation_tokens_total", "vllm:generation_tokens")
RUNNING_PEAK = ("kvserve:num_requests_running_peak",)  # high-water mark kept by the gateway
STEPS = ("kvserve:steps_total", "kvserve:steps")
STEP_SEQS = ("kvserve:step_running_seqs_total", "kvserve:step_running_seqs")
COUNTERS = {"prefix_cache_queries": PREFIX_QUERIES, "prefix_cache_hits": PREFIX_HITS,
            "preemptions": PREEMPTIONS, "prompt_tokens": PROMPT_TOKENS,
            "generation_tokens": GENERATION_TOKENS, "steps": STEPS, "step_seqs": STEP_SEQS}
# Where a scheduler step's time goes, by phase (the gateway's own profile).
STEP_TIME = ("kvserve:step_time_seconds_total", "kvserve:step_time_seconds")
# What a sample between the first and the last reads: asked for by name (Prometheus' ``name[]``
# filter), so that the server under test renders, and the sampler parses, a few lines four times a
# second instead of every histogram (~3 ms of the gateway's CPU a scrape against 0.1). Servers
# that do not filter send everything, which parses the same.
SAMPLED_GAUGES = RUNNING + WAITING + KV_USAGE + KV_STORED + KV_ALLOCATED

_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def parse_prometheus(text: str) -> dict[str, float]:
    """Metric name → value, summed over label sets (one model, one engine: sums are totals).

    Histogram series keep their ``_bucket``/``_sum``/``_count`` suffixes, so they
    never collide with the gauges and counters read here.
    """
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if not match:
            continue
        name, _labels, raw = match.groups()
        try:
            value = float(raw)
        except ValueError:
            continue
        if math.isnan(value):
            continue
        values[name] = values.get(name, 0.0) + value
    return values


def parse_labeled(text: str, names: tuple[str, ...], label: str) -> dict[str, float]:
    """``label`` value → value for the first of ``names`` found (e.g. step time by phase)."""
    found: dict[str, dict[str, float]] = {}
    pattern = re.compile(label + r'="([^"]*)"')
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if not match or match.group(1) not in names or not match.group(2):
            continue
        key = pattern.search(match.group(2))
        if key:
            per = found.setdefault(match.group(1), {})
            per[key.group(1)] = per.get(key.group(1), 0.0) + float(match.group(3))
    for name in names:
        if name in found:
            return found[name]
    return {}


def pick(values: dict[str, float], names: tuple[str, ...]) -> float | None:
    """The first of ``names`` present in ``values``."""
    for name in names:
        if name in values:
            return values[name]
    return None


@dataclass
class MetricSample:
    t: float  # seconds since the run started
    running: float | None
    waiting: float | None
    kv_usage: float | None  # fraction of KV blocks in use, 0..1
    kv_stored: float | None
    kv_allocated: float | None


def sample_from(values: dict[str, float], t: float) -> MetricSample:
    usage = pick(values, KV_USAGE)
    if usage is not None and usage > 1.0:
        usage /= 100.0  # some servers export a percentage
    return MetricSample(t, pick(values, RUNNING), pick(values, WAITING), usage,
                        pick(values, KV_STORED), pick(values, KV_ALLOCATED))


@dataclass
class ServerMetrics:
    """What the sampler saw over one run."""

    samples: list[MetricSample] = field(default_factory=list)
    counters: dict[str, float] = field(default_factory=dict)  # end - start
    step_time_by_phase: dict[str, float] = field(default_factory=dict)  # seconds, end - start
    running_high_water: float | None = None  # the gateway's own peak gauge at the end
    available: bool = False

    def peak_running(self) -> int | None:
        """Most requests running in any sample (the gateway's high-water gauge is kept apart:
        it can catch a transient mid-step count)."""
        running = [s.running for s in self.samples if s.running is not None]
        return int(max(running)) if running else None

    def mean_kv_usage(self) -> float | None:
        usage = [s.kv_usage for s in self.samples if s.kv_usage is not None and (s.running or 0) > 0]
        return sum(usage) / len(usage) if usage else None

    def peak_kv_usage(self) -> float | None:
        usage = [s.kv_usage for s in self.samples if s.kv_usage is not None]
        return max(usage) if usage else None

    def kv_utilization(self) -> float | None:
        """Tokens stored / slots allocated, summed over samples (a time-weighted ratio)."""
        pairs = [(s.kv_stored, s.kv_allocated) for s in self.samples
                 if s.kv_stored is not None and s.kv_allocated]
        allocated = sum(a for _, a in pairs)
        return sum(st for st, _ in pairs) / allocated if allocated else None

    def prefix_hit_rate(self) -> float | None:
        queries = self.counters.get("prefix_cache_queries")
        return self.counters.get("prefix_cache_hits", 0.0) / queries if queries else None

    def to_json(self) -> dict:
        return {
            "available": self.available,
            "counters": self.counters,
            "step_time_by_phase": self.step_time_by_phase,
            "running_high_water": self.running_high_water,
            "samples": [vars(s) for s in self.samples],
        }


async def scrape(client: httpx.AsyncClient, base_url: str) -> str:
    """The text of ``{base_url}/metrics``, once."""
    return (await client.get(base_url + "/metrics")).text


class MetricsSampler:
    """Polls ``{base_url}/metrics`` in the background between ``start()`` and ``stop()``."""

    def __init__(self, base_url: str, interval: float = 0.25):
        self.url = f"{base_url}/metrics"
        self.interval = interval
        self.result = ServerMetrics()
        self._task: asyncio.Task | None = None
        self._client: httpx.AsyncClient | None = None
        self._first: dict[str, float] | None = None
        self._last: dict[str, float] | None = None
        self._first_text = self._last_text = ""
        self._t0 = 0.0

    async def _scrape(self, names: tuple[str, ...] = ()) -> str | None:
        try:
            reply = await self._client.get(self.url, params={"name[]": list(names)} if names else None)
            reply.raise_for_status()
        except httpx.HTTPError:
            return None
        return reply.text

    async def _record(self, everything: bool = True) -> None:
        """One sample; ``everything``: the whole text, kept as the run's first or last (the
        counters' end points), else only the sampled gauges."""
        text = await self._scrape(() if everything else SAMPLED_GAUGES)
        if text is None:
            return
        values = parse_prometheus(text)
        self.result.available = True
        if everything:
            if self._first is None:
                self._first, self._first_text = values, text
            self._last, self._last_text = values, text
        self.result.samples.append(sample_from(values, time.perf_counter() - self._t0))

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await self._record(everything=False)

    async def start(self, t0: float | None = None) -> None:
        self._t0 = time.perf_counter() if t0 is None else t0
        self._client = httpx.AsyncClient(timeout=5.0)
        await self._record()  # the counters' starting point
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> ServerMetrics:
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        if self._client:
            await self._record()  # the counters' end point
            await self._client.aclose()
        if self._first is not None and self._last is not None:
            for key, names in COUNTERS.items():
                end, begin = pick(self._last, names), pick(self._first, names)
                if end is not None:
                    self.result.counters[key] = end - (begin or 0.0)
            begin_phases = parse_labeled(self._first_text, STEP_TIME, "phase")
            self.result.step_time_by_phase = {
                phase: seconds - begin_phases.get(phase, 0.0)
                for phase, seconds in parse_labeled(self._last_text, STEP_TIME, "phase").items()}
            self.result.running_high_water = pick(self._last, RUNNING_PEAK)
        return self.result
