"""Scheduler: which sequences run in the next step, and with how many tokens each.

Continuous batching: sequences join and leave between steps; one step holds prefill chunks and
single decode tokens of sequences for different adapters and for the base model, within
max_num_seqs sequences and max_num_batched_tokens tokens.

Order of each step (0 and the order of 3 are the fairness policy's, engine/fairness.py; with
--scheduling fcfs, 0 does nothing and 3 takes the queue's order):
0. Of a full batch, a tenant below its share takes slots from the tenant furthest above its own
   (whose newest running sequences are preempted).
1. Running sequences, oldest first, each with its next tokens (one when decoding, a chunk when a
   long prompt is prefilled piecewise). When the pool has no page for one: evict an idle adapter
   (least recently used); failing that, an adapter that only queued sequences beyond the window
   of 2 use, those furthest back in their tenant's queue first (copied in again as they come
   near: KV pages go to the sequences that run before adapters go to those that wait); failing
   that, preempt the newest running sequence not yet scheduled
   (possibly this one): its pages are freed and it goes back to the head of the queue, to be
   recomputed (prompt + generated tokens re-prefilled). Nothing is ever dropped.
2. Loads start for the adapters of queued sequences, in queue order, without waiting for the
   sequence to reach the head. The first PREFETCH_WINDOW sequences of each tenant's queue (those
   that join in the next steps) have their adapters loaded first: into free pages, then idle
   adapters', then those of adapters that only sequences further back wait for. Further back, a
   load takes only pages that one more step's prompt tokens would leave free.
3. Queued sequences join once their adapter is in the pool: tenants below their share first, the
   least served tenant first, each tenant's in arrival order, except that a sequence whose
   adapter the batch already runs may go ahead of others, each passed at most ``affinity`` times
   (engine/affinity.py: fewer distinct adapters a step, so fewer adapter bytes read); a sequence
   whose adapter is still loading is passed over (the others keep running). A sequence joins
   only if its chunk's pages leave a free page for each running sequence (their decode growth,
   as the adapter loads of 2 leave); one that lacks them stops admission, after adapters were
   evicted for it as in 1. Without that reserve, admission filled every page its sequences freed,
   the running sequences' next pages then came from preempting the newest, and those were
   recomputed: on the saturating trace of DESIGN.md (H200 defaults, 1000 requests at once) 6-9%
   of the prompt tokens again.
In 1 and 3, while several tenants are active, each tenant gets at most fair_prefill_tokens
prefill tokens per step (fairness.py: short steps while tenants share); decode tokens are never
limited.
The step's sequences are sorted by LoRA index row, so each adapter's tokens form one segment.
"""

from __future__ import annotations

import itertools
import logging
from collections import Counter, deque
from typing import NamedTuple

from services.inference.engine.adapter_manager import AdapterManager, AdapterState
from services.inference.engine.errors import InvalidRequest
from services.inference.engine.fairness import make_policy
from services.inference.engine.page_pool import PagePool
from services.inference.engine.request import Sequence, SequenceStatus

log = logging.getLogger(__name__)

# The sequences at the head of each tenant's queue whose adapters keep their pool pages against
# the KV cache and are loaded ahead of the others (module docstring, 1 and 2): about the next
# few steps' admissions, whose copies take a step or two.
PREFETCH_WINDOW = 32


class ScheduledSeq(NamedTuple):
    seq: Sequence
    num_tokens: int  # tokens computed for it this step
    lora_row: int | None
    samples: bool  # the chunk reaches the sequence's end: its next token is sampled


class Scheduler:
    def __init__(
        self,
        pool: PagePool,
        adapters: AdapterManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_len: int,
        scheduling: str = "fair",
        fair_prefill_tokens: int = 256,
        affinity: int = 0,
    ) -> None:
        if fair_prefill_tokens <= 0:
            raise ValueError(f"fair_prefill_tokens must be positive, got {fair_prefill_tokens}")
        if affinity < 0:
            raise ValueError(f"adapter affinity must be 0 (off) or positive, got {affinity}")
        self.affinity = affinity
        self.pool, self.adapters = pool, adapters
        self.max_num_seqs, self.max_tokens = max_num_seqs, max_num_batched_tokens
        self.fair_prefill_tokens = fair_prefill_tokens
        self.max_len = max_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0
        # Admission leaves a free page for each running sequence (step 3); bench/admission.py
        # turns it off to compare.
        self.decode_reserve = True
        self.fair = make_policy(scheduling)  # tenants' shares and order (engine/fairness.py)
        self.prefetch_window = PREFETCH_WINDOW
        # Loads beyond the window leave this many pages free beyond the decode reserve: one
        # step's prompt tokens, so that admission does not evict them again at once.
        self.far_margin = -(-max_num_batched_tokens // pool.page_size)
        # Per _choose: the adapters the running batch uses, and (made when first needed) those
        # only queued sequences beyond the window use, the furthest back last.
        self._running_adapters: set = set()
        self._victims: list | None = None

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        if seq.status is not SequenceStatus.WAITING:
            raise InvalidRequest(f"request {seq.request_id} cannot be queued twice")
        self.waiting.append(seq)
        self.fair.arrive(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out (finished or aborted) and free its pages now."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:  # not there when aborted before it was queued
            self.waiting.remove(seq)
        self.pool.free_kv(seq.seq_id)
        seq.status = SequenceStatus.FINISHED
        self.fair.leave(seq)

    def schedule(self) -> list[ScheduledSeq]:
        chosen = self._choose(prefetch=True)
        while not chosen and self.waiting and not self.running:
            # Nothing can run: adapters that queued requests wait for fill the pool, so the
            # head gets no pages. Make room for the head, without prefetching the others again.
            if self.adapters.loads_in_flight():
                break
            if self.waiting[0].inflight:  # it joins once finish() reads its token, not by room
                break
            if not self.adapters.evict_for_stall(keep=self.waiting[0].adapter):
                break
            chosen = self._choose(prefetch=False)
        out = [
            ScheduledSeq(
                seq,
                n,
                None if seq.adapter is None else self.adapters.row(seq.adapter),
                seq.num_computed + n == seq.num_tokens,
            )
            for seq, n in chosen
        ]
        self.fair.served(chosen)  # before step() moves num_computed: prefill or decode
        self.adapters.touch({s.seq.adapter for s in out if s.seq.adapter is not None})
        # Group by adapter: base-model rows (-1) first, then by row; stable within a row.
        out.sort(key=lambda s: -1 if s.lora_row is None else s.lora_row)
        return out

    def _choose(self, prefetch: bool) -> list[tuple[Sequence, int]]:
        self.adapters.poll_loads()
        chosen: list[tuple[Sequence, int]] = []
        budget = self.max_tokens

        # 0. Fair share: a tenant below its share of a full batch takes slots (fairness.py).
        victims = self.fair.preemptions(self.running, self.waiting, self.max_num_seqs, self._ready)
        for victim in victims:
            self._preempt(victim)
        self._running_adapters = {s.adapter for s in self.running if s.adapter is not None}
        self._victims = None
        limit = self.fair_prefill_tokens if self.fair.limits_prefill() else None
        prefilled: Counter = Counter()  # prefill tokens per tenant in this step

        # 1. Running sequences, oldest first; preempt from the newest end when pages run out.
        # A sequence whose tokens in flight already reach max_new_tokens or the context window
        # waits for them (EngineCore.finish ends it).
        pending = [s for s in self.running if s.num_uncomputed > 1 or s.can_extend(self.max_len)]
        while pending and budget > 0:
            seq = pending.pop(0)
            n = min(seq.num_uncomputed, budget)
            prefill = seq.num_uncomputed > 1  # a prompt chunk (or a recompute), not a decode
            if prefill and limit is not None:
                n = min(n, limit - prefilled[seq.tenant])
                if n <= 0:
                    continue  # its chunk waits for a step with room in the limit
            while not self._grow(seq, seq.num_computed + n):
                victim = pending.pop() if pending else seq
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                chosen.append((seq, n))
                budget -= n
                prefilled[seq.tenant] += n if prefill else 0

        # 2. Loads for queued sequences' adapters, in queue order (only the head's when not
        # prefetching), each leaving a page per running sequence for its next decode; beyond
        # each tenant's window only into room that leaves one more step's prompt pages free.
        place: Counter = Counter()  # each tenant's sequences so far
        far = True  # loads beyond the window still find room
        for seq in self.waiting if prefetch else itertools.islice(self.waiting, 1):
            rank = place[seq.tenant]
            place[seq.tenant] += 1
            key = seq.adapter
            if key is None or self.adapters.state(key) is not AdapterState.HOST:
                continue
            if rank < self.prefetch_window:
                if not self._load_near(key):
                    break  # no room even from adapters waiting further back
            elif far:
                far = self.adapters.begin_load(key, reserve=len(self.running) + self.far_margin)
        self.adapters.poll_loads()

        # 3. Admission among sequences whose adapter is ready, in the fairness policy's order
        # (first come first served within a tenant); this step's victims wait.
        admission = self.fair.admission(
            self.waiting, self.running, self.max_num_seqs, victims, self.affinity
        )
        for seq in admission:
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            if not self._ready(seq):
                continue
            n = min(seq.num_uncomputed, budget)
            if limit is not None:
                n = min(n, limit - prefilled[seq.tenant])
                if n <= 0:
                    admission.pass_over(seq.tenant)  # the rest of its queue waits too
                    continue
            reserve = len(self.running) if self.decode_reserve else 0
            if not self._grow(seq, seq.num_computed + n, reserve=reserve):
                break
            prefilled[seq.tenant] += n
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            if seq.adapter is not None:
                self._running_adapters.add(seq.adapter)
            chosen.append((seq, n))
            admission.admitted(seq, n)
            budget -= n
        return chosen

    def _ready(self, seq: Sequence) -> bool:
        """Whether a queued sequence could join now: its adapter is in the pool, and no token
        of its is in flight (a preempted one is recomputed once it is read)."""
        if seq.inflight:
            return False
        return seq.adapter is None or self.adapters.state(seq.adapter) is AdapterState.IN_POOL

    def _grow(self, seq: Sequence, num_tokens: int, reserve: int = 0) -> bool:
        """Give the sequence pages for ``num_tokens`` tokens, evicting idle adapters if needed,
        so that ``reserve`` pages stay free after."""
        missing = self.pool.kv_pages_missing(seq.seq_id, num_tokens)
        if missing == 0:
            return True  # most decode steps: the last page still has room
        while self.pool.num_free < missing + reserve:
            if not self.adapters.evict_idle() and not self._evict_queued(keep=seq.adapter):
                return False
        self.pool.grow_kv(seq.seq_id, num_tokens)  # the loop above left enough pages free
        return True

    def _load_near(self, key) -> bool:
        """Begin loading the adapter of a sequence within its tenant's window: into free pages
        or idle adapters' (begin_load), else those of adapters waiting further back."""
        while not self.adapters.begin_load(key, reserve=len(self.running)):
            if not self._evict_queued(keep=key):
                return False
        return True

    def _evict_queued(self, keep) -> bool:
        """Evict the resident adapter that only queued sequences beyond their tenant's window
        use, those furthest back first (never ``keep`` or one the running batch uses)."""
        if self._victims is None:
            self._victims = self._queued_far()
        while self._victims:
            key = self._victims.pop()
            if key != keep and key not in self._running_adapters:
                if self.adapters.evict_queued(key):
                    log.debug("evicted adapter %s for KV pages: its requests wait far back", key)
                    return True
        return False

    def _queued_far(self) -> list:
        """Adapters whose queued sequences are all beyond their tenant's window, the furthest
        back (by the best place among them, then by arrival) last."""
        best: dict = {}  # adapter: (its best place in a tenant's queue, that sequence's position)
        place: Counter = Counter()
        for position, seq in enumerate(self.waiting):
            rank = place[seq.tenant]
            place[seq.tenant] += 1
            key = seq.adapter
            if key is not None and (key not in best or rank < best[key][0]):
                best[key] = (rank, position)
        far = [(at, key) for key, at in best.items() if at[0] >= self.prefetch_window]
        far.sort(key=lambda item: item[0])
        return [key for _, key in far]

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.pool.free_kv(seq.seq_id)
        seq.num_computed = 0
        seq.status = SequenceStatus.WAITING
        # Preemption walks from the newest running sequence backwards, so pushing each to the
        # front keeps the older ones ahead.
        self.waiting.appendleft(seq)
        self.preemptions += 1
        log.debug("preempted %s (%d tokens) for recompute", seq.request_id, seq.num_tokens)
