"""The multi-LoRA hook on the CPU, batched over the step's adapters.

kernels/lora_ref.py computes each adapter of a step on its own: a few small torch operations per
adapter and module, whose fixed cost sets the time of a CPU step of many adapters (tiny Llama,
32 decode tokens on 32 distinct rank-16 adapters of all seven projections: 20 ms a layer for its
four LoRA calls, bench/cpu_path.py). Here the step's adapters are grouped by how many tokens
each has (counts up to 1, 2, 4, ...: at most twice the tokens of a group once padded), and each
group computes every slice with one gather of its adapters' A and Bᵀ rows and two batched matrix
products, so the operations grow with the groups (at most log2(T) + 1), not with the adapters.
Same arguments and result as lora_ref.lora_apply, which the tests compare it with.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kernels.lora_layout import chunks
from kernels.lora_ref import LoraIndex, LoraTokens


class _Group(NamedTuple):
    """Adapters of a step with about as many tokens each (up to a power of two)."""

    rows: torch.Tensor  # [Gb]: their LoraIndex rows
    grid: torch.Tensor  # [Gb, L]: each one's tokens in order, T (a zero row) where padded
    tokens: torch.Tensor  # [n]: the group's tokens
    at: torch.Tensor  # [n]: each one's adapter in the group
    pos: torch.Tensor  # [n]: its place among that adapter's tokens
    whole: bool  # its tokens are all the step's, in order (tokens = 0, 1, ..., T - 1)


# The last groups made, with a copy of the token rows they came from: every call of a step
# (each layer's q/k/v, o, gate/up, down) has the same rows, so a step groups them once. The
# rows are compared, not the tensor's identity: the engine hands each call a fresh view of a
# buffer that it refills in place.
_last: tuple[torch.Tensor, list[_Group]] | None = None


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
    """y[:, slices] += scale · x · Aᵀ · Bᵀ for every token's adapter; with ``delta``,
    y[:, slices] = that delta (zeros for tokens without one). ``max_rank`` bounds the ranks
    read, as the other paths' (adapters above it are not served by the engine)."""
    if y.shape[1] != sum(out_widths):
        raise ValueError(f"y has {y.shape[1]} columns, slices need {sum(out_widths)}")
    groups = _groups(tokens.token_lora)
    if not groups:
        if delta:
            y.zero_()
        return
    padded_x = torch.cat([x, x.new_zeros(1, x.shape[1])])  # row T: the padding's zeros
    xs = [padded_x[g.grid] for g in groups]  # [Gb, L, d_in] each
    # Each group's adapters' ranks (at most max_rank), offsets and scales, all modules at once.
    info = [
        (
            index.ranks[g.rows].long().clamp(max=max_rank),  # [Gb, 7]
            index.a_offsets[g.rows].long(),
            index.b_offsets[g.rows].long(),
            index.scales[g.rows].to(x.dtype),
        )
        for g in groups
    ]
    col = 0
    for s, m in enumerate(modules):
        d_out = out_widths[s]
        # Each token's delta, written by its group (a contiguous buffer: adding it to y's
        # columns at once beats scattering into them), zeros for tokens without an adapter;
        # a group that holds every token in order writes it whole.
        whole = len(groups) == 1 and groups[0].whole
        acc = None if whole else y.new_zeros(y.shape[0], d_out)
        for g, gx, (ranks, a_off, b_off, scales) in zip(groups, xs, info, strict=True):
            r = ranks[:, m]
            rank = int(r.max())
            if rank == 0:
                continue
            dead = None
            if len(g.rows) > 1 and bool((r < rank).any()):
                dead = (torch.arange(rank)[None, :] >= r[:, None])[:, :, None]  # [Gb, R, 1]
            a = _rows(pool_layer, 0, index.slot_table, g.rows, a_off[:, m], rank, dead,
                      gx.shape[-1])  # fmt: skip
            bt = _rows(pool_layer, 1, index.slot_table, g.rows, b_off[:, m], rank, dead, d_out)
            h = torch.bmm(gx, a.to(gx.dtype).transpose(1, 2))  # [Gb, L, R]
            out = torch.bmm(h, bt.to(gx.dtype))  # [Gb, L, d_out]
            out *= scales[:, m, None, None]
            delta_rows = out[g.at, g.pos].to(y.dtype)  # [n, d_out]
            if whole:
                acc = delta_rows
            else:
                acc.index_copy_(0, g.tokens, delta_rows)
        if acc is None:  # no adapter of the group has this module
            if delta:
                y[:, col : col + d_out] = 0.0
        elif delta:
            y[:, col : col + d_out] = acc
        else:
            y[:, col : col + d_out] += acc
        col += d_out


def _groups(token_lora: torch.Tensor) -> list[_Group]:
    """The step's adapters in groups by token count (the module docstring says why)."""
    global _last
    if _last is not None and torch.equal(_last[0], token_lora):
        return _last[1]
    rows_of = token_lora.long()
    adapter_tokens = torch.nonzero(rows_of >= 0).flatten()
    groups: list[_Group] = []
    if adapter_tokens.numel():
        rows, group_of, counts = torch.unique(
            rows_of[adapter_tokens], return_inverse=True, return_counts=True
        )
        # Tokens in adapter order (stable: each adapter's in token order), and their place.
        order = torch.argsort(group_of, stable=True)
        by_adapter = adapter_tokens[order]  # [Ta]
        adapter_of = group_of[order]  # [Ta]: each one's adapter (an index into rows)
        first = torch.cumsum(counts, 0) - counts  # [G]
        place = torch.arange(by_adapter.numel()) - first[adapter_of]  # [Ta]
        bucket = torch.ceil(torch.log2(counts.double())).long()  # [G]: counts to 1, 2, 4, ...
        for b in torch.unique(bucket).tolist():
            members = torch.nonzero(bucket == b).flatten()  # indices into rows
            slot_of = torch.full((len(rows),), -1, dtype=torch.long)
            slot_of[members] = torch.arange(members.numel())
            mine = slot_of[adapter_of] >= 0  # [Ta]: this group's tokens
            toks, at, pos = by_adapter[mine], slot_of[adapter_of[mine]], place[mine]
            length = int(counts[members].max())
            grid = torch.full((members.numel(), length), rows_of.numel(), dtype=torch.long)
            grid[at, pos] = toks
            whole = toks.numel() == rows_of.numel() and bool(
                torch.equal(toks, torch.arange(toks.numel()))
            )
            groups.append(_Group(rows[members], grid, toks, at, pos, whole))
    _last = (token_lora.clone(), groups)
    return groups


def _rows(
    pool_layer: torch.Tensor,
    half: int,
    table: torch.Tensor,
    rows: torch.Tensor,
    offsets: torch.Tensor,
    rank: int,
    dead: torch.Tensor | None,
    dim: int,
) -> torch.Tensor:
    """The adapters' A (half 0) or Bᵀ (half 1) rows of one module, [G, rank, dim]; ``dead``
    ([G, rank, 1]) marks the rows at or above an adapter's own rank, zeroed (never computed
    with: an adapter's slot table may end before them, and what lies there is not its own)."""
    width = pool_layer.shape[-1]
    n = chunks(dim, width)
    positions = offsets[:, None] + torch.arange(rank * n)  # [G, rank * n]
    positions = positions.clamp_(max=table.shape[1] - 1)
    slots = table[rows[:, None], positions].flatten().long()
    got = pool_layer[half].index_select(0, slots).view(len(rows), rank, n * width)
    if dead is not None:
        got.masked_fill_(dead, 0.0)
    return got[:, :, :dim]
