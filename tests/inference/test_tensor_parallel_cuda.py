"""Tensor parallelism on two GPUs: NCCL carries the collectives and every rank replays the CUDA
graphs rank 0 replays, collectives captured in them. Collected only where two GPUs are
(tests/inference/conftest.py); its output is kept in bench/results/.

float32 meets the one-rank CUDA bound (1e-4, test_engine_cuda.py) against HF + PEFT; graphs
against eager steps on the same two ranks agree as on one GPU (1e-5). A worker killed mid-run
ends the streams: the watch thread aborts the NCCL group, whose kernels would wait for it for
good (a collective in a graph has no timeout).
"""

from __future__ import annotations

import asyncio

import pytest

from services.inference.engine.api import AdapterKey, GenerationRequest
from services.inference.engine.config import EngineConfig
from services.inference.engine.engine import Engine
from services.inference.engine.errors import EngineStopped
from services.inference.engine.sampling_params import SamplingParams
from services.inference.engine.tensor_parallel import WorkerDied
from tests.inference.engine_harness import Recorder, make_core, relative_error, run
from tests.inference.models import PARITY_ADAPTERS
from tests.inference.test_engine_parity import _requests, assert_matches_hf, plan_arrivals


def _two_ranks(tiny_models, preset: str, **overrides):
    model_dir = tiny_models.model(preset)
    recorder = Recorder()
    config = dict(device="cuda", dtype="float32", max_num_batched_tokens=48, **overrides)
    core = make_core(model_dir, recorder, tensor_parallel_size=2, **config)
    try:
        for name in PARITY_ADAPTERS:
            core.add_adapter_dir(AdapterKey(name, 1), tiny_models.adapter(preset, name))
        requests = _requests(core.model_config.vocab_size)
        results = run(core, plan_arrivals(requests), recorder, overlap=True)
        records = list(core.step_log.recent)
        core.check_integrity()  # the worker replayed as many graphs as rank 0
        assert core.stats().kv_pages == 0
    finally:
        core.close()
    return model_dir, requests, results, core.runner.graph_steps, records


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2"])
def test_two_gpus_with_graphs_match_hf_peft(tiny_models, preset):
    model_dir, requests, results, graph_steps, records = _two_ranks(tiny_models, preset)
    assert graph_steps > 0
    assert any(r.graph and r.prefill_tokens == 0 for r in records)  # decode graphs
    assert any(r.graph and r.prefill_tokens > 0 and r.tokens > r.prefill_tokens for r in records)
    assert_matches_hf(tiny_models, preset, model_dir, requests, results)


def test_two_gpus_graphs_match_eager_steps(tiny_models):
    graphs = _two_ranks(tiny_models, "tiny-llama")[2]
    _, requests, eager, graph_steps, _ = _two_ranks(tiny_models, "tiny-llama", cuda_graphs=False)
    assert graph_steps == 0
    for req, _ in requests:
        g, e = graphs[req.request_id], eager[req.request_id]
        assert g.token_ids == e.token_ids, req.request_id
        for a, b in zip(g.logits, e.logits, strict=True):
            assert relative_error(a.cpu(), b.cpu().double()) <= 1e-5


async def test_a_killed_worker_ends_the_streams_on_gpus(tiny_models):
    engine = Engine(EngineConfig(
        model_dir=tiny_models.model("tiny-llama"), device="cuda", page_size=4, num_pages=256,
        max_num_seqs=4, max_num_batched_tokens=64, tensor_parallel_size=2,
    ))  # fmt: skip
    await engine.start()
    try:
        long = SamplingParams(max_new_tokens=120, ignore_eos=True)
        stream = engine.generate(GenerationRequest("r", prompt_token_ids=[5, 6, 7], sampling=long))
        assert (await anext(stream)).token_ids
        worker = engine.core.tp.workers[0]
        worker.kill()

        async def drain() -> None:
            async for _ in stream:
                pass

        with pytest.raises(EngineStopped, match="the engine step failed"):
            await asyncio.wait_for(drain(), timeout=60)
        assert not engine.running and isinstance(engine.failure, WorkerDied)
    finally:
        await asyncio.wait_for(engine.stop(), timeout=60)
