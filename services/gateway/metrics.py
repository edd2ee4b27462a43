"""The gateway's Prometheus metrics, served at GET /metrics.

Requests by route and status, their latency (to the last byte, streams included), time to the
first token of generations as the gateway sees it (from its start of the Generate calls, after
the body is read and checked and a chat prompt rendered), generated tokens, and generations and
uploads in flight. Each app has its own registry, so that several apps in one process (tests)
do not collide.
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class GatewayMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "lorafleet_gateway_requests", "HTTP requests answered", ["route", "status"], registry=r
        )
        self.latency = Histogram(
            "lorafleet_gateway_request_seconds", "HTTP request latency, to the last byte",
            ["route"], buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.ttft = Histogram(
            "lorafleet_gateway_time_to_first_token_seconds",
            "start of the Generate calls (after the body is read and checked) to the first "
            "generated token of every choice",
            ["endpoint"], buckets=_TTFT_BUCKETS, registry=r,
        )  # fmt: skip
        self.tokens = Counter(
            "lorafleet_gateway_generated_tokens", "tokens generated for HTTP clients", registry=r
        )
        self.generations = Gauge(
            "lorafleet_gateway_generations_in_flight", "Generate calls running", registry=r
        )
        self.uploads = Gauge(
            "lorafleet_gateway_uploads_in_flight", "adapter uploads streaming", registry=r
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
