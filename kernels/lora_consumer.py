"""A decode step's LoRA expand inside the kernels that consume the projections (CUDA).

The fused LoRA launch of a decode step on one-token tiles writes each call's delta (q/k/v:
tokens x q_dim + 2 kv_dim elements, o: tokens x hidden) and the base GEMM adds onto it
(models/llama.py, LoraContext.addend): the delta crosses memory twice. Instead, with
LoraContext.consume, each call's shrink writes only h = x · Aᵀ, R floats a slice and token
(lora_shrink_tokens), the base GEMM runs plain, and the kernel that reads the projection next
adds scale · h · Bᵀ as it reads it: the rotary/K-V write for q/k/v (kernels/layer_ops.py
rope_write_kv) and the residual add + RMSNorm for o (layer_ops.rmsnorm), through lora_delta.
The adapters' bytes are the same; the delta never goes to memory.

Semantics: kernels/layer_ops_ref.py (the references take the same LoraExpand); geometry:
kernels/lora_layout.py. Each token is addressed on its own (LoraTokens.token_lora, no tile
table): a decode step's tokens mostly have adapters of their own, and tokens that share one read
its weights again, from L2 where they run close together (the step's tokens are sorted by
adapter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.lora import _slice_args
from kernels.lora_args import check_float, check_modules
from kernels.lora_fused import _pick3
from kernels.lora_layout import chunks
from kernels.lora_ref import LoraExpand
from kernels.tiles import dependent, launch_gate

# The shrink's d_in block, at most: one block a pool chunk where the chunk is that wide or less.
_SHRINK_MAX_BLOCK = 4096


@triton.jit
def _shrink_tokens_kernel(
    x_ptr, stride_x, h_ptr,
    pool_ptr, stride_slot, table_ptr, stride_table, ranks_ptr, a_off_ptr, stride_idx, rows_ptr,
    M0: tl.constexpr, M1: tl.constexpr, M2: tl.constexpr, SLICES: tl.constexpr,
    D_IN: tl.constexpr, W: tl.constexpr, IN_CHUNKS: tl.constexpr, BLOCK_K: tl.constexpr,
    R: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    """Program (t, s): h[t, s, :R] = A_s · x[t] of token t's adapter in fp32, zeros past its rank
    and without one. BLOCK_K divides W, so each block of d_in lies in one pool chunk: one slot
    lookup a rank row and block, every block's loads issued before its sum."""
    launch_gate(PDL)
    t = tl.program_id(0)
    s = tl.program_id(1)
    m = _pick3(s, M0, M1, M2)
    a = tl.load(rows_ptr + t)
    a64 = tl.maximum(a, 0).to(tl.int64)
    rank = tl.where(a >= 0, tl.minimum(tl.load(ranks_ptr + a64 * stride_idx + m), R), 0)
    rows = tl.arange(0, R)
    ok = rows < rank
    a_pos = table_ptr + a64 * stride_table + tl.load(a_off_ptr + a64 * stride_idx + m)
    x_row = x_ptr + t.to(tl.int64) * stride_x
    acc = tl.zeros((R,), dtype=tl.float32)
    for k0 in range(0, IN_CHUNKS * W, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < D_IN
        slot = tl.load(a_pos + rows * IN_CHUNKS + k0 // W, mask=ok, other=0).to(tl.int64)
        w = tl.load(pool_ptr + slot[:, None] * stride_slot + (kk % W)[None, :],
                    mask=ok[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
        x = tl.load(x_row + kk, mask=k_ok, other=0.0)
        acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    tl.store(h_ptr + (t * SLICES + s) * R + rows, acc)


@triton.jit
def lora_entry(
    t, m, table_ptr, stride_table, ranks_ptr, b_off_ptr, scales_ptr, stride_idx, stride_scale,
    rows_ptr, R: tl.constexpr,
):  # fmt: skip
    """Token t's adapter for module m: its rank (clamped to R; 0 without one), where its Bᵀ
    rows' slots start in the slot table, and its scale."""
    a = tl.load(rows_ptr + t)
    a64 = tl.maximum(a, 0).to(tl.int64)
    rank = tl.where(a >= 0, tl.minimum(tl.load(ranks_ptr + a64 * stride_idx + m), R), 0)
    b_pos = table_ptr + a64 * stride_table + tl.load(b_off_ptr + a64 * stride_idx + m)
    return rank, b_pos, tl.load(scales_ptr + a64 * stride_scale + m)


@triton.jit
def lora_delta(
    t, s, rank, b_pos, scale, cols, chunk, ok, h_ptr, SLICES: tl.constexpr, pool_ptr,
    stride_half, stride_slot, W: tl.constexpr, OUT_CHUNKS: tl.constexpr, R: tl.constexpr,
    DT: tl.constexpr,
):  # fmt: skip
    """scale · h[t, s] · Bᵀ[:, cols] for token t's adapter (lora_entry's rank, b_pos, scale), in
    fp32: zeros past its rank and where ``ok`` is off; h rounded to DT first, as the fused
    kernels round it. ``cols``: column indices of the module's output, any shape; ``chunk``:
    their pool chunks (cols // W), broadcastable to cols, so that a caller who knows them per
    head looks each slot up once a head (with OUT_CHUNKS = 1, once a rank row). Every rank
    row's loads are masked, not branched on, so they all go out at once."""
    within = cols % W if OUT_CHUNKS > 1 else cols
    acc = tl.zeros(cols.shape, dtype=tl.float32)
    for r in tl.static_range(R):
        on = r < rank
        if OUT_CHUNKS == 1:
            slot = tl.load(b_pos + r, mask=on, other=0).to(tl.int64)
        else:
            slot = tl.load(b_pos + r * OUT_CHUNKS + chunk, mask=on, other=0).to(tl.int64)
        hr = tl.load(h_ptr + (t * SLICES + s) * R + r, mask=on, other=0.0)
        b = tl.load(pool_ptr + stride_half + slot * stride_slot + within, mask=ok & on, other=0.0)
        acc += hr.to(DT).to(tl.float32) * b.to(tl.float32)
    return acc * scale


def _shrink_block(width: int) -> int:
    """The largest power of two that divides the pool's row width, at most _SHRINK_MAX_BLOCK."""
    return min(width & -width, _SHRINK_MAX_BLOCK)


def lora_shrink_tokens(
    x: torch.Tensor,
    pool_layer: torch.Tensor,
    index,
    token_lora: torch.Tensor,
    modules: tuple[int, ...],
    rank: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """h[t, s, :rank] = x[t] · A_s(t)ᵀ for each token's adapter (LoraIndex row token_lora[t], -1:
    none, zeros), fp32 [T, slices, rank]; ``rank`` a power of two, the step's rank rows
    (adapters above it are clamped: the engine sizes a step's rows for its adapters)."""
    check_float("x", x)
    check_modules(modules, rank)
    t, d_in = x.shape
    if rank & (rank - 1):
        raise ValueError(f"rank must be a power of two, got {rank}")
    if token_lora.shape != (t,) or token_lora.dtype != torch.int32:
        raise ValueError(
            f"token_lora must be int32 [{t}], got {token_lora.dtype} {tuple(token_lora.shape)}"
        )
    shape = (t, len(modules), rank)
    if out is None:
        out = torch.empty(shape, dtype=torch.float32, device=x.device)
    elif out.shape != shape or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"out must be contiguous float32 {shape}, got {tuple(out.shape)}")
    if t == 0:
        return out
    width = pool_layer.shape[-1]
    block = _shrink_block(width)
    _shrink_tokens_kernel[(t, len(modules))](
        x, x.stride(0), out, pool_layer[0], pool_layer.stride(1),
        index.slot_table, index.slot_table.stride(0), index.ranks, index.a_offsets,
        index.ranks.stride(0), token_lora,
        SLICES=len(modules), D_IN=d_in, W=width,
        IN_CHUNKS=chunks(d_in, width), BLOCK_K=block, R=rank,
        num_warps=8 if rank * block >= 8192 else 4, **_slice_args(modules),
        **dependent(x.device),
    )  # fmt: skip
    return out


def delta_args(lora: LoraExpand | None, like: torch.Tensor) -> tuple:
    """What a consumer kernel takes for its LoRA expand, in its order: h, the pool layer and its
    strides, the index (slot table and stride, ranks, Bᵀ offsets, scales, their strides), each
    token's row; without ``lora``, placeholders (``like`` for every pointer, 0 for strides)."""
    if lora is None:
        return (like, like, 0, 0, like, 0, like, like, like, 0, 0, like)
    pool, index = lora.pool_layer, lora.index
    return (
        lora.h, pool, pool.stride(0), pool.stride(1), index.slot_table,
        index.slot_table.stride(0), index.ranks, index.b_offsets, index.scales,
        index.ranks.stride(0), index.scales.stride(0), lora.tokens.token_lora,
    )  # fmt: skip
