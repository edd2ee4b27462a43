"""Test sizes and tolerances: small shapes under the CPU interpreter, real ones on a GPU.

Errors are measured against a float64 reference fed the same (rounded) inputs, as
norm = ||out - ref|| / ||ref|| and peak = max|out - ref| / max|ref|. One tolerance per dtype,
from its unit roundoff u (fp32 2^-24, fp16 2^-11, bf16 2^-8): outputs are rounded once to the
dtype and the kernels round one intermediate (h, or the softmax weights) to it, so the norm
error stays near u and the peak within a few u.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kernels.lora_layout import DOWN, GATE, UP, K, O, Q, V

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")


class Tol(NamedTuple):
    norm: float
    peak: float


TOL = {
    torch.float32: Tol(norm=1e-5, peak=1e-4),
    torch.float16: Tol(norm=3e-3, peak=1e-2),
    torch.bfloat16: Tol(norm=2e-2, peak=6e-2),
}

# fp32 only under the interpreter (the CPU serving dtype); the GPU runs serve fp16 and bf16.
DTYPES = (
    (torch.float16, torch.bfloat16) if ON_GPU else (torch.float32, torch.float16, torch.bfloat16)
)


def errors(out: torch.Tensor, ref: torch.Tensor) -> Tol:
    diff = (out.double() - ref.double()).abs()
    if torch.isnan(out).any():
        return Tol(float("inf"), float("inf"))
    scale_n = ref.double().norm().clamp_min(1e-30)
    scale_p = ref.double().abs().max().clamp_min(1e-30)
    return Tol(float(diff.norm() / scale_n), float(diff.max() / scale_p))


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    err, tol = errors(out, ref), TOL[dtype]
    assert err.norm <= tol.norm and err.peak <= tol.peak, f"{dtype}: error {err} over {tol}"


class LoraShape(NamedTuple):
    """One call's geometry: pool width, the slices' modules, d_in, and each slice's d_out."""

    name: str
    width: int
    modules: tuple[int, ...]
    d_in: int
    widths: tuple[int, ...]


if ON_GPU:
    # Llama-2-7B (MHA, W = 32 x 128) and Llama-3-8B (GQA, W = 8 x 128) projections
    LORA_SHAPES = (
        LoraShape("qkv_mha", 4096, (Q, K, V), 4096, (4096, 4096, 4096)),
        LoraShape("qkv_gqa", 1024, (Q, K, V), 4096, (4096, 1024, 1024)),
        LoraShape("gate_up", 4096, (GATE, UP), 4096, (11008, 11008)),
        LoraShape("down_gqa", 1024, (DOWN,), 14336, (4096,)),
    )
    RANKS = (8, 16, 64)
    BATCHES = (1, 64, 512)
    POP_BATCH = 256  # tokens in the popularity tests
    PREFILL_TOKENS = 1500
    ADAPTERS = 96
    SEG_CAPACITY = 1024  # fixed, as the engine's (one compiled kernel for all batches)
else:
    LORA_SHAPES = (
        LoraShape("qkv_gqa", 16, (Q, K, V), 48, (48, 16, 16)),  # W divides the blocks
        LoraShape("gate_up_odd", 24, (GATE, UP), 40, (52, 52)),  # chunks straddle blocks
        LoraShape("down_odd", 16, (DOWN,), 52, (40,)),  # d_in past the last chunk boundary
        LoraShape("o", 16, (O,), 40, (40,)),
    )
    RANKS = (1, 16, 24)
    BATCHES = (1, 17)
    POP_BATCH = 13
    PREFILL_TOKENS = 40
    ADAPTERS = 5
    SEG_CAPACITY = None  # tokens + 3: the interpreter runs every (empty) program


class AttnShape(NamedTuple):
    name: str
    heads: int
    kv_heads: int
    head_dim: int
    page_size: int


if ON_GPU:
    ATTN_SHAPES = (
        AttnShape("mha_llama2", 32, 32, 128, 16),
        AttnShape("gqa_llama3", 32, 8, 128, 16),
        AttnShape("gqa7_d64", 28, 4, 64, 32),
    )
    DECODE_LENS = (1, 17, 700, 4099)
    DECODE_BATCH = 48
    PREFILL_LENS = ((1000, 1000), (333, 200), (17, 17), (2100, 1))  # (context, queries)
else:
    ATTN_SHAPES = (
        AttnShape("mha", 2, 2, 16, 4),
        AttnShape("gqa3_odd_dim", 6, 2, 12, 4),
        AttnShape("gqa4_page8", 4, 1, 16, 8),
    )
    DECODE_LENS = (1, 5, 37, 70)
    DECODE_BATCH = 4
    PREFILL_LENS = ((21, 21), (30, 7), (5, 5), (40, 1))
