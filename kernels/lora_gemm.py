"""The base GEMM with the LoRA expand in its epilogue: y = x · Wᵀ + scale · h · Bᵀ per token,
for the tokens of long runs of one adapter (a prompt's prefill chunk), in one pass over y.

Why: with cuBLAS doing the GEMM, a step's LoRA delta has to meet the GEMM's output in memory,
either added after it (the fused kernel reads y and writes it back) or written first for the
GEMM to add (LoraContext.addend: the delta written, then read back by cuBLAS's beta = 1). On a
prefill-sized step that traffic, not the adapters' bytes, is most of the LoRA time (H100, one
layer's q/k/v and o on two 1024-token prompts: 81 µs beyond 363 of GEMMs; docs/benchmarks.md).
Here the GEMM's own program adds each run's h · Bᵀ to its accumulator before the one store, so
the delta never goes to memory; h = x · Aᵀ (a few rank columns a token) comes from the shrink
launch (kernels/lora.py lora_shrink) before it.

A program owns a BLOCK_M x BLOCK_N tile of y inside one slice (every slice's width a multiple of
BLOCK_N). After its K loop it walks the runs that meet its rows, from a table the host wrote
(gemm_runs: per row block, the runs of at least min_run tokens that meet it), and for each adds
dot(h rows of the run, the run's adapter's Bᵀ block) times the adapter's scale: one 16-row dot
per run and column block, which is why short runs (decode tokens, each its own run) are left to
the fused kernel after the GEMM, in place on their rows only (gemm_runs gives their rows too).

Rounding matches the addend's: h rounded once to the output dtype (the shrink's output), the
GEMM's fp32 accumulator plus the delta in fp32 rounded once.

A prototype for bench/lora_addend.py's --gemm: the engine does not take this path yet.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.lora import _bt_block
from kernels.lora_args import MAX_SLICES
from kernels.tiles import dot_f32


class GemmLaunch(NamedTuple):
    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    warps: int = 8
    stages: int = 3
    group_m: int = 8  # row blocks of one column band launched together (L2 reuse of W)


class GemmRuns(NamedTuple):
    """What gemm_lora reads of a step's adapter runs (gemm_runs)."""

    runs: torch.Tensor  # [R, 3] int32: (adapter row, first token, end token), by row block
    first: torch.Tensor  # [row blocks + 1] int32: row block b's runs are runs[first[b]:first[b+1]]
    block_m: int
    short_rows: torch.Tensor  # [T] int32: token_lora with the long runs' tokens set to -1


def gemm_runs(token_lora: torch.Tensor, block_m: int, min_run: int) -> GemmRuns:
    """The epilogue's runs of ``token_lora`` (each token's adapter row, -1 none), on the host:
    maximal runs of one adapter of at least ``min_run`` tokens, listed once for each row block
    of ``block_m`` tokens they meet; and the rows of the other adapter tokens, for the in-place
    call after the GEMM."""
    rows = token_lora.tolist()
    t = len(rows)
    short = list(rows)
    long_runs = []
    i = 0
    while i < t:
        j = i
        while j < t and rows[j] == rows[i]:
            j += 1
        if rows[i] >= 0 and j - i >= min_run:
            long_runs.append((rows[i], i, j))
            short[i:j] = [-1] * (j - i)
        i = j
    blocks = triton.cdiv(t, block_m) if t else 0
    listed: list[tuple[int, int, int]] = []
    first = [0]
    for b in range(blocks):
        lo, hi = b * block_m, min(t, (b + 1) * block_m)
        listed += [r for r in long_runs if r[1] < hi and r[2] > lo]
        first.append(len(listed))
    dev = token_lora.device
    return GemmRuns(
        torch.tensor(listed or [(0, 0, 0)], dtype=torch.int32, device=dev).reshape(-1, 3),
        torch.tensor(first, dtype=torch.int32, device=dev),
        block_m,
        torch.tensor(short, dtype=torch.int32, device=dev),
    )


@triton.jit
def _pick3(s, v0, v1, v2):
    return tl.where(s == 0, v0, tl.where(s == 1, v1, v2))


@triton.jit
def _gemm_lora_kernel(
    x_ptr, stride_xt, w_ptr, stride_wn, y_ptr, stride_yt,
    # h [T, slices, >= BLOCK_R] (the shrink's output, the output dtype)
    h_ptr, stride_ht, stride_hs,
    pool_ptr, stride_half, stride_slot,
    table_ptr, stride_table, ranks_ptr, b_off_ptr, scales_ptr, stride_idx, stride_scale,
    runs_ptr, first_ptr,
    T, MAX_RANK,
    K: tl.constexpr, W: tl.constexpr, N: tl.constexpr,
    M0: tl.constexpr, M1: tl.constexpr, M2: tl.constexpr,
    N0: tl.constexpr, N1: tl.constexpr,  # the first two slices' widths (the third: the rest)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    GROUP_M: tl.constexpr, LORA: tl.constexpr, ALIGNED: tl.constexpr, DOT_F32: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    blocks_m = tl.cdiv(T, BLOCK_M)
    blocks_n: tl.constexpr = N // BLOCK_N
    per_group = GROUP_M * blocks_n
    g = pid // per_group
    first_m = g * GROUP_M
    size_m = tl.minimum(blocks_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < T
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xt + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, K, BLOCK_K):  # K is a multiple of BLOCK_K (the launcher checks)
        xt = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
        wt = tl.load(w_ptrs)
        if DOT_F32:
            acc += tl.dot(xt.to(tl.float32), tl.trans(wt.to(tl.float32)), input_precision="ieee")
        else:
            acc = tl.dot(xt, tl.trans(wt), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if LORA:
        n0 = pid_n * BLOCK_N
        s = tl.where(n0 < N0, 0, tl.where(n0 < N0 + N1, 1, 2))  # the tile's slice
        m = _pick3(s, M0, M1, M2)
        width = _pick3(s, N0, N1, N - N0 - N1)
        n_in = n0 - _pick3(s, 0, N0, N0 + N1)  # the tile's first column inside its slice
        cols = n_in + tl.arange(0, BLOCK_N)
        rows = tl.arange(0, BLOCK_R)
        h_rows = h_ptr + offs_m[:, None].to(tl.int64) * stride_ht + s * stride_hs
        for r in range(tl.load(first_ptr + pid_m), tl.load(first_ptr + pid_m + 1)):
            a = tl.load(runs_ptr + 3 * r).to(tl.int64)
            start = tl.load(runs_ptr + 3 * r + 1)
            end = tl.load(runs_ptr + 3 * r + 2)
            rank = tl.minimum(tl.load(ranks_ptr + a * stride_idx + m), MAX_RANK)
            if rank > 0:
                row_ok = rows < rank
                table_row = table_ptr + a * stride_table + tl.load(b_off_ptr + a * stride_idx + m)
                bt = _bt_block(
                    table_row, pool_ptr, stride_half, stride_slot, rows, row_ok,
                    (width + W - 1) // W, n_in, cols, cols < width, W, BLOCK_N, ALIGNED,
                )  # fmt: skip
                in_run = (offs_m >= start) & (offs_m < end)
                h = tl.load(h_rows + rows[None, :], mask=in_run[:, None] & row_ok[None, :],
                            other=0.0)  # fmt: skip
                scale = tl.load(scales_ptr + a * stride_scale + m)
                if DOT_F32:
                    acc += (
                        tl.dot(h.to(tl.float32), bt.to(tl.float32), input_precision="ieee") * scale
                    )
                else:
                    acc += tl.dot(h, bt.to(h.dtype)) * scale  # [M, R] x [R, N]
    y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_yt + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None])


def gemm_lora(
    x: torch.Tensor,  # [T, K]
    weight: torch.Tensor,  # [N, K]
    *,
    h: torch.Tensor | None = None,  # [T, slices, >= max_rank]: lora_shrink's output
    pool_layer: torch.Tensor | None = None,
    index=None,
    runs: GemmRuns | None = None,
    modules: tuple[int, ...] = (),
    widths: tuple[int, ...] = (),
    max_rank: int = 16,
    out: torch.Tensor | None = None,
    config: GemmLaunch | None = None,
) -> torch.Tensor:
    """x · Wᵀ, plus with ``runs`` (gemm_runs, block_m the config's) each long run's delta
    scale · h · Bᵀ on the slices ``modules`` of widths ``widths`` (summing to N)."""
    cfg = config or GemmLaunch()
    t, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k or k % cfg.block_k:
        raise ValueError(f"x {tuple(x.shape)}, weight {tuple(weight.shape)}: K must match and "
                         f"be a multiple of {cfg.block_k}")  # fmt: skip
    if n % cfg.block_n:
        raise ValueError(f"N = {n} is not a multiple of block_n = {cfg.block_n}")
    y = out if out is not None else torch.empty(t, n, dtype=x.dtype, device=x.device)
    lora = runs is not None
    if lora:
        if runs.block_m != cfg.block_m:
            raise ValueError(f"runs are listed by {runs.block_m} rows, the launch's are "
                             f"{cfg.block_m}")  # fmt: skip
        if sum(widths) != n or any(w % cfg.block_n for w in widths):
            raise ValueError(f"slice widths {widths} must sum to {n}, each a multiple of "
                             f"{cfg.block_n}")  # fmt: skip
        if len(modules) != len(widths) or not 1 <= len(modules) <= MAX_SLICES:
            raise ValueError(f"modules {modules} and widths {widths} must pair up, 1 to "
                             f"{MAX_SLICES}")  # fmt: skip
    block_r = max(16, triton.next_power_of_2(max_rank))
    mods = list(modules or (0,)) + [(modules or (0,))[-1]] * MAX_SLICES
    ws = list(widths or (n,)) + [0, 0]
    dummy = torch.empty(1, dtype=torch.int32, device=x.device)
    if lora:
        hh, pl, idx, rr, ff = h, pool_layer, index, runs.runs, runs.first
        h_strides = (hh.stride(0), hh.stride(1))
        pool_args = (pl, pl.stride(0), pl.stride(1))
        idx_args = (idx.slot_table, idx.slot_table.stride(0), idx.ranks, idx.b_offsets,
                    idx.scales, idx.ranks.stride(0), idx.scales.stride(0))  # fmt: skip
        width = pl.shape[-1]
    else:
        hh, rr, ff = x, dummy, dummy
        h_strides = (0, 0)
        pool_args = (x, 0, 0)
        idx_args = (dummy, 0, dummy, dummy, x, 0, 0)
        width = cfg.block_n
    grid = (triton.cdiv(t, cfg.block_m) * (n // cfg.block_n),)
    _gemm_lora_kernel[grid](
        x, x.stride(0), weight, weight.stride(0), y, y.stride(0),
        hh, *h_strides, *pool_args, *idx_args, rr, ff,
        t, max_rank,
        K=k, W=width, N=n, M0=mods[0], M1=mods[1], M2=mods[2], N0=ws[0], N1=ws[1],
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BLOCK_R=block_r,
        GROUP_M=cfg.group_m, LORA=lora, ALIGNED=width % cfg.block_n == 0, DOT_F32=dot_f32(x.dtype),
        num_warps=cfg.warps, num_stages=cfg.stages,
    )  # fmt: skip
    return y
