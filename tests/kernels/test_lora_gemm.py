"""kernels/lora_gemm.py (the base GEMM with the LoRA expand of long adapter runs in its
epilogue) against the float64 reference: the GEMM alone, the long runs' deltas, and with the
short runs added after it by the fused kernel, the whole step's projection."""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels import lora_ref
from kernels.lora_gemm import GemmLaunch, gemm_lora, gemm_runs
from kernels.lora_layout import K, Q, V
from tests.kernels.pools import build_adapters, lora_tokens
from tests.kernels.sizes import DEVICE, ON_GPU, assert_close

if ON_GPU:
    D_IN, WIDTHS, POOL_W, CFG = 4096, (4096, 1024, 1024), 1024, GemmLaunch()
else:  # small blocks: several row blocks, column blocks and K steps
    D_IN, WIDTHS, POOL_W, CFG = 32, (32, 16, 16), 16, GemmLaunch(16, 16, 16, 4, 1, 2)
MODULES = (Q, K, V)
DTYPES = (torch.bfloat16, torch.float16) if ON_GPU else (torch.float32, torch.bfloat16)


def _rows(scale: int) -> torch.Tensor:
    """Base tokens, a long run across row blocks, decode tokens (runs of one), a run just at
    the threshold and one below it, and a run of an adapter that lacks k."""
    parts = [[-1] * 3, [0] * (20 * scale), [1, 2, 1, 3], [2] * 4, [3] * 3, [4] * (9 * scale)]
    return torch.tensor([r for p in parts for r in p], dtype=torch.int32)


def _setup(dtype, gen):
    ranks = [{Q: 8, K: 8, V: 8}, {Q: 4, K: 4, V: 4}, {Q: 16, K: 16, V: 16},
             {Q: 2, K: 2, V: 2}, {Q: 8, V: 8}]  # fmt: skip
    dims = {m: (D_IN, w) for m, w in zip(MODULES, WIDTHS, strict=True)}
    return build_adapters(ranks, dims, POOL_W, dtype, DEVICE, gen)


def test_gemm_runs_split_the_adapter_tokens():
    rows = _rows(1)
    runs = gemm_runs(rows, block_m=16, min_run=4)
    long_tokens = torch.zeros(rows.numel(), dtype=torch.bool)
    for a, start, end in runs.runs.tolist():
        assert (rows[start:end] == a).all()
        long_tokens[start:end] = True
    assert torch.equal(runs.short_rows, torch.where(long_tokens, -1, rows))
    assert sorted({tuple(r) for r in runs.runs.tolist()}) == [(0, 3, 23), (2, 27, 31), (4, 34, 43)]
    for b in range(len(runs.first) - 1):  # each row block lists exactly the runs meeting it
        listed = runs.runs[runs.first[b] : runs.first[b + 1]].tolist()
        lo, hi = 16 * b, 16 * (b + 1)
        assert all(s < hi and e > lo for _, s, e in listed)
        assert len(listed) == sum(1 for _, s, e in {tuple(r) for r in runs.runs.tolist()}
                                  if s < hi and e > lo)  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemm_alone_is_the_linear_layer(dtype):
    gen = torch.Generator().manual_seed(1)
    t = 37
    x = torch.randn(t, D_IN, generator=gen).to(dtype).to(DEVICE)
    w = (torch.randn(sum(WIDTHS), D_IN, generator=gen) / D_IN**0.5).to(dtype).to(DEVICE)
    y = gemm_lora(x, w, config=CFG)
    assert_close(y, x.double() @ w.double().t(), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_epilogue_adds_the_long_runs_and_the_fused_call_the_rest(dtype):
    gen = torch.Generator().manual_seed(2)
    setup = _setup(dtype, gen)
    rows = _rows(1 if not ON_GPU else 40)
    t = rows.numel()
    x = torch.randn(t, D_IN, generator=gen).to(dtype).to(DEVICE)
    w = (torch.randn(sum(WIDTHS), D_IN, generator=gen) / D_IN**0.5).to(dtype).to(DEVICE)
    pool = setup.pool[0]
    runs = gemm_runs(rows.to(DEVICE), CFG.block_m, min_run=4)
    long_rows = torch.where(runs.short_rows.cpu() >= 0, -1, rows)
    long_tokens = lora_tokens(long_rows, DEVICE)
    h = kernels.lora_shrink(x, pool, setup.index, long_tokens, MODULES, 16)
    y = gemm_lora(x, w, h=h, pool_layer=pool, index=setup.index, runs=runs, modules=MODULES,
                  widths=WIDTHS, max_rank=16, config=CFG)  # fmt: skip

    x64, pool64 = x.double(), pool.double()
    index64 = setup.index._replace(scales=setup.index.scales.double())
    ref = x64 @ w.double().t()
    lora_ref.lora_apply(ref, x64, pool64, index64, lora_tokens(long_rows, DEVICE), MODULES,
                        WIDTHS, 16)  # fmt: skip
    assert_close(y, ref, dtype)

    # the short runs in place after it: the step's whole projection
    kernels.lora_apply(y, x, pool, setup.index, lora_tokens(runs.short_rows, DEVICE), MODULES,
                       WIDTHS, 16)  # fmt: skip
    lora_ref.lora_apply(ref, x64, pool64, index64, lora_tokens(runs.short_rows, DEVICE),
                        MODULES, WIDTHS, 16)  # fmt: skip
    full = x64 @ w.double().t()
    lora_ref.lora_apply(full, x64, pool64, index64, lora_tokens(rows, DEVICE), MODULES, WIDTHS,
                        16)  # fmt: skip
    assert torch.allclose(ref, full)
    assert_close(y, full, dtype)


def test_bad_shapes_are_refused_by_name():
    x = torch.zeros(4, D_IN, device=DEVICE)
    with pytest.raises(ValueError, match="multiple of block_n"):
        gemm_lora(x, torch.zeros(CFG.block_n + 1, D_IN, device=DEVICE), config=CFG)
    with pytest.raises(ValueError, match="K must match"):
        gemm_lora(x, torch.zeros(CFG.block_n, D_IN + 1, device=DEVICE), config=CFG)
