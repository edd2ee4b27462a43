"""The object-storage interface the adapter store is written against.

Keys are '/'-separated strings made by store.layout. Every method is a coroutine; backends with
blocking clients run them on worker threads so a slow call never blocks the event loop.
Failures are store.errors.StorageUnavailable (retry may help) or StorageError (it will not);
a missing object is ObjectNotFound.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from concurrent.futures import Future


class ObjectNotFound(KeyError):
    """No object under this key."""


class MultipartWriter(ABC):
    """One object written in parts; invisible until complete(), gone without trace on abort().

    Parts are numbered from 1 and may be written concurrently; ``offset`` is the part's byte
    offset in the object. Every part but the last has at least 5 MiB.
    """

    key: str

    @abstractmethod
    async def write_part(self, number: int, offset: int, data: bytes) -> None: ...

    @abstractmethod
    async def complete(self) -> None: ...

    @abstractmethod
    async def abort(self) -> None:
        """Idempotent; safe to call after a failed write or complete."""


class RangeReader(ABC):
    """One byte range of an object, streamed in order into buffers the caller owns.

    readinto() fills the whole view unless the range (or the object, if shorter) ends first;
    0 means it has ended. Reading into the caller's buffer, rather than returning a new bytes
    object per read, is what keeps the fetch path at one copy of the bytes in user space.
    """

    @abstractmethod
    async def readinto(self, view: memoryview) -> int: ...

    @abstractmethod
    async def close(self) -> None:
        """Release the connection or file; idempotent."""


async def outlast(read: Future) -> None:
    """Wait until a blocking read on a worker thread returns, however it ends: a reader closed
    mid-read must not close its socket or file, or reuse its buffer, under that thread."""
    done = asyncio.wrap_future(read)
    await asyncio.wait([done])
    if not done.cancelled():
        done.exception()  # retrieved, so that asyncio does not log it: nobody wants it now


class ObjectStore(ABC):
    @abstractmethod
    async def put(self, key: str, data: bytes) -> None:
        """Write the whole object atomically, replacing any object under the key."""

    @abstractmethod
    async def put_if_absent(self, key: str, data: bytes) -> bool:
        """Write the object only if no object has the key; False when one already has it."""

    @abstractmethod
    async def get(self, key: str) -> bytes: ...

    @abstractmethod
    async def open_range(self, key: str, start: int, end: int) -> RangeReader:
        """Bytes [start, end) of the object, as one streaming read (one ranged GET on S3).
        Reads end early where the object is shorter than ``end``; ObjectNotFound if it is
        missing."""

    @abstractmethod
    async def delete(self, key: str) -> None:
        """Remove the object; no error if it does not exist."""

    @abstractmethod
    def list_keys(self, prefix: str, start_after: str = "") -> AsyncIterator[str]:
        """Keys that start with ``prefix`` and come after ``start_after``, in the backend's
        listing order (byte order for AWS S3 and the local backend; SeaweedFS walks its
        directory tree, comparing one path segment at a time). ``start_after`` follows the
        same order, so paging through a listing is stable on every backend."""

    @abstractmethod
    async def total_bytes(self, prefix: str) -> int:
        """The sizes of the objects whose keys start with ``prefix``, summed (one listing)."""

    @abstractmethod
    async def begin_multipart(self, key: str) -> MultipartWriter: ...

    @abstractmethod
    async def pending_uploads(self, prefix: str = "") -> list[str]:
        """Keys of multipart uploads begun but neither completed nor aborted."""

    @abstractmethod
    async def abort_stale_uploads(self, prefix: str, older_than_s: float) -> list[str]:
        """Abort the multipart uploads under ``prefix`` that no live writer owns (left by a
        process that died mid-upload) and return their keys. A backend that can tell which
        uploads are live does so; otherwise those begun more than ``older_than_s`` ago (by the
        storage's clock) count as left over."""

    @abstractmethod
    async def probe(self) -> None:
        """Return when the storage answers; raise StorageUnavailable or StorageError."""

    @abstractmethod
    async def close(self) -> None:
        """Release connections and threads."""
