"""The inference service's client of the adapter store: lookups, fetches, and the watch follower.

A fetch writes FetchAdapter's chunks straight into a block of the host cache's arena (pinned on
CUDA), sized by the AdapterInfo that leads the stream. The stream is received by the fetch
worker process (fetch_worker.py: in this process it would take the GIL from the engine's step
thread), which decodes chunks without copies (fetch_wire.py) and copies each once, into the
arena that it shares with this process. Fetches are
single-flight: concurrent callers for one adapter version share one stream, and the fetch runs
to completion even if every caller went away (the bytes stay cached). A caller may have the
entry held for it (``hold``): the hold is taken as the entry is cached, before any other fetch
could evict it.
At most ``max_fetches`` fetches stream at once; the others wait for a slot, first come first
served, and a fetch's deadline counts its own transfer only. Streamed together, the adapters a
burst of requests wants share the worker's and the store's bandwidth, so each lands late: the
saturating trace with 1000 adapters fetched 572 at once, each taking a median 12.0 s, the
longest 17.3 s (bench/results/serving_n1000_fetches.txt.gz). A few at a time they land in turn,
the first after about one adapter's transfer, and as many bytes move (bench/fetch_burst.py, 256
rank-8 Llama-7B adapters at once on the 16-core H200 host: median landing 2.44-2.51 s all at
once, 1.87-2.19 s eight at a time, at 920-955 against 1036-1134 MB/s; on 2 cores, 96 adapters:
1.95-2.02 s against 1.40-1.74 s, at 580-657 against 547-627 MB/s, the store's peak memory 778 MB
against 402). Bounded, they also bound what the store holds for this service's reads.
A preload (preload.py) is a fetch that no request waits for: it streams into free room the
preloader reserved, evicts nothing, and counts apart from the requests' fetches; a request for
the same version joins it as it would any fetch in flight.
When the host cache has no room for the size the AdapterInfo announces, the stream is dropped,
the fetch waits in the cache's queue until room is released (host_cache.py), and it asks again
with the block reserved; it leaves the queue once every caller went away.
The follower keeps a WatchAdapters stream open, reconnecting with backoff. When a
(re)connected stream answers, it first tells its owner to forget what it knew of the latest
versions, then passes on the store's replay of the latest version of every adapter, so a version
created or deleted while the store was away is not served as the latest afterwards. (Deletions
missed meanwhile do not retire copies already held.)
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import grpc

from lorafleet.v1 import adapter_store_pb2 as pb
from lorafleet.v1 import adapter_store_pb2_grpc as pb_grpc
from services.inference.arena import ArenaBlock
from services.inference.engine.api import AdapterKey
from services.inference.errors import AdapterNotFound, StoreUnavailable
from services.inference.fetch_wire import RECONNECT_OPTIONS
from services.inference.fetch_worker import PROTOCOL_ERROR, AdapterCheck
from services.inference.fetcher import FetchFailed, FetchWorker
from services.inference.host_cache import HostCache, HostCacheBusy, HostEntry
from services.inference.service_stats import LatencyWindow
from services.inference.store_access import StoreAccess
from services.outage import Outage

log = logging.getLogger(__name__)


# While the watch keeps failing, a warning at its first failure and then one this often
# (services/outage.py).
WATCH_WARN_EVERY_S = 60.0

_UNAVAILABLE = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.DATA_LOSS,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.CANCELLED,
)


@dataclass
class _Flight:
    """One fetch in flight and the callers that wait for it."""

    task: asyncio.Task | None = None
    callers: int = 0
    holders: int = 0  # callers the entry is held for once cached
    held: bool = False  # the entry is cached, held once per holder
    waiting_for_room: bool = False  # queued in the host cache, not streaming
    waiting_for_slot: bool = False  # queued for one of the streams (max_fetches)
    preload: bool = False  # started by the preloader: free room only, while no caller waits


class PreloadSkipped(Exception):
    """A preload found no free room for the size the store announced: nothing was fetched."""


class AdapterEvent(NamedTuple):
    created: bool  # False: deleted
    adapter_id: str
    version: int
    size_bytes: int = 0  # the adapter's bytes (as the store announced them)


def _store_error(exc: grpc.aio.AioRpcError, what: str) -> Exception:
    """A store status as the service's domain error."""
    return _status_error(exc.code(), exc.details(), what)


def _status_error(code: grpc.StatusCode, details: str, what: str) -> Exception:
    if code == grpc.StatusCode.NOT_FOUND:
        return AdapterNotFound(f"{what}: {details}")
    if code in _UNAVAILABLE:
        return StoreUnavailable(
            f"{what}: the adapter store is unavailable ({code.name}: {details}); "
            f"the base model and adapters already held keep serving"
        )
    return StoreUnavailable(f"{what}: the adapter store answered {code.name}: {details}")


def _fetch_error(exc: FetchFailed, what: str) -> Exception:
    """A failed fetch (the worker's report) as the service's domain error."""
    if exc.code == PROTOCOL_ERROR:
        return StoreUnavailable(f"{what}: {exc.details}")
    code = getattr(grpc.StatusCode, exc.code, grpc.StatusCode.UNKNOWN)
    return _status_error(code, exc.details, what)


class StoreClient:
    def __init__(
        self,
        target: str | StoreAccess,
        cache: HostCache,
        lookup_timeout: float,
        fetch_timeout: float,
        max_fetches: int = 8,
    ) -> None:
        """``target``: HOST:PORT, or a StoreAccess with the token and TLS to use;
        ``max_fetches``: adapters streamed at once (the rest wait, in order)."""
        if max_fetches < 1:
            raise ValueError(f"max_fetches must be at least 1, got {max_fetches}")
        access = target if isinstance(target, StoreAccess) else StoreAccess(target)
        self.target = access.target
        self._cache = cache
        self._lookup_timeout = lookup_timeout
        self._fetch_timeout = fetch_timeout
        self._slots = asyncio.Semaphore(max_fetches)
        self.streaming = 0  # fetches streaming now (at most max_fetches)
        # Lookups and the watch; fetches have the worker's own channel. Every call carries
        # the service's token (store_access.py), read again when its file changes.
        self._token = access.token()
        self._channel = access.aio_channel(RECONNECT_OPTIONS)
        self._stub = pb_grpc.AdapterStoreStub(self._channel)
        self._worker = FetchWorker(access, cache.arena)  # fetches run in their own process
        # Set by the owner: fetched adapters are validated by the worker too (AdapterCheck).
        self.adapter_check: AdapterCheck | None = None
        self._inflight: dict[AdapterKey, _Flight] = {}
        self.fetch_latency = LatencyWindow()  # one sample per fetch, however many waited
        self.on_fetched: Callable[[float], None] | None = None
        self.preloads = 0  # adapters preloaded into the host cache (preload.py)
        self.on_preloaded: Callable[[float], None] | None = None

    async def close(self) -> None:
        for flight in list(self._inflight.values()):
            flight.task.cancel()
        self._worker.close()
        await self._channel.close()

    def _metadata(self) -> tuple[tuple[str, str], ...]:
        return () if self._token is None else self._token.metadata()

    @property
    def fetch_worker_starts(self) -> int:
        """Starts of the fetch worker process (restarts after it died count too)."""
        return self._worker.starts

    async def lookup(self, adapter_id: str, version: int = 0) -> pb.AdapterInfo:
        """The store's AdapterInfo; version 0 = the latest."""
        what = f"adapter {adapter_id!r}" + (f" version {version}" if version else "")
        try:
            return await self._stub.GetAdapter(
                pb.GetAdapterRequest(adapter_id=adapter_id, version=version),
                timeout=self._lookup_timeout,
                metadata=self._metadata(),
            )
        except grpc.aio.AioRpcError as exc:
            raise _store_error(exc, what) from None

    @property
    def demand_fetches(self) -> int:
        """Fetches in flight other than preloads that no request has joined."""
        return sum(1 for f in self._inflight.values() if f.callers or not f.preload)

    async def fetch(self, key: AdapterKey, hold: bool = False) -> HostEntry:
        """The adapter's bytes in the host cache: a hit, a fetch in flight, or a new fetch.
        With ``hold`` the entry comes held once for the caller (who releases it)."""
        while True:
            try:
                return await self._fetch_once(key, hold)
            except PreloadSkipped:  # joined a preload that found no room: fetch on its own
                continue

    async def preload(self, key: AdapterKey, nbytes: int) -> bool:
        """Fetches ``key`` into the host cache's free room ahead of any request: True when it
        landed; False when it is cached or in flight already, or when no free range of
        ``nbytes`` is left (nothing is evicted for it). Raises as fetch does."""
        if key in self._cache or key in self._inflight:
            return False
        block = self._cache.reserve_free(nbytes)
        if block is None:
            return False
        flight = self._start(key, _Flight(preload=True), block)
        try:
            await asyncio.shield(flight.task)
        except PreloadSkipped:
            return False
        return True

    def _start(self, key: AdapterKey, flight: _Flight, block: ArenaBlock | None = None) -> _Flight:
        flight.task = asyncio.get_running_loop().create_task(self._fetch(key, flight, block))
        self._inflight[key] = flight
        flight.task.add_done_callback(lambda _t, k=key, f=flight: self._landed(k, f))
        return flight

    async def _fetch_once(self, key: AdapterKey, hold: bool) -> HostEntry:
        entry = self._cache.get(key)
        if entry is not None:
            if hold:
                self._cache.hold(key)
            return entry
        flight = self._inflight.get(key)
        if flight is None:
            flight = self._start(key, _Flight())
        flight.callers += 1
        flight.holders += hold
        try:
            # shield: one caller's cancellation must not cancel the fetch the others wait on.
            return await asyncio.shield(flight.task)
        except PreloadSkipped:
            self._landed(key, flight)  # forgotten now: the caller's next try starts its own
            raise
        except asyncio.CancelledError:
            if flight.held:
                if hold:  # taken for this caller as the entry was cached
                    self._cache.release(key)
            elif not flight.task.done():
                flight.callers -= 1
                flight.holders -= hold
                waiting = flight.waiting_for_room or flight.waiting_for_slot
                if not flight.callers and not flight.preload and waiting:
                    # Nobody waits for it any more: it leaves the cache's or the slots' queue
                    # (and is forgotten now, so that a new caller starts a fetch of its own;
                    # a preload goes on).
                    self._landed(key, flight)
                    flight.task.cancel()
            raise

    def _landed(self, key: AdapterKey, flight: _Flight) -> None:
        if self._inflight.get(key) is flight:
            del self._inflight[key]

    async def _fetch(
        self, key: AdapterKey, flight: _Flight | None = None, ready: ArenaBlock | None = None
    ) -> HostEntry:
        """``ready``: a block reserved for the announced size (a preload's, or after waiting
        for room), used if the size matches."""
        what = f"adapter {key.adapter_id!r} version {key.version}"
        flight = flight or _Flight()

        def reserve(info: pb.AdapterInfo) -> ArenaBlock:
            nonlocal ready
            block, ready = ready, None
            if block is not None and block.size == info.size_bytes:
                return block
            if block is not None:  # not the size announced before: reserve anew
                self._cache.discard(block)
            if flight.preload and not flight.callers:  # free room only
                block = self._cache.reserve_free(info.size_bytes)
                if block is None:
                    raise PreloadSkipped(f"no free room for {what} ({info.size_bytes} bytes)")
                return block
            return self._cache.reserve(info.size_bytes)  # HostCacheBusy: wait, HostCacheFull

        try:
            while True:
                flight.waiting_for_slot = True
                try:
                    await self._slots.acquire()
                finally:
                    flight.waiting_for_slot = False
                start = time.perf_counter()
                self.streaming += 1
                try:
                    info, block, verdict = await self._worker.fetch(
                        key.adapter_id, key.version, self._fetch_timeout, reserve,
                        self._cache.discard, self.adapter_check,
                    )  # fmt: skip
                    break
                except FetchFailed as exc:
                    raise _fetch_error(exc, what) from None
                except HostCacheBusy as exc:
                    busy = exc  # the slot goes to the next fetch while this one waits for room
                finally:
                    self.streaming -= 1
                    self._slots.release()
                log.info("%s waits for room in the host cache: %s", what, busy)
                flight.waiting_for_room = True
                try:
                    ready = await self._cache.reserve_when_free(busy.nbytes)
                finally:
                    flight.waiting_for_room = False
                log.info("%s: room in the host cache after %.3f s", what,
                         time.perf_counter() - start)  # fmt: skip
        finally:
            if ready is not None:  # the stream failed before it announced the adapter
                self._cache.discard(ready)
        # No await from here on: the holds are taken before anything else could evict it.
        entry = self._cache.put(key, block, info.adapter_config_json, verdict)
        if flight.preload and not flight.callers:
            self._cache.demote(key)  # evicted before adapters that requests used
        for _ in range(flight.holders):
            self._cache.hold(key)
        flight.held = True
        seconds = time.perf_counter() - start
        if flight.preload:  # no request waited for it to start
            self.preloads += 1
            if self.on_preloaded is not None:
                self.on_preloaded(seconds)
        else:
            self.fetch_latency.add(seconds)
            if self.on_fetched is not None:
                self.on_fetched(seconds)
        log.info(
            "%s %s: %.1f MB in %.3f s (%.0f MB/s)",
            "preloaded" if flight.preload else "fetched",
            what,
            block.size / 1e6,
            seconds,
            block.size / 1e6 / max(seconds, 1e-9),
        )
        return entry

    async def follow(
        self,
        on_event: Callable[[AdapterEvent], None],
        on_connect: Callable[[], None],
        max_backoff: float = 2.0,
    ) -> None:
        """Follows WatchAdapters until cancelled. On each (re)connect the store replays the
        latest version of every adapter (include_existing) before new events; on_connect is
        called once the stream answers (the store sends its headers first, so also when it
        holds no adapter), before its first event."""
        self._worker.start()  # the service follows the store from its start: fetch soon
        backoff = 0.1
        outage = Outage(log, f"watching the adapter store at {self.target}", WATCH_WARN_EVERY_S)
        while True:
            call = self._stub.WatchAdapters(
                pb.WatchAdaptersRequest(include_existing=True), metadata=self._metadata()
            )
            try:
                await call.initial_metadata()
                if not call.done():  # headers came (a call that failed ends without them)
                    on_connect()  # the replay that starts now tells the latest versions
                    outage.succeeded()
                    backoff = 0.1
                async for event in call:  # a failed call raises here
                    created = event.type == pb.ADAPTER_EVENT_TYPE_CREATED
                    if created or event.type == pb.ADAPTER_EVENT_TYPE_DELETED:
                        info = event.adapter
                        on_event(
                            AdapterEvent(created, info.adapter_id, info.version, info.size_bytes)
                        )
                log.warning("the adapter store ended its watch stream; reconnecting")
            except grpc.aio.AioRpcError as exc:
                outage.failed(f"{exc.code().name}: {exc.details()}", f"retrying in {backoff:g} s")
            finally:
                call.cancel()
            await asyncio.sleep(backoff)
            backoff = min(max_backoff, backoff * 2)
