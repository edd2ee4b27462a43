"""Engine: the asynchronous API over EngineCore.

The step loop runs on a dedicated thread, so an asyncio server on the caller's loop stays
responsive while a step computes. Callers talk to it through an inbox of commands (queue a
request, abort one, load an adapter into the pool) that the loop drains between steps and while
a step's GPU work runs (_drain says which command where); outputs
travel back to each request's asyncio.Queue through the OutputRouter (one
loop.call_soon_threadsafe per event loop per step), a load's answer to its future.

    engine = Engine(EngineConfig(model_dir="..."))
    await engine.start()
    async for out in engine.generate(GenerationRequest("r1", prompt="Hello")):
        print(out.text, end="")
    await engine.stop()
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import queue
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import NamedTuple

import torch

from services.inference.arena import SharedArena
from services.inference.engine.adapter_manager import AdapterState, AdapterStatus
from services.inference.engine.adapter_spec import AdapterSpec
from services.inference.engine.api import (
    AdapterKey,
    EngineStats,
    GenerationOutput,
    GenerationRequest,
)
from services.inference.engine.config import EngineConfig
from services.inference.engine.core import EngineCore, LogitsHook, load_failed
from services.inference.engine.errors import EngineStopped, PoolBusy, UnknownAdapter
from services.inference.engine.gc_pacing import collect_if_due, release
from services.inference.engine.host_adapter import HostAdapter
from services.inference.engine.output_router import OutputRouter
from services.inference.engine.pool_sizing import EngineLimits
from services.inference.engine.request import Sequence
from store.peft import BaseModelShape

log = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.5  # how long an idle loop blocks on the inbox before checking for stop
# Preloads (Load.if_free) leave at least this share of the pool's pages free: the pool serves
# KV first, and an adapter a preload placed is evicted, idle, when KV needs its pages.
PRELOAD_FREE_SHARE = 0.5
_STALLED_WAIT_S = 0.001  # pause when requests wait but nothing could run (an adapter copy)


class Phase(enum.Enum):
    """Where the step loop applies commands while steps run (Engine._drain)."""

    BETWEEN = "between steps"  # before the next launch (the step launched last may still run)
    DURING = "during a step"  # right after a launch: that step's GPU work is queued


class CommandKind(enum.Enum):
    """What a command does, which decides where it applies and what must not overtake it."""

    REQUEST = "request"  # a new request
    ABORT = "abort"
    ADAPTER = "adapter"  # add or remove one (engine_process.py): its requests come after it
    PLACEMENT = "placement"  # load or pin one: its requests need not wait for it
    STATS = "stats"  # a stats query (engine_process.py): costs nothing, applies anywhere


def _applies(kind: CommandKind, phase: Phase) -> bool:
    """Whether a command of ``kind`` is applied in ``phase`` (Engine._drain)."""
    if phase is Phase.DURING:
        return kind is not CommandKind.ABORT
    return kind not in (CommandKind.ADAPTER, CommandKind.PLACEMENT)


# The step loop's commands (its inbox). Each tells its kind and the names (adapter keys,
# request ids) it acts on, which Engine._drain reads; engine_process.py's commands tell the
# same, classified once as they arrive.


def request_names(adapter: AdapterKey | None, request_id: str) -> tuple:
    """What a new request names: its adapter (if any) and its id."""
    return (request_id,) if adapter is None else (adapter, request_id)


class Enqueue(NamedTuple):
    seq: Sequence
    kind = CommandKind.REQUEST

    @property
    def names(self) -> tuple:
        return request_names(self.seq.adapter, self.seq.request_id)


class Abort(NamedTuple):
    request_id: str
    kind = CommandKind.ABORT

    @property
    def names(self) -> tuple:
        return (self.request_id,)


class Load(NamedTuple):
    key: AdapterKey
    done: Callable[[BaseException | None], None]  # called once, on the step thread
    if_free: bool = False  # a preload: free room only (PRELOAD_FREE_SHARE), or PoolBusy
    kind = CommandKind.PLACEMENT

    @property
    def names(self) -> tuple:
        return (self.key,)


def resolve(future: asyncio.Future, error: BaseException | None) -> None:
    """Complete ``future`` with None or ``error``, unless its caller gave up (cancelled)."""
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
        future.exception()  # retrieved: a caller that left leaves no "never retrieved" warning


class Engine:
    def __init__(
        self,
        config: EngineConfig,
        logits_hook: LogitsHook | None = None,
        arena: SharedArena | None = None,
    ) -> None:
        self.config = config
        self.core = EngineCore(config, logits_hook, arena)
        self.tokenizer = self.core.tokenizer
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._outputs = OutputRouter()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._failure: BaseException | None = None
        self._loads: list[Load] = []  # LoadAdapter calls waiting for their copy (step thread)
        self._held: deque = deque()  # commands taken from the inbox, applied by a later drain
        self._preload_reserve = int(self.core.pool.num_pages * PRELOAD_FREE_SHARE)

    # --- lifecycle --------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping.is_set()

    @property
    def failure(self) -> BaseException | None:
        """Why the step loop died, if it did."""
        return self._failure

    async def start(self) -> None:
        self.start_blocking()

    async def stop(self) -> None:
        """Stop the loop; requests still in flight end with EngineStopped, their pages freed."""
        await asyncio.to_thread(self.stop_blocking)

    def stop_blocking(self) -> None:
        """stop() for a caller without an event loop: returns once the loop has ended."""
        if self._thread is None:
            return
        self._stopping.set()
        self._inbox.put(None)  # wake an idle loop
        self._thread.join()

    def start_blocking(self) -> None:
        """start() for a caller without an event loop."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="engine-step-loop", daemon=True)
            self._thread.start()

    # --- adapters ---------------------------------------------------------------------------

    def add_adapter(
        self,
        key: AdapterKey,
        config_json: bytes | str | dict,
        weights: bytes | memoryview | torch.Tensor,
        spec: AdapterSpec | None = None,
    ) -> HostAdapter:
        return self.core.add_adapter(key, config_json, weights, spec)

    def add_adapter_dir(self, key: AdapterKey, path: str | Path) -> HostAdapter:
        return self.core.add_adapter_dir(key, path)

    def remove_adapter(self, key: AdapterKey) -> None:
        self.core.remove_adapter(key)
        self._inbox.put(None)  # the loop frees its pages once no request uses it

    async def load_adapter(self, key: AdapterKey, pin: bool = False, if_free: bool = False) -> None:
        """Place an added adapter in the pool now; returns once its copy completed. ``pin``
        keeps it there (never evicted) until pin_adapter(key, False). UnknownAdapter if absent.
        ``if_free`` (a preload): only into free pages and a free index row, leaving
        PRELOAD_FREE_SHARE of the pool's pages free, evicting nothing; PoolBusy when there is
        no such room now."""
        if not self.running:
            raise EngineStopped("the engine is not running; call start() first")
        if pin:
            self.core.adapters.set_pinned(key, True)
        elif self.core.adapters.status(key) is None:
            raise UnknownAdapter(f"adapter {key} is not loaded in this engine")
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        done = lambda error: loop.call_soon_threadsafe(resolve, future, error)  # noqa: E731
        self._inbox.put(Load(key, done, if_free))
        await future

    def pin_adapter(self, key: AdapterKey, pinned: bool) -> None:
        self.core.adapters.set_pinned(key, pinned)

    def adapter_status(self, key: AdapterKey) -> AdapterStatus | None:
        """State (host, loading, in the pool), requests using it, pinned; None if absent."""
        return self.core.adapters.status(key)

    def adapter_in_pool(self, key: AdapterKey) -> bool:
        status = self.core.adapters.status(key)
        return status is not None and status.state is AdapterState.IN_POOL

    def adapter_releasable(self, key: AdapterKey) -> bool:
        """Whether the host bytes given to add_adapter(key) are unused now (see core)."""
        return self.core.adapters.releasable(key)

    @property
    def base_shape(self) -> BaseModelShape:
        """The base model's module shapes, which adapters must fit."""
        return self.core.base_shape

    def adapter_copy_seconds(self) -> list[float]:
        """Durations of the recent host -> pool copies, oldest first."""
        return list(self.core.adapters.copy_seconds)

    def add_load_listener(self, listener: Callable[[AdapterKey, float], None]) -> None:
        """``listener(key, seconds)`` runs on the step thread after each host -> pool copy."""
        self.core.adapters.load_listeners.append(listener)

    @property
    def device(self) -> torch.device:
        return self.core.device

    @property
    def limits(self) -> EngineLimits:
        """max_num_seqs, max_queue and max_loras as the engine derived them (engine_limits)."""
        return self.core.limits

    # --- requests ---------------------------------------------------------------------------

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationOutput]:
        """Stream the request's outputs; the last one has a finish_reason. Leaving the loop
        early (break, cancellation) aborts the request."""
        if not self.running:
            raise EngineStopped("the engine is not running; call start() first")
        seq = self.core.prepare(request)  # raises before anything is queued
        outputs = self._outputs.open(request.request_id)
        self._inbox.put(Enqueue(seq))
        follow = self._outputs.follow(request.request_id, outputs, self.abort)
        async with contextlib.aclosing(follow):  # leaving early aborts now, not when collected
            async for item in follow:
                yield item

    def request_in_use(self, request_id: str) -> bool:
        """Whether generate() would refuse ``request_id`` as in flight: its stream is open, or
        its request not yet ended (an abort the step thread has not applied yet)."""
        return self._outputs.is_open(request_id) or self.core.in_flight(request_id)

    def abort(self, request_id: str) -> None:
        """End a request; its pages are freed before the next step."""
        self._inbox.put(Abort(request_id))

    def stats(self) -> EngineStats:
        return self.core.stats()

    async def sync_stats(self) -> None:
        """Make stats() current: it always is here (RemoteEngine's must ask its process)."""

    # --- the step loop (its own thread) -----------------------------------------------------

    def _loop(self) -> None:
        """Launch step t + 1, then finish step t: the host reads step t's tokens, detokenizes
        and delivers them (and applies commands) while the GPU computes step t + 1, whose
        inputs from step t it reads on the device (EngineCore.launch)."""
        core = self.core
        inflight = None  # the step launched last, not finished yet
        try:
            while not self._stopping.is_set():
                if inflight is not None or (core.has_work and core.last_step_ran):
                    self._drain(timeout=None, phase=Phase.BETWEEN)  # steps are running: never wait
                elif core.has_work or self._loads:
                    self._drain(timeout=_STALLED_WAIT_S)  # only copies to wait for
                else:
                    self._drain(timeout=_IDLE_WAIT_S)
                core.check_workers()
                self._advance_loads()
                launched = None
                if core.has_work and not self._stopping.is_set():
                    launched = core.launch(during=self._during_step)
                elif not core.has_work and inflight is None:
                    core.adapters.issue_loads()  # LoadAdapter's, with no step to overlap
                    core.adapters.reap()
                    collect_if_due()  # idle: garbage must not pile up while no step runs
                if inflight is not None:
                    self._deliver(core.finish(inflight))
                inflight = launched
                self._take_load_failures()
                self._iteration_done()
            if inflight is not None:  # its tokens are dropped: every request ends below
                core.finish(inflight)
        except BaseException as e:  # a failed step must not leave callers waiting forever
            log.exception("engine step loop failed")
            self._failure = e
        finally:
            self._stopping.set()
            self._shutdown()
            if self._failure is not None:
                release()  # nothing paces collections any more: CPython's own come back

    def _drain(self, timeout: float | None, phase: Phase | None = None) -> None:
        """Apply the held commands, then the inbox's, in order; with a timeout and nothing held,
        wait that long for the first one. ``phase``: while steps run, a command is applied only
        where it costs the coming launch no time or must be: DURING (right after a launch, while
        the GPU computes) takes every command but an abort, which waits for the drain before the
        next launch, whose schedule is what uses the pages it frees; BETWEEN (before the next
        launch, the step launched last possibly still on the GPU) takes only new requests,
        aborts and stats queries, which cost it nothing or change the coming batch. Freeing a
        launched step's pages is safe in either phase: anything that reuses them is queued on
        the GPU after that step (an adapter copy's side stream waits for it), and the step's
        token for a sequence that ended is dropped when it is read (EngineCore.finish). A
        command a phase does not take is held for the next drain, and so is
        every later one that names what it names (a request for the adapter an add brings, the
        abort of a held request), and during a step every new request behind a held abort
        (in the engine process, where a request's checks run when it is applied, the abort may
        free the queue slot it needs; the request still joins the next step):
        commands that depend on each other keep their order. A held load or pin holds no
        request for its adapter (the request loads the adapter itself if need be): between
        steps the adapter commands behind it are held anyway, and during a step it is held
        only behind a command that names its adapter already."""
        held, self._held = self._held, deque()
        blocked: set = set()  # names of held commands that no later command may overtake
        after_abort = False  # an abort is held in this drain, during a step
        first = not held
        try:
            while True:
                if held:
                    cmd = held.popleft()
                else:
                    try:
                        wait = timeout if first else None
                        cmd = self._inbox.get(timeout=wait) if wait else self._inbox.get_nowait()
                    except queue.Empty:
                        return
                    first = False
                if cmd is None:  # only wakes the loop (stop_blocking, remove_adapter)
                    continue
                if phase is None:  # no step runs: everything applies
                    self._apply(cmd)
                    continue
                kind, named = cmd.kind, cmd.names
                if (
                    not _applies(kind, phase)
                    or not blocked.isdisjoint(named)
                    or (after_abort and kind is CommandKind.REQUEST)
                ):
                    self._held.append(cmd)
                    if kind is not CommandKind.PLACEMENT:  # see the docstring
                        blocked.update(named)
                    after_abort = after_abort or (
                        kind is CommandKind.ABORT and phase is Phase.DURING
                    )
                else:
                    self._apply(cmd)
        finally:  # a command that raised must not lose those still held behind it
            self._held.extend(held)

    def _apply(self, cmd: object) -> None:
        if isinstance(cmd, Enqueue):
            self.core.enqueue(cmd.seq)
        elif isinstance(cmd, Abort):
            out = self.core.abort(cmd.request_id)
            if out is not None:
                self._deliver([out])
        elif isinstance(cmd, Load):
            self._loads.append(cmd)

    def _during_step(self) -> None:
        self._drain(timeout=None, phase=Phase.DURING)

    def _advance_loads(self) -> None:
        """Start the copies LoadAdapter asked for (when there is room) and answer the callers
        whose copy completed."""
        if not self._loads:
            return
        adapters = self.core.adapters
        adapters.poll_loads()
        waiting = []
        for job in self._loads:
            status = adapters.status(job.key)
            if status is None:
                job.done(UnknownAdapter(f"adapter {job.key} was removed while it loaded"))
                continue
            if status.state is AdapterState.IN_POOL:
                job.done(None)
                continue
            if status.state is AdapterState.HOST:
                running = len(self.core.scheduler.running)
                if not job.if_free:
                    adapters.begin_load(job.key, reserve=running)
                elif not adapters.begin_load(
                    job.key, reserve=max(running, self._preload_reserve), evict=False
                ):
                    job.done(PoolBusy(f"no free room in the page pool for adapter {job.key} now"))
                    continue
            waiting.append(job)
        self._loads = waiting

    def _take_load_failures(self) -> None:
        """End the requests and LoadAdapter calls waiting for an adapter whose copy failed, and
        the requests a step failed."""
        errors, failed = self.core.take_load_failures()
        errors += self.core.take_step_failures()  # non-finite logits, a failing detokenizer
        if errors:
            self._fail_requests(errors)
        if failed:
            waiting = []
            for job in self._loads:
                if job.key in failed:
                    job.done(load_failed(job.key, failed[job.key]))
                else:
                    waiting.append(job)
            self._loads = waiting

    def _deliver(self, outputs: list[GenerationOutput]) -> None:
        self._outputs.post((out.request_id, out) for out in outputs)

    def _fail_requests(self, errors: list[tuple[str, BaseException]]) -> None:
        self._outputs.post(errors)

    def _iteration_done(self) -> None:
        """Called on the step thread after each turn of the loop; engine_process.py reports
        to the service here."""

    def _shutdown(self) -> None:
        """Free every request's pages and end every stream (loads still queued included)."""
        try:
            self._drain(timeout=None)
            self.core.abort_all()
        except Exception:  # after a failed step the core may be inconsistent; streams still end
            log.exception("could not abort the requests in flight")
        ids = self._outputs.ids()
        reason = "the engine stopped" if self._failure is None else "the engine step failed"
        self.core.step_log.close()
        for job in self._loads:
            job.done(EngineStopped(reason))
        self._loads = []
        errors = []
        for rid in ids:
            err = EngineStopped(f"{reason}; request {rid} did not finish")
            if self._failure is not None:
                err.__cause__ = self._failure
            errors.append((rid, err))
        self._outputs.post(errors)
        try:
            self.core.close()  # the tensor-parallel workers, if any
        except Exception:  # the streams have ended; a worker that will not stop is killed
            log.exception("could not stop the tensor-parallel workers")
