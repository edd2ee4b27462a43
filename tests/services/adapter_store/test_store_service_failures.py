"""Failures around uploads: a client that vanishes, a SIGTERM, storage that goes away and comes
back. Each must leave no version and no multipart upload behind."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from functools import cache
from types import SimpleNamespace

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from lorafleet.v1 import adapter_store_pb2 as pb
from services.adapter_store import server as store_server
from store.base_model import BaseModelShape
from store.errors import StorageUnavailable
from store.synthetic import AdapterFiles, synthetic_adapter
from tests.s3server import SeaweedServer
from tests.services.adapter_store.conftest import new_bucket
from tests.services.adapter_store.store_harness import (
    BASE,
    REPO,
    StoreProcess,
    upload_requests,
)

SMALL = synthetic_adapter(BASE, rank=4, modules=("q_proj",))
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

# Uploads 12 MiB of a ~19 MB adapter (so that a multipart upload has begun), then hangs.
CLIENT = """
import sys, time, grpc
from lorafleet.v1 import adapter_store_pb2_grpc as pb_grpc
from store.base_model import BaseModelShape
from store.synthetic import synthetic_adapter
from tests.services.adapter_store.store_harness import upload_requests

files = synthetic_adapter(BaseModelShape(2, 4096, 11008, 32, 32, 128, 100), rank=64, seed=5)
def requests():
    for i, request in enumerate(upload_requests(sys.argv[2], files, 1 << 20)):
        yield request
        if i == 12:
            print("sent", flush=True)
            time.sleep(3600)
pb_grpc.AdapterStoreStub(grpc.insecure_channel(sys.argv[1])).UploadAdapter(requests())
"""


@cache
def big() -> AdapterFiles:
    return synthetic_adapter(BaseModelShape(2, 4096, 11008, 32, 32, 128, 100), rank=64, seed=5)


def wait_for(condition, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def assert_no_version(store, adapter_id):
    with pytest.raises(grpc.RpcError) as info:
        store.stub.GetAdapter(pb.GetAdapterRequest(adapter_id=adapter_id), timeout=10)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert store.blob_keys(adapter_id) == []


class GatedUpload:
    """An upload from a thread that sends ``before`` chunks of 1 MiB, then waits for release()."""

    def __init__(self, store, adapter_id, before: int = 12) -> None:
        self.gate = threading.Event()
        self.error: grpc.RpcError | None = None
        self._store, self._adapter_id, self._before = store, adapter_id, before
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _requests(self):
        for i, request in enumerate(upload_requests(self._adapter_id, big(), 1 << 20)):
            yield request
            if i == self._before:
                self.gate.wait(60)

    def _run(self):
        try:
            self._store.stub.UploadAdapter(self._requests(), timeout=60)
        except grpc.RpcError as exc:
            self.error = exc

    def release(self) -> grpc.RpcError | None:
        self.gate.set()
        self.thread.join(60)
        return self.error


def test_client_that_disappears_mid_upload_leaves_nothing(store, adapter_id):
    client = subprocess.Popen(
        [sys.executable, "-c", CLIENT, store.address, adapter_id],
        cwd=REPO,
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        assert client.stdout.readline().strip() == b"sent"
        wait_for(store.pending_uploads, 20, "the multipart upload to begin")
    finally:
        client.kill()  # no goodbye: the connection just drops
        client.wait()
    wait_for(lambda: store.pending_uploads() == [], 20, "the multipart upload to be aborted")
    assert_no_version(store, adapter_id)
    # The store is fine afterwards.
    assert store.stub.UploadAdapter(upload_requests(adapter_id, SMALL)).version == 1


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_sigterm_aborts_uploads_in_flight(tmp_path, backend, request, adapter_id):
    if backend == "local":
        store = StoreProcess(tmp_path, "local")
    else:
        seaweed = request.getfixturevalue("seaweed")
        store = StoreProcess(tmp_path, "s3", seaweed, new_bucket(seaweed))
    store.start()
    upload = GatedUpload(store, adapter_id)
    wait_for(store.pending_uploads, 20, "the multipart upload to begin")
    store.process.send_signal(signal.SIGTERM)
    assert store.process.wait(20) == 0, store.log()
    error = upload.release()
    assert error is not None and error.code() == grpc.StatusCode.UNAVAILABLE, error
    assert "shutting down" in error.details()
    assert store.pending_uploads() == []
    assert store.blob_keys(adapter_id) == []
    assert "aborting 1 upload(s) in flight" in store.log()
    store.stop()


def test_storage_outage_fails_fast_and_recovers(tmp_path, adapter_id):
    seaweed = SeaweedServer(tmp_path / "seaweed", bucket="outage")
    seaweed.start()
    store = StoreProcess(tmp_path / "store", "s3", seaweed, "outage", ("--probe-interval-s", "0.5"))
    try:
        store.start()
        health = health_pb2_grpc.HealthStub(store.channel)
        service = health_pb2.HealthCheckRequest(service="lorafleet.v1.AdapterStore")
        assert store.stub.UploadAdapter(upload_requests(adapter_id, SMALL)).version == 1
        interrupted = GatedUpload(store, f"{adapter_id}-big")
        wait_for(store.pending_uploads, 20, "the multipart upload to begin")

        seaweed.stop()
        calls = {
            "get": lambda: store.stub.GetAdapter(
                pb.GetAdapterRequest(adapter_id=adapter_id), timeout=5
            ),
            "fetch": lambda: list(
                store.stub.FetchAdapter(pb.FetchAdapterRequest(adapter_id=adapter_id), timeout=5)
            ),
            "list": lambda: store.stub.ListAdapters(pb.ListAdaptersRequest(), timeout=5),
            "delete": lambda: store.stub.DeleteAdapter(
                pb.DeleteAdapterRequest(adapter_id=adapter_id), timeout=5
            ),
            "upload": lambda: store.stub.UploadAdapter(
                upload_requests(f"{adapter_id}-new", SMALL), timeout=5
            ),
        }
        for name, call in calls.items():
            start = time.monotonic()
            with pytest.raises(grpc.RpcError) as info:
                call()
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE, (name, info.value.details())
            assert time.monotonic() - start < 5.0, name
        error = interrupted.release()
        assert error is not None and error.code() == grpc.StatusCode.UNAVAILABLE, error
        # The server keeps answering health checks; the store's own status follows storage.
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=1).status == SERVING
        wait_for(lambda: health.Check(service, timeout=1).status == NOT_SERVING, 10, "NOT_SERVING")

        seaweed.start()
        wait_for(lambda: health.Check(service, timeout=1).status == SERVING, 30, "SERVING again")
        info = store.stub.GetAdapter(pb.GetAdapterRequest(adapter_id=adapter_id), timeout=10)
        assert info.version == 1
        responses = list(store.stub.FetchAdapter(pb.FetchAdapterRequest(adapter_id=adapter_id)))
        assert b"".join(r.chunk for r in responses[1:]) == SMALL.safetensors
        assert store.stub.UploadAdapter(upload_requests(adapter_id, SMALL)).version == 2
        # The upload cut off by the outage was aborted once storage came back.
        wait_for(lambda: store.pending_uploads() == [], 20, "the leftover upload to be aborted")
        assert_no_version(store, f"{adapter_id}-big")
        assert_no_version(store, f"{adapter_id}-new")
        assert store.stop() == 0, store.log()
    finally:
        if store.process is not None:
            store.process.kill()
        seaweed.stop()


async def test_the_rescan_loop_says_a_storage_outage_once_and_goes_on_after_a_bug(caplog):
    """server._rescan_storage: storage that fails the rescans gives one warning for the run
    (the attempts between at DEBUG) and a line when the rescans work again; an unexpected
    error is logged with its traceback and the rescans go on."""
    outcomes = [StorageUnavailable("S3 down")] * 4 + [None, RuntimeError("a bug"), None]
    done = asyncio.Event()

    class Rescan:
        async def run(self):
            outcome = outcomes.pop(0)
            if not outcomes:
                done.set()
            if outcome is not None:
                raise outcome

    caplog.set_level(logging.DEBUG, logger=store_server.__name__)
    loop = asyncio.create_task(store_server._rescan_storage(SimpleNamespace(rescan=Rescan()), 0.01))
    try:
        await asyncio.wait_for(done.wait(), 10)
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == store_server.__name__]
    assert [m for level, m in lines if level == logging.WARNING] == [
        "rescanning the storage for other stores' changes failed (S3 down); rescanning every 0.01 s"
    ]
    assert sum(level == logging.DEBUG for level, _ in lines) == 3
    assert (
        logging.INFO,
        "rescanning the storage for other stores' changes works again, after 0 s and 4 failed "
        "attempts",
    ) in lines
    assert lines[-1] == (logging.ERROR, "rescanning the storage failed unexpectedly")
