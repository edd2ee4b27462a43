"""A local directory as object storage: the embedded default backend.

    <root>/objects/<key>        objects
    <root>/.tmp/<uuid>          whole-object writes in progress
    <root>/.uploads/<uuid>.part multipart uploads in progress, with <uuid>.key naming the key

Every write goes to a temporary file first and is renamed into place, so a reader sees the old
object or the new one, never part of one. File work runs on worker threads.
"""

from __future__ import annotations

import asyncio
import errno
import os
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from store.backends.base import MultipartWriter, ObjectNotFound, ObjectStore, RangeReader, outlast
from store.errors import StorageError, StorageUnavailable


def _storage_error(path: Path, exc: OSError) -> Exception:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM):
        return StorageError(f"local storage at {path}: {exc.strerror}")
    return StorageUnavailable(f"local storage at {path}: {exc}")


class LocalObjectStore(ObjectStore):
    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self._objects = self.root / "objects"
        self._tmp = self.root / ".tmp"
        self._uploads = self.root / ".uploads"
        for directory in (self._objects, self._tmp, self._uploads):
            directory.mkdir(parents=True, exist_ok=True)
        # Range reads run here rather than through asyncio.to_thread so that a reader closed
        # mid-read can wait for its thread (see _LocalRange.close).
        self._readers = ThreadPoolExecutor(8, thread_name_prefix="local-read")

    def _path(self, key: str) -> Path:
        parts = key.split("/")
        # Keys come from store.layout; this guard keeps any other key inside the root.
        if key.startswith("/") or any(p in ("", ".", "..") for p in parts):
            raise ValueError(f"invalid object key {key!r}")
        return self._objects.joinpath(*parts)

    async def _run(self, fn, *args):
        try:
            return await asyncio.to_thread(fn, *args)
        except FileNotFoundError as exc:
            raise ObjectNotFound(exc.filename) from exc
        except OSError as exc:
            raise _storage_error(self.root, exc) from exc

    def _write_tmp(self, data: bytes) -> Path:
        tmp = self._tmp / uuid.uuid4().hex
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return tmp

    def _put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        tmp = self._write_tmp(data)
        path.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, path)

    def _put_if_absent(self, key: str, data: bytes) -> bool:
        path = self._path(key)
        tmp = self._write_tmp(data)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            os.link(tmp, path)  # fails if the key exists: an atomic create-if-absent
            return True
        except FileExistsError:
            return False
        finally:
            tmp.unlink()

    def _delete(self, key: str) -> None:
        path = self._path(key)
        path.unlink(missing_ok=True)
        # Drop directories left empty, so that listings stay cheap.
        parent = path.parent
        while parent != self._objects:
            try:
                parent.rmdir()
            except OSError:
                break
            parent = parent.parent

    def _list(self, prefix: str, start_after: str) -> list[str]:
        base = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        top = self._objects.joinpath(*base.split("/")) if base else self._objects
        keys = []
        for directory, _, files in os.walk(top):
            rel = Path(directory).relative_to(self._objects).as_posix()
            for name in files:
                key = name if rel == "." else f"{rel}/{name}"
                if key.startswith(prefix) and key > start_after:
                    keys.append(key)
        return sorted(keys)

    async def put(self, key: str, data: bytes) -> None:
        await self._run(self._put, key, data)

    async def put_if_absent(self, key: str, data: bytes) -> bool:
        return await self._run(self._put_if_absent, key, data)

    async def get(self, key: str) -> bytes:
        return await self._run(self._path(key).read_bytes)

    async def open_range(self, key: str, start: int, end: int) -> RangeReader:
        fd = await self._run(os.open, self._path(key), os.O_RDONLY)
        return _LocalRange(self, fd, start, end)

    async def delete(self, key: str) -> None:
        await self._run(self._delete, key)

    async def list_keys(self, prefix: str, start_after: str = "") -> AsyncIterator[str]:
        for key in await self._run(self._list, prefix, start_after):
            yield key

    async def begin_multipart(self, key: str) -> MultipartWriter:
        self._path(key)
        return await self._run(_LocalMultipart.begin, self, key)

    async def pending_uploads(self, prefix: str = "") -> list[str]:
        def scan() -> list[str]:
            keys = [p.read_text() for p in self._uploads.glob("*.key")]
            return sorted(k for k in keys if k.startswith(prefix))

        return await self._run(scan)

    async def probe(self) -> None:
        await self._run(os.statvfs, self._objects)

    async def close(self) -> None:
        """Every call opens and closes its own files; only the read threads remain."""
        self._readers.shutdown(wait=False)


class _LocalRange(RangeReader):
    def __init__(self, store: LocalObjectStore, fd: int, start: int, end: int) -> None:
        self._store = store
        self._fd: int | None = fd
        self._position = start
        self._end = end
        self._reading: Future | None = None

    def _fill(self, view: memoryview) -> int:
        filled = 0
        while filled < len(view):
            n = os.preadv(self._fd, [view[filled:]], self._position + filled)
            if n == 0:
                break  # the file ends before the range does
            filled += n
        return filled

    async def readinto(self, view: memoryview) -> int:
        if self._fd is None:
            raise ValueError("read from a closed range")
        want = min(len(view), self._end - self._position)
        if want <= 0:
            return 0
        self._reading = self._store._readers.submit(self._fill, view[:want])
        try:
            n = await asyncio.wrap_future(self._reading)
        except OSError as exc:
            raise _storage_error(self._store.root, exc) from exc
        self._position += n
        if n < want:
            self._end = self._position  # nothing follows a short read
        return n

    async def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        if self._reading is not None and not self._reading.done():
            # Cancelled mid-read: close the file once the thread is done with it.
            await outlast(self._reading)
        os.close(fd)


class _LocalMultipart(MultipartWriter):
    def __init__(self, store: LocalObjectStore, key: str, name: str) -> None:
        self.key = key
        self._store = store
        self._part = store._uploads / f"{name}.part"
        self._marker = store._uploads / f"{name}.key"

    @classmethod
    def begin(cls, store: LocalObjectStore, key: str) -> _LocalMultipart:
        writer = cls(store, key, uuid.uuid4().hex)
        writer._part.touch()
        writer._marker.write_text(key)
        return writer

    def _pwrite(self, offset: int, data: bytes) -> None:
        fd = os.open(self._part, os.O_WRONLY)
        try:
            os.pwrite(fd, data, offset)
        finally:
            os.close(fd)

    def _complete(self) -> None:
        path = self._store._path(self.key)
        with open(self._part, "rb+") as f:
            os.fsync(f.fileno())
        path.parent.mkdir(parents=True, exist_ok=True)
        os.replace(self._part, path)
        self._marker.unlink()

    def _abort(self) -> None:
        self._part.unlink(missing_ok=True)
        self._marker.unlink(missing_ok=True)

    async def write_part(self, number: int, offset: int, data: bytes) -> None:
        await self._store._run(self._pwrite, offset, data)

    async def complete(self) -> None:
        await self._store._run(self._complete)

    async def abort(self) -> None:
        await self._store._run(self._abort)
