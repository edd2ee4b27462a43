"""bench/step_compare.py: a serving run's step log split into its traces and compared by bin."""

from __future__ import annotations

import pytest

from bench.bench_models import SHAPES
from bench.serving import WORKLOADS
from bench.step_compare import (
    activation_bytes_per_token,
    bytes_line,
    compare,
    over_fit,
    schedule,
    split_runs,
    totals,
)


def _step(seqs, gpu_ms, prefill=0, tokens=None, adapters=0, nbytes=0, kv=0, pairs=0):
    return {"seqs": seqs, "tokens": tokens or seqs, "prefill_tokens": prefill, "gpu_ms": gpu_ms,
            "adapters": adapters, "adapter_bytes": nbytes, "kv_read": kv,
            "attn_pairs": pairs}  # fmt: skip


def _mixed_ms(tokens, kv, pairs):
    """A base mixed step's GPU ms: 5 + 0.02 a token + 0.0005 a context token + 0.00001 an
    attention pair (what over_fit's StepModel fits exactly)."""
    return 5 + 0.02 * tokens + 0.0005 * kv + 0.00001 * pairs


def test_runs_are_split_by_their_step_counts_after_the_warm_up():
    warm_up = [_step(1, 99.0)] * 3
    base = [_step(64, 10.0)] * 5
    base_rate = [_step(30, 6.0)] * 2  # the same adapters (none) on a second trace
    lora = [_step(64, 12.0, adapters=70, nbytes=10**9)] * 6
    results = [{"run": "inf:1000", "adapters": 0, "pass": 1, "steps": 5},
               {"run": "40:15", "adapters": 0, "pass": 1, "steps": 2},
               {"run": "inf:1000", "adapters": 100, "steps": 6}]  # fmt: skip
    runs = split_runs(warm_up + base + base_rate + lora, results)
    assert runs["inf:1000", 0, 1] == base and runs["inf:1000", 100, 1] == lora
    assert runs["40:15", 0, 1] == base_rate
    with pytest.raises(ValueError, match="count 16 steps, the log holds 13"):
        split_runs(base + base_rate + lora, [*results, {"adapters": 5, "steps": 3}])


def test_bins_compare_medians_and_the_bytes_bound():
    base = [_step(70, t) for t in (10.0, 10.2, 9.8, 10.1)]
    base += [_step(40, 8.0, prefill=600, tokens=800)] * 4
    lora = [_step(75, t, adapters=70, nbytes=2 * 10**9) for t in (12.0, 12.4, 11.6, 12.2, 50.0)]
    lora += [_step(60, 11.0, prefill=600, tokens=900, nbytes=10**9)] * 4
    lora += [_step(100, 20.0)] * 3  # a bin the base run lacks: no row
    (decode,) = compare(base, lora, bandwidth=1e12, mixed=False)
    assert decode == {"batch": 64, "steps": 5, "base_ms": 10.05, "lora_ms": 12.2,
                      "extra_ms": 2.15, "adapters": 70, "adapter_bytes_ms": 2.0}  # fmt: skip
    (mixed,) = compare(base, lora, bandwidth=1e12, mixed=True)
    assert mixed["tokens"] == 768 and mixed["extra_ms"] == 3.0
    assert mixed["adapter_bytes_ms"] == 1.0


def test_totals_say_what_the_adapter_bytes_alone_would_allow():
    base = [_step(64, 10.0)] * 4  # 40 ms
    lora = [_step(64, 12.5, adapters=70, nbytes=10**9)] * 4  # 50 ms, 1 ms of bytes a step
    t = totals(base, lora, bandwidth=1e12)
    assert (t["base_s"], t["lora_s"], t["adapter_bytes_s"]) == (0.04, 0.05, 0.004)
    assert t["gpu_ratio"] == 0.8 and t["bytes_bound_ratio"] == round(40 / 44, 4)
    assert t["extra_over_bytes"] == 2.5
    assert totals(base, base, 1e12)["extra_over_bytes"] is None  # no adapters, no bytes
    assert t["activation_bytes_s"] is None and t["traffic_bound_ratio"] is None


def test_totals_add_the_lora_calls_activation_traffic():
    """With ``token_bytes`` every token of a step with adapters moves that many bytes more (its
    calls' inputs and outputs): 4 steps of 64 tokens at 15.625 MB a token take 4 ms at 1 TB/s,
    beside the adapters' 4 ms; steps without adapters move none."""
    base = [_step(64, 10.0)] * 4
    lora = [_step(64, 12.5, adapters=70, nbytes=10**9)] * 4 + [_step(64, 10.0)]
    t = totals(base, lora, bandwidth=1e12, token_bytes=15_625_000)
    assert t["activation_bytes_s"] == 0.004
    assert t["traffic_bound_ratio"] == round(40 / 48, 4)
    assert t["bytes_bound_ratio"] == round(40 / 44, 4)


def test_activation_bytes_per_token_follow_the_engines_calls():
    """A token's LoRA calls a step: q/k/v read the hidden state once and read and write their
    three outputs, o reads its input and reads and writes the hidden state, gate/up share their
    input, down reads the MLP's width; bf16, every layer. Llama-7B (4096 wide, 32 layers, MLP
    11008): S1 (q/k/v/o) 40960 elements a layer, 2.62 MB a token; q and v only 20480."""
    llama = SHAPES["llama-7b"].base()
    assert activation_bytes_per_token(llama, WORKLOADS["S1"][1]) == 40960 * 2 * 32
    assert activation_bytes_per_token(llama, ("q_proj", "v_proj")) == 20480 * 2 * 32
    mlp = (4096 + 2 * 2 * 11008) + (11008 + 2 * 4096)
    assert activation_bytes_per_token(llama, ("gate_proj", "up_proj", "down_proj")) == (
        mlp * 2 * 32
    )


def test_over_fit_charges_each_lora_step_beyond_the_base_models_cost_at_its_shape():
    # Base decode steps cost 2 + 0.01 a sequence + 0.001 a context token; mixed ones 5 + 0.02 a
    # token + 0.0005 a context token + 0.00001 an attention pair (exact, so the fit is too).
    def dec(seqs, kv):
        return 2 + 0.01 * seqs + 0.001 * kv

    mix = _mixed_ms
    base = [_step(s, dec(s, kv), kv=kv) for s, kv in ((64, 9000), (128, 30000), (300, 50000),
                                                      (200, 70000))]  # fmt: skip
    base += [_step(300, mix(t, kv, p), prefill=t - 300, tokens=t, kv=kv, pairs=p)
             for t, kv, p in ((1000, 40000, 10**6), (2048, 60000, 3 * 10**6),
                              (700, 20000, 5 * 10**5), (1500, 80000, 2 * 10**6),
                              (1200, 30000, 4 * 10**6))]  # fmt: skip
    lora = [_step(100, dec(100, 20000) + 1.5, kv=20000, nbytes=5 * 10**9)]
    lora += [_step(250, dec(250, 40000) + 0.5, kv=40000, nbytes=2 * 10**9)]
    lora += [_step(300, mix(900, 30000, 10**6) + 3.0, prefill=600, tokens=900, kv=30000,
                   pairs=10**6, nbytes=10**9)]  # fmt: skip
    paths = ("fused, one-token tiles", "fused, one-token tiles", "fused, narrow")
    for s, path in zip(lora, paths, strict=True):
        s["lora"] = path
    f = over_fit(base, lora, bandwidth=1e12)
    decode, mixed = f["rows"]
    assert (decode["kind"], decode["path"], decode["steps"]) == ("decode", paths[0], 2)
    assert decode["extra_s"] == pytest.approx(0.002, abs=1e-6)
    assert decode["adapter_bytes_s"] == pytest.approx(0.007)
    assert (mixed["kind"], mixed["steps"]) == ("mixed", 1)
    assert mixed["extra_s"] == pytest.approx(0.003, abs=1e-6)
    # The LoRA steps' shapes at the base model's cost, against the base run's own GPU time.
    fit = dec(100, 20000) + dec(250, 40000) + mix(900, 30000, 10**6)
    assert f["schedule_s"] == round((fit - sum(s["gpu_ms"] for s in base)) / 1e3, 3)
    # Two decode steps: the line through them; one mixed step: no line.
    (decode_line,) = f["lines"].values()
    assert f["lines"].keys() == {"decode"} and decode_line["steps"] == 2
    assert decode_line["per_bytes"] == pytest.approx(1 / 3, abs=1e-3)  # 1.0 ms over 3 ms of bytes
    assert decode_line["fixed_ms"] == pytest.approx(0.5 - 2 / 3, abs=1e-3)


def test_decode_sized_mixed_steps_are_their_own_kind_and_count_in_the_mixed_line():
    # Base steps that cost _mixed_ms (context and pairs vary apart from tokens so the fit is
    # exact) and 2 + 0.01 a sequence (decode).
    mix = _mixed_ms
    base = [_step(s, 2 + 0.01 * s + 0.001 * kv, kv=kv) for s, kv in ((64, 9000), (128, 30000),
                                                                      (300, 50000))]  # fmt: skip
    base += [_step(300, mix(t, kv, p), prefill=t - 300, tokens=t, kv=kv, pairs=p)
             for t, kv, p in ((400, 40000, 10**6), (2048, 60000, 3 * 10**6),
                              (700, 20000, 5 * 10**5), (1500, 80000, 2 * 10**6),
                              (1200, 30000, 4 * 10**6))]  # fmt: skip
    # Two mixed steps, one of 512 tokens (decode-sized) and one of 513, 2 and 4 ms beyond.
    lora = [_step(300, mix(t, 30000, 10**6) + extra, prefill=t - 300, tokens=t, kv=30000,
                  pairs=10**6, nbytes=nbytes)
            for t, extra, nbytes in ((512, 2.0, 10**9), (513, 4.0, 3 * 10**9))]  # fmt: skip
    for s in lora:
        s["lora"] = "fused, narrow"
    f = over_fit(base, lora, bandwidth=1e12)
    large, small = f["rows"]
    assert (small["kind"], small["steps"]) == ("mixed, small", 1)
    assert small["extra_s"] == pytest.approx(0.002, abs=1e-6)
    assert (large["kind"], large["steps"]) == ("mixed", 1)
    assert large["extra_s"] == pytest.approx(0.004, abs=1e-6)
    (line,) = f["lines"].values()
    assert f["lines"].keys() == {"mixed"} and line["steps"] == 2  # both kinds of mixed step
    assert line["per_bytes"] == pytest.approx(1.0, abs=1e-3)  # 2 ms more on 2 ms more bytes


def test_the_bytes_line_splits_a_fixed_cost_from_a_cost_a_byte():
    # Steps that cost 0.4 ms each plus 1.5x their bytes' time, with noise that cancels.
    bytes_ms = [0.2, 0.5, 1.0, 1.2, 0.2, 0.5, 1.0, 1.2]
    noise = [0.05, -0.05, 0.02, -0.02, -0.05, 0.05, -0.02, 0.02]
    extra = [0.4 + 1.5 * b + e for b, e in zip(bytes_ms, noise, strict=True)]
    line = bytes_line(bytes_ms, extra)
    assert line["fixed_ms"] == pytest.approx(0.4, abs=1e-3)
    assert line["per_bytes"] == pytest.approx(1.5, abs=1e-3)
    assert line["mean_bytes_ms"] == pytest.approx(0.725)
    assert bytes_line([1.0, 1.0, 1.0], [2.0, 2.1, 1.9]) is None  # bytes that do not vary
    assert bytes_line([1.0], [2.0]) is None


def test_schedule_counts_the_steps_their_decode_batch_and_the_kv_peak():
    base = [_step(100, 10.0, kv=50_000)] * 3 + [_step(40, 8.0, prefill=600, tokens=800, kv=60_000)]
    lora = [_step(90, 10.5, adapters=60, kv=47_000), _step(80, 10.4, adapters=60, kv=45_000)] * 2
    lora += [_step(40, 8.2, prefill=600, tokens=800, adapters=3, kv=52_000)]
    m = schedule(base, lora)
    assert m["base"] == {"steps": 4, "decode_mean_batch": 100.0, "peak_kv_tokens": 60_000}
    assert m["lora"] == {"steps": 5, "decode_mean_batch": 85.0, "peak_kv_tokens": 52_000}
    assert schedule([], [])["base"] == {"steps": 0, "decode_mean_batch": None,
                                        "peak_kv_tokens": 0}  # fmt: skip
