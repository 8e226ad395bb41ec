"""Prometheus metrics: vLLM's names (label ``model_name``) plus kvserve's own, per app registry."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from gateway.tenants import TenantLabels

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                   10.0, 20.0, 40.0, 80.0)
RPC_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
# kvmanager's TenantStats fields shown per tenant: (field, metric suffix, help). Cumulative
# values of kvmanager are gauges here (they restart from 0 when kvmanager does).
TENANT_STATS = (
    ("num_cached_blocks", "cached_blocks", "Blocks findable under the tenant, pinned included"),
    ("num_pinned_blocks", "pinned_blocks", "Blocks pinned for the tenant"),
    ("prefix_cache_queries", "prefix_cache_queries", "Prompt tokens looked up, cumulative"),
    ("prefix_cache_hits", "prefix_cache_hits", "Prompt tokens found cached, cumulative"),
    ("num_evictions_caused", "evictions_caused", "Cached blocks evicted to make room for the tenant, cumulative"),
    ("num_evictions_suffered", "evictions_suffered", "Cached blocks of the tenant evicted, cumulative"),
    ("num_quota_refusals", "quota_refusals", "Blocks not published: the tenant was at its quota, cumulative"),
    ("num_store_blocks", "store_blocks", "Store entries under the tenant"),
)
PER_LABEL_METRICS = ("tenant_requests", "tenant_gauges", "step_rpc", "step_time", "request_success", "dependency_up", "executor_up", "executor_steps",
                     "executor_overlapped_steps", "executor_mispredicted_steps",
                     "executor_running", "executor_waiting", "routing_decisions", "requests_migrated")
STEP_PHASES = ("step", "scheduler", "kvmanager_rpc", "executor_rpc", "executor_forward", "executor_total")


class GatewayMetrics:
    """Everything /metrics shows; the engine and the API layers call the ``on_*`` hooks."""

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name"]
        r = self.registry
        self.num_requests_running = Gauge("vllm:num_requests_running", "Requests in the running set", labels, registry=r)
        self.num_requests_waiting = Gauge("vllm:num_requests_waiting", "Requests waiting", labels, registry=r)
        self.kv_cache_usage = Gauge("vllm:kv_cache_usage_perc", "KV cache usage (0..1)", labels, registry=r)
        self.prefix_cache_queries = Counter("vllm:prefix_cache_queries", "Prompt tokens looked up", labels, registry=r)
        self.prefix_cache_hits = Counter("vllm:prefix_cache_hits", "Prompt tokens served from cache", labels, registry=r)
        self.num_preemptions = Counter("vllm:num_preemptions", "Preemptions (recompute)", labels, registry=r)
        self.store_hit_tokens = Counter("kvserve:kv_store_hit_tokens", "Prompt tokens loaded from the KV store "
                                        "tier instead of computed (also in vllm:prefix_cache_hits)", labels, registry=r)
        self.store_load_misses = Counter("kvserve:kv_store_load_misses", "Sequences recomputed because a store "
                                         "load missed (absent or corrupt entry, store unreachable)", labels, registry=r)
        self.spec_decode_num_draft_tokens = Counter(
            "vllm:spec_decode_num_draft_tokens", "Speculative draft tokens sent for verification", labels, registry=r)
        self.spec_decode_num_accepted_tokens = Counter(
            "vllm:spec_decode_num_accepted_tokens", "Speculative draft tokens accepted", labels, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of requests whose prefill finished", labels, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens", labels, registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token", labels,
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Inter-token latency", labels,
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency", labels,
                             buckets=LATENCY_BUCKETS, registry=r)
        self.request_success = Counter("vllm:request_success", "Finished requests", labels + ["finished_reason"],
                                       registry=r)
        self.step_rpc = Histogram("kvserve:step_rpc_seconds", "Per-step RPC time seen by the gateway",
                                  labels + ["service"], buckets=RPC_BUCKETS, registry=r)
        self.step_seconds = Histogram("kvserve:step_seconds", "Whole scheduler step", labels,
                                      buckets=RPC_BUCKETS + (5.0, 10.0), registry=r)
        self.step_time = Counter("kvserve:step_time_seconds", "Step time by phase (executor_* measured inside "
                                 "the executor)", labels + ["phase"], registry=r)
        self.steps = Counter("kvserve:steps", "Scheduler steps run", labels, registry=r)
        self.step_running_seqs = Counter("kvserve:step_running_seqs", "Sum over steps of sequences run",
                                         labels, registry=r)
        self.running_peak = Gauge("kvserve:num_requests_running_peak", "Most requests running at once",
                                  labels, registry=r)
        self.running_seqs = Gauge("kvserve:num_sequences_running", "Sequences in the running set", labels, registry=r)
        self.stored_tokens = Gauge("kvserve:kv_stored_tokens", "Tokens whose KV is stored (kvmanager)", labels,
                                   registry=r)
        self.allocated_slots = Gauge("kvserve:kv_allocated_slots", "Slots in blocks held (kvmanager)", labels,
                                     registry=r)
        self.used_blocks = Gauge("kvserve:kv_used_blocks", "Blocks in use (kvmanager)", labels, registry=r)
        self.responses_stored = Gauge("kvserve:responses_stored", "Responses API responses stored for "
                                      "previous_response_id", labels, registry=r)
        self.responses_stored_bytes = Gauge("kvserve:responses_stored_bytes", "Bytes of the stored responses "
                                            "(at most --responses-store-mib)", labels, registry=r)
        self.dependency_up = Gauge("kvserve:dependency_up", "Whether kvmanager/executor answer health checks",
                                   labels + ["service"], registry=r)
        executor = labels + ["executor"]
        self.executor_up = Gauge("kvserve:executor_up", "Whether the gateway can run steps on this executor",
                                 executor, registry=r)
        self.executor_steps = Counter("kvserve:executor_steps", "Steps run on this executor", executor, registry=r)
        self.executor_overlapped_steps = Counter(
            "kvserve:executor_overlapped_steps", "Decode steps whose Execute went out beside their kvmanager "
            "Allocate (its answer predicted)", executor, registry=r)
        self.executor_mispredicted_steps = Counter(
            "kvserve:executor_mispredicted_steps", "Overlapped steps kvmanager answered otherwise than predicted "
            "(a bug; the executor's sequences were recomputed)", executor, registry=r)
        self.executor_running = Gauge("kvserve:executor_num_sequences_running", "Sequences running on this "
                                      "executor", executor, registry=r)
        self.executor_waiting = Gauge("kvserve:executor_num_requests_waiting", "Requests waiting for this "
                                      "executor", executor, registry=r)
        self.routing_decisions = Counter("kvserve:routing_decisions", "Requests routed, by executor and by the "
                                         "policy that decided (kv, least-loaded, round-robin, only)",
                                         executor + ["policy"], registry=r)
        self.requests_migrated = Counter("kvserve:requests_migrated", "Requests taken off this executor (it "
                                         "failed) to be recomputed on one that can serve", executor, registry=r)
        # Per tenant (label bounded by gateway.tenants.TenantLabels: at most 64 names, the rest "other").
        self.tenant_requests = Counter("kvserve:tenant_requests", "Requests accepted, by tenant",
                                       labels + ["tenant"], registry=r)
        self.tenant_gauges = {
            field: Gauge(f"kvserve:tenant_{name}", f"{what} (kvmanager GetStats, summed over this gateway's "
                         f"pools; \"shared\" is the shared namespace)", labels + ["tenant"], registry=r)
            for field, name, what in TENANT_STATS}
        self._tenant_labels = TenantLabels()
        self.model_name = model_name
        self._peak = 0
        self._m = {name: metric.labels(model_name) for name, metric in self.__dict__.items()
                   if hasattr(metric, "labels") and name not in PER_LABEL_METRICS}
        self._phase = {phase: self.step_time.labels(model_name, phase) for phase in STEP_PHASES}
        self._rpc = {svc: self.step_rpc.labels(model_name, svc) for svc in ("kvmanager", "executor")}

    def set_queue(self, running_requests: int, waiting_requests: int, running_seqs: int) -> None:
        self._m["num_requests_running"].set(running_requests)
        self._m["num_requests_waiting"].set(waiting_requests)
        self._m["running_seqs"].set(running_seqs)
        if running_requests > self._peak:
            self._peak = running_requests
            self._m["running_peak"].set(running_requests)

    def on_step(self, *, step_s: float, kvmanager_s: float, executor_s: float, forward_s: float,
                executor_total_s: float, num_seqs: int, kv_usage: float | None) -> None:
        self._m["steps"].inc()
        self._m["step_running_seqs"].inc(num_seqs)
        self._m["step_seconds"].observe(step_s)
        self._rpc["kvmanager"].observe(kvmanager_s)
        if executor_s:
            self._rpc["executor"].observe(executor_s)
        self._phase["step"].inc(step_s)
        self._phase["scheduler"].inc(max(0.0, step_s - kvmanager_s - executor_s))
        self._phase["kvmanager_rpc"].inc(kvmanager_s)
        self._phase["executor_rpc"].inc(executor_s)
        self._phase["executor_forward"].inc(forward_s)
        self._phase["executor_total"].inc(executor_total_s)
        if kv_usage is not None:
            self._m["kv_cache_usage"].set(kv_usage)

    def on_prefix_lookup(self, queries: int, hits: int) -> None:
        if queries:
            self._m["prefix_cache_queries"].inc(queries)
        if hits:
            self._m["prefix_cache_hits"].inc(hits)

    def on_store(self, hit_tokens: int, load_misses: int) -> None:
        if hit_tokens:
            self._m["store_hit_tokens"].inc(hit_tokens)
        if load_misses:
            self._m["store_load_misses"].inc(load_misses)

    def on_spec_decode(self, drafted: int, accepted: int) -> None:
        if drafted:
            self._m["spec_decode_num_draft_tokens"].inc(drafted)
        if accepted:
            self._m["spec_decode_num_accepted_tokens"].inc(accepted)

    def on_preemptions(self, count: int) -> None:
        if count:
            self._m["num_preemptions"].inc(count)

    def on_tokens(self, count: int) -> None:
        self._m["generation_tokens"].inc(count)

    def on_first_token(self, seconds: float, prompt_tokens: int) -> None:
        self._m["ttft"].observe(seconds)
        self._m["prompt_tokens"].inc(prompt_tokens)

    def on_inter_token(self, seconds: float) -> None:
        self._m["itl"].observe(seconds)

    def on_request_finished(self, *, e2e_s: float, reason: str) -> None:
        self._m["e2e"].observe(e2e_s)
        self.request_success.labels(self.model_name, reason).inc()

    def on_pool_stats(self, stats) -> None:
        self._m["kv_cache_usage"].set(stats.usage)
        self._m["stored_tokens"].set(stats.num_stored_tokens)
        self._m["allocated_slots"].set(stats.num_allocated_slots)
        self._m["used_blocks"].set(stats.num_used_blocks)

    def on_response_store(self, entries: int, size_bytes: int) -> None:
        self._m["responses_stored"].set(entries)
        self._m["responses_stored_bytes"].set(size_bytes)

    def on_tenant_request(self, tenant: str) -> None:
        self.tenant_requests.labels(self.model_name, self._tenant_labels(tenant)).inc()

    def on_tenant_stats(self, pools: list) -> None:
        """Every pool's ``PoolStats.tenants``, summed per tenant label (tenants past the first 64
        seen are summed under "other")."""
        totals: dict[str, dict[str, float]] = {}
        for pool in pools:
            for tenant in pool.tenants:
                row = totals.setdefault(self._tenant_labels(tenant.tenant), dict.fromkeys(self.tenant_gauges, 0))
                for field in self.tenant_gauges:
                    row[field] += getattr(tenant, field)
        for field, gauge in self.tenant_gauges.items():
            gauge.clear()
            for label, row in totals.items():
                gauge.labels(self.model_name, label).set(row[field])

    def on_dependency(self, service: str, up: bool) -> None:
        self.dependency_up.labels(self.model_name, service).set(1 if up else 0)

    def on_executor_step(self, executor: str, running_seqs: int, waiting_requests: int) -> None:
        self.executor_steps.labels(self.model_name, executor).inc()
        self.executor_running.labels(self.model_name, executor).set(running_seqs)
        self.executor_waiting.labels(self.model_name, executor).set(waiting_requests)

    def on_overlapped_step(self, executor: str, matched: bool) -> None:
        self.executor_overlapped_steps.labels(self.model_name, executor).inc()
        if not matched:
            self.executor_mispredicted_steps.labels(self.model_name, executor).inc()

    def set_executor_up(self, executor: str, up: bool) -> None:
        self.executor_up.labels(self.model_name, executor).set(1 if up else 0)

    def on_route(self, executor: str, policy: str) -> None:
        self.routing_decisions.labels(self.model_name, executor, policy).inc()

    def on_migrated(self, executor: str, count: int) -> None:
        self.requests_migrated.labels(self.model_name, executor).inc(count)

    def forget_executor(self, executor: str) -> None:
        """An executor left: its gauges go (its counters stay, as Prometheus expects)."""
        for gauge in (self.executor_up, self.executor_running, self.executor_waiting):
            try:
                gauge.remove(self.model_name, executor)
            except KeyError:
                pass

    def render(self, names: list[str] | None = None) -> bytes:
        """The exposition text; ``names``: only those metrics (Prometheus' ``name[]`` filter: a
        sample's name, such as ``vllm:prefix_cache_queries_total``), none when no name is known."""
        return generate_latest(self.registry.restricted_registry(names) if names else self.registry)
