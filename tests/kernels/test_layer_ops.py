"""The decoder layer's fused pointwise kernels (kernels/layer_ops.py) against their float64
torch references (kernels/layer_ops_ref.py): RMSNorm with and without the residual add,
rotary embedding with the K/V write into pages, SiLU(gate) * up."""

from __future__ import annotations

import pytest
import torch

from kernels import layer_ops, layer_ops_ref
from tests.kernels.sizes import DEVICE, DTYPES, ON_GPU, assert_close

# (tokens, hidden): real Llama widths on a GPU, odd ones (not powers of two) everywhere.
NORM_SHAPES = ((1, 4096), (300, 4096), (7, 5120)) if ON_GPU else ((1, 96), (5, 100))
# (tokens, heads, kv heads, head_dim)
ROPE_SHAPES = ((64, 32, 32, 128), (37, 32, 8, 128)) if ON_GPU else ((5, 4, 2, 12), (3, 2, 2, 16))
SILU_SHAPES = ((1, 11008), (129, 14336)) if ON_GPU else ((1, 40), (6, 1100))


def _rand(gen, *shape, dtype):
    return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)


@pytest.mark.parametrize("shape", NORM_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_delta", [False, True], ids=["norm", "add+norm"])
def test_rmsnorm(shape, dtype, with_delta):
    gen = torch.Generator().manual_seed(hash((shape, with_delta)) % 1000)
    x = _rand(gen, *shape, dtype=dtype)
    w = (1 + 0.1 * torch.randn(shape[1], generator=gen)).to(dtype).to(DEVICE)
    delta = _rand(gen, *shape, dtype=dtype) if with_delta else None
    ref_x = x.double().clone()
    want = (
        layer_ops_ref.add_rmsnorm(ref_x, delta.double(), w.double(), 1e-5)
        if with_delta
        else layer_ops_ref.rmsnorm(ref_x, w.double(), 1e-5)
    )
    got = layer_ops.rmsnorm(x, w, 1e-5, delta=delta)
    assert_close(got, want, dtype)
    assert_close(x, ref_x, dtype)  # the residual add happened in place


@pytest.mark.parametrize("shape", ROPE_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_write_kv(shape, dtype):
    """q, k, v are strided views of one fused projection, as the model passes them; a padding
    token (slot -1) writes nothing; every other pool slot keeps its NaN."""
    t, heads, kv_heads, hd = shape
    gen = torch.Generator().manual_seed(t + heads)
    w = kv_heads * hd
    qkv = _rand(gen, t, heads * hd + 2 * w, dtype=dtype)
    q = qkv[:, : heads * hd].view(t, heads, hd)
    k = qkv[:, heads * hd : heads * hd + w].view(t, kv_heads, hd)
    v = qkv[:, heads * hd + w :].view(t, kv_heads, hd)
    max_len = 64
    angles = torch.outer(
        torch.arange(max_len, dtype=torch.float32), torch.rand(hd // 2, generator=gen)
    )
    cos, sin = angles.cos().to(DEVICE), angles.sin().to(DEVICE)
    positions = torch.randint(0, max_len, (t,), generator=gen).to(DEVICE)
    slots = torch.randperm(3 * t, generator=gen)[:t].to(DEVICE)
    slots[t // 2] = -1
    pool = torch.full((2, 3 * t, w), float("nan"), dtype=dtype, device=DEVICE)
    ref_q, ref_pool = q.double().clone(), pool.double().clone()
    layer_ops_ref.rope_write_kv(
        ref_q, k.double(), v.double(), cos, sin, positions, ref_pool, slots
    )  # the reference rounds cos, sin to q's dtype: float64 here
    layer_ops.rope_write_kv(q, k, v, cos, sin, positions, pool, slots)
    assert_close(q, ref_q, dtype)
    written = slots[slots >= 0]
    assert_close(pool[:, written], ref_pool[:, written], dtype)
    untouched = torch.ones(3 * t, dtype=torch.bool, device=DEVICE)
    untouched[written] = False
    assert torch.isnan(pool[:, untouched]).all()


@pytest.mark.parametrize("shape", SILU_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(shape, dtype):
    gen = torch.Generator().manual_seed(shape[1])
    gate_up = _rand(gen, shape[0], 2 * shape[1], dtype=dtype)
    assert_close(layer_ops.silu_mul(gate_up), layer_ops_ref.silu_mul(gate_up.double()), dtype)


def test_layer_ops_reject_bad_input():
    x = torch.zeros(3, 8, device=DEVICE)
    with pytest.raises(ValueError, match="weight must be"):
        layer_ops.rmsnorm(x, torch.ones(7, device=DEVICE), 1e-5)
    with pytest.raises(ValueError, match="delta must be"):
        layer_ops.rmsnorm(x, torch.ones(8, device=DEVICE), 1e-5, delta=torch.zeros(3, 7))
    with pytest.raises(ValueError, match="even width"):
        layer_ops.silu_mul(torch.zeros(2, 5, device=DEVICE))
    q = torch.zeros(2, 2, 4, device=DEVICE)
    with pytest.raises(ValueError, match="rope tables"):
        layer_ops.rope_write_kv(q, q, q, torch.zeros(4, 3), torch.zeros(4, 3),
                                torch.zeros(2, dtype=torch.int64), torch.zeros(2, 4, 8),
                                torch.zeros(2, dtype=torch.int64))  # fmt: skip


def test_dependent_launches_only_where_the_gpu_takes_them(monkeypatch):
    """kernels/tiles.py pdl_launch: never on the CPU or under the interpreter; on a Hopper GPU
    on unless LORAFLEET_PDL=0 (read when the answer is first asked for a device)."""
    from kernels.tiles import INTERPRET, PDL_ENV, pdl_launch

    pdl_launch.cache_clear()
    try:
        assert not pdl_launch(torch.device("cpu"))
        if ON_GPU and not INTERPRET:
            gpu = torch.device("cuda", 0)
            hopper = torch.cuda.get_device_capability(gpu)[0] >= 9
            monkeypatch.delenv(PDL_ENV, raising=False)
            pdl_launch.cache_clear()
            assert pdl_launch(gpu) == hopper
            monkeypatch.setenv(PDL_ENV, "0")
            pdl_launch.cache_clear()
            assert not pdl_launch(gpu)
    finally:
        pdl_launch.cache_clear()


def test_the_fused_lora_kernel_is_a_dependent_launch_only_when_asked(monkeypatch):
    """kernels/tiles.py lora_pdl_launch: off by default (LORAFLEET_LORA_PDL unset) and wherever
    pdl_launch is off; on a Hopper GPU on with LORAFLEET_LORA_PDL=1. lora_dependent gives the
    launch's PDL constexpr and Triton's launch_pdl together."""
    from kernels.tiles import LORA_PDL_ENV, PDL_ENV, lora_dependent, lora_pdl_launch, pdl_launch

    def fresh():
        pdl_launch.cache_clear()
        lora_pdl_launch.cache_clear()

    fresh()
    try:
        monkeypatch.setenv(LORA_PDL_ENV, "1")
        assert lora_dependent(torch.device("cpu")) == {"PDL": False, "launch_pdl": False}
        if ON_GPU:
            gpu = torch.device("cuda", 0)
            fresh()
            assert lora_pdl_launch(gpu) == pdl_launch(gpu)
            monkeypatch.setenv(PDL_ENV, "0")
            fresh()
            assert not lora_pdl_launch(gpu)
            monkeypatch.delenv(PDL_ENV)
            monkeypatch.delenv(LORA_PDL_ENV)
            fresh()
            assert lora_dependent(gpu) == {"PDL": False, "launch_pdl": False}
    finally:
        fresh()
