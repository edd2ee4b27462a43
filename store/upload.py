"""One adapter upload: checks the bytes as they arrive (upload_check.py) and streams them into a
multipart upload.

Memory stays bounded by ``parts_in_flight + 1`` parts whatever the adapter's size. The object
is invisible until complete(); any failure calls abort(), which removes every trace of it.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import uuid
from dataclasses import dataclass
from enum import Enum

from store.backends.base import MultipartWriter, ObjectStore
from store.base_model import BaseModelShape
from store.config import MAX_UPLOAD_CHUNK_BYTES
from store.errors import ChecksumMismatch, InvalidRequest
from store.layout import blob_key, check_adapter_id
from store.peft import LoraAdapterConfig, SafetensorsHeader
from store.upload_check import UploadCheck

log = logging.getLogger(__name__)
_SHA256 = re.compile(r"[0-9a-f]{64}")
MAX_DESCRIPTION_CHARS = 4096


@dataclass(frozen=True)
class UploadHeader:
    adapter_id: str
    adapter_config_json: str
    sha256: str = ""  # lowercase hex; "" = not checked
    description: str = ""
    size_bytes: int = 0  # 0 = not announced

    def __post_init__(self) -> None:
        check_adapter_id(self.adapter_id)
        if self.sha256 and not _SHA256.fullmatch(self.sha256):
            raise InvalidRequest(f"sha256 {self.sha256!r} is not 64 lowercase hex digits")
        if len(self.description) > MAX_DESCRIPTION_CHARS:
            raise InvalidRequest(f"description is longer than {MAX_DESCRIPTION_CHARS} characters")
        if self.size_bytes < 0:
            raise InvalidRequest("size_bytes must not be negative")


@dataclass(frozen=True)
class UploadLimits:
    max_adapter_bytes: int
    part_bytes: int
    parts_in_flight: int
    base: BaseModelShape | None


class UploadStatus(Enum):
    RECEIVING = "receiving"
    COMPLETE = "complete"
    ABORTED = "aborted"


@dataclass(frozen=True)
class StoredBlob:
    key: str
    size_bytes: int
    sha256: str
    header: SafetensorsHeader


class UploadSession:
    def __init__(
        self,
        backend: ObjectStore,
        header: UploadHeader,
        config: LoraAdapterConfig,
        limits: UploadLimits,
        room: tuple[int, str] | None = None,
    ) -> None:
        """``room``: the bytes a tenant's storage quota leaves, and what that quota is (the
        adapter may be no larger; UploadCheck says so)."""
        self.header = header
        self.status = UploadStatus.RECEIVING
        self.key = blob_key(header.adapter_id, uuid.uuid4().hex)
        self._backend = backend
        self._limits = limits
        max_bytes, quota = limits.max_adapter_bytes, ""
        if room is not None and room[0] < max_bytes:
            max_bytes, quota = room
        self._check = UploadCheck(config, max_bytes, limits.base, header.size_bytes, quota)
        self._hash = hashlib.sha256()
        self._buffer = bytearray()
        self._flushed = 0  # bytes handed to part uploads
        self._writer: MultipartWriter | None = None
        self._parts: list[asyncio.Task[None]] = []

    async def write(self, chunk: bytes) -> None:
        if self.status is not UploadStatus.RECEIVING:
            raise InvalidRequest(f"upload is {self.status.value}")
        if len(chunk) > MAX_UPLOAD_CHUNK_BYTES:
            raise InvalidRequest(
                f"chunk of {len(chunk)} bytes is larger than {MAX_UPLOAD_CHUNK_BYTES} bytes"
            )
        # Checking and hashing cost time proportional to the chunk: on a thread, off the event
        # loop (numpy and hashlib release the GIL on large inputs).
        await asyncio.to_thread(self._take, chunk)
        self._buffer += chunk
        while len(self._buffer) >= self._limits.part_bytes:
            await self._flush(self._limits.part_bytes)

    def _take(self, chunk: bytes) -> None:
        self._check.feed(chunk)
        self._hash.update(chunk)

    async def _flush(self, size: int) -> None:
        part = bytes(self._buffer[:size])
        del self._buffer[:size]
        if self._writer is None:
            self._writer = await self._backend.begin_multipart(self.key)
        # Bound the parts in flight: wait for the oldest before starting another.
        while len(self._parts) >= self._limits.parts_in_flight:
            await self._parts.pop(0)
        number = self._flushed // self._limits.part_bytes + 1
        task = asyncio.ensure_future(self._writer.write_part(number, self._flushed, part))
        self._parts.append(task)
        self._flushed += len(part)

    async def finish(self) -> StoredBlob:
        """Check that the file is whole and as announced, then make the object visible."""
        header = self._check.finish()
        digest = self._hash.hexdigest()
        if self.header.sha256 and digest != self.header.sha256:
            raise ChecksumMismatch(
                f"sha256 of the bytes received is {digest}, not {self.header.sha256}"
            )
        if self._buffer or self._writer is None:
            await self._flush(len(self._buffer))
        for task in self._parts:
            await task
        self._parts.clear()
        await self._writer.complete()
        self.status = UploadStatus.COMPLETE
        return StoredBlob(self.key, self._check.received, digest, header)

    async def abort(self) -> None:
        """Drop the multipart upload; idempotent. Parts in flight run on storage threads that
        cannot be interrupted, so they are waited for (bounded by the storage timeouts):
        aborting while one is still being written could leave that part behind."""
        self.status = UploadStatus.ABORTED
        await asyncio.gather(*self._parts, return_exceptions=True)
        self._parts.clear()
        self._buffer = bytearray()
        if self._writer is not None:
            await self._writer.abort()
