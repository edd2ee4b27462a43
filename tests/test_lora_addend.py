"""bench/lora_addend.py's premise: a step's projections are the same whether the LoRA delta is
added after the GEMM (in place) or written first and the GEMM adds onto it (LoraContext.addend),
for the step layouts it builds (base-model tokens first, then decode tokens and prompts by
adapter, padding after): here on the CPU path, the reference kernels."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from bench import lora_addend
from kernels.lora_layout import K, Q, V
from kernels.lora_ref import make_lora_tokens
from services.inference.models.llama import LoraContext, linear_lora
from tests.kernels.pools import build_adapters


def test_case_rows_group_the_step_as_the_engine_does():
    gen = torch.Generator().manual_seed(0)
    rows = lora_addend.case_rows(decode=6, n=4, prefill=(5, 3), base=2, gen=gen)
    assert rows.numel() == 2 + 6 + 5 + 3
    assert rows[:2].tolist() == [-1, -1]
    assert rows[2:].tolist() == sorted(rows[2:].tolist())  # adapter runs, as steps are sorted
    assert set(rows[2:].tolist()) <= set(range(4))


def test_every_case_is_a_step_the_addend_takes_at_the_engines_graph_size():
    """Mixed cases are prefill-sized and padded as the engine's mixed graphs pad them; decode
    cases are at least ADDEND_MIN_TOKENS tokens."""
    from pathlib import Path

    from kernels import lora_paths
    from services.inference.engine.config import EngineConfig
    from services.inference.engine.model_runner import ADDEND_MIN_TOKENS

    sizes = EngineConfig(model_dir=Path("m")).mixed_graph_tokens
    for workload, decode, _, prefill, base, padded in lora_addend.CASES:
        real = decode + sum(prefill) + base
        if workload == "S1 decode":
            assert not prefill and padded == real >= ADDEND_MIN_TOKENS
            continue
        assert padded == min(n for n in sizes if n >= real) > lora_paths.FUSED_MAX_TOKENS


def test_every_case_fits_the_engines_tables():
    """Each case's tables as the engine writes them, in place and with every token listed: the
    tiles fit the capacity, and the addend's cover every token once."""
    gen = torch.Generator().manual_seed(2)
    for workload, *shape in lora_addend.CASES:
        rows = lora_addend.padded_rows(*shape, gen)
        for addend in (False, True):
            tokens = lora_addend.case_tokens(workload, rows, addend)
            assert tokens.zero_tiles == addend
            covered = torch.zeros(rows.numel(), dtype=torch.int32)
            for row, start, end in tokens.tiles[0].tolist():
                if row != -1:
                    covered[start:end] += 1
            want = torch.ones_like(covered) if addend else (rows >= 0).to(torch.int32)
            assert torch.equal(covered, want), (workload, shape, addend)


def test_in_place_and_addend_give_the_same_projections():
    gen = torch.Generator().manual_seed(1)
    d, n = 32, 4
    ranks = [{Q: 8, K: 4, V: 8}, {Q: 8, V: 2}, {Q: 4, K: 8, V: 8}, {Q: 8, K: 8, V: 8}]
    dims = {m: (d, d) for m in (Q, K, V)}
    setup = build_adapters(ranks, dims, d, torch.float32, torch.device("cpu"), gen)
    rows = lora_addend.case_rows(decode=6, n=n, prefill=(9,), base=3, gen=gen)
    rows = torch.cat([rows, torch.full((4,), -1, dtype=torch.int32)])  # padding
    x = torch.randn(rows.numel(), d, generator=gen)
    weight = torch.randn(3 * d, d, generator=gen)
    bias = torch.randn(3 * d, generator=gen)
    out = {}
    for addend in (False, True):
        batch = SimpleNamespace(lora_tokens=make_lora_tokens(rows, capacity=n + 2, zeros=addend))
        lora = LoraContext(setup.index, 8)
        lora.fused, lora.rows, lora.addend = True, 16, addend
        out[addend] = linear_lora(x, weight, bias, batch, setup.pool[0], lora, (Q, K, V), (d,) * 3)
    torch.testing.assert_close(out[True], out[False], rtol=1e-5, atol=1e-5)
    base = x @ weight.T + bias
    assert torch.allclose(out[True][rows < 0], base[rows < 0], atol=1e-5)
    assert not torch.allclose(out[True][rows >= 0], base[rows >= 0], atol=1e-3)  # deltas landed


def test_case_entries_start_each_entry():
    """A decode token is an entry of one token, a prompt's chunk one of its length, the base
    tokens one entry; the starts end at the step's tokens."""
    gen = torch.Generator().manual_seed(3)
    rows, starts = lora_addend.case_entries(decode=5, n=3, prefill=(4, 2), base=3, gen=gen)
    assert starts[0] == 0 and starts[1] == 3 and starts[-1] == rows.numel() == 3 + 5 + 4 + 2
    lengths = sorted(b - a for a, b in zip(starts[:-1], starts[1:], strict=True))
    assert lengths == [1] * 5 + [2, 3, 4]
    for a, b in zip(starts[:-1], starts[1:], strict=True):
        assert len(set(rows[a:b].tolist())) == 1  # an entry is on one adapter


def test_small_mixed_cases_are_decode_sized_steps_on_the_engines_paths():
    """--small-mixed's cases are mixed steps of at most FUSED_MAX_TOKENS tokens padded as the
    engine's mixed graphs pad them, on the engine's two paths for them: the shapes' at its
    default max_lora_rank, and NARROW (the engine's from NARROW_MIN_ADAPTERS adapters), with
    the decode tokens apart as lora_paths.mixed_decodes_apart says (sharing their adapters 2-8
    to one: from 100) and the addend from ADDEND_MIN_TOKENS; each path's tables cover the
    step's adapter tokens once (and the addend's every token)."""
    from pathlib import Path

    from kernels import lora_paths
    from services.inference.engine.config import EngineConfig
    from services.inference.engine.model_runner import ADDEND_MIN_TOKENS

    config = EngineConfig(model_dir=Path("m"))
    assert config.max_lora_rank == lora_addend.SMALL_MAX_RANK
    sizes = config.mixed_graph_tokens
    gen = torch.Generator().manual_seed(4)
    for decode, n, prefill, padded in lora_addend.SMALL_CASES:
        real = decode + sum(prefill)
        assert padded == min(s for s in sizes if s >= real) <= lora_paths.FUSED_MAX_TOKENS
        rows, starts, paths = lora_addend.small_paths(decode, n, prefill, padded, gen)
        assert rows.numel() == padded and starts[-1] == padded
        assert paths["shapes"]["rows"] == lora_addend.SMALL_MAX_RANK
        assert paths["narrow"]["addend"] == (padded >= ADDEND_MIN_TOKENS)
        assert paths["narrow"]["apart"] == (decode > 100 and n == 100)
        for path in paths.values():
            tokens = make_lora_tokens(rows, capacity=lora_addend.CAPACITY,
                                      one_token_tiles=path["apart"],
                                      entries=starts if path["apart"] else None,
                                      zeros=path["addend"])  # fmt: skip
            covered = torch.zeros(padded, dtype=torch.int32)
            for row, start, end in tokens.tiles[0].tolist():
                if row != -1:
                    covered[start:end] += 1
            want = torch.ones_like(covered) if path["addend"] else (rows >= 0).to(torch.int32)
            assert torch.equal(covered, want), (decode, n, prefill, path)
