"""A store killed mid-upload leaves nothing once it is back (both backends, kill -9), and uploads
are bounded: how many run at once (and so the memory they take), and how long one may take."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import grpc
import pytest

from lorafleet.v1 import adapter_store_pb2 as pb
from tests.services.adapter_store.conftest import new_bucket
from tests.services.adapter_store.store_harness import StoreProcess, upload_requests
from tests.services.adapter_store.test_store_service_failures import (
    SMALL,
    GatedUpload,
    assert_no_version,
    big,
    wait_for,
)
from tests.services.inference.stack import rss_bytes


def local_leftovers(root: Path) -> list[str]:
    """Files of unfinished writes under the local backend's root."""
    return sorted(p.name for d in (".uploads", ".tmp") for p in (root / d).iterdir())


def _kill_9(store: StoreProcess, upload: GatedUpload) -> None:
    store.process.send_signal(signal.SIGKILL)
    store.process.wait(20)
    store.process = None
    store._log.close()
    upload.release()  # the client sees its call fail; nothing more reaches the store


def test_local_store_killed_mid_upload_leaves_nothing_and_spares_live_uploads(tmp_path, adapter_id):
    """Two store processes share one directory. One is killed with kill -9 mid-upload; a new
    one started on the directory removes what the dead one left, and not the other's live
    upload, which then completes."""
    shared = tmp_path / "shared"
    live = StoreProcess(tmp_path / "live", "local", root=shared)
    doomed = StoreProcess(tmp_path / "doomed", "local", root=shared)
    live.start()
    doomed.start()
    try:
        living = GatedUpload(live, f"{adapter_id}-live")
        wait_for(lambda: len(live.pending_uploads()) == 1, 20, "the live upload to begin")
        dying = GatedUpload(doomed, adapter_id)
        wait_for(lambda: len(live.pending_uploads()) == 2, 20, "the second upload to begin")
        _kill_9(doomed, dying)
        assert len(local_leftovers(live.root)) == 4  # two .part files and their .key markers

        restarted = StoreProcess(tmp_path / "restarted", "local", root=shared)
        restarted.start()
        try:
            assert live.pending_uploads() == [p for p in live.pending_uploads() if "-live/" in p]
            assert len(live.pending_uploads()) == 1
            assert_no_version(restarted, adapter_id)
            assert "an upload left unfinished by a store that stopped" in restarted.log()
            assert living.release() is None  # the live upload completed
            info = restarted.stub.GetAdapter(pb.GetAdapterRequest(adapter_id=f"{adapter_id}-live"))
            assert info.version == 1 and info.size_bytes == len(big().safetensors)
            assert local_leftovers(live.root) == []
            assert restarted.stop() == 0, restarted.log()
        finally:
            if restarted.process is not None:
                restarted.process.kill()
    finally:
        assert live.stop() == 0, live.log()


def test_s3_store_killed_mid_upload_leaves_nothing(tmp_path, seaweed, adapter_id):
    bucket = new_bucket(seaweed)
    store = StoreProcess(tmp_path / "a", "s3", seaweed, bucket)
    store.start()
    upload = GatedUpload(store, adapter_id)
    wait_for(store.pending_uploads, 20, "the multipart upload to begin")
    _kill_9(store, upload)
    assert len(store.pending_uploads()) == 1  # S3 keeps it: no one aborted it

    # The documented rule: a multipart upload begun longer ago than --stale-upload-s is no live
    # upload's (none lasts longer than --upload-timeout-s); the default is the timeout + 300 s.
    flags = ("--upload-timeout-s", "1", "--stale-upload-s", "1", "--probe-interval-s", "0.2")
    restarted = StoreProcess(tmp_path / "b", "s3", seaweed, bucket, flags)
    restarted.start()
    try:
        wait_for(lambda: restarted.pending_uploads() == [], 20, "the upload to be aborted")
        assert_no_version(restarted, adapter_id)
        assert restarted.object_keys() == []
        assert "an upload left unfinished by a store that stopped" in restarted.log()
        # A fresh upload is untouched by the sweeps that keep running.
        assert restarted.stub.UploadAdapter(upload_requests(adapter_id, SMALL)).version == 1
        assert restarted.stop() == 0, restarted.log()
    finally:
        if restarted.process is not None:
            restarted.process.kill()


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_concurrent_uploads_are_bounded_and_so_is_their_memory(
    tmp_path, backend, request, adapter_id
):
    flags = ("--max-concurrent-uploads", "2")
    if backend == "local":
        store = StoreProcess(tmp_path, "local", extra_args=flags)
    else:
        seaweed = request.getfixturevalue("seaweed")
        store = StoreProcess(tmp_path, "s3", seaweed, new_bucket(seaweed), flags)
    store.start()
    try:
        baseline = rss_bytes(store.process.pid)
        held = [GatedUpload(store, f"{adapter_id}-{i}") for i in range(2)]
        wait_for(lambda: len(store.pending_uploads()) == 2, 20, "two uploads in flight")
        # 20 more at once, each with 13 MiB to send: all refused at once, none buffered.
        codes: list[grpc.StatusCode] = []

        def attempt(i: int) -> None:
            try:
                store.stub.UploadAdapter(upload_requests(f"{adapter_id}-x{i}", big(), 1 << 20))
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as exc:
                codes.append(exc.code())
                assert "--max-concurrent-uploads" in exc.details()

        threads = [threading.Thread(target=attempt, args=(i,)) for i in range(20)]
        for thread in threads:
            thread.start()
        peak = baseline
        while any(t.is_alive() for t in threads):
            peak = max(peak, rss_bytes(store.process.pid))
            time.sleep(0.02)
        assert codes == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 20
        # Two uploads of 8 MiB parts, two in flight each, plus the chunk being received.
        assert peak - baseline < 120 * 2**20, (peak - baseline) / 2**20
        assert [upload.release() for upload in held] == [None, None]
        assert store.stub.UploadAdapter(upload_requests(adapter_id, SMALL)).version == 1
    finally:
        assert store.stop() == 0, store.log()


def test_an_upload_that_takes_too_long_fails_and_leaves_nothing(tmp_path, adapter_id):
    store = StoreProcess(tmp_path, "local", extra_args=("--upload-timeout-s", "1.5"))
    store.start()
    try:
        stalled = GatedUpload(store, adapter_id)
        time.sleep(2.5)
        error = stalled.release()
        assert error is not None and error.code() == grpc.StatusCode.DEADLINE_EXCEEDED, error
        assert "--upload-timeout-s" in error.details()
        assert_no_version(store, adapter_id)
        assert store.pending_uploads() == [] and local_leftovers(store.root) == []
    finally:
        assert store.stop() == 0, store.log()
