"""ModelRunner's CUDA-graph padding and graph choice, checked on the CPU: a padded mixed step
computes what the unpadded one does, and each step finds the graph that serves it."""

from __future__ import annotations

import torch

from kernels.lora_layout import GATE, K, O, Q, V
from services.inference.engine.api import AdapterKey, GenerationRequest
from services.inference.engine.batch import BatchEntry
from services.inference.engine.model_runner import (
    ATTENTION,
    GraphKey,
    LoraMode,
    StepLora,
    pair_modules,
)
from services.inference.engine.sampling_params import SamplingParams
from tests.inference.engine_harness import make_core
from tests.inference.models import PARITY_ADAPTERS


def _req(rid, prompt, adapter=None):
    sampling = SamplingParams(max_new_tokens=6, ignore_eos=True)
    return GenerationRequest(rid, prompt_token_ids=prompt, adapter=adapter, sampling=sampling)


def test_padded_mixed_step_matches_the_unpadded_one(tiny_models):
    """What a mixed step's graph computes with its padding (tokens of no sequence, sequences of
    no tokens), run eagerly here: the sampled rows' logits equal the unpadded step's."""
    model_dir = tiny_models.model("tiny-llama")
    core = make_core(model_dir)
    keys = [AdapterKey(name, 1) for name in list(PARITY_ADAPTERS)[:2]]
    for key in keys:
        core.add_adapter_dir(key, tiny_models.adapter("tiny-llama", key.adapter_id))
    core.add_request(_req("a", [5, 9, 13, 17, 21], keys[0]))
    core.add_request(_req("b", [6, 10, 14], None))
    core.step()  # both prefilled: decodes from now on
    core.add_request(_req("c", [7, 11, 15, 19, 23, 27, 31], keys[1]))
    seen = []
    execute = core.runner.execute

    def spy(entries):
        logits = execute(entries)
        seen.append((list(entries), logits.clone()))
        return logits

    core.runner.execute = spy
    core.step()
    entries, want = seen[0]
    assert any(len(e.token_ids) > 1 for e in entries) and any(
        len(e.token_ids) == 1 for e in entries
    )
    runner = core.runner
    tokens = sum(len(e.token_ids) for e in entries)
    runner.batch.fill(entries, pad_tokens=tokens + 5, pad_seqs=len(entries) + 3)
    assert runner.batch.has_lora
    got = runner._forward(runner.lora)[: sum(e.sample for e in entries)]
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # As captured graphs run it: the logits written into the rows of one shared buffer, the
    # rows past the step's left as they were.
    shared = torch.full((len(entries) + 8, want.shape[1]), float("nan"))
    rows = runner._forward(runner.lora, shared)
    assert rows.data_ptr() == shared.data_ptr() and rows.shape[0] == len(entries) + 3
    torch.testing.assert_close(rows[: want.shape[0]], want, rtol=1e-5, atol=1e-5)
    assert torch.isnan(shared[rows.shape[0] :]).all()


def test_each_step_finds_its_graph(tiny_models):
    core = make_core(tiny_models.model("tiny-llama"), max_num_seqs=8, max_num_batched_tokens=32)
    runner = core.runner
    graphs = [GraphKey(n, n, mode) for n in (4, 8) for mode in (LoraMode.NONE, LoraMode.TWO)]
    graphs += [GraphKey(8, 8, LoraMode.FUSED), GraphKey(4, 4, LoraMode.TWO, ATTENTION),
               GraphKey(8, 8, LoraMode.FUSED, ATTENTION)]  # fmt: skip
    graphs += [GraphKey(n, min(8, n - 1), mode) for n in (16, 32)
               for mode in (LoraMode.NONE, LoraMode.SHAPES)]  # fmt: skip
    wide = LoraMode.WIDE
    graphs += [GraphKey(32, 8, LoraMode.NARROW), GraphKey(8, 8, wide),
               GraphKey(8, 8, wide, ATTENTION), GraphKey(32, 8, wide),
               GraphKey(32, 8, LoraMode.NARROW, ATTENTION), GraphKey(16, 8, LoraMode.SHAPES,
               ATTENTION)]  # fmt: skip
    graphs += [GraphKey(4, 4, LoraMode.ONE_TOKEN), GraphKey(4, 4, LoraMode.ONE_TOKEN, ATTENTION)]
    runner._graphs = dict.fromkeys(graphs, (None, None))
    runner._decode_sizes, runner._mixed_sizes = (4, 8), (16, 32)

    def decode(n, row=None):
        return [BatchEntry([1], 3, [0], row, True) for _ in range(n)]

    def chunk(n, row=None, sample=True):
        return BatchEntry(list(range(n)), 0, [0, 1, 2, 3, 4, 5, 6, 7], row, sample)

    def pick(entries, mode, modules=None):
        return runner._graph_for(entries, StepLora(mode, modules))

    none, two, fused = LoraMode.NONE, LoraMode.TWO, LoraMode.FUSED
    shapes, narrow = LoraMode.SHAPES, LoraMode.NARROW
    assert pick(decode(3), none) == GraphKey(4, 4, none)  # base only: no LoRA kernels
    assert pick(decode(3, row=0), two) == GraphKey(4, 4, two)
    assert pick(decode(6, row=0), fused) == GraphKey(8, 8, fused)
    assert pick(decode(3, row=0), fused) == GraphKey(4, 4, two)  # no fused graph of 4
    # Adapters of the attention modules only take the graph without MLP calls, where there is
    # one; any MLP module (or modules unknown: None) takes the graph of every module.
    q_v, o, gate = 1 << Q | 1 << V, 1 << O, 1 << GATE
    assert pick(decode(3, row=0), two, q_v | o) == GraphKey(4, 4, two, ATTENTION)
    assert pick(decode(3, row=0), two, q_v | gate) == GraphKey(4, 4, two)
    assert pick(decode(3, row=0), two, None) == GraphKey(4, 4, two)
    assert pick(decode(6, row=0), two, q_v) == GraphKey(8, 8, two)  # none at 8
    assert pick(decode(6, row=0), fused, q_v) == GraphKey(8, 8, fused, ATTENTION)
    assert pick(decode(6, row=0), fused, q_v | gate) == GraphKey(8, 8, fused)
    assert pick(decode(9), none) is None  # more sequences than any graph
    assert pick([*decode(2), chunk(9)], none) == GraphKey(16, 8, none)
    assert pick([*decode(2, row=1), chunk(9)], two, None) == GraphKey(16, 8, shapes)
    assert pick([*decode(2, row=1), chunk(20)], narrow) == GraphKey(32, 8, narrow)
    # mixed steps too: their twins without MLP calls, where there is one
    assert pick([*decode(2, row=1), chunk(20)], narrow, q_v | o) == GraphKey(
        32, 8, narrow, ATTENTION
    )
    assert pick([*decode(2, row=1), chunk(20)], narrow, q_v | gate) == GraphKey(32, 8, narrow)
    assert pick([*decode(2, row=1), chunk(9)], fused, q_v) == GraphKey(16, 8, shapes, ATTENTION)
    assert pick([*decode(2, row=1), chunk(20)], LoraMode.WIDE, o) == GraphKey(32, 8, LoraMode.WIDE)
    assert pick([*decode(3), chunk(20)], none) == GraphKey(32, 8, none)
    assert pick([chunk(1, sample=False), *decode(2)], none) == GraphKey(16, 8, none)
    assert pick([*decode(5), chunk(28)], shapes) is None  # 33 tokens: more than any graph
    # steps with an adapter above 16 rank rows: the wide graphs, decode (attention-only too)
    # and mixed; none of 4 sequences or 16 tokens, so those run eagerly
    assert pick(decode(6, row=0), wide) == GraphKey(8, 8, wide)
    assert pick(decode(6, row=0), wide, q_v | o) == GraphKey(8, 8, wide, ATTENTION)
    assert pick(decode(3, row=0), wide) is None
    assert pick([*decode(2, row=1), chunk(20)], wide) == GraphKey(32, 8, wide)
    assert pick([*decode(2, row=1), chunk(9)], wide) is None
    # decode steps on one-token tiles: their graphs, or two launches where none is
    one = LoraMode.ONE_TOKEN
    assert pick(decode(3, row=0), one) == GraphKey(4, 4, one)
    assert pick(decode(3, row=0), one, q_v | o) == GraphKey(4, 4, one, ATTENTION)
    assert pick(decode(6, row=0), one) == GraphKey(8, 8, two)  # no one-token graph of 8


def test_a_one_token_graph_is_filled_with_one_token_tiles(tiny_models):
    """Replaying a ONE_TOKEN graph, the batch's 16-token tile table lists each adapter token as its
    own tile (shared adapters too); a two-launch graph's lists the adapter's run as one tile."""
    core = make_core(tiny_models.model("tiny-llama"), max_num_seqs=8)
    runner = core.runner
    runner._pad = BatchEntry((0,), 0, (0,), None, True)
    entries = [BatchEntry([1], 3, [0], row, True) for row in (0, 0, 2)]
    runner._fill_for(GraphKey(4, 4, LoraMode.ONE_TOKEN), entries)
    tiles = runner.batch.lora_tokens.tiles[0]
    assert tiles[:4].tolist() == [[0, 0, 1], [0, 1, 2], [2, 2, 3], [-1, 0, 0]]
    runner._fill_for(GraphKey(4, 4, LoraMode.TWO), entries)
    tiles = runner.batch.lora_tokens.tiles[0]
    assert tiles[:3].tolist() == [[0, 0, 2], [2, 2, 3], [-1, 0, 0]]


def test_one_token_steps_pair_their_tokens_where_every_call_takes_pairs(tiny_models):
    """A ONE_TOKEN decode step puts the tokens that share an adapter two to a tile
    (StepLora.pair_tiles, StepBatch.fill's pair_tiles) when every module its adapters have is
    one whose launch takes two-token tiles (ModelRunner.pair_modules: none on the CPU, whose
    path has no tiles); its graph's replay is filled so; a step with an adapter on a module
    outside them keeps one-token tiles."""
    core = make_core(tiny_models.model("tiny-llama"), max_num_seqs=8)
    runner = core.runner
    assert runner.pair_modules == 0  # CPU
    runner.row_ranks = [8, 8, 8, 8]
    runner.row_modules = [1 << Q | 1 << V, 1 << Q | 1 << V | 1 << GATE, 1 << O, 1 << O]
    entries = [BatchEntry([1], 3, [0], row, True) for row in (0, 0, 0, 2)]
    assert runner.step_lora(entries) == StepLora(LoraMode.ONE_TOKEN, 1 << Q | 1 << V | 1 << O,
                                                 True, False)  # fmt: skip
    runner.pair_modules = 1 << Q | 1 << K | 1 << V | 1 << O  # as Llama-7B's on a GPU
    step = runner.step_lora(entries)
    assert step.mode is LoraMode.ONE_TOKEN and step.pair_tiles
    mlp = [BatchEntry([1], 3, [0], row, True) for row in (0, 1, 1)]
    assert not runner.step_lora(mlp).pair_tiles  # row 1 adapts gate
    runner._pad = BatchEntry((0,), 0, (0,), None, True)
    runner._fill_for(GraphKey(4, 4, LoraMode.ONE_TOKEN), entries, True, step.pair_tiles)
    tiles = runner.batch.lora_tokens.tiles[0]
    assert tiles[:4].tolist() == [[0, 0, 2], [0, 2, 3], [2, 3, 4], [-1, 0, 0]]
    # From the fused rule's size (64 adapter tokens), tokens shared more than
    # ONE_TOKEN_MAX_SHARING (8) to one stay ONE_TOKEN where they go two to a tile, and take the
    # two launches where a module of theirs does not take pairs.
    runner.batch.max_segments = 200  # the capacity of an engine of many resident adapters
    shared = [BatchEntry([1], 3, [0], row, True) for row in [0] * 60 + [2] * 4]
    assert runner.step_lora(shared) == StepLora(LoraMode.ONE_TOKEN, 1 << Q | 1 << V | 1 << O,
                                                True, True)  # fmt: skip
    shared_mlp = [BatchEntry([1], 3, [0], row, True) for row in [1] * 60 + [2] * 4]
    assert runner.step_lora(shared_mlp).mode is LoraMode.TWO


def test_pair_modules_are_the_calls_that_hoist(monkeypatch):
    """With ONE_TOKEN_PAIRS on, the modules whose ONE_TOKEN calls take two-token tiles are
    those whose slices' A and Bᵀ rows fit one GEMV block and one pool chunk: Llama-7B's and
    tiny-mha's q/k/v and o (multi-head attention: the pool as wide as the hidden size), not
    their MLPs, and nothing of a grouped-query model (q/k/v's d_in and o's width above its
    pool's width); with it off, none."""
    from kernels import lora as triton_lora
    from kernels import lora_paths

    llama_7b = (4096, 4096, 4096, 11008, 4096)  # hidden, q_dim, kv_dim, inter, pool width
    monkeypatch.setattr(lora_paths, "ONE_TOKEN_PAIRS", True)
    assert pair_modules(*llama_7b) == ATTENTION
    assert pair_modules(64, 64, 64, 160, 64) == ATTENTION  # tiny-mha
    assert pair_modules(64, 64, 32, 160, 32) == 0  # tiny-llama
    assert pair_modules(4096, 4096, 1024, 14336, 1024) == 0  # Llama-3-8B
    # The launch rules read lora_paths' settings when called, not as bound at import: with
    # FUSED_MAX_TOKENS lowered (as the CUDA tests of narrow steps lower it) and back, the same
    # answers, whichever test imported kernels.lora first.
    monkeypatch.setattr(lora_paths, "FUSED_MAX_TOKENS", 16)
    assert pair_modules(*llama_7b) == ATTENTION
    rows = lora_paths.ONE_TOKEN_ROWS  # a 32-token q/k/v call of a ONE_TOKEN step
    assert not triton_lora.fused_config(32, 4096, rows, 3, 4096, d_in=4096).gemv_hoist
    monkeypatch.undo()
    assert triton_lora.fused_config(32, 4096, rows, 3, 4096, d_in=4096).gemv_hoist
    monkeypatch.setattr(lora_paths, "ONE_TOKEN_PAIRS", False)
    assert pair_modules(*llama_7b) == 0


def test_a_narrow_mixed_step_cuts_its_decode_tokens_apart(tiny_models, monkeypatch):
    """A prefill-sized step whose adapters fit 16 rank rows (NARROW) puts each decode token in a
    one-token tile when its decode tokens share their adapters 2 to 8 to one and every adapter
    fits 8 rank rows (lora_paths.mixed_decodes_apart), and the graph replaying it is filled so;
    decode tokens on distinct adapters, or sharing one adapter more, keep the segments' tiles,
    and so do steps of an adapter above 8 rank rows."""
    from kernels import lora_paths

    monkeypatch.setattr(lora_paths, "FUSED_MAX_TOKENS", 16)  # these steps count as prefill-sized
    core = make_core(tiny_models.model("tiny-llama"), max_num_seqs=80, max_num_batched_tokens=128,
                     max_lora_rank=64)  # fmt: skip
    runner = core.runner
    runner.row_ranks = [8, 8, 16, 8, 8, 8, 8, 8]
    narrow = LoraMode.NARROW

    def step(decodes, prompt_row=0):
        entries = [BatchEntry([1], 3, [0], r, True) for r in decodes]
        entries.append(BatchEntry(list(range(20)), 0, [1, 2, 3, 4, 5], prompt_row, True))
        return sorted(entries, key=lambda e: e.lora_row)

    def path(entries):
        chosen = runner.step_lora(entries)
        return chosen.mode, chosen.one_token_tiles

    entries = step([0, 0, 1, 1, 3, 3])
    assert path(entries) == (narrow, True)
    runner._pad = BatchEntry((0,), 0, (0,), None, True)
    key = GraphKey(32, 8, narrow)
    runner._fill_for(key, entries, True)
    tiles = runner.batch.lora_tokens.tiles[0]
    assert tiles[:9].tolist() == [
        [0, 2, 18], [0, 18, 22], [0, 0, 1], [0, 1, 2], [1, 22, 23], [1, 23, 24], [3, 24, 25],
        [3, 25, 26], [-1, 0, 0],
    ]  # fmt: skip
    runner._fill_for(key, entries, False)
    assert runner.batch.lora_tokens.tiles[0, :5].tolist() == [
        [0, 0, 16], [0, 16, 22], [1, 22, 24], [3, 24, 26], [-1, 0, 0]
    ]  # fmt: skip
    assert path(step([0, 1, 3, 4])) == (narrow, False)  # decode tokens on distinct adapters
    # 72 decode tokens on one adapter (over 64 adapter tokens, shared 72 to 1): the segments
    assert path(step([4] * 72)) == (narrow, False)
    # a rank-16 adapter in the step: NARROW still, its decode tokens on the segments' tiles
    assert path(step([0, 0, 1, 1], prompt_row=2)) == (narrow, False)
