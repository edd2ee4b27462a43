"""Preloader: the store's adapters into free host memory, and free pool pages, before a request
wants them.

A request whose adapter is only in the store waits for its fetch (tens of milliseconds for a
rank-8 Llama-7B adapter alone, seconds in a burst of cold adapters); one whose bytes are in the
host cache waits for the copy into the page pool (a step or two of the engine's loop); one whose
adapter is in the pool waits for nothing. The service follows the store's watch anyway
(store_client.py), which names every adapter's latest version and size; the preloader
fetches those versions, up to PRELOAD_STREAMS at a time (PRELOAD_BYTES between them), into
the host cache while it has free room, as S-LoRA keeps every adapter in host memory, and
(``place``, --preload-adapters pool) then copies each into the page pool while at least
engine.PRELOAD_FREE_SHARE of its pages stay free, as S-LoRA's unified pool keeps adapters
resident in pages the KV cache does not need (the engine evicts an idle one when KV needs its
pages). It never takes room from a request:

- it starts a preload only while no request's fetch is in flight, so it does not share the
  store's or the fetch worker's bandwidth with one (those it started may run beside a request's
  that came later: at most PRELOAD_STREAMS adapters' transfers, PRELOAD_BYTES between them);
- a preload takes free room only, never evicts, and never takes room fetches wait for; the
  cache lists a preloaded adapter least recently used, so that room for a request's fetch is
  made from preloaded adapters first;
- a pool placement takes free pages and a free index row only, never evicting (PoolBusy);
- a store error skips that version (a request for it fetches it and reports the error).

It starts preloads in the order the watch names adapters (the store's replay at connect, then
new versions as they are created), skips versions no longer the latest, places each in the pool
as it lands, and stops starting more at the first that does not fit (it goes back to the queue's
front), looking again when the watch names a new version or every IDLE_RECHECK_S;
placements stop likewise when the pool has no free room, and are tried again after
IDLE_RECHECK_S. A placed adapter whose pages the KV cache took back (a burst of long requests)
is placed again, in the order they were first placed, once the pool has free room again: every
IDLE_RECHECK_S the preloader looks which of them left the pool (``in_pool``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable

from services.inference.engine.api import AdapterKey
from services.inference.host_cache import HostCache
from services.inference.store_client import AdapterEvent, StoreClient

log = logging.getLogger(__name__)

IDLE_RECHECK_S = 2.0  # how often a preloader that found no room looks again
# Preloads streaming at once. One at a time the fetch path idles between adapters: on the H200
# host four at a time moved 1.28-1.29 GB/s against 0.71-0.79 one at a time, side by side
# (bench/fetch_burst.py --preload 1 4, bench/results/fetch_burst_worker.json). A request's
# fetch that comes meanwhile shares the path with what is left of them, so they also hold at
# most PRELOAD_BYTES between them (one always may start): four rank-8 Llama-7B adapters, one of
# rank 64, as much as one preload of that rank held back a request's fetch before there were
# several.
PRELOAD_STREAMS = 4
PRELOAD_BYTES = 128 * 2**20
BUSY_RECHECK_S = 0.02  # how often it looks whether requests' fetches are still in flight


class Preloader:
    def __init__(
        self,
        store: StoreClient,
        cache: HostCache,
        place: Callable[[AdapterKey], Awaitable[bool]] | None = None,
        in_pool: Callable[[AdapterKey], bool] | None = None,
        streams: int = PRELOAD_STREAMS,
        max_bytes: int = PRELOAD_BYTES,
    ) -> None:
        """``place``: copies an adapter whose bytes are in the host cache into free pool pages
        (AdapterRegistry.place): True once it is there, False when the pool has no free room;
        None: host cache only. ``in_pool``: whether an adapter is in the page pool now; with
        it, placed adapters that left the pool are placed again. ``streams``: preloads at once
        (they also take the store client's fetch slots); ``max_bytes``: their bytes, at most,
        once more than one streams."""
        if streams < 1:
            raise ValueError(f"streams must be at least 1, got {streams}")
        self._store = store
        self._streams = streams
        self._max_bytes = max_bytes
        # preloads streaming now -> (the order started, the version, its bytes)
        self._flights: dict[asyncio.Future, tuple[int, AdapterKey, int]] = {}
        self._started = 0
        self._placer: asyncio.Future | None = None  # placing what waits for the pool
        self._cache = cache
        self._place = place
        self._unplaced: OrderedDict[AdapterKey, None] = OrderedDict()  # in the cache, not placed
        self._pool_busy_until = 0.0  # no placement is tried before this (time.monotonic())
        self.placed = 0  # copied into the page pool (placed again included)
        self._in_pool = in_pool
        self._placed_keys: OrderedDict[AdapterKey, None] = OrderedDict()  # in the order placed
        self._look_back_at = 0.0  # when to look next which placed adapters left the pool
        self.returned = 0  # placed adapters found out of the pool and queued to be placed again
        # adapter id -> its latest version the watch named and that version's bytes
        self._latest: dict[str, tuple[int, int]] = {}
        # adapters whose latest version is not preloaded yet, in the order the watch named them
        # (those put back after a preload that did not land first)
        self._pending: OrderedDict[str, None] = OrderedDict()
        self._returned: dict[str, int] = {}  # put back at the front -> the order started
        self._wake = asyncio.Event()
        self.preloaded = 0  # landed in the cache
        self.failed = 0  # skipped after a store error
        self._stalled: AdapterKey | None = None  # the version that found no room, logged once
        self._pool_paused = False  # placements wait for the pool's free pages (logged once)

    @property
    def pending(self) -> int:
        """Versions named by the watch and not yet preloaded or skipped (streaming included)."""
        streaming = {key.adapter_id for _, key, _ in self._flights.values()}
        return len(self._pending) + len(streaming - self._pending.keys())

    def on_event(self, event: AdapterEvent) -> None:
        """The store's watch: a created version replaces any older one of its adapter in the
        queue (one named again, as a reconnected watch's replay does, is looked at again); a
        deleted one leaves it."""
        latest = self._latest.get(event.adapter_id, (0, 0))[0]
        if event.created and event.version >= latest:  # the watch's replay names it again
            self._latest[event.adapter_id] = (event.version, event.size_bytes)
            self._pending[event.adapter_id] = None
            self._wake.set()
        elif not event.created and event.version == latest:
            del self._latest[event.adapter_id]
            self._pending.pop(event.adapter_id, None)
            self._returned.pop(event.adapter_id, None)

    async def run(self) -> None:
        """Preloads until cancelled."""
        try:
            while True:
                self._wake.clear()  # set again by versions the watch names from here on
                self._requeue_evicted()
                await self._preload_pending()
                try:
                    await asyncio.wait_for(self._wake.wait(), IDLE_RECHECK_S)
                except TimeoutError:
                    pass
        finally:
            for task in self._flights:  # their transfers go on to the cache (store_client.py)
                task.cancel()
            if self._placer is not None:
                self._placer.cancel()

    async def _preload_pending(self) -> None:
        """Preloads the queue's versions in order, up to ``streams`` at once (and ``max_bytes``
        between them), until the queue is empty or one finds no room; each that lands is placed
        in the pool (in the order they land) while the others stream and more start."""
        stalled = False
        while (self._pending and not stalled) or self._flights:
            while (
                self._pending
                and not stalled
                and len(self._flights) < self._streams
                and not self._store.demand_fetches  # requests' fetches first
            ):
                adapter_id = next(iter(self._pending))
                version, nbytes = self._latest[adapter_id]
                streaming = sum(b for _, _, b in self._flights.values())
                if self._flights and streaming + nbytes > self._max_bytes:
                    break  # more once one has landed
                del self._pending[adapter_id]
                self._returned.pop(adapter_id, None)
                key = AdapterKey(adapter_id, version)
                if key in self._cache:
                    self._unplaced_add(key)
                    continue
                self._started += 1
                task = asyncio.ensure_future(self._store.preload(key, nbytes))
                self._flights[task] = (self._started, key, nbytes)
            if not self._flights:
                if not self._pending or stalled:
                    break
                await asyncio.sleep(BUSY_RECHECK_S)  # a request's fetch streams: wait
                continue
            done, _ = await asyncio.wait(
                self._flights, timeout=BUSY_RECHECK_S, return_when=asyncio.FIRST_COMPLETED
            )
            back: list[tuple[int, AdapterKey, int]] = []  # to the queue's front
            for task in done:
                started, key, nbytes = self._flights.pop(task)
                try:
                    landed = task.result()
                except Exception as exc:  # a request for it will fetch it and report the error
                    log.warning("preloading adapter %s failed: %s", key, exc)
                    self.failed += 1
                    continue
                if landed or key in self._cache:
                    self.preloaded += landed
                    self._unplaced_add(key)
                    continue
                back.append((started, key, nbytes))
                if self._store.demand_fetches:  # a request's fetch took it meanwhile
                    continue
                stalled = True
                if self._stalled != key:
                    self._stalled = key
                    log.info(
                        "preloading stops at adapter %s: no free room for its %d bytes in the "
                        "host cache (%d adapters named by the store wait for room)",
                        key, nbytes, len(self._pending) + len(back),
                    )  # fmt: skip
            self._put_back(back)
            self._kick_placer()
        self._kick_placer()

    def _put_back(self, back: list[tuple[int, AdapterKey, int]]) -> None:
        """Preloads that did not land go back to the queue's front, with those put back before
        them, in the order they were started: the next pass starts them first."""
        for started, key, _ in back:
            if self._is_latest(key) and key.adapter_id not in self._pending:
                self._pending[key.adapter_id] = None
                self._returned[key.adapter_id] = started
        for adapter_id in sorted(self._returned, key=self._returned.__getitem__, reverse=True):
            self._pending.move_to_end(adapter_id, last=False)

    def _kick_placer(self) -> None:
        """Places what waits for the pool (in order, one after another) on a task of its own,
        if that task is not running already, so that fetches start and go on meanwhile: a
        placement is a round trip through the engine's step loop and a copy (when placements
        waited for each fetch, 1000 rank-8 adapters took 45.4 s into the pool against 34.7 s
        into the host cache alone on the H200: about 11 ms a placement)."""
        if (
            self._place is not None
            and self._unplaced
            and (self._placer is None or self._placer.done())
        ):
            self._placer = asyncio.ensure_future(self._place_unplaced())

    def _unplaced_add(self, key: AdapterKey) -> None:
        """A version now in the host cache: queued to be placed in the pool (with ``place``)."""
        if self._place is not None:
            self._unplaced[key] = None

    async def _place_unplaced(self) -> None:
        """Copies the host-preloaded adapters into the pool in order, until it has no free room
        (then not again for IDLE_RECHECK_S) or a request's fetch is in flight."""
        while self._unplaced and time.monotonic() >= self._pool_busy_until:
            if self._store.demand_fetches:
                return  # requests first; the next pass goes on
            key = next(iter(self._unplaced))
            if not self._is_latest(key) or key not in self._cache:  # superseded, deleted, evicted
                del self._unplaced[key]
                continue
            try:
                placed = await self._place(key)
            except Exception as exc:  # its request will meet the same error and report it
                log.warning("placing preloaded adapter %s in the page pool failed: %s", key, exc)
                del self._unplaced[key]
                continue
            if not placed:
                if not self._pool_paused:  # once a pause: it rechecks every IDLE_RECHECK_S
                    self._pool_paused = True
                    log.info(
                        "preloading into the page pool pauses at adapter %s: the pool keeps "
                        "its free pages for the KV cache (%d preloaded adapters wait)",
                        key, len(self._unplaced),
                    )  # fmt: skip
                self._pool_busy_until = time.monotonic() + IDLE_RECHECK_S
                return
            if self._pool_paused:
                self._pool_paused = False
                log.info(
                    "preloading into the page pool resumes at adapter %s (%d preloaded "
                    "adapters wait)", key, len(self._unplaced) - 1,
                )  # fmt: skip
            self.placed += 1
            del self._unplaced[key]
            self._placed_keys[key] = None

    def _requeue_evicted(self) -> None:
        """At most every IDLE_RECHECK_S: the placed adapters no longer in the pool (the KV
        cache took their pages) are queued to be placed again; those superseded, deleted or
        evicted from the host cache are forgotten."""
        now = time.monotonic()
        if self._in_pool is None or not self._placed_keys or now < self._look_back_at:
            return
        self._look_back_at = now + IDLE_RECHECK_S
        for key in list(self._placed_keys):
            if not self._is_latest(key) or key not in self._cache:
                del self._placed_keys[key]
            elif not self._in_pool(key):
                del self._placed_keys[key]
                self._unplaced[key] = None
                self.returned += 1

    def _is_latest(self, key: AdapterKey) -> bool:
        """Whether ``key`` is its adapter's latest version the watch named (not superseded or
        deleted)."""
        return self._latest.get(key.adapter_id, (0, 0))[0] == key.version
