"""ModelRunner's CUDA-graph padding and graph choice, checked on the CPU: a padded mixed step
computes what the unpadded one does, and each step finds the graph that serves it."""

from __future__ import annotations

import torch

from services.inference.engine.api import AdapterKey, GenerationRequest
from services.inference.engine.batch import BatchEntry
from services.inference.engine.model_runner import GraphKey, LoraMode
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


def test_each_step_finds_its_graph(tiny_models):
    core = make_core(tiny_models.model("tiny-llama"), max_num_seqs=8, max_num_batched_tokens=32)
    runner = core.runner
    graphs = [GraphKey(n, n, mode) for n in (4, 8) for mode in (LoraMode.NONE, LoraMode.TWO)]
    graphs += [GraphKey(8, 8, LoraMode.FUSED)]
    graphs += [GraphKey(n, min(8, n - 1), mode) for n in (16, 32)
               for mode in (LoraMode.NONE, LoraMode.SHAPES)]  # fmt: skip
    runner._graphs = dict.fromkeys(graphs, (None, None))
    runner._decode_sizes, runner._mixed_sizes = (4, 8), (16, 32)

    def decode(n, row=None):
        return [BatchEntry([1], 3, [0], row, True) for _ in range(n)]

    def chunk(n, row=None, sample=True):
        return BatchEntry(list(range(n)), 0, [0, 1, 2, 3, 4, 5, 6, 7], row, sample)

    pick = runner._graph_for
    assert pick(decode(3), False) == GraphKey(4, 4, LoraMode.NONE)  # base only: no LoRA kernels
    assert pick(decode(3, row=0), False) == GraphKey(4, 4, LoraMode.TWO)
    assert pick(decode(6, row=0), True) == GraphKey(8, 8, LoraMode.FUSED)
    assert pick(decode(3, row=0), True) == GraphKey(4, 4, LoraMode.TWO)  # no fused graph of 4
    assert pick(decode(9), False) is None  # more sequences than any graph
    assert pick([*decode(2), chunk(9)], False) == GraphKey(16, 8, LoraMode.NONE)
    assert pick([*decode(2, row=1), chunk(9)], False) == GraphKey(16, 8, LoraMode.SHAPES)
    assert pick([*decode(3), chunk(20)], None) == GraphKey(32, 8, LoraMode.NONE)
    assert pick([chunk(1, sample=False), *decode(2)], False) == GraphKey(16, 8, LoraMode.NONE)
    assert pick([*decode(5), chunk(28)], None) is None  # 33 tokens: more than any graph
