"""FetchWorker: the service's handle on the fetch worker process (fetch_worker.py says why).

Owned by the service's event loop. fetch() sends the request, answers the worker's AdapterInfo
with a block reserved by the caller's ``reserve`` (on the event loop, so the host cache needs no
lock), and returns once the bytes are in the block. A block is given back (``discard``) only
after the worker has ended that fetch, whatever happened meanwhile (an error, the caller
cancelled, the worker died), so the worker never writes into memory that was reused.
The worker starts on the first fetch and again on the next fetch after it died.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import NamedTuple

from lorafleet.v1 import adapter_store_pb2 as pb
from services.inference.arena import ArenaBlock, HostArena
from services.inference.child_process import spawn
from services.inference.engine.adapter_spec import AdapterSpec
from services.inference.fetch_worker import AdapterCheck
from services.inference.store_access import StoreAccess
from store.peft import AdapterFormatError

log = logging.getLogger(__name__)

_STOPPED = "the fetch worker was stopped"
# How long a stopped worker may take to exit once its connection is closed (its fetches are
# threads that end with it) before it is killed: it ignores SIGTERM (fetch_worker.main).
EXIT_GRACE_S = 5.0


class FetchFailed(Exception):
    """A fetch ended without the bytes: ``code`` is a gRPC status name, or PROTOCOL."""

    def __init__(self, code: str, details: str) -> None:
        super().__init__(f"{code}: {details}")
        self.code = code
        self.details = details


class Fetched(NamedTuple):
    info: pb.AdapterInfo
    block: ArenaBlock
    verdict: AdapterSpec | AdapterFormatError | None  # see fetch_worker.AdapterCheck


@dataclass
class _Pending:
    reserve: Callable[[pb.AdapterInfo], ArenaBlock]
    discard: Callable[[ArenaBlock], None]
    future: asyncio.Future
    info: pb.AdapterInfo | None = None
    block: ArenaBlock | None = None
    verdict: AdapterSpec | AdapterFormatError | None = None
    abandoned: bool = False  # the caller went away; the block goes back when the worker ends
    done: bool = False


class FetchWorker:
    def __init__(self, access: StoreAccess, arena: HostArena) -> None:
        """``access``: how the worker reaches the store (its address, token and TLS)."""
        self.access = access
        self.target = access.target
        self.arena = arena
        self._proc: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending: dict[int, _Pending] = {}
        self._ids = itertools.count(1)
        self.starts = 0  # more than one: the worker died (or was stopped) and started again

    async def fetch(
        self,
        adapter_id: str,
        version: int,
        timeout: float,
        reserve: Callable[[pb.AdapterInfo], ArenaBlock],
        discard: Callable[[ArenaBlock], None],
        check: AdapterCheck | None = None,
    ) -> Fetched:
        """The AdapterInfo, the block holding the adapter's bytes (the caller's now) and, with
        ``check``, the worker's verdict on them. Raises FetchFailed, or what ``reserve``
        raised."""
        self.start()
        fid = next(self._ids)
        pending = _Pending(reserve, discard, asyncio.get_running_loop().create_future())
        self._pending[fid] = pending
        self._send("fetch", fid, adapter_id, version, timeout, check)
        try:
            # The worker's own gRPC deadline ends the stream; this only guards a stuck worker.
            await asyncio.wait_for(asyncio.shield(pending.future), timeout + 10.0)
        except BaseException as exc:
            if not pending.done:  # cancelled or timed out: the worker may still write
                pending.abandoned = True
                self._send("cancel", fid)
            if isinstance(exc, asyncio.TimeoutError):
                raise FetchFailed("DEADLINE_EXCEEDED", "the fetch worker did not answer") from None
            raise
        return Fetched(pending.info, pending.block, pending.verdict)

    def close(self) -> None:
        """Stops the worker; blocks of fetches still in flight go back to their owners."""
        if self._proc is None:
            return
        self._teardown(_STOPPED)

    # --- the connection -------------------------------------------------------------------

    def start(self) -> None:
        """Starts the worker now if it is not running (fetch() does so too): on the event loop."""
        if self._proc is not None:
            return
        self._proc, self._conn = spawn(
            "services.inference.fetch_worker", self.arena, self.access.encode()
        )
        self.starts += 1
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._conn.fileno(), self._readable)
        log.info("fetch worker started (pid %d) for the store at %s", self._proc.pid, self.target)

    def _send(self, *msg) -> None:
        try:
            self._conn.send(msg)
        except (OSError, AttributeError):  # the worker is gone; _readable reports it
            pass

    def _readable(self) -> None:
        try:
            while self._conn is not None and self._conn.poll(0):
                self._dispatch(self._conn.recv())
        except (EOFError, OSError):
            self._teardown("the fetch worker exited")

    def _dispatch(self, msg: tuple) -> None:
        kind, fid = msg[0], msg[1]
        pending = self._pending.get(fid)
        if pending is None:
            return
        if kind == "info":
            info = pb.AdapterInfo.FromString(msg[2])
            if pending.abandoned:
                self._send("drop", fid)
                return
            try:
                pending.block = pending.reserve(info)
            except BaseException as exc:
                self._send("drop", fid)
                _fail(pending, exc)
                return
            pending.info = info
            self._send("block", fid, pending.block.offset, pending.block.size)
            return
        del self._pending[fid]  # "done" or "error": the worker has ended this fetch
        pending.done = True
        if kind == "done" and pending.block is not None and not pending.abandoned:
            pending.verdict = msg[2]
            if not pending.future.done():
                pending.future.set_result(None)
                return
        if pending.block is not None:
            pending.discard(pending.block)
            pending.block = None
        error = (
            FetchFailed(msg[2], msg[3])
            if kind == "error"
            else FetchFailed("CANCELLED", "the fetch was abandoned")
        )
        _fail(pending, error)

    def _teardown(self, reason: str) -> None:
        if self._conn is not None:
            if self._loop is not None and not self._loop.is_closed():
                self._loop.remove_reader(self._conn.fileno())
            self._conn.close()
            self._conn = None
        if self._proc is not None:
            try:
                self._proc.wait(EXIT_GRACE_S)  # the closed connection ends serve()
            except subprocess.TimeoutExpired:
                log.warning("the fetch worker did not exit within %.0f s: killing it",
                            EXIT_GRACE_S)  # fmt: skip
                self._proc.kill()
                self._proc.wait()
            level = logging.INFO if reason == _STOPPED else logging.WARNING
            log.log(level, "%s (pid %d, exit %s)", reason, self._proc.pid, self._proc.returncode)
            self._proc = None
        pending, self._pending = self._pending, {}
        for p in pending.values():  # the process is gone: nothing writes into these blocks
            p.done = True
            if p.block is not None:
                p.discard(p.block)
                p.block = None
            _fail(p, FetchFailed("UNAVAILABLE", reason))


def _fail(pending: _Pending, error: BaseException) -> None:
    if not pending.future.done():
        pending.future.set_exception(error)
        pending.future.exception()  # retrieved: an abandoned fetch's error is not "unhandled"
