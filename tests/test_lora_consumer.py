"""bench/lora_consumer.py's kernels compute what today's path computes: the shrink h = A · x of
each token's adapter, the rotary/KV-write kernel with scale · h · Bᵀ added to q, k and v before
it rotates and writes them, and the residual RMSNorm with the o projection's delta added (under
the Triton interpreter, small shapes, float32, against the torch references: the deltas in
float64 and kernels/layer_ops_ref.py's rotary, KV write and RMSNorm). Adapters of several
ranks, a base-model token and two tokens that share an adapter."""

from __future__ import annotations

import pytest
import torch

from bench import lora_consumer as lc
from kernels import layer_ops_ref
from kernels.lora_layout import K, O, Q, V
from kernels.lora_ref import LoraIndex

HEADS, HALF, R = 2, 8, lc.RANK
H = HEADS * 2 * HALF  # the pool's row width too: one chunk a row
RANKS = (8, 5, 3, 8, 1)
ROWS = (0, 1, 1, -1, 3, 4)  # token -> adapter row (-1: the base model)
T = len(ROWS)


@pytest.fixture(scope="module")
def adapters():
    """A pool layer holding each adapter's q/k/v/o A and Bᵀ rows at shuffled slots, and the
    index rows that find them (module m's A rows at slot-table position 2Rm, its Bᵀ rows after)."""
    gen = torch.Generator().manual_seed(0)
    n = len(RANKS)
    slots = 1 + n * 4 * 2 * R
    pool = torch.zeros(2, slots, H)
    table = torch.zeros(n, 7 * 2 * R, dtype=torch.int32)
    ranks = torch.zeros(n, 7, dtype=torch.int32)
    a_off = torch.zeros(n, 7, dtype=torch.int32)
    b_off = torch.zeros(n, 7, dtype=torch.int32)
    scales = torch.zeros(n, 7)
    free = iter((torch.randperm(slots - 1, generator=gen) + 1).tolist())
    weights = {}
    for a, rank in enumerate(RANKS):
        for m in (Q, K, V, O):
            ranks[a, m], a_off[a, m], b_off[a, m] = rank, 2 * R * m, 2 * R * m + R
            scales[a, m] = 0.5 + a
            A = torch.randn(rank, H, generator=gen)
            B = torch.randn(rank, H, generator=gen)
            weights[a, m] = A, B
            for j in range(rank):
                table[a, a_off[a, m] + j] = s = next(free)
                pool[0, s] = A[j]
                table[a, b_off[a, m] + j] = s = next(free)
                pool[1, s] = B[j]
    return pool, LoraIndex(table, ranks, a_off, b_off, scales), weights


def _delta(weights, scales, x: torch.Tensor, m: int) -> torch.Tensor:
    out = torch.zeros(T, H, dtype=torch.float64)
    for t, a in enumerate(ROWS):
        if a >= 0:
            A, B = (w.double() for w in weights[a, m])
            out[t] = float(scales[a, m]) * ((A @ x[t].double()) @ B)
    return out


def test_consumer_kernels_add_each_tokens_delta(adapters):
    pool, index, weights = adapters
    gen = torch.Generator().manual_seed(1)
    rows = torch.tensor(ROWS, dtype=torch.int32)
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
    lc._shrink_kernel[(T, 3)](x, x.stride(0), h_qkv, *idx, M0=Q, M1=K, M2=V, SLICES=3, D_IN=H,
                              R=R)  # fmt: skip
    for t, a in enumerate(ROWS):
        for s, m in enumerate((Q, K, V)):
            want = torch.zeros(R, dtype=torch.float64)
            if a >= 0:
                want[: RANKS[a]] = weights[a, m][0].double() @ x[t].double()
            torch.testing.assert_close(h_qkv[t, s].double(), want, atol=1e-4, rtol=1e-4)

    kv = torch.zeros(2, T, H)
    got_qkv = qkv.clone()
    lc._rope_expand_kernel[(T, 3)](
        got_qkv, got_qkv.stride(0), h_qkv, cos, sin, cos.stride(0), pos, kv, kv.stride(0),
        kv.stride(1), kv_slots, *b_args, M0=Q, M1=K, M2=V, HEADS=HEADS, HALF=HALF, R=R,
    )  # fmt: skip
    want_qkv = qkv.double().clone()
    for s, m in enumerate((Q, K, V)):
        want_qkv[:, s * H : (s + 1) * H] += _delta(weights, index.scales, x, m)
    q, k, v = want_qkv.float().view(T, 3, HEADS, 2 * HALF).unbind(1)
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
    want_resid = resid.clone()
    o_full = (o.double() + _delta(weights, index.scales, attn, O)).float()
    want_norm = layer_ops_ref.add_rmsnorm(want_resid, o_full, norm_w, lc.EPS)
    torch.testing.assert_close(got_resid, want_resid, atol=1e-3, rtol=1e-4)
    torch.testing.assert_close(normed, want_norm, atol=1e-3, rtol=1e-4)
