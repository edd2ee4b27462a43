"""Streaming a stored adapter back: parallel ranged reads, in-order chunks, sha256 checked.

The object is cut into ranges of ``range_bytes``; up to ``parallelism`` ranges are read at once,
each as one streaming read (one ranged GET on S3) that fills buffers of ``chunk_bytes``
straight from the storage's stream (RangeReader.readinto: no bytes object per read), each
range at most ``queue_chunks`` buffers ahead of the consumer. The consumer takes the ranges in
order and yields each chunk as a memoryview of its buffer, so the bytes go out while later
bytes are still arriving, and the only copy the store makes in user space is its caller's (the
servicer encodes the gRPC message from the view). Meanwhile a thread of the fetch's own hashes
the chunks in order (hashlib drops the GIL on large buffers), at its own pace: the hash may
trail the sends by up to ``queue_chunks`` chunks, so neither waits on the other chunk by chunk.

A chunk's buffer is reused once the chunk is sent (the consumer asked for the next one) and
hashed. Its view is released then, so a consumer that keeps one gets an error, never bytes
that changed under it. A slow client holds the reads back: one fetch holds at most
``parallelism * (queue_chunks + 1) + queue_chunks + 1`` buffers whatever the adapter's size
(the reads ahead, the chunks still to hash, the one being sent), plus the servicer's encoded
copy of one.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import deque
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
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


class _Filled(NamedTuple):
    buffer: bytearray
    size: int


def byte_ranges(size: int, range_bytes: int) -> list[ByteRange]:
    return [ByteRange(s, min(s + range_bytes, size)) for s in range(0, size, range_bytes)]


class BufferPool:
    """Idle read buffers of one size, reused across fetches rather than allocated and zeroed
    per chunk (a quarter of a millisecond per 4 MiB). Keeps at most ``max_idle``; buffers are
    taken and given back on the event loop's thread only."""

    def __init__(self, size: int, max_idle: int) -> None:
        self.size = size
        self.max_idle = max_idle
        self._idle: list[bytearray] = []

    def take(self) -> bytearray:
        return self._idle.pop() if self._idle else bytearray(self.size)

    def give(self, buffer: bytearray) -> None:
        if len(self._idle) < self.max_idle:
            self._idle.append(buffer)


_pools: dict[int, BufferPool] = {}


def buffer_pool(plan: FetchPlan) -> BufferPool:
    """The process's pool for the plan's chunk size, keeping one fetch's worth idle."""
    most = plan.parallelism * (plan.queue_chunks + 1) + plan.queue_chunks + 1
    pool = _pools.get(plan.chunk_bytes)
    if pool is None:
        pool = _pools[plan.chunk_bytes] = BufferPool(plan.chunk_bytes, most)
    pool.max_idle = max(pool.max_idle, most)
    return pool


async def _pump(
    backend: ObjectStore,
    key: str,
    wanted: ByteRange,
    pool: BufferPool,
    ready: asyncio.Queue,
) -> None:
    """Read one range into pooled buffers; queue them, then _END, or the error that ended it.
    The queue's bound holds the read back while the consumer is behind."""
    try:
        reader = await backend.open_range(key, wanted.start, wanted.end)
        try:
            left = wanted.end - wanted.start
            while left > 0:
                buffer = pool.take()
                n = await reader.readinto(memoryview(buffer)[: min(pool.size, left)])
                if n == 0:
                    pool.give(buffer)
                    break  # the object is shorter than the range: the consumer finds out
                await ready.put(_Filled(buffer, n))
                left -= n
        finally:
            await reader.close()
    except Exception as exc:  # the consumer raises it when it reaches this range
        await ready.put(exc)
    else:
        await ready.put(_END)


class _OrderedHash:
    """The sha256 of a fetch's chunks, in order, on a worker thread of the fetch's own: the
    hash keeps pace with the reads while the chunks are sent, rather than taking turns with
    the sends. A chunk's buffer goes back to the pool once it is hashed and sent."""

    def __init__(self, pool: BufferPool) -> None:
        self.digest = hashlib.sha256()
        self._pool = pool
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="fetch-sha256")
        self._pending: deque[tuple[asyncio.Future, bytearray]] = deque()

    def add(self, chunk: _Filled) -> None:
        view = memoryview(chunk.buffer)[: chunk.size]
        future = asyncio.wrap_future(self._thread.submit(self.digest.update, view))
        self._pending.append((future, chunk.buffer))

    async def settle(self, behind: int) -> None:
        """Reuse the buffers of the chunks hashed so far (all of them sent), waiting until at
        most ``behind`` chunks are left to hash."""
        while self._pending and (len(self._pending) > behind or self._pending[0][0].done()):
            future, buffer = self._pending.popleft()
            await future
            self._pool.give(buffer)

    def close(self) -> None:
        """Drop what is left to hash; a chunk being hashed finishes on the thread, and its
        buffer, like every buffer still pending, is not reused."""
        self._thread.shutdown(wait=False, cancel_futures=True)
        self._pending.clear()


async def stream_blob(
    backend: ObjectStore,
    record: AdapterRecord,
    plan: FetchPlan,
) -> AsyncIterator[memoryview]:
    """Yield the blob in chunks of at most ``plan.chunk_bytes``, in order, each a view that is
    valid until the next chunk is asked for. Raises DataCorruption, after the last chunk, when
    the bytes do not hash to the recorded sha256 or fall short of the recorded size;
    ObjectNotFound if the blob is gone; the backend's errors as they come."""
    pool = buffer_pool(plan)
    ranges = byte_ranges(record.size_bytes, plan.range_bytes)
    reads: deque[tuple[asyncio.Task, asyncio.Queue, ByteRange]] = deque()
    hasher = _OrderedHash(pool)
    started = 0
    try:
        for _ in ranges:
            while started < len(ranges) and len(reads) < plan.parallelism:
                # Each range may have queue_chunks filled buffers waiting, one more being read.
                ready: asyncio.Queue = asyncio.Queue(plan.queue_chunks)
                wanted = ranges[started]
                task = asyncio.ensure_future(_pump(backend, record.blob_key, wanted, pool, ready))
                reads.append((task, ready, wanted))
                started += 1
            task, ready, wanted = reads[0]
            received = 0
            while (item := await ready.get()) is not _END:
                if isinstance(item, Exception):
                    raise item
                received += item.size
                hasher.add(item)
                view = memoryview(item.buffer)[: item.size]
                try:
                    yield view
                finally:
                    view.release()
                # The hash may trail the sends by queue_chunks chunks, no more.
                await hasher.settle(plan.queue_chunks)
            if received != wanted.end - wanted.start:
                raise DataCorruption(
                    f"{record.adapter_id} v{record.version}: stored object is shorter than the "
                    f"{record.size_bytes} bytes recorded"
                )
            reads.popleft()  # done, and its pump has returned
        await hasher.settle(0)
    finally:
        hasher.close()
        for task, _, _ in reads:
            task.cancel()
        await asyncio.gather(*(task for task, _, _ in reads), return_exceptions=True)
    digest = hasher.digest.hexdigest()
    if digest != record.sha256:
        raise DataCorruption(
            f"{record.adapter_id} v{record.version}: stored bytes hash to {digest}, not the "
            f"recorded {record.sha256}"
        )
