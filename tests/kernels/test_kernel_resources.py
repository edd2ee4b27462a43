"""kernels/lora.py's _NARROW table against what this Triton version compiles for sm_90
(bench/kernel_resources.py, run in a process of its own: the kernel tests here import Triton
in interpreter mode, which cannot compile)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from kernels import lora

REPO = Path(__file__).resolve().parents[2]


def _resources(tmp_path, *flags: str) -> dict:
    """bench.kernel_resources' JSON, run with ``flags`` in a process without the interpreter."""
    out = tmp_path / "resources.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-m", "bench.kernel_resources", *flags, "--json", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr
    return json.loads(out.read_text())


def test_narrow_table_matches_the_compiled_kernels(tmp_path):
    doc = _resources(tmp_path)
    rows = doc["rows"]
    assert {(r["rank_rows"], r["launch"]) for r in rows} == {
        (rows_, name) for rows_ in lora._NARROW for name in ("default", "smaller")
    }
    assert len(rows) == 4 * 2 * len(lora._NARROW)  # the four calls of a layer each
    for n, narrow in lora._NARROW.items():
        # each launch: the least count among the calls whose programs can reach the window
        for launch, count in (("default", narrow.wide_per_sm), ("smaller", narrow.per_sm)):
            reach = [
                r["programs_per_sm"]
                for r in rows
                if r["rank_rows"] == n and r["launch"] == launch and r["reaches_window"]
            ]
            assert reach and count == min(reach), (n, launch, reach)
        assert narrow.per_sm > narrow.wide_per_sm  # or the rule would never help

    # The expand's register cap keeps 5 programs an SM (the one-tile-a-program kernel's count);
    # at the decode step's split of 2 (q/k/v, o, gate/up) the q/k/v call spills 16 bytes a
    # thread, which the timings behind the split include (kernels/lora.py _decode_split).
    two = {(r["call"], r["kernel"]): r for r in doc["two_launch"]}
    assert {kernel for _, kernel in two} == {"shrink", "expand"}
    for (_, kernel), r in two.items():
        if kernel == "expand":
            assert r["registers"] <= lora._EXPAND_MAX_REGISTERS, r
            assert r["programs_per_sm"] >= 5, r
    assert two["qkv", "expand"]["stack_bytes"] <= 16
    assert two["down", "shrink"]["programs_per_sm"] >= 4  # d_in 11008: no decode split


def test_the_pair_body_keeps_the_one_token_launchs_programs_in_place(tmp_path):
    """A decode step's one-token launches (8 rank rows, loads hoisted) compiled for sm_90
    without and with the two-token body (LoraLaunch.gemv_pair): none spills; in place the pair
    body keeps the one-token launch's programs an SM (2), writing the delta it holds one fewer
    than without (3), which is what lora_paths.ONE_TOKEN_PAIRS' note says."""
    rows = _resources(tmp_path, "--pairs")["rows"]
    assert len(rows) == 8 and all(r["hoisted"] and r["stack_bytes"] == 0 for r in rows)
    per_sm = {(r["pairs"], r["call"], r["delta"]): r["programs_per_sm"] for r in rows}
    for call in ("qkv", "o"):
        assert per_sm[True, call, False] == per_sm[False, call, False] == 2
        assert per_sm[True, call, True] == per_sm[False, call, True] - 1 == 2


def test_a_dependent_launch_keeps_the_one_token_launchs_registers(tmp_path):
    """A decode step's one-token launches (q/k/v and o, in place and writing the delta) as
    programmatic dependent launches (kernels/tiles.py lora_pdl_launch): their PTX passes
    launch_gate (griddepcontrol.wait) where the plain launches have none, and the hoisted
    bodies, which look up their slots before the gate and load the weights after it, keep the
    registers and programs an SM of the plain launch, spilling nothing."""
    rows = _resources(tmp_path, "--pdl")["rows"]
    assert len(rows) == 8 and all(r["hoisted"] and r["stack_bytes"] == 0 for r in rows)
    by = {(r["pdl"], r["call"], r["delta"]): r for r in rows}
    for call in ("qkv", "o"):
        for delta in (False, True):
            plain, dependent = by[False, call, delta], by[True, call, delta]
            assert plain["gates"] == 0 and dependent["gates"] >= 3
            assert dependent["registers"] == plain["registers"]
            assert dependent["programs_per_sm"] == plain["programs_per_sm"]
