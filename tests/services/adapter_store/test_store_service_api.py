"""The adapter store over real gRPC, on both backends: round trips, versions, pagination,
concurrency, events, health and reflection."""

from __future__ import annotations

import hashlib
import queue
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from lorafleet.v1 import adapter_store_pb2 as pb
from store.base_model import BaseModelShape
from store.synthetic import synthetic_adapter
from tests.services.adapter_store.store_harness import BASE, upload_requests

SMALL = synthetic_adapter(BASE, rank=4, modules=("q_proj", "v_proj"), seed=1)


def fetch(store, adapter_id, version=0):
    responses = list(
        store.stub.FetchAdapter(pb.FetchAdapterRequest(adapter_id=adapter_id, version=version))
    )
    assert responses[0].WhichOneof("payload") == "info"
    assert all(r.WhichOneof("payload") == "chunk" for r in responses[1:])
    return responses[0].info, b"".join(r.chunk for r in responses[1:])


@pytest.mark.parametrize("chunk_bytes", [1000, 4 << 20])
def test_round_trip_is_byte_exact(store, adapter_id, chunk_bytes):
    info = store.stub.UploadAdapter(
        upload_requests(adapter_id, SMALL, chunk_bytes, description="first try")
    )
    assert (info.adapter_id, info.version, info.rank, info.lora_alpha) == (adapter_id, 1, 4, 16.0)
    assert list(info.target_modules) == ["q_proj", "v_proj"]
    assert info.size_bytes == len(SMALL.safetensors)
    assert info.sha256 == hashlib.sha256(SMALL.safetensors).hexdigest()
    assert info.adapter_config_json == SMALL.config_json.decode()
    assert (info.dtype, info.num_layers, info.description) == ("F16", 2, "first try")
    assert info.created_at.seconds > 0
    fetched, body = fetch(store, adapter_id)
    assert fetched == info
    assert body == SMALL.safetensors
    assert store.stub.GetAdapter(pb.GetAdapterRequest(adapter_id=adapter_id)) == info


def test_large_adapter_uses_several_parts_and_ranged_reads(store, adapter_id):
    # 2 layers x 7 modules of rank 64 on a wider model: ~19 MB, more than two 8 MiB parts.
    wide = BaseModelShape(2, 4096, 11008, 32, 32, 128, 100)
    files = synthetic_adapter(
        wide,
        rank=64,
        modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
        seed=3,
    )
    assert len(files.safetensors) > 16 << 20
    info = store.stub.UploadAdapter(upload_requests(adapter_id, files, 3 << 20))
    _, body = fetch(store, adapter_id)
    assert info.size_bytes == len(body)
    assert body == files.safetensors
    assert store.pending_uploads() == []


def test_versions_latest_and_delete(store, adapter_id):
    bodies = [synthetic_adapter(BASE, rank=2 + i, modules=("o_proj",), seed=i) for i in range(3)]
    versions = [store.stub.UploadAdapter(upload_requests(adapter_id, b)).version for b in bodies]
    assert versions == [1, 2, 3]
    assert store.stub.GetAdapter(pb.GetAdapterRequest(adapter_id=adapter_id)).version == 3
    for version, files in zip(versions, bodies, strict=True):
        info, body = fetch(store, adapter_id, version)
        assert (info.version, info.rank, body) == (
            version,
            files.config_json and info.rank,
            files.safetensors,
        )
    assert fetch(store, adapter_id, 2)[0].rank == 3

    deleted = store.stub.DeleteAdapter(pb.DeleteAdapterRequest(adapter_id=adapter_id))
    assert list(deleted.deleted_versions) == [3]
    assert store.stub.GetAdapter(pb.GetAdapterRequest(adapter_id=adapter_id)).version == 2
    with pytest.raises(grpc.RpcError) as info:
        store.stub.GetAdapter(pb.GetAdapterRequest(adapter_id=adapter_id, version=3))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    # A deleted number is never handed out again.
    assert store.stub.UploadAdapter(upload_requests(adapter_id, bodies[0])).version == 4
    deleted = store.stub.DeleteAdapter(pb.DeleteAdapterRequest(adapter_id=adapter_id, version=1))
    assert list(deleted.deleted_versions) == [1]
    deleted = store.stub.DeleteAdapter(
        pb.DeleteAdapterRequest(adapter_id=adapter_id, all_versions=True)
    )
    assert list(deleted.deleted_versions) == [2, 4]
    for request in (
        lambda: store.stub.GetAdapter(pb.GetAdapterRequest(adapter_id=adapter_id)),
        lambda: fetch(store, adapter_id),
        lambda: store.stub.DeleteAdapter(pb.DeleteAdapterRequest(adapter_id=adapter_id)),
    ):
        with pytest.raises(grpc.RpcError) as info:
            request()
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        assert adapter_id in info.value.details()
    assert store.blob_keys(adapter_id) == []


def test_pagination_under_a_prefix(store, adapter_id):
    ids = sorted(f"{adapter_id}/a{i}" for i in range(7)) + [f"{adapter_id}-other/x"]
    for i, name in enumerate(ids):
        store.stub.UploadAdapter(upload_requests(name, SMALL))
        if i == 2:
            store.stub.UploadAdapter(upload_requests(name, SMALL))  # a second version
    pages, token = [], ""
    while True:
        page = store.stub.ListAdapters(
            pb.ListAdaptersRequest(prefix=f"{adapter_id}/", page_size=3, page_token=token)
        )
        pages.append([(a.adapter_id, a.version) for a in page.adapters])
        token = page.next_page_token
        if not token:
            break
    assert [len(p) for p in pages] == [3, 3, 1]
    listed = [entry for page in pages for entry in page]
    # Pages follow the storage's key order: stable, no adapter twice or missing.
    assert sorted(listed) == [(name, 2 if i == 2 else 1) for i, name in enumerate(ids[:7])]
    whole = store.stub.ListAdapters(pb.ListAdaptersRequest(prefix=f"{adapter_id}/"))
    assert [(a.adapter_id, a.version) for a in whole.adapters] == listed
    assert whole.next_page_token == ""
    everything = store.stub.ListAdapters(pb.ListAdaptersRequest(prefix=adapter_id))
    assert sorted(a.adapter_id for a in everything.adapters) == sorted(ids)
    # A deleted adapter drops out of the listing.
    store.stub.DeleteAdapter(pb.DeleteAdapterRequest(adapter_id=listed[0][0], all_versions=True))
    first = store.stub.ListAdapters(pb.ListAdaptersRequest(prefix=f"{adapter_id}/", page_size=1))
    assert [a.adapter_id for a in first.adapters] == [listed[1][0]]

    for request, message in (
        (pb.ListAdaptersRequest(prefix=adapter_id, page_token="garbage!"), "page_token"),
        (pb.ListAdaptersRequest(prefix="other", page_token=first.next_page_token), "prefix"),
        (pb.ListAdaptersRequest(prefix="UPPER"), "prefix"),
        (pb.ListAdaptersRequest(page_size=5000), "page_size"),
    ):
        with pytest.raises(grpc.RpcError) as info:
            store.stub.ListAdapters(request)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in info.value.details()


def test_concurrent_uploads_of_one_id_get_distinct_versions(store, adapter_id):
    files = [synthetic_adapter(BASE, rank=2, modules=("k_proj",), seed=s) for s in range(6)]
    with ThreadPoolExecutor(6) as pool:
        infos = list(
            pool.map(
                lambda f: store.stub.UploadAdapter(upload_requests(adapter_id, f, 4096)), files
            )
        )
    assert sorted(i.version for i in infos) == [1, 2, 3, 4, 5, 6]
    for info, f in zip(infos, files, strict=True):
        assert fetch(store, adapter_id, info.version)[1] == f.safetensors


def test_watch_answers_before_any_event(store, adapter_id):
    """The watch's headers come at once, even with nothing to replay: a watcher can tell that
    the store answered (the inference service then forgets the latest versions it knew)."""
    call = store.stub.WatchAdapters(
        pb.WatchAdaptersRequest(prefix=f"{adapter_id}/", include_existing=True)
    )
    got = []
    thread = threading.Thread(target=lambda: got.append(call.initial_metadata()), daemon=True)
    thread.start()
    thread.join(10)
    call.cancel()
    assert got, "no headers from a watch with nothing to replay"


def test_watch_streams_creates_and_deletes(store, adapter_id):
    store.stub.UploadAdapter(upload_requests(f"{adapter_id}/old", SMALL))
    events: queue.Queue = queue.Queue()
    call = store.stub.WatchAdapters(
        pb.WatchAdaptersRequest(prefix=f"{adapter_id}/", include_existing=True)
    )

    def pump():
        try:
            for event in call:
                events.put(event)
        except grpc.RpcError:
            pass

    thread = threading.Thread(target=pump, daemon=True)
    thread.start()
    first = events.get(timeout=10)
    assert (first.type, first.adapter.adapter_id) == (
        pb.ADAPTER_EVENT_TYPE_CREATED,
        f"{adapter_id}/old",
    )
    store.stub.UploadAdapter(upload_requests(f"{adapter_id}-elsewhere", SMALL))  # filtered out
    store.stub.UploadAdapter(upload_requests(f"{adapter_id}/new", SMALL))
    store.stub.DeleteAdapter(pb.DeleteAdapterRequest(adapter_id=f"{adapter_id}/old"))
    created, deleted = events.get(timeout=10), events.get(timeout=10)
    assert (created.type, created.adapter.adapter_id, created.adapter.version) == (
        pb.ADAPTER_EVENT_TYPE_CREATED,
        f"{adapter_id}/new",
        1,
    )
    assert (deleted.type, deleted.adapter.adapter_id) == (
        pb.ADAPTER_EVENT_TYPE_DELETED,
        f"{adapter_id}/old",
    )
    assert created.event_time.seconds > 0
    call.cancel()
    thread.join(10)
    assert events.empty()


def test_corrupted_object_ends_fetch_with_data_loss(store, adapter_id):
    store.stub.UploadAdapter(upload_requests(adapter_id, SMALL))
    (key,) = store.blob_keys(adapter_id)
    damaged = bytearray(SMALL.safetensors)
    damaged[-1] ^= 0xFF
    store.write_object(key, bytes(damaged))
    stream = store.stub.FetchAdapter(pb.FetchAdapterRequest(adapter_id=adapter_id))
    received = []
    with pytest.raises(grpc.RpcError) as info:
        for response in stream:
            received.append(response)
    assert info.value.code() == grpc.StatusCode.DATA_LOSS
    assert "sha256" in info.value.details() or "hash" in info.value.details()
    assert received and received[0].WhichOneof("payload") == "info"

    store.write_object(key, SMALL.safetensors[:-10])  # truncated
    with pytest.raises(grpc.RpcError) as info:
        fetch(store, adapter_id)
    assert info.value.code() == grpc.StatusCode.DATA_LOSS


def test_health_and_reflection(store):
    from grpc_health.v1 import health_pb2_grpc

    health = health_pb2_grpc.HealthStub(store.channel)
    for service in ("", "lorafleet.v1.AdapterStore"):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    reflection = reflection_pb2_grpc.ServerReflectionStub(store.channel)
    replies = reflection.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")])
    )
    names = {s.name for reply in replies for s in reply.list_services_response.service}
    assert {"lorafleet.v1.AdapterStore", "grpc.health.v1.Health"} <= names
