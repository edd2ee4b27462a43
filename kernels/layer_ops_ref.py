"""Torch reference of the decoder layer's pointwise work, fused on CUDA by kernels/layer_ops.py:
RMSNorm (with the residual add before it), rotary embedding with the K/V write into the pool,
and SiLU(gate) * up.

Each computes what Hugging Face transformers' Llama computes, in the same order and with the
same roundings to the activation dtype, so the CPU serving path (float32) matches it token for
token. The Triton kernels compute in float32 and round each output once, which for bf16 differs
only within the dtype's rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import attention_ref


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x / rms(x)), the normalisation in float32 and rounded to x's dtype before
    the weight: [T, D] -> [T, D]."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def add_rmsnorm(
    residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """residual += delta in place (in its dtype), then rmsnorm(residual): [T, D]."""
    residual.add_(delta)
    return rmsnorm(residual, weight, eps)


def rope_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the two halves of each head. x: [T, heads, head_dim]; cos, sin: [T, head_dim // 2]
    in x's dtype."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]  # [T, heads, half] each
    cos, sin = cos[:, None, :], sin[:, None, :]  # [T, 1, half]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def rope_write_kv(
    q: torch.Tensor,  # [T, n_heads, head_dim], rotated in place
    k: torch.Tensor,  # [T, n_kv, head_dim]
    v: torch.Tensor,  # [T, n_kv, head_dim]
    cos_table: torch.Tensor,  # [max_len, head_dim // 2] float32
    sin_table: torch.Tensor,
    positions: torch.Tensor,  # [T]
    pool_layer: torch.Tensor,  # [2, slots, W]
    slot_mapping: torch.Tensor,  # [T]; negative: no write
) -> None:
    """Rotary embedding of q (in place) and k at each token's position, then k and v into the
    pool's slots (attention_ref.write_kv). cos and sin are rounded to q's dtype first."""
    cos = cos_table[positions].to(q.dtype)  # [T, head_dim // 2]
    sin = sin_table[positions].to(q.dtype)
    q.copy_(rope_rotate(q, cos, sin))
    attention_ref.write_kv(pool_layer, rope_rotate(k, cos, sin), v, slot_mapping)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up for gate_up = [gate | up]: [T, 2I] -> [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)  # [T, I] each
    return F.silu(gate) * up
