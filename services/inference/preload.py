"""Preloader: the store's adapters into the host cache's free room before a request wants them.

A request whose adapter is only in the store waits for its fetch (tens of milliseconds for a
rank-8 Llama-7B adapter alone, seconds in a burst of cold adapters), where one whose bytes are in
the host cache waits only for the copy to the GPU. The service follows the store's watch anyway
(store_client.py), which names every adapter's latest version and size; the preloader fetches
those versions, one at a time, into the cache while it has free room, as S-LoRA keeps every
adapter in host memory. It never takes room from a request:

- it starts a preload only while no request's fetch is in flight, so it does not share the
  store's or the fetch worker's bandwidth with one (one it started may run beside a request's
  that came later: one adapter's transfer);
- a preload takes free room only, never evicts, and never takes room fetches wait for; the
  cache lists a preloaded adapter least recently used, so that room for a request's fetch is
  made from preloaded adapters first;
- a store error skips that version (a request for it fetches it and reports the error).

It preloads in the order the watch names adapters (the store's replay at connect, then new
versions as they are created), skips versions no longer the latest, and stops at the first
that does not fit, looking again when the watch names a new version or every IDLE_RECHECK_S.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict

from services.inference.engine.api import AdapterKey
from services.inference.host_cache import HostCache
from services.inference.store_client import AdapterEvent, StoreClient

log = logging.getLogger(__name__)

IDLE_RECHECK_S = 2.0  # how often a preloader that found no room looks again
BUSY_RECHECK_S = 0.02  # how often it looks whether requests' fetches are still in flight


class Preloader:
    def __init__(self, store: StoreClient, cache: HostCache) -> None:
        self._store = store
        self._cache = cache
        # adapter id -> (latest version, its bytes), in the order the watch named them
        self._pending: OrderedDict[str, tuple[int, int]] = OrderedDict()
        self._wake = asyncio.Event()
        self.preloaded = 0  # landed in the cache
        self.failed = 0  # skipped after a store error
        self._stalled: AdapterKey | None = None  # the version that found no room, logged once

    @property
    def pending(self) -> int:
        """Versions named by the watch and not yet preloaded or skipped."""
        return len(self._pending)

    def on_event(self, event: AdapterEvent) -> None:
        """The store's watch: a created version replaces any older one of its adapter in the
        queue; a deleted one leaves it."""
        old = self._pending.get(event.adapter_id)
        if event.created:
            if old is None or old[0] < event.version:
                self._pending[event.adapter_id] = (event.version, event.size_bytes)
                self._wake.set()
        elif old is not None and old[0] == event.version:
            del self._pending[event.adapter_id]

    async def run(self) -> None:
        """Preloads until cancelled."""
        while True:
            self._wake.clear()  # set again by versions the watch names from here on
            await self._preload_pending()
            try:
                await asyncio.wait_for(self._wake.wait(), IDLE_RECHECK_S)
            except TimeoutError:
                pass

    async def _preload_pending(self) -> None:
        """Preloads the queue's versions in order, until it is empty or one finds no room."""
        while self._pending:
            while self._store.demand_fetches:  # requests' fetches first
                await asyncio.sleep(BUSY_RECHECK_S)
            adapter_id, (version, nbytes) = next(iter(self._pending.items()))
            key = AdapterKey(adapter_id, version)
            if key in self._cache:
                del self._pending[adapter_id]
                continue
            try:
                landed = await self._store.preload(key, nbytes)
            except Exception as exc:  # a request for it will fetch it and report the error
                log.warning("preloading adapter %s failed: %s", key, exc)
                self.failed += 1
                self._drop(adapter_id, version)
                continue
            if landed or key in self._cache:
                self.preloaded += landed
                self._drop(adapter_id, version)
                continue
            if self._store.demand_fetches:  # a request's fetch took it meanwhile: look again
                continue
            if self._stalled != key:
                self._stalled = key
                log.info(
                    "preloading stops at adapter %s: no free room for its %d bytes in the host "
                    "cache (%d adapters named by the store wait for room)",
                    key, nbytes, len(self._pending),
                )  # fmt: skip
            return

    def _drop(self, adapter_id: str, version: int) -> None:
        """Done with ``version``: it leaves the queue unless a newer one replaced it."""
        if self._pending.get(adapter_id, (None,))[0] == version:
            del self._pending[adapter_id]
