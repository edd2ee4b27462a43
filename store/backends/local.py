"""A local directory as object storage: the embedded default backend.

    <root>/objects/<key>        objects
    <root>/.tmp/<uuid>          whole-object writes in progress
    <root>/.uploads/<uuid>.part multipart uploads in progress, with <uuid>.key naming the key

Every write goes to a temporary file first and is renamed into place, so a reader sees the old
object or the new one, never part of one. File work runs on worker threads.

Crash consistency: while a temporary or .part file exists its writer holds an exclusive flock on
it (the kernel drops the locks of a process that dies, kill -9 included), so a file that can be
locked by someone else belongs to no live writer. abort_stale_uploads (run by the store at
start-up and then now and again) removes those, also while other store processes use the same
directory.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
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

    def _write_tmp(self, data: bytes) -> tuple[Path, int]:
        """A temporary file holding ``data``, and its locked descriptor: close it only once the
        file is renamed or removed."""
        tmp = self._tmp / uuid.uuid4().hex
        fd = _create_locked(tmp)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        except BaseException:
            tmp.unlink(missing_ok=True)
            os.close(fd)
            raise
        return tmp, fd

    def _put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        tmp, fd = self._write_tmp(data)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)  # gone already unless the rename failed
            os.close(fd)

    def _put_if_absent(self, key: str, data: bytes) -> bool:
        path = self._path(key)
        tmp, fd = self._write_tmp(data)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            os.link(tmp, path)  # fails if the key exists: an atomic create-if-absent
            return True
        except FileExistsError:
            return False
        finally:
            tmp.unlink()
            os.close(fd)

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

    async def total_bytes(self, prefix: str) -> int:
        def total() -> int:
            size = 0
            for key in self._list(prefix, ""):
                try:
                    size += self._path(key).stat().st_size
                except FileNotFoundError:  # deleted since it was listed
                    continue
            return size

        return await self._run(total)

    async def begin_multipart(self, key: str) -> MultipartWriter:
        self._path(key)
        return await self._run(_LocalMultipart.begin, self, key)

    async def pending_uploads(self, prefix: str = "") -> list[str]:
        def scan() -> list[str]:
            keys = []
            for marker in self._uploads.glob("*.key"):
                try:
                    keys.append(marker.read_text())
                except FileNotFoundError:  # completed or aborted meanwhile
                    continue
            return sorted(k for k in keys if k.startswith(prefix))

        return await self._run(scan)

    async def abort_stale_uploads(self, prefix: str, older_than_s: float) -> list[str]:
        """Exact here (the locks say which files are live), so ``older_than_s`` is not needed.
        Also removes temporary files left by a dead writer."""
        return await self._run(self._sweep, prefix)

    def _sweep(self, prefix: str) -> list[str]:
        swept = []
        for part in self._uploads.glob("*.part"):
            marker = part.with_suffix(".key")
            try:
                key = marker.read_text()
            except FileNotFoundError:
                key = None  # the writer died before it wrote its marker
            if key is not None and not key.startswith(prefix):
                continue
            if _remove_unlocked(part):
                marker.unlink(missing_ok=True)
                swept.append(key or part.name)
        for marker in self._uploads.glob("*.key"):
            # A marker whose .part is gone: its upload completed or aborted and the writer
            # died before removing the marker (a live one removes it a moment later anyway).
            if not marker.with_suffix(".part").exists():
                marker.unlink(missing_ok=True)
        for tmp in self._tmp.iterdir():
            _remove_unlocked(tmp)
        return sorted(swept)

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


def _create_locked(path: Path) -> int:
    """A new file at ``path``, open for reading and writing and locked (flock, exclusive)
    through the returned descriptor for as long as it stays open."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
        if os.fstat(fd).st_nlink:
            return fd
        os.close(fd)  # a sweep removed it between its creation and the lock: make it again


def _remove_unlocked(path: Path) -> bool:
    """Remove ``path`` if no one holds its lock (its writer is gone); whether it did."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return False  # a live writer holds it
    try:
        path.unlink()
        return True
    except FileNotFoundError:
        return False  # gone meanwhile: a live upload completed (renamed it) or aborted
    finally:
        os.close(fd)


class _LocalMultipart(MultipartWriter):
    def __init__(self, store: LocalObjectStore, key: str, name: str) -> None:
        self.key = key
        self._store = store
        self._part = store._uploads / f"{name}.part"
        self._marker = store._uploads / f"{name}.key"
        self._fd: int | None = None  # open, and locked, from begin to complete or abort

    @classmethod
    def begin(cls, store: LocalObjectStore, key: str) -> _LocalMultipart:
        writer = cls(store, key, uuid.uuid4().hex)
        writer._fd = _create_locked(writer._part)
        writer._marker.write_text(key)
        return writer

    def _pwrite(self, offset: int, data: bytes) -> None:
        if self._fd is None:
            raise ValueError(f"upload of {self.key} has ended")
        view = memoryview(data)
        while view:
            written = os.pwrite(self._fd, view, offset)
            view, offset = view[written:], offset + written

    def _complete(self) -> None:
        path = self._store._path(self.key)
        os.fsync(self._fd)
        path.parent.mkdir(parents=True, exist_ok=True)
        os.replace(self._part, path)
        self._marker.unlink(missing_ok=True)
        self._close()

    def _abort(self) -> None:
        self._part.unlink(missing_ok=True)
        self._marker.unlink(missing_ok=True)
        self._close()

    def _close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    async def write_part(self, number: int, offset: int, data: bytes) -> None:
        await self._store._run(self._pwrite, offset, data)

    async def complete(self) -> None:
        await self._store._run(self._complete)

    async def abort(self) -> None:
        await self._store._run(self._abort)
