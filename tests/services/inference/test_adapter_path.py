"""The engine side of the adapter path: batched host -> pool writes equal the pool geometry's
reference layout, adapters are used in place (no host copy), and the engine API the service
drives (load, pin, status, releasable, re-add after remove)."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest
import torch

from kernels.lora_layout import MODULES, write_module
from lorafleet.v1 import inference_pb2 as pb
from services.inference import adapter_registry
from services.inference.arena import ALIGN, HostArena
from services.inference.engine.adapter_copy import write_adapter
from services.inference.engine.adapter_manager import AdapterState
from services.inference.engine.api import AdapterKey, GenerationRequest
from services.inference.engine.config import EngineConfig
from services.inference.engine.engine import Engine
from services.inference.engine.host_adapter import build_host_adapter
from services.inference.engine.sampling_params import SamplingParams
from services.inference.host_cache import HostCache
from services.inference.store_client import AdapterEvent
from store.peft import BaseModelShape
from store.synthetic import lora_config_json, lora_tensors, safetensors_bytes

SHAPE = BaseModelShape(
    num_layers=12, hidden_size=48, intermediate_size=80, num_heads=4, num_kv_heads=2,
    head_dim=12, vocab_size=64,
)  # fmt: skip
WIDTH = SHAPE.num_kv_heads * SHAPE.head_dim  # 24: rows of 48 and 80 span several chunks
PROMPT = "The quick brown fox"


def _adapter(order: str, config_extra: dict | None = None, dtype: str = "F16"):
    tensors = dict(lora_tensors(SHAPE, rank=4, dtype=dtype, seed=3))
    if order == "by-name":  # how safetensors writers order a PEFT file: layers 0, 1, 10, 11, 2...
        tensors = dict(sorted(tensors.items()))
    config = json.loads(lora_config_json(4, 8.0, MODULES))
    config.update(config_extra or {})
    if "layers_to_transform" in (config_extra or {}):
        keep = {f"layers.{i}." for i in config["layers_to_transform"]}
        tensors = {k: v for k, v in tensors.items() if any(s in k for s in keep)}
    return json.dumps(config), safetensors_bytes(tensors)


def _reference_pool(host, dtype):
    """The layout written layer by layer with kernels.lora_layout.write_module."""
    pool = torch.full((SHAPE.num_layers, 2, 512, WIDTH), 7.0, dtype=dtype)
    slots = torch.arange(host.plan.num_slots, dtype=torch.int64) + 100
    for m, place in enumerate(host.plan.placements):
        if place is None:
            continue
        d_in, d_out = host.dims[m]
        for layer in range(SHAPE.num_layers):
            pair = host.pairs.get((layer, m))
            if pair is None:
                a, b = torch.zeros(0, d_in, dtype=dtype), torch.zeros(d_out, 0, dtype=dtype)
            else:
                a = host.host_view(pair.a).to(dtype)
                b = host.host_view(pair.b)
                b = (b.float() * pair.fold if pair.fold is not None else b).to(dtype)
            write_module(pool, layer, slots, place, a, b)
    return pool, slots


@pytest.mark.parametrize(
    ("order", "extra", "dtype"),
    [
        ("by-layer", None, "F16"),  # equally spaced layers: one strided view per module
        ("by-name", None, "BF16"),  # permuted layers: stacked views
        ("by-name", {"rank_pattern": {"down_proj": 2},
                     "alpha_pattern": {"layers.3.mlp.up_proj": 2}}, "F32"),  # layer by layer
        ("by-layer", {"layers_to_transform": [1, 4, 11]}, "F16"),
    ],
)  # fmt: skip
def test_batched_write_equals_the_reference_layout(order, extra, dtype):
    config, body = _adapter(order, extra, dtype)
    if extra and "rank_pattern" in extra:  # shrink down_proj to the rank the pattern gives it
        body = _shrunk(body)
    host = build_host_adapter("k", config, body, SHAPE, WIDTH, 128, pin=False)
    expected, slots = _reference_pool(host, torch.float32)
    actual = torch.full_like(expected, 7.0)
    write_adapter(actual, host, slots, host.raw)
    assert torch.equal(actual, expected)


def _shrunk(body: bytes) -> bytes:
    """Rewrites an F32 file with down_proj at rank 2 (what rank_pattern {down_proj: 2} means)."""
    from safetensors.torch import load, save

    tensors = load(body)
    for name in list(tensors):
        if "down_proj.lora_A" in name:
            tensors[name] = tensors[name][:2].contiguous()
        elif "down_proj.lora_B" in name:
            tensors[name] = tensors[name][:, :2].contiguous()
    return save(tensors)


def test_the_engine_reads_adapter_bytes_in_place(tmp_path):
    config, body = _adapter("by-layer")
    raw = torch.frombuffer(bytearray(body), dtype=torch.uint8)
    host = build_host_adapter("k", config, raw, SHAPE, WIDTH, 128, pin=False)
    assert host.raw.data_ptr() == raw.data_ptr()  # no host copy
    pair = host.pairs[(0, 0)]
    assert host.host_view(pair.a).data_ptr() == raw.data_ptr() + pair.a.offset


@pytest.fixture(scope="module")
def engine_setup(svc_models):
    cfg = EngineConfig(model_dir=svc_models.model, device="cpu", max_loras=2, num_pages=256)
    return cfg, svc_models.adapters


def _files(path):
    return (path / "adapter_config.json").read_bytes(), (
        path / "adapter_model.safetensors"
    ).read_bytes()


async def test_load_pin_status_and_readd(engine_setup):
    cfg, adapters = engine_setup
    engine = Engine(cfg)
    await engine.start()
    try:
        a, b, c = (AdapterKey(n, 1) for n in ("a", "b", "c"))
        for key, name in ((a, "a"), (b, "b"), (c, "c")):
            engine.add_adapter(key, *_files(adapters[name]))
        assert engine.adapter_status(a).state is AdapterState.HOST
        await engine.load_adapter(a, pin=True)
        assert engine.adapter_in_pool(a) and engine.adapter_status(a).pinned
        assert engine.adapter_copy_seconds() and len(engine.adapter_copy_seconds()) == 1
        # Two index rows: b and c take turns; the pinned a is never the one evicted.
        for key in (b, c, b, c):
            await engine.load_adapter(key)
            assert engine.adapter_in_pool(a) and engine.adapter_in_pool(key)
        engine.pin_adapter(a, False)
        await engine.load_adapter(b)
        await engine.load_adapter(c)  # now a, the least recently used idle one, goes
        assert engine.adapter_status(a).state is AdapterState.HOST
        assert engine.adapter_releasable(a)

        # A removed adapter comes back when added again (before or after its pages are freed).
        engine.remove_adapter(c)
        assert engine.adapter_status(c) is None
        engine.add_adapter(c, *_files(adapters["c"]))
        sampling = SamplingParams(max_new_tokens=3)
        outs = [o async for o in engine.generate(GenerationRequest("r", "hi", adapter=c,
                                                                   sampling=sampling))]  # fmt: skip
        assert outs[-1].finish_reason is not None
        with pytest.raises(LookupError):
            await engine.load_adapter(AdapterKey("missing", 1))
    finally:
        await engine.stop()
    engine.core.check_integrity()


async def test_host_cache_evicts_back_to_the_store(svc_models, reference, tmp_path):
    """A host cache with room for two adapters: serving a, b, c evicts the least recently used
    one's bytes (and drops it from the engine); its next use fetches it again and still serves
    exactly what the engine alone computes."""
    from services.inference.adapter_registry import AdapterRegistry
    from services.inference.arena import ALIGN, HostArena
    from services.inference.host_cache import HostCache
    from services.inference.store_client import StoreClient
    from tests.services.inference.stack import store_proc, upload

    store = store_proc(tmp_path / "store", tmp_path).start().wait_serving()
    engine = Engine(EngineConfig(model_dir=svc_models.model, device="cpu", num_pages=512))
    await engine.start()
    try:
        sizes = {}
        for name in ("a", "b", "c"):
            sizes[name] = upload(store.address, name, svc_models.adapters[name]).size_bytes
        room = sum(-(-sizes[n] // ALIGN) * ALIGN for n in ("b", "c")) + ALIGN
        cache = HostCache(HostArena(room, pin=False))
        client = StoreClient(store.address, cache, lookup_timeout=10, fetch_timeout=30)
        registry = AdapterRegistry(engine, client, cache)

        async def serve(name: str) -> tuple[int, ...]:
            key = await registry.acquire(name, 0)
            six = SamplingParams(max_new_tokens=6)
            request = GenerationRequest(f"{name}-{len(cache)}", PROMPT, adapter=key, sampling=six)
            try:
                return tuple([t async for out in engine.generate(request) for t in out.token_ids])
            finally:
                registry.release(key)

        first = {name: await serve(name) for name in ("a", "b", "c")}
        assert cache.stats().evictions >= 1 and "a" not in {k.adapter_id for k in cache.keys()}
        assert engine.adapter_status(AdapterKey("a", 1)) is None  # dropped from the engine too
        fetches = client.fetch_latency.summary().count
        assert await serve("a") == first["a"]
        assert client.fetch_latency.summary().count == fetches + 1  # fetched from the store again
        for name in ("a", "b", "c"):
            six = pb.SamplingParams(max_new_tokens=6)
            request = pb.GenerateRequest(prompt=PROMPT, adapter_id=name, sampling=six)
            expected = reference.expect(request, version=1)
            assert first[name] == expected.token_ids
        cache.arena.check_integrity()
        await client.close()
    finally:
        await engine.stop()
        store.stop()
    engine.core.check_integrity()


def test_the_watchs_replay_is_not_logged_adapter_by_adapter_but_new_versions_are(caplog):
    """Each connect of the store's watch replays every adapter's latest version: thousands of
    INFO lines a start with thousands of adapters. A first version noted is a DEBUG line; a
    version that replaces the known latest one (a hot reload) an INFO line; an older one is
    ignored."""
    engine = SimpleNamespace(adapter_releasable=lambda key: True)  # the watch never touches it
    registry = adapter_registry.AdapterRegistry(engine, None, HostCache(HostArena(ALIGN, False)))
    caplog.set_level(logging.DEBUG, logger=adapter_registry.log.name)
    for i in range(50):
        registry.on_event(AdapterEvent(True, f"t/a{i}", 1, 100))
    registry.on_event(AdapterEvent(True, "t/a7", 3, 100))
    registry.on_event(AdapterEvent(True, "t/a7", 2, 100))  # older than the latest: ignored
    info = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert info == ["adapter t/a7: version 3 replaces version 1 as the latest"]
    assert len(debug) == 50
    registry.forget_latest()  # a reconnect: the replay names them again, quietly
    registry.on_event(AdapterEvent(True, "t/a7", 3, 100))
    assert len([r for r in caplog.records if r.levelno >= logging.INFO]) == 1
