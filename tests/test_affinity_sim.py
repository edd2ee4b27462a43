"""bench/affinity_sim.py: the scheduler model serves every request, in arrival order without
affinity, and on fewer adapters a step with it."""

from __future__ import annotations

import math

from bench.affinity_sim import simulate
from bench.serving import make_trace, with_adapters


def _run(n: int, bound: int, count_offers: bool = False) -> dict:
    trace = with_adapters(make_trace(math.inf, 200, None, 0), n, 1.0, 0)
    return simulate(trace, bound, max_seqs=64, budget=512, kv_tokens=30_000, page=16,
                    count_offers=count_offers)  # fmt: skip


def test_affinity_packs_the_same_trace_on_fewer_adapters():
    plain, packed = _run(20, 0), _run(20, 64)
    assert packed["adapter_steps"] < 0.9 * plain["adapter_steps"]
    assert abs(packed["steps"] - plain["steps"]) <= 0.05 * plain["steps"]
    assert plain["admitted"] == packed["admitted"] == 200  # every request, once
    assert plain["ttft_steps_max"] >= plain["ttft_steps_p99"] >= plain["ttft_steps_p50"] > 0
    # No request is admitted more than the bound's admissions beyond its place.
    assert plain["most_admissions_late"] == 0
    assert 0 < packed["most_admissions_late"] <= 64


def test_a_wider_bound_packs_more():
    assert _run(20, 128)["adapter_steps"] < _run(20, 64)["adapter_steps"]


def test_base_model_requests_keep_their_order():
    # No adapters: every request has affinity, so the order (and all counts) are arrival order's.
    assert _run(0, 64) == _run(0, 0)
    assert _run(0, 0)["adapter_steps"] == 0


def test_counting_offers_as_passes_undoes_the_bound():
    """The engine's count before 2026-12-06 (a request passed over whenever one behind it was
    offered, admitted or not) let the requests ahead come due in a saturated engine: fewer
    adapters a step than arrival order, more than the bound allows."""
    plain, offers, packed = _run(20, 0), _run(20, 64, count_offers=True), _run(20, 64)
    assert packed["adapter_steps"] < offers["adapter_steps"] < plain["adapter_steps"]
    assert offers["admitted"] == 200
