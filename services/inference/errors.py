"""The service's own errors, and the one mapping from domain errors to gRPC status codes.

Servicers raise or catch domain exceptions and call ``status_for`` once; nothing else in the
service chooses a status code.
"""

from __future__ import annotations

from typing import NamedTuple

import grpc

from services.auth import PermissionDenied, Unauthenticated
from services.inference.engine.errors import (
    AdapterLoadFailed,
    EngineOverloaded,
    EngineStopped,
    InvalidRequest,
    RequestFailed,
    UnknownAdapter,
)
from services.inference.host_cache import HostCacheFull
from store.peft import AdapterFormatError, BaseModelMismatch


class ServiceError(Exception):
    """Base class of the inference service's own errors."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else type(self).__name__


class AdapterNotFound(ServiceError, LookupError):
    """The store has no such adapter or version."""


class StoreUnavailable(ServiceError):
    """The adapter store cannot be reached (or failed) and this server does not hold the
    adapter; the base model and resident adapters keep serving."""


class QueueFull(ServiceError):
    """Too many requests are waiting; retry later or on another replica."""


class ShuttingDown(ServiceError):
    """The server is stopping and takes no new work."""


class TenantQuotaExceeded(ServiceError):
    """A tenant reached one of its own limits (tenancy.py); the message names it."""


class BadArgument(ServiceError, ValueError):
    """A field of the request is invalid; the message names it."""


class Status(NamedTuple):
    code: grpc.StatusCode
    message: str


# Most specific first: BaseModelMismatch is an AdapterFormatError, InvalidRequest a ValueError.
_CODES: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
    (BaseModelMismatch, grpc.StatusCode.FAILED_PRECONDITION),
    (AdapterFormatError, grpc.StatusCode.FAILED_PRECONDITION),
    (AdapterNotFound, grpc.StatusCode.NOT_FOUND),
    (UnknownAdapter, grpc.StatusCode.NOT_FOUND),
    (InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (BadArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (StoreUnavailable, grpc.StatusCode.UNAVAILABLE),
    (ShuttingDown, grpc.StatusCode.UNAVAILABLE),
    (EngineStopped, grpc.StatusCode.UNAVAILABLE),
    (AdapterLoadFailed, grpc.StatusCode.UNAVAILABLE),
    (RequestFailed, grpc.StatusCode.INTERNAL),  # this request alone; the message says why
    (QueueFull, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (TenantQuotaExceeded, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (EngineOverloaded, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (HostCacheFull, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),  # e.g. SamplingParams' range checks
)


def status_for(exc: BaseException) -> Status:
    """The status a client sees for ``exc``; unknown exceptions are INTERNAL."""
    for kind, code in _CODES:
        if isinstance(exc, kind):
            return Status(code, str(exc) or kind.__name__)
    return Status(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}")
