"""Seeded sampling through the engine: reproducible, and independent of what else is batched
(other requests, their adapters, arrival times, the request's row) and of preemption."""

from __future__ import annotations

import random

from services.inference.engine.api import AdapterKey, GenerationRequest
from services.inference.engine.sampling_params import SamplingParams
from tests.inference.engine_harness import make_core, run

R4, R8 = AdapterKey("r4", 1), AdapterKey("r8", 1)
PROMPT = list(range(60, 75))


def _seeded(rid, seed, adapter=None, **kw):
    params = dict(max_new_tokens=24, temperature=0.9, top_p=0.95, top_k=50, seed=seed)
    params.update(kw)
    return GenerationRequest(
        rid, prompt_token_ids=PROMPT, adapter=adapter,
        sampling=SamplingParams(ignore_eos=True, **params),
    )  # fmt: skip


def _noise(n, seed):
    """Other traffic: greedy, unseeded and seeded sampling, base and adapters."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        kind = i % 3
        params = SamplingParams(
            max_new_tokens=rng.randint(2, 30),
            temperature=0.0 if kind == 0 else 1.2,
            seed=rng.randrange(1000) if kind == 2 else None,
            ignore_eos=True,
        )
        prompt = [rng.randrange(3, 512) for _ in range(rng.randint(1, 40))]
        adapter = rng.choice([None, R4, R8])
        out.append(
            GenerationRequest(
                f"n{seed}-{i}", prompt_token_ids=prompt, adapter=adapter, sampling=params
            )
        )
    return out


def _core(tiny_models, **kw):
    core = make_core(tiny_models.model("tiny-llama"), **kw)
    core.add_adapter_dir(R4, tiny_models.adapter("tiny-llama", "r4"))
    core.add_adapter_dir(R8, tiny_models.adapter("tiny-llama", "r8"))
    return core


def test_seeded_requests_do_not_depend_on_the_batch(tiny_models):
    targets = [_seeded("base", 11), _seeded("lora", 12, R8), _seeded("greedy-ish", 13, top_k=1)]
    alone = {}
    for req in targets:
        alone.update(run(_core(tiny_models), {0: [req]}))

    # Same requests among others, arriving at different steps, in a different order.
    arrivals = {0: _noise(5, 1), 2: [targets[2]], 3: _noise(4, 2) + [targets[1]], 6: [targets[0]]}
    mixed = run(_core(tiny_models), arrivals)
    # And in a pool so small that requests are preempted and recomputed.
    crowded_core = _core(tiny_models, num_pages=60, max_num_seqs=6)
    crowded = run(crowded_core, {0: _noise(6, 3) + targets[::-1], 1: _noise(6, 4)})
    assert crowded_core.stats().preemptions > 0

    for req in targets:
        tokens = alone[req.request_id].token_ids
        assert len(tokens) == 24
        assert mixed[req.request_id].token_ids == tokens, req.request_id
        assert crowded[req.request_id].token_ids == tokens, req.request_id
    # top_k=1 samples the argmax whatever the draw: it equals greedy decoding.
    greedy = _seeded("g", None, temperature=0.0)
    assert run(_core(tiny_models), {0: [greedy]})["g"].token_ids == alone["greedy-ish"].token_ids


def test_different_seeds_give_different_samples(tiny_models):
    core = _core(tiny_models)
    results = run(core, {0: [_seeded(f"s{i}", i) for i in range(4)] + [_seeded("u", None)]})
    samples = {tuple(r.token_ids) for r in results.values()}
    assert len(samples) == 5
    assert all(0 <= t < 512 for r in results.values() for t in r.token_ids)
