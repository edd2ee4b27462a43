"""The unified pool under pressure: preemption and recompute, aborts, adapter eviction and reload.
After every step the pool proves its integrity; at the end every page is free again."""

from __future__ import annotations

import random

import pytest
import torch

from services.inference.engine.adapter_manager import AdapterState
from services.inference.engine.api import AdapterKey, FinishReason, GenerationRequest
from services.inference.engine.request import SequenceStatus
from services.inference.engine.sampling_params import SamplingParams
from tests.inference.engine_harness import Recorder, hf_greedy, make_core, run
from tests.inference.models import AdapterSpec

R4, R8 = AdapterKey("r4", 1), AdapterKey("r8", 1)


def _req(rid, prompt, new, adapter=None):
    return GenerationRequest(
        rid, prompt_token_ids=prompt, adapter=adapter, sampling=SamplingParams(new, ignore_eos=True)
    )


def _forbid_busy_evictions(core) -> list:
    """Fail if an adapter that a queued or running request uses is ever evicted."""
    evicted = []
    evict = core.adapters._evict

    def checked(key):
        entry = core.adapters._entries[key]
        assert entry.refs == 0, f"adapter {key} evicted while {entry.refs} requests use it"
        evicted.append(key)
        evict(key)

    core.adapters._evict = checked
    return evicted


def _check_step(core, step) -> None:
    core.check_integrity()
    for seq in core.scheduler.running:
        if seq.adapter is not None:
            assert core.adapters.state(seq.adapter) is AdapterState.IN_POOL


def _with_adapters(core, tiny_models):
    core.add_adapter_dir(R4, tiny_models.adapter("tiny-llama", "r4"))
    core.add_adapter_dir(R8, tiny_models.adapter("tiny-llama", "r8"))
    return core


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlapped"])
def test_preemption_recomputes_and_matches_hf(tiny_models, overlap):
    model_dir = tiny_models.model("tiny-llama")
    rng = random.Random(7)
    reqs = []
    for i in range(8):
        adapter = (None, R4, R8)[i % 3]
        prompt = [rng.randrange(3, 512) for _ in range(rng.randint(6, 14))]
        reqs.append(_req(f"p{i}", prompt, 18, adapter))
    # 48 pages of 4 tokens: 20 go to the two adapters, the rest cannot hold 8 sequences of
    # ~30 tokens, and max_num_seqs keeps adapter requests queued while others run.
    core = _with_adapters(make_core(model_dir, num_pages=48, max_num_seqs=4), tiny_models)
    _forbid_busy_evictions(core)
    results = run(core, {0: reqs[:5], 3: reqs[5:]}, after_step=_check_step, overlap=overlap)
    stats = core.stats()
    assert stats.preemptions > 0
    assert stats.kv_pages == 0 and stats.num_running == stats.num_waiting == 0
    for req in reqs:
        name = None if req.adapter is None else req.adapter.adapter_id
        adapter_dir = None if name is None else tiny_models.adapter("tiny-llama", name)
        want, _ = hf_greedy(model_dir, adapter_dir, req.prompt_token_ids, 18)
        assert results[req.request_id].token_ids == want, req.request_id
        assert results[req.request_id].finish_reason is FinishReason.LENGTH


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlapped"])
def test_random_aborts_and_preemptions_leave_every_page_free(tiny_models, overlap):
    model_dir = tiny_models.model("tiny-llama")
    core = _with_adapters(
        make_core(model_dir, num_pages=40, max_num_seqs=6, max_num_batched_tokens=24),
        tiny_models,
    )
    _forbid_busy_evictions(core)
    rng = random.Random(3)
    live: list[str] = []
    finished: set[str] = set()
    aborted = 0
    recorder = Recorder()
    inflight = None

    def step_once():  # as the step loop does with overlap: launch k + 1, then finish k
        nonlocal inflight
        if not overlap:
            return core.step()
        launched = core.launch()
        out = [] if inflight is None else core.finish(inflight)
        inflight = launched
        return out

    for step in range(120):
        if step < 80 and rng.random() < 0.5:
            rid = f"q{step}"
            prompt = [rng.randrange(3, 512) for _ in range(rng.randint(1, 30))]
            core.add_request(_req(rid, prompt, rng.randint(1, 20), rng.choice([None, R4, R8])))
            live.append(rid)
        if live and rng.random() < 0.2:
            rid = live.pop(rng.randrange(len(live)))
            out = core.abort(rid)
            if out is not None:  # None: it had already finished
                assert out.finish_reason is FinishReason.ABORT
                recorder.take([out])
                aborted += 1
        assert core.abort("no-such-request") is None
        recorder.take(step_once())
        _check_step(core, step)
        finished |= {r for r, res in recorder.results.items() if res.finish_reason is not None}
        live = [r for r in live if r not in finished]
    while core.has_work or inflight is not None:
        recorder.take(step_once())
        _check_step(core, -1)
    assert aborted > 0 and core.stats().preemptions > 0
    assert all(r.finish_reason is not None for r in recorder.results.values())
    stats = core.stats()
    assert stats.kv_pages == 0
    assert stats.free_pages + stats.adapter_pages == stats.num_pages
    core.remove_adapter(R4)
    core.remove_adapter(R8)
    core.step()  # removal frees the pages at the next step
    assert core.stats().free_pages == core.stats().num_pages
    core.check_integrity()


def test_idle_adapter_evicted_under_kv_pressure_and_reloaded_identically(tiny_models):
    model_dir = tiny_models.model("tiny-llama")
    recorder = Recorder()
    # r8 takes 16 of the 40 pages; the long base request needs 30.
    core = make_core(model_dir, recorder, num_pages=40)
    core.add_adapter_dir(R8, tiny_models.adapter("tiny-llama", "r8"))
    evicted = _forbid_busy_evictions(core)
    prompt = list(range(40, 52))
    first = run(core, {0: [_req("a1", prompt, 8, R8)]}, recorder)["a1"]
    assert core.stats().adapters_in_pool == 1  # idle adapters stay resident
    long = _req("base", list(range(3, 63)), 60)
    run(core, {0: [long]}, recorder, after_step=_check_step)
    assert evicted == [R8] and core.stats().adapters_in_pool == 0
    again = run(core, {0: [_req("a2", prompt, 8, R8)]}, recorder)["a2"]
    assert core.stats().adapter_loads == 2
    assert again.token_ids == first.token_ids
    for a, b in zip(again.logits, first.logits, strict=True):
        assert torch.equal(a, b)
    core.check_integrity()


def test_full_pool_of_queued_adapters_does_not_stall(tiny_models):
    """Adapters loaded for queued requests fill the pool so that the head cannot get KV pages;
    with nothing running, one of them gives way and every request completes."""
    model_dir = tiny_models.model("tiny-llama")
    spec = AdapterSpec(rank=8, target_modules=("q_proj", "k_proj", "v_proj", "o_proj"), seed=99)
    other = tiny_models.adapter("tiny-llama", spec)
    core = make_core(model_dir, num_pages=40)
    core.add_adapter_dir(R8, tiny_models.adapter("tiny-llama", "r8"))
    core.add_adapter_dir(AdapterKey("other", 1), other)
    reqs = [
        _req("x", list(range(3, 23)), 20, R8),  # 40 tokens = 10 pages; 8 free once both load
        _req("y", list(range(5, 15)), 4, AdapterKey("other", 1)),
    ]
    results = run(core, {0: reqs}, after_step=_check_step)
    assert core.stats().adapter_evictions >= 1  # "other" gave way to the head of the queue
    assert {r.finish_reason for r in results.values()} == {FinishReason.LENGTH}
    want, _ = hf_greedy(model_dir, tiny_models.adapter("tiny-llama", "r8"), range(3, 23), 20)
    assert results["x"].token_ids == want
    core.check_integrity()


def test_adapters_waiting_far_back_give_their_pages_to_running_sequences(tiny_models):
    """Adapters loaded for queued requests beyond their tenant's prefetch window give their
    pages up when a running sequence needs KV pages (the one waiting furthest back first),
    instead of the running sequence being preempted; the ones near the head keep theirs, and
    the evicted one is copied in again when its request comes near. One sequence runs at a
    time, with three single requests for three adapters queued behind it (a window of one: all
    three are beyond it); the pool holds the running sequence's pages and the three adapters
    at first, and the sequence grows by as many pages as the last adapter takes."""
    model_dir = tiny_models.model("tiny-llama")
    spec = AdapterSpec(rank=8, target_modules=("q_proj", "k_proj", "v_proj", "o_proj"), seed=98)
    far = AdapterKey("far", 1)
    probe = _with_adapters(make_core(model_dir), tiny_models)
    probe.add_adapter_dir(far, tiny_models.adapter("tiny-llama", spec))
    pages = {k: probe.adapters.pages_of(probe.adapters.get(k)) for k in (R4, R8, far)}
    # The head's 8-token prompt takes 2 pages of 4 and grows to 3 + pages[far]: with the three
    # adapters loaded one page is left free, so its growth needs "far"'s pages.
    prompt, new = list(range(3, 11)), 4 * pages[far] + 4
    num_pages = 3 + sum(pages.values())
    core = make_core(model_dir, num_pages=num_pages, max_num_seqs=1, max_num_batched_tokens=64)
    _with_adapters(core, tiny_models)
    core.add_adapter_dir(far, tiny_models.adapter("tiny-llama", spec))
    core.scheduler.prefetch_window = 1
    core.scheduler.far_margin = 0  # the queued adapters load at once into the empty pool
    evicted = []
    evict = core.adapters._evict
    core.adapters._evict = lambda key: (evicted.append(key), evict(key))
    reqs = [
        _req("head", prompt, new),
        _req("b", list(range(5, 13)), 4, R4),
        _req("c", list(range(6, 14)), 4, R8),
        _req("d", list(range(7, 15)), 4, far),
    ]

    def loaded_at_first(core, step):
        _check_step(core, step)
        if step == 1:  # the three adapters loaded for their queued requests
            assert {core.adapters.state(k) for k in (R4, R8, far)} == {AdapterState.IN_POOL}

    results = run(core, {0: reqs}, after_step=loaded_at_first)
    stats = core.stats()
    assert stats.preemptions == 0
    assert evicted == [far]  # the furthest back gave way, the others kept their pages
    assert stats.adapter_evictions_queued == 1
    assert stats.adapter_loads == 4  # "far" was copied in again for its request
    dirs = {
        None: None,
        R4: tiny_models.adapter("tiny-llama", "r4"),
        R8: tiny_models.adapter("tiny-llama", "r8"),
        far: tiny_models.adapter("tiny-llama", spec),
    }
    for r in reqs:
        want, _ = hf_greedy(
            model_dir, dirs[r.adapter], r.prompt_token_ids, r.sampling.max_new_tokens
        )
        assert results[r.request_id].token_ids == want
    core.check_integrity()
    assert stats.kv_pages == 0 and stats.free_pages + stats.adapter_pages == stats.num_pages


def test_abort_frees_pages_at_once(tiny_models):
    core = make_core(tiny_models.model("tiny-llama"))
    core.add_request(_req("a", list(range(3, 40)), 50))
    core.step()
    assert core.stats().kv_pages == 10  # 37 prompt tokens + the first generated one, pages of 4
    out = core.abort("a")
    assert out.finish_reason is FinishReason.ABORT and out.completion_tokens == 1
    assert core.stats().kv_pages == 0 and not core.has_work
    assert core.abort("a") is None
    core.check_integrity()


@pytest.mark.parametrize("where", ["queued", "prefilling"])
def test_abort_before_or_during_prefill(tiny_models, where):
    core = make_core(tiny_models.model("tiny-llama"), max_num_batched_tokens=16)
    core.add_request(_req("a", list(range(3, 60)), 4))
    if where == "prefilling":
        core.step()  # 16 of 57 prompt tokens
        seq = core.scheduler.running[0]
        assert seq.status is SequenceStatus.RUNNING and seq.num_computed == 16
    out = core.abort("a")
    assert out.finish_reason is FinishReason.ABORT and out.completion_tokens == 0
    assert core.stats().kv_pages == 0 and not core.has_work


@pytest.mark.parametrize("reserve", [True, False])
def test_admission_leaves_a_page_for_each_running_sequence(tiny_models, reserve):
    """A queued sequence joins only if its pages leave one free for each running sequence's
    decode growth (scheduler step 3). Two 60-token prompts of 20 new tokens each end on 5 of the
    pool's 10 pages of 16 tokens; a third prompt of 20 tokens would take the last 2 free pages,
    and the first running sequence's 65th token then a preemption (the newest, for recompute).
    With the reserve it waits for the others to finish, and nothing is preempted; without it
    (Scheduler.decode_reserve off) it joins at once and is preempted. Both runs produce the same
    tokens, HF's."""
    core = make_core(tiny_models.model("tiny-llama"), page_size=16, num_pages=10, max_num_seqs=4,
                     max_num_batched_tokens=256)  # fmt: skip
    core.scheduler.decode_reserve = reserve
    reqs = [_req("a", list(range(3, 63)), 20), _req("b", list(range(5, 65)), 20),
            _req("c", list(range(7, 27)), 20)]  # fmt: skip
    recorder = Recorder()
    results = run(core, {0: reqs}, recorder)
    assert (core.stats().preemptions == 0) == reserve
    assert all(len(results[r.request_id].token_ids) == 20 for r in reqs)
    model = tiny_models.model("tiny-llama")
    for r in reqs:
        assert results[r.request_id].token_ids == hf_greedy(model, None, r.prompt_token_ids, 20)[0]
    assert core.stats().free_pages == core.stats().num_pages
