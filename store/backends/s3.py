"""S3-compatible object storage (AWS S3, MinIO, SeaweedFS) through boto3.

boto3 blocks, so every call runs on a dedicated thread pool (sized for parallel ranged reads)
and the event loop never waits on the network. botocore retries refused connections, timeouts
and 5xx answers with exponential backoff ("standard" mode) up to max_attempts; what still fails
becomes StorageUnavailable, which the service reports as UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import email.utils
import http.client
import logging
from collections.abc import AsyncIterator
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial

import boto3
import urllib3.exceptions
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError
from botocore.response import StreamingBody

from store.backends.base import MultipartWriter, ObjectNotFound, ObjectStore, RangeReader, outlast
from store.config import StoreConfig
from store.errors import StorageError, StorageUnavailable

log = logging.getLogger(__name__)

_NOT_FOUND = {"NoSuchKey", "404", "NotFound"}
_PRECONDITION = {"PreconditionFailed", "412", "ConditionalRequestConflict"}
# What a body read can raise: socket errors and timeouts (OSError), http.client's and urllib3's
# errors on a broken response, and botocore's wrappers of those.
_READ_ERRORS = (BotoCoreError, OSError, http.client.HTTPException, urllib3.exceptions.HTTPError)
_RETRYABLE = {"SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout", "Throttling"}


def _code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def _status(exc: ClientError) -> int:
    return int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)


class S3ObjectStore(ObjectStore):
    def __init__(self, config: StoreConfig) -> None:
        self.bucket = config.s3_bucket
        self._endpoint = config.s3_endpoint or f"s3.{config.s3_region}.amazonaws.com"
        self._pool = ThreadPoolExecutor(config.io_threads, thread_name_prefix="s3")
        self.client = boto3.session.Session().client(
            "s3",
            endpoint_url=config.s3_endpoint,
            region_name=config.s3_region,
            aws_access_key_id=config.aws_access_key_id,
            aws_secret_access_key=config.aws_secret_access_key,
            aws_session_token=config.aws_session_token,
            config=Config(
                connect_timeout=config.connect_timeout_s,
                read_timeout=config.read_timeout_s,
                retries={"max_attempts": config.max_attempts, "mode": "standard"},
                max_pool_connections=config.io_threads,
                s3={"addressing_style": "path"},
            ),
        )

    async def _call(self, fn, /, **kwargs):
        """Run one boto3 call on the pool and translate its failure."""
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._pool, partial(fn, **kwargs))
        except ClientError as exc:
            code, status = _code(exc), _status(exc)
            if code in _NOT_FOUND or status == 404 and code != "NoSuchBucket":
                raise ObjectNotFound(kwargs.get("Key", "")) from exc
            if code in _RETRYABLE or status >= 500:
                raise StorageUnavailable(f"storage at {self._endpoint} failed: {exc}") from exc
            raise StorageError(f"storage at {self._endpoint} refused the call: {exc}") from exc
        except NoCredentialsError as exc:
            raise StorageError(
                "no S3 credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"
            ) from exc
        except BotoCoreError as exc:
            # Connection refused or reset, DNS failure, timeouts: after botocore's retries.
            raise StorageUnavailable(f"storage at {self._endpoint} is unreachable: {exc}") from exc

    async def put(self, key: str, data: bytes) -> None:
        await self._call(self.client.put_object, Bucket=self.bucket, Key=key, Body=data)

    async def put_if_absent(self, key: str, data: bytes) -> bool:
        try:
            await self._call(
                self.client.put_object, Bucket=self.bucket, Key=key, Body=data, IfNoneMatch="*"
            )
            return True
        except StorageError as exc:
            cause = exc.__cause__
            if isinstance(cause, ClientError) and (
                _code(cause) in _PRECONDITION or _status(cause) in (409, 412)
            ):
                return False
            raise

    async def get(self, key: str) -> bytes:
        response = await self._call(self.client.get_object, Bucket=self.bucket, Key=key)
        return await self._read(response)

    async def open_range(self, key: str, start: int, end: int) -> RangeReader:
        if start >= end:
            return _S3Range(self, key, None, 0)
        try:
            response = await self._call(
                self.client.get_object,
                Bucket=self.bucket,
                Key=key,
                Range=f"bytes={start}-{end - 1}",
            )
        except StorageError as exc:
            cause = exc.__cause__
            if isinstance(cause, ClientError) and _code(cause) == "InvalidRange":
                return _S3Range(self, key, None, 0)  # the object ends before the range starts
            raise
        length = int(response.get("ContentLength", end - start))
        return _S3Range(self, key, response["Body"], length)

    async def _read(self, response) -> bytes:
        body = response["Body"]
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._pool, body.read)
        except _READ_ERRORS as exc:
            raise StorageUnavailable(f"reading from {self._endpoint} failed: {exc}") from exc
        finally:
            body.close()

    async def delete(self, key: str) -> None:
        await self._call(self.client.delete_object, Bucket=self.bucket, Key=key)

    async def list_keys(self, prefix: str, start_after: str = "") -> AsyncIterator[str]:
        token = None
        while True:
            kwargs = {"Bucket": self.bucket, "Prefix": prefix}
            if token:
                kwargs["ContinuationToken"] = token
            elif start_after:
                kwargs["StartAfter"] = start_after
            page = await self._call(self.client.list_objects_v2, **kwargs)
            for item in page.get("Contents", []):
                yield item["Key"]
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return

    async def total_bytes(self, prefix: str) -> int:
        size, kwargs = 0, {"Bucket": self.bucket, "Prefix": prefix}
        while True:
            page = await self._call(self.client.list_objects_v2, **kwargs)
            size += sum(item["Size"] for item in page.get("Contents", []))
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return size
            kwargs["ContinuationToken"] = token

    async def begin_multipart(self, key: str) -> MultipartWriter:
        response = await self._call(
            self.client.create_multipart_upload, Bucket=self.bucket, Key=key
        )
        return _S3Multipart(self, key, response["UploadId"])

    async def _upload_pages(self, prefix: str) -> AsyncIterator[dict]:
        """The pages of ListMultipartUploads under ``prefix``, followed to the last."""
        kwargs = {"Bucket": self.bucket, "Prefix": prefix}
        while True:
            page = await self._call(self.client.list_multipart_uploads, **kwargs)
            yield page
            if not page.get("IsTruncated"):
                return
            kwargs["KeyMarker"] = page["NextKeyMarker"]
            kwargs["UploadIdMarker"] = page["NextUploadIdMarker"]

    async def pending_uploads(self, prefix: str = "") -> list[str]:
        keys: list[str] = []
        async for page in self._upload_pages(prefix):
            keys += [upload["Key"] for upload in page.get("Uploads", []) or []]
        return sorted(keys)

    async def abort_stale_uploads(self, prefix: str, older_than_s: float) -> list[str]:
        """S3 cannot tell a live multipart upload from one whose writer died: uploads begun
        more than ``older_than_s`` ago (by the server's clock, as S3 reports it) are aborted."""
        stale: list[tuple[str, str]] = []
        async for page in self._upload_pages(prefix):
            now = _server_time(page)
            for upload in page.get("Uploads", []) or []:
                begun = upload.get("Initiated")
                if begun is not None and (now - begun).total_seconds() > older_than_s:
                    stale.append((upload["Key"], upload["UploadId"]))
        for key, upload_id in stale:
            await _S3Multipart(self, key, upload_id).abort()
        return sorted(key for key, _ in stale)

    async def probe(self) -> None:
        try:
            await self._call(self.client.head_bucket, Bucket=self.bucket)
        except ObjectNotFound as exc:
            message = f"bucket {self.bucket!r} does not exist at {self._endpoint}"
            raise StorageError(message) from exc

    async def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.client.close()


def _server_time(response: dict) -> datetime.datetime:
    """When the server answered (its Date header), else this machine's clock."""
    date = response.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
    if date:
        with contextlib.suppress(TypeError, ValueError):
            return email.utils.parsedate_to_datetime(date)
    return datetime.datetime.now(datetime.UTC)


def _socket_response(body: StreamingBody) -> http.client.HTTPResponse | None:
    """The http.client response under botocore's StreamingBody and urllib3's response, if this
    botocore and urllib3 have one there. Its readinto fills the buffer straight from the socket;
    StreamingBody's (through urllib3) reads into a new bytes object and copies that over, one
    more copy and allocation per read. botocore asks urllib3 for the raw body (no content
    decoding), so both read the same bytes. The attributes are private: where they are missing
    this returns None and the reads go through StreamingBody, which costs only the copy."""
    raw = getattr(body, "_raw_stream", None)
    response = getattr(raw, "_fp", None)
    if isinstance(response, http.client.HTTPResponse) and callable(
        getattr(raw, "release_conn", None)
    ):
        return response
    return None


class _S3Range(RangeReader):
    """One ranged GET's body. ``length`` is the response's Content-Length: a connection that
    ends before it is a storage failure (UNAVAILABLE), while a range that the object does not
    fill reads short, which the fetch reports as corruption."""

    def __init__(
        self, store: S3ObjectStore, key: str, body: StreamingBody | None, length: int
    ) -> None:
        self._store = store
        self._key = key
        self._body = body
        self._left = length
        self._socket = _socket_response(body) if body is not None else None
        self._reading: Future | None = None

    async def readinto(self, view: memoryview) -> int:
        want = min(len(view), self._left)
        if want <= 0:
            return 0
        if self._body is None:
            raise ValueError("read from a closed range")
        s = self._store
        source = self._socket if self._socket is not None else self._body
        self._reading = s._pool.submit(source.readinto, view[:want])
        try:
            n = await asyncio.wrap_future(self._reading)
        except _READ_ERRORS as exc:
            message = f"reading {self._key} from {s._endpoint} failed: {exc}"
            raise StorageUnavailable(message) from exc
        if n == 0:
            raise StorageUnavailable(
                f"reading {self._key} from {s._endpoint} failed: the connection closed "
                f"{self._left} bytes before the end of the response"
            )
        self._left -= n
        return n

    async def close(self) -> None:
        body, self._body = self._body, None
        if body is None:
            return
        reading = self._reading
        if reading is not None and not reading.done():
            # Cancelled mid-read: the thread still reads into the caller's buffer. Shutting
            # the socket down ends that read now; the socket is closed once it has.
            with contextlib.suppress(Exception):
                body._raw_stream.shutdown()
            await outlast(reading)
        elif self._left == 0 and self._socket is not None:
            # Read to the end past urllib3's bookkeeping: hand the connection back to the
            # pool, as urllib3 does when it reads a body to the end itself.
            body._raw_stream.release_conn()
        body.close()  # closes the connection unless it was handed back


class _S3Multipart(MultipartWriter):
    def __init__(self, store: S3ObjectStore, key: str, upload_id: str) -> None:
        self.key = key
        self._store = store
        self._upload_id = upload_id
        self._etags: dict[int, str] = {}

    async def write_part(self, number: int, offset: int, data: bytes) -> None:
        s = self._store
        response = await s._call(
            s.client.upload_part,
            Bucket=s.bucket,
            Key=self.key,
            UploadId=self._upload_id,
            PartNumber=number,
            Body=data,
        )
        self._etags[number] = response["ETag"]

    async def complete(self) -> None:
        s = self._store
        parts = [{"PartNumber": n, "ETag": tag} for n, tag in sorted(self._etags.items())]
        await s._call(
            s.client.complete_multipart_upload,
            Bucket=s.bucket,
            Key=self.key,
            UploadId=self._upload_id,
            MultipartUpload={"Parts": parts},
        )

    async def abort(self) -> None:
        s = self._store
        try:
            await s._call(
                s.client.abort_multipart_upload,
                Bucket=s.bucket,
                Key=self.key,
                UploadId=self._upload_id,
            )
        except ObjectNotFound:
            pass  # already completed or aborted (NoSuchUpload)
