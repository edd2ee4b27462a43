"""Changes that other store processes made to the storage, as watch events.

A store publishes its own uploads and deletes to its watchers (events.py) as it makes them. Where
several store processes share one bucket (replicas behind a load balancer, or a second store on
the same local root), a watcher connected to one would never hear of the others' changes. So
each process rescans the storage every few seconds (StoreConfig.watch_rescan_s): it lists the
latest live version of every adapter (keys only: one listing, a page per thousand keys) and
compares the listing with what it last knew, reading the manifests of the adapters that changed
only. An adapter that is new, or whose latest version changed, is announced CREATED with its
latest version; one whose latest version went away DELETED (then, if an older version is the
latest now, CREATED for that one, as a watcher's replay would say).

The process's own changes update what it knows as it publishes them (``note``), so a rescan
does not announce them again. A rescan that overlaps one of them leaves that adapter to the
next rescan, which lists the storage after it; a watcher may still get an event twice, as the
watch's contract allows.
"""

from __future__ import annotations

import asyncio
import logging

from store.catalog import Catalog
from store.errors import AdapterNotFound, DataCorruption
from store.events import AdapterEvent, EventBus, EventKind
from store.manifest import AdapterRecord

log = logging.getLogger(__name__)
READ_AT_ONCE = 32  # manifests a rescan reads concurrently


class Rescan:
    def __init__(self, catalog: Catalog, events: EventBus) -> None:
        self._catalog, self._events = catalog, events
        # adapter id -> its latest live version's record, as this process knows it; None
        # until the first rescan has listed the storage
        self._known: dict[str, AdapterRecord] | None = None
        self._scanning = False
        self._touched: set[str] = set()  # adapters this process changed while a rescan ran
        self._unreadable: set[tuple[str, int]] = set()  # versions whose manifest is corrupt
        self.announced = 0  # events published by rescans

    def note(self, event: AdapterEvent) -> None:
        """This process published ``event`` (its own upload or delete)."""
        if self._known is None:
            return
        record = event.record
        if self._scanning:
            self._touched.add(record.adapter_id)
        known = self._known.get(record.adapter_id)
        if event.kind is EventKind.CREATED:
            if known is None or record.version > known.version:
                self._known[record.adapter_id] = record
        elif known is not None and known.version == record.version:
            # an older version may be the latest now: the next rescan announces it
            del self._known[record.adapter_id]

    async def run(self) -> int:
        """One rescan: publishes what changed since the last one and returns how many events
        it published. The first only learns the storage's state (watchers that connect get
        the existing adapters from their own replay)."""
        self._scanning, self._touched = True, set()
        try:
            listed = await self._catalog.latest_versions()
            if self._known is None:
                self._known = await self._records(listed)
                return 0
            known = self._known
            changed = {a: v for a, v in listed.items() if a not in known or known[a].version != v}
            gone = [a for a in known if a not in listed]
            records = await self._records(changed)
        finally:
            self._scanning = False
        events = []
        for adapter_id in gone:
            if adapter_id not in self._touched:  # else this process changed it meanwhile
                events.append(AdapterEvent(EventKind.DELETED, known.pop(adapter_id)))
        # (a changed adapter whose version was deleted since the listing is not in records:
        # the next rescan looks at it again, as at those this process touched meanwhile)
        for adapter_id, new in records.items():
            if adapter_id in self._touched:
                continue
            old = known.get(adapter_id)
            if old is not None and new.version < old.version:
                events.append(AdapterEvent(EventKind.DELETED, old))
            events.append(AdapterEvent(EventKind.CREATED, new))
            known[adapter_id] = new
        for event in events:
            self._events.publish(event)
        self.announced += len(events)
        if events:
            created = sum(e.kind is EventKind.CREATED for e in events)
            log.info(
                "the storage changed beside this process (another store on it): %d adapter "
                "versions created, %d deleted, announced to %d watchers",
                created, len(events) - created, self._events.watchers,
            )  # fmt: skip
        return len(events)

    async def _records(self, versions: dict[str, int]) -> dict[str, AdapterRecord]:
        """The manifests of these versions, READ_AT_ONCE at a time; one deleted since it was
        listed is left out."""
        items = list(versions.items())
        out = {}
        for start in range(0, len(items), READ_AT_ONCE):
            batch = items[start : start + READ_AT_ONCE]
            read = await asyncio.gather(*(self._read(a, v) for a, v in batch))
            out.update((r.adapter_id, r) for r in read if r is not None)
        return out

    async def _read(self, adapter_id: str, version: int) -> AdapterRecord | None:
        try:
            return await self._catalog.read(adapter_id, version)
        except AdapterNotFound:
            return None
        except DataCorruption as exc:  # not announced; said once (a fetch of it fails too)
            if (adapter_id, version) not in self._unreadable:
                self._unreadable.add((adapter_id, version))
                log.warning("a rescan skips %s v%d: %s", adapter_id, version, exc)
            return None
