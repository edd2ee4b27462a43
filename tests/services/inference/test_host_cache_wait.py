"""The host cache's wait for room (pure host-side code on an event loop): a reserve that finds
the cache full of adapters in use waits until they are released, first come first served; it
fails at once only when no room can come (larger than the cache, or pinned adapters alone leave
no range); a cancelled waiter leaves the queue with nothing reserved."""

from __future__ import annotations

import asyncio

import pytest

from services.inference.arena import ALIGN, HostArena
from services.inference.host_cache import RECHECK_S, HostCache, HostCacheBusy, HostCacheFull


def _cache(pages: int, evictable=None) -> HostCache:
    return HostCache(HostArena(pages * ALIGN, pin=False), evictable=evictable)


def _fill(cache: HostCache, key: str, pages: int = 1, held: bool = True) -> None:
    cache.put(key, cache.reserve(pages * ALIGN), "{}")
    if held:
        cache.hold(key)


def _intact(cache: HostCache) -> None:
    """Every live block of the arena is an entry: nothing reserved was left behind."""
    cache.arena.check_integrity()
    assert cache.arena.stats().blocks == len(cache) and cache.waiting == 0


async def _settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


async def test_waiters_get_room_in_arrival_order_as_holds_are_released():
    cache = _cache(2)
    _fill(cache, "a")
    _fill(cache, "b")
    with pytest.raises(HostCacheBusy, match="held by adapters in use"):
        cache.reserve(ALIGN)
    first = asyncio.create_task(cache.reserve_when_free(ALIGN))
    second = asyncio.create_task(cache.reserve_when_free(ALIGN))
    await _settle()
    assert cache.waiting == 2 and not first.done()
    cache.release("b")  # b is idle now: evicted for the first waiter only
    await _settle()
    assert first.done() and not second.done() and "b" not in cache
    with pytest.raises(HostCacheBusy, match="1 fetches wait"):
        cache.reserve(ALIGN)  # room or not, a newcomer queues behind the waiters
    cache.release("a")
    block = await asyncio.wait_for(second, 5)
    cache.put("c", first.result(), "{}")
    cache.put("d", block, "{}")
    assert set(cache.keys()) == {"c", "d"}
    _intact(cache)


async def test_the_engine_letting_go_is_seen_without_a_release():
    """An unheld entry the engine still reads (evictable False) blocks the waiter until the
    engine lets go; the waiter sees that within RECHECK_S, with no call on the cache."""
    busy = {"a"}
    cache = _cache(1, evictable=lambda key: key not in busy)
    _fill(cache, "a", held=False)
    waiter = asyncio.create_task(cache.reserve_when_free(ALIGN))
    await asyncio.sleep(3 * RECHECK_S)
    assert not waiter.done()
    busy.clear()
    block = await asyncio.wait_for(waiter, 5)
    assert "a" not in cache and cache.evictions == 1
    cache.discard(block)
    _intact(cache)


async def test_pinned_adapters_alone_fail_the_fetch_naming_them():
    cache = _cache(3)
    _fill(cache, "a", pages=2, held=False)  # pages 0-1
    _fill(cache, "b")  # page 2, in use
    cache.pin("a", True)
    cache.pin("b", True)
    with pytest.raises(HostCacheFull, match=r"pinned adapters hold 12288 bytes \(a, b\)") as exc:
        await cache.reserve_when_free(2 * ALIGN)
    assert not isinstance(exc.value, HostCacheBusy) and "--host-cache-mb" in str(exc.value)
    # Blocked by a in use (b's pin leaves pages 0-1), a waiter waits; once a is pinned and
    # released, the pins alone block it: it fails.
    cache.pin("a", False)
    cache.hold("a")
    waiter = asyncio.create_task(cache.reserve_when_free(2 * ALIGN))
    await _settle()
    assert cache.waiting == 1
    cache.pin("a", True)
    cache.release("a")
    with pytest.raises(HostCacheFull, match=r"\(a, b\)"):
        await asyncio.wait_for(waiter, 5)
    assert cache.waiting == 0
    cache.pin("a", False)  # unpinned and idle: evicted for the next one
    cache.discard(await asyncio.wait_for(cache.reserve_when_free(2 * ALIGN), 5))
    assert set(cache.keys()) == {"b"}
    with pytest.raises(HostCacheFull, match="larger than the host cache"):
        await cache.reserve_when_free(4 * ALIGN)
    _intact(cache)


async def test_pinned_entries_that_fragment_the_arena_leave_no_range():
    """Two free pages that are not adjacent do not hold a two-page adapter."""
    cache = _cache(4)
    for key in ("a", "b", "c", "d"):
        _fill(cache, key, held=False)
    cache.pin("b", True)
    cache.pin("d", True)
    with pytest.raises(HostCacheFull, match=r"\(b, d\)"):
        cache.reserve(2 * ALIGN)
    assert set(cache.keys()) == {"a", "b", "c", "d"}  # nothing was evicted for nothing
    cache.discard(cache.reserve(ALIGN))  # one page fits: a goes
    assert "a" not in cache


async def test_a_cancelled_waiter_leaves_the_queue_with_nothing_reserved():
    cache = _cache(2)
    _fill(cache, "a")
    _fill(cache, "b")
    gone = asyncio.create_task(cache.reserve_when_free(2 * ALIGN))
    behind = asyncio.create_task(cache.reserve_when_free(ALIGN))
    await _settle()
    cache.release("a")  # room for `behind`, which waits behind `gone`
    await _settle()
    assert not behind.done()
    gone.cancel()
    block = await asyncio.wait_for(behind, 5)  # served once `gone` left
    assert gone.cancelled() and cache.waiting == 0
    # Granted and cancelled before its caller ran: the block goes back.
    cache.release("b")
    granted = asyncio.create_task(cache.reserve_when_free(2 * ALIGN))
    await _settle()
    cache.discard(block)  # the queue is served on the next turn of the loop
    await asyncio.sleep(0)
    assert cache.waiting == 0 and "b" not in cache and not granted.done()  # granted, not run
    granted.cancel()
    with pytest.raises(asyncio.CancelledError):
        await granted
    _intact(cache)
    assert cache.arena.stats().used == 0
