"""OutputRouter: a step's outputs reach their streams' queues in order, one wake-up of each
event loop per step, from the step thread."""

from __future__ import annotations

import asyncio
import threading

from services.inference.engine.output_router import OutputRouter


def _count_wakeups(loop: asyncio.AbstractEventLoop) -> list[int]:
    calls = [0]
    real = loop.call_soon_threadsafe

    def spy(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    loop.call_soon_threadsafe = spy  # an instance attribute: this loop only
    return calls


async def test_one_wakeup_per_post_and_order_kept():
    router = OutputRouter()
    loop = asyncio.get_running_loop()
    queues = {rid: router.open(rid) for rid in ("a", "b", "c")}
    calls = _count_wakeups(loop)
    error = RuntimeError("ended")
    steps = [[("a", 1), ("b", 1), ("c", 1)], [("a", 2), ("c", 2)], [("b", error)]]
    thread = threading.Thread(target=lambda: [router.post(step) for step in steps])
    thread.start()
    thread.join()
    got = {rid: [] for rid in queues}
    for _ in range(6):
        for rid, q in queues.items():
            while not q.empty():
                got[rid].append(q.get_nowait())
        await asyncio.sleep(0)
    assert got == {"a": [1, 2], "b": [1, error], "c": [1, 2]}
    assert calls[0] == len(steps)  # not one per output


def test_closed_streams_and_loops_are_skipped():
    router = OutputRouter()
    loop, other = asyncio.new_event_loop(), asyncio.new_event_loop()
    kept = loop.run_until_complete(_open_queue(router, "kept"))
    loop.run_until_complete(_open_queue(router, "gone"))
    router.close("gone")
    other.run_until_complete(_open_queue(router, "orphan"))
    other.close()  # a caller whose event loop has closed since it opened its stream
    assert sorted(router.ids()) == ["kept", "orphan"]
    router.post([("gone", 1), ("orphan", 1), ("kept", 1), ("unknown", 1)])
    loop.run_until_complete(asyncio.sleep(0))
    loop.close()
    assert kept.get_nowait() == 1 and kept.empty()


def test_each_event_loop_is_woken_once():
    router = OutputRouter()
    loops = [asyncio.new_event_loop() for _ in range(2)]
    queues = [loop.run_until_complete(_open_queue(router, f"r{i}")) for i, loop in enumerate(loops)]
    calls = [_count_wakeups(loop) for loop in loops]
    router.post([("r0", "x"), ("r1", "y"), ("r0", "z")])
    for loop in loops:
        loop.run_until_complete(asyncio.sleep(0))
        loop.close()
    assert [c[0] for c in calls] == [1, 1]
    assert [queues[0].get_nowait(), queues[0].get_nowait(), queues[1].get_nowait()] == [
        "x",
        "z",
        "y",
    ]


def test_posting_on_the_streams_own_loop_delivers_at_once():
    """The engine process's reports are read on the event loop the streams follow: their
    outputs go into the queues at once, not a turn of the loop later, and a stream on another
    loop is still woken through that loop."""
    router = OutputRouter()
    loop, other = asyncio.new_event_loop(), asyncio.new_event_loop()
    here = loop.run_until_complete(_open_queue(router, "here"))
    there = other.run_until_complete(_open_queue(router, "there"))
    calls, other_calls = _count_wakeups(loop), _count_wakeups(other)

    async def post_and_look() -> list:
        router.post([("here", 1), ("there", 2), ("here", 3)])
        return [here.get_nowait() for _ in range(here.qsize())]  # before any await

    assert loop.run_until_complete(post_and_look()) == [1, 3] and calls[0] == 0
    assert there.empty() and other_calls[0] == 1
    other.run_until_complete(asyncio.sleep(0))
    assert there.get_nowait() == 2
    loop.close()
    other.close()


async def _open_queue(router: OutputRouter, rid: str) -> asyncio.Queue:
    return router.open(rid)
