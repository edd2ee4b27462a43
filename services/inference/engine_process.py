"""The engine process: the engine's step loop in a process of its own, apart from the gRPC server.

Why: in one process the step thread shares the GIL with the event loop that streams tokens,
serves RPCs and follows the store; every millisecond of that Python which falls between two
steps delays the next one. On the H200, 64 streams through gRPC with cold loads gave a decode
step p99 1.02-1.10x of the quiet step, against 1.03x for the engine alone
(bench/service_load.py, bench/adapter_load.py). Here the step thread's only neighbours are the
thread that reads commands, which sleeps in a socket read between them and only unpickles each
one into the engine's inbox, and the one that sends reports (ReportSender: the step thread
queues them, so that a service that stops reading for a while does not stop the steps). The
step thread applies the commands, between steps or while a step computes (Engine._drain:
adapter commands wait for a step's GPU time; commands that depend on each other keep their
order), so their Python does not compete with it for the GIL either.

The service keeps everything else: the registry, the host cache and its arena, the fetch
worker, the gRPC server. Adapter bytes do not travel: the arena is a memfd that this process
maps too (and page-locks on CUDA), and an "add" names a block of it. The service's side is
engine_client.RemoteEngine.

Protocol (pickled objects over a multiprocessing Connection on a socketpair):
  service -> engine: the EngineConfig, first
  engine -> service: ("ready", EngineInfo) | ("failed", message)
  service -> engine, each command numbered n = 1, 2, ... in the order sent:
    ("generate", n, GenerationRequest)    ("abort", n, request_id)
    ("add", n, key, offset, size, config_json, AdapterSpec)
    ("remove", n, key)    ("pin", n, key, pinned)    ("load", n, key)    ("stats", n)
    ("stop",)
  engine -> service: ("report", Report) after each turn of the step loop that has news;
    ("stopped", None | reason) last.
A Report's ``applied`` is a watermark: every command up to that number is applied, and its
adapter statuses reflect them all (the service decides from that when an adapter's host bytes
are free to reuse, engine_client.py). Every abort is confirmed, whether or not the request was
still running, so the service knows when its id may be used again. Stats ride along at most
every 50 ms, in the report of a turn that leaves the engine idle or changes its adapters while
idle, and in the first report that covers a "stats" command (GetStats wants them current).
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import NamedTuple

from services.inference.arena import SharedArena, map_shared
from services.inference.engine import gc_pacing
from services.inference.engine.adapter_manager import AdapterEntryStatus
from services.inference.engine.api import AdapterKey, EngineStats, GenerationOutput
from services.inference.engine.config import EngineConfig
from services.inference.engine.engine import Abort, CommandKind, Engine, Load, request_names
from services.inference.engine.errors import EngineError
from services.inference.engine.pool_sizing import EngineLimits
from store.peft import BaseModelShape

log = logging.getLogger(__name__)

_STATS_EVERY_S = 0.05  # a busy engine's stats reach the service this often
_POLL_S = 0.5  # the command reader checks this often that the step loop is still alive
# Reports the step thread may queue ahead of what the socket takes: a full batch's report is
# some 25 KB, so at most about 25 MB, 25-40 s of steps.
MAX_PENDING_REPORTS = 1024


class EngineInfo(NamedTuple):
    """What the service needs to know of the engine, sent once it is ready."""

    device: str
    base_shape: BaseModelShape
    pool_width: int  # elements per pool slot (kernels/lora_layout.py)
    plan_shape: BaseModelShape  # what an adapter's plan is laid out for: one rank's share
    page_size: int
    num_pages: int  # usable pages: an adapter needing more never fits
    arena_pinned: bool
    stats: EngineStats
    limits: EngineLimits  # max_num_seqs, max_queue, max_loras: derived by the engine if unset


class Report(NamedTuple):
    applied: int  # every command up to this number is applied
    outputs: list[tuple]  # GenerationOutput's fields in order: plain tuples pickle 8x faster
    errors: list[tuple[str, BaseException]]  # (request_id, why it was refused or ended)
    adapters: dict[AdapterKey, AdapterEntryStatus | None]  # changed; None = gone
    copies: list[tuple[AdapterKey, float]]  # host -> pool copies completed, seconds
    loaded: list[tuple[int, BaseException | None]]  # "load" commands answered
    aborted: list[str]  # request ids whose abort was applied
    stats: EngineStats | None


class _Command(NamedTuple):
    msg: tuple  # as the service sent it (see the protocol above)
    kind: CommandKind
    names: tuple  # the adapter or request ids it acts on (Engine._drain)


_KINDS = {
    "generate": CommandKind.REQUEST,
    "abort": CommandKind.ABORT,
    "add": CommandKind.ADAPTER,
    "remove": CommandKind.ADAPTER,
    "load": CommandKind.PLACEMENT,
    "pin": CommandKind.PLACEMENT,
    "stats": CommandKind.STATS,
}


def _command(msg: tuple) -> _Command:
    """The service's message as a step-loop command, classified once, when it arrives. An
    unknown one (only logged, by _apply) is held between steps, as adapter work is."""
    kind = _KINDS.get(msg[0])
    if kind is None:
        return _Command(msg, CommandKind.ADAPTER, ())
    if kind is CommandKind.REQUEST:
        return _Command(msg, kind, request_names(msg[2].adapter, msg[2].request_id))
    if kind is CommandKind.STATS:
        return _Command(msg, kind, ())
    return _Command(msg, kind, (msg[2],))  # abort: the request id; the others: the adapter


class ReportSender:
    """The step thread's reports, sent to the service on a thread of their own.

    A send blocks once the socket's buffer is full (some 200 KB on Linux: about eight steps of
    a full batch's tokens), and it fills whenever the service's event loop stops reading for
    longer than that (a full garbage collection of its heap, a burst of RPCs). Sent from the
    step thread between two launches, such a report kept the next step from launching and the
    GPU idled until the service read again (an experiment that stopped the service for 1 s with
    32 sequences decoding on the CPU: the engine ran 0.8 s, then stood still until the service
    went on). Queued here, reports wait in this process's memory while the step loop goes on.
    The queue holds at most ``max_pending``: a service slower than the engine for good still
    holds the engine back, as before (put() blocks).

    Invariants:
    - messages go out in the order put() took them, one thread sending;
    - once the connection broke (``gone``), messages are dropped, never block;
    - a message that cannot be pickled is logged and dropped (nothing of it was written), and
      the thread goes on: dead, it would leave put() to block for good once the queue filled
      (the errors a report carries are made portable first: ``portable``);
    - close() returns after every message put before it was sent or dropped.
    """

    def __init__(self, conn: Connection, max_pending: int = MAX_PENDING_REPORTS) -> None:
        self._conn = conn
        self._queue: queue.Queue[tuple | None] = queue.Queue(max_pending)
        self.gone = False
        self._thread = threading.Thread(target=self._run, name="engine-reports", daemon=True)
        self._thread.start()

    def put(self, msg: tuple) -> None:
        if not self.gone:
            self._queue.put(msg)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (msg := self._queue.get()) is not None:
            if self.gone:
                continue  # drained, so that put() never waits on a dead connection
            try:
                self._conn.send(msg)  # pickled whole before a byte is written
            except OSError:  # the service is gone; the command reader sees it and stops
                self.gone = True
            except Exception:
                log.exception("a %r message could not be sent to the service; dropped", msg[0])


def portable(exc: BaseException) -> BaseException:
    """``exc`` if it makes the trip to the service (pickled here, unpickled there), else an
    EngineError naming it: an exception whose attributes do not pickle, or whose class cannot be
    rebuilt from its args, would keep the whole report from the service (every request's
    tokens in it) or break the service's reader. The engine's own errors pass as they are."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        return EngineError(f"{type(exc).__name__}: {exc}")
    return exc


class ProcessEngine(Engine):
    """An Engine whose outputs and news go to the service over ``conn``."""

    def __init__(
        self, config: EngineConfig, conn: Connection, arena: SharedArena | None = None
    ) -> None:
        """``arena``: the service's host arena, mapped here (tensor-parallel workers map it
        too), where "add" commands name adapter bytes (serve() gives it)."""
        super().__init__(config, arena=arena)
        self._conn = conn
        self.arena = None if arena is None else arena.buffer
        # The step thread's alone, except after it stopped (the final report).
        self._applied = 0
        self._reported = 0
        self._outputs_out: list[tuple] = []
        self._errors: list[tuple[str, BaseException]] = []
        self._loaded: list[tuple[int, BaseException | None]] = []
        self._copies: list[tuple[AdapterKey, float]] = []
        self._failed_adds: dict[AdapterKey, None] = {}
        self._aborted: list[str] = []
        self._stats_wanted = 0  # the number of the latest "stats" command not yet answered
        self._stats_at = 0.0
        self._was_busy = False  # the engine had requests at the last report
        self._last_stats: EngineStats | None = None
        self._sender = ReportSender(conn)
        self.core.adapters.track_changes()
        self.add_load_listener(self._copied)

    # --- the command reader (main thread) ---------------------------------------------------

    def post(self, msg: tuple) -> None:
        """Queue a command from the service for the step thread, which applies it between steps
        or while a step computes (Engine._drain), so that its Python (validating a request,
        describing an adapter) never holds the GIL the step thread needs between its launches."""
        self._inbox.put(_command(msg))

    # --- the step thread ------------------------------------------------------------------

    def _apply(self, cmd: object) -> None:
        if not isinstance(cmd, _Command):
            super()._apply(cmd)
            return
        msg = cmd.msg
        kind, n = msg[0], msg[1]
        try:
            if kind == "generate":
                self._generate(msg[2])
            elif kind == "abort":
                self._aborted.append(msg[2])  # confirmed even if applying it fails: the id frees
                super()._apply(Abort(msg[2]))
            elif kind == "add":
                self._add(msg[2], self.arena[msg[3] : msg[3] + msg[4]], msg[5], msg[6])
            elif kind == "remove":
                self.core.remove_adapter(msg[2])
            elif kind == "pin":
                self.pin_adapter(msg[2], msg[3])
            elif kind == "load":
                super()._apply(Load(msg[2], lambda error: self._answer(n, error), msg[3]))
            elif kind == "stats":
                self._stats_wanted = n
            else:
                log.error("unknown command %r from the service", kind)
        except Exception:  # the service checked first: this is a bug, not bad input
            log.exception("command %s (%d) failed", kind, n)
        self._applied = max(self._applied, n)

    def _generate(self, request) -> None:
        try:
            self.core.add_request(request)
        except Exception as exc:  # invalid request, unknown adapter, overloaded: the caller's
            self._errors.append((request.request_id, portable(exc)))

    def _add(self, key, raw, config_json, spec) -> None:
        try:
            self.add_adapter(key, config_json, raw, spec=spec)
        except Exception:
            log.exception("adapter %s could not be added", key)
            self._failed_adds[key] = None

    def _fail_requests(self, errors: list[tuple[str, BaseException]]) -> None:
        self._errors.extend((rid, portable(exc)) for rid, exc in errors)

    def _answer(self, n: int, error: BaseException | None) -> None:
        self._loaded.append((n, None if error is None else portable(error)))

    def _copied(self, key: AdapterKey, seconds: float) -> None:
        self._copies.append((key, seconds))

    def _deliver(self, outputs: list[GenerationOutput]) -> None:
        self._outputs_out.extend(
            (o.request_id, o.token_ids, o.text, o.finish_reason, o.prompt_tokens,
             o.completion_tokens, o.logprobs)
            for o in outputs
        )  # fmt: skip

    def _iteration_done(self) -> None:
        self.report(final=False)

    def report(self, final: bool) -> None:
        """Send what happened since the last report, if anything did."""
        # Reports cover commands up to ``applied``, all applied: a held command keeps the
        # ones after it that were applied first from counting (Engine._drain). Held commands
        # stay in the order they arrived, so the first has the lowest number.
        first_held = next((cmd.msg[1] for cmd in self._held if isinstance(cmd, _Command)), None)
        applied = self._applied if first_held is None else min(self._applied, first_held - 1)
        outputs, self._outputs_out = self._outputs_out, []
        errors, self._errors = self._errors, []
        loaded, self._loaded = self._loaded, []
        copies, self._copies = self._copies, []
        failed, self._failed_adds = self._failed_adds, {}
        aborted, self._aborted = self._aborted, []
        adapters = self.core.adapters.take_changes()
        adapters.update(failed)
        stats = None
        now = time.monotonic()
        # A "stats" command is answered by the first report that covers it (its caller waits
        # for that one; with a command before it held, a report may not cover it yet).
        asked = 0 < self._stats_wanted <= applied
        # An idle engine's turns can be 0.5 s apart: the turn that leaves it idle, or that
        # changes its adapters while idle, sends stats at once (the last ones would stand until
        # the next turn). Other idle turns keep to the 50 ms pace.
        busy = self.core.has_work
        went_idle, self._was_busy = self._was_busy and not busy, busy
        idle_news = went_idle or (not busy and bool(adapters or copies or loaded))
        if final or asked or idle_news or now - self._stats_at >= _STATS_EVERY_S:
            self._stats_at = now
            current = self.core.stats()
            if current != self._last_stats or asked:
                stats = self._last_stats = current
            if asked:
                self._stats_wanted = 0
        news = outputs or errors or loaded or copies or adapters or aborted or stats is not None
        if not news and applied == self._reported:
            return
        self._reported = applied
        self._sender.put(("report", Report(applied, outputs, errors, adapters, copies, loaded,
                                           aborted, stats)))  # fmt: skip

    def close_reports(self) -> None:
        """After the final report: every report is sent (or the service is gone)."""
        self._sender.close()


def serve(conn: Connection, arena_fd: int, arena_bytes: int) -> int:
    config: EngineConfig = conn.recv()
    try:
        pinned = config.torch_device.type == "cuda"
        arena = SharedArena(arena_fd, map_shared(arena_fd, arena_bytes, pin=pinned))
        engine = ProcessEngine(config, conn, arena)  # tensor-parallel workers inherit the fd
        os.close(arena_fd)
    except Exception as exc:
        log.exception("the engine could not start")
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return 1
    core = engine.core
    info = EngineInfo(
        str(engine.device), core.base_shape, core.pool.width, core.plan_shape, config.page_size,
        core.pool.num_usable, pinned, core.stats(), core.limits,
    )  # fmt: skip
    gc_pacing.pace_collections()  # the step thread collects from now on
    conn.send(("ready", info))  # before the step loop, whose reports must come after it
    engine.start_blocking()
    reason = None
    try:
        while True:
            if not conn.poll(_POLL_S):
                if not engine.running:
                    reason = f"the engine step failed: {engine.failure!r}"
                    break
                continue
            msg = conn.recv()
            if msg[0] == "stop":
                break
            engine.post(msg)
    except (EOFError, OSError):  # the service is gone
        log.warning("the service closed the connection; stopping")
    engine.stop_blocking()
    gc_pacing.release()
    try:
        engine.report(final=True)
    except Exception:  # after a failed step the core may be inconsistent; still say why
        log.exception("the final report failed")
    engine.close_reports()
    try:
        conn.send(("stopped", reason))
    except OSError:
        pass
    return 0 if reason is None else 1


def main(argv: list[str]) -> int:
    """argv: connection fd, arena fd, arena size in bytes, log level (child_process.spawn)."""
    # The service owns this process's lifetime: it sends "stop", and its exit ends the
    # connection; a Ctrl-C or SIGTERM sent to the whole process group is the service's to
    # handle (it stops this process in order, after ending its streams).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(
        level=argv[3], format="%(asctime)s engine-process %(name)s %(levelname)s: %(message)s"
    )
    return serve(Connection(int(argv[0])), int(argv[1]), int(argv[2]))


if __name__ == "__main__":
    # Run the imported module's main, so that pickled types name their real module.
    from services.inference import engine_process

    sys.exit(engine_process.main(sys.argv[1:]))
