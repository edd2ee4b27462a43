"""The gateway's errors and the one mapping to HTTP: OpenAI's error body and status codes.

Every failure a client sees is ``{"error": {"message", "type", "param", "code"}}`` with ``code``
the HTTP status. gRPC statuses map as the contract says (INVALID_ARGUMENT, FAILED_PRECONDITION
and OUT_OF_RANGE 400, UNAUTHENTICATED 401, PERMISSION_DENIED 403, NOT_FOUND 404,
RESOURCE_EXHAUSTED 429, UNAVAILABLE 503, anything else 500), with the service's message, which
says what to fix. A client that left before its answer gets none (the metrics count it as 499).
Every answer to a failure is made here: by the handlers installed on the app, and by
response_for for the generation endpoints, which are served ahead of FastAPI (completions.py).
"""

from __future__ import annotations

import logging

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

log = logging.getLogger(__name__)

CLIENT_CLOSED = 499  # the status counted for a client that left before its answer (nginx's)

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
}

_GRPC_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
}


class GatewayError(Exception):
    """A request the gateway answers with ``status`` and this message (which names the field
    or says what to fix)."""

    status = 500

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class BadRequest(GatewayError):
    status = 400


class NotFound(GatewayError):
    status = 404


class PayloadTooLarge(GatewayError):
    status = 413


class Unavailable(GatewayError):
    status = 503


class ClientGone(Exception):
    """The client closed its connection before the answer was ready."""


def rpc_status(exc: grpc.RpcError) -> tuple[int, str]:
    """The HTTP status and message of a failed gRPC call."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = (exc.details() if hasattr(exc, "details") else None) or str(code.name)
    status = _GRPC_STATUS.get(code, 500)
    if status == 500:
        log.error("gRPC call failed: %s: %s", code.name, details)
    return status, details


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {
        "error": {
            "message": message,
            "type": ERROR_TYPES.get(status, "invalid_request_error"),
            "param": param,
            "code": status,
        }
    }


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status)


def error_of(exc: BaseException) -> tuple[int, str, str | None]:
    """(status, message, param) of any exception raised while serving a request."""
    if isinstance(exc, GatewayError):
        return exc.status, exc.message, exc.param
    if isinstance(exc, grpc.RpcError):
        status, message = rpc_status(exc)
        return status, message, None
    log.error("request failed", exc_info=exc)
    return 500, f"internal error: {type(exc).__name__}: {exc}", None


def response_for(exc: Exception) -> Response:
    """The answer to a request that failed with ``exc`` before its response started."""
    if isinstance(exc, ClientGone):
        return Response(status_code=CLIENT_CLOSED)  # unread: the client is gone
    return error_response(*error_of(exc))


async def handle(request: Request, exc: Exception) -> Response:
    """The exception handler of the gateway's own errors, gRPC's and anything unexpected."""
    return response_for(exc)


def install(app: FastAPI) -> None:
    """Answers every failure with OpenAI's error body."""

    async def handle_http(request: Request, exc: HTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        return error_response(exc.status_code, message)

    async def handle_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(400, validation_message(exc.errors()))

    app.add_exception_handler(GatewayError, handle)
    app.add_exception_handler(grpc.RpcError, handle)
    app.add_exception_handler(HTTPException, handle_http)
    app.add_exception_handler(RequestValidationError, handle_validation)
    app.add_exception_handler(ClientGone, handle)
    app.add_exception_handler(Exception, handle)


def validation_message(errors) -> str:
    """One line naming each invalid field, from pydantic's error list."""
    parts = []
    for err in errors:
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        parts.append(f"{where}: {err.get('msg', 'invalid')}" if where else err.get("msg", ""))
    return "; ".join(parts) or "invalid request"
