"""Tiles over packed runs of tokens, read without a host sync.

A batch of tokens is packed in runs (LoRA segments, or each sequence's queries); kernels cut
each run into tiles of at most BLOCK rows, ``max_tiles(T, BLOCK, runs)`` at most: a program per
tile of that bound, or fewer that stride over the tiles (next_tile). The LoRA and the prefill
attention kernels read their tiles from a table the host wrote with the step's metadata
(table_tile, next_tile; kernels/tile_table.py); programs past the last tile get run -1 and
return.

Also the host-side facts every launcher shares: the interpreter switch and the GPU's size.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from kernels.tile_table import max_tiles  # noqa: F401 (the launchers' grid bound, here too)

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def num_sms(device_index: int = 0) -> int:
    """Multiprocessors of the GPU (8 under the interpreter or without one): sizes grids."""
    if INTERPRET or not torch.cuda.is_available():
        return 8
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def dot_f32(dtype: torch.dtype) -> bool:
    """Whether kernels widen dot operands to fp32 (their DOT_F32 switch): fp32 gets an exact
    fp32 dot (not tf32); the Triton interpreter computes bf16 dots wrongly, so under it bf16
    operands are widened too."""
    return dtype == torch.float32 or (INTERPRET and dtype == torch.bfloat16)


@triton.jit
def table_tile(tiles_ptr, tile):
    """(row, first token, end token) of tile number ``tile`` from a host-built tile table
    (kernels/tile_table.py); row = -1 past the step's last tile."""
    p = tiles_ptr + tile * 3
    return tl.load(p), tl.load(p + 1), tl.load(p + 2)


@triton.jit
def next_tile(tiles_ptr, tile, num_tiles):
    """table_tile for programs that stride over the tiles (a grid smaller than the tile bound,
    so that programs past the step's last tile do not each cost a launch): row = -1 also from
    ``num_tiles`` (the table's bound for the call) on, where nothing is read."""
    ok = tile < num_tiles
    p = tiles_ptr + tile * 3
    return (
        tl.load(p, mask=ok, other=-1),
        tl.load(p + 1, mask=ok, other=0),
        tl.load(p + 2, mask=ok, other=0),
    )
