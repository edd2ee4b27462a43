"""The preloader: the store's adapters come into the host cache before a request wants them.

In process, against a scripted FetchAdapter server (test_fetch_worker.py's): the preloader
waits while a request's fetch streams, and follows the watch's versions. Through an adapter
store process and an inference service process: adapters in the store when the service starts,
and versions created while it serves, are preloaded, so their requests fetch nothing and match
the engine alone, and (the default, --preload-adapters pool) are copied into the page pool
before any request; with host, they stay in the host cache until a request wants them; a host
cache smaller than the store's adapters is filled and no more, and requests for the others
still complete (test_host_cache_pressure.py); with off nothing is preloaded.
"""

from __future__ import annotations

import asyncio
import logging

from lorafleet.v1 import inference_pb2 as pb
from services.inference import preload
from services.inference.arena import ALIGN, HostArena
from services.inference.engine.api import AdapterKey
from services.inference.host_cache import HostCache
from services.inference.preload import Preloader
from services.inference.store_client import AdapterEvent, StoreClient
from tests.services.inference.reference import PROMPTS, assert_matches
from tests.services.inference.stack import collect, upload, wait_for
from tests.services.inference.test_fetch_worker import BODY, PAUSED, WHOLE, server  # noqa: F401


async def _until(predicate, what: str, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise TimeoutError(what)
        await asyncio.sleep(0.02)


async def test_the_preloader_waits_for_requests_fetches(server):  # noqa: F811
    script, address = server
    script.steps = PAUSED
    cache = HostCache(HostArena(200 * ALIGN, pin=False))
    client = StoreClient(address, cache, lookup_timeout=5, fetch_timeout=10)
    preloader = Preloader(client, cache)
    runner = asyncio.create_task(preloader.run())
    try:
        request = asyncio.create_task(client.fetch(AdapterKey("r", 1)))
        await asyncio.wait_for(script.started.wait(), 10)
        preloader.on_event(AdapterEvent(True, "p", 1, len(BODY)))
        preloader.on_event(AdapterEvent(True, "q", 1, len(BODY)))
        preloader.on_event(AdapterEvent(True, "q", 2, len(BODY)))  # replaces q's version 1
        preloader.on_event(AdapterEvent(True, "gone", 1, len(BODY)))
        preloader.on_event(AdapterEvent(False, "gone", 1, len(BODY)))  # deleted: not preloaded
        await asyncio.sleep(0.3)
        assert script.requested == ["r"] and preloader.pending == 2  # behind the request's
        script.release.set()
        await asyncio.wait_for(request, 10)
        await _until(lambda: preloader.preloaded == 2, "p and q preloaded")
        # p and q stream at once (PRELOAD_STREAMS), after the request's
        assert script.requested[0] == "r" and sorted(script.requested[1:]) == ["p", "q"]
        assert preloader.pending == 0
        assert set(cache.keys()) == {AdapterKey("r", 1), AdapterKey("p", 1), AdapterKey("q", 2)}
        # Preloaded entries are the least recently used: a request's fetch evicts them first.
        assert cache.keys()[-1] == AdapterKey("r", 1)
        assert client.preloads == 2 and client.fetch_latency.summary().count == 1
    finally:
        runner.cancel()
        await client.close()


async def test_preloads_stream_a_few_at_once_and_stop_at_the_first_without_room(
    server,  # noqa: F811
):
    """PRELOAD_STREAMS preloads stream at once, the others wait in the queue; once one finds
    no free room none is started after it, and it goes back to the queue's front."""
    script, address = server
    script.steps = PAUSED
    block = -(-len(BODY) // ALIGN) * ALIGN  # what one adapter takes of the arena
    cache = HostCache(HostArena(8 * block, pin=False))
    client = StoreClient(address, cache, lookup_timeout=5, fetch_timeout=10, max_fetches=8)
    preloader = Preloader(client, cache)
    runner = asyncio.create_task(preloader.run())
    names = [f"a{i}" for i in range(6)]
    try:
        for name in names:
            preloader.on_event(AdapterEvent(True, name, 1, len(BODY)))
        await _until(lambda: len(script.requested) == preload.PRELOAD_STREAMS, "streams")
        await asyncio.sleep(0.3)  # no more start while those stream
        assert sorted(script.requested) == names[: preload.PRELOAD_STREAMS]
        assert client.streaming == preload.PRELOAD_STREAMS and preloader.pending == len(names)
        script.release.set()
        await _until(lambda: preloader.preloaded == len(names), "every adapter preloaded")
        assert sorted(script.requested) == names and preloader.pending == 0
        assert {key.adapter_id for key in cache.keys()} == set(names)
        # Two more fit the cache's free room (8 blocks); the third and the fourth, started
        # beside them, find none and go back to the queue's front, in order.
        more = [f"b{i}" for i in range(4)]
        for name in more:
            preloader.on_event(AdapterEvent(True, name, 1, len(BODY)))
        await _until(lambda: preloader.preloaded == len(names) + 2, "two more preloaded")
        await asyncio.sleep(0.3)
        assert preloader.preloaded == len(names) + 2 and preloader.pending == 2
        assert AdapterKey("b2", 1) not in cache and AdapterKey("b3", 1) not in cache
        assert list(preloader._pending) == ["b2", "b3"]
        assert client.streaming == 0
    finally:
        runner.cancel()
        await client.close()


async def test_preloads_at_once_hold_at_most_their_bytes(server):  # noqa: F811
    """With room for two adapters' bytes in flight, two stream at once, not four; one always
    may, however large."""
    script, address = server
    script.steps = PAUSED
    cache = HostCache(HostArena(8 * -(-len(BODY) // ALIGN) * ALIGN, pin=False))  # 8 adapters
    client = StoreClient(address, cache, lookup_timeout=5, fetch_timeout=10, max_fetches=8)
    preloader = Preloader(client, cache, max_bytes=2 * len(BODY))
    alone = Preloader(client, cache, max_bytes=1)
    runner = asyncio.create_task(preloader.run())
    try:
        for name in ("a", "b", "c", "d"):
            preloader.on_event(AdapterEvent(True, name, 1, len(BODY)))
        await _until(lambda: len(script.requested) == 2, "two streams")
        await asyncio.sleep(0.3)
        assert sorted(script.requested) == ["a", "b"] and client.streaming == 2
        script.release.set()
        await _until(lambda: preloader.preloaded == 4, "every adapter preloaded")
        assert preloader.pending == 0
        runner.cancel()
        script.release.clear()
        runner = asyncio.create_task(alone.run())
        for name in ("e", "f"):
            alone.on_event(AdapterEvent(True, name, 1, len(BODY)))
        await _until(lambda: len(script.requested) == 5, "one stream")
        await asyncio.sleep(0.3)
        assert script.requested[4] == "e" and client.streaming == 1
        script.release.set()
        await _until(lambda: alone.preloaded == 2, "e and f preloaded")
    finally:
        runner.cancel()
        await client.close()


def test_preloads_put_back_keep_the_order_they_were_started_in():
    """Preloads that did not land, in two passes of the loop (the second's started first):
    back at the queue's front in the order started, ahead of those never started."""
    preloader = Preloader(store=None, cache=None)  # type: ignore[arg-type]
    for name in ("a", "b", "c", "d", "e"):
        preloader.on_event(AdapterEvent(True, name, 1, len(BODY)))
    for _ in range(3):  # a, b and c start, as _preload_pending starts them
        preloader._returned.pop(preloader._pending.popitem(last=False)[0], None)
    preloader._put_back([(3, AdapterKey("c", 1), len(BODY))])
    preloader._put_back([(1, AdapterKey("a", 1), len(BODY))])
    assert list(preloader._pending) == ["a", "c", "d", "e"]
    preloader.on_event(AdapterEvent(False, "c", 1, len(BODY)))  # deleted meanwhile
    preloader._put_back([(2, AdapterKey("b", 1), len(BODY))])
    assert list(preloader._pending) == ["a", "b", "d", "e"]


def _stats(stack) -> pb.GetStatsResponse:
    return stack.stub.GetStats(pb.GetStatsRequest(), timeout=10)


def _in_pool(stack) -> set[tuple[str, int]]:
    listed = stack.stub.ListAdapters(pb.ListResidentAdaptersRequest(), timeout=10).adapters
    return {(a.adapter_id, a.version) for a in listed if a.residency == pb.RESIDENCY_GPU}


def test_store_adapters_are_preloaded_and_serve_without_a_fetch(
    stack_factory, svc_models, reference
):
    stack = stack_factory()  # a, b and c are in the store before the service starts
    wait_for(lambda: _stats(stack).host_cache.entries == 3, what="a, b and c preloaded")
    # --preload-adapters pool (the default): copied into the page pool too, before any request.
    wait_for(lambda: _in_pool(stack) == {("a", 1), ("b", 1), ("c", 1)}, what="a, b, c placed")
    assert _stats(stack).adapter_copy.count == 3
    for i, name in enumerate("abc"):
        request = pb.GenerateRequest(prompt=PROMPTS[i], adapter_id=name)
        assert_matches(collect(stack.stub, request), reference.expect(request, 1), request)
    stats = _stats(stack)
    assert stats.adapter_fetch.count == 0 and stats.adapter_copy.count == 3  # no more copies
    # A version created while the service runs is preloaded as the watch names it.
    assert upload(stack.store.address, "a", svc_models.adapters["a2"]).version == 2
    wait_for(
        lambda: "preloaded adapter 'a' version 2" in stack.inference.log(),
        what="a's version 2 preloaded",
    )  # fmt: skip
    assert _stats(stack).host_cache.entries == 3  # version 1 was dropped: superseded and idle
    wait_for(lambda: ("a", 2) in _in_pool(stack), what="a's version 2 placed")
    request = pb.GenerateRequest(prompt=PROMPTS[3], adapter_id="a")
    stream = collect(stack.stub, request)
    assert stream.last.adapter_version == 2
    assert_matches(stream, reference.expect(request, version=2), request)
    assert _stats(stack).adapter_fetch.count == 0


def test_host_preload_leaves_the_pool_to_requests(stack_factory, reference):
    stack = stack_factory(flags=("--preload-adapters", "host"))
    wait_for(lambda: _stats(stack).host_cache.entries == 3, what="a, b and c preloaded")
    assert _in_pool(stack) == set() and _stats(stack).adapter_copy.count == 0
    request = pb.GenerateRequest(prompt=PROMPTS[2], adapter_id="c")
    assert_matches(collect(stack.stub, request), reference.expect(request, 1), request)
    stats = _stats(stack)
    assert stats.adapter_fetch.count == 0 and stats.adapter_copy.count == 1
    assert _in_pool(stack) == {("c", 1)}


def test_without_preload_adapters_wait_in_the_store(stack_factory, reference):
    stack = stack_factory(flags=("--preload-adapters", "off"))
    request = pb.GenerateRequest(prompt=PROMPTS[0], adapter_id="b")
    assert _stats(stack).host_cache.entries == 0  # the service was SERVING: its watch ran
    assert_matches(collect(stack.stub, request), reference.expect(request, 1), request)
    stats = _stats(stack)
    assert stats.adapter_fetch.count == 1 and stats.host_cache.entries == 1


async def test_placements_pause_when_the_pool_is_busy_and_skip_superseded_versions(
    server,  # noqa: F811
    monkeypatch,
    caplog,
):
    """``place`` answering False (the pool keeps its free pages for KV) pauses placements for
    IDLE_RECHECK_S; a version superseded meanwhile is not placed, its successor is. The pause
    is logged once however often it is rechecked, and so is the resumption."""
    monkeypatch.setattr(preload, "IDLE_RECHECK_S", 0.1)
    caplog.set_level(logging.INFO, logger=preload.log.name)
    script, address = server
    script.steps = WHOLE
    cache = HostCache(HostArena(200 * ALIGN, pin=False))
    client = StoreClient(address, cache, lookup_timeout=5, fetch_timeout=10)
    busy, placed = [True], []

    async def place(key: AdapterKey) -> bool:
        if busy[0]:
            return False
        placed.append(key)
        return True

    preloader = Preloader(client, cache, place)
    runner = asyncio.create_task(preloader.run())
    try:
        preloader.on_event(AdapterEvent(True, "p", 1, len(BODY)))
        await _until(lambda: AdapterKey("p", 1) in cache, "p's version 1 preloaded")
        preloader.on_event(AdapterEvent(True, "p", 2, len(BODY)))  # supersedes version 1
        await _until(lambda: AdapterKey("p", 2) in cache, "p's version 2 preloaded")
        assert placed == []  # the pool was busy
        await asyncio.sleep(0.35)  # rechecked a few times meanwhile
        busy[0] = False
        await _until(lambda: placed, "a placement after the pause")
        await asyncio.sleep(0.3)
        assert placed == [AdapterKey("p", 2)] and preloader.placed == 1
        pauses = [r for r in caplog.messages if "page pool pauses" in r]
        resumes = [r for r in caplog.messages if "page pool resumes" in r]
        assert len(pauses) == 1 and len(resumes) == 1, caplog.messages
        assert "'p', version=2" in resumes[0] and "0 preloaded adapters wait" in resumes[0]
    finally:
        runner.cancel()
        await client.close()


async def test_placed_adapters_that_left_the_pool_are_placed_again(
    server,  # noqa: F811
    monkeypatch,
):
    """Every IDLE_RECHECK_S the preloader looks which adapters it placed are no longer in the
    pool (the KV cache took their pages) and places them again, in the order first placed;
    one superseded meanwhile is forgotten, its successor placed."""
    monkeypatch.setattr(preload, "IDLE_RECHECK_S", 0.1)
    script, address = server
    script.steps = WHOLE
    cache = HostCache(HostArena(200 * ALIGN, pin=False))
    client = StoreClient(address, cache, lookup_timeout=5, fetch_timeout=10)
    pool: set[AdapterKey] = set()
    placed: list[AdapterKey] = []

    async def place(key: AdapterKey) -> bool:
        placed.append(key)
        pool.add(key)
        return True

    preloader = Preloader(client, cache, place, lambda key: key in pool)
    runner = asyncio.create_task(preloader.run())
    p1, q1, p2 = AdapterKey("p", 1), AdapterKey("q", 1), AdapterKey("p", 2)
    try:
        preloader.on_event(AdapterEvent(True, "p", 1, len(BODY)))
        preloader.on_event(AdapterEvent(True, "q", 1, len(BODY)))
        await _until(lambda: len(placed) == 2, "p and q placed")  # as each landed
        await asyncio.sleep(0.3)
        assert set(placed) == {p1, q1} and preloader.returned == 0  # in the pool: left alone
        pool.clear()  # the KV cache took both adapters' pages
        await _until(lambda: len(placed) == 4, "p and q placed again")
        assert placed[2:] == placed[:2] and preloader.returned == 2 and preloader.placed == 4
        pool.discard(q1)
        preloader.on_event(AdapterEvent(True, "p", 2, len(BODY)))  # supersedes p's version 1
        pool.discard(p1)
        await _until(lambda: len(placed) == 6, "q and p's version 2 placed")
        assert set(placed[4:]) == {q1, p2}
        await asyncio.sleep(0.3)
        assert len(placed) == 6  # p's version 1 was not placed again
    finally:
        runner.cancel()
        await client.close()


def test_adapters_return_to_the_pool_once_the_kv_cache_gives_pages_back(stack_factory, reference):
    """A pool of 64 pages: a, b and c are placed in its free half; a base-model request whose
    KV needs more pages than are free makes the engine evict idle adapters; once it has ended the
    preloader places them again, and their requests then copy nothing."""
    stack = stack_factory(flags=("--num-pages", "64"))
    everything = {("a", 1), ("b", 1), ("c", 1)}
    wait_for(lambda: _in_pool(stack) == everything, what="a, b and c placed")
    pool = _stats(stack).pool
    tokens = (pool.free_pages + 2) * pool.page_size  # more KV than the free pages hold
    long = pb.GenerateRequest(
        prompt_token_ids=[3 + i % 250 for i in range(tokens)],
        sampling=pb.SamplingParams(max_new_tokens=4),
    )
    assert collect(stack.stub, long).last.usage.completion_tokens == 4
    stats = _stats(stack)
    evicted = stats.adapter_evictions_gpu
    assert evicted >= 1
    assert stats.adapter_evictions_gpu_queued == 0  # idle ones: no queued request wanted them
    wait_for(lambda: _in_pool(stack) == everything, timeout=30, what="a, b and c placed again")
    assert _stats(stack).adapter_copy.count == 3 + evicted
    for i, name in enumerate("abc"):
        request = pb.GenerateRequest(prompt=PROMPTS[i], adapter_id=name)
        assert_matches(collect(stack.stub, request), reference.expect(request, 1), request)
    stats = _stats(stack)
    assert stats.adapter_copy.count == 3 + evicted and stats.adapter_fetch.count == 0
