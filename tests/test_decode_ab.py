"""bench/decode_ab.py's step spans from a profiler trace (the GPU comparison itself needs CUDA)."""

from __future__ import annotations

import pytest

from bench.bench_models import SHAPES
from bench.decode_ab import kv_gib, spans


def _kernel(ts: float, dur: float) -> dict:
    return {"cat": "kernel", "ts": ts, "dur": dur}


def test_spans_cut_steps_at_the_host_gaps_and_span_both_streams():
    # step 1: two kernels, the second on another stream overlapping the first, ending last
    # step 2: three kernels with small gaps; host gaps of 800 and 1500 µs between steps
    events = [
        _kernel(0.0, 100.0), _kernel(10.0, 120.0),
        _kernel(930.0, 50.0), _kernel(985.0, 20.0), _kernel(1010.0, 40.0),
        _kernel(2550.0, 10.0),
        {"cat": "cpu_op", "ts": 5.0, "dur": 9000.0},  # host events do not count
    ]  # fmt: skip
    got = spans({"traceEvents": events[::-1]}, 3)
    assert got == pytest.approx([0.130, 0.120, 0.010])


def test_spans_refuse_a_trace_with_fewer_kernels_than_steps():
    with pytest.raises(RuntimeError, match="2 kernels in 3 steps"):
        spans({"traceEvents": [_kernel(0.0, 1.0), _kernel(5.0, 1.0)]}, 3)


def test_kv_gib_counts_both_halves_of_every_layer():
    shape = SHAPES["llama-7b"]  # 32 layers, kv width 4096: 512 KiB of K and V a token in bf16
    assert kv_gib(shape, 256, 424) == pytest.approx(256 * 424 * 512 / 2**20)
