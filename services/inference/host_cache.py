"""The host cache: adapters' bytes in the host arena, bounded in bytes, least recently used first.

A GPU eviction keeps the host copy, so the adapter comes back without a fetch; a host eviction
drops the bytes and the next use fetches them from the store again. An entry that is held (a
request or a pin uses its adapter) or that the owner's ``evictable`` check refuses (the engine
may still read the bytes) is never evicted.
The cache is owned by the service's event loop; it is not thread-safe.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from services.inference.arena import ArenaBlock, HostArena

log = logging.getLogger(__name__)


class HostCacheFull(Exception):
    """No room for an adapter even after evicting every idle entry."""


@dataclass
class HostEntry:
    key: Hashable
    block: ArenaBlock
    config_json: str  # the adapter's adapter_config.json
    holds: int = 0  # reasons the entry may not be evicted now; > 0 blocks eviction
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


class HostCache:
    def __init__(
        self,
        arena: HostArena,
        on_evict: Callable[[Hashable], None] | None = None,
        evictable: Callable[[Hashable], bool] | None = None,
    ) -> None:
        self.arena = arena
        self._entries: OrderedDict[Hashable, HostEntry] = OrderedDict()  # LRU first
        self.on_evict = on_evict  # called with the key of each evicted entry
        # Whether an unheld entry's bytes may go now (the engine may still read them).
        self.evictable = evictable
        self.evictions = 0

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

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

    def reserve(self, nbytes: int) -> ArenaBlock:
        """A block of ``nbytes`` for an adapter about to be fetched; evicts idle entries, least
        recently used first, until one fits. Raises HostCacheFull when nothing more can go."""
        if nbytes > self.arena.capacity:
            raise HostCacheFull(
                f"adapter of {nbytes} bytes is larger than the host cache "
                f"({self.arena.capacity} bytes); raise --host-cache-mb"
            )
        while (block := self.arena.alloc(nbytes)) is None:
            victim = next((e for e in self._entries.values() if self._idle(e)), None)
            if victim is None:
                held = sum(e.size_bytes for e in self._entries.values())
                raise HostCacheFull(
                    f"no room for {nbytes} bytes in the host cache: {held} bytes are held by "
                    f"adapters in use or pinned; raise --host-cache-mb or unpin adapters"
                )
            self._evict(victim)
        return block

    def put(
        self, key: Hashable, block: ArenaBlock, config_json: str, verdict: object = None
    ) -> HostEntry:
        """Adds a fetched adapter whose bytes fill ``block`` (from reserve)."""
        if key in self._entries:
            raise ValueError(f"adapter {key} is already in the host cache")
        entry = HostEntry(key, block, config_json, verdict=verdict)
        self._entries[key] = entry
        return entry

    def discard(self, block: ArenaBlock) -> None:
        """Returns a reserved block that never became an entry (a failed fetch)."""
        self.arena.free(block)

    def hold(self, key: Hashable) -> HostEntry:
        entry = self._entries[key]
        entry.holds += 1
        return entry

    def release(self, key: Hashable) -> None:
        entry = self._entries.get(key)
        if entry is None or entry.holds == 0:
            raise ValueError(f"adapter {key} is not held in the host cache")
        entry.holds -= 1

    def remove(self, key: Hashable) -> bool:
        """Drops an idle entry now; False when it is absent, held or not evictable."""
        entry = self._entries.get(key)
        if entry is None or not self._idle(entry):
            return False
        self._drop(entry)
        return True

    def stats(self) -> HostCacheStats:
        used = sum(e.block.reserved for e in self._entries.values())
        return HostCacheStats(
            self.arena.capacity, used, len(self._entries), self.evictions, self.arena.pinned
        )

    def _idle(self, entry: HostEntry) -> bool:
        return entry.holds == 0 and (self.evictable is None or self.evictable(entry.key))

    def _evict(self, entry: HostEntry) -> None:
        log.info("host cache: evicting adapter %s (%d bytes)", entry.key, entry.size_bytes)
        self.evictions += 1
        self._drop(entry)
        if self.on_evict is not None:
            self.on_evict(entry.key)

    def _drop(self, entry: HostEntry) -> None:
        del self._entries[entry.key]
        self.arena.free(entry.block)
