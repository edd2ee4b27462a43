"""The step thread's cost of handing one step's outputs to their streams (engine/output_router.py).

After every step the in-process engine's step thread (--engine thread) delivers each running
request's new token to that request's asyncio queue on the service's event loop, while the GPU
waits for the next step (with the engine process, RemoteEngine posts each report's outputs from
the event loop itself).
Side by side in one run: the engine's OutputRouter.post (one call_soon_threadsafe per event
loop per step) and the way the engine did it before (one call per output), for ``streams``
outputs a step, with the event loop draining its queues concurrently as the service's does.
Steps come every ``--interval-ms``, variants in turn for ``--rounds`` rounds; the figure is
the median of each variant's per-step times.

    python bench/deliver.py [--streams 64] [--steps 200] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import threading
import time
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from services.inference.engine.output_router import OutputRouter  # noqa: E402


class Output(NamedTuple):  # the shape of a GenerationOutput that matters here
    request_id: str
    token_ids: tuple[int, ...]


class PerOutput(OutputRouter):
    """The baseline: one call_soon_threadsafe per output."""

    def post(self, items) -> None:
        for request_id, item in items:
            with self._lock:
                sink = self._sinks.get(request_id)
            if sink is not None:
                sink.loop.call_soon_threadsafe(sink.queue.put_nowait, item)


async def measure(router: OutputRouter, streams: int, steps: int, interval: float) -> list[float]:
    """Per-step post() times from a step thread, while this loop drains the queues."""
    queues = [router.open(f"r{i}") for i in range(streams)]
    outputs = [Output(f"r{i}", (7,)) for i in range(streams)]
    times: list[float] = []
    received = [0]

    def step_thread() -> None:
        for _ in range(steps):
            t = time.perf_counter()
            router.post((out.request_id, out) for out in outputs)
            times.append(time.perf_counter() - t)
            time.sleep(interval)

    async def drain(queue: asyncio.Queue) -> None:
        while True:
            await queue.get()
            received[0] += 1

    drains = [asyncio.create_task(drain(q)) for q in queues]
    thread = threading.Thread(target=step_thread)
    thread.start()
    await asyncio.to_thread(thread.join)
    while received[0] < streams * steps:
        await asyncio.sleep(0.001)
    for task in drains:
        task.cancel()
    await asyncio.gather(*drains, return_exceptions=True)
    return times


async def run(args) -> dict:
    variants = {"one call per step (engine)": OutputRouter, "one call per output": PerOutput}
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, cls in variants.items():
            samples[name] += await measure(cls(), args.streams, args.steps, args.interval_ms / 1000)
    median = {name: sorted(v)[len(v) // 2] for name, v in samples.items()}
    return {
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                    "platform": platform.platform()},
        "streams": args.streams, "steps": args.steps * args.rounds,
        "interval_ms": args.interval_ms,
        "median_us": {name: round(v * 1e6, 1) for name, v in median.items()},
        "ratio": median["one call per output"] / median["one call per step (engine)"],
    }  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--steps", type=int, default=200, help="steps per variant and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--interval-ms", type=float, default=2.0, help="between steps")
    parser.add_argument("--out", default=str(REPO / "bench/results/deliver.json"))
    args = parser.parse_args()
    result = asyncio.run(run(args))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"delivering one step's outputs to {args.streams} streams, median per step "
          f"({result['steps']} steps each):")  # fmt: skip
    for name, us in result["median_us"].items():
        print(f"  {name:28s} {us:8.1f} µs")
    print(f"  ratio {result['ratio']:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
