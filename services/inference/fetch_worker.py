"""The fetch worker: a child process that streams FetchAdapter into the shared host arena.

Why a process: receiving an adapter over gRPC in Python holds the GIL for milliseconds at a
time (each 4 MiB message is assembled into a bytes object before any Python code sees it).
In the service process that time is taken from the engine's step thread, which needs the GIL
between its kernel launches: decode steps slowed down while cold adapters loaded. So the
adapter bytes never enter the service process. The worker maps the arena (a memfd the service
shares with it, page-locked there for the GPU) and writes each chunk into the block the service
reserved for it; per fetch the two processes exchange four messages over a socket (the largest,
the adapter's spec, is a few kilobytes).

Protocol (pickled tuples over a multiprocessing Connection on a socketpair; fid = fetch id):
  service -> worker: ("fetch", fid, adapter_id, version, timeout_s, check) | ("cancel", fid)
  worker -> service: ("info", fid, AdapterInfo bytes)
  service -> worker: ("block", fid, offset, size) | ("drop", fid)
  worker -> service: ("done", fid, verdict) | ("error", fid, status name, details)
``check`` is None or an AdapterCheck: then the worker also validates the adapter (store.peft,
as the engine would: its Python would hold the service's GIL for milliseconds too) and the
verdict is its AdapterSpec (engine/adapter_spec.py), or the AdapterFormatError that rejects it.
The worker reaches the store as the service does (store_access.py: its token, its TLS).
Every fetch ends with exactly one "done" or "error", also after "drop" or "cancel": only then
may the service reuse the block, since the worker could still be writing into it.

The parent's side is FetchWorker (started on first use, restarted if it dies); the child's is
``python -m services.inference.fetch_worker``.

Two costs per byte that are not the copy itself are kept out (Linux, glibc; measured with
bench/fetch_burst.py, which compares them with glibc's defaults):

- Freed message buffers stay in this process's heap (``keep_freed_memory``). By default glibc
  gives the top of a heap back to the kernel once more than twice the last large block is
  free, which several 4 MiB messages in flight keep doing, and every page it gave back comes
  back as a page fault that zeroes it: 60,000-160,000 faults a GB received on 2 cores.
- Each block is populated in one call before its first chunk lands (``Populator``): the page
  faults of this process's first writes into its mapping of the arena cost more than the copy.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import queue
import signal
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import NamedTuple

import grpc
import numpy as np

from lorafleet.v1 import adapter_store_pb2 as pb
from services.inference.engine.adapter_spec import AdapterSpec, validate_and_describe
from services.inference.fetch_wire import FETCH_METHOD, RECONNECT_OPTIONS, decode_fetch_response
from services.inference.store_access import StoreAccess
from store.peft import AdapterFormatError, BaseModelShape

log = logging.getLogger(__name__)

# Status name for a stream that broke the protocol (not a gRPC status).
PROTOCOL_ERROR = "PROTOCOL"
MAX_MESSAGE_BYTES = 16 * 2**20
# glibc's mallopt parameters and what this process sets them to (keep_freed_memory): the heap's
# free top stays up to TRIM_THRESHOLD, and blocks up to MMAP_THRESHOLD (glibc's largest, so every
# gRPC message fits) come from the heap rather than from mappings of their own.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
TRIM_THRESHOLD, MMAP_THRESHOLD = 512 * 2**20, 32 * 2**20
# madvise: fault the range's pages in for writing, in one call (Linux 5.14)
MADV_POPULATE_WRITE = 23
# LORAFLEET_FETCH_WORKER_MEMORY=default leaves glibc's heap and the first touches as they are:
# bench/fetch_burst.py compares the two.
MEMORY_ENV = "LORAFLEET_FETCH_WORKER_MEMORY"


def keep_freed_memory() -> bool:
    """Sets glibc's trim and mmap thresholds for this process (see the module's docstring);
    False where that is not glibc."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)) and bool(
        mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    )


class Populator:
    """Faults a block of the arena in for writing before the stream fills it, in one madvise
    call, where that call exists (once it fails, it is not tried again). The call goes through
    ctypes, which lets go of the GIL meanwhile: a block of a rank-64 adapter takes milliseconds,
    in which the other fetches' threads go on."""

    def __init__(self, address: int, madvise: Callable[..., int] | None = None) -> None:
        """``address``: where this process maps the arena; ``madvise``: libc's (the default)."""
        self._address = address
        if madvise is None:
            try:
                madvise = ctypes.CDLL(None, use_errno=True).madvise
                madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
                madvise.restype = ctypes.c_int
            except (OSError, AttributeError):
                madvise = None
        self._madvise = madvise
        self.enabled = madvise is not None

    def __call__(self, offset: int, size: int) -> None:
        if not self.enabled or size <= 0:
            return
        start = offset - offset % mmap.PAGESIZE
        if self._madvise(self._address + start, offset + size - start, MADV_POPULATE_WRITE):
            self.enabled = False  # an older kernel: the writes fault the pages in as they come


class AdapterCheck(NamedTuple):
    """What a fetched adapter is validated against: the engine's base model and rank limit."""

    base: BaseModelShape
    max_rank: int


def verdict(
    check: AdapterCheck, config_json: str, data: memoryview
) -> AdapterSpec | AdapterFormatError:
    try:
        return validate_and_describe(config_json, data, check.base, check.max_rank)
    except AdapterFormatError as exc:  # BaseModelMismatch included
        return exc


class _Fetch:
    """One fetch on the worker's side: its call and the service's answer to its AdapterInfo."""

    def __init__(self) -> None:
        self.answer: queue.SimpleQueue = queue.SimpleQueue()
        self.call = None
        self.cancelled = False


class _Worker:
    def __init__(
        self,
        access: StoreAccess,
        arena: np.ndarray,
        conn: Connection,
        populate: Callable[[int, int], None] | None = None,
    ) -> None:
        self.arena = arena
        self.conn = conn
        self.populate = populate
        self._send_lock = threading.Lock()
        self._fetches: dict[int, _Fetch] = {}
        self._lock = threading.Lock()
        self._token = access.token()  # the service's token at the store, sent with each fetch
        channel = access.channel(
            [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES), *RECONNECT_OPTIONS]
        )
        self._rpc = channel.unary_stream(
            FETCH_METHOD,
            request_serializer=pb.FetchAdapterRequest.SerializeToString,
            response_deserializer=decode_fetch_response,
        )

    def send(self, *msg) -> None:
        with self._send_lock:
            self.conn.send(msg)

    def serve(self) -> None:
        """Until the service closes its end (or exits)."""
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                return
            kind, fid = msg[0], msg[1]
            if kind == "fetch":
                fetch = _Fetch()
                with self._lock:
                    self._fetches[fid] = fetch
                threading.Thread(target=self._run, args=(fid, fetch, *msg[2:]), daemon=True).start()
                continue
            with self._lock:
                fetch = self._fetches.get(fid)
            if fetch is None:
                continue  # already ended
            if kind == "cancel":
                fetch.cancelled = True
                fetch.answer.put(("drop",))
                if fetch.call is not None:
                    fetch.call.cancel()
            else:  # "block" or "drop": the answer to this fetch's AdapterInfo
                fetch.answer.put(msg[2:] if kind == "block" else ("drop",))

    def _run(self, fid, fetch: _Fetch, adapter_id, version, timeout, check: AdapterCheck | None):
        try:
            self._stream(fid, fetch, adapter_id, version, timeout, check)
        except grpc.RpcError as exc:
            name = "CANCELLED" if fetch.cancelled else exc.code().name
            self.send("error", fid, name, exc.details() or "")
        except _ProtocolError as exc:
            self.send("error", fid, PROTOCOL_ERROR, str(exc))
        except Exception as exc:  # reported, never swallowed: the service must hear an end
            log.exception("fetch %d of %r failed", fid, adapter_id)
            self.send("error", fid, "INTERNAL", f"{type(exc).__name__}: {exc}")
        finally:
            with self._lock:
                self._fetches.pop(fid, None)

    def _stream(self, fid, fetch: _Fetch, adapter_id, version, timeout, check):
        request = pb.FetchAdapterRequest(adapter_id=adapter_id, version=version)
        metadata = () if self._token is None else self._token.metadata()
        call = self._rpc(request, timeout=timeout, metadata=metadata)
        fetch.call = call
        if fetch.cancelled:
            call.cancel()
        view = info = None
        size = pos = 0
        for msg in call:
            if isinstance(msg, memoryview):
                chunk = msg
            elif msg.WhichOneof("payload") == "chunk":
                chunk = msg.chunk
            else:
                if view is not None:
                    raise _ProtocolError("the store sent AdapterInfo twice")
                if msg.info.size_bytes <= 0:
                    raise _ProtocolError("the store reports an empty adapter")
                info = msg.info
                self.send("info", fid, info.SerializeToString())
                answer = fetch.answer.get()
                if answer[0] == "drop":
                    call.cancel()
                    raise _ProtocolError("dropped by the service")
                offset, size = answer
                if size != msg.info.size_bytes or offset + size > len(self.arena):
                    raise _ProtocolError(f"block ({offset}, {size}) does not fit the adapter")
                view = self.arena[offset : offset + size]
                if self.populate is not None:
                    self.populate(offset, size)
                continue
            if view is None:
                raise _ProtocolError("the store sent bytes before AdapterInfo")
            end = pos + len(chunk)
            if end > size:
                raise _ProtocolError(f"the store sent more than the announced {size} bytes")
            np.copyto(view[pos:end], np.frombuffer(chunk, dtype=np.uint8))
            pos = end
        if view is None or pos != size:
            raise _ProtocolError(f"stream ended after {pos} of {size or '?'} bytes")
        result = None
        if check is not None:
            result = verdict(check, info.adapter_config_json, memoryview(view))
        self.send("done", fid, result)


class _ProtocolError(Exception):
    """The store's stream (or the service's answer) does not fit the protocol."""


def main(argv: list[str]) -> int:
    """argv: connection fd, arena fd, arena size, the store's StoreAccess as JSON
    (child_process.spawn)."""
    # The service owns this process's lifetime: it closes the connection, which ends serve(),
    # and its exit does too. A Ctrl-C or SIGTERM sent to the whole process group (a terminal,
    # a supervisor that signals every process of the service) is the service's to handle: it
    # stops this process after the fetches its draining requests wait for.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s fetch-worker %(levelname)s: %(message)s"
    )
    conn_fd, arena_fd, size = int(argv[0]), int(argv[1]), int(argv[2])
    access = StoreAccess.decode(argv[3])
    mapping = mmap.mmap(arena_fd, size)
    os.close(arena_fd)
    arena = np.frombuffer(mapping, dtype=np.uint8)
    populate = None
    if os.environ.get(MEMORY_ENV, "tuned") != "default":
        keep_freed_memory()
        populate = Populator(arena.ctypes.data)
    _Worker(access, arena, Connection(conn_fd), populate).serve()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
