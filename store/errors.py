"""The store's domain errors. The gRPC servicer maps each to one status code, in one place."""

from __future__ import annotations


class StoreError(Exception):
    """Base of every error the store reports to its callers."""


class ShuttingDown(StoreError):
    """The store is stopping and takes no new uploads."""


class InvalidRequest(StoreError):
    """A malformed request: bad adapter id, bad checksum syntax, misuse of the upload stream."""


class ChecksumMismatch(InvalidRequest):
    """The uploaded bytes do not hash to the sha256 the client announced."""


class AdapterNotFound(StoreError):
    """No such adapter, or no such version of it."""


class AdapterTooLarge(StoreError):
    """The adapter is larger than the store's configured limit."""


class TenantStorageFull(AdapterTooLarge):
    """A tenant's stored adapters would pass its storage quota (--tenant-max-bytes)."""


class TooManyUploads(StoreError):
    """As many uploads as the store takes at once are in flight; retry later."""


class UploadTimedOut(StoreError):
    """The upload took longer than the store allows one upload to take."""


class StorageUnavailable(StoreError):
    """The backing storage cannot be reached or did not answer in time; retrying may succeed."""


class StorageError(StoreError):
    """The backing storage refused a call for a reason retrying will not fix (credentials, a
    missing bucket, a full disk)."""


class DataCorruption(StoreError):
    """Stored bytes no longer match the sha256 recorded when they were uploaded."""


class VersionConflict(StoreError):
    """Could not claim a version number: too many concurrent uploads of one adapter id."""


class WatchOverflow(StoreError):
    """A watcher fell too far behind the stream of events and was dropped."""
