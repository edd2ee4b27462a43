"""Tensor parallelism on the CPU: two ranks over gloo (rank 0 in this process, one worker).

Token for token against transformers + peft, as test_engine_parity.py is for one rank: the base
model and four adapters mixed in steps, prefill chunks beside decodes; then preemption in a
small pool, aborts and adapter evictions with every rank's pool checked; then a worker killed
mid-run, which fails the step and stops the engine.
"""

from __future__ import annotations

import asyncio
import shutil

import pytest
import torch

from services.inference.arena import HostArena
from services.inference.engine.api import AdapterKey, GenerationRequest
from services.inference.engine.config import EngineConfig
from services.inference.engine.core import EngineCore
from services.inference.engine.engine import Engine
from services.inference.engine.errors import EngineStopped, ModelLoadError
from services.inference.engine.model_runner import ATTENTION, NO_GRAPH, GraphKey, LoraMode
from services.inference.engine.sampling_params import SamplingParams
from services.inference.engine.tensor_parallel import HEADER, WorkerDied
from tests.inference.engine_harness import Recorder, make_core, run
from tests.inference.models import PARITY_ADAPTERS
from tests.inference.test_engine_parity import _requests, assert_matches_hf, plan_arrivals


@pytest.fixture
def tp_core(tiny_models):
    cores = []

    def make(preset="tiny-llama", recorder=None, **overrides):
        core = make_core(tiny_models.model(preset), recorder, tensor_parallel_size=2, **overrides)
        cores.append(core)
        return core

    yield make
    for core in cores:
        core.close()


@pytest.mark.parametrize(
    "preset, side_stream",
    [("tiny-llama", False), ("tiny-qwen2", False), ("tiny-llama", True)],
    ids=["tiny-llama", "tiny-qwen2", "tiny-llama-lora-beside"],
)
def test_two_ranks_match_hf_peft(tiny_models, tp_core, preset, side_stream):
    """``side_stream``: every rank's small steps' LoRA deltas go through its delta buffer (the
    worker takes the engine's lora_side_stream), the row-split o and down ones into the partial
    sums."""
    model_dir = tiny_models.model(preset)
    recorder = Recorder()
    core = tp_core(preset, recorder, max_num_batched_tokens=48, lora_side_stream=side_stream)
    assert core.pool.width == core.model_config.kv_dim // 2  # each rank holds its kv heads
    for name in PARITY_ADAPTERS:
        core.add_adapter_dir(AdapterKey(name, 1), tiny_models.adapter(preset, name))
    requests = _requests(core.model_config.vocab_size)
    results = run(core, plan_arrivals(requests), recorder, overlap=True)
    assert_matches_hf(tiny_models, preset, model_dir, requests, results)
    core.check_integrity()
    assert core.stats().kv_pages == 0


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2"])
def test_two_ranks_with_the_addend_match_hf_peft(tiny_models, tp_core, preset):
    """lora_addend under tensor parallelism: prefill-sized steps (over 512 tokens: a long
    prompt beside short ones, adapters within 16 rank rows in an engine sized for 64, so NARROW)
    write every rank's deltas first, the column-split q/k/v's and the row-split o's partial
    ones alike, and each rank's GEMM adds onto them before o and down are summed. Token for
    token against HF + PEFT, every rank's pool intact."""
    model_dir = tiny_models.model(preset)
    recorder = Recorder()
    core = tp_core(preset, recorder, max_num_batched_tokens=640, max_lora_rank=64,
                   lora_addend=True)  # fmt: skip
    for name in ("r4", "r8", "r16"):
        core.add_adapter_dir(AdapterKey(name, 1), tiny_models.adapter(preset, name))
    gen = torch.Generator().manual_seed(5)
    vocab = core.model_config.vocab_size
    plan = [("r8", 540, 4), ("r4", 20, 5), (None, 30, 4), ("r16", 12, 5), ("r8", 9, 3)]
    requests = []
    for i, (name, length, new) in enumerate(plan):
        req = GenerationRequest(
            request_id=f"long{i}-{name or 'base'}",
            prompt_token_ids=torch.randint(3, vocab, (length,), generator=gen).tolist(),
            adapter=None if name is None else AdapterKey(name, 1),
            sampling=SamplingParams(max_new_tokens=new, ignore_eos=True),
        )
        requests.append((req, name))
    modes = []
    lora_for = core.runner._lora_for

    def spy(mode, modules):
        lora = lora_for(mode, modules)
        modes.append((mode, lora is not None and lora.addend))
        return lora

    core.runner._lora_for = spy
    results = run(core, {0: [r for r, _ in requests]}, recorder)
    assert (LoraMode.NARROW, True) in modes
    assert_matches_hf(tiny_models, preset, model_dir, requests, results)
    core.check_integrity()
    assert core.stats().kv_pages == 0


def test_workers_read_adapters_where_they_lie_in_the_shared_arena(tiny_models):
    """Adapter bytes in the engine's host arena (a memfd the workers map, as the engine process
    has it) are named by their offset, not sent: the same tokens as HF + PEFT, no bytes sent."""
    preset = "tiny-llama"
    host = HostArena(64 << 20, pin=False)
    recorder = Recorder()
    config = EngineConfig(model_dir=tiny_models.model(preset), device="cpu", page_size=4,
                          num_pages=1024, max_num_seqs=16, max_loras=8,
                          max_num_batched_tokens=48, tensor_parallel_size=2)  # fmt: skip
    core = EngineCore(config, recorder.hook, host.shared)
    try:
        for name in PARITY_ADAPTERS:
            path = tiny_models.adapter(preset, name)
            body = (path / "adapter_model.safetensors").read_bytes()
            block = host.alloc(len(body))
            view = host.buffer[block.offset : block.offset + len(body)]
            view.copy_(torch.frombuffer(bytearray(body), dtype=torch.uint8))
            core.add_adapter(AdapterKey(name, 1), (path / "adapter_config.json").read_bytes(), view)
        requests = _requests(core.model_config.vocab_size)
        results = run(core, plan_arrivals(requests), recorder, overlap=True)
        assert core.tp.shared_loads == len(PARITY_ADAPTERS) and core.tp.sent_loads == 0
        core.check_integrity()
    finally:
        core.close()
    assert_matches_hf(tiny_models, preset, tiny_models.model(preset), requests, results)


R4, R8, R16 = AdapterKey("r4", 1), AdapterKey("r8", 1), AdapterKey("r16", 1)


def _pressure_run(core, tiny_models, check: bool) -> dict:
    """Ten requests over three adapters and the base model in a pool too small for them, two
    index rows for three adapters (evictions), two aborts; every rank's pool checked per step."""
    for key in (R4, R8, R16):
        core.add_adapter_dir(key, tiny_models.adapter("tiny-llama", key.adapter_id))
    gen = torch.Generator().manual_seed(5)
    arrivals: dict[int, list[GenerationRequest]] = {}
    for i in range(10):
        prompt = torch.randint(3, 512, (int(torch.randint(8, 20, (1,), generator=gen)),),
                               generator=gen).tolist()  # fmt: skip
        req = GenerationRequest(
            f"p{i}", prompt_token_ids=prompt, adapter=(None, R4, R8, R16)[i % 4],
            sampling=SamplingParams(max_new_tokens=24, ignore_eos=True),
        )  # fmt: skip
        arrivals.setdefault(0 if i < 6 else 3, []).append(req)
    recorder = Recorder()

    def after(core, step):
        if step in (4, 7):  # one running, one waiting or running
            out = core.abort(f"p{step - 3}")
            if out is not None:
                recorder.take([out])
        if check:
            core.check_integrity()

    results = run(core, arrivals, recorder, after_step=after, overlap=True)
    stats = core.stats()
    assert stats.kv_pages == 0 and stats.num_running == stats.num_waiting == 0
    return {rid: (r.token_ids, r.finish_reason) for rid, r in results.items()}, stats


def test_preemption_aborts_and_evictions_stay_in_step(tiny_models, tp_core):
    small = dict(num_pages=64, max_num_seqs=4, max_loras=2)
    want, _ = _pressure_run(make_core(tiny_models.model("tiny-llama"), **small), tiny_models, False)
    got, stats = _pressure_run(tp_core(**small), tiny_models, True)
    assert stats.preemptions > 0 and stats.adapter_evictions > 0
    assert got == want  # the same tokens and finish reasons as one rank (itself HF's)


def test_random_weights_shard_alike_on_every_rank(tiny_models, tmp_path):
    """--load-format random on a directory without weights: each rank (the worker too) draws
    its slice of the same model, so two ranks give one rank's tokens and finish reasons."""
    model_dir = tmp_path / "config_only"
    shutil.copytree(tiny_models.model("tiny-llama"), model_dir)
    (model_dir / "model.safetensors").unlink()
    small = dict(num_pages=64, max_num_seqs=4, max_loras=2, load_format="random")
    want, _ = _pressure_run(make_core(model_dir, **small), tiny_models, False)
    core = make_core(model_dir, tensor_parallel_size=2, **small)
    try:
        got, _ = _pressure_run(core, tiny_models, True)
    finally:
        core.close()
    assert got == want


def test_a_worker_out_of_step_is_found(tiny_models, tp_core):
    core = tp_core()
    core.add_adapter_dir(R4, tiny_models.adapter("tiny-llama", "r4"))
    req = GenerationRequest("r", prompt_token_ids=[5, 6, 7], adapter=R4,
                            sampling=SamplingParams(max_new_tokens=2, ignore_eos=True))  # fmt: skip
    run(core, {0: [req]})
    core.check_integrity()
    core.adapters.index.scales[core.adapters.row(R4), 0] += 1.0  # rank 0's row, not the worker's
    with pytest.raises(AssertionError, match=r"ranks \[1\] are out of step"):
        core.check_integrity()


def test_graph_keys_cross_in_the_step_header():
    """The graph rank 0 replays reaches the workers as four header fields, each key whole."""
    keys = [
        GraphKey(tokens, seqs, mode, modules)
        for tokens, seqs in ((16, 16), (2048, 512))
        for mode in LoraMode
        for modules in (None, ATTENTION, 0)
    ]
    for key in keys:
        fields = key.encode()
        assert len(fields) == 4 and all(isinstance(f, int) for f in fields)
        assert GraphKey.decode(fields) == key
    assert GraphKey.decode(NO_GRAPH) is None
    assert 1 + 5 + 2 + len(NO_GRAPH) <= HEADER  # STEP, the batch's counts, StepLora, the key


def test_ranks_that_would_capture_other_graphs_fail_the_start(tiny_models, monkeypatch):
    """Every rank lists the graphs it would capture before any capture (on the CPU too):
    rank 0's list changed here alone, so the worker's differs, and the start fails at once
    rather than pair one rank's captured collectives with another's."""
    from services.inference.engine.model_runner import ModelRunner

    every = ModelRunner.graph_keys

    def fewer(runner, decode, mixed):
        return every(runner, decode[:-1], mixed)

    monkeypatch.setattr(ModelRunner, "graph_keys", fewer, raising=True)
    with pytest.raises(ModelLoadError, match=r"ranks \[1\] would capture other CUDA graphs"):
        make_core(tiny_models.model("tiny-llama"), tensor_parallel_size=2)


def test_a_model_that_does_not_split_is_refused(tiny_models):
    with pytest.raises(ModelLoadError, match="must divide the model's num_kv_heads"):
        make_core(tiny_models.model("tiny-llama"), tensor_parallel_size=4)
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        EngineConfig(model_dir="m", tensor_parallel_size=0)


def _two_rank_engine(tiny_models) -> Engine:
    return Engine(EngineConfig(
        model_dir=tiny_models.model("tiny-llama"), device="cpu", page_size=4, num_pages=256,
        max_num_seqs=4, tensor_parallel_size=2,
    ))  # fmt: skip


async def test_a_killed_worker_ends_the_streams_and_stops_the_engine(tiny_models):
    engine = _two_rank_engine(tiny_models)
    await engine.start()
    try:
        long = SamplingParams(max_new_tokens=10_000 // 100, ignore_eos=True)
        stream = engine.generate(GenerationRequest("r", prompt_token_ids=[5, 6, 7], sampling=long))
        assert (await anext(stream)).token_ids
        worker = engine.core.tp.workers[0]
        worker.kill()
        with pytest.raises(EngineStopped, match="the engine step failed"):
            async for _ in stream:
                pass
        assert not engine.running and isinstance(engine.failure, WorkerDied)
        assert worker.wait(timeout=10) is not None
    finally:
        await engine.stop()


async def test_a_worker_that_dies_while_the_engine_is_idle_stops_it(tiny_models):
    """No step runs, so no collective fails: the step loop's own look at the workers (each
    turn, every 0.5 s while idle) finds it, and the engine stops for its supervisor."""
    engine = _two_rank_engine(tiny_models)
    await engine.start()
    try:
        worker = engine.core.tp.workers[0]
        worker.kill()
        worker.wait(timeout=10)
        for _ in range(100):
            if not engine.running:
                break
            await asyncio.sleep(0.05)
        assert not engine.running and isinstance(engine.failure, WorkerDied)
        assert "tensor-parallel workers exited" in str(engine.failure)
        late = SamplingParams(max_new_tokens=3)
        stream = engine.generate(GenerationRequest("late", prompt_token_ids=[5], sampling=late))
        with pytest.raises(EngineStopped):
            await anext(stream)
    finally:
        await engine.stop()
