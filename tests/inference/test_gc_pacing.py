"""Garbage collection paced by the step thread (engine/gc_pacing.py), against the real gc.

Every test leaves gc as it found it: enabled or not, thresholds, nothing frozen, no callback.
Collections are observed through gc.callbacks and weakref.finalize on cyclic garbage.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import weakref

import pytest

from services.inference.engine import gc_pacing
from services.inference.engine.api import GenerationRequest
from services.inference.engine.config import EngineConfig
from services.inference.engine.engine import Engine
from services.inference.engine.gc_pacing import GcPacer, due_generation
from services.inference.engine.sampling_params import SamplingParams


@pytest.fixture
def gc_state():
    """Restores gc's state after the test; yields the collections seen: (generation, thread)."""
    enabled, thresholds = gc.isenabled(), gc.get_threshold()
    seen: list[tuple[int, str]] = []

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            seen.append((info["generation"], threading.current_thread().name))

    gc.callbacks.append(on_gc)
    try:
        yield seen
    finally:
        gc.callbacks.remove(on_gc)
        gc_pacing.release()
        gc.unfreeze()
        gc.set_threshold(*thresholds)
        (gc.enable if enabled else gc.disable)()


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the collector frees it


def cyclic_garbage() -> list[bool]:
    """Drops a reference cycle; the returned list gets True once the collector freed it."""
    freed: list[bool] = []
    node = _Node()
    weakref.finalize(node, freed.append, True)
    del node
    return freed


def allocate(keep: list, n: int) -> None:
    """n more live container objects: generation 0's count grows by at least n."""
    keep.append([[] for _ in range(n)])


def test_garbage_waits_for_collect_if_due(gc_state):
    gc.set_threshold(500, 1000, 1000)
    gc_pacing.pace_collections(freeze=False)
    gc.collect()  # counts from zero
    before = gc_pacing.stats()
    gc_state.clear()
    freed, keep = cyclic_garbage(), []
    allocate(keep, 600)
    assert gc.get_count()[0] >= 500  # automatic collection would have run by now
    assert not freed and gc_state == []
    assert gc_pacing.collect_if_due() == 0
    assert freed == [True] and gc_state == [(0, threading.current_thread().name)]
    after = gc_pacing.stats()
    assert after.collections[0] == before.collections[0] + 1
    assert after.seconds[0] > before.seconds[0] and after.active


def test_nothing_runs_below_threshold0(gc_state):
    gc.set_threshold(100_000, 1, 1)  # generations 1 and 2 would be due; generation 0 is not
    gc_pacing.pace_collections(freeze=False)
    gc.collect()
    gc.collect(0)
    gc.collect(1)  # count1 and count2 at their thresholds now
    gc_state.clear()
    freed, keep = cyclic_garbage(), []
    allocate(keep, 200)
    assert gc_pacing.collect_if_due() is None
    assert not freed and gc_state == []
    gc.set_threshold(100, 1000, 1000)  # read at each call
    assert gc_pacing.collect_if_due() == 0 and freed == [True]


def test_generation1_once_count1_reaches_threshold1(gc_state):
    gc.set_threshold(100, 3, 1000)
    gc_pacing.pace_collections(freeze=False)
    gc.collect()
    keep: list = []
    generations = []
    for _ in range(8):
        allocate(keep, 150)
        generations.append(gc_pacing.collect_if_due())
    assert generations == [0, 0, 0, 1, 0, 0, 0, 1]
    assert gc.get_count()[1:] == (0, 2)  # two generation-1 collections since the full one


def test_due_generation_rule():
    t = (700, 10, 10)
    assert due_generation((699, 10, 10), t, 9.0, 1.0) is None  # nothing before threshold0
    assert due_generation((700, 0, 0), t, 9.0, 1.0) == 0
    assert due_generation((700, 10, 0), t, 9.0, 1.0) == 1
    assert due_generation((700, 3, 10), t, 1.0, 1.0) == 2
    assert due_generation((700, 3, 10), t, 0.9, 1.0) == 0  # a full one waits for the interval
    assert due_generation((700, 10, 10), t, 0.9, 1.0) == 1  # meanwhile generation 1 runs
    assert due_generation((5000, 10, 10), (0, 10, 10), 9.0, 1.0) is None  # threshold0 0: off


class _Clock:
    """A clock the test moves; each reading advances it by ``per_call`` (a collection's
    measured duration is then per_call)."""

    def __init__(self) -> None:
        self.now, self.per_call = 100.0, 0.0

    def __call__(self) -> float:
        t = self.now
        self.now += self.per_call
        return t


def _clocked_pacer() -> tuple[_Clock, GcPacer]:
    """A pacer on a test clock (1% duty, 1 s minimum), pacing from a fresh collection; a full
    collection's count is reached after each generation-1 one (thresholds 50, 1, 1)."""
    clock = _Clock()
    pacer = GcPacer(full_duty=0.01, full_min_interval_s=1.0, clock=clock)
    gc.set_threshold(50, 1, 1)
    pacer.pace(freeze=False)
    gc.collect()
    return clock, pacer


def test_full_collections_spaced_by_their_duration(gc_state):
    clock, pacer = _clocked_pacer()
    keep: list = []

    def drive(n: int) -> list[int | None]:
        out = []
        for _ in range(n):
            allocate(keep, 60)
            out.append(pacer.collect_if_due())
        return out

    # count2 reaches threshold2 after one generation-1 collection, but the minimum interval
    # since pacing started has not passed: generations 0 and 1 alternate.
    assert drive(4) == [0, 1, 0, 1]
    clock.now += 1.0
    clock.per_call = 0.025  # this full collection "takes" 25 ms ...
    assert drive(1) == [2] and gc.get_count()[1:] == (0, 0)
    clock.per_call = 0.0
    assert drive(2) == [0, 1]
    clock.now += 2.4  # ... so the next waits 25 ms / 1% = 2.5 s, not the 1 s minimum
    assert drive(2) == [0, 1]
    clock.now += 0.1
    assert drive(1) == [2]
    stats = pacer.stats()
    assert stats.collections == (4, 4, 2) and stats.seconds[2] == pytest.approx(0.025)
    assert [g for g, _ in gc_state].count(2) >= 2  # the real gc ran them (gc.collect above too)


def test_a_slow_full_collection_is_logged(gc_state, caplog):
    """A full collection of SLOW_FULL_S or more outlasts a decode step: a warning says how
    long it took and how long the next one waits; shorter ones say nothing."""
    clock, pacer = _clocked_pacer()
    keep: list = []

    def full(seconds: float) -> None:
        """Collections that each "take" ``seconds`` until a full one ran."""
        clock.now += 100.0  # past any interval
        clock.per_call = seconds
        for _ in range(10):
            allocate(keep, 60)
            if pacer.collect_if_due() == 2:
                return
        raise AssertionError("no full collection came")

    with caplog.at_level("WARNING", logger="services.inference.engine.gc_pacing"):
        full(0.01)
        assert not caplog.records
        full(0.12)
    [record] = caplog.records
    assert "took 120 ms" in record.getMessage() and "next waits 12 s" in record.getMessage()


def test_release_restores_automatic_collection(gc_state):
    gc_pacing.pace_collections(freeze=False)
    assert not gc.isenabled() and gc_pacing.stats().active
    gc_pacing.release()
    assert gc.isenabled() and not gc_pacing.stats().active
    gc.set_threshold(100, 1000, 1000)
    gc.collect()
    gc_state.clear()
    freed, keep = cyclic_garbage(), []
    allocate(keep, 300)
    assert freed == [True] and (0, threading.current_thread().name) in gc_state
    assert gc_pacing.collect_if_due() is None  # released: the pacer no longer collects


def test_pace_collections_freezes_startup_objects(gc_state):
    gc_pacing.pace_collections()
    assert gc.get_freeze_count() > 1000  # modules, the test session: everything alive
    assert not gc.isenabled()
    with pytest.raises(ValueError, match="full_duty"):
        GcPacer(full_duty=0.0)


async def test_engine_collects_on_its_step_thread(gc_state, tiny_models):
    gc.set_threshold(100, 10, 10)  # collections come often in a short run
    gc_pacing.pace_collections(freeze=False)
    gc_state.clear()  # automatic collections before pacing started
    before = gc_pacing.stats()
    engine = Engine(
        EngineConfig(
            model_dir=tiny_models.model("tiny-llama"), device="cpu", page_size=4,
            num_pages=512, max_model_len=128,
        )
    )  # fmt: skip
    await engine.start()
    try:

        async def generate(i: int) -> int:
            sampling = SamplingParams(max_new_tokens=12, ignore_eos=True)
            request = GenerationRequest(f"r{i}", prompt_token_ids=[3 + i, 5, 7], sampling=sampling)
            return len([out async for out in engine.generate(request)])

        assert await asyncio.gather(*(generate(i) for i in range(4))) == [12] * 4
        stepping = list(gc_state)
        # Idle: garbage made on this thread is collected by the step loop's idle iteration.
        # Well past threshold0 (100): objects freed meanwhile lower the count again, and the
        # idle iteration comes up to half a second later.
        freed, keep = cyclic_garbage(), []
        allocate(keep, 1000)
        for _ in range(300):
            if freed:
                break
            await asyncio.sleep(0.01)
        assert freed == [True]
    finally:
        await engine.stop()
    assert stepping and {thread for _, thread in gc_state} == {"engine-step-loop"}
    assert sum(gc_pacing.stats().collections) > sum(before.collections)
    # The engine's stats carry them (the metrics' lorafleet_engine_gc_* counters)
    assert engine.core.stats().gc == gc_pacing.stats()


async def test_failed_step_loop_gives_collection_back(gc_state, tiny_models):
    """Pacing needs the step loop: once it has died, CPython's automatic collection is back."""
    gc_pacing.pace_collections(freeze=False)
    engine = Engine(
        EngineConfig(
            model_dir=tiny_models.model("tiny-llama"), device="cpu", page_size=4,
            num_pages=512, max_model_len=128,
        )
    )  # fmt: skip

    def broken_step(during=None):
        raise RuntimeError("a broken step")

    engine.core.launch = broken_step
    await engine.start()
    request = GenerationRequest("r", prompt_token_ids=[3, 5, 7], sampling=SamplingParams())
    with pytest.raises(Exception, match="engine step failed"):
        async for _ in engine.generate(request):
            pass
    await engine.stop()
    assert gc.isenabled() and not gc_pacing.stats().active
