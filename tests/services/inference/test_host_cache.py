"""The host arena's allocator and the byte-bounded LRU host cache (pure host-side code)."""

from __future__ import annotations

import asyncio
import random

import pytest

from services.inference.arena import ALIGN, ArenaBlock, HostArena
from services.inference.host_cache import HostCache, HostCacheFull


def test_arena_first_fit_and_coalescing():
    arena = HostArena(8 * ALIGN, pin=False)
    a = arena.alloc(ALIGN)
    b = arena.alloc(2 * ALIGN + 1)  # rounds up to three pages
    c = arena.alloc(ALIGN)
    assert (a.offset, b.offset, c.offset) == (0, ALIGN, 4 * ALIGN)
    assert arena.alloc(4 * ALIGN) is None  # only three pages left
    arena.free(b)
    assert arena.alloc(4 * ALIGN) is None  # free ranges 3 + 3 pages, not contiguous
    arena.free(c)  # coalesces with b's range and the tail: 7 pages
    assert arena.stats().largest_free == 7 * ALIGN
    big = arena.alloc(7 * ALIGN)
    assert big.offset == ALIGN
    arena.free(a)
    arena.free(big)
    arena.check_integrity()
    assert arena.stats().used == 0 and arena.stats().largest_free == 8 * ALIGN


def test_arena_rejects_bad_frees_and_sizes():
    arena = HostArena(4 * ALIGN, pin=False)
    block = arena.alloc(100)
    arena.free(block)
    with pytest.raises(ValueError, match="not allocated"):
        arena.free(block)
    with pytest.raises(ValueError, match="not allocated"):
        arena.free(ArenaBlock(ALIGN, 10))
    with pytest.raises(ValueError, match="positive"):
        arena.alloc(0)
    with pytest.raises(ValueError, match="positive"):
        HostArena(0, pin=False)


def test_arena_views_share_memory():
    arena = HostArena(4 * ALIGN, pin=False)
    block = arena.alloc(10)
    arena.view(block)[:] = bytes(range(10))
    assert arena.tensor(block).tolist() == list(range(10))
    assert bytes(arena.buffer[block.offset : block.offset + 10].numpy()) == bytes(range(10))


def test_arena_random_alloc_free_keeps_integrity():
    rng = random.Random(7)
    arena = HostArena(64 * ALIGN, pin=False)
    live: list[ArenaBlock] = []
    for _ in range(2000):
        if live and rng.random() < 0.5:
            arena.free(live.pop(rng.randrange(len(live))))
        else:
            block = arena.alloc(rng.randint(1, 6 * ALIGN))
            if block is not None:
                live.append(block)
        arena.check_integrity()
    spans = sorted((b.offset, b.offset + b.reserved) for b in live)
    assert all(e <= s for (_, e), (s, _) in zip(spans, spans[1:], strict=False))
    for block in live:
        arena.free(block)
    assert arena.stats() == (64 * ALIGN, 0, 64 * ALIGN, 0)


def _fill(cache: HostCache, key: str, nbytes: int) -> None:
    block = cache.reserve(nbytes)
    cache.arena.view(block)[:] = bytes([len(key)]) * nbytes
    cache.put(key, block, "{}")


def test_cache_evicts_least_recently_used_first():
    evicted: list[str] = []
    cache = HostCache(HostArena(4 * ALIGN, pin=False), on_evict=evicted.append)
    for key in ("a", "b", "c", "d"):
        _fill(cache, key, ALIGN)
    assert cache.get("a") is not None  # a becomes the most recent; b is now the oldest
    _fill(cache, "e", 2 * ALIGN)
    assert evicted == ["b", "c"]
    assert set(cache.keys()) == {"a", "d", "e"}
    assert cache.stats().used_bytes == 4 * ALIGN and cache.stats().evictions == 2
    cache.arena.check_integrity()


def test_cache_never_evicts_held_entries():
    cache = HostCache(HostArena(3 * ALIGN, pin=False))
    for key in ("a", "b", "c"):
        _fill(cache, key, ALIGN)
    cache.hold("a")
    cache.hold("b")
    _fill(cache, "d", ALIGN)  # evicts c, the only idle entry
    assert set(cache.keys()) == {"a", "b", "d"}
    cache.hold("d")
    with pytest.raises(HostCacheFull, match="held"):
        cache.reserve(ALIGN)
    assert not cache.remove("a")  # held
    cache.release("a")
    assert cache.remove("a")
    with pytest.raises(ValueError, match="not held"):
        cache.release("a")
    with pytest.raises(HostCacheFull, match="larger than the host cache"):
        cache.reserve(4 * ALIGN)


def test_cache_asks_the_owner_before_evicting():
    busy = {"a"}
    cache = HostCache(HostArena(2 * ALIGN, pin=False), evictable=lambda key: key not in busy)
    _fill(cache, "a", ALIGN)
    _fill(cache, "b", ALIGN)
    _fill(cache, "c", ALIGN)  # a is the oldest but busy: b goes
    assert set(cache.keys()) == {"a", "c"}
    assert not cache.remove("a")
    busy.clear()
    assert cache.remove("a")


def test_preload_room_is_free_room_only_and_preloaded_entries_go_first():
    evicted: list[str] = []
    cache = HostCache(HostArena(4 * ALIGN, pin=False), on_evict=evicted.append)
    for key in ("a", "b"):
        _fill(cache, key, ALIGN)
    block = cache.reserve_free(2 * ALIGN)  # the two free pages
    assert block is not None and cache.reserve_free(ALIGN) is None  # nothing evicted for it
    assert evicted == [] and set(cache.keys()) == {"a", "b"}
    cache.put("p", block, "{}")
    cache.demote("p")  # preloaded: least recently used, ahead of a and b
    _fill(cache, "c", 2 * ALIGN)
    assert evicted == ["p"] and set(cache.keys()) == {"a", "b", "c"}
    assert cache.reserve_free(5 * ALIGN) is None  # larger than the cache: no room, no error
    cache.arena.check_integrity()


async def test_preload_room_waits_behind_fetches_waiting_for_room():
    cache = HostCache(HostArena(3 * ALIGN, pin=False))
    _fill(cache, "a", 2 * ALIGN)
    cache.hold("a")
    waiter = asyncio.create_task(cache.reserve_when_free(2 * ALIGN))
    await asyncio.sleep(0)
    assert cache.waiting == 1
    assert cache.reserve_free(ALIGN) is None  # a page is free, but a fetch waits: it comes first
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    block = cache.reserve_free(ALIGN)
    assert block is not None
    cache.discard(block)
    cache.release("a")
    cache.arena.check_integrity()


def test_cache_discard_returns_a_failed_fetch_block():
    cache = HostCache(HostArena(2 * ALIGN, pin=False))
    block = cache.reserve(2 * ALIGN)
    cache.discard(block)
    assert cache.stats().used_bytes == 0 and len(cache) == 0
    cache.arena.check_integrity()


def test_fetch_chunks_decode_without_copies():
    from lorafleet.v1 import adapter_store_pb2 as store_pb
    from services.inference.fetch_wire import decode_fetch_response

    for size in (0, 1, 127, 128, 300_000):
        body = bytes(range(256)) * (size // 256) + bytes(size % 256)
        data = store_pb.FetchAdapterResponse(chunk=body).SerializeToString()
        decoded = decode_fetch_response(data)
        assert isinstance(decoded, memoryview) and decoded == body
        assert decoded.obj is data  # a view of the received buffer
    info = store_pb.FetchAdapterResponse(info=store_pb.AdapterInfo(adapter_id="x", version=3))
    decoded = decode_fetch_response(info.SerializeToString())
    assert decoded.info.adapter_id == "x" and decoded.info.version == 3
    with pytest.raises(ValueError, match="truncated"):
        decode_fetch_response(b"\x12\xff")
