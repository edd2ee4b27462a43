"""Reading request bodies within a bound, and work that ends when its client goes away.

Both work on ASGI's own scope and receive, so that the generation endpoints, which are plain
ASGI apps (completions.py), and FastAPI's routes (``request.scope``, ``request.receive``) share
them.
"""

from __future__ import annotations

import asyncio

from starlette.types import Receive, Scope

from services.gateway.errors import BadRequest, ClientGone, PayloadTooLarge


def header(scope: Scope, name: bytes) -> str | None:
    """The first value of the header ``name`` (lower case), as Starlette's Headers.get reads it.
    ``scope`` may also be a Starlette Request, which reads as its scope."""
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


async def read_body(scope: Scope, receive: Receive, limit: int) -> bytes:
    """The whole body, refused (413) as soon as it is known to exceed ``limit`` bytes."""
    declared = header(scope, b"content-length")
    if declared is not None:
        if not declared.isdigit():
            raise BadRequest(f"Content-Length must be a number of bytes, got {declared!r}")
        if int(declared) > limit:
            raise PayloadTooLarge(f"the request body is {declared} bytes; at most {limit}")
    parts, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"the request body exceeds {limit} bytes")
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts)


class DisconnectWatch:
    """Cancels the task that starts it when its client disconnects (a Generate call that task
    awaits is then cancelled, and the engine aborts the request); ``gone`` says that it did.
    The body must have been read already: what the connection receives next is its end.

    The work stays in the caller's task, so a result is the caller's at once (a task of its
    own would cost an event-loop turn between the first message's arrival and the response);
    the watch is the task. A CancelledError that the caller catches is this watch's when
    ``gone`` is set (then the caller uncancels itself), else from elsewhere (a shutdown: not
    the caller's to absorb). ``stop()`` before the response's last byte: uvicorn answers
    ``receive`` with a disconnect once the response is complete."""

    def __init__(self, receive: Receive) -> None:
        self.gone = False
        self._caller = asyncio.current_task()
        self._armed = True
        self._watcher = asyncio.ensure_future(self._watch(receive))

    async def _watch(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        if self._armed:
            self.gone = True
            self._caller.cancel()

    def stop(self) -> None:
        self._armed = False
        self._watcher.cancel()
