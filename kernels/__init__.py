"""Kernels behind one set of calls: Triton on CUDA tensors, the torch reference elsewhere.

lora_apply(y, x, pool_layer, index, tokens, modules, out_widths, max_rank)
lora_shrink(...), lora_expand(...)            # kernels/lora_ref.py documents the arguments
write_kv(pool_layer, k, v, slot_mapping)
paged_attention(q, pool_layer, block_tables, seq_lens, query_starts, page_size, scale)
rmsnorm(x, weight, eps, delta=None), rope_write_kv(...), silu_mul(gate_up)   # layer_ops_ref.py

The Triton modules are imported on the first CUDA call, so CPU serving never loads Triton.
Optional keywords pass preallocated buffers (``lora_apply(workspace=)``, ``lora_shrink(out=)``,
``paged_attention(out=)``); the reference path accepts and fills them the same way
(``paged_attention(prefill_tiles=)``, a host-built table, it accepts and ignores). The engine
passes no buffers (inside a CUDA-graph capture the launchers allocate from the graph's own
pool), only each step's prefill tiles.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from kernels import attention_cpu, attention_ref, layer_ops_ref, lora_cpu, lora_ref
from kernels.lora_ref import LoraIndex, LoraTokens, make_lora_tokens


@functools.cache
def _triton_lora() -> ModuleType:
    from kernels import lora

    return lora


@functools.cache
def _triton_attention() -> ModuleType:
    from kernels import attention

    return attention


@functools.cache
def _triton_layer_ops() -> ModuleType:
    from kernels import layer_ops

    return layer_ops


def lora_shrink(x, pool_layer, index, tokens, modules, max_rank, *, out=None):
    """h = x · Aᵀ per slice: [T, slices, max_rank] (kernels/lora_ref.py)."""
    if x.is_cuda:
        return _triton_lora().lora_shrink(x, pool_layer, index, tokens, modules, max_rank, out=out)
    h = lora_ref.lora_shrink(x, pool_layer, index, tokens, modules, max_rank)
    if out is None:
        return h
    out.zero_()
    out[:, :, :max_rank] = h
    return out


def lora_expand(y, h, pool_layer, index, tokens, modules, out_widths) -> None:
    """y[:, slices] += scale · h · Bᵀ in place (kernels/lora_ref.py)."""
    if y.is_cuda:
        _triton_lora().lora_expand(y, h, pool_layer, index, tokens, modules, out_widths)
    else:
        lora_ref.lora_expand(y, h, pool_layer, index, tokens, modules, out_widths)


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
    workspace: torch.Tensor | None = None,
    fused: bool | None = None,
    rank_block: int = 16,
    delta: bool = False,
) -> None:
    """The model's LoRA hook: y[:, slices] += scale · x · Aᵀ · Bᵀ in place. ``fused`` and
    ``rank_block`` pick the Triton path and its blocks (kernels/lora.py, lora_apply); the result
    is the same either way. ``delta``: y[:, slices] = the delta instead (zeros for tokens
    without one), on the fused kernel, whose tile tables must then list every token
    (kernels/lora.py)."""
    if y.is_cuda:
        _triton_lora().lora_apply(
            y, x, pool_layer, index, tokens, modules, out_widths, max_rank,
            workspace=workspace, fused=fused, rank_block=rank_block, delta=delta,
        )  # fmt: skip
    else:  # batched over the step's adapters (kernels/lora_cpu.py), as lora_ref computes it
        lora_cpu.lora_apply(
            y, x, pool_layer, index, tokens, modules, out_widths, max_rank, delta=delta
        )


def write_kv(pool_layer, k, v, slot_mapping) -> None:
    """pool_layer[0, slot_mapping[t]] = k[t], likewise v; negative slots are skipped."""
    if pool_layer.is_cuda:
        _triton_attention().write_kv(pool_layer, k, v, slot_mapping)
    else:
        attention_ref.write_kv(pool_layer, k, v, slot_mapping)


def paged_attention(
    q,
    pool_layer,
    block_tables,
    seq_lens,
    query_starts,
    page_size,
    scale,
    *,
    out: torch.Tensor | None = None,
    prefill_tiles: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of packed queries [T, heads, head_dim] over paged K/V. ``prefill_tiles``:
    a mixed step's prefill tiles (kernels/attention.py), which the reference does not need."""
    if q.is_cuda:
        return _triton_attention().paged_attention(
            q, pool_layer, block_tables, seq_lens, query_starts, page_size, scale, out=out,
            prefill_tiles=prefill_tiles,
        )  # fmt: skip
    return attention_cpu.paged_attention(  # decode rows batched (kernels/attention_cpu.py)
        q, pool_layer, block_tables, seq_lens, query_starts, page_size, scale, out=out
    )


def rmsnorm(x, weight, eps: float, *, delta: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of x; with ``delta``, x += delta in place first (the residual add)."""
    if x.is_cuda:
        return _triton_layer_ops().rmsnorm(x, weight, eps, delta=delta)
    if delta is None:
        return layer_ops_ref.rmsnorm(x, weight, eps)
    return layer_ops_ref.add_rmsnorm(x, delta, weight, eps)


def rope_write_kv(q, k, v, cos_table, sin_table, positions, pool_layer, slot_mapping) -> None:
    """Rotary embedding of q (in place) and k, then k and v into the pool's slots."""
    impl = _triton_layer_ops() if q.is_cuda else layer_ops_ref
    impl.rope_write_kv(q, k, v, cos_table, sin_table, positions, pool_layer, slot_mapping)


def silu_mul(gate_up) -> torch.Tensor:
    """SiLU(gate) * up for gate_up = [gate | up]."""
    if gate_up.is_cuda:
        return _triton_layer_ops().silu_mul(gate_up)
    return layer_ops_ref.silu_mul(gate_up)


__all__ = [
    "LoraIndex",
    "LoraTokens",
    "lora_apply",
    "lora_expand",
    "lora_shrink",
    "make_lora_tokens",
    "paged_attention",
    "rmsnorm",
    "rope_write_kv",
    "silu_mul",
    "write_kv",
]
