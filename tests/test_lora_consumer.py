"""bench/lora_consumer.py's kernels compute what today's path computes: the shrink h = A · x of
each token's adapter, the rotary/KV-write kernel with scale · h · Bᵀ added to q, k and v before
it rotates and writes them, and the residual RMSNorm with the o projection's delta added (under
the Triton interpreter, small shapes, float32, against the references: kernels/lora_ref.py's
shrink and delta, kernels/layer_ops_ref.py's rotary, KV write and RMSNorm). Adapters of several
ranks, a base-model token and two tokens that share an adapter."""

from __future__ import annotations

import torch

from bench import lora_consumer as lc
from kernels import layer_ops_ref, lora_ref
from kernels.lora_layout import K, O, Q, V
from kernels.lora_ref import make_lora_tokens
from tests.kernels.pools import build_adapters

HEADS, HALF, R = 2, 8, lc.RANK
H = HEADS * 2 * HALF  # the pool's row width too: one chunk a row
RANKS = (8, 5, 3, 8, 1)
ROWS = (0, 1, 1, -1, 3, 4)  # token -> adapter row (-1: the base model)
T = len(ROWS)
QKV = (Q, K, V)


def test_consumer_kernels_add_each_tokens_delta():
    gen = torch.Generator().manual_seed(0)
    dims = {m: (H, H) for m in (*QKV, O)}
    setup = build_adapters([dict.fromkeys(dims, r) for r in RANKS], dims, H, torch.float32,
                           torch.device("cpu"), gen)  # fmt: skip
    pool, index = setup.pool[0], setup.index
    rows = torch.tensor(ROWS, dtype=torch.int32)
    tokens = make_lora_tokens(rows)
    x, attn = torch.randn(T, H, generator=gen), torch.randn(T, H, generator=gen)
    qkv, o = torch.randn(T, 3 * H, generator=gen), torch.randn(T, H, generator=gen)
    resid, norm_w = torch.randn(T, H, generator=gen), torch.randn(H, generator=gen)
    cos, sin = torch.randn(64, HALF, generator=gen), torch.randn(64, HALF, generator=gen)
    pos = torch.randint(0, 64, (T,), generator=gen)
    kv_slots = torch.arange(T, dtype=torch.int64)
    idx = (pool[0], pool.stride(1), index.slot_table, index.slot_table.stride(0), index.ranks,
           index.a_offsets, index.ranks.stride(0), rows)  # fmt: skip
    b_args = (pool, pool.stride(0), pool.stride(1), index.slot_table,
              index.slot_table.stride(0), index.ranks, index.b_offsets, index.scales,
              index.ranks.stride(0), index.scales.stride(0), rows)  # fmt: skip

    h_qkv = torch.full((T, 3, R), float("nan"))
    lc._shrink_kernel[(T, 3)](x, x.stride(0), h_qkv, *idx, M0=QKV[0], M1=QKV[1], M2=QKV[2],
                              SLICES=3, D_IN=H, R=R)  # fmt: skip
    want_h = lora_ref.lora_shrink(x, pool, index, tokens, QKV, R)
    torch.testing.assert_close(h_qkv, want_h.float(), atol=1e-4, rtol=1e-4)

    kv = torch.zeros(2, T, H)
    got_qkv = qkv.clone()
    lc._rope_expand_kernel[(T, 3)](
        got_qkv, got_qkv.stride(0), h_qkv, cos, sin, cos.stride(0), pos, kv, kv.stride(0),
        kv.stride(1), kv_slots, *b_args, M0=QKV[0], M1=QKV[1], M2=QKV[2], HEADS=HEADS,
        HALF=HALF, R=R,
    )  # fmt: skip
    want_qkv = qkv.clone()
    lora_ref.lora_apply(want_qkv, x, pool, index, tokens, QKV, (H, H, H), R)
    q, k, v = want_qkv.view(T, 3, HEADS, 2 * HALF).unbind(1)
    q, want_kv = q.clone(), torch.zeros(2, T, H)
    layer_ops_ref.rope_write_kv(q, k, v, cos, sin, pos, want_kv, kv_slots)
    torch.testing.assert_close(got_qkv[:, :H], q.reshape(T, H), atol=1e-3, rtol=1e-4)
    torch.testing.assert_close(kv, want_kv, atol=1e-3, rtol=1e-4)

    h_o = torch.full((T, 1, R), float("nan"))
    lc._shrink_kernel[(T, 1)](attn, attn.stride(0), h_o, *idx, M0=O, M1=O, M2=O, SLICES=1,
                              D_IN=H, R=R)  # fmt: skip
    got_resid, normed = resid.clone(), torch.empty(T, H)
    lc._norm_expand_kernel[(T,)](
        got_resid, got_resid.stride(0), o, o.stride(0), normed, normed.stride(0), norm_w,
        lc.EPS, h_o, *b_args, M=O, D=H, R=R,
    )  # fmt: skip
    o_full, want_resid = o.clone(), resid.clone()
    lora_ref.lora_apply(o_full, attn, pool, index, tokens, (O,), (H,), R)
    want_norm = layer_ops_ref.add_rmsnorm(want_resid, o_full, norm_w, lc.EPS)
    torch.testing.assert_close(got_resid, want_resid, atol=1e-3, rtol=1e-4)
    torch.testing.assert_close(normed, want_norm, atol=1e-3, rtol=1e-4)
