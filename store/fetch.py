"""Streaming a stored adapter back: parallel ranged reads, in-order chunks, sha256 checked."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator
from typing import NamedTuple

from store.backends.base import ObjectStore
from store.errors import DataCorruption
from store.manifest import AdapterRecord


class ByteRange(NamedTuple):
    start: int
    end: int


def byte_ranges(size: int, part_bytes: int) -> list[ByteRange]:
    return [ByteRange(s, min(s + part_bytes, size)) for s in range(0, size, part_bytes)]


async def stream_blob(
    backend: ObjectStore,
    record: AdapterRecord,
    part_bytes: int,
    parallelism: int,
    chunk_bytes: int,
) -> AsyncIterator[bytes]:
    """Yield the blob in chunks of at most ``chunk_bytes``, in order. Up to ``parallelism``
    ranged reads run ahead of the consumer. Raises DataCorruption, after the last chunk, when
    the bytes do not hash to the recorded sha256; ObjectNotFound if the blob is gone."""
    ranges = byte_ranges(record.size_bytes, part_bytes)
    pending: list[asyncio.Task[bytes]] = []
    digest = hashlib.sha256()
    next_range = 0
    try:
        for wanted in ranges:
            while next_range < len(ranges) and len(pending) < parallelism:
                start, end = ranges[next_range]
                pending.append(
                    asyncio.ensure_future(backend.get_range(record.blob_key, start, end))
                )
                next_range += 1
            data = await pending.pop(0)
            if len(data) != wanted.end - wanted.start:
                raise DataCorruption(
                    f"{record.adapter_id} v{record.version}: stored object is shorter than the "
                    f"{record.size_bytes} bytes recorded"
                )
            hashing = asyncio.ensure_future(asyncio.to_thread(digest.update, data))
            for offset in range(0, len(data), chunk_bytes):
                yield data[offset : offset + chunk_bytes]
            await hashing
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    if digest.hexdigest() != record.sha256:
        raise DataCorruption(
            f"{record.adapter_id} v{record.version}: stored bytes hash to "
            f"{digest.hexdigest()}, not the recorded {record.sha256}"
        )
