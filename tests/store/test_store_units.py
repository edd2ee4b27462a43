"""Adapter ids and object layout, StoreConfig, manifests, events, and an upload's memory bound."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from store.adapter_store import AdapterStore
from store.backends.local import LocalObjectStore
from store.config import MIB, BackendKind, StoreConfig
from store.errors import DataCorruption, InvalidRequest, WatchOverflow
from store.events import AdapterEvent, EventBus, EventKind
from store.layout import (
    blob_key,
    check_adapter_id,
    check_prefix,
    manifest_key,
    parse_version_key,
    tombstone_key,
)
from store.manifest import AdapterRecord
from store.synthetic import synthetic_adapter
from store.upload import UploadHeader

RECORD = AdapterRecord(
    adapter_id="acme/bot",
    version=3,
    rank=8,
    lora_alpha=16.0,
    target_modules=("q_proj", "v_proj"),
    size_bytes=10,
    sha256="0" * 64,
    adapter_config_json="{}",
    description="d",
    created_at=1.5,
    dtype="F16",
    num_layers=2,
    blob_key="blobs/acme/bot/x.safetensors",
)


@pytest.mark.parametrize("good", ["a", "acme/support-bot", "a.b_c-d/0/x9", "x" * 128])
def test_valid_adapter_ids(good):
    assert check_adapter_id(good) == good


@pytest.mark.parametrize(
    "bad", ["", "A", "a/", "/a", "a//b", "../a", "a/..", "a/.b", "-a", "a b", "a@v", "é", "x" * 129]
)
def test_invalid_adapter_ids(bad):
    with pytest.raises(InvalidRequest, match="adapter_id"):
        check_adapter_id(bad)


def test_prefixes_and_keys():
    assert check_prefix("") == "" and check_prefix("acme/") == "acme/"
    with pytest.raises(InvalidRequest, match="prefix"):
        check_prefix("acme/@v")
    assert manifest_key("a/b", 7) == "manifests/a/b/@v/0000000007.json"
    assert tombstone_key("a/b", 7) == "manifests/a/b/@v/0000000007.deleted"
    assert blob_key("a/b", "u1") == "blobs/a/b/u1.safetensors"
    assert parse_version_key(manifest_key("a/b", 7)) == ("a/b", 7, False)
    assert parse_version_key(tombstone_key("x", 1)) == ("x", 1, True)
    for other in (
        "blobs/a/u.safetensors",
        "manifests/a/@v/1.json",
        "manifests/A/@v/0000000001.json",
    ):
        assert parse_version_key(other) is None


def test_manifest_round_trip_and_corruption():
    assert AdapterRecord.from_json(RECORD.to_json(), "k") == RECORD
    for raw in (b"not json", b"[]", json.dumps({"format": 99}).encode(), b'{"format": 1}'):
        with pytest.raises(DataCorruption, match="manifest k"):
            AdapterRecord.from_json(raw, "k")


def test_store_config_from_args_reads_environment(tmp_path):
    base = tmp_path / "config.json"
    base.write_text(
        json.dumps(
            {
                "num_hidden_layers": 2,
                "hidden_size": 64,
                "intermediate_size": 96,
                "num_attention_heads": 4,
                "vocab_size": 10,
            }
        )
    )
    env = {
        "AWS_ACCESS_KEY_ID": "k",
        "AWS_SECRET_ACCESS_KEY": "SECRETVALUE",
        "AWS_REGION": "eu-west-1",
        "LORAFLEET_LOG_LEVEL": "debug",
    }
    config = StoreConfig.from_args(
        [
            "--backend",
            "s3",
            "--s3-endpoint",
            "http://x:1",
            "--s3-bucket",
            "b",
            "--base-model-config",
            str(base),
            "--max-adapter-bytes",
            "1000",
        ],
        env,
    )
    assert config.backend is BackendKind.S3 and config.s3_region == "eu-west-1"
    assert (config.aws_access_key_id, config.aws_secret_access_key) == ("k", "SECRETVALUE")
    assert config.log_level == "DEBUG" and config.max_adapter_bytes == 1000
    assert config.base_shape.num_kv_heads == 4 and config.base_shape.head_dim == 16
    assert "SECRETVALUE" not in repr(config)  # logs never show credentials
    local = StoreConfig.from_args([], {})
    assert local.backend is BackendKind.LOCAL and local.root == Path("data/adapters")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(backend=BackendKind.S3), "--s3-bucket"),
        (dict(port=70000), "port"),
        (dict(part_bytes=MIB), "at least"),
        (dict(fetch_chunk_bytes=8 * MIB), "fetch_chunk_bytes"),
        (dict(fetch_parallelism=0), "fetch_parallelism"),
        (dict(read_timeout_s=0), "read_timeout_s"),
        (dict(log_level="LOUD"), "log level"),
        (dict(base_model_config=Path("/nonexistent/config.json")), "not a file"),
    ],
)
def test_store_config_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StoreConfig(**kwargs)


async def test_event_bus_filters_and_drops_a_slow_watcher():
    bus = EventBus(max_events=2)
    fast, slow = bus.subscribe("acme/"), bus.subscribe("")
    other = AdapterRecord(**{**RECORD.__dict__, "adapter_id": "zeta/x"})
    bus.publish(AdapterEvent(EventKind.CREATED, RECORD))
    bus.publish(AdapterEvent(EventKind.CREATED, other))
    received = []
    async for event in fast:
        received.append(event.record.adapter_id)
        break
    assert received == ["acme/bot"]
    bus.publish(AdapterEvent(EventKind.DELETED, RECORD))  # third event: slow overflows
    assert bus.watchers == 1  # only the fast one is left
    seen = []
    with pytest.raises(WatchOverflow):
        async for event in slow:
            seen.append(event.record.adapter_id)
    assert seen == ["acme/bot", "zeta/x"]


class CountingStore(LocalObjectStore):
    """The real local backend, counting part writes in flight."""

    in_flight = 0
    most_in_flight = 0

    async def begin_multipart(self, key):
        writer = await super().begin_multipart(key)
        inner = writer.write_part

        async def write_part(number, offset, data):
            CountingStore.in_flight += 1
            CountingStore.most_in_flight = max(
                CountingStore.most_in_flight, CountingStore.in_flight
            )
            await asyncio.sleep(0.01)
            try:
                await inner(number, offset, data)
            finally:
                CountingStore.in_flight -= 1

        writer.write_part = write_part
        return writer


async def test_upload_memory_stays_bounded(tmp_path):
    from store.base_model import BaseModelShape

    files = synthetic_adapter(BaseModelShape(4, 2048, 4096, 16, 16, 128, 10), rank=64)
    config = StoreConfig(root=tmp_path, part_bytes=5 * MIB, upload_parts_in_flight=2)
    store = AdapterStore(CountingStore(tmp_path), config)

    async def chunks():
        for offset in range(0, len(files.safetensors), 1 << 20):
            yield files.safetensors[offset : offset + (1 << 20)]

    header = UploadHeader("mem/test", files.config_json.decode())
    record = await store.upload(header, chunks())
    assert record.version == 1 and record.size_bytes == len(files.safetensors)
    assert len(files.safetensors) > 3 * config.part_bytes
    # Memory: the parts in flight plus one part being filled, whatever the adapter's size.
    assert CountingStore.most_in_flight == 2
    body = b"".join([bytes(c) async for c in store.fetch(record)])
    assert body == files.safetensors
    await store.close()
