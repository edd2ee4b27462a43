"""kernels/lora.py's _NARROW table against what this Triton version compiles for sm_90
(bench/kernel_resources.py, run in a process of its own: the kernel tests here import Triton
in interpreter mode, which cannot compile)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from kernels import lora


def test_narrow_table_matches_the_compiled_kernels(tmp_path):
    out = tmp_path / "resources.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run(
        [sys.executable, "-m", "bench.kernel_resources", "--json", str(out)],
        env=env,
        check=True,
        capture_output=True,
        timeout=600,
    )
    rows = json.loads(out.read_text())["rows"]
    assert {(r["rank_rows"], r["launch"]) for r in rows} == {
        (rows_, name) for rows_ in lora._NARROW for name in ("default", "smaller")
    }
    for r in rows:
        assert r["programs_per_sm"] == r["table_programs_per_sm"], r
    # the smaller blocks must hold more programs an SM, or the rule would never help
    by = {(r["rank_rows"], r["launch"]): r["programs_per_sm"] for r in rows}
    assert all(by[(n, "smaller")] > by[(n, "default")] for n in lora._NARROW)
