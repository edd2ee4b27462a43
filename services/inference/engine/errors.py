"""Exceptions the engine raises to its callers; each names what is wrong and what to fix."""

from __future__ import annotations


class EngineError(Exception):
    """Base class of the engine's own errors."""


class InvalidRequest(EngineError, ValueError):
    """The request cannot run as given (prompt too long, token ids out of vocabulary, ...)."""


class UnknownAdapter(EngineError, LookupError):
    """The request or call names an adapter that the engine does not hold."""

    def __str__(self) -> str:  # LookupError would quote the message
        return str(self.args[0]) if self.args else "unknown adapter"


class DuplicateRequest(InvalidRequest):
    """A request with the same request_id is still in flight."""


class EngineOverloaded(EngineError):
    """The queue is full; the caller should retry later."""


class EngineStopped(EngineError):
    """The engine is not running (never started, stopped, or its step loop failed)."""


class AdapterLoadFailed(EngineError):
    """An adapter's copy into the GPU page pool failed (its requests end with this; the engine
    keeps serving, and a later request for the adapter tries the copy again)."""


class PoolBusy(EngineError):
    """A load asked only for free room (a preload) found none now: nothing was evicted."""


class ModelLoadError(EngineError):
    """The model directory cannot be served: missing file, unsupported architecture, bad shape."""


class RequestFailed(EngineError):
    """A step could not go on with one request (its logits were not finite, its text could not
    be decoded): that request ends with this, and every other one keeps running."""
