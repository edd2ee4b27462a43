"""AdapterStore: the store's operations (upload, get, fetch, list, delete, watch) over one
backend. The gRPC servicer is a thin translation of these into protobuf."""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
import time
from collections import Counter
from collections.abc import AsyncIterable, AsyncIterator
from typing import NamedTuple

from store.backends.base import ObjectNotFound, ObjectStore
from store.catalog import Catalog
from store.config import StoreConfig
from store.errors import (
    AdapterNotFound,
    DataCorruption,
    InvalidRequest,
    ShuttingDown,
    TenantStorageFull,
    TooManyUploads,
    UploadTimedOut,
)
from store.events import AdapterEvent, EventBus, EventKind
from store.fetch import FetchPlan, stream_blob
from store.layout import BLOBS, check_adapter_id, check_prefix, check_version
from store.manifest import AdapterRecord
from store.peft import parse_adapter_config
from store.rescan import Rescan
from store.upload import UploadHeader, UploadLimits, UploadSession

log = logging.getLogger(__name__)
DEFAULT_PAGE_SIZE = 100
MAX_PAGE_SIZE = 1000


class ListPage(NamedTuple):
    records: list[AdapterRecord]
    next_page_token: str  # "" on the last page


class AdapterStore:
    def __init__(self, backend: ObjectStore, config: StoreConfig) -> None:
        self.backend = backend
        self.config = config
        self.catalog = Catalog(backend)
        self.events = EventBus()
        self.rescan = Rescan(self.catalog, self.events)  # other store processes' changes
        self._limits = UploadLimits(
            max_adapter_bytes=config.max_adapter_bytes,
            part_bytes=config.part_bytes,
            parts_in_flight=config.upload_parts_in_flight,
            base=config.base_shape,
        )
        self._fetch_plan = FetchPlan(
            config.fetch_range_bytes,
            config.fetch_parallelism,
            config.fetch_chunk_bytes,
            config.fetch_queue_chunks,
        )
        self._uploads: set[asyncio.Task] = set()
        self._tenant_uploads: Counter[str] = Counter()  # in flight, by tenant
        self._cleanups: set[asyncio.Task] = set()
        # Clean-up that failed (storage down): retried by retry_cleanup().
        self._leftover_sessions: list[UploadSession] = []
        self._leftover_blobs: list[str] = []
        self.closing = False

    # -- upload --------------------------------------------------------------------------

    async def upload(
        self, header: UploadHeader, chunks: AsyncIterable[bytes], tenant: str | None = None
    ) -> AdapterRecord:
        """Store a new version from the bytes of adapter_model.safetensors. On any failure,
        cancellation included, nothing of the upload remains visible or stored. ``tenant``:
        the uploading tenant, whose uploads in flight --tenant-max-concurrent-uploads bounds
        and whose stored bytes --tenant-max-bytes does (if set)."""
        if self.closing:
            raise ShuttingDown("the store is shutting down")
        if len(self._uploads) >= self.config.max_concurrent_uploads:
            raise TooManyUploads(
                f"{len(self._uploads)} uploads are in flight, as many as this store takes at "
                "once (--max-concurrent-uploads); retry later"
            )
        if tenant is not None and self._tenant_uploads[tenant] >= self.config.tenant_upload_slots:
            raise TooManyUploads(
                f"tenant {tenant!r} has {self._tenant_uploads[tenant]} uploads in flight, its "
                f"limit (--tenant-max-concurrent-uploads {self.config.tenant_upload_slots}); "
                "retry when one has finished"
            )
        task = asyncio.current_task()
        self._uploads.add(task)  # before any await: the limit holds however many arrive at once
        if tenant is not None:
            self._tenant_uploads[tenant] += 1
        quota = self.config.tenant_max_bytes if tenant is not None else None
        try:
            room = None
            if quota is not None:  # before a byte is read: a full tenant is refused at once
                stored = await self.tenant_bytes(tenant)
                room = quota - stored, self._quota_note(tenant, quota, stored)
                if room[0] <= 0:
                    raise TenantStorageFull(f"no room for another adapter: {room[1]}")
            # Regexes and all: parsing costs up to tens of milliseconds, off the event loop.
            config = await asyncio.to_thread(
                parse_adapter_config, header.adapter_config_json, self.config.max_rank
            )
            session = UploadSession(self.backend, header, config, self._limits, room)
            timer = asyncio.timeout(self.config.upload_timeout_s)
            try:
                async with timer:
                    async for chunk in self._until_idle(chunks):
                        await session.write(chunk)
                    blob = await session.finish()
            except BaseException:
                await self._cleanup(self._abort_session(session))
                if timer.expired():
                    raise UploadTimedOut(
                        f"the upload took longer than {self.config.upload_timeout_s:g} s "
                        "(--upload-timeout-s)"
                    ) from None
                raise
        finally:
            self._uploads.discard(task)
            if tenant is not None:
                self._tenant_uploads[tenant] -= 1
                if not self._tenant_uploads[tenant]:
                    del self._tenant_uploads[tenant]
        first = blob.header.tensors[0]
        record = AdapterRecord(
            adapter_id=header.adapter_id,
            version=0,  # assigned by commit
            rank=max(t.shape[0] for t in blob.header.tensors if t.kind == "A"),
            lora_alpha=config.lora_alpha,
            target_modules=config.target_modules,
            size_bytes=blob.size_bytes,
            sha256=blob.sha256,
            adapter_config_json=header.adapter_config_json,
            description=header.description,
            created_at=time.time(),
            dtype=first.dtype,
            num_layers=max(blob.header.layers) + 1,
            blob_key=blob.key,
        )
        try:
            if quota is not None:  # uploads of the tenant that ran beside this one count too
                stored = await self.tenant_bytes(tenant)  # this blob's bytes included
                if stored > quota:
                    raise TenantStorageFull(
                        f"adapter_model.safetensors is {blob.size_bytes} bytes, and with the "
                        f"tenant's other uploads it passes its quota: "
                        f"{self._quota_note(tenant, quota, stored - blob.size_bytes)}"
                    )
            record = await self.catalog.commit(record)
        except BaseException:
            await self._cleanup(self._delete_blob(blob.key))
            raise
        log.info("stored %s v%d (%d bytes)", record.adapter_id, record.version, blob.size_bytes)
        self._publish(AdapterEvent(EventKind.CREATED, record))
        return record

    @property
    def uploads(self) -> int:
        """Uploads in flight."""
        return len(self._uploads)

    async def _until_idle(self, chunks: AsyncIterable[bytes]) -> AsyncIterator[bytes]:
        """``chunks``, failing UploadTimedOut once none has come for upload_idle_timeout_s."""
        idle = self.config.upload_idle_timeout_s
        source = aiter(chunks)
        while True:
            timer = asyncio.timeout(idle)
            try:
                async with timer:
                    chunk = await anext(source)
            except StopAsyncIteration:
                return
            except TimeoutError:
                if not timer.expired():
                    raise  # the source's own
                raise UploadTimedOut(
                    f"no bytes of the upload came for {idle:g} s (--upload-idle-timeout-s)"
                ) from None
            yield chunk

    async def tenant_bytes(self, tenant: str) -> int:
        """The bytes of every stored version of the adapters under ``tenant``'s name (their
        blobs, from one listing; a blob whose upload has not committed yet included)."""
        return await self.backend.total_bytes(f"{BLOBS}{tenant}/")

    def _quota_note(self, tenant: str, quota: int, stored: int) -> str:
        return (
            f"tenant {tenant!r} stores {stored} of the {quota} bytes of adapters it may keep "
            "(--tenant-max-bytes); delete versions it no longer needs"
        )

    async def _cleanup(self, coro) -> None:
        """Run clean-up to its end even if the caller is cancelled meanwhile; close() waits
        for any still running."""
        task = asyncio.ensure_future(coro)
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)
        await asyncio.shield(task)

    async def _abort_session(self, session: UploadSession) -> None:
        try:
            await session.abort()
        except Exception:
            log.warning("could not abort upload %s yet; will retry", session.key, exc_info=True)
            self._leftover_sessions.append(session)

    async def _delete_blob(self, key: str) -> None:
        try:
            await self.backend.delete(key)
        except Exception:
            log.warning("could not delete %s yet; will retry", key, exc_info=True)
            self._leftover_blobs.append(key)

    async def sweep_uploads(self) -> list[str]:
        """Abort the unfinished multipart uploads of this store's blobs that no live upload
        owns, left by a store process that was killed (kill -9, a crash) mid-upload. The
        local backend knows them exactly (a live upload holds a lock on its file); on S3 they
        are those begun more than --stale-upload-s ago, since no store keeps an upload longer
        than --upload-timeout-s. Returns their keys."""
        keys = await self.backend.abort_stale_uploads(BLOBS, self.config.stale_upload_after_s)
        for key in keys:
            log.warning("aborted %s, an upload left unfinished by a store that stopped", key)
        return keys

    async def retry_cleanup(self) -> None:
        """Retry aborts and deletes that failed while storage was down."""
        sessions, self._leftover_sessions = self._leftover_sessions, []
        blobs, self._leftover_blobs = self._leftover_blobs, []
        for session in sessions:
            await self._abort_session(session)
        for key in blobs:
            await self._delete_blob(key)

    @property
    def leftovers(self) -> int:
        return len(self._leftover_sessions) + len(self._leftover_blobs)

    # -- read ----------------------------------------------------------------------------

    async def get(self, adapter_id: str, version: int = 0) -> AdapterRecord:
        return await self.catalog.read(check_adapter_id(adapter_id), check_version(version))

    async def fetch(self, record: AdapterRecord) -> AsyncIterator[bytes]:
        """The record's adapter_model.safetensors, chunk by chunk (see fetch.stream_blob)."""
        try:
            async for chunk in stream_blob(self.backend, record, self._fetch_plan):
                yield chunk
        except ObjectNotFound:
            # Deleted while we read it, or lost: tell the two apart by the manifest.
            await self.get(record.adapter_id, record.version)
            raise DataCorruption(
                f"{record.adapter_id} v{record.version}: its stored object is missing"
            ) from None

    async def list(self, prefix: str = "", page_size: int = 0, page_token: str = "") -> ListPage:
        check_prefix(prefix)
        if page_size > MAX_PAGE_SIZE:
            raise InvalidRequest(f"page_size {page_size} is above the maximum {MAX_PAGE_SIZE}")
        after = _decode_token(page_token, prefix) if page_token else None
        page = await self.catalog.latest_records(prefix, after, page_size or DEFAULT_PAGE_SIZE)
        token = _encode_token(page.last_adapter_id, prefix) if page.last_adapter_id else ""
        return ListPage(page.records, token)

    # -- delete, watch -------------------------------------------------------------------

    async def delete(
        self, adapter_id: str, version: int = 0, all_versions: bool = False
    ) -> list[AdapterRecord]:
        check_adapter_id(adapter_id)
        check_version(version)
        if all_versions:
            versions = await self.catalog.live_versions(adapter_id)
            if not versions:
                raise AdapterNotFound(f"adapter {adapter_id!r} does not exist")
        else:
            versions = [await self.catalog.resolve(adapter_id, version)]
        deleted = []
        for number in versions:
            record = await self.catalog.read(adapter_id, number)
            await self.catalog.retire(record)
            await self._delete_blob(record.blob_key)
            self._publish(AdapterEvent(EventKind.DELETED, record))
            deleted.append(record)
            log.info("deleted %s v%d", adapter_id, number)
        return deleted

    def _publish(self, event: AdapterEvent) -> None:
        self.events.publish(event)
        self.rescan.note(event)

    async def watch(self, prefix: str = "", include_existing: bool = False):
        """Events from now on; with include_existing, first a CREATED event for the latest
        version of each existing adapter. Subscribing before listing loses no event (one may
        come twice)."""
        check_prefix(prefix)
        subscription = self.events.subscribe(prefix)
        try:
            if include_existing:
                token = ""
                while True:
                    page = await self.list(prefix, MAX_PAGE_SIZE, token)
                    for record in page.records:
                        yield AdapterEvent(EventKind.CREATED, record)
                    token = page.next_page_token
                    if not token:
                        break
            async for event in subscription:
                yield event
        finally:
            subscription.close()

    # -- life cycle ----------------------------------------------------------------------

    async def probe(self) -> None:
        await self.backend.probe()

    def abort_uploads(self) -> int:
        """Stop taking uploads and cancel those in flight (each aborts its multipart upload)."""
        self.closing = True
        for task in list(self._uploads):
            task.cancel()
        return len(self._uploads)

    async def close(self, timeout_s: float = 30.0) -> None:
        self.abort_uploads()
        if self._cleanups:
            await asyncio.wait(list(self._cleanups), timeout=timeout_s)
        await self.backend.close()


def _encode_token(after: str, prefix: str) -> str:
    raw = json.dumps({"after": after, "prefix": prefix}).encode()
    return base64.urlsafe_b64encode(raw).decode()


def _decode_token(token: str, prefix: str) -> str:
    try:
        doc = json.loads(base64.urlsafe_b64decode(token.encode()))
        after, token_prefix = doc["after"], doc["prefix"]
    except (ValueError, KeyError, TypeError, binascii.Error) as exc:
        raise InvalidRequest("page_token is not one this store issued") from exc
    if token_prefix != prefix:
        raise InvalidRequest("page_token was issued for another prefix")
    return check_adapter_id(after)
