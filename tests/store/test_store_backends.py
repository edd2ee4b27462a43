"""The object-storage contract, run against both backends (local directory, SeaweedFS)."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import uuid

import pytest

from store.backends import ObjectNotFound, open_backend
from store.backends.local import LocalObjectStore
from store.config import MIB, BackendKind, StoreConfig
from store.errors import StorageError, StorageUnavailable
from tests.s3server import ACCESS_KEY, SECRET_KEY


def s3_config(seaweed, bucket: str | None = None, **extra) -> StoreConfig:
    return StoreConfig(
        backend=BackendKind.S3,
        s3_endpoint=seaweed.endpoint,
        s3_bucket=bucket or seaweed.bucket,
        aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY,
        **extra,
    )


@pytest.fixture(params=["local", "s3"])
async def backend(request, tmp_path):
    if request.param == "local":
        store = LocalObjectStore(tmp_path / "root")
    else:
        store = open_backend(s3_config(request.getfixturevalue("seaweed")))
    yield store
    await store.close()


@pytest.fixture
def prefix() -> str:
    return f"t{uuid.uuid4().hex[:12]}/"


async def read_range(backend, key, start, end, piece_bytes=100):
    """The range as the reads return it, each into a buffer of piece_bytes."""
    reader = await backend.open_range(key, start, end)
    pieces = []
    try:
        while n := await reader.readinto(memoryview(buffer := bytearray(piece_bytes))):
            pieces.append(bytes(buffer[:n]))
    finally:
        await reader.close()
    return pieces


async def keys(backend, prefix, start_after=""):
    return [k async for k in backend.list_keys(prefix, start_after)]


async def test_put_get_range_delete(backend, prefix):
    key = prefix + "a/b.bin"
    data = bytes(range(256)) * 10
    await backend.put(key, data)
    assert await backend.get(key) == data
    pieces = await read_range(backend, key, 5, 300)
    assert [len(p) for p in pieces] == [100, 100, 95]
    assert b"".join(pieces) == data[5:300]
    assert b"".join(await read_range(backend, key, 2500, 9999)) == data[2500:]  # short object
    await backend.put(key, b"new")  # replaces
    assert await backend.get(key) == b"new"
    await backend.delete(key)
    await backend.delete(key)  # idempotent
    with pytest.raises(ObjectNotFound):
        await backend.get(key)
    with pytest.raises(ObjectNotFound):
        await read_range(backend, key, 0, 1)


async def test_put_if_absent_is_create_only(backend, prefix):
    key = prefix + "manifest.json"
    assert await backend.put_if_absent(key, b"first")
    assert not await backend.put_if_absent(key, b"second")
    assert await backend.get(key) == b"first"
    results = await asyncio.gather(
        *(backend.put_if_absent(prefix + "race", b"%d" % i) for i in range(8))
    )
    assert sum(results) == 1


async def test_listing_is_sorted_and_resumable(backend, prefix):
    names = ["m/a/@v/2", "m/a/@v/1", "m/a-x/@v/1", "m/a/b/@v/1", "m/b/@v/1", "other/x"]
    for name in names:
        await backend.put(prefix + name, b"")
    listed = await keys(backend, prefix + "m/")
    assert sorted(listed) == sorted(prefix + n for n in names if n.startswith("m/"))
    # One adapter's version keys come together (store.layout relies on it).
    a_positions = [i for i, k in enumerate(listed) if k.startswith(prefix + "m/a/@v/")]
    assert a_positions == list(range(a_positions[0], a_positions[0] + 2))
    after = await keys(backend, prefix + "m/", start_after=prefix + "m/a/@v/~")
    assert prefix + "m/a/@v/1" not in after and prefix + "m/b/@v/1" in after
    assert await keys(backend, prefix + "m/a/@") == [prefix + "m/a/@v/1", prefix + "m/a/@v/2"]
    assert await keys(backend, prefix + "nothing/") == []


async def test_multipart_complete_and_abort(backend, prefix):
    part = bytes([7]) * (5 * MIB)
    writer = await backend.begin_multipart(prefix + "blob")
    assert prefix + "blob" in await backend.pending_uploads(prefix)
    # Parts may finish out of order.
    await asyncio.gather(writer.write_part(2, len(part), b"tail"), writer.write_part(1, 0, part))
    with pytest.raises(ObjectNotFound):
        await backend.get(prefix + "blob")  # invisible until complete
    await writer.complete()
    assert await backend.get(prefix + "blob") == part + b"tail"
    assert await backend.pending_uploads(prefix) == []

    aborted = await backend.begin_multipart(prefix + "gone")
    await aborted.write_part(1, 0, b"x" * 100)
    await aborted.abort()
    await aborted.abort()  # idempotent
    assert await backend.pending_uploads(prefix) == []
    with pytest.raises(ObjectNotFound):
        await backend.get(prefix + "gone")


async def test_probe(backend):
    await backend.probe()


async def test_local_keys_cannot_escape_the_root(tmp_path):
    store = LocalObjectStore(tmp_path)
    for key in ("../x", "/etc/passwd", "a//b", "a/./b"):
        with pytest.raises(ValueError, match="invalid object key"):
            await store.put(key, b"")


def test_a_sweep_does_not_count_a_file_that_a_live_upload_renamed_meanwhile(tmp_path, monkeypatch):
    """A live upload may complete (rename its .part into place) between the sweep's open of the
    file and its unlink: that file was not the sweep's to remove, nor to report swept."""
    from store.backends import local

    part, done = tmp_path / "x.part", tmp_path / "object"
    part.write_bytes(b"x")
    flock = local.fcntl.flock

    def completed_first(fd, operation):
        os.replace(part, done)  # the writer's complete(), which then drops its lock
        flock(fd, operation)

    monkeypatch.setattr(local.fcntl, "flock", completed_first)
    assert local._remove_unlocked(part) is False
    assert done.read_bytes() == b"x"


async def test_s3_missing_bucket_and_bad_credentials(seaweed):
    missing = open_backend(s3_config(seaweed, bucket="no-such-bucket"))
    with pytest.raises(StorageError, match="does not exist"):
        await missing.probe()
    await missing.close()
    config = s3_config(seaweed)
    bad = open_backend(
        StoreConfig(
            backend=BackendKind.S3,
            s3_endpoint=config.s3_endpoint,
            s3_bucket=config.s3_bucket,
            aws_access_key_id="nobody",
            aws_secret_access_key="wrong",
        )
    )
    with pytest.raises(StorageError):
        await bad.get("anything")
    await bad.close()


async def test_s3_unreachable_is_unavailable_quickly():
    from tests.s3server import free_ports

    (port,) = free_ports(1)
    config = StoreConfig(
        backend=BackendKind.S3,
        s3_endpoint=f"http://127.0.0.1:{port}",
        s3_bucket="b",
        aws_access_key_id="k",
        aws_secret_access_key="s",
    )
    store = open_backend(config)
    loop = asyncio.get_running_loop()
    start = loop.time()
    with pytest.raises(StorageUnavailable, match="unreachable"):
        await store.get("x")
    assert loop.time() - start < 5.0
    await store.close()


async def test_s3_range_reads_straight_from_the_socket_or_through_botocore(
    seaweed, prefix, monkeypatch
):
    from store.backends import s3

    store = open_backend(s3_config(seaweed))
    key = prefix + "big.bin"
    data = os.urandom(3 * MIB + 5)
    await store.put(key, data)
    reader = await store.open_range(key, 0, len(data))
    # The installed botocore and urllib3 offer http.client's readinto: no copy per read.
    assert reader._socket is not None
    await reader.close()
    assert b"".join(await read_range(store, key, 0, len(data), MIB)) == data
    monkeypatch.setattr(s3, "_socket_response", lambda body: None)  # another botocore
    assert b"".join(await read_range(store, key, 7, len(data), MIB)) == data[7:]
    await store.close()


class BrokenHttp:
    """An S3 endpoint whose every answer promises 1000 bytes, sends 500, then closes the
    connection (or, with ``stall``, keeps it open and sends nothing more)."""

    def __init__(self, stall: bool) -> None:
        self.stall = stall
        self.release = threading.Event()
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                request = b""
                while b"\r\n\r\n" not in request:
                    request += conn.recv(65536)
                head = b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\nContent-Type: binary\r\n\r\n"
                conn.sendall(head + b"x" * 500)
                if self.stall:
                    self.release.wait(30)

    def close(self) -> None:
        self.release.set()
        self.sock.close()


def broken_store(server: BrokenHttp):
    config = StoreConfig(
        backend=BackendKind.S3,
        s3_endpoint=server.endpoint,
        s3_bucket="b",
        aws_access_key_id="k",
        aws_secret_access_key="s",
        read_timeout_s=20.0,
    )
    return open_backend(config)


async def test_s3_connection_that_ends_mid_body_is_unavailable():
    server = BrokenHttp(stall=False)
    store = broken_store(server)
    reader = await store.open_range("x", 0, 1000)
    view = memoryview(bytearray(1000))
    assert await reader.readinto(view) == 500  # the read ends where the bytes stop
    with pytest.raises(StorageUnavailable, match="500 bytes before the end"):
        await reader.readinto(view[500:])
    await reader.close()
    await store.close()
    server.close()


async def test_s3_reader_closed_mid_read_stops_the_read_at_once():
    server = BrokenHttp(stall=True)
    store = broken_store(server)
    reader = await store.open_range("x", 0, 1000)
    buffer = bytearray(1000)
    read = asyncio.create_task(reader.readinto(memoryview(buffer)))
    await asyncio.sleep(0.3)  # the read has 500 bytes and waits for the rest
    read.cancel()
    loop = asyncio.get_running_loop()
    start = loop.time()
    await reader.close()  # waits for the read thread, which the socket shutdown ends
    assert loop.time() - start < 5.0  # not the 20 s read timeout
    assert read.cancelled()
    await store.close()
    server.close()


def test_the_weed_binary_can_be_named_by_the_environment(tmp_path, monkeypatch):
    import subprocess

    from tests.s3server import WEED_BIN_ENV, weed_binary

    monkeypatch.delenv(WEED_BIN_ENV, raising=False)
    named = tmp_path / "my-weed"
    named.symlink_to(weed_binary())
    monkeypatch.setenv(WEED_BIN_ENV, str(named))
    assert weed_binary() == str(named)
    version = subprocess.run([weed_binary(), "version"], capture_output=True, text=True)
    assert "version" in version.stdout
    plain = tmp_path / "not-executable"
    plain.write_text("")
    monkeypatch.setenv(WEED_BIN_ENV, str(plain))
    with pytest.raises(RuntimeError, match=f"{WEED_BIN_ENV}=.*not an executable"):
        weed_binary()
