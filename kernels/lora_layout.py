"""Where an adapter's weights live in the unified page pool.

The pool is one tensor ``[layers, 2, slots, W]`` with ``W = kv_heads * head_dim``; a slot holds one
token's K (half 0) and V (half 1) in every layer. An adapter owns a list of slots, its slot table,
which is the same for every layer. For each target module, the rows of A (``[r, d_in]``) are cut
into chunks of W contiguous elements and stored in half 0; the rows of Bᵀ (``[r, d_out]``) likewise
in half 1. Row ``j``, chunk ``c`` of module ``m`` lives at

    A:  pool[layer, 0, slot_table[a_offset[m] + j * chunks(d_in) + c], :]
    Bᵀ: pool[layer, 1, slot_table[b_offset[m] + j * chunks(d_out) + c], :]

with zeros past ``d_in`` / ``d_out`` in a module's last chunk. The A chunks of all modules follow
each other in module order, and so do the Bᵀ chunks, so an adapter needs
``max(sum r*chunks(d_in), sum r*chunks(d_out))`` slots. A module's rank is the largest rank it has
in any layer; rows past a layer's own rank are zero, so they add nothing.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

# Module ids: the order of the LoRA index's columns and of an adapter's chunks.
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MODULE_ID = {name: i for i, name in enumerate(MODULES)}
Q, K, V, O, GATE, UP, DOWN = range(7)  # noqa: E741 (the projections' own names)
NUM_MODULES = len(MODULES)


# An adapter copy's pieces table (kernels/adapter_write.py documents the columns): its width,
# and the codes of the file dtypes it reads.
PIECE_COLS = 12
PIECE_DTYPES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}


def chunks(dim: int, width: int) -> int:
    """Number of W-wide chunks that hold a row of ``dim`` elements."""
    return -(-dim // width)


class ModulePlacement(NamedTuple):
    rank: int
    a_offset: int  # first slot-table position of the module's A chunks (half 0)
    b_offset: int  # first slot-table position of the module's Bᵀ chunks (half 1)
    in_chunks: int
    out_chunks: int


class AdapterPlan(NamedTuple):
    placements: tuple[ModulePlacement | None, ...]  # indexed by module id; None = not targeted
    num_slots: int


def plan_adapter(
    ranks: dict[int, int], dims: dict[int, tuple[int, int]], width: int
) -> AdapterPlan:
    """Lay out an adapter: ``ranks[m]`` is module m's rank, ``dims[m]`` its (d_in, d_out)."""
    placements: list[ModulePlacement | None] = [None] * NUM_MODULES
    a_total = b_total = 0
    for m in range(NUM_MODULES):
        r = ranks.get(m, 0)
        if r <= 0:
            continue
        d_in, d_out = dims[m]
        cin, cout = chunks(d_in, width), chunks(d_out, width)
        placements[m] = ModulePlacement(r, a_total, b_total, cin, cout)
        a_total += r * cin
        b_total += r * cout
    return AdapterPlan(tuple(placements), max(a_total, b_total))


def write_module(
    pool: torch.Tensor,
    layer: int,
    slots: torch.Tensor,
    place: ModulePlacement,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
) -> None:
    """Write one layer's A ``[r_l, d_in]`` and B ``[d_out, r_l]`` (r_l <= place.rank) into the pool.

    ``slots`` is the adapter's slot table (int64, on the pool's device). Rows past ``r_l`` and
    columns past ``d_in``/``d_out`` are written as zeros, so stale pool contents are never read.
    """
    width = pool.shape[-1]
    r_l, d_in = lora_a.shape
    d_out = lora_b.shape[0]
    if r_l > place.rank or lora_b.shape[1] != r_l:
        raise ValueError(
            f"A {tuple(lora_a.shape)} and B {tuple(lora_b.shape)} do not fit rank {place.rank}"
        )
    a_pad = torch.zeros(place.rank, place.in_chunks * width, dtype=pool.dtype, device=pool.device)
    a_pad[:r_l, :d_in] = lora_a
    b_pad = torch.zeros(place.rank, place.out_chunks * width, dtype=pool.dtype, device=pool.device)
    b_pad[:r_l, :d_out] = lora_b.t()
    n_a, n_b = place.rank * place.in_chunks, place.rank * place.out_chunks
    pool[layer, 0, slots[place.a_offset : place.a_offset + n_a]] = a_pad.view(n_a, width)
    pool[layer, 1, slots[place.b_offset : place.b_offset + n_b]] = b_pad.view(n_b, width)
