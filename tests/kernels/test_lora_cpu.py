"""The CPU serving path's batched LoRA hook (kernels/lora_cpu.py) against the per-adapter
reference (kernels/lora_ref.py), in float64 (to rounding) and float32 (the CPU serving dtype):
every popularity with tokens in runs and scattered, mixed ranks with untargeted modules, prefill
runs beside one-token ones (token counts that fall in several buckets), delta mode, and the
dispatch. Pools hold NaN wherever no adapter owns a slot, so a stray read shows as NaN."""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels import lora_cpu, lora_ref
from kernels.lora_layout import DOWN, GATE, UP, K, O, Q, V
from tests.kernels.pools import POPULARITY, build_adapters, lora_tokens, token_rows
from tests.kernels.sizes import LoraShape

SHAPES = (
    LoraShape("qkv_gqa", 16, (Q, K, V), 48, (48, 16, 16)),
    LoraShape("gate_up_odd", 24, (GATE, UP), 40, (52, 52)),
    LoraShape("down_odd", 16, (DOWN,), 52, (40,)),
    LoraShape("o", 16, (O,), 40, (40,)),
)
RANKS = (1, 8, 16, 24, 64)


def _ranks(n: int, modules: tuple[int, ...], gen: torch.Generator) -> list[dict[int, int]]:
    """Per adapter a rank for each module (mixed, as S2's), about one in four untargeted."""
    out = []
    for i in range(n):
        r = {m: RANKS[int(torch.randint(len(RANKS), (), generator=gen))] for m in modules}
        if i % 4 == 3 and len(modules) > 1:
            del r[modules[-1]]
        out.append(r)
    return out


def _compare(shape, ranks, rows, dtype, gen, delta=False, max_rank=None):
    dims = {m: (shape.d_in, w) for m, w in zip(shape.modules, shape.widths, strict=True)}
    setup = build_adapters(ranks, dims, shape.width, dtype, torch.device("cpu"), gen)
    tokens = lora_tokens(rows, torch.device("cpu"), zeros=delta)
    max_rank = max_rank or max(max(r.values()) for r in ranks)
    x = torch.randn(rows.numel(), shape.d_in, generator=gen, dtype=torch.float64)
    y0 = torch.randn(rows.numel(), sum(shape.widths), generator=gen, dtype=torch.float64)
    if delta:
        y0.fill_(float("nan"))  # every element must be written
    ref = y0.clone()
    lora_ref.lora_apply(ref, x, setup.pool[0].double(), setup.index, tokens, shape.modules,
                        shape.widths, max_rank, delta=delta)  # fmt: skip
    out = y0.to(dtype)
    lora_cpu.lora_apply(out, x.to(dtype), setup.pool[0], setup.index, tokens, shape.modules,
                        shape.widths, max_rank, delta=delta)  # fmt: skip
    assert not torch.isnan(out).any()
    if dtype is torch.float64:
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    else:
        diff = (out.double() - ref).norm() / ref.norm()
        assert diff < 1e-5, diff


@pytest.mark.parametrize("dtype", (torch.float64, torch.float32))
@pytest.mark.parametrize("grouped", (True, False), ids=("runs", "scattered"))
@pytest.mark.parametrize("popularity", POPULARITY)
def test_every_popularity_matches_the_reference(popularity, grouped, dtype):
    i = POPULARITY.index(popularity) * 4 + grouped * 2 + (dtype is torch.float32)
    gen = torch.Generator().manual_seed(500 + i)
    shape = SHAPES[i % len(SHAPES)]
    n = 37 if popularity == "distinct" else 9
    ranks = _ranks(n, shape.modules, gen)
    rows = token_rows(popularity, 37, n, gen, grouped)
    _compare(shape, ranks, rows, dtype, gen)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
@pytest.mark.parametrize("delta", (False, True), ids=("add", "delta"))
def test_prefill_runs_beside_decode_tokens(shape, delta):
    """A mixed step: runs of 1, 2, 3, 5, 9, 17 and 40 tokens (buckets 1 to 64), a base-model
    run and base-model tokens among one-token ones."""
    gen = torch.Generator().manual_seed(600 + SHAPES.index(shape) * 2 + delta)
    lengths = (40, 1, 17, 2, 9, 3, 5)
    ranks = _ranks(len(lengths) + 4, shape.modules, gen)
    rows = [torch.full((n,), a, dtype=torch.int32) for a, n in enumerate(lengths)]
    rows.append(torch.full((6,), -1, dtype=torch.int32))
    rows.append(torch.tensor([7, -1, 8, 9, -1, 10, 7], dtype=torch.int32))
    _compare(shape, ranks, torch.cat(rows), torch.float64, gen, delta=delta)


def test_a_step_of_the_base_model_alone_adds_nothing_or_writes_zeros():
    gen = torch.Generator().manual_seed(7)
    shape = SHAPES[0]
    rows = torch.full((5,), -1, dtype=torch.int32)
    _compare(shape, _ranks(2, shape.modules, gen), rows, torch.float64, gen)
    _compare(shape, _ranks(2, shape.modules, gen), rows, torch.float64, gen, delta=True)


def test_calls_sized_for_more_rank_rows_than_the_step_holds():
    """max_rank above every adapter's rank (the engine's max_lora_rank): the same result."""
    gen = torch.Generator().manual_seed(8)
    shape = SHAPES[0]
    ranks = [{m: 8 for m in shape.modules} for _ in range(4)]
    rows = token_rows("uniform", 11, 4, gen, grouped=True)
    _compare(shape, ranks, rows, torch.float64, gen, max_rank=128)


def test_cpu_tensors_take_the_batched_path(monkeypatch):
    """kernels.lora_apply sends CPU tensors here (the reference stays the tests' yardstick)."""
    called = []
    monkeypatch.setattr(lora_cpu, "lora_apply", lambda *a, **k: called.append(k.get("delta")))
    y, x = torch.zeros(2, 48), torch.zeros(2, 48)
    kernels.lora_apply(y, x, None, None, None, (Q, K, V), (48, 16, 16), 8, delta=True)
    assert called == [True]


def test_a_buffer_refilled_in_place_is_grouped_again():
    """The engine hands each call a fresh view of a token-row buffer that it refills in place
    every step: the groups kept from one step must not serve the next."""
    gen = torch.Generator().manual_seed(9)
    shape = SHAPES[0]
    ranks = _ranks(6, shape.modules, gen)
    dims = {m: (shape.d_in, w) for m, w in zip(shape.modules, shape.widths, strict=True)}
    setup = build_adapters(ranks, dims, shape.width, torch.float64, torch.device("cpu"), gen)
    buffer = torch.full((16,), -1, dtype=torch.int32)
    x = torch.randn(8, shape.d_in, generator=gen, dtype=torch.float64)
    for step in ([0, 0, 1, 2, 3, 3, 3, 4], [5, 4, 4, 1, -1, 2, 0, 0], [5, 4, 4, 1, -1, 2, 0, 0]):
        buffer[:8] = torch.tensor(step, dtype=torch.int32)
        tokens = lora_tokens(buffer[:8], torch.device("cpu"))._replace(token_lora=buffer[:8])
        ref = torch.zeros(8, sum(shape.widths), dtype=torch.float64)
        out = ref.clone()
        args = (x, setup.pool[0], setup.index, tokens, shape.modules, shape.widths, 64)
        lora_ref.lora_apply(ref, *args)
        lora_cpu.lora_apply(out, *args)
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


def test_an_index_changed_in_place_is_read_again():
    """A step works out its adapters' pool slots once for all its layers; when the engine
    changes the index between steps (an adapter evicted, another written into a freed row), the
    next step with the same token rows reads the new rows, not the kept slots."""
    gen = torch.Generator().manual_seed(10)
    shape = SHAPES[0]
    ranks = _ranks(6, shape.modules, gen)
    dims = {m: (shape.d_in, w) for m, w in zip(shape.modules, shape.widths, strict=True)}
    setup = build_adapters(ranks, dims, shape.width, torch.float64, torch.device("cpu"), gen)
    rows = torch.tensor([0, 1, 1, 2, 3, 5, 5, 4], dtype=torch.int32)
    tokens = lora_tokens(rows, torch.device("cpu"))
    x = torch.randn(8, shape.d_in, generator=gen, dtype=torch.float64)
    args = (x, setup.pool[0], setup.index, tokens, shape.modules, shape.widths, 64)

    def check():
        ref = torch.zeros(8, sum(shape.widths), dtype=torch.float64)
        out = ref.clone()
        lora_ref.lora_apply(ref, *args)
        lora_cpu.lora_apply(out, *args)
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
        return ref

    first = check()
    plan = lora_cpu._last
    check()  # the next layer of the same step: the same plan
    assert lora_cpu._last is plan
    setup.index.ranks[2].zero_()  # evicted: its row adds nothing
    for table in setup.index:  # row 1 now holds adapter 4 (its slots, ranks, offsets, scales)
        table[1] = table[4]
    second = check()
    assert lora_cpu._last is not plan
    assert not torch.equal(first[1:3], second[1:3]) and torch.equal(first[0], second[0])
