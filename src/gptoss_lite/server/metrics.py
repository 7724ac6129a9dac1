"""Prometheus metrics of one server (its own registry, so two apps in one process never mix figures).

Request counts and latency histograms are recorded as requests end; engine figures (running and
waiting requests, KV blocks, prefix-cache hits, preemptions, and each tenant's queues and tokens) are
read at scrape time from the engine loop's last stats snapshot, so a scrape never waits for, or
touches, the engine. Series labelled `tenant` name tenants, which is why /metrics needs a key on a
keyed server (docs/server.md#metrics).
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

PREFIX = "gptoss"

# Bucket edges in seconds: a CPU-served tiny model answers in milliseconds, a large one in seconds.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
# A browser search takes milliseconds, a python cell up to its 120 s limit.
TOOL_BUCKETS = (0.001, 0.005, 0.025, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# Time in the queue: none at all on an idle server, up to a tenant's max_queue_time (minutes) under a flood.
QUEUE_BUCKETS = (0.001, 0.005, 0.025, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class ServerMetrics:
    """The metrics of one app. `snapshot()` returns the engine's latest EngineStats (or None)."""

    def __init__(self, snapshot):
        self.registry = CollectorRegistry()
        self.requests = Counter(
            f"{PREFIX}_requests",
            "HTTP requests to the API endpoints, by endpoint and response status",
            ("endpoint", "status"),
            registry=self.registry,
        )
        self.ttft = Histogram(
            f"{PREFIX}_time_to_first_token_seconds",
            "Seconds from a request's arrival in the engine to its first generated token",
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            f"{PREFIX}_inter_token_latency_seconds",
            "Seconds between consecutive generated tokens of one request",
            buckets=ITL_BUCKETS,
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            f"{PREFIX}_prompt_tokens",
            "Prompt tokens of finished requests, by tenant",
            ("tenant",),
            registry=self.registry,
        )
        self.cached_tokens = Counter(
            f"{PREFIX}_prefix_cache_hit_tokens",
            "Prompt tokens served from the prefix cache, by tenant",
            ("tenant",),
            registry=self.registry,
        )
        self.aborted = Counter(
            f"{PREFIX}_client_aborts",
            "Requests aborted because their client disconnected",
            registry=self.registry,
        )
        self.stalled = Counter(
            f"{PREFIX}_stalled_client_aborts",
            "Streams aborted because their client stopped reading for the stall timeout",
            registry=self.registry,
        )
        self.harmony_malformed = Counter(
            f"{PREFIX}_harmony_malformed",
            "Harmony completions the parser refused (their text was answered as content)",
            registry=self.registry,
        )
        self.tool_calls = Counter(
            f"{PREFIX}_tool_calls",
            "Built-in tool calls run inside /v1/responses, by tool (browser, python, mcp:LABEL)",
            ("tool",),
            registry=self.registry,
        )
        self.tool_errors = Counter(
            f"{PREFIX}_tool_errors",
            "Built-in tool calls that ended in an error the model read, by tool",
            ("tool",),
            registry=self.registry,
        )
        self.tool_seconds = Histogram(
            f"{PREFIX}_tool_call_seconds",
            "Seconds one built-in tool call took, by tool",
            ("tool",),
            buckets=TOOL_BUCKETS,
            registry=self.registry,
        )
        self.rejected = Counter(
            f"{PREFIX}_tenant_rejected_requests",
            "Requests answered 429 before they were queued, by tenant and code (rate_limit_exceeded: the "
            "tenant's quota; queue_full: --max-waiting requests already waited)",
            ("tenant", "code"),
            registry=self.registry,
        )
        self.queue_time = Histogram(
            f"{PREFIX}_tenant_queue_time_seconds",
            "Seconds a request waited from its arrival in the engine to its first admission, by tenant "
            "(observed when it finishes; a request that timed out in the queue counts its whole wait)",
            ("tenant",),
            buckets=QUEUE_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_EngineCollector(snapshot))

    def record_finished(self, output, tenant: str) -> None:
        """Latency histograms of one finished sample, and its request's time in the queue (called on
        the engine thread)."""
        m = output.metrics
        if m.ttft is not None:
            self.ttft.observe(m.ttft)
        for gap in m.itl:
            self.itl.observe(gap)
        if output.index == 0:  # one figure per request: its other samples were forked, never queued
            if m.scheduled_time is not None:
                self.queue_time.labels(tenant).observe(m.scheduled_time - m.arrival_time)
            elif output.error_code == "queue_timeout":
                self.queue_time.labels(tenant).observe(time.monotonic() - m.arrival_time)

    def record_rejected(self, tenant: str, code: str) -> None:
        """A request refused with a 429 before it was queued."""
        self.rejected.labels(tenant, code).inc()

    def record_tool(self, tool: str, seconds: float, error: bool) -> None:
        """One built-in tool call: its count, its time, and whether it ended in an error."""
        self.tool_calls.labels(tool).inc()
        self.tool_seconds.labels(tool).observe(seconds)
        if error:
            self.tool_errors.labels(tool).inc()

    def record_usage(self, tenant: str, prompt_tokens: int, cached_tokens: int) -> None:
        self.prompt_tokens.labels(tenant).inc(prompt_tokens)
        self.cached_tokens.labels(tenant).inc(cached_tokens)


class _EngineCollector:
    """Engine gauges and counters, read from the latest snapshot at scrape time."""

    def __init__(self, snapshot):
        self.snapshot = snapshot

    def collect(self):
        s = self.snapshot()
        if s is None:
            return
        gauges = (
            ("requests_running", "Requests being generated", s.num_running),
            ("requests_waiting", "Requests waiting to be scheduled", s.num_waiting),
            ("kv_blocks_total", "Blocks in the KV pool", s.kv_blocks_total),
            ("kv_blocks_used", "KV blocks held, by requests or pinned by the prefix cache", s.kv_blocks_used),
            ("kv_blocks_free", "KV blocks held by nobody", s.kv_blocks_free),
            ("kv_blocks_cached", "KV blocks held only by the prefix cache (reclaimable)", s.kv_blocks_cached),
            ("prefix_cache_hit_rate", "Prompt tokens found in the prefix cache / tokens looked up", s.prefix_hit_rate),
            ("kv_cache_bytes", "Bytes allocated for K/V, scales and full-precision tails included", s.kv_bytes),
        )
        for name, doc, value in gauges:
            yield GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=value)
        kv_format = GaugeMetricFamily(
            f"{PREFIX}_kv_format",
            "How full-layer K/V is stored (dense: the model's dtype; otherwise the name of its codes)",
            labels=["format"],
        )
        kv_format.add_metric([s.kv_format], 1)
        yield kv_format
        counters = (
            ("prefix_cache_queries", "Prefix-cache lookups (admissions and resumptions)", s.prefix_queries),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache", s.prefix_hits),
            ("preemptions", "Requests preempted to free KV blocks", s.preemptions),
            ("spec_draft_tokens", "Speculative draft tokens proposed (serve --speculate)", s.spec_drafted),
            ("spec_accepted_tokens", "Speculative draft tokens the verification kept", s.spec_accepted),
            ("spec_verifications", "Drafts verified (a request's step that carried one)", s.spec_verifications),
            ("spec_emitted_tokens", "Tokens emitted by verified steps (accepted drafts + one each)", s.spec_tokens),
            ("requests_finished", "Requests the engine finished", s.finished),
            ("requests_aborted", "Requests the engine aborted", s.aborted),
            ("requests_failed", "Requests the engine ended with an error, confined to them", s.failed),
            ("generation_tokens", "Tokens generated", s.generated_tokens),
        )
        for name, doc, value in counters:
            yield CounterMetricFamily(f"{PREFIX}_{name}", doc, value=value)
        yield from _tenant_families(s.tenants)


def _tenant_families(tenants: dict):
    """Each tenant's queues and tokens (engine/fairness.py's TenantCounters), labelled by tenant."""
    gauges = (
        ("requests_running", "Requests of the tenant being generated (each of n samples counts)", "running"),
        ("requests_waiting", "Requests of the tenant waiting for a slot", "waiting"),
    )
    for name, doc, attr in gauges:
        family = GaugeMetricFamily(f"{PREFIX}_tenant_{name}", doc, labels=("tenant",))
        for tenant, c in sorted(tenants.items()):
            family.add_metric((tenant,), getattr(c, attr))
        yield family
    counters = (
        ("admitted_requests", "Requests of the tenant admitted to run (first admissions)", "admitted_requests"),
        (
            "admitted_tokens",
            "Prompt tokens the engine took on for the tenant (uncached; recomputation after a preemption included)",
            "admitted_tokens",
        ),
        ("generated_tokens", "Tokens generated for the tenant", "generated_tokens"),
        (
            "queue_timeouts",
            "Requests of the tenant that waited longer than its max_queue_time and were answered 429 queue_timeout",
            "expired",
        ),
    )
    for name, doc, attr in counters:
        family = CounterMetricFamily(f"{PREFIX}_tenant_{name}", doc, labels=("tenant",))
        for tenant, c in sorted(tenants.items()):
            family.add_metric((tenant,), getattr(c, attr))
        yield family
