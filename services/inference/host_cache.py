"""The host cache: adapters' bytes in the host arena, bounded in bytes, least recently used first.

A GPU eviction keeps the host copy, so the adapter comes back without a fetch; a host eviction
drops the bytes and the next use fetches them from the store again. An entry that is held (a
request uses its adapter), pinned, or that the owner's ``evictable`` check refuses (the engine
may still read the bytes) is never evicted.

When the cache has no room for a fetch, the fetch waits (reserve_when_free) rather than fail:
the bytes that block it are held by requests that the engine finishes without it, so room
comes; waiters are served first come, first served, and a reserve() made while others wait
queues behind them. A wait ends in HostCacheFull only when no room can ever come: the adapter
is larger than the cache, or pinned adapters alone leave no range of its size. Holds and pins
are the service's to change (release, unpin, remove wake the queue at once); the engine's
``evictable`` answer changes on its own, so waiters also look again every RECHECK_S.
The cache is owned by the service's event loop; it is not thread-safe.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass

from services.inference.arena import ArenaBlock, HostArena

log = logging.getLogger(__name__)

RECHECK_S = 0.05  # how often waiters look again for bytes the engine let go of


class HostCacheFull(Exception):
    """No room for an adapter, and none can come (larger than the cache, or pinned adapters
    hold what it needs)."""


class HostCacheBusy(HostCacheFull):
    """No room for an adapter now; bytes held by adapters in use will be released, so a fetch
    waits for them (reserve_when_free)."""

    def __init__(self, message: str, nbytes: int) -> None:
        super().__init__(message)
        self.nbytes = nbytes


@dataclass
class HostEntry:
    key: Hashable
    block: ArenaBlock
    config_json: str  # the adapter's adapter_config.json
    holds: int = 0  # requests (and LoadAdapter calls) using it now; > 0 blocks eviction
    pinned: bool = False  # kept until unpinned (LoadAdapter with pin)
    # The fetch worker's validation of the bytes (their AdapterSpec or the error that rejects
    # them), None if it did not validate.
    verdict: object = None

    @property
    def size_bytes(self) -> int:
        return self.block.size


@dataclass(frozen=True)
class HostCacheStats:
    capacity_bytes: int
    used_bytes: int
    entries: int
    evictions: int
    pinned_memory: bool
    waiting: int = 0  # fetches waiting for room


@dataclass
class _Waiter:
    nbytes: int
    future: asyncio.Future


class HostCache:
    def __init__(
        self,
        arena: HostArena,
        on_evict: Callable[[Hashable], None] | None = None,
        evictable: Callable[[Hashable], bool] | None = None,
    ) -> None:
        self.arena = arena
        self._entries: OrderedDict[Hashable, HostEntry] = OrderedDict()  # LRU first
        self._reserved: dict[int, ArenaBlock] = {}  # offset -> block reserved, not yet an entry
        self.on_evict = on_evict  # called with the key of each evicted entry
        # Whether an unheld entry's bytes may go now (the engine may still read them).
        self.evictable = evictable
        self.evictions = 0
        self._waiters: deque[_Waiter] = deque()  # first come, first served
        self._loop: asyncio.AbstractEventLoop | None = None
        self._kicked = False  # a pass over the waiters is scheduled
        self._timer: asyncio.TimerHandle | None = None

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def waiting(self) -> int:
        """Fetches waiting for room."""
        return len(self._waiters)

    def get(self, key: Hashable) -> HostEntry | None:
        """The entry for ``key``, marked most recently used; None on a miss."""
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def peek(self, key: Hashable) -> HostEntry | None:
        return self._entries.get(key)

    def keys(self) -> list[Hashable]:
        return list(self._entries)

    # --- room -------------------------------------------------------------------------------

    def reserve(self, nbytes: int) -> ArenaBlock:
        """A block of ``nbytes`` for an adapter about to be fetched, now; evicts idle entries,
        least recently used first, if that makes room (and none if it would not). Raises
        HostCacheBusy when room must be waited for (reserve_when_free), HostCacheFull when
        none can come."""
        self._check_size(nbytes)
        if self._waiters:  # they came first
            raise self._busy(nbytes, f"{len(self._waiters)} fetches wait for room before it")
        block = self._take(nbytes)
        if block is None:
            raise self._busy(nbytes, "")
        return block

    def reserve_free(self, nbytes: int) -> ArenaBlock | None:
        """A block of ``nbytes`` from free room only, for a preload (preload.py): evicts
        nothing and takes nothing while fetches wait for room; None when no free range fits."""
        if self._waiters or nbytes > self.arena.capacity:
            return None
        block = self.arena.alloc(nbytes)
        if block is not None:
            self._reserved[block.offset] = block
        return block

    def demote(self, key: Hashable) -> None:
        """Marks an entry least recently used: a preloaded adapter no request has used yet
        goes before the ones requests used when room must be made."""
        self._entries.move_to_end(key, last=False)

    async def reserve_when_free(self, nbytes: int) -> ArenaBlock:
        """A block of ``nbytes``, once bytes held by adapters in use are released (first come,
        first served). Raises HostCacheFull when no room can come; a cancelled caller leaves
        the queue with nothing reserved."""
        self._check_size(nbytes)
        if not self._waiters:  # else they came first
            block = self._take(nbytes)
            if block is not None:
                return block
        self._loop = asyncio.get_running_loop()
        waiter = _Waiter(nbytes, self._loop.create_future())
        self._waiters.append(waiter)
        self._arm()
        try:
            return await waiter.future
        except BaseException:
            future = waiter.future
            if future.done() and not future.cancelled() and future.exception() is None:
                self.discard(future.result())  # granted as its caller went away
            elif waiter in self._waiters:
                self._waiters.remove(waiter)
                self._kick()  # those behind it may fit
            raise

    def put(
        self, key: Hashable, block: ArenaBlock, config_json: str, verdict: object = None
    ) -> HostEntry:
        """Adds a fetched adapter whose bytes fill ``block`` (from reserve)."""
        if key in self._entries:
            raise ValueError(f"adapter {key} is already in the host cache")
        self._reserved.pop(block.offset, None)
        entry = HostEntry(key, block, config_json, verdict=verdict)
        self._entries[key] = entry
        return entry

    def discard(self, block: ArenaBlock) -> None:
        """Returns a reserved block that never became an entry (a failed fetch)."""
        self._reserved.pop(block.offset, None)
        self.arena.free(block)
        self._kick()

    # --- holds and pins ---------------------------------------------------------------------

    def hold(self, key: Hashable) -> HostEntry:
        entry = self._entries[key]
        entry.holds += 1
        return entry

    def release(self, key: Hashable) -> None:
        entry = self._entries.get(key)
        if entry is None or entry.holds == 0:
            raise ValueError(f"adapter {key} is not held in the host cache")
        entry.holds -= 1
        if entry.holds == 0:
            self._kick()

    def pin(self, key: Hashable, pinned: bool) -> None:
        entry = self._entries[key]
        entry.pinned = pinned
        if not pinned:
            self._kick()

    def remove(self, key: Hashable) -> bool:
        """Drops an idle entry now; False when it is absent, held, pinned or not evictable."""
        entry = self._entries.get(key)
        if entry is None or not self._idle(entry):
            return False
        self._drop(entry)
        return True

    def stats(self) -> HostCacheStats:
        used = sum(e.block.reserved for e in self._entries.values())
        return HostCacheStats(
            self.arena.capacity, used, len(self._entries), self.evictions, self.arena.pinned,
            len(self._waiters),
        )  # fmt: skip

    # --- internals --------------------------------------------------------------------------

    def _check_size(self, nbytes: int) -> None:
        if nbytes > self.arena.capacity:
            raise HostCacheFull(
                f"adapter of {nbytes} bytes is larger than the host cache "
                f"({self.arena.capacity} bytes); raise --host-cache-mb"
            )

    def _busy(self, nbytes: int, why: str) -> HostCacheBusy:
        held = sum(e.block.reserved for e in self._entries.values() if not self._idle(e))
        held += sum(b.reserved for b in self._reserved.values())
        return HostCacheBusy(
            f"no room for {nbytes} bytes in the host cache now: {held} bytes are held by "
            f"adapters in use or being fetched{'; ' + why if why else ''}",
            nbytes,
        )

    def _take(self, nbytes: int) -> ArenaBlock | None:
        """A block now, evicting idle entries only if that makes room; None when room must be
        waited for. Raises HostCacheFull when none can come."""
        self._check_size(nbytes)
        block = self.arena.alloc(nbytes)
        if block is None:
            idle = [e for e in self._entries.values() if self._idle(e)]  # LRU first
            gone = {id(e) for e in idle}
            keep = [e.block for e in self._entries.values() if id(e) not in gone]
            if idle and self._fits(nbytes, [*keep, *self._reserved.values()]):
                for entry in idle:
                    self._evict(entry)
                    if (block := self.arena.alloc(nbytes)) is not None:
                        break
        if block is None:
            pinned = [e for e in self._entries.values() if e.pinned]
            if not self._fits(nbytes, [e.block for e in pinned]):
                raise HostCacheFull(_pinned_message(nbytes, self.arena.capacity, pinned))
            return None
        self._reserved[block.offset] = block
        return block

    def _fits(self, nbytes: int, kept: Iterable[ArenaBlock]) -> bool:
        """Whether the arena would have a free range for ``nbytes`` if only ``kept`` stayed."""
        need = ArenaBlock(0, nbytes).reserved
        end = 0
        for block in sorted(kept):
            if block.offset - end >= need:
                return True
            end = max(end, block.offset + block.reserved)
        return self.arena.capacity - end >= need

    def _kick(self) -> None:
        """Bytes may have been released: serve the waiters soon (on the event loop)."""
        if self._waiters and not self._kicked and self._loop is not None:
            self._kicked = True
            self._loop.call_soon(self._serve)

    def _arm(self) -> None:
        if self._waiters and self._timer is None:
            self._timer = self._loop.call_later(RECHECK_S, self._recheck)

    def _recheck(self) -> None:
        self._timer = None
        self._serve()

    def _serve(self) -> None:
        """Grant blocks to waiters in order while they fit; fail those no room can come for."""
        self._kicked = False
        while self._waiters:
            waiter = self._waiters[0]
            if waiter.future.done():  # cancelled; its caller removes it too
                self._waiters.popleft()
                continue
            try:
                block = self._take(waiter.nbytes)
            except HostCacheFull as exc:
                self._waiters.popleft()
                waiter.future.set_exception(exc)
                continue
            if block is None:
                break
            self._waiters.popleft()
            waiter.future.set_result(block)
        self._arm()

    def _idle(self, entry: HostEntry) -> bool:
        return (
            entry.holds == 0
            and not entry.pinned
            and (self.evictable is None or self.evictable(entry.key))
        )

    def _evict(self, entry: HostEntry) -> None:
        log.info("host cache: evicting adapter %s (%d bytes)", entry.key, entry.size_bytes)
        self.evictions += 1
        self._drop(entry)
        if self.on_evict is not None:
            self.on_evict(entry.key)

    def _drop(self, entry: HostEntry) -> None:
        del self._entries[entry.key]
        self.arena.free(entry.block)
        self._kick()


def _pinned_message(nbytes: int, capacity: int, pinned: list[HostEntry]) -> str:
    names = [_name(e.key) for e in pinned[:5]]
    if len(pinned) > 5:
        names.append(f"{len(pinned) - 5} more")
    held = sum(e.block.reserved for e in pinned)
    return (
        f"no room for {nbytes} bytes in the host cache of {capacity} bytes: pinned adapters "
        f"hold {held} bytes ({', '.join(names) or 'none'}) and leave no free range that large; "
        "unpin some (UnloadAdapter) or raise --host-cache-mb"
    )


def _name(key: Hashable) -> str:
    adapter_id, version = getattr(key, "adapter_id", None), getattr(key, "version", None)
    return str(key) if adapter_id is None else f"{adapter_id} version {version}"
