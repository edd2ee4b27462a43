"""The adapter store's metrics endpoint (--metrics-port), scraped from a store process: calls
by method and status, the adapter bytes moved, and the levels read at scrape time."""

from __future__ import annotations

import re
import threading
import time
import urllib.request

import grpc

from lorafleet.v1 import adapter_store_pb2 as pb
from store.synthetic import synthetic_adapter
from tests.services.adapter_store.store_harness import BASE, StoreProcess, upload_requests

FILES = synthetic_adapter(BASE, rank=4, seed=3)


def _scrape(store: StoreProcess) -> dict[str, float]:
    deadline = time.monotonic() + 10
    while not (found := re.search(r"metrics on http://[^:]+:(\d+)/", store.log())):
        assert time.monotonic() < deadline, store.log()
        time.sleep(0.05)
    body = urllib.request.urlopen(f"http://127.0.0.1:{found.group(1)}/metrics", timeout=5).read()
    return {
        m.group(1): float(m.group(2))
        for m in re.finditer(r"^(lorafleet_store_\S+) (\S+)$", body.decode(), re.M)
    }


def test_calls_bytes_and_levels_are_counted(tmp_path):
    store = StoreProcess(tmp_path, "local", extra_args=("--metrics-port", "0")).start()
    try:
        before = _scrape(store)
        assert before['lorafleet_store_calls_total{code="OK",method="UploadAdapter"}'] == 0
        size = len(FILES.safetensors)
        store.stub.UploadAdapter(upload_requests("m/a", FILES), timeout=30)
        body = b"".join(
            r.chunk for r in store.stub.FetchAdapter(pb.FetchAdapterRequest(adapter_id="m/a"))
        )
        assert len(body) == size
        for call in (
            lambda: store.stub.GetAdapter(pb.GetAdapterRequest(adapter_id="m/none"), timeout=5),
            lambda: store.stub.UploadAdapter(
                upload_requests("m/b", FILES, sha256="0" * 64), timeout=30
            ),
        ):
            try:
                call()
            except grpc.RpcError:
                pass
        watch = store.stub.WatchAdapters(pb.WatchAdaptersRequest(prefix="m/"), timeout=30)

        def follow():
            try:
                list(watch)
            except grpc.RpcError:  # cancelled below
                pass

        watching = threading.Thread(target=follow, daemon=True)
        watching.start()
        time.sleep(0.5)
        got = _scrape(store)
        watch.cancel()
        watching.join(5)
        assert got['lorafleet_store_calls_total{code="OK",method="UploadAdapter"}'] == 1
        assert (
            got['lorafleet_store_calls_total{code="INVALID_ARGUMENT",method="UploadAdapter"}'] == 1
        )
        assert got['lorafleet_store_calls_total{code="OK",method="FetchAdapter"}'] == 1
        assert got['lorafleet_store_calls_total{code="NOT_FOUND",method="GetAdapter"}'] == 1
        assert got['lorafleet_store_adapter_bytes_total{direction="upload"}'] == size
        assert got['lorafleet_store_adapter_bytes_total{direction="fetch"}'] == size
        assert (
            got["lorafleet_store_watchers"] == 1 and got["lorafleet_store_uploads_in_flight"] == 0
        )
        assert got["lorafleet_store_rescan_events_total"] == 0
        # the cancelled watch counts as CANCELLED once its stream has ended
        deadline = time.monotonic() + 10
        key = 'lorafleet_store_calls_total{code="CANCELLED",method="WatchAdapters"}'
        while _scrape(store).get(key) != 1:
            assert time.monotonic() < deadline, _scrape(store)
            time.sleep(0.1)
    finally:
        assert store.stop() == 0, store.log()
