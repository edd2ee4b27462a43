"""The engine process with every step and every garbage collection recorded, for
bench/service_load.py: it runs services/inference/engine_process.py unchanged, wraps the
engine's step with bench/adapter_load.py's StepTimer, and writes what it recorded as JSON to
the file named by LORAFLEET_BENCH_TRACE when the process ends.

Times are time.perf_counter (CLOCK_MONOTONIC on Linux), so they compare with the client's.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.adapter_load import CollectionLog, StepTimer  # noqa: E402
from services.inference import engine_process  # noqa: E402

_timers: list[StepTimer] = []


class _TracedEngine(engine_process.ProcessEngine):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        _timers.append(StepTimer(self.core))


def main(argv: list[str]) -> int:
    engine_process.ProcessEngine = _TracedEngine
    with CollectionLog() as collections:
        code = engine_process.main(argv)
    trace = {
        "steps": [s._asdict() for t in _timers for s in t.steps],
        "collections": [c._asdict() for c in collections.collections],
    }
    Path(os.environ["LORAFLEET_BENCH_TRACE"]).write_text(json.dumps(trace))
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
