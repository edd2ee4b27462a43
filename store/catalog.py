"""The versions of every adapter, read and written through manifests (see layout.py)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import replace
from typing import NamedTuple

from store.backends.base import ObjectNotFound, ObjectStore
from store.errors import AdapterNotFound, VersionConflict
from store.layout import (
    MANIFESTS,
    MAX_VERSION,
    VersionKey,
    after_adapter,
    manifest_key,
    parse_version_key,
    tombstone_key,
    versions_prefix,
)
from store.manifest import AdapterRecord

log = logging.getLogger(__name__)
MAX_COMMIT_ATTEMPTS = 64


class CatalogPage(NamedTuple):
    records: list[AdapterRecord]
    last_adapter_id: str | None  # set when more adapters follow


class Catalog:
    def __init__(self, backend: ObjectStore) -> None:
        self._backend = backend

    async def version_keys(self, adapter_id: str) -> list[VersionKey]:
        keys = [
            parsed
            async for key in self._backend.list_keys(versions_prefix(adapter_id))
            if (parsed := parse_version_key(key)) is not None and parsed.adapter_id == adapter_id
        ]
        return sorted(keys, key=lambda k: (k.version, k.deleted))

    async def live_versions(self, adapter_id: str) -> list[int]:
        return [k.version for k in await self.version_keys(adapter_id) if not k.deleted]

    async def resolve(self, adapter_id: str, version: int) -> int:
        """The version a request means: ``version`` itself, or the latest when it is 0."""
        if version:
            return version
        live = await self.live_versions(adapter_id)
        if not live:
            raise AdapterNotFound(f"adapter {adapter_id!r} does not exist")
        return live[-1]

    async def read(self, adapter_id: str, version: int = 0) -> AdapterRecord:
        version = await self.resolve(adapter_id, version)
        key = manifest_key(adapter_id, version)
        try:
            return AdapterRecord.from_json(await self._backend.get(key), key)
        except ObjectNotFound:
            raise AdapterNotFound(f"adapter {adapter_id!r} has no version {version}") from None

    async def commit(self, record: AdapterRecord) -> AdapterRecord:
        """Write the manifest under the next free version number and return the record with
        that version. Create-if-absent makes concurrent commits take distinct numbers; the
        loser of a race lists again and takes the next one."""
        for _ in range(MAX_COMMIT_ATTEMPTS):
            keys = await self.version_keys(record.adapter_id)
            version = (keys[-1].version if keys else 0) + 1
            if version > MAX_VERSION:
                raise VersionConflict(f"adapter {record.adapter_id!r} has used every version")
            committed = replace(record, version=version)
            key = manifest_key(record.adapter_id, version)
            if await self._backend.put_if_absent(key, committed.to_json()):
                return committed
        raise VersionConflict(
            f"too many concurrent uploads of {record.adapter_id!r}; could not claim a version"
        )

    async def retire(self, record: AdapterRecord) -> None:
        """Hide a version: tombstone first, so the number is never free for reuse, then drop
        the manifest. The blob is the caller's to delete."""
        await self._backend.put(tombstone_key(record.adapter_id, record.version), b"")
        await self._backend.delete(manifest_key(record.adapter_id, record.version))

    async def latest_records(self, prefix: str, after: str | None, limit: int) -> CatalogPage:
        """Up to ``limit`` adapters whose id starts with ``prefix`` and sorts after ``after``
        (latest live version of each), in listing order."""
        latest: list[tuple[str, int]] = []
        more = False
        start = after_adapter(after) if after else ""
        async with aclosing(self._latest_live(MANIFESTS + prefix, start)) as adapters:
            async for adapter_id, version in adapters:
                if len(latest) == limit:
                    more = True
                    break
                latest.append((adapter_id, version))
        records = await asyncio.gather(*(self._read_if_live(a, v) for a, v in latest))
        found = [r for r in records if r is not None]
        return CatalogPage(found, latest[-1][0] if more and latest else None)

    async def latest_versions(self) -> dict[str, int]:
        """Every adapter's latest live version, from one listing of the manifests' keys."""
        async with aclosing(self._latest_live(MANIFESTS, "")) as adapters:
            return {adapter_id: version async for adapter_id, version in adapters}

    async def _read_if_live(self, adapter_id: str, version: int) -> AdapterRecord | None:
        try:
            return await self.read(adapter_id, version)
        except AdapterNotFound:
            return None  # deleted since it was listed

    async def _latest_live(self, prefix: str, start_after: str) -> AsyncIterator[tuple[str, int]]:
        """(adapter_id, latest live version) per adapter: one adapter's keys come together in
        the listing (layout.py), so each group is complete when the next one begins."""
        current: str | None = None
        best: int | None = None
        async for key in self._backend.list_keys(prefix, start_after):
            parsed = parse_version_key(key)
            if parsed is None:
                continue
            if parsed.adapter_id != current:
                if current is not None and best is not None:
                    yield current, best
                current, best = parsed.adapter_id, None
            if not parsed.deleted:
                best = parsed.version if best is None else max(best, parsed.version)
        if current is not None and best is not None:
            yield current, best
