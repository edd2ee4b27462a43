"""AdapterManager: where each adapter lives (host, loading, in the pool) and its LoRA index row.

States, one per adapter:
    HOST     weights in host memory only (pinned on CUDA)
    LOADING  pool pages and an index row taken; the host->pool copy prepared, then issued (on
             CUDA on a side stream, completion marked by an event)
    IN_POOL  the copy completed: requests using the adapter may join a step
begin_load() moves HOST -> LOADING, poll_loads() LOADING -> IN_POOL once the copy is done (on CPU
at once), evict moves IN_POOL -> HOST. A copy that fails (a device allocation, a bug) moves
LOADING -> HOST with its pages and row given back; the adapter is not copied again until
take_failed_loads() has reported it (the engine then ends the requests waiting for it). The
scheduler admits a request only when its adapter is IN_POOL, so a load never stalls the
requests already running. The copy itself is
adapter_copy.py's: on CUDA begin_load() prepares it and issue_loads(), called once the step's
GPU work is queued (at once when no step runs), issues it on a side stream (a fraction of a
millisecond of the step thread's time each, spent while the GPU computes, within a budget per
step: the others wait for the next step, keeping their pages and rows); the transfer runs while
later steps compute.

Invariant: an adapter with refs > 0 (a request that uses it is queued or running) or pinned is
never evicted by evict_idle(). Only evict_queued() (the scheduler's choice: KV needs the pages,
no running request uses the adapter, and its queued ones wait far back) and evict_for_stall()
(nothing runs and the queue's head cannot start) may take one that queued requests wait for,
never a pinned one.
An adapter's host bytes may be released by their owner only when releasable(): no request uses
it and no copy reads them.

Threads: add/remove/acquire/release may be called from any thread (the engine's API);
everything that touches the pool runs on the engine's step thread. One lock guards the table.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

import torch

from kernels import LoraIndex
from kernels.lora_layout import NUM_MODULES
from services.inference.engine.adapter_copy import AdapterCopier, CopyTicket
from services.inference.engine.errors import UnknownAdapter
from services.inference.engine.host_adapter import HostAdapter
from services.inference.engine.page_pool import PagePool, pages_needed

log = logging.getLogger(__name__)


class AdapterState(enum.Enum):
    HOST = "host"
    LOADING = "loading"
    IN_POOL = "in_pool"


class AdapterStatus(NamedTuple):
    state: AdapterState
    refs: int  # requests queued or running with it
    pinned: bool


def _releasable(refs: int, state: AdapterState) -> bool:
    """No request uses the adapter and no copy reads its host bytes."""
    return refs == 0 and state is not AdapterState.LOADING


class AdapterEntryStatus(NamedTuple):
    """An entry as take_changes() reports it: a removed one still counts while in use."""

    state: AdapterState
    refs: int
    pinned: bool
    removed: bool

    @property
    def releasable(self) -> bool:
        return _releasable(self.refs, self.state)


@dataclass
class AdapterEntry:
    host: HostAdapter
    state: AdapterState = AdapterState.HOST
    refs: int = 0  # requests queued or running with this adapter
    row: int | None = None  # LoRA index row while LOADING or IN_POOL
    ready: CopyTicket | None = None  # the host->pool copy while LOADING
    last_used: int = 0  # step clock of the latest step that used it (LRU)
    removed: bool = False  # remove_adapter() was called; dropped once refs reach 0
    pinned: bool = False  # never evicted from the pool (LoadAdapter with pin)


def new_lora_index(max_loras: int, slot_capacity: int, device: torch.device) -> LoraIndex:
    """An empty LoRA index: ``max_loras`` rows of ``slot_capacity`` slots."""
    return LoraIndex(
        slot_table=torch.zeros(max_loras, slot_capacity, dtype=torch.int32, device=device),
        ranks=torch.zeros(max_loras, NUM_MODULES, dtype=torch.int32, device=device),
        a_offsets=torch.zeros(max_loras, NUM_MODULES, dtype=torch.int32, device=device),
        b_offsets=torch.zeros(max_loras, NUM_MODULES, dtype=torch.int32, device=device),
        scales=torch.zeros(max_loras, NUM_MODULES, dtype=torch.float32, device=device),
    )


class AdapterManager:
    def __init__(self, pool: PagePool, max_loras: int, slot_capacity: int) -> None:
        self.pool = pool
        dev = pool.tensor.device
        self.index = new_lora_index(max_loras, slot_capacity, dev)
        self._free_rows = list(range(max_loras - 1, -1, -1))
        # Host copy of each index row's largest rank (0 = free): the model runner picks the
        # step's kernel path from it without reading the device. And of the modules each row's
        # adapter has (bit m: module m), from which a step lists the modules in use.
        self.row_ranks = [0] * max_loras
        self.row_modules = [0] * max_loras
        self._entries: dict[Hashable, AdapterEntry] = {}
        # Kept beside the table so the per-step reap() and poll_loads() touch only these,
        # not every registered adapter.
        self._loading: set[Hashable] = set()
        self._unissued: list[CopyTicket] = []  # prepared copies (step thread)
        self._removed: set[Hashable] = set()
        # Adapters whose copy failed, and why: not copied again until take_failed_loads().
        self._failed: dict[Hashable, BaseException] = {}
        self._lock = threading.Lock()
        self._clock = 0
        # evict_idle's order of the idle adapters, least recently used first, as of _clock
        self._evict_order: deque | None = None
        self._evict_clock = -1
        self.copier = AdapterCopier(pool.tensor, self.index)
        self.loads = self.evictions = 0
        self.queued_evictions = 0  # of those, adapters that queued requests wait for (KV's)
        self.copy_seconds: deque[float] = deque(maxlen=1024)  # recent host->pool copies
        # Called on the step thread with (key, seconds) when a copy completes.
        self.load_listeners: list[Callable[[Hashable, float], None]] = []
        # Keys whose status changed since take_changes(); None = not tracked (only an engine
        # in its own process reports them: services/inference/engine_process.py).
        self._changed: set[Hashable] | None = None

    # --- any thread -------------------------------------------------------------------------

    def pages_of(self, host: HostAdapter) -> int:
        return pages_needed(host.plan.num_slots, self.pool.page_size)

    def add(self, host: HostAdapter) -> bool:
        """Register an adapter in host memory; False if the key is already registered. A key
        removed but not yet reaped comes back to life with the new bytes (an adapter version
        is immutable, so the pages it may still hold are the same)."""
        with self._lock:
            entry = self._entries.get(host.key)
            if entry is not None and not entry.removed:
                return False  # refused: nothing changed
            self._mark(host.key)
            if entry is None:
                self._entries[host.key] = AdapterEntry(host)
                return True
            # A copy in flight still reads the old bytes: they stay in use while the entry is
            # LOADING (releasable() is False).
            entry.host, entry.removed = host, False
            self._removed.discard(host.key)
            return True

    def remove(self, key: Hashable) -> None:
        """Forget the adapter: new requests cannot use it; its pages are freed by reap() once
        the requests already using it are done."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.removed:
                raise UnknownAdapter(f"adapter {key} is not loaded in this engine")
            entry.removed = True
            self._mark(key)
            if entry.refs == 0 and entry.state is AdapterState.HOST:
                del self._entries[key]
            else:
                self._removed.add(key)

    def acquire(self, key: Hashable) -> HostAdapter:
        """Count one more request using ``key`` (UnknownAdapter if absent or removed)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.removed:
                raise UnknownAdapter(f"adapter {key} is not loaded in this engine")
            entry.refs += 1
            self._mark(key)
            return entry.host

    def release(self, key: Hashable) -> None:
        with self._lock:
            entry = self._entries[key]
            if entry.refs <= 0:
                raise AssertionError(f"adapter {key} released more often than acquired")
            entry.refs -= 1
            self._mark(key)

    def get(self, key: Hashable) -> HostAdapter | None:
        with self._lock:
            entry = self._entries.get(key)
            return None if entry is None or entry.removed else entry.host

    def status(self, key: Hashable) -> AdapterStatus | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.removed:
                return None
            return AdapterStatus(entry.state, entry.refs, entry.pinned)

    def releasable(self, key: Hashable) -> bool:
        """True when the adapter's host bytes are not needed now: no request uses it and no
        copy reads them (the adapter must then be removed before the bytes are reused)."""
        with self._lock:
            entry = self._entries.get(key)
            return entry is None or _releasable(entry.refs, entry.state)

    def set_pinned(self, key: Hashable, pinned: bool) -> None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.removed:
                raise UnknownAdapter(f"adapter {key} is not loaded in this engine")
            entry.pinned = pinned
            self._mark(key)

    def state_counts(self) -> dict[AdapterState, int]:
        with self._lock:
            counts = dict.fromkeys(AdapterState, 0)
            for entry in self._entries.values():
                counts[entry.state] += 1
            return counts

    def track_changes(self) -> None:
        """From now on remember which adapters' status changed, for take_changes()."""
        with self._lock:
            self._changed = set()

    def take_changes(self) -> dict[Hashable, AdapterEntryStatus | None]:
        """Each adapter whose status changed since the last call: its status, removed ones
        included, or None once it is gone from the table."""
        with self._lock:
            changed, self._changed = self._changed, set()
            out = {}
            for key in changed:
                e = self._entries.get(key)
                out[key] = (
                    None if e is None else AdapterEntryStatus(e.state, e.refs, e.pinned, e.removed)
                )
            return out

    # --- step thread ------------------------------------------------------------------------

    def state(self, key: Hashable) -> AdapterState:
        return self._entries[key].state

    def row(self, key: Hashable) -> int:
        row = self._entries[key].row
        if row is None:
            raise AssertionError(f"adapter {key} has no LoRA index row")
        return row

    def touch(self, keys: Iterable[Hashable]) -> None:
        self._clock += 1
        for key in keys:
            self._entries[key].last_used = self._clock

    def loads_in_flight(self) -> bool:
        """Copies in flight, or failed and not yet taken (the scheduler must not evict others to
        make room while either may still change what can run)."""
        return bool(self._loading or self._failed)

    def begin_load(self, key: Hashable, reserve: int = 0, evict: bool = True) -> bool:
        """Take pages and a row (evicting idle adapters if that suffices, unless not ``evict``)
        and prepare the copy, leaving at least ``reserve`` pages free; issue_loads() then queues
        it. False when there is no room now; nothing is evicted then."""
        with self._lock:
            entry = self._entries[key]
            if entry.state is not AdapterState.HOST or key in self._failed:
                return True  # loading or loaded; or failed, waiting for take_failed_loads()
            need = self.pages_of(entry.host)
            if not self._free_rows or self.pool.num_free < need + reserve:
                if not evict:
                    return False
                # Idle adapters must make room: a pass over every entry, so only when needed
                # (with thousands of index rows most loads find a free row and pages).
                idle = self._idle()
                rows = len(self._free_rows) + len(idle)
                room = self.pool.num_free + sum(self._pool_pages(k) for k in idle)
                if rows == 0 or room < need + reserve:
                    return False
                while not self._free_rows or self.pool.num_free < need + reserve:
                    self._evict(idle.pop(0))
            entry.row = self._free_rows.pop()
            slots = self.pool.allocate_adapter(key, entry.host.plan.num_slots)
            entry.state = AdapterState.LOADING
            self._loading.add(key)
            self._mark(key)
        self.row_ranks[entry.row] = entry.host.max_rank
        self.row_modules[entry.row] = sum(1 << m for m, r in enumerate(entry.host.ranks) if r)
        entry.ready = self.copier.prepare(entry.host, entry.row, slots)
        self._unissued.append(entry.ready)
        return True

    def issue_loads(
        self,
        budget_s: float | None = None,
        budget_bytes: int | None = None,
        after: torch.cuda.Event | None = None,
    ) -> None:
        """Queue the copies begin_load prepared (adapter_copy.py), in the order they were
        prepared (the queue's). The engine calls this once the step's GPU work is queued, so
        their host time passes while the GPU computes (and at once when no step runs). With
        ``budget_s``, it stops once that much time has passed, at least one issued: a burst of
        hundreds of loads (a saturating trace's adapters all wanted at once) must not keep the
        step thread from launching the next step while the GPU idles. With ``budget_bytes``, it
        queues at most about that many bytes of the adapters' files (AdapterCopier.issue: a
        transfer may end at the next calls), so that the transfers end before the step does
        and its successor's input copies find the copy engine free; ``after`` (the step's input
        copies) the transfers wait for."""
        start = time.perf_counter()
        issued = sent = 0
        for ticket in self._unissued:
            left = None if budget_bytes is None else budget_bytes - sent
            sent += self.copier.issue(ticket, left, after)
            if not ticket.issued:  # the rest of its transfer goes at the next call
                break
            issued += 1
            if budget_s is not None and time.perf_counter() - start >= budget_s:
                break
            if budget_bytes is not None and sent >= budget_bytes:
                break
        del self._unissued[:issued]

    def poll_loads(self) -> None:
        """LOADING -> IN_POOL for every load whose copy has completed (never blocks); a copy
        that failed gives its pages and row back (LOADING -> HOST) and waits, not retried, until
        take_failed_loads() reports it."""
        done = []
        with self._lock:
            for key in list(self._loading):
                entry = self._entries[key]
                ticket = entry.ready
                if not ticket.done():
                    continue
                self._loading.discard(key)
                entry.ready = None
                self._mark(key)
                if ticket.error is None:
                    entry.state = AdapterState.IN_POOL
                    self.loads += 1  # copies completed into the pool
                    done.append((key, ticket.seconds()))
                    continue
                self._unplace(key)
                self._failed[key] = ticket.error
                log.error(
                    "copying adapter %s into the page pool failed: %r", key, ticket.error,
                    exc_info=ticket.error,
                )  # fmt: skip
        for key, seconds in done:
            self.copy_seconds.append(seconds)
            for listener in self.load_listeners:
                listener(key, seconds)

    def take_failed_loads(self) -> dict[Hashable, BaseException]:
        """The adapters whose copy failed since the last call, and why; a later begin_load()
        of one tries again."""
        if not self._failed:  # every loop turn; _failed is written on the step thread only
            return {}
        with self._lock:
            failed, self._failed = self._failed, {}
        return failed

    def evict_idle(self) -> bool:
        """Evict the least recently used resident adapter that no request uses. The scheduler
        calls this for each page a step lacks, and a pool holding a thousand preloaded adapters
        may give up most of them in one step: the idle adapters are sorted once per step (the
        clock moves with each step's touch) and taken in that order, each checked to be idle
        still; an exhausted order is built again once before this says there is none."""
        with self._lock:
            for fresh in (False, True):
                if fresh or self._evict_order is None or self._evict_clock != self._clock:
                    self._evict_order = deque(self._idle())
                    self._evict_clock = self._clock
                while self._evict_order:
                    key = self._evict_order.popleft()
                    entry = self._entries.get(key)
                    idle = entry is not None and entry.state is AdapterState.IN_POOL
                    if idle and entry.refs == 0 and not entry.pinned:
                        self._evict(key)
                        return True
            return False

    def evict_queued(self, key: Hashable) -> bool:
        """Evict ``key`` although queued requests use it: the scheduler's choice, for KV pages,
        of an adapter that no running request uses and whose requests wait furthest back (it is
        copied in again as they near the head). False, and nothing evicted, unless it is in the
        pool and not pinned."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.state is not AdapterState.IN_POOL or entry.pinned:
                return False
            self._evict(key)
            self.queued_evictions += 1
            return True

    def evict_for_stall(self, keep: Hashable | None) -> bool:
        """Evict the least recently used resident adapter other than ``keep`` even though queued
        requests wait for it. Only for when nothing runs and the queue's head cannot start."""
        with self._lock:
            resident = sorted(
                (
                    k
                    for k, e in self._entries.items()
                    if e.state is AdapterState.IN_POOL and not e.pinned
                ),
                key=lambda k: self._entries[k].last_used,
            )
            for key in resident:
                if key != keep:
                    log.warning("evicting adapter %s (queued requests wait for it) to unblock", key)
                    self._evict(key)
                    return True
            return False

    def reap(self) -> None:
        """Drop removed adapters that no request uses any more, freeing their pages."""
        with self._lock:
            for key in list(self._removed):
                entry = self._entries[key]
                if not _releasable(entry.refs, entry.state):
                    continue  # in use, or the copy still reads the host tensors; next time
                if entry.state is AdapterState.IN_POOL:
                    self._evict(key)
                del self._entries[key]
                self._removed.discard(key)
                self._mark(key)

    # --- internals (lock held, or step thread only) -----------------------------------------

    def _mark(self, key: Hashable) -> None:
        if self._changed is not None:
            self._changed.add(key)

    def _idle_keys(self) -> Iterator[Hashable]:
        """Resident adapters with no request, in no order."""
        return (
            k
            for k, e in self._entries.items()
            if e.state is AdapterState.IN_POOL and e.refs == 0 and not e.pinned
        )

    def _idle(self) -> list[Hashable]:
        """Resident adapters with no request, least recently used first."""
        return sorted(self._idle_keys(), key=lambda k: self._entries[k].last_used)

    def _pool_pages(self, key: Hashable) -> int:
        return self.pages_of(self._entries[key].host)

    def _evict(self, key: Hashable) -> None:
        self._unplace(key)
        self._mark(key)
        self.evictions += 1
        log.debug("evicted adapter %s from the pool", key)

    def _unplace(self, key: Hashable) -> None:
        """Give the adapter's pages and index row back: state HOST."""
        entry = self._entries[key]
        self.pool.free_adapter(key)
        self.index.ranks[entry.row].zero_()  # a stale row must add nothing if it were read
        if self.copier.mirror is not None:  # and likewise on the tensor-parallel workers
            self.copier.mirror.clear_row(entry.row)
        self.row_ranks[entry.row] = self.row_modules[entry.row] = 0
        self._free_rows.append(entry.row)
        entry.state, entry.row = AdapterState.HOST, None
