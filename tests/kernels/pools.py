"""Builders for the kernel tests: a page pool with adapters and KV pages in it.

Adapters are placed with kernels.lora_layout (the engine's own geometry code) at shuffled pool
slots; every slot nobody owns holds NaN, so a kernel that reads outside what it owns fails.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kernels.lora_layout import NUM_MODULES, plan_adapter, write_module
from kernels.lora_ref import LoraIndex, LoraTokens, make_lora_tokens

POPULARITY = ("distinct", "uniform", "zipf", "identical", "base_mix")


class LoraSetup(NamedTuple):
    pool: torch.Tensor  # [1, 2, slots, W]: one layer
    index: LoraIndex


def build_adapters(
    ranks: list[dict[int, int]],
    dims: dict[int, tuple[int, int]],
    width: int,
    dtype: torch.dtype,
    device: torch.device,
    gen: torch.Generator,
    spare_slots: int = 8,
) -> LoraSetup:
    """Adapters with ranks[i][m] (0 = untargeted) for modules with dims[m] = (d_in, d_out)."""
    plans = [plan_adapter(r, dims, width) for r in ranks]
    total = sum(p.num_slots for p in plans) + spare_slots
    pool = torch.full((1, 2, total, width), float("nan"), dtype=dtype, device=device)
    perm = torch.randperm(total, generator=gen).to(device)
    dgen = _device_gen(gen, device)
    n = len(ranks)
    cols = max([p.num_slots for p in plans] + [1])
    table = torch.zeros(n, cols, dtype=torch.int32, device=device)
    rank_t = torch.zeros(n, NUM_MODULES, dtype=torch.int32)
    a_off = torch.zeros(n, NUM_MODULES, dtype=torch.int32)
    b_off = torch.zeros(n, NUM_MODULES, dtype=torch.int32)
    scales = torch.zeros(n, NUM_MODULES, dtype=torch.float32)
    used = 0
    for i, plan in enumerate(plans):
        slots = perm[used : used + plan.num_slots]
        used += plan.num_slots
        table[i, : plan.num_slots] = slots.to(torch.int32)
        for m, place in enumerate(plan.placements):
            if place is None:
                continue
            d_in, d_out = dims[m]
            a = torch.randn(place.rank, d_in, generator=dgen, device=device) / d_in**0.5
            b = torch.randn(d_out, place.rank, generator=dgen, device=device)
            write_module(pool, 0, slots.long(), place, a.to(dtype), b.to(dtype))
            rank_t[i, m] = place.rank
            a_off[i, m], b_off[i, m] = place.a_offset, place.b_offset
            scales[i, m] = float(torch.rand((), generator=gen)) + 0.5
    # Untouched halves of owned slots (A half past the A chunks, say) stay NaN on purpose.
    index = LoraIndex(
        table, rank_t.to(device), a_off.to(device), b_off.to(device), scales.to(device)
    )
    return LoraSetup(pool, index)


def token_rows(
    kind: str, num_tokens: int, num_adapters: int, gen: torch.Generator, grouped: bool
) -> torch.Tensor:
    """Adapter row of each token under a popularity; grouped sorts tokens into runs."""
    if kind == "distinct":
        rows = torch.arange(num_tokens) % num_adapters
    elif kind == "uniform":
        rows = torch.randint(0, num_adapters, (num_tokens,), generator=gen)
    elif kind == "zipf":
        p = 1.0 / torch.arange(1, num_adapters + 1, dtype=torch.float64) ** 1.2
        rows = torch.multinomial(p, num_tokens, replacement=True, generator=gen)
    elif kind == "identical":
        rows = torch.zeros(num_tokens, dtype=torch.long)
    elif kind == "base_mix":
        rows = torch.randint(-1, num_adapters, (num_tokens,), generator=gen)
        rows[torch.rand(num_tokens, generator=gen) < 0.3] = -1
    else:
        raise ValueError(f"unknown popularity {kind!r}")
    if grouped:
        rows = rows.sort(stable=True).values
    else:
        rows = rows[torch.randperm(num_tokens, generator=gen)]
    return rows.to(torch.int32)


def _device_gen(gen: torch.Generator, device: torch.device) -> torch.Generator:
    """A generator on ``device`` seeded from ``gen``: bulk random weights are drawn there."""
    seed = int(torch.randint(0, 2**62, (), generator=gen))
    return torch.Generator(device=device).manual_seed(seed)


def lora_tokens(
    rows: torch.Tensor,
    device: torch.device,
    capacity: int | None = None,
    one_token: bool = False,
    entries: list[int] | None = None,
    zeros: bool = False,
    pair: bool = False,
) -> LoraTokens:
    """LoraTokens with a fixed segment capacity, larger than needed (empty padding segments);
    by default three more than the tokens. ``one_token``: the smallest block's tiles cut each
    of ``entries`` (their first tokens and the end) apart, by default every token
    (make_lora_tokens' one_token_tiles); ``zeros``: the tokens without an adapter are tiles
    too (a delta launch's); ``pair``: with one_token, the tokens that share an adapter two to a
    tile (a decode step's pair_tiles)."""
    cap = capacity or max(1, rows.numel()) + 3
    return make_lora_tokens(
        rows.to(device),
        capacity=cap,
        one_token_tiles=one_token,
        entries=entries,
        zeros=zeros,
        pair_tiles=pair,
    )


class KvSetup(NamedTuple):
    pool_layer: torch.Tensor  # [2, slots, W]
    block_tables: torch.Tensor  # [B, max_pages] int32
    seq_lens: torch.Tensor  # [B] int32
    query_starts: torch.Tensor  # [B + 1] int32
    slot_mapping: torch.Tensor  # [T] int64: slots of the query tokens


def build_kv(
    seq_lens: list[int],
    num_queries: list[int],
    page_size: int,
    width: int,
    dtype: torch.dtype,
    device: torch.device,
    gen: torch.Generator,
    spare_pages: int = 3,
) -> KvSetup:
    """Sequences on shuffled pages; the cache holds random K/V, free pages hold NaN.

    The query tokens' own slots are filled too (as write_kv would) so attention is well defined.
    """
    pages = [-(-n // page_size) for n in seq_lens]
    total = sum(pages) + spare_pages
    pool = torch.full((2, total * page_size, width), float("nan"), dtype=dtype, device=device)
    perm = torch.randperm(total, generator=gen)
    dgen = _device_gen(gen, device)
    max_pages = max(pages + [1]) + 2
    tables = torch.zeros(len(seq_lens), max_pages, dtype=torch.int32)
    slots_q = []
    used = 0
    for b, n in enumerate(seq_lens):
        tables[b, : pages[b]] = perm[used : used + pages[b]].to(torch.int32)
        used += pages[b]
        pos = torch.arange(n)
        slots = tables[b, pos // page_size].long() * page_size + pos % page_size
        kv = torch.randn(2, n, width, generator=dgen, device=device).to(dtype)
        pool[:, slots.to(device)] = kv.to(device)
        slots_q.append(slots[n - num_queries[b] :])
    starts = torch.tensor([0, *torch.tensor(num_queries).cumsum(0).tolist()], dtype=torch.int32)
    return KvSetup(
        pool,
        tables.to(device),
        torch.tensor(seq_lens, dtype=torch.int32, device=device),
        starts.to(device),
        torch.cat(slots_q).to(device),
    )
