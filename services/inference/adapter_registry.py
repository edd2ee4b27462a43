"""AdapterRegistry: which adapter versions this server holds, and who uses them.

It joins the three places an adapter lives: the store (fetched through StoreClient), the host
cache (bytes in the pinned arena) and the engine (validated, then copied into pool pages when a
request needs it). Invariants, all on the service's event loop:

- an adapter version is in the engine only while its bytes are in the host cache: a host
  eviction removes it from the engine (pages freed once its last request ends); the cache also
  holds versions preloaded ahead of their first request (preload.py), added to the engine when
  a request first acquires them;
- a version in use (a Generate call or a LoadAdapter holds a lease) is held in the host cache,
  and a pinned one pinned there, so neither is evicted there;
- a request never fails because the host cache is full of adapters in use: its fetch waits for
  room (host_cache.py), which the requests holding it release as they finish in the engine
  without waiting for anything here; only pinned adapters that leave no room fail it;
- the latest version of each adapter is known from the store's watch; a request for version 0
  takes the latest known one without asking the store, so held adapters keep serving while the
  store is down. A version superseded or deleted is retired: requests already on it finish on
  it, and it is dropped when its last one ends.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from services.auth import Caller, Role
from services.inference.engine.api import AdapterKey
from services.inference.engine.engine import Engine
from services.inference.engine.errors import PoolBusy
from services.inference.errors import BadArgument, StoreUnavailable, TenantQuotaExceeded
from services.inference.fetch_worker import AdapterCheck
from services.inference.host_cache import HostCache
from services.inference.service_stats import LatencyWindow
from services.inference.store_client import AdapterEvent, StoreClient
from store.errors import InvalidRequest
from store.layout import check_adapter_id
from store.peft import AdapterFormatError

log = logging.getLogger(__name__)

_NO_FETCHES = LatencyWindow()  # without a store


@dataclass
class HeldAdapter:
    key: AdapterKey
    size_bytes: int
    leases: int = 0  # Generate calls and LoadAdapter calls using it now
    pinned: bool = False
    pin_owner: str | None = None  # the tenant whose --tenant-max-pinned-mb the pin counts in
    retired: bool = False  # superseded, deleted or unloaded: dropped when no lease is left


class AdapterRegistry:
    def __init__(
        self,
        engine: Engine,
        store: StoreClient | None,
        cache: HostCache,
        on_fetched: Callable[[float], None] | None = None,
        check_pin: Callable[[Caller, str, int, int], None] | None = None,
    ) -> None:
        """``check_pin``: the tenants' limit on pinned bytes (tenancy.Tenancy.check_pin), which
        pin_for keeps to, for a LoadAdapter call and a pinned adapter's hot reload alike."""
        self.engine = engine
        self._check_pin = check_pin
        self.store = store
        self.cache = cache
        cache.on_evict = self.on_host_evict
        cache.evictable = engine.adapter_releasable  # no request or copy reads the bytes
        self._latest: dict[str, int] = {}
        self._held: dict[AdapterKey, HeldAdapter] = {}
        self._rejected: dict[AdapterKey, Exception] = {}  # versions are immutable: fail fast
        self._fetch_waiters: dict[AdapterKey, int] = {}  # requests waiting for a fetch
        if store is not None:
            store.on_fetched = on_fetched
            # Validated in the fetch worker, off this process's GIL (fetch_worker.py).
            store.adapter_check = AdapterCheck(engine.base_shape, engine.config.max_lora_rank)

    # --- lookups --------------------------------------------------------------------------

    @property
    def fetch_waiters(self) -> int:
        """Requests waiting for an adapter's bytes to arrive from the store, those whose fetch
        waits for room in the host cache included (GetStats' waiting_for_adapter)."""
        return sum(self._fetch_waiters.values())

    @property
    def fetch_latency(self) -> LatencyWindow:
        return self.store.fetch_latency if self.store is not None else _NO_FETCHES

    def fetching(self) -> dict[AdapterKey, int]:
        """Versions being fetched, with the number of requests waiting for each."""
        return {k: n for k, n in self._fetch_waiters.items() if k not in self._held}

    def held(self) -> list[HeldAdapter]:
        return list(self._held.values())

    def get(self, key: AdapterKey) -> HeldAdapter | None:
        return self._held.get(key)

    async def resolve(self, adapter_id: str, version: int) -> AdapterKey:
        """The concrete version a request names; 0 = the latest (known from the watch)."""
        try:
            check_adapter_id(adapter_id)  # the store's rule: a bad id is the caller's error
        except InvalidRequest as exc:
            raise BadArgument(str(exc)) from None
        if version:
            return AdapterKey(adapter_id, version)
        known = self._latest.get(adapter_id)
        if known is not None:
            return AdapterKey(adapter_id, known)
        info = await self._store().lookup(adapter_id, 0)
        self._note_latest(adapter_id, info.version)
        return AdapterKey(adapter_id, self._latest[adapter_id])

    # --- leases ---------------------------------------------------------------------------

    async def acquire(self, adapter_id: str, version: int) -> AdapterKey:
        """Resolve, fetch if needed and add to the engine; the caller must release(key)."""
        key = await self.resolve(adapter_id, version)
        rejected = self._rejected.get(key)
        if rejected is not None:
            raise rejected
        held = self._held.get(key)
        if held is not None:  # held implies cached: eviction and drops forget it
            held.leases += 1
            self.cache.hold(key)
            self.cache.get(key)  # most recently used
            return key
        await self._fetch_and_add(key)
        held = self._held[key]
        held.leases += 1
        return key

    async def place(self, key: AdapterKey) -> bool:
        """A preload into the page pool (preload.py): an adapter whose bytes are in the host
        cache is added to the engine and copied into free pool pages, evicting nothing; True
        once it is there (placed now or before), False when the pool has no such room now
        (engine.PoolBusy). Raises as acquire does."""
        if key in self._held and self.engine.adapter_in_pool(key):
            return True
        await self.acquire(key.adapter_id, key.version)
        try:
            await self.engine.load_adapter(key, if_free=True)
        except PoolBusy:
            return False
        finally:
            self.release(key)
            if key in self.cache:  # no request used it: the host cache evicts it first
                self.cache.demote(key)
        return True

    def release(self, key: AdapterKey) -> None:
        held = self._held.get(key)
        if held is None or held.leases == 0:
            raise ValueError(f"adapter {key} released more often than acquired")
        held.leases -= 1
        self.cache.release(key)
        self._maybe_drop(held)

    def pin(self, key: AdapterKey, pinned: bool, owner: str | None = None) -> None:
        """Pinned: kept in the host cache and the page pool until unpinned. ``owner``: the
        tenant that pins it, in whose pinned bytes it counts (None: an admin's pin)."""
        held = self._held[key]
        if held.pinned != pinned:
            held.pinned = pinned
            held.pin_owner = owner if pinned else None
            self.engine.pin_adapter(key, pinned)
            self.cache.pin(key, pinned)
            if not pinned:
                self._maybe_drop(held)

    def pin_for(self, key: AdapterKey, caller: Caller) -> None:
        """Pin ``key`` (held) for ``caller``: a tenant's pin counts in its pinned bytes, and
        check_pin raises TenantQuotaExceeded, pinning nothing, where it would pass its limit."""
        held = self._held[key]
        if held.pinned:
            return
        owner = caller.tenant if caller.role is Role.TENANT else None
        if owner is not None and self._check_pin is not None:
            what = f"{key.adapter_id} version {key.version}"
            self._check_pin(caller, what, held.size_bytes, self.pinned_bytes(owner))
        self.pin(key, True, owner)

    def pinned_bytes(self, owner: str) -> int:
        """The bytes of the versions that tenant ``owner`` pinned."""
        return sum(h.size_bytes for h in self._held.values() if h.pinned and h.pin_owner == owner)

    def unload(self, adapter_id: str, version: int) -> list[HeldAdapter]:
        """Unpin and retire the matching versions (0 = all); each is dropped once idle."""
        out = []
        for held in list(self._held.values()):
            if held.key.adapter_id == adapter_id and version in (0, held.key.version):
                held.retired = True
                out.append(held)
                if held.pinned:
                    self.pin(held.key, False)
                else:
                    self._maybe_drop(held)
        return out

    # --- the store's watch ------------------------------------------------------------------

    def on_event(self, event: AdapterEvent) -> None:
        if event.created:
            self._note_latest(event.adapter_id, event.version)
            return
        key = AdapterKey(event.adapter_id, event.version)
        if self._latest.get(event.adapter_id) == event.version:
            # The next request asks the store which version is the latest now.
            del self._latest[event.adapter_id]
        held = self._held.get(key)
        if held is not None:
            log.info("adapter %s was deleted from the store; retiring it", key)
            held.retired = True
            self._maybe_drop(held)

    def forget_latest(self) -> None:
        """The watch (re)connected: its replay says again which versions are the latest."""
        self._latest.clear()

    def on_host_evict(self, key: AdapterKey) -> None:
        """The host cache dropped an idle adapter's bytes: the engine forgets it too."""
        held = self._held.pop(key, None)
        if held is not None:
            self.engine.remove_adapter(key)

    # --- internals --------------------------------------------------------------------------

    def _store(self) -> StoreClient:
        if self.store is None:
            raise StoreUnavailable(
                "no adapter store is configured (--adapter-store); only the base model serves"
            )
        return self.store

    def _note_latest(self, adapter_id: str, version: int) -> None:
        old = self._latest.get(adapter_id)
        if old is not None and version <= old:
            return
        self._latest[adapter_id] = version
        if old is None:  # the watch's replay names every adapter at each connect: no line each
            log.debug("adapter %s: version %d is the latest", adapter_id, version)
        else:
            log.info("adapter %s: version %d replaces version %d as the latest", adapter_id,
                     version, old)  # fmt: skip
        for held in list(self._held.values()):
            if held.key.adapter_id == adapter_id and held.key.version < version:
                held.retired = True
                if held.pinned:
                    # Hot reload: a pinned adapter's new version is loaded and pinned now.
                    asyncio.get_running_loop().create_task(
                        self._reload_pinned(AdapterKey(adapter_id, version), held.pin_owner)
                    )
                    self.pin(held.key, False)
                else:
                    self._maybe_drop(held)

    async def _reload_pinned(self, key: AdapterKey, owner: str | None) -> None:
        try:
            await self.acquire(key.adapter_id, key.version)
        except Exception as exc:  # the old version is gone; requests will retry the fetch
            log.warning("hot reload of pinned adapter %s failed: %s", key, exc)
            return
        try:
            caller = Caller(Role.ADMIN) if owner is None else Caller(Role.TENANT, owner)
            try:
                self.pin_for(key, caller)  # pins it in the engine too
            except TenantQuotaExceeded as exc:
                log.warning("hot reload of pinned adapter %s: loaded but not pinned: %s", key, exc)
            await self.engine.load_adapter(key)
        except Exception as exc:
            log.warning("hot reload of pinned adapter %s: no room in the pool yet: %s", key, exc)
        finally:
            self.release(key)

    async def _fetch_and_add(self, key: AdapterKey) -> None:
        """Brings ``key`` into the host cache and the engine, held once for the caller."""
        store = self._store()
        self._fetch_waiters[key] = self._fetch_waiters.get(key, 0) + 1
        try:
            # Held for this call as it lands in the cache (or at once on a hit): another fetch
            # waiting for room cannot evict it before it is added. It may wait for room.
            entry = await store.fetch(key, hold=True)
        finally:
            self._fetch_waiters[key] -= 1
            if not self._fetch_waiters[key]:
                del self._fetch_waiters[key]
        # No await from here on.
        if key in self._held:  # another call added it meanwhile: this hold is the lease's
            return
        start = time.perf_counter()
        try:
            if isinstance(entry.verdict, Exception):  # the fetch worker rejected the bytes
                raise entry.verdict
            raw = self.cache.arena.tensor(entry.block)
            self.engine.add_adapter(key, entry.config_json, raw, spec=entry.verdict)
            # Used once (a later add of these bytes validates them here again).
            entry.verdict = None
        except Exception as exc:
            self.cache.release(key)
            self.cache.remove(key)
            if isinstance(exc, AdapterFormatError):  # the bytes will not change
                self._rejected[key] = exc
            raise
        log.debug("adapter %s validated in %.3f s", key, time.perf_counter() - start)
        self._held[key] = HeldAdapter(key, entry.size_bytes)

    def _maybe_drop(self, held: HeldAdapter) -> None:
        if held.retired and held.leases == 0 and not held.pinned:
            del self._held[held.key]
            self.cache.remove(held.key)
            self.engine.remove_adapter(held.key)
            log.info("adapter %s dropped", held.key)
