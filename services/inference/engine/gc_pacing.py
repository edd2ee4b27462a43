"""Garbage collection paced by the engine's step thread.

CPython collects automatically when an allocation pushes generation 0's count past its
threshold, on whichever thread allocated (often the asyncio event loop's), holding the GIL
that the step thread needs to launch the next step. The step thread, however, spends most of a
GPU step waiting for the device with the GIL released (the sampler's host sync): a collection
run right after a step's GPU work was queued costs nothing, the GPU computes meanwhile.

So after start-up the service calls pace_collections(): automatic collection goes off and the
step thread calls collect_if_due() after queueing each step (and on idle loop iterations, so
garbage never piles up while nothing runs), which runs the collection CPython would run by now.

Invariants:
- While paced, gc is disabled and collections run only in collect_if_due(), so only on the
  threads that call it (the engine's step loop); release() turns automatic collection back on.
- collect_if_due() collects nothing until generation 0's count reaches its threshold (as
  CPython), then the oldest generation that is due (one collection; an older one includes the
  younger ones).
- The pacer is one per process because gc's state is: the module's functions act on _PACER.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

log = logging.getLogger(__name__)

# Full (generation 2) collections. CPython 3.11-3.13 runs one only when count2 exceeds
# threshold2 AND the objects promoted to generation 2 since the last full collection exceed 25%
# of those that survived it, so that scanning the whole heap stays proportional to what was
# allocated; Python cannot read those two numbers. The rule here bounds the same cost in time
# instead: count2 must reach threshold2 and, since the last full collection ended, at least
# max(FULL_MIN_INTERVAL_S, its duration / FULL_DUTY) must have passed. A full collection thus
# takes at most 1% of the step thread's time, however large the heap grows (a 10 ms one runs at
# most once a second), and cyclic garbage that reached generation 2 waits at most that long.
# A full collection measured with the engine loaded, after the start-up freeze: 0.4-0.5 ms on a
# 2-core CPU while 64 requests decode (tiny model; 58 ms before the freeze); 10 ms on the H200
# host during adapter loads (bench/adapter_load.py, automatic collection).
FULL_DUTY = 0.01
FULL_MIN_INTERVAL_S = 1.0
# A full collection this long is logged as a warning: it outlasts a decode step of a full batch
# on a GPU (tens of ms), so the device idles for the difference.
SLOW_FULL_S = 0.05


class PacingStats(NamedTuple):
    collections: tuple[int, int, int] = (0, 0, 0)  # paced collections run, per generation
    seconds: tuple[float, float, float] = (0.0, 0.0, 0.0)  # their total duration, per generation
    active: bool = False


def due_generation(
    counts: tuple[int, int, int],
    thresholds: tuple[int, int, int],
    since_full_s: float,
    full_interval_s: float,
) -> int | None:
    """The generation to collect now, or None. ``counts`` and ``thresholds`` as gc.get_count()
    and gc.get_threshold() return them; a full collection also needs ``since_full_s`` (time
    since the last one ended) to reach ``full_interval_s``. threshold0 == 0 means never (as
    gc.set_threshold(0) disables automatic collection)."""
    (c0, c1, c2), (t0, t1, t2) = counts, thresholds
    if t0 <= 0 or c0 < t0:
        return None
    if c2 >= t2 and since_full_s >= full_interval_s:
        return 2
    if c1 >= t1:
        return 1
    return 0


class GcPacer:
    def __init__(
        self,
        full_duty: float = FULL_DUTY,
        full_min_interval_s: float = FULL_MIN_INTERVAL_S,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if not 0 < full_duty <= 1:
            raise ValueError(f"full_duty must be in (0, 1], got {full_duty}")
        if full_min_interval_s < 0:
            raise ValueError(f"full_min_interval_s must be >= 0, got {full_min_interval_s}")
        self.full_duty = full_duty
        self.full_min_interval_s = full_min_interval_s
        self._clock = clock
        self._lock = threading.Lock()  # one collection at a time; a busy pacer skips
        self._active = False
        self._collections = [0, 0, 0]
        self._seconds = [0.0, 0.0, 0.0]
        self._full_end = clock()
        self._full_seconds = 0.0

    def pace(self, freeze: bool = True) -> None:
        """Turn automatic collection off; collect_if_due() collects from now on. ``freeze``
        (once, after start-up): collect everything first, then move every object alive (model,
        tokenizer, CUDA graphs, imported modules: they live as long as the process) out of the
        collector's sight, so later collections stay short (with the tiny model a full
        collection took 58 ms before the freeze and 0.4 ms after, on a 2-core CPU)."""
        if freeze:
            freeze_start_up("garbage collection paced by the step thread", self._clock)
        with self._lock:
            gc.disable()
            self._active = True
            # The heap just frozen is not what the next full collection scans: no duration yet.
            self._full_end, self._full_seconds = self._clock(), 0.0

    def release(self) -> None:
        """Automatic collection back on (no-op unless paced); frozen objects stay frozen."""
        with self._lock:
            if self._active:
                self._active = False
                gc.enable()

    def collect_if_due(self) -> int | None:
        """Run the collection that is due (see due_generation) and return its generation; None
        when not paced, nothing is due, or another thread is collecting through this pacer."""
        if not self._active or not self._lock.acquire(blocking=False):
            return None
        try:
            if not self._active:  # released meanwhile
                return None
            now = self._clock()
            interval = self._full_interval(self._full_seconds)
            gen = due_generation(gc.get_count(), gc.get_threshold(), now - self._full_end, interval)
            if gen is None:
                return None
            gc.collect(gen)
            end = self._clock()
            self._collections[gen] += 1
            self._seconds[gen] += end - now
            if gen == 2:
                self._full_end, self._full_seconds = end, end - now
                if end - now >= SLOW_FULL_S:
                    log.warning(
                        "a full garbage collection took %.0f ms on the step thread (the device "
                        "idles for what outlasts the step queued before it); the next waits %.0f s",
                        (end - now) * 1000, self._full_interval(end - now),
                    )  # fmt: skip
            return gen
        finally:
            self._lock.release()

    def _full_interval(self, full_seconds: float) -> float:
        """How long after a full collection of ``full_seconds`` the next may run."""
        return max(self.full_min_interval_s, full_seconds / self.full_duty)

    def stats(self) -> PacingStats:
        return PacingStats(tuple(self._collections), tuple(self._seconds), self._active)


def freeze_start_up(what: str, clock: Callable[[], float] = time.perf_counter) -> None:
    """Collect, then move every object alive out of the collector's sight (gc.freeze): what
    start-up leaves (imported modules, the model, the gRPC server) lives as long as the process,
    and full collections then scan only what was allocated since. ``what``: the log's subject."""
    t = clock()
    gc.collect()
    gc.freeze()
    log.info("%s; %d start-up objects frozen (collected in %.1f ms)", what,
             gc.get_freeze_count(), (clock() - t) * 1000)  # fmt: skip


_PACER = GcPacer()


def pace_collections(freeze: bool = True) -> None:
    """Call once after start-up (the service, the benchmark); see GcPacer.pace."""
    _PACER.pace(freeze)


def release() -> None:
    _PACER.release()


def collect_if_due() -> int | None:
    """The step thread's call: after queueing a step's GPU work, and when idle."""
    return _PACER.collect_if_due()


def stats() -> PacingStats:
    return _PACER.stats()
