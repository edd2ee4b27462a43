"""Torch reference of paged attention over the unified pool, and of the K/V write.

The pool layer is ``[2, slots, W]`` with ``W = kv_heads * head_dim``; a sequence's token at
position p lives at slot ``block_tables[b, p // page_size] * page_size + p % page_size``.
A step's queries are packed: sequence b owns rows ``query_starts[b]:query_starts[b+1]``, which are
its last positions (``seq_lens[b]`` counts the context including them), so one call serves
prefill (all positions are queries), decode (one query) and prefill after a recompute.
Reference for kernels/attention.py (float64 in tests) and the CPU serving path (float32).
"""

from __future__ import annotations

import torch


def write_kv(
    pool_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """pool_layer[0, slot_mapping[t]] = k[t]; likewise v. k, v: [T, n_kv, head_dim].

    Tokens with a negative slot are skipped: rows that are padding only (the engine itself
    pads CUDA-graph steps with rows that write into a reserved page instead).
    """
    t = k.shape[0]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    pool_layer[0, slots] = k.reshape(t, -1)[keep].to(pool_layer.dtype)
    pool_layer[1, slots] = v.reshape(t, -1)[keep].to(pool_layer.dtype)


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
    """Causal attention of packed queries ``[T, n_heads, head_dim]`` over paged K/V.

    ``out`` (optional, q's shape) receives the result; rows of no sequence are zero.
    """
    if out is None:
        out = torch.zeros_like(q)
    else:
        out.zero_()
    starts = query_starts.tolist()
    for b, ctx in enumerate(seq_lens.tolist()):
        q0, q1 = starts[b], starts[b + 1]
        if q1 > q0:
            out[q0:q1] = attend_sequence(q[q0:q1], pool_layer, block_tables[b], ctx, page_size,
                                         scale)  # fmt: skip
    return out


def attend_sequence(
    q: torch.Tensor,
    pool_layer: torch.Tensor,
    block_table: torch.Tensor,
    ctx: int,
    page_size: int,
    scale: float,
) -> torch.Tensor:
    """One sequence's causal attention: its last ``len(q)`` positions ``q`` [n_q, n_heads,
    head_dim] over its ``ctx`` positions in the pages of ``block_table``."""
    n_q, n_heads, head_dim = q.shape
    n_kv = pool_layer.shape[-1] // head_dim
    group = n_heads // n_kv
    pos = torch.arange(ctx, device=q.device)
    slots = block_table[pos // page_size].long() * page_size + pos % page_size
    k = pool_layer[0, slots].view(ctx, n_kv, head_dim).to(q.dtype)  # [ctx, n_kv, hd]
    v = pool_layer[1, slots].view(ctx, n_kv, head_dim).to(q.dtype)
    k = k.repeat_interleave(group, dim=1)  # [ctx, n_heads, hd]
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # [n_heads, n_q, ctx]
    q_pos = torch.arange(ctx - n_q, ctx, device=q.device)
    mask = pos[None, :] > q_pos[:, None]  # [n_q, ctx]
    scores = scores.masked_fill(mask[None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v)
