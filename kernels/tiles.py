"""Tiles over packed runs of tokens, found without a host sync.

A batch of tokens is packed in runs (LoRA segments, or each sequence's queries); kernels cut
each run into tiles of at most BLOCK rows, ``max_tiles(T, BLOCK, runs)`` at most: a program per
tile of that bound, or fewer that stride over the tiles (next_tile). The LoRA kernels read
their tiles from a table the host wrote with the step's metadata (table_tile, next_tile;
kernels/tile_table.py). Attention finds its own (find_tile) by scanning
the run starts CHUNK runs at a time and stopping at the chunk that holds its tile, so a tile of
run g costs about g / CHUNK steps whatever the run capacity (its runs are the step's
sequences). Programs past the last tile get run -1 and return.

Also the host-side facts every launcher shares: the interpreter switch and the GPU's size.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from kernels.tile_table import max_tiles  # noqa: F401 (the launchers' grid bound, here too)

CHUNK = 512  # runs scanned per step (masked lanes past the capacity load nothing)
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


@triton.jit
def find_tile(
    starts_ptr,
    rows_ptr,
    num_runs,
    tile,
    BLOCK: tl.constexpr,
    CHUNK: tl.constexpr,
    HAS_ROWS: tl.constexpr,
    MIN_LEN: tl.constexpr,
):
    """(run, row, first token, end token) of tile number ``tile``; run = row = -1 past the end.

    Run g covers tokens starts[g]:starts[g+1]. With HAS_ROWS, runs whose ``rows[g]`` is negative
    (base-only LoRA segments) get no tiles and ``row`` is rows[g]; otherwise row = run. Runs of
    fewer than MIN_LEN tokens (MIN_LEN >= 1) get no tiles: MIN_LEN = 1 skips only empty ones.
    """
    run = tile * 0 - 1
    row = run
    start = tile * 0
    end = start
    before = tile * 0  # tiles of the runs before this chunk
    base = tile * 0
    while base < num_runs:
        offs = base + tl.arange(0, CHUNK)
        live = offs < num_runs
        s0 = tl.load(starts_ptr + offs, mask=live, other=0)
        s1 = tl.load(starts_ptr + offs + 1, mask=live, other=0)
        if HAS_ROWS:
            rows = tl.load(rows_ptr + offs, mask=live, other=-1)
        else:
            rows = tl.where(live, offs, -1)
        n_tiles = tl.where((rows >= 0) & (s1 - s0 >= MIN_LEN), (s1 - s0 + BLOCK - 1) // BLOCK, 0)
        ends = before + tl.cumsum(n_tiles, 0)  # inclusive: tiles of runs up to each one
        total = before + tl.sum(n_tiles, 0)
        if tile < total:
            g = tl.sum((ends <= tile).to(tl.int32), 0)  # the run whose tiles reach past `tile`
            pick = tl.arange(0, CHUNK) == g
            first = tl.sum(tl.where(pick, ends - n_tiles, 0), 0)
            start = tl.sum(tl.where(pick, s0, 0), 0) + (tile - first) * BLOCK
            end = tl.minimum(tl.sum(tl.where(pick, s1, 0), 0), start + BLOCK)
            row = tl.sum(tl.where(pick, rows, 0), 0)
            run = base + g
            base = num_runs  # found: stop
        else:
            before = total
            base += CHUNK
    return run, row, start, end
