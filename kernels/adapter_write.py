"""An adapter's weights into its pool slots in one launch: dtype conversion, scale folding and
zero padding on the device, for any file layout.

The adapter file's bytes are on the device (one copy from pinned memory); a host-built pieces
table (services/inference/engine/host_adapter.py, ``HostAdapter.pieces``) says where each
(layer, module, half) comes from and goes to. Row ``j`` of a piece holds ``chunks`` pool slots,
``slots[slot_pos + j * chunks + c]`` for chunk c (kernels/lora_layout.py's geometry), and takes
column ``n`` from file element ``src + j * row_stride + n * col_stride`` for ``j < rows_valid``
and ``n < cols_valid``, zero elsewhere; the value is read in the piece's dtype, widened to
float32, multiplied by ``fold`` and rounded once to the pool's dtype, as the torch path does
(adapter_copy.write_adapter_torch, the CPU path and the reference of the tests).

Why a kernel: the torch path takes a few operations per module and half (a stack of the
layers' views when a file's layers do not lie at equal distances, as in files written in name
order), each a launch and host time on the engine's step thread; here one launch per adapter.

Pieces columns (int64): layer, half (0: A, 1: Bᵀ), slot_pos, rows (the placement's rank: rows
written), chunks, src (element offset in the piece's dtype), row_stride, col_stride,
rows_valid, cols_valid, dtype (lora_layout.PIECE_DTYPES), fold (float32 bits). The table and
its codes are in kernels/lora_layout.py, which the host imports without Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.lora_layout import PIECE_COLS

BLOCK = 1024  # columns a program writes per iteration


@triton.jit
def adapter_write_kernel(
    pool_ptr, stride_layer, stride_half, stride_slot,
    slots_ptr,  # the adapter's slot table (int32 or int64)
    src16_ptr, src32_ptr,  # the file's bytes as int16 and as int32 (the same memory)
    pieces_ptr,  # int64 [pieces, PIECE_COLS]
    W: tl.constexpr, BLOCK: tl.constexpr, COLS: tl.constexpr,
):  # fmt: skip
    d = pieces_ptr + tl.program_id(0) * COLS
    j = tl.program_id(1)  # the row this program writes
    if j >= tl.load(d + 3):
        return
    layer, half, slot_pos, chunks = tl.load(d), tl.load(d + 1), tl.load(d + 2), tl.load(d + 4)
    src, row_stride, col_stride = tl.load(d + 5), tl.load(d + 6), tl.load(d + 7)
    rows_valid, cols_valid, code = tl.load(d + 8), tl.load(d + 9), tl.load(d + 10)
    fold = tl.load(d + 11).to(tl.int32).to(tl.float32, bitcast=True)
    live = j < rows_valid
    first = src + j * row_stride
    base = pool_ptr + layer * stride_layer + half * stride_half
    offs = tl.arange(0, BLOCK)
    for c in range(chunks):
        slot = tl.load(slots_ptr + slot_pos + j * chunks + c).to(tl.int64)
        dst = base + slot * stride_slot
        for w0 in range(0, W, BLOCK):
            col = c * W + w0 + offs
            ok = live & (col < cols_valid)
            at = first + col * col_stride
            if code == 2:
                v = tl.load(src32_ptr + at, mask=ok, other=0).to(tl.float32, bitcast=True)
            elif code == 1:  # bf16: its bits are a float32's upper half
                bits = tl.load(src16_ptr + at, mask=ok, other=0).to(tl.int32) << 16
                v = bits.to(tl.float32, bitcast=True)
            else:
                v = tl.load(src16_ptr + at, mask=ok, other=0).to(tl.float16, bitcast=True)
                v = v.to(tl.float32)
            v = v * fold
            tl.store(dst + w0 + offs, _rounded(v, pool_ptr.dtype.element_ty), mask=w0 + offs < W)


@triton.jit
def _rounded(v, dtype: tl.constexpr):
    """float32 ``v`` rounded to ``dtype`` to the nearest even, as torch rounds. bf16 by hand, on
    the bits: the Triton interpreter's conversion truncates, and tests run under it."""
    if dtype == tl.bfloat16:
        bits = v.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return v.to(dtype)


def adapter_write(
    pool: torch.Tensor, slots: torch.Tensor, src: torch.Tensor, pieces: torch.Tensor, rows: int
) -> None:
    """Write an adapter into ``pool`` [layers, 2, slots, W] (module docstring). ``slots``: its
    slot table on the device; ``src``: the file's bytes (uint8, on the device, length a multiple
    of 4); ``pieces``: the table, on the device; ``rows``: the largest ``rows`` in it."""
    if src.dtype != torch.uint8 or src.dim() != 1 or src.numel() % 4:
        raise ValueError("src must be 1-D uint8 with a length that is a multiple of 4")
    if pieces.dtype != torch.int64 or pieces.dim() != 2 or pieces.shape[1] != PIECE_COLS:
        raise ValueError(f"pieces must be int64 [pieces, {PIECE_COLS}]")
    if pool.stride(-1) != 1:
        raise ValueError("pool rows must be contiguous")
    if pieces.shape[0] == 0 or rows == 0:
        return
    grid = (pieces.shape[0], rows)
    adapter_write_kernel[grid](
        pool, pool.stride(0), pool.stride(1), pool.stride(2), slots,
        src.view(torch.int16), src.view(torch.int32), pieces,
        W=pool.shape[-1], BLOCK=min(BLOCK, triton.next_power_of_2(pool.shape[-1])),
        COLS=PIECE_COLS,
    )  # fmt: skip
