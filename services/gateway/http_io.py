"""Reading request bodies within a bound, and work that ends when its client goes away."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import ClientDisconnect, Request

from services.gateway.errors import BadRequest, ClientGone, PayloadTooLarge

T = TypeVar("T")


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, refused (413) as soon as it is known to exceed ``limit`` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise BadRequest(f"Content-Length must be a number of bytes, got {declared!r}")
        if int(declared) > limit:
            raise PayloadTooLarge(f"the request body is {declared} bytes; at most {limit}")
    parts, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(f"the request body exceeds {limit} bytes")
            parts.append(chunk)
    except ClientDisconnect:
        raise ClientGone() from None
    return b"".join(parts)


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """``work``'s result; if the client disconnects first, ``work`` is cancelled (a Generate
    call it makes is then cancelled, and the engine aborts the request) and ClientGone raised.
    The body must have been read already: what the connection receives next is its end.

    ``work`` runs in the caller's task, so its result is the caller's at once (a task of its
    own would cost an event-loop turn between the first message's arrival and the response);
    the watch for the disconnect is the task, and it cancels the caller's."""
    caller = asyncio.current_task()
    gone = False

    async def watch() -> None:
        nonlocal gone
        await _disconnected(request)
        gone = True
        caller.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        return await work
    except asyncio.CancelledError:
        if not gone:  # cancelled from elsewhere (a shutdown): not ours to absorb
            raise
        caller.uncancel()
        raise ClientGone() from None
    finally:
        watcher.cancel()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
