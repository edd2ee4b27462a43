"""Adapter affinity in admission: a queued request whose adapter the running batch already uses
joins before requests that would bring another adapter into the batch, within a bound.

Why: every step reads the weights of each distinct adapter in its batch once (the LoRA kernels group
a step's tokens by adapter), so a step's LoRA cost grows with its distinct adapters, not its tokens.
Under a deep queue, admitting in arrival order fills the batch with as many adapters as the queue's
head happens to hold; preferring requests of adapters already running packs the same tokens on fewer
adapters. On DESIGN.md's saturating trace (1000 requests at once, uniform over n adapters)
bench/affinity_sim.py counts the distinct adapters a step: with the H100 engine's 288 sequences,
n = 100 77.0 in queue order, 55.1 with a bound of one batch (288) and 38.2 with the default of two
(576); n = 1000 161.9, 143.3 and 133.9. The number of steps stays within 1%, and no TTFT percentile
in steps (p50, p99, the last request) comes more than 2% later than in arrival order at n = 5-2000;
what the bound trades is how late one request may come (576 admissions). Through the services on one
H100, S2 n = 100 (ranks 8-64) ran at 0.879 of the base model with the one-batch bound and 0.897 with
the default, its steps on 60.3 and 50.8 adapters on average (0.894 with the default on another
H100); on the H200 at 0.905 with the one-batch bound and 0.890 without. Those runs counted a request
passed over whenever one behind it was offered (Affinity's docstring), which the model reproduces
(62.1 and 49.8); counted on admissions (55.1 and 38.2), S2 n = 100 ran at 0.920 on the H200 with
the default bound. S1's rank-8 ratios did not move (docs/inference_service.md, *Adapter affinity*).

The bound (``limit``, the engine's adapter_affinity; 0 turns this off): only the first
``limit`` requests of a tenant's queue are looked at, and a request that requests behind it have
passed ``limit`` times is taken next whatever its adapter, so no request waits more than
``limit`` admissions beyond its place. Base-model requests (no adapter) add no adapter to a
step: they count as having affinity. The order between tenants stays the fairness policy's
(engine/fairness.py); this only reorders within one tenant's queue.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterable
from itertools import islice
from typing import Protocol


class _Seq(Protocol):  # the parts of engine/request.Sequence this module reads and writes
    adapter: Hashable | None
    passed_over: int  # how many requests behind it in its queue were admitted before it


class Affinity:
    """One step's admission: ``take`` the next request of a queue, ``admitted`` each request
    that joined (its adapter then counts as running for the rest of the step).

    A request is passed over when one behind it is admitted, not when one is only offered: a
    scheduler offers requests it does not admit (no room for its KV pages this step, its
    adapter still loading), and in a saturated engine it offers one in every step, the same
    one while the batch stays full. Counted on offers, the requests ahead of it came due
    within ``limit`` steps, and admission fell back to arrival order: S2 n = 100 through the
    services held 50.8 adapters a step with a bound of two batches where the scheduler's model
    said 38.2 (bench/affinity_sim.py's ``--count-offers`` models the old count: 49.8).

    A scheduler offers a queue's requests one after another, many of them not admitted, so
    ``take`` does not look at the same requests again: for each queue it keeps how many at its
    head are known to have no affinity and not to be due (passed fewer than ``limit`` times),
    until the batch's adapters change: between such changes each request is checked once, as
    arrival order checks it, not once for every request offered before it."""

    def __init__(self, running: Iterable[_Seq], limit: int) -> None:
        if limit < 0:
            raise ValueError(f"adapter affinity must be 0 (off) or positive, got {limit}")
        self.limit = limit
        self._running = running
        self._active: set | None = None  # the batch's adapters, read at the first take
        # id(queue) -> how many of its head requests are known to be passed over (the queues
        # live as long as the step's admission that owns them and this)
        self._plain: dict[int, int] = {}
        # the latest request taken from behind others: (it, the requests ahead of it, its
        # queue's id), which admitted() counts as passed over
        self._pending: tuple[_Seq, list[_Seq], int] | None = None

    def _has_affinity(self, seq: _Seq) -> bool:
        if seq.adapter is None:
            return True
        if self._active is None:
            self._active = {s.adapter for s in self._running}
        return seq.adapter in self._active

    def take(self, queue: deque) -> _Seq:
        """Remove and return the next request of a non-empty queue: the first of its first
        ``limit`` that has affinity or has been passed ``limit`` times, else its head."""
        self._pending = None
        if not self.limit:
            return queue.popleft()
        window = min(self.limit, len(queue))
        for i in range(self._plain.get(id(queue), 0), window):  # a deque index hops blocks
            seq = queue[i]
            if self._has_affinity(seq) or seq.passed_over >= self.limit:
                k = i
                break
        else:
            self._plain[id(queue)] = window - 1  # all passed over; the head goes
            return queue.popleft()
        if k == 0:
            return queue.popleft()  # the head itself has affinity or is due
        seq = queue[k]
        self._pending = (seq, list(islice(queue, k)), id(queue))
        self._plain[id(queue)] = k  # the k ahead of it stay plain until it is admitted
        del queue[k]
        return seq

    def _pass_over(self) -> None:
        """The request ``take`` returned last passes those ahead of it over (any that come due
        are looked at again); it is no longer pending."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        _, ahead, queue_id = pending
        for i, passed in enumerate(ahead):
            passed.passed_over += 1
            if passed.passed_over >= self.limit and queue_id in self._plain:
                self._plain[queue_id] = min(self._plain[queue_id], i)  # due: look again

    def admitted(self, seq: _Seq) -> None:
        if self._pending is not None and self._pending[0] is seq:
            self._pass_over()
        self._pending = None
        if self._active is not None and seq.adapter not in self._active:
            self._active.add(seq.adapter)
            self._plain.clear()  # requests of this adapter now have affinity
