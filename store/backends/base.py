"""The object-storage interface the adapter store is written against.

Keys are '/'-separated strings made by store.layout. Every method is a coroutine; backends with
blocking clients run them on worker threads so a slow call never blocks the event loop.
Failures are store.errors.StorageUnavailable (retry may help) or StorageError (it will not);
a missing object is ObjectNotFound.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator


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
    def stream_range(
        self, key: str, start: int, end: int, piece_bytes: int
    ) -> AsyncIterator[bytes]:
        """Bytes [start, end) of the object as they arrive, in pieces of at most
        ``piece_bytes`` (the last may be short if the object is shorter than ``end``)."""

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
    async def begin_multipart(self, key: str) -> MultipartWriter: ...

    @abstractmethod
    async def pending_uploads(self, prefix: str = "") -> list[str]:
        """Keys of multipart uploads begun but neither completed nor aborted."""

    @abstractmethod
    async def probe(self) -> None:
        """Return when the storage answers; raise StorageUnavailable or StorageError."""

    @abstractmethod
    async def close(self) -> None:
        """Release connections and threads."""
