"""A host cache smaller than the adapters wanted at once: requests wait for room instead of
failing. Through an adapter store process and an inference service process, 8 concurrent
Generate calls on 8 distinct adapters share a cache that holds 2 and each gets exactly what the
engine alone computes; pinned adapters that fill the cache fail a request with
RESOURCE_EXHAUSTED naming them. In process, a call that gives up while it waits leaves nothing
reserved or held."""

from __future__ import annotations

import asyncio
import re
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from lorafleet.v1 import inference_pb2 as pb
from services.inference.arena import ALIGN
from services.inference.engine.api import AdapterKey, GenerationRequest
from services.inference.engine.sampling_params import SamplingParams
from services.inference.tiny_model import make_adapter
from tests.services.inference.conftest import start_stack, stop_stack
from tests.services.inference.reference import PROMPTS, Reference, assert_matches
from tests.services.inference.stack import collect, sampling, store_proc, upload, wait_for

N = 8
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CACHE_MB = 1


def _blocks(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


@pytest.fixture(scope="module")
def big_adapters(svc_models, tmp_path_factory):
    """N rank-32 adapters on every projection of the tiny model: about 430 KB each, so a cache
    of CACHE_MB MiB holds two of them and not three."""
    root = tmp_path_factory.mktemp("big-adapters")
    return {
        f"p{i}": make_adapter(
            svc_models.model,
            root / f"p{i}",
            rank=32,
            lora_alpha=16,
            target_modules=MODULES,
            seed=100 + i,
        )  # fmt: skip
        for i in range(N)
    }


@pytest.fixture(scope="module")
def big_reference(svc_models, big_adapters) -> Reference:
    return Reference(
        svc_models.model, {AdapterKey(name, 1): path for name, path in big_adapters.items()}
    )


@pytest.fixture(scope="module")
def small_cache_stack(svc_models, big_adapters, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("small-cache")
    # Requests' fetches alone (no preload): each of the N adapters is fetched when wanted.
    flags = ("--host-cache-mb", str(CACHE_MB), "--preload-adapters", "off")
    stack = start_stack(svc_models, tmp, uploads=(), flags=flags)
    sizes = [upload(stack.store.address, n, p).size_bytes for n, p in big_adapters.items()]
    assert 2 * _blocks(max(sizes)) <= CACHE_MB << 20 < 3 * _blocks(min(sizes))
    yield stack
    stop_stack(stack)


@pytest.fixture(scope="module")
def preloading_small_cache_stack(svc_models, big_adapters, tmp_path_factory):
    """The same cache, the adapters in the store before the service starts, preload on."""
    tmp = tmp_path_factory.mktemp("small-cache-preload")
    store = store_proc(tmp / "store", tmp).start().wait_serving()
    for name, path in big_adapters.items():
        upload(store.address, name, path)
    flags = ("--host-cache-mb", str(CACHE_MB))
    stack = start_stack(svc_models, tmp, uploads=(), store=store, flags=flags)
    yield stack
    stop_stack(stack)


def _request(i: int, new: int = 8) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=f"press-{i}", prompt=PROMPTS[i % len(PROMPTS)], adapter_id=f"p{i}",
        sampling=sampling(max_new_tokens=new),
    )  # fmt: skip


def _stats(stack) -> pb.GetStatsResponse:
    return stack.stub.GetStats(pb.GetStatsRequest(), timeout=10)


def test_distinct_adapters_beyond_the_cache_wait_and_all_complete(small_cache_stack, big_reference):
    stack = small_cache_stack
    requests = [_request(i) for i in range(N)]
    seen: list[pb.GetStatsResponse] = []
    done = threading.Event()

    def watch():
        while not done.is_set():
            seen.append(_stats(stack))

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with ThreadPoolExecutor(N) as pool:
            streams = list(pool.map(lambda r: collect(stack.stub, r, timeout=120), requests))
    finally:
        done.set()
        watcher.join()
    for request, stream in zip(requests, streams, strict=True):
        assert_matches(stream, big_reference.expect(request, version=1), request)
    after = _stats(stack)
    capacity = after.host_cache.capacity_bytes
    assert capacity == CACHE_MB << 20
    assert all(s.host_cache.used_bytes <= capacity and s.host_cache.entries <= 2 for s in seen)
    assert after.adapter_evictions_host >= N - 2 and after.adapter_fetch.count == N
    assert "waits for room in the host cache" in stack.inference.log()
    assert "RESOURCE_EXHAUSTED" not in stack.inference.log()


def test_preload_fills_the_cache_and_no_more(preloading_small_cache_stack, big_reference):
    """The preloader takes the free room (two adapters), evicts nothing for the third; those
    two serve without a fetch, the others are fetched as requests want them, evicting the
    preloaded ones, and every request gets what the engine alone computes."""
    stack = preloading_small_cache_stack

    def landed(log: str) -> list[str]:
        return sorted(set(re.findall(r"preloaded adapter 'p(\d)' version 1", log)))

    # Preloads stream a few at once: the one that finds no room may stop the preloader before
    # the others have landed.
    log = wait_for(
        lambda: (log := stack.inference.log()) and "preloading stops at adapter" in log
        and len(landed(log)) >= 2 and log,
        what="the preloader stopping for want of room, two adapters preloaded",
    )  # fmt: skip
    preloaded = landed(log)
    stats = _stats(stack)
    assert len(preloaded) == 2 and stats.host_cache.entries == 2
    assert stats.adapter_fetch.count == 0 and stats.adapter_evictions_host == 0
    first = [_request(int(i)) for i in preloaded]
    rest = [_request(i) for i in range(N) if str(i) not in preloaded]
    for request in first:  # from the preloaded bytes
        stream = collect(stack.stub, request, timeout=120)
        assert_matches(stream, big_reference.expect(request, version=1), request)
    assert _stats(stack).adapter_fetch.count == 0
    with ThreadPoolExecutor(len(rest)) as pool:
        streams = list(pool.map(lambda r: collect(stack.stub, r, timeout=120), rest))
    for request, stream in zip(rest, streams, strict=True):
        assert_matches(stream, big_reference.expect(request, version=1), request)
    after = _stats(stack)
    assert after.adapter_fetch.count == N - 2 and after.adapter_evictions_host >= N - 2
    assert after.host_cache.entries <= 2


def test_pinned_adapters_that_fill_the_cache_are_named(small_cache_stack, big_reference):
    stack = small_cache_stack
    for name in ("p0", "p1"):
        stack.stub.LoadAdapter(pb.LoadAdapterRequest(adapter_id=name, pin=True), timeout=60)
    try:
        stream = collect(stack.stub, _request(2))
        assert stream.code == grpc.StatusCode.RESOURCE_EXHAUSTED, stream.details
        assert "pinned adapters" in stream.details and "--host-cache-mb" in stream.details
        assert "p0 version 1" in stream.details and "p1 version 1" in stream.details
    finally:
        stack.stub.UnloadAdapter(pb.UnloadAdapterRequest(adapter_id="p0"), timeout=10)
    request = _request(2)  # p1 still pinned; p0's room serves p2
    assert_matches(collect(stack.stub, request), big_reference.expect(request, version=1), request)
    stack.stub.UnloadAdapter(pb.UnloadAdapterRequest(adapter_id="p1"), timeout=10)


async def _until(predicate, what: str, timeout: float = 30.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise TimeoutError(f"{what} not reached within {timeout} s")
        await asyncio.sleep(0.02)


async def test_a_call_that_gives_up_while_waiting_leaves_nothing_behind(
    svc_models, big_adapters, big_reference, tmp_path
):
    """p0 and p1 fill the cache, held by calls in progress. Two calls for p2 wait for room:
    one gives up at its deadline and the wait goes on for the other; once that one is cancelled
    too, nothing is reserved, held or queued. Once p0 is released, p2 is fetched again and
    serves what the engine alone computes."""
    from services.inference.adapter_registry import AdapterRegistry
    from services.inference.arena import HostArena
    from services.inference.engine.config import EngineConfig
    from services.inference.engine.engine import Engine
    from services.inference.host_cache import HostCache
    from services.inference.store_client import StoreClient

    store = store_proc(tmp_path / "store", tmp_path).start().wait_serving()
    engine = Engine(EngineConfig(model_dir=svc_models.model, device="cpu", num_pages=512))
    await engine.start()
    try:
        size = max(upload(store.address, n, big_adapters[n]).size_bytes for n in ("p0", "p1", "p2"))
        cache = HostCache(HostArena(2 * _blocks(size) + ALIGN, pin=False))
        client = StoreClient(store.address, cache, lookup_timeout=10, fetch_timeout=30)
        registry = AdapterRegistry(engine, client, cache)
        p0 = await registry.acquire("p0", 0)
        p1 = await registry.acquire("p1", 0)

        patient = asyncio.create_task(registry.acquire("p2", 0))
        await _until(lambda: cache.waiting == 1, "p2's fetch waiting for room")
        impatient = asyncio.create_task(asyncio.wait_for(registry.acquire("p2", 0), 0.5))
        await _until(lambda: registry.fetch_waiters == 2, "two calls waiting")
        with pytest.raises(TimeoutError):
            await impatient
        assert cache.waiting == 1 and registry.fetch_waiters == 1  # the other one still waits
        patient.cancel()
        with pytest.raises(asyncio.CancelledError):
            await patient
        await _until(lambda: cache.waiting == 0, "the queue emptied")
        assert registry.fetch_waiters == 0 and not client._inflight
        assert set(cache.keys()) == {p0, p1} and cache.arena.stats().blocks == 2
        assert [cache.peek(k).holds for k in (p0, p1)] == [1, 1]
        cache.arena.check_integrity()

        registry.release(p0)  # p0 idle: its room goes to the next fetch of p2
        p2 = await asyncio.wait_for(registry.acquire("p2", 0), 30)
        try:
            request = GenerationRequest(
                "after", PROMPTS[1], adapter=p2, sampling=SamplingParams(max_new_tokens=6)
            )
            tokens = tuple([t async for out in engine.generate(request) for t in out.token_ids])
        finally:
            registry.release(p2)
        expected = big_reference.expect(
            pb.GenerateRequest(
                prompt=PROMPTS[1], adapter_id="p2", sampling=pb.SamplingParams(max_new_tokens=6)
            ),
            version=1,
        )
        assert tokens == expected.token_ids
        registry.release(p1)
        assert all(cache.peek(k).holds == 0 for k in cache.keys())
        assert client.fetch_latency.summary().count == 3  # p0, p1, then p2 once
        cache.arena.check_integrity()
        await client.close()
    finally:
        await engine.stop()
        store.stop()
    engine.core.check_integrity()
