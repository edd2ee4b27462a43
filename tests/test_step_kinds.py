"""bench/step_kinds.py: a serving run's steps grouped by kind against their two floors."""

from __future__ import annotations

import pytest

from bench.roofline import Ceilings, Roofline
from bench.step_kinds import group

# 1 GB of weights, a token's KV 1 MB, 1 GFLOP of linear work a token, 1 MFLOP an attention pair
ROOF = Roofline(
    weight_bytes=10**9, linear_params=5 * 10**8, kv_bytes_per_token=10**6,
    attn_flops_per_pair=10**6, ceilings=Ceilings(copy_bytes_per_s=1e12, matmul_flops_per_s=1e15),
)  # fmt: skip


def _step(seqs, tokens, prefill, kv_read, gpu_ms, pairs=None):
    return {"seqs": seqs, "tokens": tokens, "prefill_tokens": prefill, "kv_read": kv_read,
            "kv_written": tokens, "attn_pairs": kv_read if pairs is None else pairs,
            "adapter_bytes": 0, "gpu_ms": gpu_ms}  # fmt: skip


def test_steps_are_grouped_by_kind_against_both_floors():
    decode = _step(100, 100, 0, 900, gpu_ms=2.5)  # bytes: 1 GB + 1 GB of KV -> 2 ms
    # 2000 tokens: 2 TFLOP of GEMMs -> 2 ms, beside 1 GB of weights (1 ms) and 1 GB of KV
    # (1 ms): the roofline overlaps them (2 ms), the phase floor adds them (2 + 1 = 3 ms)
    mixed = _step(100, 2000, 1900, 0, gpu_ms=4.0, pairs=0)
    mixed["kv_written"] = 1000
    small = _step(8, 8, 0, 100, gpu_ms=1.0)
    rows = {r["kind"]: r for r in group([decode, decode, mixed, small], ROOF)}
    assert set(rows) == {"decode 64+", "mixed 64+", "decode <64"}
    d, m = rows["decode 64+"], rows["mixed 64+"]
    assert d["steps"] == 2 and d["gpu_s"] == 0.005
    assert d["roofline_s"] == pytest.approx(0.004) and d["roofline_share"] == 0.8
    assert d["phase_floor_s"] == pytest.approx(0.004)  # decode: GEMMs and KV both bytes
    assert m["roofline_s"] == pytest.approx(0.002) and m["phase_floor_s"] == pytest.approx(0.003)
    assert (m["roofline_share"], m["phase_share"]) == (0.5, 0.75)


def test_occupancy_is_the_runs_fullest_steps():
    """The 90th percentile of a step's sequences and KV tokens read: a run whose KV cache held
    fewer tokens (a LoRA run's adapters take pool pages) shows it, however its steps split."""
    from bench.step_kinds import occupancy

    full = [_step(seqs, seqs, 0, 400 * seqs, gpu_ms=1.0) for seqs in range(1, 513)]
    capped = [_step(min(seqs, 400), seqs, 0, 400 * min(seqs, 400), 1.0) for seqs in range(1, 513)]
    assert occupancy(full) == {"steps": 512, "seqs_p90": 461, "kv_read_p90": 184400}
    assert occupancy(capped) == {"steps": 512, "seqs_p90": 400, "kv_read_p90": 160000}
