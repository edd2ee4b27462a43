"""Triton multi-LoRA kernels that read adapters in place from the unified page pool.

Geometry: kernels/lora_layout.py; semantics: kernels/lora_ref.py, the float64 reference the
kernels are tested against. Two launches per call (or the fused one of kernels/lora_fused.py
where launch_config or the caller picks it), over tiles of at most BLOCK_M tokens inside one
segment of ``LoraTokens`` (one adapter per tile; the host lists them in LoraTokens.tiles,
kernels/tile_table.py, so a program finds its tile in one load and no host sync is needed).
Prefill runs give full tiles that share each weight load; decode tokens of distinct adapters
give one-token tiles, which is per-token addressing. Base-only and padding segments get no
tiles.

- shrink, grid (tile programs, slices x k-splits x rank splits): h[k, t, s, rows] = x[t,
  k-part] · A_s[rows]ᵀ in fp32, a program looping over the adapter's rank blocks (every
  rank_split-th one where several programs share them: S2's decode steps, _wide_split); small
  batches split d_in over several programs (partial sums, added by expand) to stream through
  more SMs.
- expand, grid (tile programs, column blocks of all slices): y[t, cols] += scale · Σ_k h[k, t,
  s] · Bᵀ. On Hopper it is launched as a programmatic dependent of shrink: it finds its first
  tile, looks up and loads its Bᵀ block and y block while shrink still runs, then waits for h.

In both, the programs along the tiles stride over them (up to _TILE_PROGRAMS_PER_SM an SM in
all) and stop at the step's last tile, rather than one program per tile of the bound a CUDA
graph is captured for, most of which would find no tile.

Graph safety: no host reads of device data; given ``workspace``, no allocation either. Ranks
above ``max_rank`` cannot be checked without a host sync: the kernels clamp them (memory stays
in bounds; the engine passes EngineConfig.max_lora_rank and refuses larger adapters up front).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kernels import lora_paths
from kernels.lora_args import MAX_SLICES, check_call, check_float, check_modules, check_widths
from kernels.lora_fused import lora_fused_kernel, pick3
from kernels.lora_paths import fused_rank_rows, shapes_prefer_fused
from kernels.tile_table import TILE_BLOCKS
from kernels.tiles import (
    INTERPRET,
    dot_f32,
    lora_dependent,
    max_tiles,
    next_tile,
    num_sms,
    pdl_launch,
)

# Shrink programs wanted per multiprocessor: with fewer, the weights stream through too few
# SMs (small decode batches) and split_k makes up the difference.
_SHRINK_PROGRAMS_PER_SM = 4
# Fused programs wanted per multiprocessor; parts split a (tile, slice) until there are as many.
_FUSED_PROGRAMS_PER_SM = 2
# Fused calls of up to this many tokens cut their runs into 16-token tiles, larger ones into 32:
# a prompt's tile runs its shrink and expand steps one after the other, and halving the tile
# halves what each program streams of x and y. H200, one layer's S1 calls of the serving trace's
# mixed steps (16 rank rows, every call fused, the masked MLP calls beside them), 32- against
# 16-token tiles: 400 decode tokens on 331 adapters beside four 400-token prompts 132.3 against
# 124.4 µs, beside three 200-token prompts 106.4 against 95.6, 300 on 266 beside three 512-token
# prompts 110.6 against 107.2, the same on 5 adapters 92.5 against 91.5, two 1024-token prompts
# 101.0 against 92.8 (bench/results/lora_engine_calls_dot.json, --dot). Larger calls (prefill of
# more than a step's 2048 tokens) were measured with 32 (docs/kernels.md) and keep it.
_DOT_16_MAX_TOKENS = 2048
# Two-launch programs along the tiles, per multiprocessor: the most 4-warp programs an SM holds
# (64 warps). A grid of the tile bound (a CUDA graph's worst case: every token its own adapter)
# would launch mostly programs that find no tile: H200, 512 decode tokens on 5 rank-8 adapters,
# one layer's q/k/v and o calls took 58.7 µs with ~50,000 such programs (17,000 for the
# shrink's rank blocks and splits, 33,000 for the expand's), and each doubling of the shrink's
# programs by split_k added 18-92 µs (bench/results/lora_engine_calls_before_striding.json).
# So programs stride over the tiles instead, and the shrink loops over rank blocks: 45.2 µs
# for the same calls (bench/results/lora_engine_calls.json).
_TILE_PROGRAMS_PER_SM = 16
# WIDE decode-sized calls of at least this many tokens do not split d_in (_wide_split).
_WIDE_SPLIT_ONE_TOKENS = 256
# Decode-sized calls of at most this d_in split it in two at least (_decode_split).
_DECODE_SPLIT_MAX_D_IN = 4096
# The expand's registers a thread. Its tile loop kept 124-128 live (4 programs an SM at 4 warps,
# 256-column blocks; sm_90, Triton 3.6) where the one-tile-a-program kernel took 96 (5 an SM);
# capped at 96 the q/k/v call compiles without spilling at split 1, with 16 bytes of stack a
# thread at the decode step's split 2 (whose timings above include them), o and gate/up with 32
# (`python -m bench.kernel_resources`; a test checks it).
_EXPAND_MAX_REGISTERS = 96


# Fused launches send tiles of at most this many tokens to the kernel's GEMV body
# (kernels/lora_fused.py), with weight blocks of _GEMV_BLOCK elements. H200, one layer's S1
# q/k/v and o calls in a graph at the engine's 16 rank rows, every call fused, the dot body
# against GEMV for one-token tiles (bench/results/lora_engine_calls_gemv.json; the engine's own
# paths beside them): 512 decode tokens on 405 adapters 151.4 against 116.3 µs; the n = 1000
# trace's mixed steps, 400 decode tokens beside four 400-token prompts 201.0 against 170.3, beside
# three 200-token prompts 191.7 against 145.1, 300 beside three 512-token prompts 188.9 against
# 150.9; 292 tokens on 192 adapters 85.9 against 81.0; calls whose tiles are mostly longer
# (512 tokens on 5 or 30 adapters, 1024 on 100, prefill of a few adapters) within 1.1 µs.
# Tiles of up to 2 tokens on the GEMV body were slower at 512 on 405 (161.7), 16 much slower
# (a 16-token tile, 16 products of every weight on the CUDA cores: 1657 µs at 1024 on 100); with
# 256- and 512-element blocks or 8 warps it took longer (512 on 405: 349.5 and 149.1 with 4
# warps, 197.7 with 1024 and 8 warps; the first sweep,
# lora_engine_calls_gemv_sweep.json). GEMV programs of 8 rank rows (rank-8 adapters in calls of
# max_rank 8) gained 2-5% more (113.2 and 140.1 µs above), which the engine's 16-row fused graphs
# leave aside. Launches of more rank rows have no GEMV body (fused_config).
_GEMV_MAX = 1
_GEMV_BLOCK = 1024
# A GEMV body of 16 rank rows takes the tiles of adapters that fit lora_paths.ONE_TOKEN_ROWS (8)
# in blocks of those rows, twice as wide (kernels/lora_fused.py; H200, the engine's S1 calls: 512
# decode tokens on 405 adapters 97.9 µs against 103.6 without, the n = 1000 trace's mixed steps
# 6-12% less; bench/results/lora_engine_calls_narrow.json); fused_config gives calls whose
# adapters all fit them such a body alone, reading those rows when it chooses the launch (as it
# reads every rule of lora_paths).
# The fused grid's tiles lie along its y axis (the slices first: kernels/lora_fused.py), whose
# size CUDA caps.
_MAX_GRID_Y = 65535


class _Narrow(NamedTuple):
    """A fused decode launch with smaller blocks, which more programs share one SM with: taken
    when a call's programs overflow what one wave of the default launch holds but fit one wave
    of this one (fused_config)."""

    wide_per_sm: int  # programs of the default launch one SM holds
    per_sm: int  # programs of this launch one SM holds
    block_k: int
    block_n: int
    warps: int

    def fields(self) -> dict:
        """This launch's LoraLaunch fields (fused_config also fits the blocks to the width)."""
        return dict(shrink_k=self.block_k, expand_n=self.block_n, shrink_warps=self.warps)


# By rank rows; sm_90 only (Hopper: 228 KB of shared memory and 64K registers a
# multiprocessor; Triton 3.6). Programs an SM holds follow from the compiled kernel's registers
# and shared memory, which differ between calls (`python -m bench.kernel_resources` prints them
# for the Llama-2-7B layer's four; a test checks this table against it: each count is the least
# among the calls whose decode programs can reach the window). At 16 rows, with the GEMV body
# the launch carries for one-token tiles (_GEMV_MAX) and its narrow blocks for rank-8 tiles
# (gemv_narrow), the default 256 x 256 launch holds 3 or 4 programs an SM (128-168 registers a
# thread: q/k/v and o 4, gate/up and down 3), 256 x 128 blocks 4 (128 registers); without the
# narrow blocks q/k/v and o held 5 (96 registers), without the GEMV body those blocks held 6
# (63-80 registers), the count behind the rule's timings (fused_config's docstring), which were
# not retaken with either. At 64 rows the default 256 x 256 launch with 8 warps holds 2 (80 KB of
# shared memory), 128 x 128 with 4 warps 4 (5 for q/k/v and o, 4 for gate/up and down: 78-128
# registers). Other rank rows were not measured and keep the default launch.
_NARROW = {16: _Narrow(3, 4, 256, 128, 4), 64: _Narrow(2, 4, 128, 128, 4)}


class LoraLaunch(NamedTuple):
    """Block sizes of one call (launch_config chooses them)."""

    block_m: int  # tokens per tile
    shrink_k: int  # d_in elements per shrink step
    shrink_r: int  # rank rows per shrink program
    expand_n: int  # output columns per expand program
    shrink_warps: int = 4
    expand_warps: int = 4
    stages: int = 3
    split_k: int = 1  # shrink programs per d_in; expand adds their partial sums
    rank_split: int = 1  # shrink programs per (tile, slice, k-split), sharing its rank blocks
    expand_r: int = 16  # rank rows per expand step
    pdl: bool = True  # overlap expand's prologue with shrink (Hopper and later)
    fused: bool = False  # one launch (kernels/lora_fused.py) instead of shrink + expand
    parts: int = 1  # fused: programs sharing one (tile, slice)'s output columns
    tile_programs: int = 0  # two launches: programs along the tiles (0: _tile_programs picks)
    gemv_max: int = 0  # fused: tiles of at most this many tokens take the GEMV body (0: none)
    gemv_k: int = 256  # fused: the GEMV body's d_in block
    gemv_n: int = 256  # fused: the GEMV body's column block
    gemv_r: int = 0  # fused: the GEMV body's rank rows (0: shrink_r's; any power of two)
    # fused: where the GEMV body holds twice these rows, the tiles of adapters that fit them take
    # blocks of these rows, twice as wide (0: none)
    gemv_narrow: int = 0
    # fused: a one-token tile whose slice's A and Bᵀ rows each fit one GEMV block issues all its
    # loads before its first sum (kernels/lora_fused.py _hoisted_gemv; where the call's geometry
    # allows it: gemv_hoists)
    gemv_hoist: bool = False
    # fused, with gemv_hoist: tiles of two tokens take a hoisted body too, the second token
    # reusing the weights loaded for the first (the tables a decode step writes with pair_tiles:
    # tile_table.PAIR_BLOCK; kernels/lora_fused.py _hoisted_gemv, PAIR)
    gemv_pair: bool = False


def launch_config(
    num_tokens: int,
    d_in: int,
    width: int,
    max_rank: int,
    num_slices: int = 1,
    out_width: int = 0,
    rank_block: int = 16,
) -> LoraLaunch:
    """16-token tiles (a decode token wastes little of a 16-row dot), 32 for big batches where
    tiles are full; K and N blocks inside one pool chunk when the width allows (each row of a
    block is one contiguous run); d_in split when too few programs would stream the weights.
    With ``out_width`` (the widest slice; lora_apply passes it) prefill-sized calls of several
    slices get the fused one-launch kernel instead (kernels/lora_paths.py). ``rank_block``: the
    two launches' rank rows a program, 16 unless the caller's adapters are wider
    (lora_paths.step_is_wide: 32, in 16-token tiles)."""
    if rank_block < 16 or rank_block & (rank_block - 1):
        raise ValueError(f"rank_block must be a power of two >= 16, got {rank_block}")
    if out_width and shapes_prefer_fused(num_tokens, max_rank, num_slices):
        return fused_config(num_tokens, width, max_rank, num_slices, out_width, d_in=d_in)
    big = num_tokens > 1024
    shrink_k = _fit_block(256, width)
    # rank_block (16 unless the caller says more) rank rows a program whatever max_rank: an
    # engine is sized for its largest adapter (max_lora_rank 128 by default) but serves mostly
    # small ones; wider blocks would compute masked rows for them (H200, 292 decode tokens on
    # 96 rank-8 adapters, one layer's q/k/v and o calls: 69 µs at max_rank 16 with 16-row
    # blocks, against 80 at 32 and 89 at 128 with 32-row blocks;
    # bench/results/lora_engine_calls_before_tiles.json). Wider blocks take 16-token tiles
    # (lora_paths.step_is_wide).
    programs = max(1, min(num_tokens, 1024)) * num_slices  # decode worst case: a tile a token
    want = _SHRINK_PROGRAMS_PER_SM * num_sms() // programs
    split = _decode_split(num_tokens, d_in, shrink_k)
    rank_split = 1
    # a WIDE decode step (_wide_split)
    if rank_block > 16 and num_tokens <= lora_paths.FUSED_MAX_TOKENS:
        split, rank_split = _wide_split(num_tokens, split)
    while split * 2 <= want and d_in >= 4 * split * shrink_k:
        split *= 2
    return LoraLaunch(
        block_m=32 if big and rank_block == 16 else 16,
        shrink_k=shrink_k,
        shrink_r=rank_block,
        expand_n=_fit_block(256, width),
        split_k=split,
        expand_r=rank_block,
        rank_split=rank_split,
    )


def _wide_split(num_tokens: int, split: int) -> tuple[int, int]:
    """split_k and rank_split of a decode-sized call on programs of more than 16 rank rows (S2's
    decode steps: lora_paths.step_is_wide). Their tiles are few (tokens share adapters) and of
    uneven rank (8 to 64): a shrink program that loops over all of a rank-64 adapter's blocks
    alone sets the call's time, so two programs share each (tile, slice, k-split)'s blocks; and
    from _WIDE_SPLIT_ONE_TOKENS the rank split alone gives enough programs, so d_in is not split.
    H200, one layer's q/k/v and o calls, ranks 8-64 cycled, 32 rank rows (split_k, rank_split):
    400 decode tokens on 98 adapters (2, 1) 116.3 µs, (2, 2) 105.8, (1, 2) 98.9; 256 on 94
    112.0 / 99.9 / 97.7; 400 on 329 297.2 / 288.6 / 262.5; but 64 on 46 69.8 / 57.6 / 61.4. Blocks
    of 16 rows over 4 programs, splits of 4, 64-row expands and tiles listed by rank were each
    slower or level (bench/results/lora_engine_calls_s2_split.json, --s2-split)."""
    return (1 if num_tokens >= _WIDE_SPLIT_ONE_TOKENS else split), 2


def _decode_split(num_tokens: int, d_in: int, shrink_k: int) -> int:
    """The least split_k: 2 for decode-sized calls. Their two-launch steps are the ones whose
    tokens share adapters (steps of mostly distinct adapters fuse: kernels/lora_paths.py), so
    their tiles are few and each streams its A alone. H200, one layer's S1 q/k/v and o calls in
    a graph, split 1 against 2: 512 tokens on 5 adapters 45.3 -> 38.6 µs, on 30 52.8 -> 47.1,
    on 100 72.5 -> 62.8; 64 on 41 39.8 -> 32.9; but 512 on 403 (a fused step) 197.5 -> 209.1
    (bench/results/lora_engine_calls.json, --splits). Only up to the d_in measured (4096): a
    down call's shrink (d_in 11008) compiles to 168 registers a thread at split 2 (3 programs an
    SM, against 4; `python -m bench.kernel_resources`) and was not timed."""
    if num_tokens <= lora_paths.FUSED_MAX_TOKENS and 8 * shrink_k <= d_in <= _DECODE_SPLIT_MAX_D_IN:
        return 2
    return 1


def fused_config(
    num_tokens: int, width: int, max_rank: int, num_slices: int, out_width: int, *, d_in: int
) -> LoraLaunch:
    """One launch. Weight blocks of 256 columns (rank rows x 256: 8 KB at rank 16, 32 KB at
    rank 64, streamed by 8 warps from 64 rows) and 128 from 128 rank rows; prefill-sized calls at
    64 rows (lora_paths.prefill_step_fuses_wide) take 128 columns and 4 warps. ``parts`` programs
    share a (tile, slice)'s output columns when tokens alone give an SM at most one program
    (parts = 2 x SMs // programs; the distinct-adapter worst case, a tile a token), at most
    one per column block,
    and at most 1 + out_width // d_in: each part reads the tile's whole A (all but one from
    L2), so the extra A reads stay within the slice's Bᵀ bytes (o: 2 parts, down: 1); but 2
    while two parts give at most one program an SM (down up to 66 tokens on 132 SMs).
    Tiles of 16 tokens up to _DOT_16_MAX_TOKENS (the engine's steps), 32 for larger prefill
    calls. Tiles of one token (a decode token whose adapter no other token of the call uses)
    take the GEMV body with 1024-element weight blocks (_GEMV_MAX), in launches of
    FUSED_DECODE_ROWS rank rows, the engine's (a program of more rows would hold rows x 1024
    weights in registers; not measured).

    On sm_90, decode calls whose programs overflow one wave of that launch but fit one wave of
    a launch with smaller blocks (_NARROW) take the smaller blocks: a partial second wave
    streams through too few programs an SM (rank 16, 256 tokens, q/k/v: 768 programs, 528 a
    wave of the default launch on 132 SMs, 792 of 256 x 128 blocks: 72 µs against 89, before
    the GEMV body, with which those blocks hold 4 programs an SM, not 6, and that call keeps
    the default launch: the window at 16 rows is now 397-528 programs).

    Measured per call on the H200 for decode at ranks 16 and 64 (bench/results/
    kernels_sweep_blocks.json and kernels_sweep_waves.json, docs/kernels.md), Llama-2-7B
    shapes; other model shapes (whose calls compile to other register counts), prefill at
    ranks above 32 and 128 rank rows take the same rules unmeasured."""
    rows = fused_rank_rows(max_rank)
    blk = _fit_block(max(32, min(256, 16384 // rows)), width)
    sms = num_sms()
    programs = num_tokens * num_slices
    cap = 1 + out_width // d_in
    if 2 * programs <= sms:
        cap = max(cap, 2)
    parts = max(1, min(_FUSED_PROGRAMS_PER_SM * sms // programs, -(-out_width // blk), cap))
    block_k = block_n = blk
    warps = 8 if rows >= 64 else 4
    narrow = _NARROW.get(rows) if _hopper() else None
    decode = num_tokens <= lora_paths.FUSED_MAX_TOKENS
    if decode and narrow and narrow.wide_per_sm * sms < programs * parts <= narrow.per_sm * sms:
        block_k = _fit_block(narrow.block_k, width)
        block_n = _fit_block(narrow.block_n, width)
        warps = narrow.warps
    if not decode and rows == lora_paths.WIDE_FUSED_ROWS:  # a wide prefill-sized step's calls
        # H200, one layer's S2 calls of mixed steps (lora_paths.prefill_step_fuses_wide), 128-
        # against 256-wide blocks with 4 warps and with the 8 warps of this rows' default: 98
        # adapters, 300 decode tokens beside three 512-token prompts 174.4 / 187.9 / 233.2 µs,
        # 400 beside four 400-token prompts 175.9 / 190.1 / 232.7, beside three 200-token
        # prompts 161.9 / 147.2 / 168.2; 64-wide blocks and 8 warps slower
        # (bench/results/lora_engine_calls_s2_steps.json).
        block_k = block_n = _fit_block(128, width)
        warps = 4
    # A prefill-sized call's prompt tiles (of 16 tokens: the engine's mixed steps) stream their
    # shrink and expand loops with 3 weight blocks in flight, not 2, where that keeps the
    # programs an SM (16 rank rows: 48 KB of shared memory, 4 programs an SM as with 2 in
    # flight). H100, one layer's S1 q/k/v and o calls of the traces' mixed steps writing the
    # delta, as the engine's steps of 256 tokens or more do (µs): 4 stages against 3 took
    # 0.3-8% less on all 7 steps (400 decode tokens on 331 adapters beside four 400-token prompts
    # 116.6 / 117.3, 220 on 187 beside a 300-token prompt 59.4 / 64.6, a 1024-token prompt 44.9 /
    # 48.3); 2 and 4 parts lost 3-30% on every step of 520 tokens or more; 5 stages (3 programs
    # an SM) and 8 other dot-body points led by more than 0.2 µs on one step only, 300 decode
    # tokens on 5 adapters beside three 512-token prompts (5 stages 56.9, 32-token tiles 57.1,
    # against 62.3), and both of those lost 4-27% on the steps of 90 adapters or more
    # (bench/results/lora_engine_calls_delta_dot_6c7816f_h100.json, --delta-dot, and
    # lora_engine_calls_parts_9b8108a_h100.json, --parts). Adding in place, 2 stages were 11-39%
    # slower (lora_engine_calls_stages_066495a_h100.json, --stages).
    prompt_tiles = not decode and num_tokens <= _DOT_16_MAX_TOKENS  # 16-token tiles
    stages = 4 if prompt_tiles and rows <= lora_paths.FUSED_DECODE_ROWS else 3
    # The GEMV body's rows: lora_paths.ONE_TOKEN_ROWS (8) where every adapter fits them (a decode
    # step on one-token tiles: kernels/lora_paths.one_token_step_fuses), in 4096-wide blocks
    # streamed by 8 warps in decode (H200, one layer's S1 q/k/v and o calls, 8-63 tokens on
    # one-token tiles: 12.9-20.3 µs against 14.9-21.6 with 2048-wide blocks and 4 warps;
    # bench/results/lora_engine_calls_one_token.json), each one-token tile issuing every load before
    # its first sum where one block holds a slice (gemv_hoists; against the loads in order, 8-63
    # tokens -0.1 to +0.6 µs faster, 512 on 98 adapters 51.3 against 55.8, on 390 75.2 against 77.2:
    # lora_engine_calls_hoist.json); else the launch's rows, in 1024-wide ones.
    narrow_rows = lora_paths.ONE_TOKEN_ROWS
    gemv_rows = rows
    gemv = _fit_block(_GEMV_BLOCK, width)
    hoist = False
    if max_rank <= narrow_rows:
        gemv_rows = narrow_rows
        gemv = _fit_block(_GEMV_BLOCK * (4 if decode else 2), width)
        warps = 8 if decode else warps
        hoist = decode  # one-token tiles issue every load first (gemv_hoists)
    return LoraLaunch(
        block_m=16 if num_tokens <= _DOT_16_MAX_TOKENS else 32,
        shrink_k=block_k,
        shrink_r=rows,
        expand_n=block_n,
        expand_r=rows,
        shrink_warps=warps,
        fused=True,
        parts=parts,
        stages=stages,
        gemv_max=_GEMV_MAX if rows <= lora_paths.FUSED_DECODE_ROWS else 0,
        gemv_k=gemv,
        gemv_n=gemv,
        gemv_r=gemv_rows,
        gemv_narrow=narrow_rows,
        gemv_hoist=hoist,
        gemv_pair=hoist and lora_paths.ONE_TOKEN_PAIRS,
    )


@functools.cache
def _hopper() -> bool:
    """Whether the GPU is sm_90, the one _NARROW's counts are for (False under the interpreter)."""
    return (
        not INTERPRET and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
    )


def _fit_block(preferred: int, width: int) -> int:
    """The largest power of two <= preferred that divides width (>= 16), else preferred."""
    b = preferred
    while b > 16 and width % b:
        b //= 2
    return b if width % b == 0 else preferred


@triton.jit
def _lora_shrink_kernel(
    # activations x [T, D_IN]; output h [SPLIT_K, T, slices, >= max_rank] fp32 (unit last stride)
    x_ptr, stride_xt, h_ptr, stride_hk, stride_ht, stride_hs,
    # pool layer [2, slots, W] (unit last stride); A chunks live in half 0
    pool_ptr, stride_slot,
    # LoRA index: slot table [N, C]; per-module ranks and A offsets [N, 7]
    table_ptr, stride_table, ranks_ptr, a_off_ptr, stride_idx,
    # segments
    tiles_ptr,  # the call's tile table [K, 3] (kernels/tile_table.py)
    NUM_TILES,  # the tile count's bound (max_tiles <= K); programs stride over the tiles
    mods_ptr,  # [7] int32: the modules the step's adapters have (LoraTokens.modules)
    MAX_RANK,
    D_IN: tl.constexpr, W: tl.constexpr, IN_CHUNKS: tl.constexpr,
    M0: tl.constexpr, M1: tl.constexpr, M2: tl.constexpr,
    SPLIT_K: tl.constexpr, K_PER: tl.constexpr, RANK_SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    ALIGNED: tl.constexpr, DOT_F32: tl.constexpr, PDL: tl.constexpr, MASKED: tl.constexpr,
):  # fmt: skip
    if PDL:
        gdc_launch_dependents()  # expand may start its prologue now
    q = tl.program_id(1)
    s = q // (SPLIT_K * RANK_SPLIT)
    ks = q // RANK_SPLIT % SPLIT_K
    rp = q % RANK_SPLIT  # this program's rank blocks: rp, rp + RANK_SPLIT, ...
    m = pick3(s, M0, M1, M2)
    if MASKED:
        if tl.load(mods_ptr + m) == 0:  # no adapter of the step has this module
            return
    offs_k = tl.arange(0, BLOCK_K)
    k_lo = ks * K_PER
    k_hi = tl.minimum(k_lo + K_PER, D_IN)
    # Two tiles ahead: the table row of the tile after next and the next tile's index row are
    # in flight while this tile streams, so a tile waits for its slot lookups and weights only
    # (a tile's chain of dependent loads, table row -> index row -> slots -> weights, would
    # otherwise be the program's critical path in decode, where tiles are one token).
    tile = tl.program_id(0)
    step = tl.num_programs(0)
    a, m_start, m_end = next_tile(tiles_ptr, tile, NUM_TILES)
    rank, a_off = _index_entry(a, ranks_ptr, a_off_ptr, stride_idx, m, MAX_RANK)
    a_n, start_n, end_n = next_tile(tiles_ptr, tile + step, NUM_TILES)
    while a >= 0:
        a_nn, start_nn, end_nn = next_tile(tiles_ptr, tile + 2 * step, NUM_TILES)
        rank_n, a_off_n = _index_entry(a_n, ranks_ptr, a_off_ptr, stride_idx, m, MAX_RANK)
        a64 = a.to(tl.int64)
        offs_m = m_start + tl.arange(0, BLOCK_M)
        m_ok = offs_m < m_end
        x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xt
        h_rows = h_ptr + ks * stride_hk + offs_m[:, None].to(tl.int64) * stride_ht + s * stride_hs
        # none for a module the adapter lacks (rank 0), or past its rank
        for r0 in range(rp * BLOCK_R, rank, RANK_SPLIT * BLOCK_R):
            rows = r0 + tl.arange(0, BLOCK_R)
            row_ok = rows < rank
            # A row j, chunk c sits at slot-table position a_off + j * IN_CHUNKS + c
            row_pos = table_ptr + a64 * stride_table + a_off + rows * IN_CHUNKS
            acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
            # One slot lookup per row and pool chunk, outside the streaming loop: a lookup
            # inside it would serialize every step behind a dependent load and defeat the
            # pipelining.
            for c in range(k_lo // W, tl.cdiv(k_hi, W)):
                slot = tl.load(row_pos + c, mask=row_ok, other=0).to(tl.int64)
                w_rows = pool_ptr + slot[:, None] * stride_slot - c * W  # + k: element k
                k_end = tl.minimum(k_hi, c * W + W)
                for k0 in range(tl.maximum(k_lo, c * W), k_end, BLOCK_K):
                    if ALIGNED:  # W and K_PER are multiples of BLOCK_K
                        k0 = tl.multiple_of(k0, BLOCK_K)
                    kk = k0 + offs_k
                    k_ok = kk < k_end
                    w = tl.load(
                        w_rows + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0
                    )
                    xt = tl.load(
                        x_rows + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0
                    )
                    if DOT_F32:
                        acc += tl.dot(
                            xt.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee"
                        )
                    else:
                        acc += tl.dot(xt, tl.trans(w.to(xt.dtype)))  # [M, K] x [K, R]
            tl.store(
                h_rows + rows[None, :],
                acc.to(h_ptr.dtype.element_ty),
                mask=m_ok[:, None] & row_ok[None, :],
            )
        tile += step
        a, m_start, m_end, rank, a_off = a_n, start_n, end_n, rank_n, a_off_n
        a_n, start_n, end_n = a_nn, start_nn, end_nn


@triton.jit
def _index_entry(a, ranks_ptr, off_ptr, stride_idx, m, MAX_RANK):
    """Adapter row ``a``'s rank (clamped to MAX_RANK) and weight offset for module m; rank 0
    and offset 0 for a = -1 (no tile), which reads nothing."""
    ok = a >= 0
    entry = a.to(tl.int64) * stride_idx + m
    rank = tl.load(ranks_ptr + entry, mask=ok, other=0)
    return tl.minimum(rank, MAX_RANK), tl.load(off_ptr + entry, mask=ok, other=0)


@triton.jit
def _shrunk(h_rows, stride_hk, rows, row_ok, m_ok, SPLIT_K: tl.constexpr):
    """Σ over the k-splits of h[k, tokens, slice, rows]: [BLOCK_M, BLOCK_R] fp32."""
    mask = m_ok[:, None] & row_ok[None, :]
    h = tl.load(h_rows + rows[None, :], mask=mask, other=0.0).to(tl.float32)
    for k in tl.static_range(1, SPLIT_K):
        h += tl.load(h_rows + k * stride_hk + rows[None, :], mask=mask, other=0.0)
    return h


@triton.jit
def _bt_block(
    table_row,
    pool_ptr,
    stride_half,
    stride_slot,
    rows,
    row_ok,
    out_chunks,
    n0,
    offs_n,
    n_ok,
    W: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    """Rows ``rows`` of Bᵀ, columns offs_n: [BLOCK_R, BLOCK_N]. Bᵀ row j, chunk c sits at
    slot-table position j * out_chunks + c past ``table_row``."""
    if ALIGNED:  # BLOCK_N divides W: the block lies in one chunk
        slot = tl.load(table_row + rows * out_chunks + n0 // W, mask=row_ok, other=0)
        n_in = tl.multiple_of(n0 % W, BLOCK_N)
        ptrs = slot.to(tl.int64)[:, None] * stride_slot + n_in + tl.arange(0, BLOCK_N)[None, :]
    else:
        mask = row_ok[:, None] & n_ok[None, :]
        slot = tl.load(
            table_row + rows[:, None] * out_chunks + offs_n[None, :] // W, mask=mask, other=0
        )
        ptrs = slot.to(tl.int64) * stride_slot + offs_n[None, :] % W
    return tl.load(pool_ptr + stride_half + ptrs, mask=row_ok[:, None] & n_ok[None, :], other=0.0)


@triton.jit
def _lora_expand_kernel(
    # output y [T, sum(widths)]; h [SPLIT_K, T, slices, >= max_rank] (unit last strides)
    y_ptr, stride_yt, h_ptr, stride_hk, stride_ht, stride_hs,
    # pool layer [2, slots, W]; Bᵀ chunks live in half 1
    pool_ptr, stride_half, stride_slot,
    # LoRA index: slot table; per-module ranks, Bᵀ offsets, scales [N, 7]
    table_ptr, stride_table, ranks_ptr, b_off_ptr, scales_ptr, stride_idx, stride_scale,
    tiles_ptr,  # the call's tile table [K, 3] (kernels/tile_table.py)
    NUM_TILES,  # the tile count's bound (max_tiles <= K); programs stride over the tiles
    mods_ptr,  # [7] int32: the modules the step's adapters have (LoraTokens.modules)
    MAX_RANK,
    W: tl.constexpr,
    M0: tl.constexpr, M1: tl.constexpr, M2: tl.constexpr,
    N0: tl.constexpr, N1: tl.constexpr, N2: tl.constexpr,  # slice widths
    NB0: tl.constexpr, NB1: tl.constexpr,  # column blocks of slices 0 and 1
    SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr, ALIGNED: tl.constexpr, DOT_F32: tl.constexpr,
    PDL: tl.constexpr, MASKED: tl.constexpr,
):  # fmt: skip
    nb = tl.program_id(1)
    s = tl.where(nb < NB0, 0, tl.where(nb < NB0 + NB1, 1, 2))  # this block's slice
    n0 = (nb - pick3(s, 0, NB0, NB0 + NB1)) * BLOCK_N  # first column inside the slice
    width = pick3(s, N0, N1, N2)
    m = pick3(s, M0, M1, M2)
    if MASKED:
        if tl.load(mods_ptr + m) == 0:  # no adapter of the step has this module
            return
    out_chunks = (width + W - 1) // W
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < width
    y_cols = y_ptr + pick3(s, 0, N0, N0 + N1) + offs_n[None, :]
    # Two tiles ahead, as in the shrink: the table row of the tile after next and the next
    # tile's index row load while this tile's block streams.
    tile = tl.program_id(0)
    step = tl.num_programs(0)
    a, m_start, m_end = next_tile(tiles_ptr, tile, NUM_TILES)
    rank, b_off = _index_entry(a, ranks_ptr, b_off_ptr, stride_idx, m, MAX_RANK)
    a_n, start_n, end_n = next_tile(tiles_ptr, tile + step, NUM_TILES)
    while a >= 0:
        a_nn, start_nn, end_nn = next_tile(tiles_ptr, tile + 2 * step, NUM_TILES)
        rank_n, b_off_n = _index_entry(a_n, ranks_ptr, b_off_ptr, stride_idx, m, MAX_RANK)
        if rank > 0:
            # Up to gdc_wait only what existed before shrink started is read: on the first
            # tile this overlaps shrink's end; on later ones gdc_wait returns at once.
            a64 = a.to(tl.int64)
            table_row = table_ptr + a64 * stride_table + b_off
            scale = tl.load(scales_ptr + a64 * stride_scale + m)
            offs_m = m_start + tl.arange(0, BLOCK_M)
            m_ok = offs_m < m_end
            y_ptrs = y_cols + offs_m[:, None].to(tl.int64) * stride_yt
            y_ok = m_ok[:, None] & n_ok[None, :]
            y = tl.load(y_ptrs, mask=y_ok, other=0.0)
            rows = tl.arange(0, BLOCK_R)
            bt = _bt_block(
                table_row, pool_ptr, stride_half, stride_slot, rows, rows < rank, out_chunks,
                n0, offs_n, n_ok, W, BLOCK_N, ALIGNED,
            )  # fmt: skip
            if PDL:
                gdc_wait()  # h is shrink's output
            h_rows = h_ptr + offs_m[:, None].to(tl.int64) * stride_ht + s * stride_hs
            h = _shrunk(h_rows, stride_hk, rows, rows < rank, m_ok, SPLIT_K)
            if DOT_F32:
                acc = tl.dot(h, bt.to(tl.float32), input_precision="ieee")
            else:
                acc = tl.dot(h.to(bt.dtype), bt)  # [M, R] x [R, N]
            for r0 in range(BLOCK_R, rank, BLOCK_R):  # ranks past the first block, if any
                rows = r0 + tl.arange(0, BLOCK_R)
                bt = _bt_block(
                    table_row, pool_ptr, stride_half, stride_slot, rows, rows < rank,
                    out_chunks, n0, offs_n, n_ok, W, BLOCK_N, ALIGNED,
                )  # fmt: skip
                h = _shrunk(h_rows, stride_hk, rows, rows < rank, m_ok, SPLIT_K)
                if DOT_F32:
                    acc += tl.dot(h, bt.to(tl.float32), input_precision="ieee")
                else:
                    acc += tl.dot(h.to(bt.dtype), bt)
            out = (y.to(tl.float32) + acc * scale).to(y_ptr.dtype.element_ty)
            tl.store(y_ptrs, out, mask=y_ok)
        tile += step
        a, m_start, m_end, rank, b_off = a_n, start_n, end_n, rank_n, b_off_n
        a_n, start_n, end_n = a_nn, start_nn, end_nn


def _slice_args(modules: tuple[int, ...], widths: tuple[int, ...] = ()) -> dict:
    mods = list(modules) + [modules[-1]] * (MAX_SLICES - len(modules))
    out = {"M0": mods[0], "M1": mods[1], "M2": mods[2]}
    if widths:
        w = list(widths) + [0] * (MAX_SLICES - len(widths))
        out.update(N0=w[0], N1=w[1], N2=w[2])
    return out


def _tiles(tokens, block_m: int) -> torch.Tensor:
    """The tile table of ``block_m``-token tiles (kernels/tile_table.py): [K, 3]."""
    if block_m not in TILE_BLOCKS:
        raise ValueError(f"block_m must be one of {TILE_BLOCKS}, got {block_m}")
    return tokens.tiles[TILE_BLOCKS.index(block_m)]


def _mask(tokens) -> torch.Tensor:
    """The kernels' module mask argument: LoraTokens.modules, or (unused: MASKED is off) any
    int32 tensor of the call."""
    return tokens.seg_lora if tokens.modules is None else tokens.modules


def _pdl(cfg: LoraLaunch, device: torch.device) -> bool:
    return cfg.pdl and pdl_launch(device)


def _tile_programs(cfg: LoraLaunch, bound: int, per_tile: int) -> int:
    """Programs along the tiles: as many as the tile bound, up to _TILE_PROGRAMS_PER_SM an SM
    with ``per_tile`` programs each (or cfg.tile_programs); each strides over the tiles."""
    want = cfg.tile_programs or _TILE_PROGRAMS_PER_SM * num_sms() // per_tile
    return max(1, min(bound, want))


def _shrink(x, h, pool_layer, index, tokens, modules, max_rank, cfg, call, pdl):
    split = cfg.split_k
    bound = max_tiles(call.num_tokens, cfg.block_m, call.num_segs)
    per_tile = len(modules) * split * cfg.rank_split
    grid = (_tile_programs(cfg, bound, per_tile), per_tile)
    _lora_shrink_kernel[grid](
        x, x.stride(0), h[0], h.stride(0), h.stride(1), h.stride(2),
        pool_layer, pool_layer.stride(1),
        index.slot_table, index.slot_table.stride(0), index.ranks, index.a_offsets,
        index.ranks.stride(0),
        _tiles(tokens, cfg.block_m), bound, _mask(tokens),
        max_rank,
        D_IN=call.d_in, W=call.width, IN_CHUNKS=call.in_chunks, SPLIT_K=split,
        K_PER=triton.cdiv(triton.cdiv(call.d_in, split), cfg.shrink_k) * cfg.shrink_k,
        RANK_SPLIT=cfg.rank_split,
        BLOCK_M=cfg.block_m, BLOCK_K=cfg.shrink_k, BLOCK_R=cfg.shrink_r,
        ALIGNED=call.width % cfg.shrink_k == 0, DOT_F32=dot_f32(x.dtype), PDL=pdl,
        MASKED=tokens.modules is not None,
        num_warps=cfg.shrink_warps, num_stages=cfg.stages,
        **_slice_args(modules),
    )  # fmt: skip


def _expand(y, h, pool_layer, index, tokens, modules, out_widths, max_rank, cfg, call, pdl):
    blocks = [triton.cdiv(w, cfg.expand_n) for w in out_widths] + [0, 0]
    bound = max_tiles(call.num_tokens, cfg.block_m, call.num_segs)
    grid = (_tile_programs(cfg, bound, sum(blocks)), sum(blocks))
    _lora_expand_kernel[grid](
        y, y.stride(0), h[0], h.stride(0), h.stride(1), h.stride(2),
        pool_layer, pool_layer.stride(0), pool_layer.stride(1),
        index.slot_table, index.slot_table.stride(0), index.ranks, index.b_offsets,
        index.scales, index.ranks.stride(0), index.scales.stride(0),
        _tiles(tokens, cfg.block_m), bound, _mask(tokens),
        max_rank,
        W=call.width, NB0=blocks[0], NB1=blocks[1], SPLIT_K=h.shape[0],
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.expand_n, BLOCK_R=cfg.expand_r,
        ALIGNED=call.width % cfg.expand_n == 0, DOT_F32=dot_f32(y.dtype), PDL=pdl,
        MASKED=tokens.modules is not None,
        num_warps=cfg.expand_warps, num_stages=1, launch_pdl=pdl, maxnreg=_EXPAND_MAX_REGISTERS,
        **_slice_args(modules, out_widths),
    )  # fmt: skip


def _fused(y, x, pool_layer, index, tokens, modules, out_widths, max_rank, cfg, call, delta=False):
    if cfg.shrink_r < max_rank:
        raise ValueError(f"a fused config holds {cfg.shrink_r} rank rows, max_rank is {max_rank}")
    gemv_rows = cfg.gemv_r or cfg.shrink_r
    if cfg.gemv_max:
        for name in ("gemv_max", "gemv_k", "gemv_n"):
            v = getattr(cfg, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two, got {v}")
        if gemv_rows & (gemv_rows - 1):
            raise ValueError(f"gemv_r must be a power of two, got {gemv_rows}")
    if cfg.gemv_max and gemv_rows < max_rank:
        raise ValueError(f"a GEMV body holds {gemv_rows} rank rows, max_rank is {max_rank}")
    tiles = max_tiles(call.num_tokens, cfg.block_m, call.num_segs)
    if tiles > _MAX_GRID_Y:
        raise ValueError(
            f"a fused call takes at most {_MAX_GRID_Y} tiles (a grid's y), this one "
            f"{tiles}: use the two launches (fused=False) for {call.num_tokens} tokens"
        )
    grid = (len(modules) * cfg.parts, tiles)
    lora_fused_kernel[grid](
        x, x.stride(0), y, y.stride(0),
        pool_layer, pool_layer.stride(0), pool_layer.stride(1),
        index.slot_table, index.slot_table.stride(0), index.ranks, index.a_offsets,
        index.b_offsets, index.scales, index.ranks.stride(0), index.scales.stride(0),
        _tiles(tokens, cfg.block_m), _mask(tokens),
        max_rank, cfg.parts,
        D_IN=call.d_in, W=call.width, IN_CHUNKS=call.in_chunks,
        BLOCK_M=cfg.block_m, BLOCK_K=cfg.shrink_k, BLOCK_N=cfg.expand_n, BLOCK_R=cfg.shrink_r,
        DOT_F32=dot_f32(y.dtype), MASKED=tokens.modules is not None,
        PART_N=max(cfg.expand_n, _gemv_blocks(cfg, gemv_rows)) if cfg.gemv_max else cfg.expand_n,
        GEMV_MAX=cfg.gemv_max, GEMV_K=cfg.gemv_k, GEMV_N=cfg.gemv_n,
        GEMV_R=gemv_rows, GEMV_NARROW_R=cfg.gemv_narrow,
        GEMV_HOIST=gemv_hoists(cfg, call.d_in, call.width, out_widths),
        GEMV_PAIR=cfg.gemv_pair, DELTA=delta,
        num_warps=cfg.shrink_warps, num_stages=cfg.stages,
        **_slice_args(modules, out_widths), **lora_dependent(x.device),
    )  # fmt: skip


def gemv_hoists(cfg: LoraLaunch, d_in: int, width: int, out_widths: tuple[int, ...]) -> bool:
    """Whether a fused launch's one-token tiles take the GEMV body with every load issued
    first (kernels/lora_fused.py _hoisted_gemv): on request (gemv_hoist), where each slice's A
    rows (d_in) and Bᵀ rows (its width) fit one GEMV block and one pool chunk of ``width``
    elements, so that each is one load."""
    if not (cfg.gemv_hoist and cfg.gemv_max):
        return False
    return d_in <= min(cfg.gemv_k, width) and max(out_widths) <= min(cfg.gemv_n, width)


def _gemv_blocks(cfg: LoraLaunch, gemv_rows: int) -> int:
    """The widest column block of a fused launch's GEMV body: gemv_n, or twice that for its
    tiles of small-rank adapters (gemv_narrow: kernels/lora_fused.py)."""
    return cfg.gemv_n * (2 if cfg.gemv_narrow and gemv_rows == 2 * cfg.gemv_narrow else 1)


def workspace_size(
    num_tokens: int, num_slices: int, max_rank: int, config: LoraLaunch | None = None
) -> int:
    """fp32 elements a lora_apply workspace needs: the shrink's partial sums.

    Without a config this bounds every launch_config choice: decode-sized calls split in two
    (_decode_split), and further splits only happen while tokens x slices x split stays within
    the shrink programs wanted for the GPU."""
    if config is not None:
        return config.split_k * num_tokens * num_slices * max_rank
    # an upper bound: d_in is not known
    least = 2 if num_tokens <= lora_paths.FUSED_MAX_TOKENS else 1
    rows = max(least * num_tokens * num_slices, _SHRINK_PROGRAMS_PER_SM * num_sms())
    return rows * max_rank


def _no_zero_tiles(tokens, who: str) -> None:
    """The two launches' programs stride over the tiles and stop at the first row below 0, so
    tables that list tokens without an adapter (a delta step's) would cut their work short."""
    if tokens.zero_tiles:
        raise ValueError(
            f"{who} cannot take tile tables that list tokens without an adapter "
            "(LoraTokens.zero_tiles: a delta step's); use the fused kernel"
        )


def lora_shrink(x, pool_layer, index, tokens, modules, max_rank, *, out=None, config=None):
    """h = x · Aᵀ per slice, [T, slices, max_rank], zeros past each rank and for base tokens.

    ``out`` (optional, any float dtype, [T, slices, >= max_rank], unit last stride) receives h.
    """
    check_float("x", x)
    call = check_call(x, pool_layer, index, tokens, modules, max_rank, x.shape[1])
    _no_zero_tiles(tokens, "lora_shrink")
    cfg = config or launch_config(x.shape[0], x.shape[1], call.width, max_rank, len(modules))
    cfg = cfg._replace(split_k=1)  # written straight into out
    shape = (x.shape[0], len(modules), max_rank)
    if out is None:
        out = torch.zeros(shape, dtype=x.dtype, device=x.device)
    elif out.dim() != 3 or out.shape[:2] != shape[:2] or out.shape[2] < max_rank:
        raise ValueError(
            f"out must be [{shape[0]}, {shape[1]}, >= {max_rank}], got {tuple(out.shape)}"
        )
    else:
        out.zero_()
    if call.num_tokens:
        _shrink(x, out[None], pool_layer, index, tokens, modules, max_rank, cfg, call, False)
    return out


def lora_expand(y, h, pool_layer, index, tokens, modules, out_widths, *, config=None):
    """y[t, slice s] += scale · h[t, s, :rank] · Bᵀ in place; h as lora_shrink returns it."""
    check_float("y", y)
    check_widths(y, modules, out_widths)
    if h.dim() != 3 or h.shape[:2] != (y.shape[0], len(modules)) or h.stride(2) != 1:
        raise ValueError(
            f"h must be [{y.shape[0]}, {len(modules)}, rank] with a unit last "
            f"stride, got {tuple(h.shape)}"
        )
    max_rank = h.shape[2]
    call = check_call(y, pool_layer, index, tokens, modules, max_rank)
    _no_zero_tiles(tokens, "lora_expand")
    cfg = config or launch_config(y.shape[0], 0, call.width, max_rank, len(modules))
    if call.num_tokens:
        _expand(
            y,
            h[None],
            pool_layer,
            index,
            tokens,
            modules,
            tuple(out_widths),
            max_rank,
            cfg,
            call,
            False,
        )


def lora_apply(
    y,
    x,
    pool_layer,
    index,
    tokens,
    modules,
    out_widths,
    max_rank,
    *,
    workspace=None,
    config=None,
    fused: bool | None = None,
    rank_block: int = 16,
    delta: bool = False,
):
    """The model's LoRA hook: y[:, slices] += scale · x · Aᵀ · Bᵀ, two launches or one.

    ``delta``: y[:, slices] = scale · x · Aᵀ · Bᵀ instead, y's contents never read, on the fused
    kernel (the call must take it): every token's rows are written, zeros where the token has
    no delta, so the step's tile tables must list its tokens without an adapter too
    (tile_table.block_tiles' zeros: rows ZERO_ROW; make_lora_tokens(zeros=True),
    StepBatch.fill(zero_tiles=True)). The base GEMM then adds onto it (models/llama.py).

    ``workspace`` (optional): a contiguous fp32 device buffer of at least
    ``workspace_size(T, len(modules), max_rank)`` elements; without it one is allocated
    (from the graph's pool when capturing). ``config`` fixes the launch; otherwise ``fused``
    picks the path (True: the fused kernel, if it can hold max_rank rows; False: two
    launches) or, None, launch_config picks it from the shapes. ``rank_block``: the two
    launches' rank rows a program (launch_config).
    """
    check_modules(modules, max_rank)
    check_float("x", x)
    check_float("y", y)
    check_widths(y, modules, out_widths)
    t, d_in = x.shape
    if y.shape[0] != t:
        raise ValueError(f"x has {t} tokens, y has {y.shape[0]}")
    call = check_call(x, pool_layer, index, tokens, modules, max_rank, d_in)
    cfg = config or _path_config(
        t, d_in, call.width, max_rank, len(modules), out_widths, fused, rank_block
    )
    if config is None and fused is None and cfg.fused:  # the shapes' choice: never one that fails
        if max_tiles(call.num_tokens, cfg.block_m, call.num_segs) > _MAX_GRID_Y:
            cfg = launch_config(t, d_in, call.width, max_rank, len(modules), 0, rank_block)
    need = 0 if cfg.fused else cfg.split_k * t * len(modules) * max_rank
    if workspace is not None and (
        workspace.dtype != torch.float32
        or workspace.numel() < need
        or not workspace.is_contiguous()
        or workspace.device != x.device
    ):
        raise ValueError(
            f"workspace must be a contiguous float32 buffer of at least {need} "
            f"elements on {x.device}, got {workspace.numel()} {workspace.dtype}"
        )
    if delta and not cfg.fused:
        raise ValueError(
            f"delta=True writes the delta on the fused kernel; this call ({t} tokens, max_rank "
            f"{max_rank}, fused={fused}) takes the two launches"
        )
    if delta and not tokens.zero_tiles:
        raise ValueError(
            "delta=True writes every token's rows: the tile tables must list the tokens "
            "without an adapter too (LoraTokens.zero_tiles; make_lora_tokens(zeros=True))"
        )
    if not cfg.fused:
        _no_zero_tiles(tokens, "the two launches")
    if t == 0:
        return
    if cfg.fused:  # one launch, h stays in registers: no workspace
        _fused(
            y, x, pool_layer, index, tokens, modules, tuple(out_widths), max_rank, cfg, call,
            delta,
        )  # fmt: skip
        return
    if workspace is None:
        workspace = torch.empty(need, dtype=torch.float32, device=x.device)
    h = workspace[:need].view(cfg.split_k, t, len(modules), max_rank)
    pdl = _pdl(cfg, x.device)
    _shrink(x, h, pool_layer, index, tokens, modules, max_rank, cfg, call, pdl)
    _expand(y, h, pool_layer, index, tokens, modules, tuple(out_widths), max_rank, cfg, call, pdl)


def _path_config(
    t, d_in, width, max_rank, num_slices, out_widths, fused, rank_block=16
) -> LoraLaunch:
    if fused is None:
        return launch_config(t, d_in, width, max_rank, num_slices, max(out_widths), rank_block)
    if fused and max_rank <= lora_paths.FUSED_MAX_RANK:
        return fused_config(t, width, max_rank, num_slices, max(out_widths), d_in=d_in)
    # no out_width: never fused
    return launch_config(t, d_in, width, max_rank, num_slices, 0, rank_block)
