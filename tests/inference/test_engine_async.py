"""The asynchronous API: streaming, concurrency, abort, stop conditions and errors."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil

import numpy as np
import pytest

from services.inference.engine import adapter_copy
from services.inference.engine.api import AdapterKey, FinishReason, GenerationRequest
from services.inference.engine.config import EngineConfig
from services.inference.engine.engine import PRELOAD_FREE_SHARE, Engine
from services.inference.engine.errors import (
    AdapterLoadFailed,
    DuplicateRequest,
    EngineOverloaded,
    EngineStopped,
    InvalidRequest,
    PoolBusy,
    UnknownAdapter,
)
from services.inference.engine.sampling_params import SamplingParams
from tests.inference.engine_harness import hf_greedy

R8 = AdapterKey("r8", 1)


@pytest.fixture
async def engine(tiny_models):
    eng = Engine(
        EngineConfig(
            model_dir=tiny_models.model("tiny-llama"), device="cpu", page_size=4,
            num_pages=512, max_model_len=128, max_queue=8,
        )
    )  # fmt: skip
    eng.add_adapter_dir(R8, tiny_models.adapter("tiny-llama", "r8"))
    await eng.start()
    yield eng
    await eng.stop()


async def collect(engine, request):
    return [out async for out in engine.generate(request)]


def greedy(rid, prompt, new, adapter=None, **kw):
    return GenerationRequest(
        rid, prompt_token_ids=prompt, adapter=adapter,
        sampling=SamplingParams(max_new_tokens=new, ignore_eos=True, **kw),
    )  # fmt: skip


async def wait_idle(engine):
    for _ in range(200):
        s = engine.stats()
        if s.num_running == 0 and s.num_waiting == 0 and s.kv_pages == 0:
            return s
        await asyncio.sleep(0.01)
    raise AssertionError(f"engine did not go idle: {engine.stats()}")


async def test_streams_tokens_and_text(engine, tiny_models):
    req = GenerationRequest(
        "t", prompt="The harbour was quiet", sampling=SamplingParams(12, ignore_eos=True)
    )
    outs = await collect(engine, req)
    assert len(outs) == 12 and all(len(o.token_ids) == 1 for o in outs)
    assert [o.finish_reason for o in outs] == [None] * 11 + [FinishReason.LENGTH]
    assert [o.completion_tokens for o in outs] == list(range(1, 13))
    ids = [t for o in outs for t in o.token_ids]
    prompt_ids = engine.tokenizer.encode("The harbour was quiet")
    assert outs[-1].prompt_tokens == len(prompt_ids)
    want, _ = hf_greedy(tiny_models.model("tiny-llama"), None, prompt_ids, 12)
    assert ids == want
    assert "".join(o.text for o in outs) == engine.tokenizer.decode(ids)


async def test_concurrent_streams_mix_adapters(engine, tiny_models):
    model_dir = tiny_models.model("tiny-llama")
    reqs = [
        greedy(f"c{i}", list(range(3 + i, 10 + 2 * i)), 6 + i % 3, R8 if i % 2 else None)
        for i in range(6)
    ]
    results = await asyncio.gather(*(collect(engine, r) for r in reqs))
    for req, outs in zip(reqs, results, strict=True):
        adapter_dir = tiny_models.adapter("tiny-llama", "r8") if req.adapter else None
        want, _ = hf_greedy(model_dir, adapter_dir, req.prompt_token_ids, len(outs))
        assert [t for o in outs for t in o.token_ids] == want
    assert engine.stats().steps < sum(r.sampling.max_new_tokens for r in reqs)  # batched
    await wait_idle(engine)


async def test_abort_ends_the_stream_and_frees_pages(engine):
    outs = []
    async for out in engine.generate(greedy("a", list(range(3, 30)), 100)):
        outs.append(out)
        if len(outs) == 3:
            engine.abort("a")
    assert outs[-1].finish_reason is FinishReason.ABORT
    assert 3 <= outs[-1].completion_tokens < 100
    engine.core.check_integrity()
    await wait_idle(engine)


async def test_leaving_the_stream_aborts_the_request(engine):
    async with contextlib.aclosing(engine.generate(greedy("b", list(range(3, 30)), 100))) as gen:
        async for _ in gen:
            break
    await wait_idle(engine)

    async def consume():
        async for _ in engine.generate(greedy("c", list(range(3, 30)), 100)):
            pass

    task = asyncio.create_task(consume())
    while engine.stats().num_running == 0:
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_idle(engine)
    engine.core.check_integrity()


async def test_bad_requests_fail_before_queueing(engine):
    async def fails(exc, req, match):
        with pytest.raises(exc, match=match):
            await collect(engine, req)

    await fails(
        InvalidRequest, greedy("x", list(range(3, 123)), 10), "exceed the context window of 128"
    )
    await fails(
        InvalidRequest,
        greedy("x", [5, 512, 7], 4),
        r"prompt token 1 is 512, outside the vocabulary \[0, 512\)",
    )
    await fails(InvalidRequest, greedy("x", [5, -1], 4), "prompt token 1 is -1")
    await fails(InvalidRequest, greedy("x", [5, 6.0], 4), "prompt token 1 is 6.0")
    await fails(InvalidRequest, GenerationRequest("x", prompt_token_ids=[]), "prompt is empty")
    await fails(UnknownAdapter, greedy("x", [5, 6], 4, AdapterKey("nope", 3)), "nope")
    stats = engine.stats()
    assert stats.num_waiting == stats.num_running == 0 and not engine.core._live

    numpy_ids = await collect(engine, greedy("np", np.arange(5, 9), 2))  # numpy ints are fine
    assert numpy_ids[-1].finish_reason is FinishReason.LENGTH

    assert not engine.request_in_use("dup")
    first = engine.generate(greedy("dup", list(range(3, 20)), 50))
    assert (await anext(first)).finish_reason is None
    assert engine.request_in_use("dup")  # what the service asks before it names a call
    await fails(DuplicateRequest, greedy("dup", [5, 6], 4), "already in flight")
    await first.aclose()
    await wait_idle(engine)
    assert not engine.request_in_use("dup")


async def test_full_queue_is_refused(engine):
    streams = [engine.generate(greedy(f"q{i}", list(range(3, 20)), 60)) for i in range(8)]
    for s in streams:
        await anext(s)
    with pytest.raises(EngineOverloaded, match="max_queue 8"):
        await collect(engine, greedy("q8", [5, 6], 4))
    for s in streams:
        await s.aclose()
    await wait_idle(engine)


async def test_stop_strings_and_stop_token_ids(engine):
    prompt = list(range(40, 52))
    base = await collect(engine, greedy("s0", prompt, 16))
    ids = [t for o in base for t in o.token_ids]
    text = "".join(o.text for o in base)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    outs = await collect(engine, greedy("s1", prompt, 16, stop=(stop,)))
    assert outs[-1].finish_reason is FinishReason.STOP
    assert "".join(o.text for o in outs) == text[: text.index(stop)]

    stop_id = ids[5]
    outs = await collect(engine, greedy("s2", prompt, 16, stop_token_ids=(stop_id,)))
    got = [t for o in outs for t in o.token_ids]
    assert outs[-1].finish_reason is FinishReason.STOP
    assert got == ids[: ids.index(stop_id) + 1]  # the stop token is reported, not its text


async def test_eos_ends_generation_unless_ignored(tiny_models, tmp_path):
    src = tiny_models.model("tiny-llama")
    prompt = list(range(40, 52))
    want, _ = hf_greedy(src, None, prompt, 10)
    model_dir = tmp_path / "model"
    shutil.copytree(src, model_dir)
    gen_cfg = json.loads((model_dir / "generation_config.json").read_text())
    eos_id = want[4]  # make the model's 5th greedy token an end-of-sequence token
    gen_cfg["eos_token_id"] = [gen_cfg["eos_token_id"], eos_id]
    (model_dir / "generation_config.json").write_text(json.dumps(gen_cfg))
    engine = Engine(EngineConfig(model_dir=model_dir, device="cpu", num_pages=64))
    await engine.start()
    try:
        req = GenerationRequest("e", prompt_token_ids=prompt, sampling=SamplingParams(10))
        outs = await collect(engine, req)
        assert outs[-1].finish_reason is FinishReason.EOS
        assert [t for o in outs for t in o.token_ids] == want[: want.index(eos_id) + 1]
        outs = await collect(engine, greedy("f", prompt, 10))
        assert outs[-1].finish_reason is FinishReason.LENGTH and outs[-1].completion_tokens == 10
    finally:
        await engine.stop()


async def test_removing_an_adapter_while_requests_run(engine, tiny_models):
    """remove_adapter wakes the step loop while steps run: the streams go on (one for the
    removed adapter included, which keeps it until it ends), and the adapter is gone after."""
    other = AdapterKey("other", 1)
    engine.add_adapter_dir(other, tiny_models.adapter("tiny-llama", "r8"))
    tuned = asyncio.create_task(collect(engine, greedy("t", [3, 5, 7], 40, adapter=other)))
    gen = engine.generate(greedy("base", [3, 5, 7], 40))
    await anext(gen)
    engine.remove_adapter(other)
    rest = [out async for out in gen]
    assert rest[-1].finish_reason is FinishReason.LENGTH and rest[-1].completion_tokens == 40
    outs = await tuned
    assert outs[-1].finish_reason is FinishReason.LENGTH and outs[-1].completion_tokens == 40
    await wait_idle(engine)
    assert engine.running and engine.failure is None
    assert engine.adapter_status(other) is None


async def test_stop_ends_streams_and_refuses_new_requests(engine):
    gen = engine.generate(greedy("long", list(range(3, 30)), 100))
    await anext(gen)
    await engine.stop()
    with pytest.raises(EngineStopped):
        async for _ in gen:
            pass
    assert engine.stats().kv_pages == 0 and engine.failure is None
    with pytest.raises(EngineStopped, match="not running"):
        await collect(engine, greedy("late", [5, 6], 2))


async def test_step_failure_reaches_the_caller(engine):
    def broken(during=None):
        raise RuntimeError("device lost")

    engine.core.launch = broken
    with pytest.raises(EngineStopped, match="step failed") as info:
        await collect(engine, greedy("z", [5, 6, 7], 4))
    assert isinstance(info.value.__cause__, RuntimeError)


def test_commands_during_a_step_hold_aborts(tiny_models):
    """While a step's batch is on the GPU the loop holds aborts, which would free pages the step
    still uses, and the new requests behind them (an abort may free the queue slot a request
    needs); both are applied between steps, in order, before the next step is scheduled."""
    from services.inference.engine.engine import Abort, Enqueue, Phase

    engine = Engine(
        EngineConfig(model_dir=tiny_models.model("tiny-llama"), device="cpu", num_pages=64)
    )
    core = engine.core
    first, second = (
        core.prepare(GenerationRequest(rid, prompt_token_ids=[3, 5])) for rid in ("a", "b")
    )
    for cmd in (Enqueue(first), Abort("a"), Enqueue(second)):
        engine._inbox.put(cmd)
    engine._drain(timeout=None, phase=Phase.DURING)
    assert list(core.scheduler.waiting) == [first]  # "b" waits behind the abort
    engine._drain(timeout=None, phase=Phase.DURING)  # still held
    assert list(core.scheduler.waiting) == [first]
    engine._drain(timeout=None, phase=Phase.BETWEEN)  # between steps: the abort, then "b"
    assert list(core.scheduler.waiting) == [second]
    assert first.finish_reason is FinishReason.ABORT


def test_a_command_that_raises_loses_none_held_behind_it(tiny_models, monkeypatch):
    """If applying a held command raises, the commands held behind it stay held for the next
    drain (a LoadAdapter dropped there would never be answered)."""
    from services.inference.engine.engine import Abort, Load, Phase

    engine = Engine(
        EngineConfig(model_dir=tiny_models.model("tiny-llama"), device="cpu", num_pages=64)
    )
    load = Load(R8, lambda error: None)
    for cmd in (Abort("zz"), load):
        engine._inbox.put(cmd)
    engine._drain(timeout=None, phase=Phase.DURING)  # the abort is held; the load applies
    assert list(engine._held) == [Abort("zz")] and engine._loads == [load]
    later = Load(AdapterKey("t", 2), lambda error: None)
    engine._inbox.put(later)
    engine._drain(timeout=None, phase=Phase.BETWEEN)  # the abort applies; the load is held
    assert list(engine._held) == [later]
    engine._held.appendleft(Abort("boom"))

    def broken(request_id):
        raise RuntimeError("abort failed")

    monkeypatch.setattr(engine.core, "abort", broken)
    with pytest.raises(RuntimeError, match="abort failed"):
        engine._drain(timeout=None, phase=Phase.BETWEEN)
    assert list(engine._held) == [later]


def test_adapter_commands_between_steps_wait_for_the_next_step(tiny_models):
    """Between steps (the GPU idle) the loop applies new requests and aborts; adapter work waits
    for the next step's drain, while the GPU computes. A request for the adapter a held load
    names does not wait for the load (it would load the adapter itself); a later load of that
    adapter does, and so do the requests and aborts behind a held request they name."""
    from services.inference.engine.engine import Abort, Enqueue, Load, Phase

    engine = Engine(
        EngineConfig(model_dir=tiny_models.model("tiny-llama"), device="cpu", num_pages=64)
    )
    engine.add_adapter_dir(R8, tiny_models.adapter("tiny-llama", "r8"))
    core = engine.core
    base, tuned, other = (
        core.prepare(GenerationRequest(rid, prompt_token_ids=[3, 5], adapter=adapter))
        for rid, adapter in (("a", None), ("t", R8), ("c", None))
    )
    load, again = (Load(R8, lambda error: None) for _ in range(2))
    for cmd in (Enqueue(base), Abort("zz"), load, Enqueue(tuned), again, Enqueue(other)):
        engine._inbox.put(cmd)
    engine._drain(timeout=None, phase=Phase.BETWEEN)
    # the loads wait; the request for their adapter does not
    assert list(core.scheduler.waiting) == [base, tuned, other] and engine._loads == []
    engine._drain(timeout=None, phase=Phase.BETWEEN)  # still held
    assert engine._loads == []
    engine._inbox.put(Abort("c"))  # during a step an abort waits
    engine._inbox.put(Abort("t"))
    engine._drain(timeout=None, phase=Phase.DURING)  # the loads, in order; the aborts wait
    assert engine._loads == [load, again]
    assert list(core.scheduler.waiting) == [base, tuned, other]
    # During a step a request waits behind a held abort, and a load of its adapter behind it.
    late = core.prepare(GenerationRequest("d", prompt_token_ids=[3], adapter=R8))
    third = Load(R8, lambda error: None)
    engine._inbox.put(Enqueue(late))
    engine._inbox.put(third)
    engine._drain(timeout=None, phase=Phase.DURING)
    assert list(core.scheduler.waiting) == [base, tuned, other]
    assert engine._loads == [load, again]
    # When no step runs (idle, stalled, stopping) a drain takes every command, held ones first.
    engine._inbox.put(Load(AdapterKey("t", 2), lambda error: None))
    engine._drain(timeout=None)
    assert engine._loads[:3] == [load, again, third] and len(engine._loads) == 4
    assert list(core.scheduler.waiting) == [base, late]
    assert tuned.finish_reason is other.finish_reason is FinishReason.ABORT


async def test_a_failed_copy_is_not_tried_again_before_its_callers_are_answered(
    engine, monkeypatch
):
    """On an idle engine a LoadAdapter's failed copy is answered with AdapterLoadFailed, once:
    the loop does not start the copy again before it has reported the failure."""
    calls = []

    def failing(*args):
        calls.append(args)
        raise RuntimeError("device ran out of memory")

    monkeypatch.setattr(adapter_copy, "write_adapter", failing)
    with pytest.raises(AdapterLoadFailed, match="r8.*could not be copied"):
        await engine.load_adapter(R8)
    assert len(calls) == 1
    engine.core.check_integrity()


async def test_a_failed_adapter_copy_ends_its_requests_and_the_engine_keeps_serving(
    engine, monkeypatch, tiny_models
):
    """A copy into the pool that fails (here: the CPU write raises) ends the requests and the
    LoadAdapter call waiting for that adapter with AdapterLoadFailed; its pages and index row go
    back, other requests and resident adapters are untouched (nothing is evicted to make room
    for a copy that failed), and a later request for the adapter copies it again."""
    real = adapter_copy.write_adapter
    calls = []

    def failing(*args):
        calls.append(args)
        raise RuntimeError("device ran out of memory")

    resident = AdapterKey("r16", 1)
    engine.add_adapter_dir(resident, tiny_models.adapter("tiny-llama", "r16"))
    await engine.load_adapter(resident)
    monkeypatch.setattr(adapter_copy, "write_adapter", failing)
    with pytest.raises(AdapterLoadFailed, match="r8.*could not be copied.*ran out of memory"):
        await collect(engine, greedy("alone", [5, 6, 7], 4, adapter=R8))  # nothing else runs
    assert engine.adapter_in_pool(resident) and engine.core.adapters.evictions == 0
    base = asyncio.create_task(collect(engine, greedy("base", [5, 6, 7], 12)))
    with pytest.raises(AdapterLoadFailed, match="r8.*could not be copied.*ran out of memory"):
        await collect(engine, greedy("x", [5, 6, 7], 4, adapter=R8))
    with pytest.raises(AdapterLoadFailed, match="could not be copied"):
        await engine.load_adapter(R8)
    assert len(calls) == 3  # one attempt each, no retry loop
    assert [o.finish_reason for o in await base][-1] is FinishReason.LENGTH
    stats = await wait_idle(engine)
    assert stats.adapter_pages == engine.core.adapters.pages_of(engine.core.adapters.get(resident))
    assert not engine.adapter_in_pool(R8)
    engine.core.check_integrity()

    monkeypatch.setattr(adapter_copy, "write_adapter", real)
    outs = await collect(engine, greedy("y", [5, 6, 7], 4, adapter=R8))
    assert outs[-1].finish_reason is FinishReason.LENGTH and engine.adapter_in_pool(R8)
    assert engine.stats().adapter_loads == 2  # copies completed: r16's and this one


async def test_a_preload_takes_free_pool_room_only(tiny_models):
    """load_adapter(if_free=True) copies an adapter into free pages and a free index row only,
    leaving PRELOAD_FREE_SHARE of the pool's pages free; without such room it raises PoolBusy
    and evicts nothing, where a LoadAdapter (if_free=False) evicts the least recently used."""
    eng = Engine(
        EngineConfig(
            model_dir=tiny_models.model("tiny-llama"), device="cpu", page_size=4,
            num_pages=512, max_model_len=128, max_queue=8, max_loras=2,
        )
    )  # fmt: skip
    keys = [AdapterKey(name, 1) for name in ("r4", "r8", "r16")]
    for key in keys:
        eng.add_adapter_dir(key, tiny_models.adapter("tiny-llama", key.adapter_id))
    await eng.start()
    try:
        assert eng._preload_reserve == int(512 * PRELOAD_FREE_SHARE)
        for key in keys[:2]:
            await eng.load_adapter(key, if_free=True)
            assert eng.adapter_in_pool(key)
        with pytest.raises(PoolBusy, match="no free room in the page pool for adapter.*r16"):
            await eng.load_adapter(keys[2], if_free=True)  # both index rows are taken
        assert all(eng.adapter_in_pool(k) for k in keys[:2]) and eng.core.adapters.evictions == 0
        await eng.load_adapter(keys[2])  # a LoadAdapter evicts the least recently used
        assert eng.adapter_in_pool(keys[2]) and not eng.adapter_in_pool(keys[0])
        eng._preload_reserve = eng.core.pool.num_free  # the free pages are the KV cache's
        with pytest.raises(PoolBusy):
            await eng.load_adapter(keys[0], if_free=True)
        assert eng.core.adapters.evictions == 1 and not eng.adapter_in_pool(keys[0])
        outs = await collect(eng, greedy("after", [5, 6, 7], 4, adapter=keys[1]))
        assert outs[-1].finish_reason is FinishReason.LENGTH
        eng.core.check_integrity()
    finally:
        await eng.stop()
