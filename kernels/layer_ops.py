"""Triton kernels for the decoder layer's pointwise work: one launch each where PyTorch takes
several (RMSNorm was seven, rotary embedding and the K/V write about fifteen, SiLU * up two).
At decode batch sizes these small kernels cost more than their bytes: the H200 profile of an
eager Llama-7B decode step at batch 64 (bench/step_profile.py) spent 2.5 ms of its 11 in them.

Semantics and roundings: kernels/layer_ops_ref.py. Each program computes in float32 and rounds
its outputs once to the activation dtype (the residual sum first, as the reference's in-place
add does, since the norm reads the rounded sum).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.tiles import dependent, launch_gate


@triton.jit
def _rmsnorm_kernel(
    # rows [T, D]: input (the residual), delta added to it in place when HAS_DELTA, output
    x_ptr, stride_x, d_ptr, stride_d, out_ptr, stride_o, w_ptr, dim, eps,
    HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    launch_gate(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < dim
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_DELTA:
        d = tl.load(d_ptr + row * stride_d + cols, mask=ok, other=0.0)
        x = (x.to(tl.float32) + d.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(x_ptr + row * stride_x + cols, x, mask=ok)
    h = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(h * h, 0) / dim + eps)
    h = (h * inv).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (w * h).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _rope_kv_kernel(
    # q, k, v rows [T, heads x head_dim] (views of the fused q/k/v projection)
    q_ptr, stride_q, k_ptr, stride_k, v_ptr, stride_v,
    # rotary tables [max_len, HALF] float32, positions [T]
    cos_ptr, sin_ptr, stride_cs, pos_ptr,
    # pool layer [2, slots, W] and each token's slot (negative: no write)
    pool_ptr, stride_half, stride_slot, slots_ptr,
    N_HEADS: tl.constexpr, N_KV: tl.constexpr, HALF: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_KV: tl.constexpr, BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """Program (t, 0): token t's query heads rotated in place, as one [heads, half] block;
    program (t, 1): its K heads rotated into the pool and V copied there."""
    launch_gate(PDL)
    t = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)
    i_ok = i < HALF
    pos = tl.load(pos_ptr + t).to(tl.int64)
    dtype = q_ptr.dtype.element_ty
    c = tl.load(cos_ptr + pos * stride_cs + i, mask=i_ok, other=0.0).to(dtype).to(tl.float32)
    s = tl.load(sin_ptr + pos * stride_cs + i, mask=i_ok, other=0.0).to(dtype).to(tl.float32)
    c, s = c[None, :], s[None, :]
    if tl.program_id(1) == 0:
        h = tl.arange(0, BLOCK_H)
        ok = (h < N_HEADS)[:, None] & i_ok[None, :]
        base = q_ptr + t * stride_q + h[:, None] * (2 * HALF) + i[None, :]
        x1 = tl.load(base, mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(base + HALF, mask=ok, other=0.0).to(tl.float32)
        tl.store(base, (x1 * c - x2 * s).to(dtype), mask=ok)
        tl.store(base + HALF, (x2 * c + x1 * s).to(dtype), mask=ok)
    else:
        slot = tl.load(slots_ptr + t).to(tl.int64)
        if slot >= 0:
            h = tl.arange(0, BLOCK_KV)
            ok = (h < N_KV)[:, None] & i_ok[None, :]
            cols = h[:, None] * (2 * HALF) + i[None, :]
            x1 = tl.load(k_ptr + t * stride_k + cols, mask=ok, other=0.0).to(tl.float32)
            x2 = tl.load(k_ptr + t * stride_k + HALF + cols, mask=ok, other=0.0).to(tl.float32)
            dst = pool_ptr + slot * stride_slot + cols
            pool_dtype = pool_ptr.dtype.element_ty
            tl.store(dst, (x1 * c - x2 * s).to(dtype).to(pool_dtype), mask=ok)
            tl.store(dst + HALF, (x2 * c + x1 * s).to(dtype).to(pool_dtype), mask=ok)
            v1 = tl.load(v_ptr + t * stride_v + cols, mask=ok, other=0.0)
            v2 = tl.load(v_ptr + t * stride_v + HALF + cols, mask=ok, other=0.0)
            tl.store(dst + stride_half, v1.to(pool_dtype), mask=ok)
            tl.store(dst + stride_half + HALF, v2.to(pool_dtype), mask=ok)


@triton.jit
def _silu_mul_kernel(
    gu_ptr, stride_gu, out_ptr, stride_o, inter, BLOCK: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    launch_gate(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inter
    g = tl.load(gu_ptr + row * stride_gu + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * stride_gu + inter + cols, mask=ok, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    act = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)  # SiLU, rounded as torch's
    tl.store(out_ptr + row * stride_o + cols, (act * u).to(dtype), mask=ok)


def _rows(name: str, x: torch.Tensor) -> None:
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"{name} must be [T, D] with a unit last stride, got {tuple(x.shape)}")


def rmsnorm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, delta: torch.Tensor | None = None
) -> torch.Tensor:
    """rmsnorm(x) (layer_ops_ref.rmsnorm); with ``delta``, x += delta in place first
    (layer_ops_ref.add_rmsnorm). x, delta: [T, D]; weight: [D]."""
    _rows("x", x)
    t, dim = x.shape
    if weight.shape != (dim,) or not weight.is_contiguous():
        raise ValueError(f"weight must be contiguous [{dim}], got {tuple(weight.shape)}")
    if delta is not None:
        _rows("delta", delta)
        if delta.shape != x.shape or delta.dtype != x.dtype:
            raise ValueError(f"delta must be {tuple(x.shape)} {x.dtype}, got {delta.dtype}")
    out = torch.empty_like(x)
    if t == 0:
        return out
    block = triton.next_power_of_2(dim)
    d = x if delta is None else delta
    _rmsnorm_kernel[(t,)](
        x, x.stride(0), d, d.stride(0), out, out.stride(0), weight, dim, eps,
        HAS_DELTA=delta is not None, BLOCK=block, num_warps=min(16, max(1, block // 256)),
        **dependent(x.device),
    )  # fmt: skip
    return out


def rope_write_kv(q, k, v, cos_table, sin_table, positions, pool_layer, slot_mapping) -> None:
    """layer_ops_ref.rope_write_kv: q [T, n_heads, hd] rotated in place, k rotated and v copied
    into the pool layer [2, slots, n_kv * hd] at slot_mapping (negative slots skipped)."""
    t, n_heads, head_dim = q.shape
    n_kv = k.shape[1]
    for name, x, heads in (("q", q, n_heads), ("k", k, n_kv), ("v", v, n_kv)):
        if x.dim() != 3 or x.shape[0] != t or x.shape[1:] != (heads, head_dim):
            raise ValueError(f"{name} must be [{t}, {heads}, {head_dim}], got {tuple(x.shape)}")
        if x.stride(2) != 1 or x.stride(1) != head_dim:
            raise ValueError(f"{name}'s heads must be contiguous within each token")
    if head_dim % 2 or cos_table.shape[1] != head_dim // 2 or cos_table.dtype != torch.float32:
        raise ValueError(f"rope tables must be [max_len, {head_dim // 2}] float32")
    if sin_table.shape != cos_table.shape or sin_table.stride() != cos_table.stride():
        raise ValueError("cos and sin tables must have the same shape and strides")
    if pool_layer.dim() != 3 or pool_layer.shape[2] != n_kv * head_dim or pool_layer.stride(2) != 1:
        raise ValueError(f"pool_layer must be [2, slots, {n_kv * head_dim}]")
    if positions.shape != (t,) or slot_mapping.shape != (t,):
        raise ValueError(f"positions and slot_mapping must be [{t}]")
    if t == 0:
        return
    half = head_dim // 2
    block_h = triton.next_power_of_2(n_heads)
    _rope_kv_kernel[(t, 2)](
        q, q.stride(0), k, k.stride(0), v, v.stride(0),
        cos_table, sin_table, cos_table.stride(0), positions,
        pool_layer, pool_layer.stride(0), pool_layer.stride(1), slot_mapping,
        N_HEADS=n_heads, N_KV=n_kv, HALF=half, BLOCK_H=block_h,
        BLOCK_KV=triton.next_power_of_2(n_kv), BLOCK=triton.next_power_of_2(half),
        num_warps=min(8, max(1, block_h * half // 512)),
        **dependent(q.device),
    )  # fmt: skip


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """layer_ops_ref.silu_mul: [T, 2I] -> [T, I]."""
    _rows("gate_up", gate_up)
    t, width = gate_up.shape
    if width % 2:
        raise ValueError(f"gate_up must have an even width, got {width}")
    inter = width // 2
    out = torch.empty(t, inter, dtype=gate_up.dtype, device=gate_up.device)
    if t == 0:
        return out
    block = 1024
    _silu_mul_kernel[(t, triton.cdiv(inter, block))](
        gate_up, gate_up.stride(0), out, out.stride(0), inter, BLOCK=block, num_warps=4,
        **dependent(gate_up.device),
    )  # fmt: skip
    return out
