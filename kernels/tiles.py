"""Tiles over packed runs of tokens, read without a host sync.

A batch of tokens is packed in runs (LoRA segments, or each sequence's queries); kernels cut
each run into tiles of at most BLOCK rows, ``max_tiles(T, BLOCK, runs)`` at most: a program per
tile of that bound, or fewer that stride over the tiles (next_tile). The LoRA and the prefill
attention kernels read their tiles from a table the host wrote with the step's metadata
(table_tile, next_tile; kernels/tile_table.py); programs past the last tile get run -1 and
return.

Also what every launcher shares: the interpreter switch, the GPU's size, the side stream, and the
programmatic dependent launch (pdl_launch, launch_gate).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kernels.tile_table import max_tiles  # noqa: F401 (the launchers' grid bound, here too)

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# Set to 0 to launch every kernel in plain stream order (pdl_launch).
PDL_ENV = "LORAFLEET_PDL"
# Set to 1 to launch the fused LoRA kernel as a dependent too (lora_pdl_launch).
LORA_PDL_ENV = "LORAFLEET_LORA_PDL"


@functools.cache
def num_sms(device_index: int = 0) -> int:
    """Multiprocessors of the GPU (8 under the interpreter or without one): sizes grids."""
    if INTERPRET or not torch.cuda.is_available():
        return 8
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The device's one second stream, at high priority, for work beside the step's stream:
    the prefill kernel of mixed attention calls (its tiles' loops are the longest chains of a
    mixed step's attention) and, with lora_side_stream, small decode steps' LoRA calls beside
    the base GEMMs (they run on the SMs the GEMM leaves). Their users fork onto it after the
    step's stream and join back before the next one does, so they never hold it at once."""
    return torch.cuda.Stream(device=device, priority=-1)


@functools.cache
def pdl_launch(device: torch.device) -> bool:
    """Whether programmatic dependent launches are on for ``device`` (Hopper and later, not
    under the interpreter, unless LORAFLEET_PDL=0). The layer's pointwise kernels and paged
    attention are then launched with launch_pdl and enter through launch_gate, so the GPU
    dispatches their programs as the kernel before them in the stream finishes instead of
    after; the two-launch LoRA expand overlaps its prologue with its shrink. The other LoRA
    kernels keep plain launches: with them PDL too, one-token decode steps timed 0.6-2.4%
    slower on the H200 (bench/results/pdl.txt), but that timer held the host's work before each
    replay, so the question is open until bench/decode_ab.py --compare pdl measures its spans."""
    if INTERPRET or device.type != "cuda" or os.environ.get(PDL_ENV, "1") == "0":
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


@functools.cache
def lora_pdl_launch(device: torch.device) -> bool:
    """Whether the fused LoRA kernel is a programmatic dependent launch on ``device``: where
    pdl_launch is on and LORAFLEET_LORA_PDL=1 (off by default: docs/kernels.md, Launches). Its
    programs then look up their tile, the index and (a one-token or pair tile's hoisted body) the
    adapter's slot rows while the kernel before them (the norm, attention, or the base GEMM)
    finishes, and pass launch_gate before they read its output or the weights
    (kernels/lora_fused.py). Graphs keep what they captured: set it before the engine starts."""
    return pdl_launch(device) and os.environ.get(LORA_PDL_ENV, "0") == "1"


def lora_dependent(device: torch.device) -> dict:
    """dependent()'s keyword arguments for the fused LoRA kernel, as lora_pdl_launch says."""
    on = lora_pdl_launch(device)
    return {"PDL": on, "launch_pdl": on}


def dependent(device: torch.device) -> dict:
    """A launch's keyword arguments for a kernel that enters through launch_gate (its PDL
    constexpr and Triton's launch_pdl), as pdl_launch says for ``device``."""
    on = pdl_launch(device)
    return {"PDL": on, "launch_pdl": on}


@triton.jit
def launch_gate(PDL: tl.constexpr):
    """A kernel's entry under a programmatic dependent launch (PDL): wait until the kernel
    before it in the stream has completed and its writes are visible (griddepcontrol.wait),
    then let the next kernel's programs be dispatched (they wait likewise at their own gate,
    or read before it only what existed before this kernel started: the two-launch expand).
    Called before any load or store, so the kernel sees the stream's order exactly; without
    PDL, nothing."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


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
