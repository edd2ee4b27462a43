"""Argument checks of the multi-LoRA launchers (kernels/lora.py): shapes, strides, dtypes.

Only what the host knows is checked (no device data is read, so the launchers stay graph-safe).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kernels.lora_layout import NUM_MODULES, chunks
from kernels.lora_ref import LoraIndex, LoraTokens
from kernels.tile_table import TILE_BLOCKS, table_rows

MAX_SLICES = 3  # q, k, v share one input; so do gate and up


class LoraCall(NamedTuple):
    """Checked geometry of one call."""

    num_tokens: int
    d_in: int  # 0 for an expand-only call
    width: int  # pool row width W
    in_chunks: int  # W-wide chunks of one A row
    num_segs: int  # segment capacity


def check_modules(modules: tuple[int, ...], max_rank: int) -> None:
    if not 1 <= len(modules) <= MAX_SLICES:
        raise ValueError(f"modules must list 1 to {MAX_SLICES} module ids, got {modules}")
    if any(not 0 <= m < NUM_MODULES for m in modules):
        raise ValueError(f"module ids must be in 0..{NUM_MODULES - 1}, got {modules}")
    if max_rank <= 0:
        raise ValueError(f"max_rank must be positive, got {max_rank}")


def check_float(name: str, t: torch.Tensor) -> None:
    if t.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"{name} must be float16, bfloat16 or float32, got {t.dtype}")
    if t.dim() != 2 or t.stride(1) != 1:
        raise ValueError(
            f"{name} must be 2-D with a unit last stride, got {tuple(t.shape)} {t.stride()}"
        )


def check_widths(y: torch.Tensor, modules: tuple[int, ...], out_widths: tuple[int, ...]) -> None:
    if y.shape[1] != sum(out_widths) or len(out_widths) != len(modules):
        raise ValueError(
            f"y has {y.shape[1]} columns; slices {modules} need widths {out_widths} summing to it"
        )


def check_call(
    acts: torch.Tensor,
    pool_layer: torch.Tensor,
    index: LoraIndex,
    tokens: LoraTokens,
    modules: tuple[int, ...],
    max_rank: int,
    d_in: int = 0,
) -> LoraCall:
    """Checks shared by shrink, expand and apply; ``acts`` is x or y ([T, ...])."""
    check_modules(modules, max_rank)
    if pool_layer.dim() != 3 or pool_layer.shape[0] != 2 or pool_layer.stride(2) != 1:
        raise ValueError(
            f"pool_layer must be [2, slots, W] with unit last stride, got "
            f"{tuple(pool_layer.shape)} strides {pool_layer.stride()}"
        )
    dev = pool_layer.device
    n = index.slot_table.shape[0]
    ints = {
        "slot_table": index.slot_table,
        "ranks": index.ranks,
        "a_offsets": index.a_offsets,
        "b_offsets": index.b_offsets,
        "seg_starts": tokens.seg_starts,
        "seg_lora": tokens.seg_lora,
        "tiles": tokens.tiles,
    }
    for name, t in ints.items():
        if t.dtype != torch.int32 or t.device != dev or t.stride(-1) != 1:
            raise ValueError(
                f"{name} must be int32 on {dev} with a unit last stride, got {t.dtype} on "
                f"{t.device}"
            )
    if index.scales.dtype != torch.float32 or index.scales.device != dev:
        raise ValueError(f"scales must be float32 on {dev}, got {index.scales.dtype}")
    for name in ("ranks", "a_offsets", "b_offsets", "scales"):
        t = getattr(index, name)
        if t.shape != (n, NUM_MODULES) or t.stride(1) != 1:
            raise ValueError(f"{name} must be [{n}, {NUM_MODULES}], got {tuple(t.shape)}")
    if not index.ranks.stride() == index.a_offsets.stride() == index.b_offsets.stride():
        raise ValueError("ranks, a_offsets and b_offsets must share strides")
    num_segs = tokens.seg_lora.numel()
    if tokens.seg_starts.numel() != num_segs + 1:
        raise ValueError(
            f"seg_starts needs {num_segs + 1} entries for {num_segs} segments, "
            f"got {tokens.seg_starts.numel()}"
        )
    rows = table_rows(acts.shape[0], num_segs)
    blocks = len(TILE_BLOCKS)
    if tokens.tiles.dim() != 3 or tokens.tiles.shape[0] != blocks or tokens.tiles.shape[2] != 3:
        raise ValueError(
            f"tiles must be [{blocks}, K, 3] (kernels/tile_table.py), "
            f"got {tuple(tokens.tiles.shape)}"
        )
    if tokens.tiles.shape[1] < rows or not tokens.tiles.is_contiguous():
        raise ValueError(
            f"tiles must be contiguous with at least {rows} rows for {acts.shape[0]} tokens in "
            f"{num_segs} segments, got {tuple(tokens.tiles.shape)}"
        )
    mods = tokens.modules
    if mods is not None and (
        mods.shape != (NUM_MODULES,) or mods.dtype != torch.int32 or mods.device != dev
    ):
        raise ValueError(
            f"tokens.modules must be int32 [{NUM_MODULES}] on {dev}, got {mods.dtype} "
            f"{tuple(mods.shape)} on {mods.device}"
        )
    if acts.device != dev:
        raise ValueError(f"activations on {acts.device}, pool on {dev}")
    width = pool_layer.shape[2]
    return LoraCall(acts.shape[0], d_in, width, chunks(d_in, width) if d_in else 0, num_segs)
