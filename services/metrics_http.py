"""A Prometheus registry served over HTTP (--metrics-port of either service)."""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, start_http_server

log = logging.getLogger(__name__)


class MetricsEndpoint:
    """Serves ``registry`` at /metrics from a daemon thread, once started."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self._server = None

    def serve(self, port: int, host: str = "0.0.0.0") -> int:
        """Starts the endpoint; returns the bound port (``port`` 0: a free one)."""
        self._server, _ = start_http_server(port, addr=host, registry=self.registry)
        bound = self._server.server_address[1]
        log.info("metrics on http://%s:%d/metrics", host, bound)
        return bound

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
