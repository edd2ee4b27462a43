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
    The body must have been read already: what the connection receives next is its end."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise ClientGone()
    finally:
        watch.cancel()
        task.cancel()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
