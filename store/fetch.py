"""Streaming a stored adapter back: parallel ranged reads, in-order chunks, sha256 checked.

The object is cut into ranges of ``range_bytes``; up to ``parallelism`` ranges stream from
storage at once, each into its own bounded queue, and the consumer drains the ranges in order.
Each range is one streaming GET read in message-sized chunks, so bytes go out to the client
while later bytes are still arriving; a slow client holds the reads back, so memory per fetch
stays under ``(parallelism * (queue_chunks + 1) + 2) * chunk_bytes`` (the read-ahead, plus the
chunk being hashed and the one being sent), and the servicer's encoded copy of that one.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator
from typing import NamedTuple

from store.backends.base import ObjectStore
from store.errors import DataCorruption
from store.manifest import AdapterRecord

_END = None  # marks a range's queue as complete


class FetchPlan(NamedTuple):
    range_bytes: int
    parallelism: int
    chunk_bytes: int
    queue_chunks: int


class ByteRange(NamedTuple):
    start: int
    end: int


def byte_ranges(size: int, range_bytes: int) -> list[ByteRange]:
    return [ByteRange(s, min(s + range_bytes, size)) for s in range(0, size, range_bytes)]


async def _pump(
    backend: ObjectStore, key: str, wanted: ByteRange, piece_bytes: int, queue: asyncio.Queue
) -> None:
    async for piece in backend.stream_range(key, wanted.start, wanted.end, piece_bytes):
        await queue.put(piece)
    await queue.put(_END)


async def stream_blob(
    backend: ObjectStore,
    record: AdapterRecord,
    plan: FetchPlan,
) -> AsyncIterator[bytes]:
    """Yield the blob in chunks of at most ``plan.chunk_bytes``, in order. Raises DataCorruption,
    after the last chunk, when the bytes do not hash to the recorded sha256 or fall short of
    the recorded size; ObjectNotFound if the blob is gone."""
    ranges = byte_ranges(record.size_bytes, plan.range_bytes)
    running: list[tuple[asyncio.Task, asyncio.Queue, ByteRange]] = []
    digest = hashlib.sha256()
    hashing: asyncio.Future | None = None
    started = 0
    try:
        for _ in ranges:
            while started < len(ranges) and len(running) < plan.parallelism:
                queue: asyncio.Queue = asyncio.Queue(plan.queue_chunks)
                task = asyncio.ensure_future(
                    _pump(backend, record.blob_key, ranges[started], plan.chunk_bytes, queue)
                )
                running.append((task, queue, ranges[started]))
                started += 1
            task, queue, wanted = running.pop(0)
            received = 0
            while True:
                getter = asyncio.ensure_future(queue.get())
                # A failed read ends the wait at once rather than leaving it hanging.
                await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
                if not getter.done() and task.exception() is not None:
                    getter.cancel()
                    raise task.exception()
                piece = await getter  # done, or the pump ended well and _END is queued
                if piece is _END:
                    break
                received += len(piece)
                # Hash on a thread (hashlib drops the GIL), one piece at a time, in order.
                if hashing is not None:
                    await hashing
                hashing = asyncio.ensure_future(asyncio.to_thread(digest.update, piece))
                yield piece
            if received != wanted.end - wanted.start:
                raise DataCorruption(
                    f"{record.adapter_id} v{record.version}: stored object is shorter than the "
                    f"{record.size_bytes} bytes recorded"
                )
        if hashing is not None:
            await hashing
    finally:
        for task, _, _ in running:
            task.cancel()
        await asyncio.gather(*(task for task, _, _ in running), return_exceptions=True)
    if digest.hexdigest() != record.sha256:
        raise DataCorruption(
            f"{record.adapter_id} v{record.version}: stored bytes hash to "
            f"{digest.hexdigest()}, not the recorded {record.sha256}"
        )
