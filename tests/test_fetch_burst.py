"""bench/fetch_burst.py end to end on the CPU: a real adapter store process and the service's
StoreClient, fetch worker and preloader, with the tiny shape's adapters."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_bursts_by_worker_memory_and_preloads_by_streams(tmp_path):
    out = tmp_path / "burst.json"
    command = [
        sys.executable, str(REPO / "bench" / "fetch_burst.py"), "--shape", "tiny",
        "--adapters", "6", "--slots", "2", "--worker-memory", "default", "tuned",
        "--preload", "1", "3", "--repeats", "1", "--store-dir", str(tmp_path), "--out", str(out),
    ]  # fmt: skip
    subprocess.run(command, check=True, cwd=REPO, timeout=600)
    rows = json.loads(out.read_text())["rows"]
    bursts = [r for r in rows if "slots" in r]
    assert [(r["slots"], r["worker_memory"], r["adapters"]) for r in bursts] == [
        (2, "default", 6),
        (2, "tuned", 6),
    ]
    for r in bursts:
        assert r["mb_per_s"] > 0 and r["first_s"] <= r["p50_s"] <= r["total_s"]
        assert r["worker_faults_per_gb"] >= 0 and r["cpu_s_per_gb"]["fetch worker"] > 0
    preloads = [r for r in rows if "preload_streams" in r]
    assert [(r["preload_streams"], r["adapters"]) for r in preloads] == [(1, 6), (3, 6)]
    assert all(r["mb_per_s"] > 0 for r in preloads)
