"""Prometheus metrics of the inference service, served over HTTP on --metrics-port.

Latencies are observed as they happen (histograms); levels and totals that the engine and the
adapter registry already count are read from one StatsSnapshot at scrape time, so GetStats and
the metrics endpoint never disagree.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from services.auth import Caller, Role
from services.inference.service_stats import StatsSnapshot
from services.metrics_http import MetricsEndpoint

# Seconds: decode steps are milliseconds on a GPU and tens of milliseconds on a CPU.
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_LOAD_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class _SnapshotCollector(Collector):
    def __init__(self, snapshot: Callable[[], StatsSnapshot]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator:
        s = self._snapshot()
        yield GaugeMetricFamily(
            "lorafleet_queue_depth",
            "Requests waiting for a batch slot or an adapter",
            value=s.queued + s.waiting_for_adapter,
        )
        yield GaugeMetricFamily(
            "lorafleet_running_requests", "Requests in the running batch", value=s.running
        )
        yield GaugeMetricFamily(
            "lorafleet_tokens_per_second",
            "Generated tokens per second, recent window",
            value=s.tokens_per_second,
        )
        yield CounterMetricFamily(
            "lorafleet_generated_tokens", "Generated tokens since start", value=s.generated_tokens
        )
        pages = GaugeMetricFamily(
            "lorafleet_pool_pages", "Pages of the unified pool by use", labels=["kind"]
        )
        pages.add_metric(["kv"], s.kv_pages)
        pages.add_metric(["adapter"], s.adapter_pages)
        pages.add_metric(["free"], s.free_pages)
        yield pages
        yield GaugeMetricFamily(
            "lorafleet_adapters_in_pool",
            "Adapters resident in the page pool",
            value=s.adapters_in_pool,
        )
        host = GaugeMetricFamily(
            "lorafleet_host_cache_bytes", "Host cache of adapter bytes", labels=["kind"]
        )
        host.add_metric(["used"], s.host_used_bytes)
        host.add_metric(["capacity"], s.host_capacity_bytes)
        yield host
        yield GaugeMetricFamily(
            "lorafleet_host_cache_waiting_fetches",
            "Adapter fetches waiting for room in the host cache (its bytes held by requests)",
            value=s.host_waiting,
        )
        evictions = CounterMetricFamily(
            "lorafleet_adapter_evictions", "Adapter evictions by tier", labels=["tier"]
        )
        evictions.add_metric(["gpu"], s.evictions_gpu)
        evictions.add_metric(["host"], s.evictions_host)
        yield evictions
        yield CounterMetricFamily(
            "lorafleet_adapter_evictions_queued",
            "Of the pool's adapter evictions, adapters that only requests far back in the queue "
            "wanted, evicted for running sequences' KV cache",
            value=s.evictions_gpu_queued,
        )
        yield CounterMetricFamily(
            "lorafleet_fetch_worker_starts",
            "Starts of the fetch worker process; more than one means it died and was restarted",
            value=s.fetch_worker_starts,
        )
        memory = GaugeMetricFamily(
            "lorafleet_device_memory_bytes",
            "The engine's device memory: total, free (any process's use counted), and the most "
            "its allocator held at once (peak_reserved); 0 on the CPU",
            labels=["kind"],
        )
        for kind, value in s.memory._asdict().items():
            memory.add_metric([kind], value)
        yield memory
        runs = CounterMetricFamily(
            "lorafleet_engine_gc_collections",
            "Garbage collections the engine's step thread ran between steps, by generation "
            "(2: full)",
            labels=["generation"],
        )
        seconds = CounterMetricFamily(
            "lorafleet_engine_gc_seconds",
            "Their time, by generation: a collection that outlasts the step queued before it "
            "idles the device for the difference",
            labels=["generation"],
        )
        for gen in range(3):
            runs.add_metric([str(gen)], s.engine_gc.collections[gen])
            seconds.add_metric([str(gen)], s.engine_gc.seconds[gen])
        yield runs
        yield seconds


def tenant_label(caller: Caller | None) -> str:
    """A caller as the per-tenant series name it: a tenant's name, else its role in
    parentheses (no tenant name has them), "(unknown)" for a call refused before it was known."""
    if caller is None:
        return "(unknown)"
    return caller.tenant if caller.role is Role.TENANT else f"({caller.role.value})"


class ServiceMetrics(MetricsEndpoint):
    """The service's metrics in their own registry (several services may share a process)."""

    def __init__(self) -> None:
        super().__init__(CollectorRegistry())
        self.ttft = Histogram(
            "lorafleet_time_to_first_token_seconds",
            "Generate call to its first token",
            buckets=_TOKEN_BUCKETS,
            registry=self.registry,
        )
        self.inter_token = Histogram(
            "lorafleet_inter_token_latency_seconds",
            "Time between a request's tokens",
            buckets=_TOKEN_BUCKETS,
            registry=self.registry,
        )
        self.adapter_load = Histogram(
            "lorafleet_adapter_load_seconds",
            "Adapter load phases: fetch (store to host cache for a request), preload (store to "
            "host cache ahead of requests), copy (host cache to page pool)",
            labelnames=["phase"],
            buckets=_LOAD_BUCKETS,
            registry=self.registry,
        )
        self.adapter_loads = Counter(
            "lorafleet_adapter_loads",
            "Adapter loads: into the host cache (fetched from the store for a request), into it "
            "ahead of requests (preload), and into the page pool",
            labelnames=["target"],
            registry=self.registry,
        )
        self.requests = Counter(
            "lorafleet_requests",
            "Finished Generate calls by status code",
            labelnames=["code"],
            registry=self.registry,
        )
        # Per caller: a tenant's name, or the role of a caller without one ("(admin)", and
        # "(anonymous)" without --auth-tokens): usage a tenant can be shown or billed for.
        self.tenant_requests = Counter(
            "lorafleet_tenant_requests",
            "Finished Generate calls by caller (a tenant, or (admin) / (anonymous)) and status",
            labelnames=["tenant", "code"],
            registry=self.registry,
        )
        self.tenant_tokens = Counter(
            "lorafleet_tenant_tokens",
            "Tokens of Generate calls by caller: prompt (of calls that ran) and completion "
            "(streamed, of ended and cancelled calls alike)",
            labelnames=["tenant", "kind"],
            registry=self.registry,
        )
        # Every series exists from the start, at zero, so a dashboard's rate() and a scrape
        # before the first load see the same names as after it.
        for phase in ("fetch", "preload", "copy"):
            self.adapter_load.labels(phase)
        for target in ("host", "preload", "pool"):
            self.adapter_loads.labels(target)

    def track(self, snapshot: Callable[[], StatsSnapshot]) -> None:
        """Export the levels and totals of ``snapshot`` at every scrape."""
        self.registry.register(_SnapshotCollector(snapshot))

    def observe_load(self, phase: str, seconds: float) -> None:
        """One adapter load phase: fetch or preload (store -> host) or copy (host -> pool).
        Thread-safe."""
        self.adapter_load.labels(phase).observe(seconds)
        if phase == "fetch":
            self.adapter_loads.labels("host").inc()
        elif phase == "preload":
            self.adapter_loads.labels("preload").inc()
        elif phase == "copy":
            self.adapter_loads.labels("pool").inc()

    def observe_call(self, caller: str, code: str, prompt_tokens: int, completion_tokens: int):
        """A finished Generate call of ``caller`` (tenant_label) with status ``code``."""
        self.requests.labels(code).inc()
        self.tenant_requests.labels(caller, code).inc()
        if prompt_tokens or completion_tokens:
            self.tenant_tokens.labels(caller, "prompt").inc(prompt_tokens)
            self.tenant_tokens.labels(caller, "completion").inc(completion_tokens)
