"""One-launch multi-LoRA: shrink and expand fused in one kernel.

Semantics are kernels/lora_ref.py's lora_apply; geometry kernels/lora_layout.py. Grid (slices x
parts, tiles), so that every program of a tile starts before those of the next (the host lists
the long tiles first: kernels/tile_table.block_tiles): a program owns one tile (at most BLOCK_M
tokens of one adapter, from the tile table the host wrote), one slice and one contiguous share
(``part``) of that slice's output columns. It computes the tile's whole h = x · Aᵀ for its slice in
registers (all rank rows at once, streaming d_in), then streams its share of Bᵀ and adds
scale · h · Bᵀ into y.

Why: one launch instead of two (kernels/lora.py), h never goes to memory and no workspace is
needed. The price is that a program streams a whole A row block alone, and the ``parts``
programs of a (tile, slice) each read A (the first from memory, the others mostly from L2), so
fused_config keeps ``parts`` small unless the batch is too small to fill the GPU. The launcher
takes this path by default for prefill-sized calls of several slices, and on request
(``fused=True``) elsewhere: in decode it wins only when tokens' adapters are distinct and many,
which the engine knows and the shapes do not (kernels/lora_paths.py).

A tile takes one of two bodies by its token count. Tiles of more than GEMV_MAX tokens multiply
their token block by each weight block on the tensor cores (_tile_dot): a 16- or 32-row block,
the weights staged through shared memory. Tiles of at most GEMV_MAX tokens (GEMV_MAX = 0: none),
a decode token's tile of one, would pad that block to 16 rows for one, so they keep each weight
block in registers instead and form each token's products and sums on the CUDA cores
(_tile_gemv): h[t] = Σ_k A[:, k] x[t, k], then y[t, cols] += scale · Σ_r h[t, r] Bᵀ[r, cols],
one token after the other against the block loaded once. A GEMV block holds GEMV_R rank rows;
where GEMV_R is twice GEMV_NARROW_R (16 and 8), a tile whose adapter has at most GEMV_NARROW_R
takes blocks of those rows, twice as wide (the same registers): the rows past its rank would be
masked loads and wasted lanes, and each streaming step a trip of load latency. Where one GEMV
block holds a slice's whole A and Bᵀ rows (GEMV_HOIST, which the host sets: lora.gemv_hoists),
a one-token tile takes _hoisted_gemv, the same sums with every load issued first, and with
GEMV_PAIR so does a two-token tile (a decode step's tokens that share an adapter, two to a
tile: StepBatch.fill's pair_tiles), the second token's sums on the weights loaded once. Both
bodies round alike: products and sums in fp32, h rounded once to the output dtype before the
expand (for bf16 and fp16 outputs), y once.

Slot lookups are hoisted out of both streaming loops (one per rank row and pool chunk), as in
the two-launch kernels, so the loops are plain strided streams that software-pipeline.

With PDL (a programmatic dependent launch: kernels/tiles.py lora_pdl_launch) a program reads
before launch_gate only what existed before the kernel ahead of it in the stream started: its
tile (the step's table), the index, and a hoisted body's slot rows; x, the weights and y after
it, and it writes nothing before it.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.tile_table import ZERO_ROW
from kernels.tiles import launch_gate, table_tile

_ZERO_ROW = tl.constexpr(ZERO_ROW)


@triton.jit
def pick3(s, v0, v1, v2):
    """Slice s's value of three (v0, v1, v2): a launch's per-slice widths and offsets
    (kernels/lora.py's two-launch kernels use it too)."""
    return tl.where(s == 0, v0, tl.where(s == 1, v1, v2))


@triton.jit
def lora_fused_kernel(
    # activations x [T, D_IN], output y [T, sum(widths)] (unit last strides)
    x_ptr, stride_xt, y_ptr, stride_yt,
    # pool layer [2, slots, W]: A chunks in half 0, Bᵀ chunks in half 1
    pool_ptr, stride_half, stride_slot,
    # LoRA index: slot table [N, C]; ranks, A and Bᵀ offsets, scales [N, 7]
    table_ptr, stride_table, ranks_ptr, a_off_ptr, b_off_ptr, scales_ptr, stride_idx,
    stride_scale,
    tiles_ptr,  # the call's tile table [K, 3] (kernels/tile_table.py)
    mods_ptr,  # [7] int32: the modules the step's adapters have (LoraTokens.modules)
    MAX_RANK, PARTS,
    D_IN: tl.constexpr, W: tl.constexpr, IN_CHUNKS: tl.constexpr,
    M0: tl.constexpr, M1: tl.constexpr, M2: tl.constexpr,
    N0: tl.constexpr, N1: tl.constexpr, N2: tl.constexpr,  # slice widths
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr, DOT_F32: tl.constexpr, MASKED: tl.constexpr,
    PART_N: tl.constexpr,  # parts own whole blocks of PART_N columns (both bodies' blocks fit)
    GEMV_MAX: tl.constexpr = 0,
    GEMV_K: tl.constexpr = 256, GEMV_N: tl.constexpr = 256,  # the GEMV body's weight blocks
    GEMV_R: tl.constexpr = 16,  # the GEMV body's rank rows (>= MAX_RANK; no dot: 8 is allowed)
    GEMV_NARROW_R: tl.constexpr = 0,  # with GEMV_R twice this: the rows of small-rank tiles
    GEMV_HOIST: tl.constexpr = False,  # one-token tiles whose slice fits one block: loads first
    GEMV_PAIR: tl.constexpr = False,  # with GEMV_HOIST, two-token tiles take that body too
    DELTA: tl.constexpr = False,  # y = the delta (every token: ZERO_ROW tiles) rather than y +=
    PDL: tl.constexpr = False,  # a dependent launch: reads x and y, writes y, past launch_gate
):  # fmt: skip
    q = tl.program_id(0)
    s = q // PARTS
    p = q % PARTS
    m = pick3(s, M0, M1, M2)
    if not DELTA:
        if MASKED:
            if tl.load(mods_ptr + m) == 0:  # no adapter of the step has it
                return
    a, m_start, m_end = table_tile(tiles_ptr, tl.program_id(1))
    if a < 0:
        if not DELTA:
            return
        if a != _ZERO_ROW:  # past the step's last tile
            return
    width = pick3(s, N0, N1, N2)
    per = tl.cdiv(tl.cdiv(width, PART_N), PARTS) * PART_N
    lo = p * per
    hi = tl.minimum(lo + per, width)
    if lo >= hi:  # a narrow slice (GQA k, v) has fewer blocks than parts
        return
    y_base = y_ptr + pick3(s, 0, N0, N0 + N1)
    a64 = tl.maximum(a, 0).to(tl.int64)
    rank = tl.minimum(tl.load(ranks_ptr + a64 * stride_idx + m), MAX_RANK)
    if DELTA:  # tokens without this module's delta get zeros: no adapter, rank 0, none has it
        rank = tl.where(a < 0, 0, rank)
        if MASKED:
            rank = tl.where(tl.load(mods_ptr + m) == 0, 0, rank)
        if rank == 0:
            launch_gate(PDL)
            _store_zeros(y_base, stride_yt, m_start, m_end, lo, hi, BLOCK_M, BLOCK_N)
            return
    if rank == 0:
        return
    table_row = table_ptr + a64 * stride_table
    # A row j, chunk c at a_off + j*IN_CHUNKS + c; Bᵀ row j, chunk c at b_off + j*out_chunks + c
    a_base = table_row + tl.load(a_off_ptr + a64 * stride_idx + m)
    b_base = table_row + tl.load(b_off_ptr + a64 * stride_idx + m)
    scale = tl.load(scales_ptr + a64 * stride_scale + m)
    if GEMV_HOIST:  # the host checked that a slice's A and Bᵀ rows fit one GEMV block
        if m_end - m_start == 1:
            _hoisted_gemv(
                x_ptr, stride_xt, y_base, stride_yt, pool_ptr, stride_half, stride_slot,
                a_base, b_base, scale, rank, width, m_start, lo, hi,
                D_IN, W, GEMV_K, GEMV_N, GEMV_R, DELTA, PDL, False,
            )  # fmt: skip
            return
        if GEMV_PAIR:
            if m_end - m_start == 2:
                _hoisted_gemv(
                    x_ptr, stride_xt, y_base, stride_yt, pool_ptr, stride_half, stride_slot,
                    a_base, b_base, scale, rank, width, m_start, lo, hi,
                    D_IN, W, GEMV_K, GEMV_N, GEMV_R, DELTA, PDL, True,
                )  # fmt: skip
                return
    launch_gate(PDL)  # the streaming bodies read x as they go
    if GEMV_MAX > 0:
        if m_end - m_start <= GEMV_MAX:
            if GEMV_NARROW_R > 0 and GEMV_R == 2 * GEMV_NARROW_R:  # a narrow body is compiled
                if rank <= GEMV_NARROW_R:  # half the rows, in blocks twice as wide
                    _tile_gemv(
                        x_ptr, stride_xt, y_base, stride_yt, pool_ptr, stride_half, stride_slot,
                        a_base, b_base, scale, rank, width, m_start, m_end, lo, hi,
                        D_IN, W, IN_CHUNKS, GEMV_MAX, 2 * GEMV_K, 2 * GEMV_N, GEMV_NARROW_R,
                        DELTA,
                    )  # fmt: skip
                    return
            _tile_gemv(
                x_ptr, stride_xt, y_base, stride_yt, pool_ptr, stride_half, stride_slot,
                a_base, b_base, scale, rank, width, m_start, m_end, lo, hi,
                D_IN, W, IN_CHUNKS, GEMV_MAX, GEMV_K, GEMV_N, GEMV_R, DELTA,
            )  # fmt: skip
            return
    _tile_dot(
        x_ptr, stride_xt, y_base, stride_yt, pool_ptr, stride_half, stride_slot,
        a_base, b_base, scale, rank, width, m_start, m_end, lo, hi,
        D_IN, W, IN_CHUNKS, BLOCK_M, BLOCK_K, BLOCK_N, BLOCK_R, DOT_F32, DELTA,
    )  # fmt: skip


@triton.jit
def _store_zeros(
    y_base, stride_yt, m_start, m_end, lo, hi, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr
):
    """A tile's rows of columns [lo, hi) of a delta are zeros (a DELTA launch's tile of tokens
    without this slice's delta)."""
    offs_m = m_start + tl.arange(0, BLOCK_M)
    y_rows = y_base + offs_m[:, None].to(tl.int64) * stride_yt
    m_ok = (offs_m < m_end)[:, None]
    zeros = tl.zeros((BLOCK_M, BLOCK_N), dtype=y_base.dtype.element_ty)
    for n0 in range(lo, hi, BLOCK_N):
        nn = n0 + tl.arange(0, BLOCK_N)
        tl.store(y_rows + nn[None, :], zeros, mask=m_ok & (nn < hi)[None, :])


@triton.jit
def _tile_dot(
    x_ptr, stride_xt, y_base, stride_yt, pool_ptr, stride_half, stride_slot,
    a_base, b_base, scale, rank, width, m_start, m_end, lo, hi,
    D_IN: tl.constexpr, W: tl.constexpr, IN_CHUNKS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr, DOT_F32: tl.constexpr, DELTA: tl.constexpr,
):  # fmt: skip
    """A tile's shrink and expand as dots of its BLOCK_M-row token block (tensor cores); with
    DELTA the tile's rows of y are written, not read."""
    rows = tl.arange(0, BLOCK_R)  # every rank row at once: BLOCK_R >= MAX_RANK
    row_ok = rows < rank
    a_pos = a_base + rows * IN_CHUNKS
    b_pos = b_base + rows * ((width + W - 1) // W)
    offs_m = m_start + tl.arange(0, BLOCK_M)
    m_ok = offs_m < m_end
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xt
    offs_k = tl.arange(0, BLOCK_K)
    h = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for c in range(IN_CHUNKS):
        slot = tl.load(a_pos + c, mask=row_ok, other=0).to(tl.int64)
        w_rows = pool_ptr + slot[:, None] * stride_slot - c * W  # + k: element k of each row
        k_end = tl.minimum(D_IN, c * W + W)
        for k0 in range(c * W, k_end, BLOCK_K):
            if W % BLOCK_K == 0:
                k0 = tl.multiple_of(k0, BLOCK_K)
            kk = k0 + offs_k
            k_ok = kk < k_end
            w = tl.load(w_rows + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            xt = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            if DOT_F32:
                h += tl.dot(xt.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
            else:
                h += tl.dot(xt, tl.trans(w.to(xt.dtype)))  # [M, K] x [K, R]

    y_rows = y_base + offs_m[:, None].to(tl.int64) * stride_yt
    if DOT_F32:
        hd = h
    else:
        hd = h.to(y_base.dtype.element_ty)  # rounded once, as the two-launch path rounds h
    offs_n = tl.arange(0, BLOCK_N)
    for c in range(lo // W, tl.cdiv(hi, W)):
        slot = tl.load(b_pos + c, mask=row_ok, other=0).to(tl.int64)
        bt_rows = pool_ptr + stride_half + slot[:, None] * stride_slot - c * W
        c_end = tl.minimum(hi, c * W + W)
        for n0 in range(tl.maximum(lo, c * W), c_end, BLOCK_N):
            if W % BLOCK_N == 0:
                n0 = tl.multiple_of(n0, BLOCK_N)
            nn = n0 + offs_n
            n_ok = nn < c_end
            bt = tl.load(bt_rows + nn[None, :], mask=row_ok[:, None] & n_ok[None, :], other=0.0)
            y_ok = m_ok[:, None] & n_ok[None, :]
            if DOT_F32:
                acc = tl.dot(hd, bt.to(tl.float32), input_precision="ieee")
            else:
                acc = tl.dot(hd, bt.to(hd.dtype))  # [M, R] x [R, N]
            out = acc * scale
            if not DELTA:
                out += tl.load(y_rows + nn[None, :], mask=y_ok, other=0.0).to(tl.float32)
            tl.store(y_rows + nn[None, :], out.to(y_base.dtype.element_ty), mask=y_ok)


@triton.jit
def _tile_gemv(
    x_ptr, stride_xt, y_base, stride_yt, pool_ptr, stride_half, stride_slot,
    a_base, b_base, scale, rank, width, m_start, m_end, lo, hi,
    D_IN: tl.constexpr, W: tl.constexpr, IN_CHUNKS: tl.constexpr,
    GEMV_MAX: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr, DELTA: tl.constexpr,
):  # fmt: skip
    """A tile of at most GEMV_MAX tokens, token by token against each weight block held in
    registers (CUDA cores). BLOCK_R (the launch's GEMV_R) >= MAX_RANK: every rank row at once."""
    rows = tl.arange(0, BLOCK_R)
    row_ok = rows < rank
    a_pos = a_base + rows * IN_CHUNKS
    b_pos = b_base + rows * ((width + W - 1) // W)
    toks = tl.arange(0, GEMV_MAX)  # the tile's tokens, as rows of h
    n_tok = m_end - m_start
    offs_k = tl.arange(0, BLOCK_K)
    h = tl.zeros((GEMV_MAX, BLOCK_R), dtype=tl.float32)
    for c in range(IN_CHUNKS):
        slot = tl.load(a_pos + c, mask=row_ok, other=0).to(tl.int64)
        w_rows = pool_ptr + slot[:, None] * stride_slot - c * W
        k_end = tl.minimum(D_IN, c * W + W)
        for k0 in range(c * W, k_end, BLOCK_K):
            if W % BLOCK_K == 0:
                k0 = tl.multiple_of(k0, BLOCK_K)
            kk = k0 + offs_k
            k_ok = kk < k_end
            w = tl.load(w_rows + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = w.to(tl.float32)
            for t in range(n_tok):
                xv = tl.load(x_ptr + (m_start + t).to(tl.int64) * stride_xt + kk, mask=k_ok,
                             other=0.0)  # fmt: skip
                part = tl.sum(w * xv.to(tl.float32)[None, :], axis=1)  # [R]
                h += tl.where(toks[:, None] == t, part[None, :], 0.0)

    if y_base.dtype.element_ty != tl.float32:  # rounded once, as the two-launch path rounds h
        h = h.to(y_base.dtype.element_ty).to(tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    for c in range(lo // W, tl.cdiv(hi, W)):
        slot = tl.load(b_pos + c, mask=row_ok, other=0).to(tl.int64)
        bt_rows = pool_ptr + stride_half + slot[:, None] * stride_slot - c * W
        c_end = tl.minimum(hi, c * W + W)
        for n0 in range(tl.maximum(lo, c * W), c_end, BLOCK_N):
            if W % BLOCK_N == 0:
                n0 = tl.multiple_of(n0, BLOCK_N)
            nn = n0 + offs_n
            n_ok = nn < c_end
            bt = tl.load(bt_rows + nn[None, :], mask=row_ok[:, None] & n_ok[None, :], other=0.0)
            bt = bt.to(tl.float32)
            for t in range(n_tok):
                ht = tl.sum(tl.where(toks[:, None] == t, h, 0.0), axis=0)  # [R]: token t's h
                acc = tl.sum(ht[:, None] * bt, axis=0)  # [N]
                y_ptrs = y_base + (m_start + t).to(tl.int64) * stride_yt + nn
                out = acc * scale
                if not DELTA:
                    out += tl.load(y_ptrs, mask=n_ok, other=0.0).to(tl.float32)
                tl.store(y_ptrs, out.to(y_base.dtype.element_ty), mask=n_ok)


@triton.jit
def _hoisted_weights(
    pool_ptr, stride_half, stride_slot, a_base, b_base, rank, width, lo, hi,
    D_IN: tl.constexpr, W: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """The loads of a hoisted GEMV body's weights: the slice's A rows (one block of d_in, one
    pool chunk) and its Bᵀ rows' columns [lo, hi) (one block, one chunk), each a single load
    after the rows' slots; with the column and d_in offsets and their masks. Under PDL the
    slots are looked up before launch_gate and the weights loaded after it (loaded before, they
    would be held in registers across the gate: 248 a thread against 128, python -m
    bench.kernel_resources --pdl)."""
    rows = tl.arange(0, BLOCK_R)
    row_ok = rows < rank
    c = lo // W  # the output chunk [lo, hi) lies in
    a_slot = tl.load(a_base + rows, mask=row_ok, other=0).to(tl.int64)  # one input chunk
    b_slot = tl.load(b_base + rows * ((width + W - 1) // W) + c, mask=row_ok, other=0)
    launch_gate(PDL)  # the chain of lookups is done: now the kernel ahead's output
    kk = tl.arange(0, BLOCK_K)
    k_ok = kk < D_IN
    nn = lo + tl.arange(0, BLOCK_N)
    n_ok = nn < hi
    w = tl.load(pool_ptr + a_slot[:, None] * stride_slot + kk[None, :],
                mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
    bt_rows = pool_ptr + stride_half + b_slot.to(tl.int64)[:, None] * stride_slot - c * W
    bt = tl.load(bt_rows + nn[None, :], mask=row_ok[:, None] & n_ok[None, :], other=0.0)
    return w, bt, kk, k_ok, nn, n_ok


@triton.jit
def _hoisted_gemv(
    x_ptr, stride_xt, y_base, stride_yt, pool_ptr, stride_half, stride_slot,
    a_base, b_base, scale, rank, width, m, lo, hi,
    D_IN: tl.constexpr, W: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, DELTA: tl.constexpr,
    PDL: tl.constexpr, PAIR: tl.constexpr,
):  # fmt: skip
    """_tile_gemv for a tile of one token (row m), or with PAIR of two tokens of one adapter
    (rows m and m + 1: a decode step's pair_tiles), whose slice's A and Bᵀ rows each fit one
    weight block in one pool chunk (D_IN <= BLOCK_K and W; [lo, hi) within BLOCK_N columns of
    one chunk): every load is issued before the first sum, so the program waits on memory once
    for the rows' slots and once for A, Bᵀ, x and y together, where _tile_gemv waits for A and
    x, then for Bᵀ's slots, then for Bᵀ and y (a decode step's calls on one-token tiles:
    lora_paths.one_token_step_fuses). A pair's weights are loaded once, and each token's sums
    widen them to fp32 as they go, so that the program holds them once, in the pool's dtype."""
    w, bt, kk, k_ok, nn, n_ok = _hoisted_weights(
        pool_ptr, stride_half, stride_slot, a_base, b_base, rank, width, lo, hi,
        D_IN, W, BLOCK_K, BLOCK_N, BLOCK_R, PDL,
    )  # fmt: skip
    x0 = tl.load(x_ptr + m.to(tl.int64) * stride_xt + kk, mask=k_ok, other=0.0)
    if PAIR:
        x1 = tl.load(x_ptr + (m + 1).to(tl.int64) * stride_xt + kk, mask=k_ok, other=0.0)
    y0_ptrs = y_base + m.to(tl.int64) * stride_yt + nn
    y1_ptrs = y0_ptrs + stride_yt
    if not DELTA:
        y0 = tl.load(y0_ptrs, mask=n_ok, other=0.0)
        if PAIR:
            y1 = tl.load(y1_ptrs, mask=n_ok, other=0.0)
    h0 = tl.sum(w.to(tl.float32) * x0.to(tl.float32)[None, :], axis=1)  # [R]
    if PAIR:
        h1 = tl.sum(w.to(tl.float32) * x1.to(tl.float32)[None, :], axis=1)
    if y_base.dtype.element_ty != tl.float32:  # rounded once, as the two-launch path rounds h
        h0 = h0.to(y_base.dtype.element_ty).to(tl.float32)
        if PAIR:
            h1 = h1.to(y_base.dtype.element_ty).to(tl.float32)
    out0 = tl.sum(h0[:, None] * bt.to(tl.float32), axis=0) * scale  # [N]
    if PAIR:
        out1 = tl.sum(h1[:, None] * bt.to(tl.float32), axis=0) * scale
    if not DELTA:
        out0 += y0.to(tl.float32)
        if PAIR:
            out1 += y1.to(tl.float32)
    tl.store(y0_ptrs, out0.to(y_base.dtype.element_ty), mask=n_ok)
    if PAIR:
        tl.store(y1_ptrs, out1.to(y_base.dtype.element_ty), mask=n_ok)
