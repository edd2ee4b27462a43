"""Triton paged attention over the unified pool, and the K/V write into pages.

Geometry and semantics: kernels/attention_ref.py (the float64 reference these are tested
against). The pool layer is ``[2, slots, W]``, ``W = kv_heads * head_dim``; position p of
sequence b lives at slot ``block_tables[b, p // page_size] * page_size + p % page_size``.

paged_attention launches from shapes and a host-built tile table (no host sync, so a CUDA
graph can hold any step):
- decode: one program per (query row, kv head, context split). The query heads of a kv head
  are one tile, so each K/V row is read once for the whole group (grouped-query attention).
  Long contexts are split across programs and merged by a second small kernel (split-K,
  "flash decoding"). With as many query rows as sequences (a decode step) it serves every row,
  whatever the mix; otherwise (a mixed step) its programs are sequences, and it serves those
  with exactly one query row.
- prefill, in mixed steps: programs per query head that stride over the tiles of the sequences
  of two rows or more (tiles of a sequence's query rows, listed by the host:
  kernels/tile_table.py), each a causal flash-attention loop over the sequence's pages. On CUDA
  it runs on a second stream beside the decode kernel.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.tile_table import ATTENTION_BLOCK, EMPTY, FIELDS, query_tiles
from kernels.tiles import (
    INTERPRET,
    dependent,
    dot_f32,
    launch_gate,
    max_tiles,
    next_tile,
    num_sms,
    side_stream,
)

_LOG2E = 1.4426950408889634
# Prefill programs along the tiles, per multiprocessor and head: each strides over the tiles,
# so the grid does not grow with the bound a CUDA graph is captured for (most of whose tiles
# do not exist in a given step).
_PREFILL_PROGRAMS_PER_SM = 8


class DecodeLaunch(NamedTuple):
    block_n: int = 64  # keys per step
    splits: int = 0  # context splits; 0 = choose from the grid size
    warps: int = 4
    stages: int = 3
    # 0: a program per (row, kv head, split); N: N programs striding over those (the decode
    # rows held to a share of the GPU, beside other work)
    programs: int = 0


class PrefillLaunch(NamedTuple):
    block_q: int = ATTENTION_BLOCK
    block_n: int = 64
    warps: int = 4
    stages: int = 2
    tile_programs: int = 0  # programs along the tiles (0: _PREFILL_PROGRAMS_PER_SM picks)


@triton.jit
def _decode_kernel(
    # queries [T, H, D] and output [T, H, D] (last strides 1)
    q_ptr, stride_qt, stride_qh, out_ptr, stride_ot, stride_oh,
    # split partials: max and sum [T, H, SPLITS], accumulators [T, H, SPLITS, BLOCK_D] (fp32)
    ml_ptr, acc_ptr,
    # pool layer [2, slots, W]
    pool_ptr, stride_half, stride_slot,
    # sequences: block tables [B, pages], context lengths [B], query row starts [B + 1]
    bt_ptr, stride_bt, seq_lens_ptr, qs_ptr, num_seqs, num_rows, scale_log2, n_kv,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, SEQ_POW2: tl.constexpr, SPLITS: tl.constexpr,
    DOT_F32: tl.constexpr, BY_SEQ: tl.constexpr, PERSIST: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """One (row or sequence, kv head, split) a program (grid (B, n_kv, SPLITS)), or, PERSIST,
    a grid of fewer programs that stride over those items in that order (DecodeLaunch.programs:
    the attention of a step held to a share of the GPU)."""
    launch_gate(PDL)
    if PERSIST:
        items = num_seqs * n_kv * SPLITS
        for item in range(tl.program_id(0), items, tl.num_programs(0)):
            _decode_item(
                item // (n_kv * SPLITS), item // SPLITS % n_kv, item % SPLITS,
                q_ptr, stride_qt, stride_qh, out_ptr, stride_ot, stride_oh, ml_ptr, acc_ptr,
                pool_ptr, stride_half, stride_slot, bt_ptr, stride_bt, seq_lens_ptr, qs_ptr,
                num_seqs, num_rows, scale_log2, n_kv,
                HEAD_DIM, BLOCK_D, GROUP, GROUP_PAD, PAGE, BLOCK_N, SEQ_POW2, SPLITS, DOT_F32,
                BY_SEQ,
            )  # fmt: skip
    else:
        _decode_item(
            tl.program_id(0), tl.program_id(1), tl.program_id(2),
            q_ptr, stride_qt, stride_qh, out_ptr, stride_ot, stride_oh, ml_ptr, acc_ptr,
            pool_ptr, stride_half, stride_slot, bt_ptr, stride_bt, seq_lens_ptr, qs_ptr,
            num_seqs, num_rows, scale_log2, n_kv,
            HEAD_DIM, BLOCK_D, GROUP, GROUP_PAD, PAGE, BLOCK_N, SEQ_POW2, SPLITS, DOT_F32, BY_SEQ,
        )  # fmt: skip


@triton.jit
def _decode_item(
    first, kvh, sp,
    q_ptr, stride_qt, stride_qh, out_ptr, stride_ot, stride_oh, ml_ptr, acc_ptr,
    pool_ptr, stride_half, stride_slot, bt_ptr, stride_bt, seq_lens_ptr, qs_ptr,
    num_seqs, num_rows, scale_log2, n_kv,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, SEQ_POW2: tl.constexpr, SPLITS: tl.constexpr,
    DOT_F32: tl.constexpr, BY_SEQ: tl.constexpr,
):  # fmt: skip
    """The decode kernel's work on one item: ``first`` is a query row, or with BY_SEQ a
    sequence, served only if it has exactly one query row (the prefill kernel takes the longer
    ones: paged_attention's mixed steps); kv head ``kvh``; context split ``sp``."""
    serve = True
    if BY_SEQ:
        b = first
        t = tl.load(qs_ptr + b)
        serve = tl.load(qs_ptr + b + 1) - t == 1
        n_keys = tl.where(serve, tl.load(seq_lens_ptr + b), 0)
        # A sequence not served reads row 0's q, never its own start: a padding sequence of a
        # mixed step's graph starts at the step's real token count, one row past q's end when
        # the step fills the graph exactly (an illegal address on the H200 where that row lay
        # past q's allocation).
        t = tl.where(serve, t, 0)
        part_row = b  # split partials are kept per sequence
    else:
        t = first
        # the sequence owning row t: the last b with query_starts[b] <= t (empty ones come
        # before)
        offs_b = tl.arange(0, SEQ_POW2)
        qs = tl.load(qs_ptr + offs_b, mask=offs_b <= num_seqs, other=2147483647)
        b = tl.sum((qs <= t).to(tl.int32), 0) - 1
        ok = (b >= 0) & (b < num_seqs) & (t < num_rows)
        b = tl.where(ok, b, 0)
        q_end = tl.sum(tl.where(offs_b == b + 1, qs, 0), 0)
        seq_len = tl.load(seq_lens_ptr + b)
        n_keys = tl.where(ok, seq_len - q_end + t + 1, 0)  # keys 0..position of row t
        part_row = t
    per = tl.cdiv(tl.cdiv(n_keys, SPLITS), BLOCK_N) * BLOCK_N
    lo = sp * per
    hi = tl.minimum(n_keys, lo + per)

    g = tl.arange(0, GROUP_PAD)
    g_ok = g < GROUP
    heads = kvh * GROUP + g
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(
        q_ptr + t.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + d[None, :],
        mask=g_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    m_i = tl.full((GROUP_PAD,), float("-inf"), tl.float32)
    l_i = tl.zeros((GROUP_PAD,), tl.float32)
    acc = tl.zeros((GROUP_PAD, BLOCK_D), tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    kv_col = kvh * HEAD_DIM + d
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        p_ok = pos < hi
        page = tl.load(bt_row + pos // PAGE, mask=p_ok, other=0).to(tl.int64)
        slot = page * PAGE + pos % PAGE
        kv_off = slot[:, None] * stride_slot + kv_col[None, :]
        kv_ok = p_ok[:, None] & d_ok[None, :]
        k = tl.load(pool_ptr + kv_off, mask=kv_ok, other=0.0)  # [N, D]
        if DOT_F32:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))  # [G, N]
        s = tl.where(p_ok[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(pool_ptr + stride_half + kv_off, mask=kv_ok, other=0.0)  # [N, D]
        if DOT_F32:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    if BY_SEQ:
        g_ok = g_ok & serve
    if SPLITS == 1:
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + t.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=g_ok[:, None] & d_ok[None, :],
        )
    else:
        part = (part_row.to(tl.int64) * n_kv * GROUP + heads) * SPLITS + sp  # [G]
        tl.store(ml_ptr + part * 2, m_i, mask=g_ok)
        tl.store(ml_ptr + part * 2 + 1, l_i, mask=g_ok)
        tl.store(acc_ptr + part[:, None] * BLOCK_D + d[None, :], acc, mask=g_ok[:, None])


@triton.jit
def _combine_kernel(
    out_ptr, stride_ot, stride_oh, ml_ptr, acc_ptr, qs_ptr, num_heads, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, SPLITS: tl.constexpr, BY_SEQ: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """Merge the context splits of one (row, head): softmax-weighted sum of the partials. With
    BY_SEQ, program 0 is a sequence, merged into its one query row (if it has exactly one)."""
    launch_gate(PDL)
    h = tl.program_id(1)
    if BY_SEQ:
        b = tl.program_id(0)
        t = tl.load(qs_ptr + b)
        if tl.load(qs_ptr + b + 1) - t != 1:
            return
        part_row = b
    else:
        t = tl.program_id(0)
        part_row = t
    sp = tl.arange(0, SPLITS)
    d = tl.arange(0, BLOCK_D)
    base = (part_row.to(tl.int64) * num_heads + h) * SPLITS + sp
    m = tl.load(ml_ptr + base * 2)
    l_s = tl.load(ml_ptr + base * 2 + 1)
    acc = tl.load(acc_ptr + base[:, None] * BLOCK_D + d[None, :])
    m_all = tl.max(m, 0)
    m_all = tl.where(m_all == float("-inf"), 0.0, m_all)  # every split empty: zeros, not NaN
    w = tl.exp2(m - m_all)
    total = tl.sum(w * l_s, 0)
    o = tl.sum(w[:, None] * acc, 0) / tl.where(total > 0, total, 1.0)
    tl.store(
        out_ptr + t.to(tl.int64) * stride_ot + h * stride_oh + d,
        o.to(out_ptr.dtype.element_ty),
        mask=d < HEAD_DIM,
    )


@triton.jit
def _prefill_tile(
    q_ptr, stride_qt, stride_qh, out_ptr, stride_ot, stride_oh, pool_ptr, stride_half,
    stride_slot, bt_ptr, stride_bt, seq_lens_ptr, qs_ptr, scale_log2, b, r0, r1, h,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr,
):  # fmt: skip
    """Query rows r0:r1 of sequence b, head h: a causal flash-attention loop over its pages."""
    kvh = h // GROUP
    seq_len = tl.load(seq_lens_ptr + b)
    q_end = tl.load(qs_ptr + b + 1)
    rows = r0 + tl.arange(0, BLOCK_Q)
    r_ok = rows < r1
    q_pos = seq_len - q_end + rows  # position of each query row in its sequence
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(
        q_ptr + rows[:, None].to(tl.int64) * stride_qt + h * stride_qh + d[None, :],
        mask=r_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    m_i = tl.full((BLOCK_Q,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_Q,), tl.float32)
    acc = tl.zeros((BLOCK_Q, BLOCK_D), tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    kv_col = kvh * HEAD_DIM + d
    n_keys = seq_len - q_end + r1  # keys up to the tile's last row (causal)
    for start in range(0, n_keys, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        p_ok = pos < n_keys
        page = tl.load(bt_row + pos // PAGE, mask=p_ok, other=0).to(tl.int64)
        kv_off = (page * PAGE + pos % PAGE)[:, None] * stride_slot + kv_col[None, :]
        kv_ok = p_ok[:, None] & d_ok[None, :]
        k = tl.load(pool_ptr + kv_off, mask=kv_ok, other=0.0)
        if DOT_F32:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))  # [Q, N]
        causal = (pos[None, :] <= q_pos[:, None]) & p_ok[None, :]
        s = tl.where(causal, s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(pool_ptr + stride_half + kv_off, mask=kv_ok, other=0.0)
        if DOT_F32:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + rows[:, None].to(tl.int64) * stride_ot + h * stride_oh + d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=r_ok[:, None] & d_ok[None, :],
    )


@triton.jit
def _prefill_kernel(
    q_ptr, stride_qt, stride_qh, out_ptr, stride_ot, stride_oh, pool_ptr, stride_half,
    stride_slot, bt_ptr, stride_bt, seq_lens_ptr, qs_ptr, scale_log2,
    tiles_ptr,  # [K, 3] (sequence, first row, end row), row -1 past the last (tile_table.py)
    NUM_TILES,  # the tile count's bound (max_tiles <= K)
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr,
):  # fmt: skip
    """Programs (i, head h) take tiles i, i + programs, ... of the table until its first
    empty row: the prompts' and chunks' query tiles of a mixed step."""
    h = tl.program_id(1)
    tile = tl.program_id(0)
    b, r0, r1 = next_tile(tiles_ptr, tile, NUM_TILES)
    while b >= 0:
        _prefill_tile(
            q_ptr, stride_qt, stride_qh, out_ptr, stride_ot, stride_oh, pool_ptr, stride_half,
            stride_slot, bt_ptr, stride_bt, seq_lens_ptr, qs_ptr, scale_log2, b, r0, r1, h,
            HEAD_DIM, BLOCK_D, GROUP, PAGE, BLOCK_Q, BLOCK_N, DOT_F32,
        )  # fmt: skip
        tile += tl.num_programs(0)
        b, r0, r1 = next_tile(tiles_ptr, tile, NUM_TILES)


@triton.jit
def _write_kv_kernel(
    k_ptr, stride_kt, v_ptr, stride_vt, pool_ptr, stride_half, stride_slot, slots_ptr,
    W: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    if slot < 0:  # padding token: nothing to write
        return
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < W
    dst = pool_ptr + slot * stride_slot + offs
    k = tl.load(k_ptr + t.to(tl.int64) * stride_kt + offs, mask=ok)
    tl.store(dst, k.to(pool_ptr.dtype.element_ty), mask=ok)
    v = tl.load(v_ptr + t.to(tl.int64) * stride_vt + offs, mask=ok)
    tl.store(dst + stride_half, v.to(pool_ptr.dtype.element_ty), mask=ok)


def _rows_flat(name: str, t: torch.Tensor) -> torch.Tensor:
    """[T, n_kv, head_dim] with each token's row contiguous (a view when it already is)."""
    if t.dim() != 3:
        raise ValueError(f"{name} must be [T, kv_heads, head_dim], got {tuple(t.shape)}")
    if t.stride(2) != 1 or t.stride(1) != t.shape[2]:
        t = t.contiguous()
    return t


def write_kv(
    pool_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """pool_layer[0, slot_mapping[t]] = k[t] (likewise v); slots < 0 are skipped (padding)."""
    _check_pool(pool_layer)
    k, v = _rows_flat("k", k), _rows_flat("v", v)
    t = k.shape[0]
    width = pool_layer.shape[2]
    if v.shape != k.shape or k.shape[1] * k.shape[2] != width:
        raise ValueError(
            f"k {tuple(k.shape)} and v {tuple(v.shape)} must match and fill the pool width {width}"
        )
    if slot_mapping.shape != (t,) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"slot_mapping must be [{t}] int32/int64, got "
            f"{tuple(slot_mapping.shape)} {slot_mapping.dtype}"
        )
    for name, x in (("k", k), ("v", v), ("slot_mapping", slot_mapping)):
        if x.device != pool_layer.device:
            raise ValueError(f"{name} is on {x.device}, the pool on {pool_layer.device}")
    if t == 0:
        return
    block = min(1024, triton.next_power_of_2(width))
    _write_kv_kernel[(t, triton.cdiv(width, block))](
        k,
        k.stride(0),
        v,
        v.stride(0),
        pool_layer,
        pool_layer.stride(0),
        pool_layer.stride(1),
        slot_mapping,
        W=width,
        BLOCK=block,
        num_warps=4,
    )


def _check_pool(pool_layer: torch.Tensor) -> None:
    if pool_layer.dim() != 3 or pool_layer.shape[0] != 2 or pool_layer.stride(2) != 1:
        raise ValueError(
            f"pool_layer must be [2, slots, W] with a unit last stride, got "
            f"{tuple(pool_layer.shape)} strides {pool_layer.stride()}"
        )


def decode_splits(
    num_rows: int, kv_heads: int, max_context: int, block_n: int, device_index: int = 0
) -> int:
    """Context splits for the decode kernel: enough programs to fill the GPU about twice
    over, never splits shorter than four key blocks of the longest possible context."""
    sms = num_sms(device_index)
    want = triton.cdiv(2 * sms, max(1, num_rows * kv_heads))
    cap = max(1, max_context // (4 * block_n))
    return triton.next_power_of_2(max(1, min(want, cap, 32)))


def paged_attention(
    q: torch.Tensor,
    pool_layer: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_starts: torch.Tensor,
    page_size: int,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
    decode: DecodeLaunch | None = None,
    prefill: PrefillLaunch | None = None,
    prefill_tiles: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of packed queries ``[T, n_heads, head_dim]`` over paged K/V.

    ``out`` (optional, [T, n_heads, head_dim]) receives the result; rows past the last
    sequence's (padding) are not written. ``workspace`` (optional, contiguous fp32, at least
    ``decode_workspace_size(sequences, ...)``) holds split partials. ``prefill_tiles``
    (optional, int32 [>= max_tiles(T, ATTENTION_BLOCK, sequences), 3] on the device): a mixed
    call's prefill tiles as kernels/tile_table.query_tiles lists them and the engine's
    StepBatch writes them with each step; without it a mixed call lists them from
    query_starts on the host, a read that synchronizes (and so cannot be captured in a CUDA
    graph). Decode-only calls read no table.
    """
    _check_pool(pool_layer)
    if q.dim() != 3 or q.stride(2) != 1:
        raise ValueError(
            f"q must be [T, heads, head_dim] with a unit last stride, got {tuple(q.shape)}"
        )
    t, n_heads, head_dim = q.shape
    width = pool_layer.shape[2]
    if width % head_dim or n_heads % (width // head_dim):
        raise ValueError(
            f"pool width {width} is not kv_heads x head_dim {head_dim} for {n_heads} query heads"
        )
    n_kv = width // head_dim
    b = seq_lens.numel()
    if block_tables.dim() != 2 or block_tables.shape[0] != b or block_tables.stride(1) != 1:
        raise ValueError(
            f"block_tables must be [{b}, pages] with a unit last stride, got "
            f"{tuple(block_tables.shape)}"
        )
    if query_starts.shape != (b + 1,):
        raise ValueError(f"query_starts must have {b + 1} entries, got {tuple(query_starts.shape)}")
    for name, x in (
        ("block_tables", block_tables),
        ("seq_lens", seq_lens),
        ("query_starts", query_starts),
    ):
        if x.dtype != torch.int32 or x.device != pool_layer.device:
            raise ValueError(
                f"{name} must be int32 on {pool_layer.device}, got {x.dtype} on {x.device}"
            )
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.stride(2) != 1:
        raise ValueError(f"out must be {tuple(q.shape)} with a unit last stride")
    if t == 0:
        return out
    block_d = triton.next_power_of_2(head_dim)
    group = n_heads // n_kv
    seq_pow2 = max(2, triton.next_power_of_2(b + 1))
    scale_log2 = scale * _LOG2E
    common = (
        pool_layer,
        pool_layer.stride(0),
        pool_layer.stride(1),
        block_tables,
        block_tables.stride(0),
        seq_lens,
        query_starts,
        b,
    )
    # Decode-only steps (as many rows as sequences): the decode kernel, row by row, serves
    # them whatever their mix. Otherwise it serves the one-row sequences (by sequence) and the
    # prefill kernel the longer ones: a mixed step's decode rows keep split-K.
    by_seq = t != b
    cfg = decode or DecodeLaunch()
    splits = cfg.splits or decode_splits(
        b, n_kv, block_tables.shape[1] * page_size, cfg.block_n, q.device.index or 0
    )
    if splits & (splits - 1):
        raise ValueError(f"decode splits must be a power of two, got {splits}")
    need = decode_workspace_size(b, n_heads, head_dim, splits)
    if splits == 1:
        ml = acc = out  # unused
    else:
        if workspace is None:
            workspace = torch.empty(need, dtype=torch.float32, device=q.device)
        elif workspace.numel() < need or workspace.dtype != torch.float32:
            raise ValueError(f"workspace must be float32 with at least {need} elements")
        ml = workspace[: b * n_heads * splits * 2]
        acc = workspace[b * n_heads * splits * 2 : need]
    concurrent = False
    if by_seq:
        pcfg = prefill or PrefillLaunch()
        tiles = _prefill_table(prefill_tiles, query_starts, t, b, pcfg.block_q)
        # The prompts' tiles run beside the decode rows (another stream, joined below): a
        # tile's loop over its keys is latency-bound, the decode rows are bandwidth-bound.
        concurrent = q.is_cuda and not INTERPRET
        main = torch.cuda.current_stream(q.device) if concurrent else None
        side = side_stream(q.device) if concurrent else None
        if concurrent:
            side.wait_stream(main)  # q's rotation and the step's K/V are written on main
        with torch.cuda.stream(side) if concurrent else contextlib.nullcontext():
            bound = max_tiles(t, pcfg.block_q, b)
            want = pcfg.tile_programs or _PREFILL_PROGRAMS_PER_SM * num_sms() // n_heads
            programs = max(1, min(bound, want))
            _prefill_kernel[(programs, n_heads)](
                q, q.stride(0), q.stride(1), out, out.stride(0), out.stride(1), *common[:-1],
                scale_log2, tiles, bound,
                HEAD_DIM=head_dim, BLOCK_D=block_d, GROUP=group, PAGE=page_size,
                BLOCK_Q=pcfg.block_q, BLOCK_N=pcfg.block_n, DOT_F32=dot_f32(q.dtype),
                num_warps=pcfg.warps, num_stages=pcfg.stages,
            )  # fmt: skip
    if cfg.programs < 0:
        raise ValueError(f"decode programs must be 0 or positive, got {cfg.programs}")
    grid = (cfg.programs,) if cfg.programs else (b, n_kv, splits)
    _decode_kernel[grid](
        q, q.stride(0), q.stride(1), out, out.stride(0), out.stride(1), ml, acc, *common, t,
        scale_log2, n_kv,
        HEAD_DIM=head_dim, BLOCK_D=block_d, GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)), PAGE=page_size,
        BLOCK_N=cfg.block_n, SEQ_POW2=seq_pow2, SPLITS=splits, DOT_F32=dot_f32(q.dtype),
        BY_SEQ=by_seq, PERSIST=cfg.programs > 0, num_warps=cfg.warps, num_stages=cfg.stages,
        **dependent(q.device),
    )  # fmt: skip
    if splits > 1:
        _combine_kernel[(b, n_heads)](
            out, out.stride(0), out.stride(1), ml, acc, query_starts, n_heads,
            HEAD_DIM=head_dim, BLOCK_D=block_d, SPLITS=splits, BY_SEQ=by_seq, num_warps=4,
            **dependent(q.device),
        )  # fmt: skip
    if concurrent:
        main.wait_stream(side)
    return out


def _prefill_table(given, query_starts, t: int, b: int, block_q: int) -> torch.Tensor:
    """The prefill kernel's tile table: ``given`` after checks, else listed from
    query_starts on the host (tile_table.query_tiles), which reads them there."""
    bound = max_tiles(t, block_q, b)
    if given is None:
        flat = query_tiles(query_starts.tolist(), block_q)
        flat += EMPTY * (bound - len(flat) // FIELDS)
        return torch.tensor(flat, dtype=torch.int32).view(-1, FIELDS).to(query_starts.device)
    if block_q != ATTENTION_BLOCK:
        raise ValueError(
            f"prefill_tiles are cut into {ATTENTION_BLOCK}-row tiles; prefill.block_q is {block_q}"
        )
    if (
        given.dtype != torch.int32
        or given.dim() != 2
        or given.shape[1] != FIELDS
        or given.shape[0] < bound
        or given.device != query_starts.device
    ):
        raise ValueError(
            f"prefill_tiles must be int32 [>= {bound}, {FIELDS}] on {query_starts.device}, got "
            f"{given.dtype} {tuple(given.shape)} on {given.device}"
        )
    return given


def decode_workspace_size(num_rows: int, num_heads: int, head_dim: int, splits: int) -> int:
    """fp32 elements of the decode split partials: (max, sum) and an accumulator per split."""
    return num_rows * num_heads * splits * (2 + triton.next_power_of_2(head_dim))
