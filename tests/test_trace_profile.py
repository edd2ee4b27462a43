"""bench/trace_profile.py --by-step: kernels between two marker kernels, in the GPU's order, are
the step the first marker opened; the report sums them by step kind."""

from __future__ import annotations

import pytest

from bench.trace_profile import MARKER, by_step_report, kernels_by_step

MARK = f"void at::native::{MARKER}(long)"


def test_kernels_go_to_the_step_their_marker_opened_in_gpu_order():
    kernels = [  # (name, start µs, duration µs), listed out of order
        ("lora_fused_kernel", 35.0, 4.0),
        (MARK, 30.0, 1.0),
        ("nvjet_sm90_tst_gemm", 12.0, 6.0),
        ("_decode_kernel", 20.0, 8.0),
        (MARK, 10.0, 1.0),
        ("_rmsnorm_kernel", 5.0, 2.0),  # before the first marker: no step's
        (MARK, 40.0, 1.0),  # a launch that ran no step
        ("Memcpy DtoH", 42.0, 1.0),
    ]
    steps, found = kernels_by_step(kernels, [7, 8, None])
    assert found == 3
    assert steps == {7: {"gemm": 0.006, "attention decode": 0.008}, 8: {"lora": 0.004}}


def test_a_profile_short_of_markers_says_so():
    steps, found = kernels_by_step([(MARK, 1.0, 1.0), ("_rope_kv_kernel", 2.0, 1.0)], [3, 4])
    assert found == 1 and steps == {3: {"pointwise": 0.001}}


def test_the_report_sums_decode_and_mixed_steps_apart():
    steps = {1: {"lora": 2.0, "gemm": 5.0}, 2: {"lora": 3.0}, 3: {"lora": 10.0, "gemm": 30.0}}
    records = [
        {"step": 1, "prefill_tokens": 0, "gpu_ms": 8.0, "adapter_bytes": 1e9, "tokens": 100},
        {"step": 2, "prefill_tokens": 0, "gpu_ms": 4.0, "adapter_bytes": 2e9, "tokens": 90},
        {"step": 3, "prefill_tokens": 500, "gpu_ms": 45.0, "adapter_bytes": 5e8, "tokens": 600},
        {"step": 4, "prefill_tokens": 0, "gpu_ms": 9.0, "adapter_bytes": 1e9, "tokens": 80},
    ]  # step 4 was not profiled
    report = by_step_report(steps, records)
    decode, mixed = report["decode"], report["mixed"]
    assert decode["steps"] == 2 and decode["tokens"] == 190
    assert decode["kernel_s"] == {"gemm": 0.005, "lora": 0.005}
    assert decode["gpu_s"] == pytest.approx(0.012) and decode["adapter_gb"] == pytest.approx(3.0)
    assert mixed["steps"] == 1 and mixed["kernel_s"] == {"gemm": 0.03, "lora": 0.01}


def test_a_traces_row_holds_its_markers_report_and_steps(capsys):
    from types import SimpleNamespace

    from bench.trace_profile import marked_fields

    marked = SimpleNamespace(markers_found=1, marks=[3, 4], steps={3: {"lora": 1.23456}})
    records = [{"step": 3, "prefill_tokens": 0, "gpu_ms": 2.0, "adapter_bytes": 0, "tokens": 9}]
    fields = marked_fields(marked, records)
    assert fields["markers"] == {"launches": 2, "found": 1}
    assert fields["by_step"]["decode"]["steps"] == 1
    assert fields["steps_profiled"] == {"3": {"lora": 1.2346}}
    assert "holds 1 markers for 2 launches" in capsys.readouterr().out
