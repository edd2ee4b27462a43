"""RemoteEngine: the service's handle on the engine process (engine_process.py says why).

It offers what the servicer and the registry use of Engine, with the same errors. Owned by the
service's event loop: commands go out on the connection as they are called; the engine's
reports come back through the loop's reader and feed the request streams (the same
OutputRouter as the in-process engine), the LoadAdapter futures and a mirror of the adapters'
statuses, which answers the synchronous queries.

When may the service reuse an adapter's host bytes (adapter_releasable)? Only when the engine
has said so after applying every command that could make it read them: each command has a
number, each report carries a watermark (every command up to it is applied), and a key's
bytes are free only when the latest report covers the latest command that named the key,
shows no request using it and no copy reading it, and no LoadAdapter of it is unanswered. A
stale mirror can only say "not yet".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import subprocess
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable
from multiprocessing.connection import Connection
from typing import NamedTuple

import torch

from services.inference.arena import HostArena
from services.inference.child_process import spawn
from services.inference.engine.adapter_manager import (
    AdapterEntryStatus,
    AdapterState,
    AdapterStatus,
)
from services.inference.engine.adapter_spec import AdapterSpec, validate_and_describe
from services.inference.engine.api import (
    AdapterKey,
    EngineStats,
    GenerationOutput,
    GenerationRequest,
)
from services.inference.engine.config import EngineConfig
from services.inference.engine.engine import resolve
from services.inference.engine.errors import (
    DuplicateRequest,
    EngineStopped,
    InvalidRequest,
    ModelLoadError,
    UnknownAdapter,
)
from services.inference.engine.host_adapter import plan_for
from services.inference.engine.output_router import OutputRouter
from services.inference.engine.page_pool import pages_needed
from services.inference.engine.pool_sizing import EngineLimits
from services.inference.engine_process import EngineInfo, Report
from store.peft import BaseModelShape

log = logging.getLogger(__name__)

_STOP_TIMEOUT_S = 30.0


class _Intent(NamedTuple):
    """The service's latest add, remove or pin of a key, until a report covers it."""

    n: int
    present: bool
    pinned: bool | None  # None: as the engine last reported


class RemoteEngine:
    def __init__(
        self,
        config: EngineConfig,
        arena: HostArena,
        log_level: str = "INFO",
        on_exit: Callable[[str], None] | None = None,
        module: str = "services.inference.engine_process",
    ) -> None:
        """``on_exit(reason)`` is called on the event loop if the process ends unasked;
        ``module`` is what the process runs (a benchmark runs one that times every step)."""
        self.config = config
        self._module = module
        self._on_exit = on_exit
        self.arena = arena
        self._log_level = log_level
        self._proc: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._info: EngineInfo | None = None
        self._outputs = OutputRouter()
        self._sent = 0  # commands sent, numbered from 1
        self._applied = 0  # the latest command the engine reported applied
        self._named: dict[AdapterKey, int] = {}  # key -> latest command that named it
        self._reported: dict[AdapterKey, AdapterEntryStatus] = {}
        self._intents: dict[AdapterKey, _Intent] = {}
        self._loads: dict[int, tuple[AdapterKey, asyncio.Future]] = {}
        self._loading = Counter()  # keys with an unanswered "load"
        self._aborting = Counter()  # request ids with an unconfirmed abort
        self._stats_waiters: list[tuple[int, asyncio.Future]] = []
        self._copy_seconds: deque[float] = deque(maxlen=1024)
        self._listeners: list[Callable[[AdapterKey, float], None]] = []
        self._stats: EngineStats | None = None
        self._alive = False
        self._stopping = False  # stop() was called
        self._stopped = asyncio.Event()
        self._stop_reason = "the engine process is not running"

    # --- lifecycle --------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._alive

    async def start(self) -> None:
        """Start the process and wait until its model is loaded (ModelLoadError if it fails)."""
        if self._proc is not None:
            return
        self._proc, self._conn = spawn(self._module, self.arena, self._log_level)
        self._conn.send(self.config)
        log.info("engine process started (pid %d); loading the model", self._proc.pid)
        try:
            msg = await asyncio.to_thread(self._conn.recv)
        except (EOFError, OSError):
            msg = ("failed", f"the engine process exited with code {self._proc.wait()}")
        if msg[0] != "ready":
            await asyncio.to_thread(self._close)
            raise ModelLoadError(msg[1])
        self._info = msg[1]
        self._stats = self._info.stats
        if self._info.arena_pinned:
            self.arena.pinned = True  # page-locked in the engine process, which copies from it
        self._alive = True
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._conn.fileno(), self._readable)

    async def stop(self) -> None:
        """Requests still in flight end with EngineStopped; returns once the process exited."""
        if self._proc is None:
            return
        self._stopping = True
        if self._info is None and self._proc.poll() is None:
            self._proc.kill()  # still loading the model: nothing to end in order
        elif self._alive:
            self._post(("stop",))
            try:
                await asyncio.wait_for(self._stopped.wait(), _STOP_TIMEOUT_S)
            except TimeoutError:
                log.warning("the engine process did not stop in %.0f s: killed", _STOP_TIMEOUT_S)
                self._proc.kill()
        if self._conn is not None and self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._conn.fileno())
        await asyncio.to_thread(self._close)  # exited: nothing reads the arena any more
        self._teardown("the engine stopped")

    # --- adapters ---------------------------------------------------------------------------

    def add_adapter(
        self,
        key: AdapterKey,
        config_json: bytes | str | dict,
        weights: torch.Tensor,
        spec: AdapterSpec | None = None,
    ) -> None:
        """As Engine.add_adapter (the same errors, raised here); ``weights`` must be a block of
        the shared arena. The engine process describes the adapter over its own mapping."""
        if not isinstance(key, AdapterKey):
            raise TypeError("key must be an AdapterKey")
        self._check_running()
        if self.adapter_status(key) is not None:
            raise InvalidRequest(f"adapter {key} is already loaded; remove it first")
        offset = self._arena_offset(weights)
        info = self._info
        if spec is None or spec.total_size != weights.numel():
            spec = validate_and_describe(
                config_json, memoryview(weights.numpy()), info.base_shape,
                self.config.max_lora_rank,
            )  # fmt: skip
        plan = plan_for(spec, info.plan_shape, info.pool_width)
        need = pages_needed(plan.num_slots, info.page_size)
        if need > info.num_pages:
            raise InvalidRequest(
                f"adapter {key} needs {need} pool pages; the pool has {info.num_pages}"
            )
        n = self._send("add", key, offset, weights.numel(), config_json, spec, named=key)
        self._intents[key] = _Intent(n, True, None)

    def remove_adapter(self, key: AdapterKey) -> None:
        if self.adapter_status(key) is None:
            raise UnknownAdapter(f"adapter {key} is not loaded in this engine")
        self._intents[key] = _Intent(self._send("remove", key, named=key), False, None)

    def pin_adapter(self, key: AdapterKey, pinned: bool) -> None:
        if self.adapter_status(key) is None:
            raise UnknownAdapter(f"adapter {key} is not loaded in this engine")
        self._intents[key] = _Intent(self._send("pin", key, pinned, named=key), True, pinned)

    async def load_adapter(self, key: AdapterKey, pin: bool = False, if_free: bool = False) -> None:
        """As Engine.load_adapter: returns once the adapter is in the pool."""
        self._check_running()
        if pin:
            self.pin_adapter(key, True)
        elif self.adapter_status(key) is None:
            raise UnknownAdapter(f"adapter {key} is not loaded in this engine")
        future = self._loop.create_future()
        n = self._send("load", key, if_free, named=key)
        self._loads[n] = (key, future)
        self._loading[key] += 1
        # Shielded: a caller that gives up leaves the load registered until the engine answers,
        # so the adapter's bytes stay in use meanwhile (adapter_releasable).
        await asyncio.shield(future)

    def adapter_status(self, key: AdapterKey) -> AdapterStatus | None:
        entry = self._entry(key)
        if entry is None or entry.removed:
            return None
        return AdapterStatus(entry.state, entry.refs, entry.pinned)

    def adapter_in_pool(self, key: AdapterKey) -> bool:
        status = self.adapter_status(key)
        return status is not None and status.state is AdapterState.IN_POOL

    def adapter_releasable(self, key: AdapterKey) -> bool:
        if self._loading[key] or self._named.get(key, 0) > self._applied:
            return False
        reported = self._reported.get(key)
        return reported is None or reported.releasable

    def adapter_copy_seconds(self) -> list[float]:
        return list(self._copy_seconds)

    def add_load_listener(self, listener: Callable[[AdapterKey, float], None]) -> None:
        """``listener(key, seconds)`` runs on the event loop when a copy's report arrives."""
        self._listeners.append(listener)

    @property
    def base_shape(self) -> BaseModelShape:
        return self._require_info().base_shape

    @property
    def device(self) -> torch.device:
        return torch.device(self._require_info().device)

    # --- requests ---------------------------------------------------------------------------

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationOutput]:
        """As Engine.generate; the engine's refusal (InvalidRequest, UnknownAdapter, ...)
        is raised by the first iteration."""
        self._check_running()
        rid = request.request_id
        if self.request_in_use(rid):
            raise DuplicateRequest(f"request id {rid!r} is already in flight")
        outputs = self._outputs.open(rid)
        self._send("generate", request, named=request.adapter)
        follow = self._outputs.follow(rid, outputs, self.abort)
        async with contextlib.aclosing(follow):  # leaving early aborts now, not when collected
            async for item in follow:
                yield item

    def request_in_use(self, request_id: str) -> bool:
        """Whether generate() would refuse ``request_id`` as in flight: its stream is open, or
        its abort is not confirmed yet."""
        return self._outputs.is_open(request_id) or self._aborting[request_id] > 0

    def abort(self, request_id: str) -> None:
        """End a request; its id is in use until the engine confirms the abort."""
        if self._alive:
            self._aborting[request_id] += 1
            self._send("abort", request_id)

    async def sync_stats(self) -> None:
        """Wait for stats that reflect every command sent so far (GetStats)."""
        self._check_running()
        future = self._loop.create_future()
        self._stats_waiters.append((self._send("stats"), future))
        await future

    def stats(self) -> EngineStats:
        """The engine's stats as of its latest report (at most about 50 ms old while busy)."""
        return self._stats

    # --- internals --------------------------------------------------------------------------

    def _entry(self, key: AdapterKey) -> AdapterEntryStatus | None:
        """The reported status, overlaid with the service's own change not yet applied."""
        reported = self._reported.get(key)
        intent = self._intents.get(key)
        if intent is None or intent.n <= self._applied:
            return reported
        if not intent.present:
            return None
        if reported is None:
            reported = AdapterEntryStatus(AdapterState.HOST, 0, False, False)
        pinned = reported.pinned if intent.pinned is None else intent.pinned
        return reported._replace(removed=False, pinned=pinned)

    def _send(self, kind: str, *args, named: AdapterKey | None = None) -> int:
        """Send command number n (returned); ``named``: the adapter it may make the engine
        read, whose bytes then stay in use until a report covers n."""
        self._sent += 1
        n = self._sent
        if named is not None:
            self._named[named] = n
        self._post((kind, n, *args))
        return n

    def _post(self, msg: tuple) -> None:
        try:
            self._conn.send(msg)
        except (OSError, AttributeError):  # the process is gone; _readable reports it
            pass

    def _readable(self) -> None:
        try:
            while self._conn is not None and self._conn.poll(0):
                msg = self._conn.recv()
                if msg[0] == "report":
                    self._apply(msg[1])
                elif msg[0] == "stopped":
                    reason = msg[1] or "the engine stopped"
                    self._teardown(reason)
        except (EOFError, OSError):
            code = self._proc.poll() if self._proc is not None else None
            self._teardown(f"the engine process exited (code {code})")

    def _apply(self, report: Report) -> None:
        self._applied = report.applied
        for key, status in report.adapters.items():
            if status is None:
                self._reported.pop(key, None)
            else:
                self._reported[key] = status
        if self._intents:
            self._intents = {k: i for k, i in self._intents.items() if i.n > report.applied}
        if len(self._named) > 4 * len(self._reported) + 64:  # forget keys long settled
            self._named = {k: n for k, n in self._named.items() if n > report.applied}
        for key, seconds in report.copies:
            self._copy_seconds.append(seconds)
            for listener in self._listeners:
                listener(key, seconds)
        for n, error in report.loaded:
            key, future = self._loads.pop(n)
            self._loading[key] -= 1
            if not self._loading[key]:
                del self._loading[key]
            resolve(future, error)
        for rid in report.aborted:
            self._aborting[rid] -= 1
            if not self._aborting[rid]:
                del self._aborting[rid]
        if report.stats is not None:
            self._stats = report.stats
            waiting = []
            for n, future in self._stats_waiters:
                if n <= report.applied:
                    resolve(future, None)
                else:
                    waiting.append((n, future))
            self._stats_waiters = waiting
        items = [(row[0], GenerationOutput(*row)) for row in report.outputs]
        items.extend(report.errors)
        if items:
            self._outputs.post(items)

    def _teardown(self, reason: str) -> None:
        """The process stopped or died: every stream and load ends with EngineStopped."""
        if self._stopped.is_set():
            return
        unasked = self._alive and not self._stopping
        self._alive = False
        self._stop_reason = reason
        self._stopped.set()
        if self._conn is not None and self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._conn.fileno())
        level = logging.ERROR if unasked else logging.INFO
        log.log(level, "engine process: %s", reason)
        for future in [f for _, f in self._loads.values()] + [f for _, f in self._stats_waiters]:
            resolve(future, EngineStopped(reason))
        self._loads.clear()
        self._loading.clear()
        self._stats_waiters.clear()
        self._aborting.clear()
        # No request uses any adapter now: the host bytes are free.
        self._reported.clear()
        self._intents.clear()
        self._named.clear()
        self._outputs.post(
            (rid, EngineStopped(f"{reason}; request {rid} did not finish"))
            for rid in self._outputs.ids()
        )
        if unasked and self._on_exit is not None:
            self._on_exit(reason)

    def _close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._proc is not None:
            try:
                self._proc.wait(_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            log.info("engine process %d exited (code %s)", self._proc.pid, self._proc.returncode)

    def _check_running(self) -> None:
        if not self._alive:
            raise EngineStopped(f"the engine is not running ({self._stop_reason})")

    @property
    def limits(self) -> EngineLimits:
        """max_num_seqs and max_queue as the engine derived them (known once it is ready)."""
        return self._require_info().limits

    def _require_info(self) -> EngineInfo:
        if self._info is None:
            raise EngineStopped("the engine process has not started")
        return self._info

    def _arena_offset(self, weights: torch.Tensor) -> int:
        """Where ``weights`` lie in the arena: the engine process reads them there."""
        base = self.arena.buffer
        flat = isinstance(weights, torch.Tensor) and weights.dim() == 1
        if flat and weights.dtype == torch.uint8:
            offset = weights.data_ptr() - base.data_ptr()
            if 0 <= offset <= base.numel() - weights.numel():
                return offset
        raise TypeError("an engine in its own process takes adapter bytes from the host arena only")
