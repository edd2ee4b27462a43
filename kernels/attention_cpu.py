"""Paged attention on the CPU, the decode rows batched over their sequences.

kernels/attention_ref.py attends one sequence at a time: about fifteen small torch operations a
sequence, which set a CPU decode step's time (tiny Llama, batch 32: most of its 25 ms). Here the
sequences with one query row (decoding) attend together: sorted by context length, in batches
whose padded K/V stay under BATCH_BYTES and whose longest context is at most twice their
shortest, each one gather of its K and V rows, two batched products and a masked softmax.
Sequences with several query rows (prefill chunks) attend one at a time, as the reference's
attention_ref.attend_sequence computes them. Same arguments and result as
attention_ref.paged_attention (rows of no sequence are zero), which the tests compare it with.
"""

from __future__ import annotations

import torch

from kernels import attention_ref

# The padded K (and V) of one batch of decode rows at most: [rows, longest context, W].
BATCH_BYTES = 32 << 20


def paged_attention(
    q: torch.Tensor,
    pool_layer: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_starts: torch.Tensor,
    page_size: int,
    scale: float,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of packed queries ``[T, n_heads, head_dim]`` over paged K/V; ``out``
    (optional, q's shape) receives the result; rows of no sequence are zero."""
    starts, lens = query_starts.tolist(), seq_lens.tolist()
    if out is None:
        out = torch.zeros_like(q)
    else:
        out.zero_()
    single = []  # sequences with one query row: decoding
    for b, ctx in enumerate(lens):
        q0, q1 = starts[b], starts[b + 1]
        if q1 - q0 == 1 and ctx > 0:
            single.append(b)
        elif q1 > q0:  # a prefill chunk
            out[q0:q1] = attention_ref.attend_sequence(q[q0:q1], pool_layer, block_tables[b], ctx,
                                                       page_size, scale)  # fmt: skip
    single.sort(key=lambda b: lens[b])
    per_row = pool_layer.shape[-1] * pool_layer.element_size()
    batch: list[int] = []
    for b in single:
        # Sorted by context: a batch is padded to its last one's, at most twice its first's.
        full = (len(batch) + 1) * lens[b] * per_row > BATCH_BYTES
        if batch and (full or lens[b] > 2 * lens[batch[0]]):
            _decode(q, pool_layer, block_tables, starts, lens, batch, page_size, scale, out)
            batch = []
        batch.append(b)
    if batch:
        _decode(q, pool_layer, block_tables, starts, lens, batch, page_size, scale, out)
    return out


def _decode(q, pool_layer, block_tables, starts, lens, batch, page_size, scale, out) -> None:
    """One batch of decode rows (sequences ``batch``, one query row each) into ``out``."""
    _, n_heads, head_dim = q.shape
    n_kv = pool_layer.shape[-1] // head_dim
    group = n_heads // n_kv
    idx = torch.tensor(batch)
    ctx = torch.tensor([lens[b] for b in batch])  # [B]
    n, longest = len(batch), int(ctx.max())
    pos = torch.arange(longest)
    valid = pos[None, :] < ctx[:, None]  # [B, C]
    pages = block_tables[idx][:, pos // page_size].long()  # [B, C]
    slots = pages * page_size + pos % page_size  # [B, C]
    # Past a context, its first position's slot: its own K/V, finite, which the softmax then
    # weighs at exactly 0 (a slot that is not its own could hold anything, NaN included).
    slots = torch.where(valid, slots, slots[:, :1])
    # Rows of head_dim gathered in [B, n_kv, C] order (row slot * n_kv + head of the pool's
    # [slots * n_kv, head_dim] view), so that the products read them without a copy.
    rows_of = (slots[:, None, :] * n_kv + torch.arange(n_kv)[None, :, None]).flatten()
    k = pool_layer[0].reshape(-1, head_dim).index_select(0, rows_of)
    v = pool_layer[1].reshape(-1, head_dim).index_select(0, rows_of)
    k = k.view(n * n_kv, longest, head_dim).to(q.dtype)
    v = v.view(n * n_kv, longest, head_dim).to(q.dtype)
    rows = torch.tensor([starts[b] for b in batch])
    qs = q[rows].view(n * n_kv, group, head_dim)  # head h reads kv head h // group
    scores = torch.bmm(qs, k.transpose(1, 2)) * scale  # [B * n_kv, group, C]
    scores = scores.view(n, n_kv, group, longest)
    scores.masked_fill_(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(n * n_kv, group, longest)
    out[rows] = torch.bmm(probs, v).view(n, n_heads, head_dim)
