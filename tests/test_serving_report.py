"""bench/serving_report.py: what a serving run reports from the clients' results and the step
log."""

from __future__ import annotations

import pytest

from bench.roofline import Ceilings, Roofline
from bench.serving_report import analyse

ROOF = Roofline.for_config(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=100,
                           dtype_bytes=2, ceilings=Ceilings(1e12, 1e14))  # fmt: skip


def _result(sent, first, last, tokens, prompt_len, status="OK"):
    return {"status": status, "sent": sent, "first": first, "last": last, "tokens": tokens,
            "output_len": tokens, "prompt_len": prompt_len, "arrival": sent}  # fmt: skip


def _step(at, seqs, prefill):
    return {"launched_at": at, "gpu_ms": 5.0, "host_ms": 1.0, "seqs": seqs,
            "tokens": seqs + prefill, "prefill_tokens": prefill, "kv_read": 100,
            "kv_written": seqs + prefill, "attn_pairs": 1000, "graph": True}  # fmt: skip


def test_recomputed_tokens_are_prefill_beyond_the_completed_prompts():
    results = [_result(0.0, 0.5, 2.0, 10, 30), _result(0.0, 0.6, 2.5, 12, 20),
               _result(0.0, 0.0, 0.0, 0, 40, status="RESOURCE_EXHAUSTED")]  # fmt: skip
    # both prompts once (50 tokens), then a preempted sequence's 30 + 4 generated again; the
    # step before the first request was sent (a warm-up) is not the run's
    steps = [_step(-1.0, 1, 64), _step(0.1, 2, 50), _step(0.3, 2, 0), _step(1.0, 1, 34),
             _step(1.5, 2, 0)]  # fmt: skip
    row = analyse(results, steps, ROOF)
    assert row["recomputed_tokens"] == 34
    assert row["completed"] == 2 and row["rejected"] == 1 and row["steps"] == 4
    assert row["output_tokens"] == 22 and row["wall_s"] == 2.5


def test_no_preemption_recomputes_nothing():
    results = [_result(0.0, 0.5, 2.0, 10, 30)]
    row = analyse(results, [_step(0.1, 1, 30), _step(0.5, 1, 0)], ROOF)
    assert row["recomputed_tokens"] == 0


def test_vs_base_over_passes_averages_each_n_over_its_passes():
    from bench.serving_report import vs_base_over_passes

    rows = [
        {"run": "inf:8", "pass": 1, "adapters": 0, "output_tokens_per_s": 100.0},
        {"run": "inf:8", "pass": 1, "adapters": 5, "vs_base": 0.94},
        {"run": "inf:8", "pass": 2, "adapters": 0, "output_tokens_per_s": 98.0},
        {"run": "inf:8", "pass": 2, "adapters": 5, "vs_base": 0.96},
        {"run": "inf:8", "pass": 1, "adapters": 9, "vs_base": 0.9, "via": "gateway"},
    ]
    got = {(s["via"], s["adapters"]): s for s in vs_base_over_passes(rows)}
    assert set(got) == {("grpc", 5), ("gateway", 9)}
    five = got["grpc", 5]
    assert five["passes"] == 2 and abs(five["mean"] - 0.95) < 1e-12
    assert (five["min"], five["max"]) == (0.94, 0.96)
    assert got["gateway", 9]["passes"] == 1


def test_gpu_busy_share_is_the_steps_device_time_over_their_span():
    """Steps of 5 ms launched 0.1 s apart from 0.1 to 1.5 s: 4 of them busy the device 20 ms
    of the 1.405 s from the first launch to the last step's end."""
    results = [_result(0.0, 0.5, 2.0, 10, 30)]
    steps = [_step(-1.0, 1, 64), _step(0.1, 2, 10), _step(0.3, 2, 0), _step(1.0, 1, 0),
             _step(1.5, 2, 0)]  # fmt: skip
    row = analyse(results, steps, ROOF)
    assert row["step_gpu_s"] == pytest.approx(0.020)
    assert row["gpu_busy_share"] == pytest.approx(0.020 / 1.405)
    assert analyse(results, [], ROOF)["gpu_busy_share"] is None
