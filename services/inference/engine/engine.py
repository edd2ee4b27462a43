"""Engine: the asynchronous API over EngineCore.

The step loop runs on a dedicated thread, so an asyncio server on the caller's loop stays
responsive while a step computes. Callers talk to it through an inbox of commands (queue a
request, abort one) that the loop drains between steps; outputs travel back to each request's
asyncio.Queue with loop.call_soon_threadsafe.

    engine = Engine(EngineConfig(model_dir="..."))
    await engine.start()
    async for out in engine.generate(GenerationRequest("r1", prompt="Hello")):
        print(out.text, end="")
    await engine.stop()
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import NamedTuple

from services.inference.engine.api import (
    AdapterKey,
    EngineStats,
    GenerationOutput,
    GenerationRequest,
)
from services.inference.engine.config import EngineConfig
from services.inference.engine.core import EngineCore, LogitsHook
from services.inference.engine.errors import EngineStopped
from services.inference.engine.host_adapter import HostAdapter
from services.inference.engine.request import Sequence

log = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.5  # how long an idle loop blocks on the inbox before checking for stop
_STALLED_WAIT_S = 0.001  # pause when requests wait but nothing could run (an adapter copy)


class _Sink(NamedTuple):
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class _Enqueue(NamedTuple):
    seq: Sequence


class _Abort(NamedTuple):
    request_id: str


class Engine:
    def __init__(self, config: EngineConfig, logits_hook: LogitsHook | None = None) -> None:
        self.config = config
        self.core = EngineCore(config, logits_hook)
        self.tokenizer = self.core.tokenizer
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, _Sink] = {}
        self._sinks_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._failure: BaseException | None = None

    # --- lifecycle --------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping.is_set()

    async def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._loop, name="engine-step-loop", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Stop the loop; requests still in flight end with EngineStopped, their pages freed."""
        if self._thread is None:
            return
        self._stopping.set()
        self._inbox.put(None)  # wake an idle loop
        await asyncio.to_thread(self._thread.join)

    # --- adapters ---------------------------------------------------------------------------

    def add_adapter(
        self, key: AdapterKey, config_json: bytes | str | dict, weights: bytes | memoryview
    ) -> HostAdapter:
        return self.core.add_adapter(key, config_json, weights)

    def add_adapter_dir(self, key: AdapterKey, path: str | Path) -> HostAdapter:
        return self.core.add_adapter_dir(key, path)

    def remove_adapter(self, key: AdapterKey) -> None:
        self.core.remove_adapter(key)
        self._inbox.put(None)  # the loop frees its pages once no request uses it

    # --- requests ---------------------------------------------------------------------------

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationOutput]:
        """Stream the request's outputs; the last one has a finish_reason. Leaving the loop
        early (break, cancellation) aborts the request."""
        if not self.running:
            raise EngineStopped("the engine is not running; call start() first")
        seq = self.core.prepare(request)  # raises before anything is queued
        sink = _Sink(asyncio.get_running_loop(), asyncio.Queue())
        with self._sinks_lock:
            self._sinks[request.request_id] = sink
        self._inbox.put(_Enqueue(seq))
        done = False
        try:
            while True:
                item = await sink.queue.get()
                if isinstance(item, BaseException):
                    done = True
                    raise item
                done = item.finished
                yield item
                if done:
                    return
        finally:
            with self._sinks_lock:
                self._sinks.pop(request.request_id, None)
            if not done:
                self.abort(request.request_id)

    def abort(self, request_id: str) -> None:
        """End a request; its pages are freed before the next step."""
        self._inbox.put(_Abort(request_id))

    def stats(self) -> EngineStats:
        return self.core.stats()

    # --- the step loop (its own thread) -----------------------------------------------------

    def _loop(self) -> None:
        core = self.core
        try:
            while not self._stopping.is_set():
                if not core.has_work:
                    self._drain(timeout=_IDLE_WAIT_S)
                elif not core.last_step_ran:
                    self._drain(timeout=_STALLED_WAIT_S)
                else:
                    self._drain(timeout=None)
                if core.has_work and not self._stopping.is_set():
                    self._deliver(core.step())
                elif not core.has_work:
                    core.adapters.reap()
        except BaseException as e:  # a failed step must not leave callers waiting forever
            log.exception("engine step loop failed")
            self._failure = e
        finally:
            self._stopping.set()
            self._shutdown()

    def _drain(self, timeout: float | None) -> None:
        """Apply the inbox's commands; with a timeout, wait that long for the first one."""
        try:
            cmd = self._inbox.get(timeout=timeout) if timeout else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if isinstance(cmd, _Enqueue):
                self.core.enqueue(cmd.seq)
            elif isinstance(cmd, _Abort):
                out = self.core.abort(cmd.request_id)
                if out is not None:
                    self._deliver([out])
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _deliver(self, outputs: list[GenerationOutput]) -> None:
        for out in outputs:
            self._send(out.request_id, out)

    def _send(self, request_id: str, item: GenerationOutput | BaseException) -> None:
        with self._sinks_lock:
            sink = self._sinks.get(request_id)
        if sink is None:
            return  # the caller went away; its abort is in the inbox
        try:
            sink.loop.call_soon_threadsafe(sink.queue.put_nowait, item)
        except RuntimeError:  # the caller's event loop is closed
            pass

    def _shutdown(self) -> None:
        """Free every request's pages and end every stream."""
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(cmd, _Enqueue):
                self.core.enqueue(cmd.seq)
        try:
            self.core.abort_all()
        except Exception:  # after a failed step the core may be inconsistent; streams still end
            log.exception("could not abort the requests in flight")
        with self._sinks_lock:
            ids = list(self._sinks)
        reason = "the engine stopped" if self._failure is None else "the engine step failed"
        for rid in ids:
            err = EngineStopped(f"{reason}; request {rid} did not finish")
            if self._failure is not None:
                err.__cause__ = self._failure
            self._send(rid, err)
