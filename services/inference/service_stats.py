"""Windows over recent events: latency percentiles and a token rate, for GetStats and metrics."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterable
from typing import NamedTuple

from services.inference.engine.api import DeviceMemory
from services.inference.engine.gc_pacing import PacingStats


class LatencySummary(NamedTuple):
    count: int  # events since start
    mean: float  # seconds, over the window
    p50: float
    p99: float
    max: float


class LatencyWindow:
    """The last ``size`` durations; percentiles by nearest rank. Thread-safe."""

    def __init__(self, size: int = 1024) -> None:
        self._samples: deque[float] = deque(maxlen=size)
        self._count = 0
        self._lock = threading.Lock()

    def add(self, seconds: float) -> None:
        with self._lock:
            self._samples.append(seconds)
            self._count += 1

    @property
    def last(self) -> float:
        with self._lock:
            return self._samples[-1] if self._samples else 0.0

    def summary(self) -> LatencySummary:
        with self._lock:
            samples = list(self._samples)
            count = self._count
        return summarize(samples, count)


def summarize(samples: Iterable[float], count: int) -> LatencySummary:
    """Mean and nearest-rank percentiles of ``samples``; ``count`` is the all-time total."""
    ordered = sorted(samples)
    if not ordered:
        return LatencySummary(count, 0.0, 0.0, 0.0, 0.0)

    def rank(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return LatencySummary(count, sum(ordered) / len(ordered), rank(0.5), rank(0.99), ordered[-1])


class RateWindow:
    """Events per second over the last ``window`` seconds, from a monotonically growing total."""

    def __init__(self, window: float = 10.0) -> None:
        self._window = window
        self._points: deque[tuple[float, int]] = deque()
        self._lock = threading.Lock()

    def rate(self, total: int, now: float | None = None) -> float:
        """Records ``total`` at ``now`` and returns the rate over the window."""
        now = time.monotonic() if now is None else now
        with self._lock:
            self._points.append((now, total))
            while len(self._points) > 2 and now - self._points[1][0] >= self._window:
                self._points.popleft()
            t0, n0 = self._points[0]
        return (total - n0) / (now - t0) if now > t0 else 0.0


class StatsSnapshot(NamedTuple):
    """Everything GetStats reports and the metrics endpoint exports, taken at one moment."""

    queued: int  # waiting in the engine's queue
    running: int
    waiting_for_adapter: int  # waiting for a fetch (service) or a copy into the pool (engine)
    total_pages: int
    free_pages: int
    kv_pages: int
    adapter_pages: int
    page_size: int
    tokens_per_second: float
    generated_tokens: int
    adapters_in_pool: int
    host_capacity_bytes: int
    host_used_bytes: int
    host_entries: int
    host_pinned: bool
    host_waiting: int  # fetches waiting for room in the host cache (bytes held by requests)
    adapter_fetch: LatencySummary
    adapter_copy: LatencySummary
    adapter_load: LatencySummary
    evictions_gpu: int
    evictions_host: int
    evictions_gpu_queued: int  # of evictions_gpu: adapters queued requests waited for
    fetch_worker_starts: int  # 0 without a store; above 1 after the worker died
    memory: DeviceMemory = DeviceMemory()  # the engine's (EngineStats.memory)
    engine_gc: PacingStats = PacingStats()  # the engine's step thread's (EngineStats.gc)
