"""Logprobs: each generated token's log-probability and the most likely alternatives, against
transformers' log-softmax of the same position's logits, in a batch beside requests that ask
for none; steps launched ahead (the step loop's overlap) and one at a time."""

from __future__ import annotations

import pytest
import torch

from services.inference.engine.api import AdapterKey, GenerationRequest
from services.inference.engine.sampling_params import MAX_LOGPROBS, SamplingParams
from tests.inference.engine_harness import hf_greedy, make_core, run


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlapped"])
def test_logprobs_match_transformers(tiny_models, overlap):
    model_dir = tiny_models.model("tiny-llama")
    core = make_core(model_dir)
    key = AdapterKey("r8", 1)
    adapter_dir = tiny_models.adapter("tiny-llama", "r8")
    core.add_adapter_dir(key, adapter_dir)
    prompts = {"a": [5, 9, 13, 17, 21, 4], "b": [6, 10, 14], "c": [7, 11, 15, 19]}
    asks = {"a": 3, "b": None, "c": 0}
    adapters = {"a": key, "b": None, "c": None}
    requests = [
        GenerationRequest(rid, prompt_token_ids=prompt, adapter=adapters[rid],
                          sampling=SamplingParams(max_new_tokens=5, ignore_eos=True,
                                                  logprobs=asks[rid]))
        for rid, prompt in prompts.items()
    ]  # fmt: skip
    results = run(core, {0: requests}, overlap=overlap)
    assert results["b"].logprobs == []  # asked for none
    for rid in ("a", "c"):
        adapter = adapter_dir if adapters[rid] is not None else None
        tokens, logits = hf_greedy(model_dir, adapter, prompts[rid], 5)
        entries = results[rid].logprobs
        assert [lp.token_id for lp in entries] == tokens == results[rid].token_ids
        for lp, row in zip(entries, logits, strict=True):
            want = torch.log_softmax(row.double(), dim=-1)
            assert lp.logprob == pytest.approx(float(want[lp.token_id]), abs=1e-4)
            assert lp.token == core.tokenizer.decode([lp.token_id], skip_special_tokens=False)
            assert len(lp.top) == asks[rid]
            best = torch.topk(want, asks[rid]).indices.tolist() if asks[rid] else []
            assert [t.token_id for t in lp.top] == best
            for t in lp.top:
                assert t.logprob == pytest.approx(float(want[t.token_id]), abs=1e-4)
            if lp.top:  # greedy: the chosen token is the most likely one
                assert lp.top[0].token_id == lp.token_id


def test_logprobs_are_bounded():
    with pytest.raises(ValueError, match="logprobs must be None or an integer in"):
        SamplingParams(logprobs=MAX_LOGPROBS + 1)
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=-1)
    assert SamplingParams(logprobs=MAX_LOGPROBS).logprobs == MAX_LOGPROBS
