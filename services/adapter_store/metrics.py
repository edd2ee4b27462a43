"""Prometheus metrics of the adapter store, served over HTTP on --metrics-port.

Calls are counted as they end (by method and status, the servicer's error mapping: errors.py)
with the adapter bytes they moved; levels (uploads in flight, watchers) and the rescans'
announcements are read from the store at scrape time.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from services.metrics_http import MetricsEndpoint
from store.adapter_store import AdapterStore

METHODS = (
    "UploadAdapter", "FetchAdapter", "GetAdapter", "ListAdapters", "DeleteAdapter",
    "WatchAdapters",
)  # fmt: skip


class _StoreCollector(Collector):
    def __init__(self, store: AdapterStore) -> None:
        self._store = store

    def collect(self) -> Iterator:
        yield GaugeMetricFamily(
            "lorafleet_store_uploads_in_flight", "Uploads streaming in", value=self._store.uploads
        )
        yield GaugeMetricFamily(
            "lorafleet_store_watchers", "WatchAdapters streams", value=self._store.events.watchers
        )
        yield CounterMetricFamily(
            "lorafleet_store_rescan_events",
            "Changes of other store processes on the storage announced to this one's watchers",
            value=self._store.rescan.announced,
        )


class StoreMetrics(MetricsEndpoint):
    def __init__(self, store: AdapterStore) -> None:
        super().__init__(CollectorRegistry())
        self.calls = Counter(
            "lorafleet_store_calls",
            "Finished calls by method and status code",
            labelnames=["method", "code"],
            registry=self.registry,
        )
        self.adapter_bytes = Counter(
            "lorafleet_store_adapter_bytes",
            "Bytes of adapter_model.safetensors stored by uploads and streamed by fetches",
            labelnames=["direction"],
            registry=self.registry,
        )
        for method in METHODS:  # every series from the start, at zero
            self.calls.labels(method, "OK")
        for direction in ("upload", "fetch"):
            self.adapter_bytes.labels(direction)
        self.registry.register(_StoreCollector(store))

    def call(self, method: str, code: str) -> None:
        self.calls.labels(method, code).inc()
