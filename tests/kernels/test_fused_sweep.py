"""bench/fused_sweep.py on tiny shapes: the default launch it compares every point with matches
the float64 reference, and a fast but wrong launch is caught and never ranked."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from bench import fused_sweep as fs
from bench import kernels as bk
from kernels import lora

# The default point (block 32), then block 16 at stages 2 and 4: under the interpreter stages
# change nothing, so the two compute the same; the test makes stages 4 skip the work.
GRID = dataclasses.replace(fs.TINY, ranks=(8,), stages=(2, 4), parts=(None,))


def test_tiny_sweep_ranks_only_checked_points(tmp_path, monkeypatch):
    original = lora.lora_apply

    def fast_but_wrong(y, x, *args, config=None, **kwargs):
        if config is not None and config.stages == 4:
            return  # no work at all: the fastest launch there is, and a wrong one
        original(y, x, *args, config=config, **kwargs)

    monkeypatch.setattr(lora, "lora_apply", fast_but_wrong)
    path = tmp_path / "sweep.json"
    result = fs.run_sweep(GRID, str(path))

    (case,) = result["cases"]
    assert case["default_vs_reference"]["ok"]
    assert case["default_vs_reference"]["norm"] <= fs.TOL_NORM
    status = {(p["block"], p["stages"]): p["status"] for p in case["points"]}
    assert status == {(32, 3): "ok", (16, 2): "ok", (16, 4): "wrong"}
    ok = [p for p in case["points"] if p["status"] == "ok"]
    assert all(p["graph_us"] > 0 and p["norm_err"] <= fs.TOL_NORM for p in ok)
    assert case["best"]["stages"] != 4 and all(p["stages"] != 4 for p in case["top"])
    assert case["best"]["graph_us"] == min(p["graph_us"] for p in ok)
    assert case["default"]["block"] == 32 and case["default"]["parts"] is None
    assert json.loads(path.read_text())["cases"][0]["best"] == case["best"]
    assert bk.DEV == torch.device("cuda") and bk.POOL_W == 4096  # bench/kernels.py restored


def test_grid_and_config():
    full = fs.SweepConfig()
    # fused_config's own launches at W = 4096: blocks and warps
    for rank, block, warps in ((16, 256, 4), (64, 256, 8)):
        points = fs.grid(full, rank, 256)
        assert points[0] == fs.SweepPoint(block, None, 3, warps)
        assert len(points) == 1 + 4 * 5 * 3 * 3
    # every batch shares the compiled kernels of a rank and launch; on sm_90 fused_config's
    # smaller expand blocks for calls that fit one wave of them only add their own
    tasks = fs.compile_tasks(full)
    assert len([t for t in tasks if t.block_n is None]) == 2 * 4 * 3 * 3
    for t in tasks:
        if t.block_n is not None:
            assert any(fs.default_point(full, t.rank, b).block_n == t.block_n
                       for b in full.batches)  # fmt: skip
    with pytest.raises(ValueError, match="blocks must be powers of two"):
        fs.SweepConfig(blocks=(48,))
    with pytest.raises(ValueError, match="ranks must be in"):
        fs.SweepConfig(ranks=(256,))
    with pytest.raises(ValueError, match="parts must be positive"):
        fs.SweepConfig(parts=(0,))
