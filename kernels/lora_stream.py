"""One-launch multi-LoRA for decode steps, streamed: a fixed grid of programs that each walk
work items (tile, slice, part) and look up the next item while the current one's weights load.

Semantics are kernels/lora_ref.py's lora_apply (and its delta form); the work is that of the
fused kernel's hoisted GEMV body (kernels/lora_fused.py _hoisted_gemv): a slice's A rows (d_in
within one weight block and one pool chunk) and its Bᵀ rows' share of columns [lo, hi) are each
one load into registers, then each token of the tile forms h = A · x and adds scale · h · Bᵀ.

Why: in the fused kernel a program per (tile, slice, part) starts with a chain of dependent
loads (its tile's row of the table, the adapter's index row, the rank rows' slots) before the
weights it streams, and an SM holds two such programs (128 registers a thread), so whenever
both sit in their chains the SM's share of the copy bandwidth idles. Here a program issues its
item's weight loads first and walks the next item's chain while they are in flight, so after its
first item the chain costs no time of its own. Items go in table order (a tile's slices and
parts one after the other), program p taking items p, p + G, p + 2G, ... of a grid of G; a
program stops at the first tile past the step's last (row -1: every later item of it is past
too).

The launcher takes this kernel for decode steps on one-token tiles, whose tables hold tiles of
one token, or two of one adapter (StepBatch.fill's pair_tiles), and in a delta launch tiles of
tokens without an adapter (ZERO_ROW: zeros written). Where such a step's table could not cut its
tokens apart (more tiles than the launch's bound: few adapters, StepBatch._write_tiles), its
tiles are the segments', of up to 16 tokens: those take the fused kernel's dot body. Products
and sums in fp32, h rounded once to the output dtype before the expand (bf16 and fp16 outputs),
y once, as the other bodies round. With PDL a program looks up its first item before launch_gate
(the table, the index and the slot rows existed before the kernel ahead started) and everything
after it.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.lora_fused import _store_zeros, _tile_dot
from kernels.tiles import launch_gate


@triton.jit
def _pick3(s, v0, v1, v2):
    return tl.where(s == 0, v0, tl.where(s == 1, v1, v2))


@triton.jit
def _item(
    item, num_items, tiles_ptr, mods_ptr,
    table_ptr, stride_table, ranks_ptr, a_off_ptr, b_off_ptr, scales_ptr, stride_idx,
    stride_scale, MAX_RANK, PARTS,
    W: tl.constexpr, M0: tl.constexpr, M1: tl.constexpr, M2: tl.constexpr,
    N0: tl.constexpr, N1: tl.constexpr, N2: tl.constexpr, SLICES: tl.constexpr,
    PART_N: tl.constexpr, BLOCK_R: tl.constexpr, MASKED: tl.constexpr,
):  # fmt: skip
    """Work item ``item``'s tile (row, first, end token), slice, columns [lo, hi), rank (0: no
    work: no adapter, the module off, no columns), scale, its A and Bᵀ rows' slots and their
    offsets in the slot table's row. The tile's loads and the module mask's go out together;
    then the index row's; then the slots'."""
    ok = item < num_items
    per_tile = SLICES * PARTS
    tile = item // per_tile
    q = item % per_tile
    s = q // PARTS
    p = q % PARTS
    m = _pick3(s, M0, M1, M2)
    t_ptr = tiles_ptr + tile * 3
    a = tl.load(t_ptr, mask=ok, other=-1)
    m_start = tl.load(t_ptr + 1, mask=ok, other=0)
    m_end = tl.load(t_ptr + 2, mask=ok, other=0)
    on = a >= 0
    if MASKED:
        on = on & (tl.load(mods_ptr + m) != 0)
    width = _pick3(s, N0, N1, N2)
    per = tl.cdiv(tl.cdiv(width, PART_N), PARTS) * PART_N
    lo = p * per
    hi = tl.minimum(lo + per, width)
    a64 = tl.maximum(a, 0).to(tl.int64)
    idx = a64 * stride_idx + m
    rank = tl.load(ranks_ptr + idx, mask=on, other=0)
    rank = tl.where(lo < hi, tl.minimum(rank, MAX_RANK), 0)
    a_off = tl.load(a_off_ptr + idx, mask=on, other=0)
    b_off = tl.load(b_off_ptr + idx, mask=on, other=0)
    scale = tl.load(scales_ptr + a64 * stride_scale + m, mask=on, other=0.0)
    rows = tl.arange(0, BLOCK_R)
    row_ok = rows < rank
    table_row = table_ptr + a64 * stride_table
    # A row j at a_off + j (one input chunk); Bᵀ row j, chunk c at b_off + j * out_chunks + c
    a_slot = tl.load(table_row + a_off + rows, mask=row_ok, other=0)
    b_slot = tl.load(table_row + b_off + rows * ((width + W - 1) // W) + lo // W, mask=row_ok,
                     other=0)  # fmt: skip
    return a, m_start, m_end, s, lo, hi, rank, scale, a_slot, b_slot, a_off, b_off


@triton.jit
def lora_stream_kernel(
    # activations x [T, D_IN], output y [T, sum(widths)] (unit last strides)
    x_ptr, stride_xt, y_ptr, stride_yt,
    # pool layer [2, slots, W]: A chunks in half 0, Bᵀ chunks in half 1
    pool_ptr, stride_half, stride_slot,
    # LoRA index: slot table [N, C]; ranks, A and Bᵀ offsets, scales [N, 7]
    table_ptr, stride_table, ranks_ptr, a_off_ptr, b_off_ptr, scales_ptr, stride_idx,
    stride_scale,
    tiles_ptr,  # the call's tile table [K, 3] (kernels/tile_table.py)
    mods_ptr,  # [7] int32: the modules the step's adapters have (LoraTokens.modules)
    MAX_RANK, PARTS, NUM_ITEMS,  # items: tile bound x SLICES x PARTS
    D_IN: tl.constexpr, W: tl.constexpr,
    M0: tl.constexpr, M1: tl.constexpr, M2: tl.constexpr,
    N0: tl.constexpr, N1: tl.constexpr, N2: tl.constexpr,  # slice widths
    SLICES: tl.constexpr, PART_N: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,  # BLOCK_K >= D_IN
    MASKED: tl.constexpr,
    # the dot body's tile tokens, weight blocks and rank rows (>= MAX_RANK, >= 16) for tiles of
    # more than two tokens; DOT_F32: its operands widened to fp32
    DOT_M: tl.constexpr, DOT_K: tl.constexpr, DOT_N: tl.constexpr, DOT_R: tl.constexpr,
    DOT_F32: tl.constexpr,
    DELTA: tl.constexpr = False,  # y = the delta (every token: ZERO_ROW tiles) rather than y +=
    PDL: tl.constexpr = False,
):  # fmt: skip
    g = tl.num_programs(0)
    it = tl.program_id(0)
    a, m_start, m_end, s, lo, hi, rank, scale, a_slot, b_slot, a_off, b_off = _item(
        it, NUM_ITEMS, tiles_ptr, mods_ptr, table_ptr, stride_table, ranks_ptr, a_off_ptr,
        b_off_ptr, scales_ptr, stride_idx, stride_scale, MAX_RANK, PARTS,
        W, M0, M1, M2, N0, N1, N2, SLICES, PART_N, BLOCK_R, MASKED,
    )  # fmt: skip
    launch_gate(PDL)
    rows = tl.arange(0, BLOCK_R)
    kk = tl.arange(0, BLOCK_K)
    k_ok = kk < D_IN
    cols = tl.arange(0, BLOCK_N)
    while a != -1:
        work = rank > 0
        short = m_end - m_start <= 2  # a tile of one or two tokens: the GEMV body here
        if DELTA:  # a delta's tokens without one get zeros
            writes = (work | (lo < hi)) & short
        else:
            writes = work & short
        load = work & short
        # this item's loads: weights, and its tokens' x (and y)
        row_ok = (rows < rank) & load
        nn = lo + cols
        n_ok = nn < hi
        w = tl.load(pool_ptr + a_slot.to(tl.int64)[:, None] * stride_slot + kk[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
        # [lo, hi) lies in output chunk lo // W
        bt_rows = pool_ptr + stride_half + b_slot.to(tl.int64)[:, None] * stride_slot
        bt = tl.load(bt_rows + (nn - (lo // W) * W)[None, :],
                     mask=row_ok[:, None] & n_ok[None, :], other=0.0)  # fmt: skip
        two = m_end - m_start == 2
        x0 = tl.load(x_ptr + m_start.to(tl.int64) * stride_xt + kk, mask=k_ok & load, other=0.0)
        x1 = tl.load(x_ptr + (m_start + 1).to(tl.int64) * stride_xt + kk,
                     mask=k_ok & load & two, other=0.0)  # fmt: skip
        y_base = y_ptr + _pick3(s, 0, N0, N0 + N1)
        y0_ptrs = y_base + m_start.to(tl.int64) * stride_yt + nn
        y1_ptrs = y0_ptrs + stride_yt
        if not DELTA:
            y0 = tl.load(y0_ptrs, mask=n_ok & load, other=0.0)
            y1 = tl.load(y1_ptrs, mask=n_ok & load & two, other=0.0)
        # the next item's chain, while those loads are in flight
        it_n = it + g
        a_n, m_start_n, m_end_n, s_n, lo_n, hi_n, rank_n, scale_n, a_slot_n, b_slot_n, a_off_n, \
            b_off_n = _item(
                it_n, NUM_ITEMS, tiles_ptr, mods_ptr, table_ptr, stride_table, ranks_ptr,
                a_off_ptr, b_off_ptr, scales_ptr, stride_idx, stride_scale, MAX_RANK, PARTS,
                W, M0, M1, M2, N0, N1, N2, SLICES, PART_N, BLOCK_R, MASKED,
            )  # fmt: skip
        h0 = tl.sum(w.to(tl.float32) * x0.to(tl.float32)[None, :], axis=1)  # [R]
        h1 = tl.sum(w.to(tl.float32) * x1.to(tl.float32)[None, :], axis=1)
        if y_ptr.dtype.element_ty != tl.float32:  # h rounded once, as the other bodies round it
            h0 = h0.to(y_ptr.dtype.element_ty).to(tl.float32)
            h1 = h1.to(y_ptr.dtype.element_ty).to(tl.float32)
        out0 = tl.sum(h0[:, None] * bt.to(tl.float32), axis=0) * scale  # [N]
        out1 = tl.sum(h1[:, None] * bt.to(tl.float32), axis=0) * scale
        if not DELTA:
            out0 += y0.to(tl.float32)
            out1 += y1.to(tl.float32)
        tl.store(y0_ptrs, out0.to(y_ptr.dtype.element_ty), mask=n_ok & writes)
        tl.store(y1_ptrs, out1.to(y_ptr.dtype.element_ty), mask=n_ok & writes & two)
        if not short:  # a longer tile (the segments' tiles of a table that did not cut them)
            width = _pick3(s, N0, N1, N2)
            if work:
                table_row = table_ptr + tl.maximum(a, 0).to(tl.int64) * stride_table
                _tile_dot(
                    x_ptr, stride_xt, y_base, stride_yt, pool_ptr, stride_half, stride_slot,
                    table_row + a_off, table_row + b_off, scale, rank, width, m_start, m_end,
                    lo, hi, D_IN, W, 1, DOT_M, DOT_K, DOT_N, DOT_R, DOT_F32, DELTA,
                )  # fmt: skip
            elif DELTA:
                if lo < hi:
                    _store_zeros(y_base, stride_yt, m_start, m_end, lo, hi, DOT_M, DOT_N)
        it = it_n
        a, m_start, m_end, s, lo, hi, rank, scale, a_slot, b_slot, a_off, b_off = (
            a_n, m_start_n, m_end_n, s_n, lo_n, hi_n, rank_n, scale_n, a_slot_n, b_slot_n,
            a_off_n, b_off_n,
        )  # fmt: skip
