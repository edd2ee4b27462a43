"""The fetch pipeline (store/fetch.py) over the local backend: byte-exact chunks across ranges,
views released once the next chunk is asked for, bounded buffers under a slow consumer,
corruption, failed reads and an early stop."""

from __future__ import annotations

import asyncio
import hashlib
import os

import pytest

from store import fetch
from store.backends.local import LocalObjectStore
from store.errors import DataCorruption, StorageUnavailable
from store.fetch import FetchPlan, stream_blob
from store.manifest import AdapterRecord

BODY = os.urandom(10_000)
KEY = "blobs/t/x.safetensors"
# Ranges of 3000 bytes in chunks of 700: chunks end short at every range's end.
PLAN = FetchPlan(range_bytes=3000, parallelism=2, chunk_bytes=700, queue_chunks=1)


def record(body: bytes = BODY) -> AdapterRecord:
    return AdapterRecord(
        adapter_id="t",
        version=1,
        rank=8,
        lora_alpha=16.0,
        target_modules=("q_proj",),
        size_bytes=len(body),
        sha256=hashlib.sha256(body).hexdigest(),
        adapter_config_json="{}",
        description="",
        created_at=0.0,
        dtype="F16",
        num_layers=1,
        blob_key=KEY,
    )


@pytest.fixture
async def backend(tmp_path):
    store = LocalObjectStore(tmp_path)
    await store.put(KEY, BODY)
    yield store
    await store.close()


async def test_chunks_are_byte_exact_and_in_order(backend):
    sizes, pieces = [], []
    async for chunk in stream_blob(backend, record(), PLAN):
        sizes.append(len(chunk))
        pieces.append(bytes(chunk))
    assert b"".join(pieces) == BODY
    assert sizes == ([700] * 4 + [200]) * 3 + [700, 300]


async def test_a_kept_view_is_released_not_overwritten(backend):
    chunks = stream_blob(backend, record(), PLAN)
    first = await anext(chunks)
    assert bytes(first) == BODY[:700]
    await anext(chunks)
    with pytest.raises(ValueError, match="released"):
        bytes(first)
    await chunks.aclose()


async def test_buffers_stay_bounded_under_a_slow_consumer(backend, monkeypatch):
    pool = fetch.BufferPool(PLAN.chunk_bytes, max_idle=0)  # every buffer is a new one
    monkeypatch.setattr(fetch, "buffer_pool", lambda plan: pool)
    live = most = 0
    take, give = pool.take, pool.give

    def counted_take():
        nonlocal live, most
        live += 1
        most = max(most, live)
        return take()

    def counted_give(buffer):
        nonlocal live
        live -= 1
        give(buffer)

    pool.take, pool.give = counted_take, counted_give
    received = bytearray()
    async for chunk in stream_blob(backend, record(), PLAN):
        received += chunk
        await asyncio.sleep(0.01)  # the reads run ahead as far as they may
    assert received == BODY
    bound = PLAN.parallelism * (PLAN.queue_chunks + 1) + PLAN.queue_chunks + 1
    assert 2 <= most <= bound
    assert live == 0  # every buffer came back


async def test_mismatched_and_short_bytes_are_corruption(backend):
    damaged = bytearray(BODY)
    damaged[5000] ^= 1
    await backend.put(KEY, bytes(damaged))
    received = bytearray()
    with pytest.raises(DataCorruption, match="hash to"):
        async for chunk in stream_blob(backend, record(), PLAN):
            received += chunk
    assert received == damaged  # every chunk went out before the hash was known

    await backend.put(KEY, BODY[:9000])
    with pytest.raises(DataCorruption, match="shorter"):
        async for _ in stream_blob(backend, record(), PLAN):
            pass


class _FailingRead(LocalObjectStore):
    """The local backend, with reads that fail from a given offset on."""

    fail_from = 4000

    async def open_range(self, key, start, end):
        reader = await super().open_range(key, start, end)
        inner = reader.readinto
        position = start

        async def readinto(view):
            nonlocal position
            if position + len(view) > self.fail_from:
                raise StorageUnavailable("the disk went away")
            n = await inner(view)
            position += n
            return n

        reader.readinto = readinto
        return reader


async def test_a_failed_read_ends_the_stream_with_its_error(tmp_path):
    backend = _FailingRead(tmp_path)
    await backend.put(KEY, BODY)
    received = bytearray()
    with pytest.raises(StorageUnavailable, match="went away"):
        async for chunk in stream_blob(backend, record(), PLAN):
            received += chunk
    assert received == BODY[:3000] + BODY[3000:3700]  # what was read before the failure
    await backend.close()


async def test_stopping_early_leaves_no_reads_running(backend):
    chunks = stream_blob(backend, record(), PLAN)
    await anext(chunks)
    await chunks.aclose()
    others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    assert others == []
