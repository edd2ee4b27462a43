"""The multi-LoRA hook on the CPU, batched over the step's adapters.

kernels/lora_ref.py computes each adapter of a step on its own: a few small torch operations per
adapter and module, whose fixed cost sets the time of a CPU step of many adapters (tiny Llama,
32 decode tokens on 32 distinct rank-16 adapters of all seven projections: 20 ms a layer for its
four LoRA calls, bench/cpu_path.py). Here the step's adapters are grouped by how many tokens
each has (counts up to 1, 2, 4, ...: at most twice the tokens of a group once padded), and each
group computes every slice with one gather of its adapters' A and Bᵀ rows and two batched matrix
products, so the operations grow with the groups (at most log2(T) + 1), not with the adapters.
A step's groups and each module's pool slots are worked out on its first call and kept for the
calls of its other layers (_Plan). Same arguments and result as lora_ref.lora_apply, which the
tests compare it with.
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


class _Reads(NamedTuple):
    """Where one group's A and Bᵀ rows of one module lie in a layer's pool (the same in every
    layer: an adapter's slot table serves all of them)."""

    rank: int  # the group's largest rank of the module (at most max_rank)
    a_slots: torch.Tensor  # [Gb * rank * chunks(d_in)]: pool slots of the A rows, in order
    b_slots: torch.Tensor  # [Gb * rank * chunks(d_out)]: and of the Bᵀ rows
    dead: torch.Tensor | None  # [Gb, rank, 1]: rows at or above an adapter's own rank
    scales: torch.Tensor  # [Gb, 1, 1]: each adapter's scale of the module


class _Plan:
    """A step's groups and, made on first use, each module's reads: every call of a step (each
    layer's q/k/v, o, gate/up, down) has the same token rows and index, so a step works them out
    once, not once a layer."""

    def __init__(self, token_lora: torch.Tensor, index: LoraIndex, max_rank: int) -> None:
        # The rows are compared by value, not the tensor's identity: the engine hands each call
        # a fresh view of a buffer that it refills in place. The index's tensors are the same
        # objects from step to step, changed in place, which bumps their version counters.
        self.token_lora = token_lora.clone()
        self.index = index
        self.versions = tuple(t._version for t in index)
        self.max_rank = max_rank
        self.groups = _groups(token_lora)
        self.reads: dict[tuple[int, int, int, int], list[_Reads | None]] = {}

    def serves(self, token_lora: torch.Tensor, index: LoraIndex, max_rank: int) -> bool:
        return (
            max_rank == self.max_rank
            and all(a is b for a, b in zip(index, self.index, strict=True))
            and all(t._version == v for t, v in zip(index, self.versions, strict=True))
            and torch.equal(token_lora, self.token_lora)
        )

    def module_reads(self, m: int, d_in: int, d_out: int, width: int) -> list[_Reads | None]:
        """Each group's reads of module ``m`` (None where no adapter of the group has it)."""
        key = (m, d_in, d_out, width)
        if key not in self.reads:
            self.reads[key] = [
                _module_reads(self.index, g.rows, m, d_in, d_out, width, self.max_rank)
                for g in self.groups
            ]
        return self.reads[key]


# The last step's plan (one engine a process: its steps follow one another).
_last: _Plan | None = None


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
    global _last
    if y.shape[1] != sum(out_widths):
        raise ValueError(f"y has {y.shape[1]} columns, slices need {sum(out_widths)}")
    plan = _last  # read once: another thread's engine may replace it meanwhile
    if plan is None or not plan.serves(tokens.token_lora, index, max_rank):
        plan = _last = _Plan(tokens.token_lora, index, max_rank)
    groups = plan.groups
    if not groups:
        if delta:
            y.zero_()
        return
    # A group that holds every token in order writes its delta whole; one adapter that holds
    # them all reads x as it is.
    whole = len(groups) == 1 and groups[0].whole
    alone = whole and len(groups[0].rows) == 1
    if alone:
        xs = [x[None]]
    else:
        padded_x = torch.cat([x, x.new_zeros(1, x.shape[1])])  # row T: the padding's zeros
        xs = [padded_x[g.grid] for g in groups]  # [Gb, L, d_in] each
    width = pool_layer.shape[-1]
    col = 0
    for s, m in enumerate(modules):
        d_out = out_widths[s]
        # Each token's delta, written by its group (a contiguous buffer: adding it to y's
        # columns at once beats scattering into them), zeros for tokens without an adapter.
        acc = None if whole else y.new_zeros(y.shape[0], d_out)
        reads = plan.module_reads(m, x.shape[1], d_out, width)
        for g, gx, got in zip(groups, xs, reads, strict=True):
            if got is None:
                continue
            a = _gather(pool_layer[0], got.a_slots, got.dead, len(g.rows), got.rank, x.shape[1])
            bt = _gather(pool_layer[1], got.b_slots, got.dead, len(g.rows), got.rank, d_out)
            h = torch.bmm(gx, a.to(gx.dtype).transpose(1, 2))  # [Gb, L, R]
            h *= got.scales.to(h.dtype)
            out = torch.bmm(h, bt.to(gx.dtype))  # [Gb, L, d_out]
            if alone:
                acc = out[0].to(y.dtype)
            elif whole:
                acc = out[g.at, g.pos].to(y.dtype)
            else:
                acc.index_copy_(0, g.tokens, out[g.at, g.pos].to(y.dtype))
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
    return groups


def _module_reads(
    index: LoraIndex, rows: torch.Tensor, m: int, d_in: int, d_out: int, width: int,
    max_rank: int,
) -> _Reads | None:  # fmt: skip
    """Where the group of adapters ``rows`` keeps module ``m``'s A and Bᵀ rows."""
    r = index.ranks[rows, m].long().clamp(max=max_rank)  # [Gb]
    rank = int(r.max())
    if rank == 0:
        return None
    dead = None
    if len(rows) > 1 and bool((r < rank).any()):
        dead = (torch.arange(rank)[None, :] >= r[:, None])[:, :, None]  # [Gb, R, 1]
    table = index.slot_table

    def slots(offsets: torch.Tensor, dim: int) -> torch.Tensor:
        positions = offsets.long()[:, None] + torch.arange(rank * chunks(dim, width))
        positions = positions.clamp_(max=table.shape[1] - 1)  # [Gb, rank * chunks]
        return table[rows[:, None], positions].flatten().long()

    scales = index.scales[rows, m][:, None, None]
    return _Reads(rank, slots(index.a_offsets[rows, m], d_in),
                  slots(index.b_offsets[rows, m], d_out), dead, scales)  # fmt: skip


def _gather(
    half: torch.Tensor, slots: torch.Tensor, dead: torch.Tensor | None, count: int, rank: int,
    dim: int,
) -> torch.Tensor:  # fmt: skip
    """The rows at ``slots`` of one half of a layer's pool (A or Bᵀ), [count, rank, dim];
    ``dead`` rows are zeroed (never computed with: an adapter's slot table may end before them,
    and what lies there is not its own)."""
    got = half.index_select(0, slots).view(count, rank, -1)
    if dead is not None:
        got.masked_fill_(dead, 0.0)
    return got[:, :, :dim]
