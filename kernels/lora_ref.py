"""Torch reference of the multi-LoRA kernels, reading adapters in place from the page pool.

It is the numerical reference for the Triton kernels in tests (call it on float64 inputs) and the
CPU serving path (float32). Geometry: kernels/lora_layout.py. The calls, shared with the Triton
launchers in kernels/lora.py:

    h = lora_shrink(x, pool_layer, index, tokens, modules, max_rank)
    lora_expand(y, h, pool_layer, index, tokens, modules, out_widths)

``modules`` lists module ids (lora_layout.Q ...) that share the input ``x``: (Q, K, V) for the
attention input, (GATE, UP) for the MLP input, (O,) and (DOWN,) alone. ``h[:, s]`` is slice s's
shrunk activation; ``y`` holds the slices' outputs side by side, widths ``out_widths``, and gets
``scale * h[:, s, :rank] @ Bᵀ`` added in place.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from kernels import tile_table
from kernels.lora_layout import NUM_MODULES, chunks


class LoraIndex(NamedTuple):
    """Resident adapters, one row each (the adapter's LoRA index row). Fixed capacity."""

    slot_table: torch.Tensor  # [N, C] int32: pool slot of each slot-table position
    ranks: torch.Tensor  # [N, 7] int32: module rank, 0 = module not targeted
    a_offsets: torch.Tensor  # [N, 7] int32: slot-table position of the module's first A chunk
    b_offsets: torch.Tensor  # [N, 7] int32: slot-table position of the module's first Bᵀ chunk
    scales: torch.Tensor  # [N, 7] float32: lora_alpha / r (or / sqrt(r) with rslora)


class LoraTokens(NamedTuple):
    """Which adapter each token of a step uses. Tokens of one adapter may be scattered
    (decode) or form runs (prefill); the segments describe the runs, in token order."""

    token_lora: torch.Tensor  # [T] int32: LoraIndex row of each token, -1 = base model only
    seg_starts: torch.Tensor  # [G + 1] int32: segment g covers tokens seg_starts[g]:seg_starts[g+1]
    seg_lora: torch.Tensor  # [G] int32: LoraIndex row of segment g, -1 = base model only
    # [len(TILE_BLOCKS), K, 3] int32: per block size, the segments' tiles (row, first token,
    # end token), then rows of -1; K >= tile_table.table_rows(T, G) (kernels/tile_table.py).
    # The Triton kernels read it; this reference does not.
    tiles: torch.Tensor
    # [7] int32: 1 for each module some adapter of the step has (rank > 0), 0 for the others;
    # None: every module may be in use. A Triton launch whose module is 0 returns at once
    # instead of walking the tiles (adapters on q/k/v/o cost the MLP's calls nothing). The
    # reference does not need it: a module no adapter has adds nothing.
    modules: torch.Tensor | None = None
    # Whether the tile tables also list the tokens without an adapter (tile_table.ZERO_ROW
    # tiles): what a delta launch needs (kernels/lora.py lora_apply's delta) and the two
    # launches must not meet (their programs stop at the first row below 0).
    zero_tiles: bool = False


def make_lora_tokens(
    token_lora: torch.Tensor,
    capacity: int | None = None,
    modules: Sequence[int] | None = None,
    one_token_tiles: bool = False,
    entries: Sequence[int] | None = None,
    zeros: bool = False,
    pair_tiles: bool = False,
) -> LoraTokens:
    """Build LoraTokens from per-token rows; pads to ``capacity`` segments with empty ones.
    ``modules``: the module ids some adapter of these rows has (None: every module).
    ``one_token_tiles``: the smallest block's table cuts each entry's tokens apart from the
    others', as the engine writes it for a step on one-token tiles (StepBatch.fill): ``entries``
    are the entries' first tokens and the end (a step's query starts; None: every token an
    entry, so every adapter token is a tile of its own). ``pair_tiles`` (a decode step's, every
    token an entry): that table cuts each adapter's tokens two to a tile instead
    (tile_table.PAIR_BLOCK; StepBatch.fill's pair_tiles)."""
    if pair_tiles and (not one_token_tiles or entries is not None):
        raise ValueError("pair_tiles are a decode step's one-token tiles: one_token_tiles "
                         "with every token an entry (entries=None)")  # fmt: skip
    t = token_lora.numel()
    tl = token_lora.to(torch.int32)
    if t == 0:
        starts = [0]
        rows: list[int] = []
    else:
        change = torch.nonzero(tl[1:] != tl[:-1]).flatten() + 1
        starts = [0, *change.tolist()]
        rows = tl[torch.tensor(starts, dtype=torch.long)].tolist()
        starts.append(t)
    g = len(rows)
    if capacity is not None:
        if g > capacity:
            raise ValueError(f"{g} segments exceed the capacity {capacity}")
        starts += [t] * (capacity - g)
        rows += [-1] * (capacity - g)
    dev = token_lora.device
    k = tile_table.table_rows(t, len(rows))
    tiles = torch.tensor(tile_table.EMPTY, dtype=torch.int32).repeat(
        len(tile_table.TILE_BLOCKS), k, 1
    )
    for b, block in enumerate(tile_table.TILE_BLOCKS):
        if pair_tiles and b == 0:
            flat = tile_table.block_tiles(starts, rows, tile_table.PAIR_BLOCK, zeros)
        elif one_token_tiles and b == 0:
            cuts = list(range(t + 1)) if entries is None else list(entries)
            if cuts[-1] != t:
                raise ValueError(f"the entries end at token {cuts[-1]}, the step has {t}")
            per_token = tl.tolist()
            flat = tile_table.block_tiles(
                cuts, [per_token[c] if c < t else -1 for c in cuts[:-1]], block, zeros
            )
        else:
            flat = tile_table.block_tiles(starts, rows, block, zeros)
        if flat:
            tiles[b, : len(flat) // 3] = torch.tensor(flat, dtype=torch.int32).view(-1, 3)
    mask = None
    if modules is not None:
        mask = torch.zeros(NUM_MODULES, dtype=torch.int32)
        mask[list(modules)] = 1
        mask = mask.to(dev)
    return LoraTokens(
        tl,
        torch.tensor(starts, dtype=torch.int32, device=dev),
        torch.tensor(rows, dtype=torch.int32, device=dev),
        tiles.to(dev),
        mask,
        zeros,
    )


def gather_matrix(
    pool_layer: torch.Tensor, half: int, table: torch.Tensor, off: int, rank: int, dim: int
) -> torch.Tensor:
    """An adapter's A (``half`` 0, [rank, d_in]) or Bᵀ (1, [rank, d_out]) of one module, read
    from ``pool_layer`` [2, slots, W] through its slot ``table`` from offset ``off``."""
    width = pool_layer.shape[-1]
    n = chunks(dim, width)
    slots = table[off : off + rank * n].long()
    rows = pool_layer[half, slots]  # [rank * n, W]
    return rows.reshape(rank, n * width)[:, :dim]  # [rank, dim]


def _adapters(tokens: LoraTokens) -> list[tuple[int, torch.Tensor]]:
    rows = tokens.token_lora.long()
    out = []
    for a in torch.unique(rows).tolist():
        if a >= 0:
            out.append((a, torch.nonzero(rows == a).flatten()))
    return out


def lora_shrink(
    x: torch.Tensor,
    pool_layer: torch.Tensor,
    index: LoraIndex,
    tokens: LoraTokens,
    modules: tuple[int, ...],
    max_rank: int,
) -> torch.Tensor:
    """h[t, s, :r] = x[t] · A_s(t)ᵀ for each slice s; zero elsewhere. x: [T, d_in]."""
    t, d_in = x.shape
    h = torch.zeros(t, len(modules), max_rank, dtype=x.dtype, device=x.device)
    for a, idx in _adapters(tokens):
        table = index.slot_table[a]
        for s, m in enumerate(modules):
            r = int(index.ranks[a, m])
            if r == 0:
                continue
            w_a = gather_matrix(pool_layer, 0, table, int(index.a_offsets[a, m]), r, d_in)
            h[idx, s, :r] = x[idx] @ w_a.to(x.dtype).t()
    return h


def lora_expand(
    y: torch.Tensor,
    h: torch.Tensor,
    pool_layer: torch.Tensor,
    index: LoraIndex,
    tokens: LoraTokens,
    modules: tuple[int, ...],
    out_widths: tuple[int, ...],
) -> None:
    """y[t, slice s] += scale_s(t) · h[t, s, :r] · B_s(t)ᵀ, in place. y: [T, sum(out_widths)]."""
    if y.shape[1] != sum(out_widths):
        raise ValueError(f"y has {y.shape[1]} columns, slices need {sum(out_widths)}")
    for a, idx in _adapters(tokens):
        table = index.slot_table[a]
        col = 0
        for s, m in enumerate(modules):
            d_out = out_widths[s]
            r = int(index.ranks[a, m])
            if r:
                w_bt = gather_matrix(pool_layer, 1, table, int(index.b_offsets[a, m]), r, d_out)
                delta = (h[idx, s, :r] @ w_bt.to(h.dtype)) * index.scales[a, m].to(h.dtype)
                y[idx, col : col + d_out] += delta.to(y.dtype)
            col += d_out


def lora_apply(
    y: torch.Tensor,
    x: torch.Tensor,
    pool_layer: torch.Tensor,
    index: LoraIndex,
    tokens: LoraTokens,
    modules: tuple[int, ...],
    out_widths: tuple[int, ...],
    max_rank: int,
    delta: bool = False,
) -> None:
    """The model's LoRA hook: y[:, slices] += scale · x · Aᵀ · Bᵀ for every token's adapter;
    with ``delta``, y[:, slices] = that delta (zeros for tokens without one)."""
    h = lora_shrink(x, pool_layer, index, tokens, modules, max_rank)
    if delta:
        y.zero_()
    lora_expand(y, h, pool_layer, index, tokens, modules, out_widths)
