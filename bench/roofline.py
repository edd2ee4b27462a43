"""A step's roofline: the bytes it must move and the FLOPs it must do, at ceilings measured on
the machine that runs it.

Bytes: every weight once (the seven projections of every layer and the lm_head), the KV cache
read (every context token of every sequence in the step) and written (every computed token), and
each distinct adapter's A and B once when the caller counts them (``adapter_bytes``; the serving
benchmark takes them from the engine's step log). FLOPs: 2
per weight per token, and the attention's 4 per head dimension per (query, key) pair. The bound
is the larger of bytes / copy bandwidth and FLOPs / matmul rate; a step's share of its roofline
is bound / measured time.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import torch

_REPO = Path(__file__).resolve().parents[1]


class Ceilings(NamedTuple):
    copy_bytes_per_s: float  # device-to-device copy, bytes read + written
    matmul_flops_per_s: float  # bf16 (or the device's dtype) GEMM on random data


def _time_ms(fn, device: torch.device, repeats: int) -> float:
    """Median of ``repeats`` timed calls after a warm-up, with events on CUDA."""
    fn()
    if device.type != "cuda":
        import time

        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t))
        return sorted(times)[len(times) // 2]
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def measure_ceilings(device: torch.device) -> Ceilings:
    """Copy bandwidth over a buffer far larger than the L2, and a large bf16 GEMM's rate."""
    cuda = device.type == "cuda"
    n_bytes = 2 * 2**30 if cuda else 64 * 2**20
    src = torch.randn(n_bytes // 4, device=device)
    dst = torch.empty_like(src)
    copy_ms = _time_ms(lambda: dst.copy_(src), device, 20 if cuda else 3)
    n = 8192 if cuda else 512
    dtype = torch.bfloat16 if cuda else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    mm_ms = _time_ms(lambda: a @ b, device, 20 if cuda else 3)
    return Ceilings(2 * n_bytes / (copy_ms / 1e3), 2 * n**3 / (mm_ms / 1e3))


def measure_ceilings_subprocess(device: str) -> Ceilings:
    """measure_ceilings in a process of its own: its memory (and its CUDA context) is gone
    before the service or engine measured takes the device."""
    code = (
        "import json, sys, torch; sys.path.insert(0, sys.argv[1]);"
        "from bench.roofline import measure_ceilings;"
        "print(json.dumps(measure_ceilings(torch.device(sys.argv[2]))._asdict()))"
    )
    out = subprocess.run([sys.executable, "-c", code, str(_REPO), device], check=True,
                         capture_output=True, text=True).stdout  # fmt: skip
    return Ceilings(**json.loads(out.strip().splitlines()[-1]))


class Roofline(NamedTuple):
    weight_bytes: int  # every projection of every layer and the lm_head, once
    linear_params: int  # weights a token multiplies (the same projections)
    kv_bytes_per_token: int  # K and V of one token in every layer
    attn_flops_per_pair: int  # one (query, key) pair in every layer: 4 x heads x head_dim
    ceilings: Ceilings

    @classmethod
    def for_config(
        cls, *, hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int,
        vocab: int, dtype_bytes: int, ceilings: Ceilings,
    ) -> Roofline:  # fmt: skip
        head_dim = hidden // heads
        q, kv = heads * head_dim, kv_heads * head_dim
        per_layer = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * intermediate
        params = layers * per_layer + vocab * hidden
        return cls(
            weight_bytes=params * dtype_bytes,
            linear_params=params,
            kv_bytes_per_token=layers * 2 * kv * dtype_bytes,
            attn_flops_per_pair=layers * 4 * q,
            ceilings=ceilings,
        )

    @classmethod
    def for_shape(cls, shape, ceilings: Ceilings, dtype_bytes: int = 2) -> Roofline:
        """For a bench.bench_models.Shape."""
        return cls.for_config(
            hidden=shape.hidden, layers=shape.layers, heads=shape.heads,
            kv_heads=shape.kv_heads, intermediate=shape.intermediate, vocab=shape.vocab,
            dtype_bytes=dtype_bytes, ceilings=ceilings,
        )  # fmt: skip

    def step_bytes(self, kv_read: int, kv_written: int, adapter_bytes: int = 0) -> int:
        return self.weight_bytes + (kv_read + kv_written) * self.kv_bytes_per_token + adapter_bytes

    def step_flops(self, tokens: int, attn_pairs: int) -> int:
        return 2 * tokens * self.linear_params + attn_pairs * self.attn_flops_per_pair

    def step_bound_ms(
        self, tokens: int, kv_read: int, kv_written: int, attn_pairs: int | None = None,
        adapter_bytes: int = 0,
    ) -> float:  # fmt: skip
        """The step's floor in ms. ``attn_pairs`` defaults to ``kv_read`` (one query row per
        sequence, as in decode)."""
        pairs = kv_read if attn_pairs is None else attn_pairs
        c = self.ceilings
        by_bytes = self.step_bytes(kv_read, kv_written, adapter_bytes) / c.copy_bytes_per_s
        by_flops = self.step_flops(tokens, pairs) / c.matmul_flops_per_s
        return 1e3 * max(by_bytes, by_flops)

    def step_phase_bound_ms(
        self, tokens: int, kv_read: int, kv_written: int, attn_pairs: int, adapter_bytes: int = 0
    ) -> float:
        """A tighter floor for steps whose parts run one after the other: the projections
        (weights and adapters once, or their FLOPs) plus the attention (the KV cache, or its
        FLOPs), each at its own bound. A mixed step's GEMMs are compute-bound while its decode
        attention is memory-bound; step_bound_ms lets one hide the other, this does not."""
        c = self.ceilings
        gemm = max(
            (self.weight_bytes + adapter_bytes) / c.copy_bytes_per_s,
            2 * tokens * self.linear_params / c.matmul_flops_per_s,
        )
        attn = max(
            (kv_read + kv_written) * self.kv_bytes_per_token / c.copy_bytes_per_s,
            attn_pairs * self.attn_flops_per_pair / c.matmul_flops_per_s,
        )
        return 1e3 * (gemm + attn)
