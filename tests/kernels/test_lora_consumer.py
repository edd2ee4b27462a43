"""The expand inside the consumers (kernels/lora_consumer.py): the per-token shrink, and the
rotary/K-V write and the residual RMSNorm with a call's LoRA expand (kernels/layer_ops.py),
against the float64 references (kernels/lora_ref.py's shrink, layer_ops_ref's consumers with
the same LoraExpand). Grouped-query geometry, so that q's and o's rows span several pool chunks
and k's and v's one; adapters of several ranks, one without k, a base-model token and tokens
that share an adapter."""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels import layer_ops, layer_ops_ref, lora_consumer, lora_ref
from kernels.lora_layout import K, O, Q, V
from kernels.lora_ref import LoraExpand
from tests.kernels.pools import build_adapters
from tests.kernels.sizes import DEVICE, DTYPES, ON_GPU, assert_close

# (heads, kv heads, head_dim): Llama-2-7B (MHA: a row a chunk) and Llama-3-8B (GQA) on a GPU
GEOMETRIES = ((32, 32, 128), (32, 8, 128)) if ON_GPU else ((4, 2, 16), (2, 2, 8))
R = 8
RANKS = (8, 5, 3, 8, 1)
# token -> adapter row (-1: the base model); adapter 2 has no k
ROWS = (0, 1, 1, -1, 2, 4, 3, 3, 0)
QKV = (Q, K, V)


def _setup(geometry, dtype, seed):
    heads, kv_heads, hd = geometry
    hidden, kv = heads * hd, kv_heads * hd
    gen = torch.Generator().manual_seed(seed)
    dims = {Q: (hidden, hidden), K: (hidden, kv), V: (hidden, kv), O: (hidden, hidden)}
    ranks = [dict.fromkeys(dims, r) for r in RANKS]
    ranks[2][K] = 0
    setup = build_adapters(ranks, dims, kv, dtype, DEVICE, gen)
    rows = torch.tensor(ROWS, dtype=torch.int32, device=DEVICE)
    return setup.pool[0], setup.index, kernels.make_lora_tokens(rows), gen


def _rand(gen, *shape, dtype):
    return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)


@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_shrink_tokens(geometry, dtype):
    pool, index, tokens, gen = _setup(geometry, dtype, 1)
    x = _rand(gen, len(ROWS), geometry[0] * geometry[2], dtype=dtype)
    for modules in (QKV, (O,)):
        h = lora_consumer.lora_shrink_tokens(x, pool, index, tokens.token_lora, modules, R)
        want = lora_ref.lora_shrink(x.double(), pool.double(), index, tokens, modules, R)
        assert h.dtype == torch.float32 and h.shape == want.shape
        assert_close(h, want, dtype)
        assert torch.equal(h[3], torch.zeros_like(h[3]))  # the base-model token


@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_write_kv_adds_the_qkv_expand(geometry, dtype):
    heads, kv_heads, hd = geometry
    pool, index, tokens, gen = _setup(geometry, dtype, 2)
    t, hidden, kv = len(ROWS), heads * hd, kv_heads * hd
    x = _rand(gen, t, hidden, dtype=dtype)
    h = lora_ref.lora_shrink(x.double(), pool.double(), index, tokens, QKV, R).float()
    qkv = _rand(gen, t, hidden + 2 * kv, dtype=dtype)
    max_len = 64
    angles = torch.outer(
        torch.arange(max_len, dtype=torch.float32), torch.rand(hd // 2, generator=gen)
    )
    cos, sin = angles.cos().to(DEVICE), angles.sin().to(DEVICE)
    positions = torch.randint(0, max_len, (t,), generator=gen).to(DEVICE)
    slots = torch.randperm(2 * t, generator=gen)[:t].to(DEVICE)
    slots[1] = -1
    kv_pool = torch.full((2, 2 * t, kv), float("nan"), dtype=dtype, device=DEVICE)
    widths = (hidden, kv, kv)

    def views(y):
        return (y[:, :hidden].view(t, heads, hd), y[:, hidden : hidden + kv].view(t, kv_heads, hd),
                y[:, hidden + kv :].view(t, kv_heads, hd))  # fmt: skip

    ref_qkv, ref_pool = qkv.double(), kv_pool.double()
    ref_lora = LoraExpand(h.double(), pool.double(), index, tokens, QKV, widths)
    layer_ops_ref.rope_write_kv(*views(ref_qkv), cos, sin, positions, ref_pool, slots, ref_lora)
    got_qkv = qkv.clone()
    layer_ops.rope_write_kv(*views(got_qkv), cos, sin, positions, kv_pool, slots,
                            lora=LoraExpand(h, pool, index, tokens, QKV, widths))  # fmt: skip
    assert_close(got_qkv[:, :hidden], ref_qkv[:, :hidden], dtype)  # q, rotated in place
    assert torch.equal(got_qkv[:, hidden:], qkv[:, hidden:])  # k and v: read only
    written = slots[slots >= 0]
    assert_close(kv_pool[:, written], ref_pool[:, written], dtype)
    unwritten = torch.ones(2 * t, dtype=torch.bool, device=DEVICE)
    unwritten[written] = False
    assert torch.isnan(kv_pool[:, unwritten]).all()
    # the expand changed what was written: without it, the base projections alone
    plain = kv_pool.clone()
    layer_ops.rope_write_kv(*views(qkv.clone()), cos, sin, positions, plain, slots)
    assert not torch.allclose(plain[:, written].float(), kv_pool[:, written].float())


@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rmsnorm_adds_the_o_expand(geometry, dtype):
    pool, index, tokens, gen = _setup(geometry, dtype, 3)
    t, hidden = len(ROWS), geometry[0] * geometry[2]
    attn = _rand(gen, t, hidden, dtype=dtype)
    h = lora_ref.lora_shrink(attn.double(), pool.double(), index, tokens, (O,), R).float()
    o, resid = _rand(gen, t, hidden, dtype=dtype), _rand(gen, t, hidden, dtype=dtype)
    w = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype).to(DEVICE)
    ref_resid = resid.double()
    ref_lora = LoraExpand(h.double(), pool.double(), index, tokens, (O,), (hidden,))
    want = layer_ops_ref.add_rmsnorm(ref_resid, o.double(), w.double(), 1e-5, ref_lora)
    got_resid = resid.clone()
    got = layer_ops.rmsnorm(got_resid, w, 1e-5, delta=o,
                            lora=LoraExpand(h, pool, index, tokens, (O,), (hidden,)))  # fmt: skip
    assert_close(got, want, dtype)
    assert_close(got_resid, ref_resid, dtype)
    plain = layer_ops.rmsnorm(resid.clone(), w, 1e-5, delta=o)
    assert not torch.allclose(plain.float(), got.float())


def test_consumers_reject_an_expand_that_does_not_fit():
    pool, index, tokens, gen = _setup(GEOMETRIES[-1], torch.float32, 4)
    t, hidden = len(ROWS), pool.shape[-1]
    h = torch.zeros(t, 1, R, device=DEVICE)
    x = torch.zeros(t, hidden, device=DEVICE)
    lora = LoraExpand(h, pool, index, tokens, (O,), (hidden,))
    with pytest.raises(ValueError, match="pass delta too"):
        layer_ops.rmsnorm(x, torch.ones(hidden, device=DEVICE), 1e-5, lora=lora)
    with pytest.raises(ValueError, match="slices must be"):
        layer_ops.rmsnorm(x, torch.ones(hidden, device=DEVICE), 1e-5, delta=x,
                          lora=lora._replace(widths=(hidden // 2,)))  # fmt: skip
    with pytest.raises(ValueError, match="h must be float32"):
        layer_ops.rmsnorm(x, torch.ones(hidden, device=DEVICE), 1e-5, delta=x,
                          lora=lora._replace(h=h.double()))  # fmt: skip
    with pytest.raises(ValueError, match="rank must be a power of two"):
        lora_consumer.lora_shrink_tokens(x, pool, index, tokens.token_lora, (O,), 6)


@pytest.mark.parametrize("block", [None, 1024])
def test_the_benchs_three_paths_agree(monkeypatch, block):
    """bench/lora_consumer.py's check at Llama-7B's layer width: today's path (the delta through
    memory), the consumer path with the per-token shrink (its d_in blocks capped at ``block``)
    and with the two-launch shrink give the same rotated q, K/V, residual and normed rows within
    bf16 rounding; a base-model token and two that share an adapter."""
    from bench import kernels as kb
    from bench import lora_consumer as bench

    monkeypatch.setattr(kb, "DEV", DEVICE)
    if block is not None:
        monkeypatch.setattr(lora_consumer, "_SHRINK_MAX_BLOCK", block)
    gen = torch.Generator().manual_seed(5)
    rows = torch.tensor([0, 1, 1, -1], dtype=torch.int32)
    case = kb.build_lora(3, bench.RANK, 1, rows)
    angles = torch.outer(torch.arange(64, dtype=torch.float32), torch.rand(bench.HALF))
    step = dict(
        index=case.index, rows=case.rows,
        tokens=kernels.make_lora_tokens(case.rows, capacity=5, one_token_tiles=True,
                                        pair_tiles=True, zeros=True),
        shrink_tokens=kernels.make_lora_tokens(case.rows, capacity=5, one_token_tiles=True,
                                               pair_tiles=True),
        cos=angles.cos().to(DEVICE), sin=angles.sin().to(DEVICE),
        pos=torch.randint(0, 64, (4,), generator=gen).to(DEVICE),
        slots=torch.arange(4, device=DEVICE),
    )  # fmt: skip
    assert bench.check([bench.Layer(4, case.pool[0], gen)], step) < 2e-2
