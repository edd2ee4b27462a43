"""Other store processes' changes reach this one's watchers (store/rescan.py).

In process: two AdapterStores on one local root, as two store processes on one storage, each
with its own watchers. As processes: two adapter stores on one S3 bucket (SeaweedFS), a
WatchAdapters stream on one of them, uploads and deletes through the other."""

from __future__ import annotations

import threading
import time
import uuid

import grpc
import pytest

from lorafleet.v1 import adapter_store_pb2 as pb
from store.adapter_store import AdapterStore
from store.backends.local import LocalObjectStore
from store.base_model import BaseModelShape
from store.config import StoreConfig
from store.layout import manifest_key
from store.synthetic import synthetic_adapter
from store.upload import UploadHeader
from tests.services.adapter_store.conftest import new_bucket
from tests.services.adapter_store.store_harness import StoreProcess, upload_requests

SHAPE = BaseModelShape(2, 64, 96, 4, 2, 16, 128)
FILES = synthetic_adapter(SHAPE, rank=4)


async def _upload(store: AdapterStore, adapter_id: str) -> int:
    async def chunks():
        yield FILES.safetensors

    header = UploadHeader(adapter_id, FILES.config_json.decode())
    return (await store.upload(header, chunks())).version


def _drain(subscription) -> list[tuple[str, str, int]]:
    out = []
    while not subscription._queue.empty():
        event = subscription._queue.get_nowait()
        out.append((event.kind.value, event.record.adapter_id, event.record.version))
    return out


async def test_a_store_announces_what_another_store_on_its_storage_changed(tmp_path):
    config = StoreConfig(root=tmp_path)
    a = AdapterStore(LocalObjectStore(tmp_path), config)
    b = AdapterStore(LocalObjectStore(tmp_path), config)
    await _upload(b, "t/old")
    assert await a.rescan.run() == 0  # the first rescan learns what is there
    watcher = a.events.subscribe()
    try:
        await _upload(b, "t/x")
        await _upload(b, "t/y")
        await _upload(b, "t/y")
        assert await a.rescan.run() == 2
        assert sorted(_drain(watcher)) == [("created", "t/x", 1), ("created", "t/y", 2)]
        assert await a.rescan.run() == 0  # nothing changed since

        await b.delete("t/y", 2)  # version 1 is the latest again
        await b.delete("t/old", all_versions=True)
        await a.rescan.run()
        assert sorted(_drain(watcher)) == [
            ("created", "t/y", 1), ("deleted", "t/old", 1), ("deleted", "t/y", 2),
        ]  # fmt: skip

        # This store's own changes reach its watchers once, as it makes them.
        assert await _upload(a, "t/x") == 2
        await a.delete("t/y", all_versions=True)
        own = _drain(watcher)
        assert own == [("created", "t/x", 2), ("deleted", "t/y", 1)]
        assert await a.rescan.run() == 0 and _drain(watcher) == []
        # ... and reach the other store's watchers by its rescan.
        other = b.events.subscribe()
        await b.rescan.run()  # its first: it learns the storage as it is now
        await a.delete("t/x", 2)
        await b.rescan.run()
        assert _drain(other) == [("deleted", "t/x", 2), ("created", "t/x", 1)]
        other.close()
    finally:
        watcher.close()
        await a.close()
        await b.close()


async def test_a_change_a_rescan_overlaps_is_left_to_the_next(tmp_path):
    """A delete this store makes while its rescan reads manifests is not announced back as
    a creation: the rescan leaves that adapter to the next one, which finds it gone."""
    config = StoreConfig(root=tmp_path)
    a = AdapterStore(LocalObjectStore(tmp_path), config)
    b = AdapterStore(LocalObjectStore(tmp_path), config)
    await a.rescan.run()
    watcher = a.events.subscribe()
    try:
        await _upload(b, "t/z")  # listed by a's next rescan, which then reads its manifest
        read = a.catalog.read
        deleted = []

        async def read_then_delete(adapter_id, version=0):
            record = await read(adapter_id, version)
            if not deleted:  # (the delete reads the manifest too)
                deleted.append(adapter_id)
                await a.delete(adapter_id, version)  # this store deletes it meanwhile
            return record

        a.catalog.read = read_then_delete
        assert await a.rescan.run() == 0 and deleted == ["t/z"]
        a.catalog.read = read
        assert _drain(watcher) == [("deleted", "t/z", 1)]  # its own delete, nothing else
        assert await a.rescan.run() == 0 and _drain(watcher) == []
    finally:
        watcher.close()
        await a.close()
        await b.close()


async def test_an_unreadable_manifest_is_skipped_and_said_once(tmp_path, caplog):
    """A manifest that another writer left unreadable is not announced, and is warned of
    once however many rescans meet it; the other adapters' changes still are announced."""
    config = StoreConfig(root=tmp_path)
    a = AdapterStore(LocalObjectStore(tmp_path), config)
    await a.rescan.run()
    watcher = a.events.subscribe()
    try:
        await a.backend.put(manifest_key("t/bad", 1), b"{not json")
        b = AdapterStore(LocalObjectStore(tmp_path), config)
        await _upload(b, "t/good")
        await b.close()
        for _ in range(3):
            await a.rescan.run()
        assert _drain(watcher) == [("created", "t/good", 1)]
        warned = [r.getMessage() for r in caplog.records if "rescan skips" in r.getMessage()]
        assert len(warned) == 1 and "t/bad v1" in warned[0], warned
    finally:
        watcher.close()
        await a.close()


def test_config_refuses_a_negative_rescan_interval():
    with pytest.raises(ValueError, match="watch_rescan_s must be 0"):
        StoreConfig(watch_rescan_s=-1)
    assert StoreConfig.from_args(["--watch-rescan-s", "0"]).watch_rescan_s == 0


def test_two_store_processes_on_one_bucket_announce_each_others_changes(seaweed, tmp_path):
    bucket = new_bucket(seaweed)
    flags = ("--watch-rescan-s", "0.2")
    a = StoreProcess(tmp_path / "a", "s3", seaweed, bucket, extra_args=flags).start()
    b = StoreProcess(tmp_path / "b", "s3", seaweed, bucket, extra_args=flags).start()
    prefix = f"r{uuid.uuid4().hex[:8]}/"
    events: list[tuple[int, str, int]] = []
    call = a.stub.WatchAdapters(pb.WatchAdaptersRequest(prefix=prefix), timeout=60)

    def follow():
        try:
            for event in call:
                events.append((event.type, event.adapter.adapter_id, event.adapter.version))
        except grpc.RpcError:
            pass

    reader = threading.Thread(target=follow, daemon=True)
    reader.start()
    try:
        info = b.stub.UploadAdapter(upload_requests(f"{prefix}m", FILES), timeout=30)
        created = (pb.ADAPTER_EVENT_TYPE_CREATED, f"{prefix}m", info.version)
        _until(lambda: created in events, "store a announced store b's upload")
        b.stub.DeleteAdapter(pb.DeleteAdapterRequest(adapter_id=f"{prefix}m"), timeout=30)
        deleted = (pb.ADAPTER_EVENT_TYPE_DELETED, f"{prefix}m", info.version)
        _until(lambda: deleted in events, "store a announced store b's delete")
        assert events == [created, deleted]
        assert "the storage changed beside this process" in a.log()
    finally:
        call.cancel()
        reader.join(10)
        assert b.stop() == 0 and a.stop() == 0, a.log()


def _until(predicate, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)
