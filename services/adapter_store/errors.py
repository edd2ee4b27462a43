"""Domain errors -> gRPC status codes, in one place."""

from __future__ import annotations

import asyncio
import functools
import logging

import grpc

from services.auth import AuthError, PermissionDenied, Unauthenticated
from store.errors import (
    AdapterNotFound,
    AdapterTooLarge,
    DataCorruption,
    InvalidRequest,
    ShuttingDown,
    StorageError,
    StorageUnavailable,
    StoreError,
    TooManyUploads,
    UploadTimedOut,
    VersionConflict,
    WatchOverflow,
)
from store.peft import AdapterFormatError, BaseModelMismatch

log = logging.getLogger(__name__)

# First match wins: subclasses before their bases.
STATUS_BY_ERROR: tuple[tuple[type[Exception], grpc.StatusCode], ...] = (
    (Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
    (BaseModelMismatch, grpc.StatusCode.FAILED_PRECONDITION),
    (AdapterFormatError, grpc.StatusCode.INVALID_ARGUMENT),
    (InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (AdapterNotFound, grpc.StatusCode.NOT_FOUND),
    (AdapterTooLarge, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (TooManyUploads, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (UploadTimedOut, grpc.StatusCode.DEADLINE_EXCEEDED),
    (StorageUnavailable, grpc.StatusCode.UNAVAILABLE),
    (DataCorruption, grpc.StatusCode.DATA_LOSS),
    (VersionConflict, grpc.StatusCode.ABORTED),
    (WatchOverflow, grpc.StatusCode.ABORTED),
    (StorageError, grpc.StatusCode.INTERNAL),
    (ShuttingDown, grpc.StatusCode.UNAVAILABLE),
)


def status_for(exc: Exception) -> grpc.StatusCode | None:
    for error_type, code in STATUS_BY_ERROR:
        if isinstance(exc, error_type):
            return code
    return None


# What a handler may raise that becomes a status; anything else is a bug (gRPC: UNKNOWN).
_MAPPED = (StoreError, AdapterFormatError, AuthError, TimeoutError)


def _code_for(exc: BaseException, context: grpc.aio.ServicerContext) -> grpc.StatusCode:
    """The status a call that raised ``exc`` ends with (as _abort gives it, or gRPC's own)."""
    if isinstance(exc, asyncio.CancelledError | GeneratorExit):  # the client went away
        return grpc.StatusCode.CANCELLED
    if isinstance(exc, grpc.aio.AbortError):  # the handler aborted the call itself
        return context.code() or grpc.StatusCode.UNKNOWN
    if isinstance(exc, _MAPPED):
        return _mapped_code(exc)
    return grpc.StatusCode.UNKNOWN


def _mapped_code(exc: BaseException) -> grpc.StatusCode:
    """The status of an error in _MAPPED: a TimeoutError (within_deadline gave up) is
    UNAVAILABLE, an error with no entry in STATUS_BY_ERROR INTERNAL."""
    if isinstance(exc, TimeoutError):
        return grpc.StatusCode.UNAVAILABLE
    return status_for(exc) or grpc.StatusCode.INTERNAL


def _count(servicer, context, method: str, exc: BaseException | None) -> None:
    """The call's end on the servicer's metrics (``metrics``: StoreMetrics or None)."""
    if servicer.metrics is not None:
        servicer.metrics.call(method, "OK" if exc is None else _code_for(exc, context).name)


async def _abort(context: grpc.aio.ServicerContext, method: str, exc: Exception) -> None:
    """Abort the call with the status for ``exc``; context.abort raises, so this never returns."""
    code, message = _mapped_code(exc), str(exc)
    if isinstance(exc, TimeoutError):
        message = "storage did not answer before the call's deadline"
    elif status_for(exc) is None:
        log.exception("%s failed unexpectedly", method)
        message = f"internal error: {exc}"
    elif code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.DATA_LOSS):
        log.error("%s: %s", method, exc)
    else:
        log.info("%s: %s: %s", method, code.name, exc)
    await context.abort(code, message)


def map_errors(handler):
    """Wrap a unary-response handler so that domain errors become status codes."""

    @functools.wraps(handler)
    async def wrapper(self, request, context):
        try:
            response = await handler(self, request, context)
        except BaseException as exc:
            _count(self, context, handler.__name__, exc)
            if not isinstance(exc, _MAPPED):
                raise
            await _abort(context, handler.__name__, exc)
        _count(self, context, handler.__name__, None)
        return response

    return wrapper


def map_stream_errors(handler):
    """The same for a response-streaming handler (an async generator)."""

    @functools.wraps(handler)
    async def wrapper(self, request, context):
        try:
            async for response in handler(self, request, context):
                yield response
        except BaseException as exc:
            _count(self, context, handler.__name__, exc)
            if not isinstance(exc, _MAPPED):
                raise
            await _abort(context, handler.__name__, exc)
        _count(self, context, handler.__name__, None)

    return wrapper


async def within_deadline(context: grpc.aio.ServicerContext, awaitable):
    """Await a storage operation, giving up (UNAVAILABLE) shortly before the RPC's deadline so
    that the client gets a status that says why rather than DEADLINE_EXCEEDED."""
    remaining = context.time_remaining()
    if remaining is None:
        return await awaitable
    margin = min(0.25, remaining * 0.1)
    return await asyncio.wait_for(awaitable, max(remaining - margin, 0.001))
