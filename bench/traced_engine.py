"""The engine process with every step, garbage collection, pool load and command recorded, for
bench/service_load.py: it runs services/inference/engine_process.py unchanged, wraps the
engine's step with bench/adapter_load.py's StepTimer, and the adapter manager's begin_load and
issue_loads (step thread) and the commands it applies for the service
with timers, and writes what it recorded as JSON to the file named by LORAFLEET_BENCH_TRACE
when it ends.

Times are time.perf_counter (CLOCK_MONOTONIC on Linux), so they compare with the client's.

With LORAFLEET_BENCH_PROFILE=PATH (CUDA) the torch profiler records the device's work from the
service's PROFILE_FROM-th load command to its PROFILE_LOADS-th after (the stream phase's load
windows and the quiet windows between them: every kernel and copy with its stream), and writes
it as a gzipped Chrome trace at PATH when it stops.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.adapter_load import CollectionLog, StepTimer  # noqa: E402
from services.inference import engine_process  # noqa: E402

PROFILE_FROM, PROFILE_LOADS = 40, 4

_timers: list[StepTimer] = []
_spans: dict[str, list[tuple[float, float]]] = {}  # what -> (start, seconds)


@contextlib.contextmanager
def _span(what: str):
    t = time.perf_counter()
    try:
        yield
    finally:
        _spans.setdefault(what, []).append((t, time.perf_counter() - t))


def _timed(what: str, fn):
    def wrapper(*args, **kwargs):
        with _span(what):
            return fn(*args, **kwargs)

    return wrapper


class _TracedEngine(engine_process.ProcessEngine):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        _timers.append(StepTimer(self.core))
        adapters = self.core.adapters
        adapters.begin_load = _timed("begin_load", adapters.begin_load)
        adapters.issue_loads = _timed("issue_loads", adapters.issue_loads)

        self._bench_loads = 0
        self._bench_profile = None

    def _apply(self, cmd: object) -> None:
        if not isinstance(cmd, engine_process._Command):
            super()._apply(cmd)
            return
        if cmd.msg[0] == "load" and os.environ.get("LORAFLEET_BENCH_PROFILE"):
            self._profiled_load()
        with _span(f"cmd_{cmd.msg[0]}"):
            super()._apply(cmd)

    def _profiled_load(self) -> None:
        import torch

        self._bench_loads += 1
        if self._bench_loads == PROFILE_FROM:
            act = torch.profiler.ProfilerActivity
            self._bench_profile = torch.profiler.profile(
                activities=[act.CUDA if torch.cuda.is_available() else act.CPU]
            )
            self._bench_profile.start()
        elif self._bench_loads == PROFILE_FROM + PROFILE_LOADS and self._bench_profile is not None:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self._bench_profile.stop()
            path = Path(os.environ["LORAFLEET_BENCH_PROFILE"])
            raw = path.with_suffix("")  # the trace, then gzipped at PATH
            self._bench_profile.export_chrome_trace(str(raw))
            with open(raw, "rb") as f, gzip.open(path, "wb") as out:
                out.write(f.read())
            raw.unlink()
            self._bench_profile = None


def main(argv: list[str]) -> int:
    engine_process.ProcessEngine = _TracedEngine
    with CollectionLog() as collections:
        code = engine_process.main(argv)
    trace = {
        "steps": [s._asdict() for t in _timers for s in t.steps],
        "collections": [c._asdict() for c in collections.collections],
        "spans": _spans,
    }
    Path(os.environ["LORAFLEET_BENCH_TRACE"]).write_text(json.dumps(trace))
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
