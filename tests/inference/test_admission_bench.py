"""bench/admission.py's pieces: the step-time fit and one small trace through the scheduler."""

from __future__ import annotations

import pytest

from bench.admission import StepModel, saturating_base, simulate
from bench.step_compare import split_runs


def _step(seqs, tokens, prefill, kv, pairs=0):
    return dict(seqs=seqs, tokens=tokens, prefill_tokens=prefill, kv_read=kv, attn_pairs=pairs)


def test_the_fit_takes_the_base_models_steps_of_requests_all_at_once():
    """Of a serving run's traces (split by bench/step_compare.py), the base model's at
    inf:N, whichever order the runs came in; None when the run has none."""
    rate, once, lora = [_step(9, 9, 0, 10)] * 2, [_step(300, 300, 0, 10)] * 3, [_step(1, 1, 0, 1)]
    results = [{"run": "40:15", "adapters": 0, "steps": 2},
               {"run": "inf:1000", "adapters": 0, "steps": 3},
               {"run": "inf:1000", "adapters": 100, "steps": 1}]  # fmt: skip
    assert saturating_base(split_runs(rate + once + lora, results)) == once
    assert saturating_base(split_runs(rate, results[:1])) is None


def test_step_model_recovers_a_linear_cost():
    """Steps timed by a known linear cost fit back to it, decode and prefill steps apart."""
    steps = []
    for seqs in (64, 100, 300, 512):
        for kv in (20_000, 90_000, 200_000):
            s = _step(seqs, seqs, 0, kv)
            s["gpu_ms"] = 4.0 + 0.025 * seqs + 1e-4 * kv
            steps.append(s)
            for prefill in (200, 700, 1500):
                m = _step(seqs, seqs + prefill, prefill, kv, pairs=prefill * prefill // 2 + kv)
                m["gpu_ms"] = 4.0 + 0.02 * m["tokens"] + 1.2e-4 * kv + 2e-6 * m["attn_pairs"]
                steps.append(m)
    cost = StepModel(steps)
    assert cost.decode == pytest.approx([4.0, 0.025, 1e-4], rel=1e-6)
    assert cost.mixed == pytest.approx([4.0, 0.02, 1.2e-4, 2e-6], rel=1e-6)
    assert cost.ms(_step(200, 200, 0, 50_000)) == pytest.approx(4.0 + 5.0 + 5.0)


def _small_cost() -> StepModel:
    """A fit to a few small steps of a known linear cost."""
    steps = [_step(8, 8, 0, 1000 * k) for k in range(1, 5)]
    steps += [_step(8, 100 * k, 90 * k, 1000 * k, 500 * k) for k in range(1, 6)]
    for s in steps:
        s["gpu_ms"] = 1.0 + s["tokens"] * 0.01 + s["kv_read"] * 1e-4
    return StepModel(steps)


def test_the_reserve_spares_a_small_pool_its_preemptions(tiny_models):
    """Thirty requests at once on a pool of 200 pages: every request completes either way; with
    the scheduler's decode reserve fewer are preempted and fewer tokens recomputed."""
    cost = _small_cost()
    model = tiny_models.model("tiny-llama")
    off = simulate(model, "inf:30", False, cost.ms, num_pages=200)
    on = simulate(model, "inf:30", True, cost.ms, num_pages=200)
    assert off["requests"] == on["requests"] == 30
    assert off["preemptions"] > on["preemptions"]
    assert off["recomputed_tokens"] > on["recomputed_tokens"] >= 0
    assert on["modeled_gpu_s"] > 0 and on["modeled_ttft_p99_s"] >= on["modeled_ttft_p50_s"]


def test_without_the_forward_pass_the_scheduler_decides_alike(tiny_models):
    """The trace's steps (sequences, tokens, context read, adapters) are the same whether the
    model runs or every logit is zero: requests ignore EOS, so tokens' values decide nothing."""
    cost = _small_cost()
    model = tiny_models.model("tiny-llama")
    run = simulate(model, "inf:12", True, cost.ms, num_pages=200)
    skip = simulate(model, "inf:12", True, cost.ms, num_pages=200, compute=False)
    assert run["steps"] == skip["steps"] > 12 and run["steps_hash"] == skip["steps_hash"]
    assert run["modeled_gpu_s"] == skip["modeled_gpu_s"]
