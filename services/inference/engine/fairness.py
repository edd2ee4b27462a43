"""Fair sharing of the running batch between tenants, in the spirit of the Virtual Token Counter
(Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024).

The scheduler asks this policy two things each step: which running sequences give up their slot
(``preemptions``), and in which order queued sequences are offered for admission
(``admission``); it reports what each step served (``served``) and when sequences arrive and
leave. A tenant is a request's ``tenant`` (None: anonymous or admin, one tenant of its own).

- Counters: each tenant has a counter of the service it received, prefill tokens weighted
  PREFILL_WEIGHT and decode tokens DECODE_WEIGHT (the paper's weights: a decode token costs the
  GPU more per token than a prefill token). A tenant that becomes active (its first sequence
  waiting or running) has its counter lifted to the smallest counter of the active tenants, so
  idle time is not banked as credit to flood the batch with later.
- Shares: of a full batch (max_num_seqs running), each active tenant's share is max_num_seqs //
  active tenants. A tenant below its share with a sequence ready to run (its adapter in the
  pool) takes a slot from the tenant furthest above its share: that tenant's newest running
  sequence is preempted (recomputed later, as any preemption). Without this a tenant arriving
  at a batch filled by another waits for a slot to free: a whole generation of the other's.
- Admission: queued sequences are offered tenant by tenant, first from tenants below their
  share, then from the rest; among those, the tenant with the smallest counter first; within a
  tenant in queue order, except that a sequence whose adapter the batch already runs may go
  first, within a bound (engine/affinity.py). Sequences preempted in this step are not offered
  again in it.
- Short steps while tenants share: while several tenants are active, each tenant's prefill
  tokens per step are limited (``limits_prefill``; the scheduler's fair_prefill_tokens). A
  step's length is mostly its prefill, and an arriving request's first token waits for the
  steps already built (one running, one prepared): without the limit a burst of the busy
  tenant's refills (2048-token steps, about 45 ms for a 7B model) sets the other tenants' TTFT
  tail. The limit is per tenant, so a light tenant's prompt is not chunked behind the busy
  one's; a tenant alone is not limited.
- Work-conserving: a tenant that has nothing ready does not hold slots back; with one active
  tenant the order is the queue's, exactly as FCFS.
``FirstComeFirstServed`` is the same interface without any of this (--scheduling fcfs): the
queue's order, adapter affinity included.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

from services.inference.engine.affinity import Affinity

PREFILL_WEIGHT = 1.0
DECODE_WEIGHT = 2.0

Tenant = str | None


class _Seq(Protocol):  # the parts of engine/request.Sequence this module reads
    seq_id: int
    tenant: Tenant
    adapter: object  # read, with passed_over, only with adapter affinity (engine/affinity.py)
    passed_over: int
    prompt_ids: list[int]
    output_ids: list[int]
    num_computed: int

    @property
    def num_tokens(self) -> int: ...


def step_cost(seq: _Seq, num_tokens: int) -> float:
    """The weighted tokens of computing ``num_tokens`` of ``seq`` next (before num_computed
    moves): one decode token, or a prefill chunk (a recompute's included)."""
    # num_tokens counts tokens in flight: a first decode comes before its token is read
    decoding = (
        num_tokens == 1
        and seq.num_tokens > len(seq.prompt_ids)
        and seq.num_computed == seq.num_tokens - 1
    )
    return DECODE_WEIGHT if decoding else PREFILL_WEIGHT * num_tokens


class FairShare:
    def __init__(self) -> None:
        self.counters: dict[Tenant, float] = {}
        self._live: dict[Tenant, set[int]] = {}  # active tenants: their waiting + running seqs

    @property
    def active(self) -> int:
        return len(self._live)

    def arrive(self, seq: _Seq) -> None:
        live = self._live.get(seq.tenant)
        if live is None:
            floor = min((self.counters[t] for t in self._live), default=0.0)
            self.counters[seq.tenant] = max(self.counters.get(seq.tenant, 0.0), floor)
            live = self._live[seq.tenant] = set()
        live.add(seq.seq_id)

    def leave(self, seq: _Seq) -> None:
        """Idempotent; also for a sequence that never arrived (aborted before it was queued)."""
        live = self._live.get(seq.tenant)
        if live is not None:
            live.discard(seq.seq_id)
            if not live:
                del self._live[seq.tenant]

    def served(self, scheduled: Iterable[tuple[_Seq, int]]) -> None:
        for seq, n in scheduled:
            self.counters[seq.tenant] = self.counters.get(seq.tenant, 0.0) + step_cost(seq, n)

    def share(self, max_num_seqs: int) -> int:
        return max_num_seqs // max(1, len(self._live))

    def limits_prefill(self) -> bool:
        """Whether this step limits each tenant's prefill (several tenants active)."""
        return len(self._live) >= 2

    def preemptions(
        self,
        running: list[_Seq],
        waiting: Iterable[_Seq],
        max_num_seqs: int,
        ready: Callable[[_Seq], bool],
    ) -> list[_Seq]:
        """Running sequences to preempt now, newest first, so that tenants below their share
        of a full batch get slots."""
        if len(running) < max_num_seqs or len(self._live) < 2:
            return []
        share = self.share(max_num_seqs)
        count = Counter(s.tenant for s in running)
        wanted = Counter(s.tenant for s in waiting if count[s.tenant] < share and ready(s))
        need = sum(min(n, share - count[t]) for t, n in wanted.items())
        victims: list[_Seq] = []
        taken: set[int] = set()
        while need > 0:
            tenant, most = max(count.items(), key=lambda item: item[1])
            if most <= share:
                break
            victim = next(s for s in reversed(running) if s.tenant == tenant and id(s) not in taken)
            taken.add(id(victim))
            victims.append(victim)
            count[tenant] -= 1
            need -= 1
        return victims

    def admission(
        self,
        waiting: Iterable[_Seq],
        running: list[_Seq],
        max_num_seqs: int,
        skip=(),
        affinity: int = 0,
    ) -> Admission:
        """This step's admission order; ``affinity``: engine/affinity.py's bound (0: off)."""
        return Admission(self, waiting, running, max_num_seqs, skip, affinity)


class Admission:
    """One step's admission order; the scheduler reports each sequence it admits
    (``admitted``), which moves that tenant's place for the rest of the step. Nothing is offered
    once the batch is full, and the queue is read only when something may be admitted (most
    steps of a busy engine admit nothing)."""

    def __init__(
        self, policy: FairShare, waiting, running, max_num_seqs: int, skip, affinity: int
    ) -> None:
        self._policy = policy
        self._affinity = Affinity(running, affinity)
        self._share = policy.share(max_num_seqs)
        self._count = Counter(s.tenant for s in running)
        self._room = max_num_seqs - len(running)
        self._waiting, self._skip = waiting, skip
        self._counter: dict[Tenant, float] = {}
        self._queues: dict[Tenant, deque[_Seq]] | None = None
        self._first: dict[Tenant, int] = {}  # queue position of each tenant's first sequence

    def _group(self) -> dict[Tenant, deque[_Seq]]:
        queues: dict[Tenant, deque[_Seq]] = {}
        skipped = {id(s) for s in self._skip}
        for position, seq in enumerate(self._waiting):
            if id(seq) in skipped:
                continue
            queue = queues.get(seq.tenant)
            if queue is None:
                queue = queues[seq.tenant] = deque()
                self._first[seq.tenant] = position
                self._counter[seq.tenant] = self._policy.counters.get(seq.tenant, 0.0)
            queue.append(seq)
        return queues

    def __iter__(self) -> Iterator[_Seq]:
        return self

    def __next__(self) -> _Seq:
        if self._room <= 0:
            raise StopIteration
        if self._queues is None:
            self._queues = self._group()
        if not self._queues:
            raise StopIteration
        tenant = min(
            self._queues,
            key=lambda t: (self._count[t] >= self._share, self._counter[t], self._first[t]),
        )
        queue = self._queues[tenant]
        seq = self._affinity.take(queue)
        if not queue:
            del self._queues[tenant]
        return seq

    def admitted(self, seq: _Seq, num_tokens: int) -> None:
        self._affinity.admitted(seq)
        self._room -= 1
        self._count[seq.tenant] += 1
        if seq.tenant in self._counter:
            self._counter[seq.tenant] += step_cost(seq, num_tokens)

    def pass_over(self, tenant: Tenant) -> None:
        """Offer nothing more of this tenant's in this step (its prefill limit is spent)."""
        if self._queues is not None:
            self._queues.pop(tenant, None)


class FirstComeFirstServed:
    """The queue's order, no preemption for fairness, no counters."""

    def arrive(self, seq: _Seq) -> None:
        pass

    def leave(self, seq: _Seq) -> None:
        pass

    def served(self, scheduled) -> None:
        pass

    def preemptions(self, running, waiting, max_num_seqs, ready) -> list[_Seq]:
        return []

    def limits_prefill(self) -> bool:
        return False

    def admission(self, waiting, running, max_num_seqs, skip=(), affinity: int = 0) -> _InOrder:
        return _InOrder(waiting, running, affinity)


class _InOrder:
    """The queue's order (a copy: the scheduler removes whom it admits), with adapter
    affinity."""

    def __init__(self, waiting: Iterable[_Seq], running: list[_Seq], affinity: int) -> None:
        self._queue = deque(waiting)
        self._affinity = Affinity(running, affinity)

    def __iter__(self) -> Iterator[_Seq]:
        return self

    def __next__(self) -> _Seq:
        if not self._queue:
            raise StopIteration
        return self._affinity.take(self._queue)

    def admitted(self, seq: _Seq, num_tokens: int) -> None:
        self._affinity.admitted(seq)

    def pass_over(self, tenant: Tenant) -> None:  # never asked: FCFS limits no prefill
        pass


POLICIES = {"fair": FairShare, "fcfs": FirstComeFirstServed}


def make_policy(name: str) -> FairShare | FirstComeFirstServed:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"scheduling must be one of {sorted(POLICIES)}, got {name!r}") from None
