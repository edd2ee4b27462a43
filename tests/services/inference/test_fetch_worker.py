"""The fetch worker process against a real gRPC FetchAdapter server that follows a script.

Each test serves one adapter body through a scripted servicer (pauses, protocol violations,
errors) and fetches it through StoreClient, whose fetches run in the worker process. After
every test the arena is intact and holds no block that is not a cache entry: nothing leaked.
"""

from __future__ import annotations

import asyncio
import logging
import mmap
import os
import resource
import signal
import socket
import time

import grpc
import numpy as np
import pytest

from lorafleet.v1 import adapter_store_pb2 as pb
from services.adapter_store.wire import encode_chunk
from services.inference import store_client
from services.inference.arena import ALIGN, HostArena
from services.inference.engine.adapter_spec import AdapterSpec
from services.inference.engine.api import AdapterKey
from services.inference.errors import AdapterNotFound, StoreUnavailable
from services.inference.fetch_worker import MEMORY_ENV, AdapterCheck, Populator, keep_freed_memory
from services.inference.host_cache import HostCache, HostCacheFull
from services.inference.store_client import StoreClient
from store.peft import BaseModelMismatch, BaseModelShape
from store.synthetic import synthetic_adapter

BODY = bytes(range(256)) * 1000 + b"tail"  # 256004 bytes, not a multiple of the chunk size
CHUNK = 64 * 1024
WHOLE = [("info", None), ("body", None)]  # AdapterInfo, then the whole body
# One chunk, then a pause until the test releases the server, then the rest.
PAUSED = [("info", None), ("body", (0, CHUNK)), ("pause", None), ("body", (CHUNK, len(BODY)))]


class Script:
    """What the server does for the next FetchAdapter: ``steps`` of (what, arg)."""

    def __init__(self) -> None:
        self.steps: list[tuple[str, object]] = []
        self.body = BODY
        self.config_json = "{}"
        self.started = asyncio.Event()
        self.release = asyncio.Event()
        self.requested: list[str] = []  # each FetchAdapter's adapter_id, as it arrived


def _info(size: int, config_json: str) -> pb.FetchAdapterResponse:
    info = pb.AdapterInfo(
        adapter_id="x", version=1, size_bytes=size, adapter_config_json=config_json
    )
    return pb.FetchAdapterResponse(info=info)


async def _serve(script: Script, request, context):
    for what, arg in script.steps:
        if what == "info":
            size = arg if arg is not None else len(script.body)
            yield _info(size, script.config_json).SerializeToString()
        elif what == "body":  # arg: (start, end), None for all of it
            start, end = arg or (0, len(script.body))
            for i in range(start, end, CHUNK):
                yield encode_chunk(script.body[i : min(i + CHUNK, end)])
        elif what == "pause":  # until the test releases it
            script.started.set()
            await script.release.wait()
        elif what == "abort":
            await context.abort(arg, "scripted failure")


@pytest.fixture
async def server():
    script = Script()
    srv, port = await _start_store(script)
    yield script, f"127.0.0.1:{port}"
    script.release.set()
    await srv.stop(0)


async def _start_store(script: Script, port: int = 0) -> tuple[grpc.aio.Server, int]:
    """A scripted store on ``port`` (0: any free one), started."""
    srv = grpc.aio.server()

    async def fetch(request, context):
        script.requested.append(request.adapter_id)
        async for message in _serve(script, request, context):
            yield message

    async def watch(request, context):  # a store that holds no adapter: headers, then quiet
        await context.send_initial_metadata(())
        await script.release.wait()
        return
        yield

    handler = grpc.method_handlers_generic_handler(
        "lorafleet.v1.AdapterStore",
        {
            "FetchAdapter": grpc.unary_stream_rpc_method_handler(
                fetch,
                request_deserializer=pb.FetchAdapterRequest.FromString,
                response_serializer=lambda b: b,
            ),
            "WatchAdapters": grpc.unary_stream_rpc_method_handler(
                watch,
                request_deserializer=pb.WatchAdaptersRequest.FromString,
                response_serializer=pb.AdapterEvent.SerializeToString,
            ),
        },
    )
    srv.add_generic_rpc_handlers((handler,))
    port = srv.add_insecure_port(f"127.0.0.1:{port}")
    await srv.start()
    return srv, port


def _client(address: str, blocks: int = 200) -> tuple[StoreClient, HostCache]:
    cache = HostCache(HostArena(blocks * ALIGN, pin=False))
    return StoreClient(address, cache, lookup_timeout=5, fetch_timeout=10), cache


def _no_leak(cache: HostCache) -> None:
    cache.arena.check_integrity()
    entries = sum(-(-cache.peek(k).size_bytes // ALIGN) * ALIGN for k in cache.keys())
    assert cache.arena.stats().used == entries


async def _fetch_intact(client: StoreClient, cache: HostCache):
    entry = await client.fetch(AdapterKey("x", 1))
    assert bytes(cache.arena.view(entry.block)) == BODY
    return entry


async def test_bytes_land_in_the_shared_arena(server):
    script, address = server
    script.steps = WHOLE
    client, cache = _client(address)
    try:
        entry = await _fetch_intact(client, cache)
        again = await client.fetch(AdapterKey("x", 1))  # a cache hit: no second stream
        assert again is entry and client.fetch_latency.summary().count == 1
        _no_leak(cache)
    finally:
        await client.close()


async def test_bytes_land_with_glibcs_defaults_too(server, monkeypatch):
    """The fetch worker as bench/fetch_burst.py runs it for comparison (MEMORY_ENV=default)."""
    monkeypatch.setenv(MEMORY_ENV, "default")
    script, address = server
    script.steps = WHOLE
    client, cache = _client(address)
    try:
        await _fetch_intact(client, cache)
        _no_leak(cache)
    finally:
        await client.close()


def test_freed_memory_is_kept_on_glibc():
    assert keep_freed_memory()  # Linux with glibc, as the service's images and CI run


def _faults_writing(view: memoryview) -> int:
    """This thread's minor page faults while it writes every byte of ``view``."""
    data = b"\x01" * len(view)  # written, so in memory, before the count starts
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    view[:] = data
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before


def test_a_populated_block_takes_no_faults_as_it_is_written():
    pages = 64
    fd = os.memfd_create("test-arena")
    try:
        os.ftruncate(fd, pages * mmap.PAGESIZE)
        mapping = mmap.mmap(fd, pages * mmap.PAGESIZE)
    finally:
        os.close(fd)
    arena = np.frombuffer(mapping, dtype=np.uint8)
    view = memoryview(mapping)
    populate = Populator(arena.ctypes.data)
    size = 20 * mmap.PAGESIZE
    assert _faults_writing(view[0:size]) >= 20  # each page faulted in by its first write
    offset = 30 * mmap.PAGESIZE + 100  # not page-aligned: the page it starts in is included
    populate(offset, size)
    assert populate.enabled and _faults_writing(view[offset : offset + size]) == 0
    assert bytes(arena[offset : offset + size]) == b"\x01" * size
    view.release()
    del arena
    mapping.close()


def test_populate_gives_up_where_the_kernel_lacks_it():
    calls = []

    def old_kernel(address, length, advice):
        calls.append((address, length, advice))
        return -1  # EINVAL

    populate = Populator(4096 * 1000, madvise=old_kernel)
    populate(100, 4096)
    populate(4096, 4096)
    assert not populate.enabled and calls == [(4096 * 1000, 4196, 23)]


async def test_fetches_beyond_the_slots_wait_in_order_and_may_leave(server):
    """With one slot, a second and a third adapter wait while the first streams (paused
    mid-body by the server); the third's only caller gives up and it leaves the queue unasked;
    once the first ends, the second streams, whole, and nothing is left reserved."""
    script, address = server
    script.steps = PAUSED
    cache = HostCache(HostArena(200 * ALIGN, pin=False))
    client = StoreClient(address, cache, lookup_timeout=5, fetch_timeout=10, max_fetches=1)
    try:
        first = asyncio.create_task(client.fetch(AdapterKey("x", 1)))
        await asyncio.wait_for(script.started.wait(), 10)
        second = asyncio.create_task(client.fetch(AdapterKey("y", 1)))
        third = asyncio.create_task(client.fetch(AdapterKey("z", 1)))
        await asyncio.sleep(0.3)
        assert script.requested == ["x"] and client.streaming == 1
        assert all(client._inflight[AdapterKey(k, 1)].waiting_for_slot for k in "yz")
        third.cancel()
        with pytest.raises(asyncio.CancelledError):
            await third
        assert AdapterKey("z", 1) not in client._inflight
        script.release.set()
        entries = await asyncio.wait_for(asyncio.gather(first, second), 10)
        assert script.requested == ["x", "y"] and client.streaming == 0
        assert all(bytes(cache.arena.view(e.block)) == BODY for e in entries)
        assert client.fetch_latency.summary().count == 2
        _no_leak(cache)
    finally:
        await client.close()


def test_at_least_one_fetch_slot():
    cache = HostCache(HostArena(8 * ALIGN, pin=False))
    with pytest.raises(ValueError, match="max_fetches must be at least 1"):
        StoreClient("127.0.0.1:1", cache, lookup_timeout=5, fetch_timeout=10, max_fetches=0)


@pytest.mark.parametrize(
    ("steps", "error", "words"),
    [
        ([("abort", grpc.StatusCode.NOT_FOUND)], AdapterNotFound, "scripted failure"),
        (
            [("info", None), ("body", (0, 1000)), ("abort", grpc.StatusCode.UNAVAILABLE)],
            StoreUnavailable,
            "UNAVAILABLE",
        ),  # fmt: skip
        ([("body", (0, 10))], StoreUnavailable, "bytes before AdapterInfo"),
        ([("info", None), ("body", (0, 1000))], StoreUnavailable, "1000 of 256004"),
        ([("info", 100), ("body", (0, 1000))], StoreUnavailable, "more than the announced"),
        ([("info", None), ("info", None)], StoreUnavailable, "AdapterInfo twice"),
        ([("info", 0)], StoreUnavailable, "empty adapter"),
    ],
)
async def test_a_broken_stream_fails_cleanly(server, steps, error, words):
    script, address = server
    script.steps = steps
    client, cache = _client(address)
    try:
        with pytest.raises(error, match=words):
            await client.fetch(AdapterKey("x", 1))
        assert len(cache) == 0
        _no_leak(cache)
        script.steps = WHOLE
        await _fetch_intact(client, cache)  # the worker still serves
    finally:
        await client.close()


async def test_no_room_in_the_cache_is_reported_and_nothing_leaks(server):
    script, address = server
    script.steps = WHOLE
    client, cache = _client(address, blocks=8)  # 32 KiB: too small for the body
    try:
        with pytest.raises(HostCacheFull, match="larger than the host cache"):
            await client.fetch(AdapterKey("x", 1))
        _no_leak(cache)
    finally:
        await client.close()


async def test_a_cancelled_caller_returns_the_block_only_after_the_worker_ends(server):
    """The fetch task is cancelled while the worker writes into its block: the block stays
    reserved until the worker reports the end, then goes back to the arena."""
    script, address = server
    script.steps = PAUSED
    client, cache = _client(address)
    try:
        task = asyncio.create_task(client._fetch(AdapterKey("x", 1)))
        await asyncio.wait_for(script.started.wait(), 10)
        await asyncio.sleep(0.2)  # the block was reserved when AdapterInfo arrived
        assert cache.arena.stats().blocks == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(100):  # the worker cancels its call and reports the end
            if cache.arena.stats().blocks == 0:
                break
            await asyncio.sleep(0.05)
        assert cache.arena.stats().blocks == 0
        _no_leak(cache)
    finally:
        await client.close()


async def test_a_dead_worker_fails_its_fetches_and_is_restarted(server):
    script, address = server
    script.steps = PAUSED
    client, cache = _client(address)
    try:
        task = asyncio.create_task(client.fetch(AdapterKey("x", 1)))
        await asyncio.wait_for(script.started.wait(), 10)
        os.kill(client._worker._proc.pid, signal.SIGKILL)
        with pytest.raises(StoreUnavailable, match="fetch worker exited"):
            await asyncio.wait_for(task, 10)
        _no_leak(cache)
        assert cache.arena.stats().blocks == 0
        script.release.set()
        script.steps = WHOLE
        await _fetch_intact(client, cache)  # a new worker
        assert client.fetch_worker_starts == 2
    finally:
        await client.close()


async def test_concurrent_fetches_of_one_version_share_one_stream(server):
    script, address = server
    script.steps = WHOLE
    client, cache = _client(address)
    try:
        entries = await asyncio.gather(*(client.fetch(AdapterKey("x", 1)) for _ in range(5)))
        assert all(e is entries[0] for e in entries)
        assert client.fetch_latency.summary().count == 1
        _no_leak(cache)
    finally:
        await client.close()


async def test_the_worker_validates_what_it_fetched(server):
    """With an AdapterCheck the worker parses and validates the adapter against the base model:
    the entry carries the spec the engine then uses, or the error that rejects it."""
    script, address = server
    base = BaseModelShape(2, 64, 128, 4, 2, 16, 256)
    other = BaseModelShape(2, 32, 128, 4, 2, 8, 256)
    client, cache = _client(address, blocks=400)
    client.adapter_check = AdapterCheck(base, 64)
    try:
        for version, (shape, expect) in enumerate(
            [(base, AdapterSpec), (other, BaseModelMismatch)], start=1
        ):
            files = synthetic_adapter(shape, rank=4)
            script.body, script.config_json = files.safetensors, files.config_json.decode()
            script.steps = WHOLE
            entry = await client.fetch(AdapterKey("x", version))
            assert bytes(cache.arena.view(entry.block)) == files.safetensors
            assert isinstance(entry.verdict, expect), entry.verdict
        assert len(entry.verdict.args[0]) > 0  # the mismatch names what does not fit
        _no_leak(cache)
    finally:
        await client.close()


async def test_the_watch_follower_connects_to_a_store_with_no_adapters(server):
    """on_connect (which makes the registry forget the latest versions it knew) follows the
    store's answer even when the store has nothing to replay, and never a failed attempt."""
    _, address = server
    for target, answers in ((address, True), (f"127.0.0.1:{_free_port()}", False)):
        client, _ = _client(target)
        connected = asyncio.Event()
        follower = asyncio.create_task(client.follow(lambda event: None, connected.set))
        try:
            if answers:
                await asyncio.wait_for(connected.wait(), 10)
            else:
                await asyncio.sleep(0.5)  # a few failed attempts
                assert not connected.is_set()
        finally:
            follower.cancel()
            await asyncio.gather(follower, return_exceptions=True)
            await client.close()


async def test_a_store_that_stays_down_is_warned_of_at_intervals_then_its_return(
    monkeypatch, caplog
):
    """While the watch keeps failing: a warning at the first failure, then one a
    WATCH_WARN_EVERY_S, the attempts between at DEBUG; once the store answers, one line saying
    how long it was away."""
    monkeypatch.setattr(store_client, "WATCH_WARN_EVERY_S", 0.5)
    caplog.set_level(logging.DEBUG, logger=store_client.__name__)
    port = _free_port()
    client, _ = _client(f"127.0.0.1:{port}")
    connected = asyncio.Event()
    follower = asyncio.create_task(client.follow(lambda e: None, connected.set, max_backoff=0.02))
    store = None
    try:
        start = time.monotonic()
        await asyncio.sleep(1.6)
        down_for = time.monotonic() - start
        lines = [r for r in caplog.records if r.name == store_client.__name__]
        warnings = [r.getMessage() for r in lines if r.levelno == logging.WARNING]
        quiet = [
            r for r in lines if r.levelno == logging.DEBUG and "failed again" in r.getMessage()
        ]
        assert f"watching the adapter store at 127.0.0.1:{port} failed (UNAVAILABLE" in warnings[0]
        assert 2 <= len(warnings) <= 2 + down_for / 0.5, warnings
        assert all(" has failed for " in w for w in warnings[1:]), warnings
        assert len(quiet) > len(warnings), "the attempts between warnings are at DEBUG"
        script = Script()
        store, _ = await _start_store(script, port)
        await asyncio.wait_for(connected.wait(), 10)
        back = [r.getMessage() for r in caplog.records if "works again" in r.getMessage()]
        assert len(back) == 1 and f"at 127.0.0.1:{port} works again, after" in back[0], back
        assert caplog.records[-1].levelno <= logging.INFO
    finally:
        follower.cancel()
        await asyncio.gather(follower, return_exceptions=True)
        await client.close()
        if store is not None:
            script.release.set()
            await store.stop(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_a_request_joins_a_preload_in_flight(server):
    """A preload streams alone, not counted as a request's fetch; a request for the same
    version joins its stream (one FetchAdapter) and gets the entry held."""
    script, address = server
    script.steps = PAUSED
    client, cache = _client(address)
    key = AdapterKey("x", 1)
    try:
        preload = asyncio.create_task(client.preload(key, len(BODY)))
        await asyncio.wait_for(script.started.wait(), 10)
        assert client.demand_fetches == 0  # a preload that no request has joined
        request = asyncio.create_task(client.fetch(key, hold=True))
        await asyncio.sleep(0.1)
        assert client.demand_fetches == 1
        script.release.set()
        landed, entry = await asyncio.wait_for(asyncio.gather(preload, request), 10)
        assert landed and entry.holds == 1 and bytes(cache.arena.view(entry.block)) == BODY
        assert script.requested == ["x"]
        assert client.preloads == 1 and client.fetch_latency.summary().count == 0
        assert not await client.preload(key, len(BODY))  # cached: nothing to do
        cache.release(key)
        _no_leak(cache)
    finally:
        await client.close()


async def test_a_preload_takes_free_room_only(server):
    script, address = server
    script.steps = WHOLE
    blocks = -(-len(BODY) // ALIGN)
    client, cache = _client(address, blocks=blocks + 1)  # room for one adapter
    try:
        await _fetch_intact(client, cache)  # idle in the cache: a request's fetch would evict it
        assert not await client.preload(AdapterKey("y", 1), len(BODY))
        assert script.requested == ["x"] and cache.keys() == [AdapterKey("x", 1)]
        # Announced larger than the free room the preload reserved: skipped, nothing kept.
        cache.remove(AdapterKey("x", 1))
        script.steps = [("info", 2 * len(BODY)), ("body", None)]
        assert not await client.preload(AdapterKey("z", 1), len(BODY))
        assert script.requested == ["x", "z"] and len(cache) == 0 and client.preloads == 0
        _no_leak(cache)
    finally:
        await client.close()
