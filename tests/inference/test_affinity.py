"""Adapter affinity in admission (engine/affinity.py): the order on its own, inside the fairness
policies, then the engine on the tiny model with two adapters: the same tokens for every
request in either order, on fewer adapters a step."""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass, field

import pytest

from services.inference.engine.affinity import Affinity
from services.inference.engine.api import AdapterKey, GenerationRequest
from services.inference.engine.config import EngineConfig
from services.inference.engine.fairness import FairShare, FirstComeFirstServed
from services.inference.engine.page_allocator import OwnerKind
from services.inference.engine.sampling_params import SamplingParams
from tests.inference.engine_harness import Recorder, make_core, run


@dataclass(eq=False)
class _Seq:
    name: str
    adapter: str | None
    tenant: str | None = None
    seq_id: int = 0
    passed_over: int = 0
    prompt_ids: list[int] = field(default_factory=lambda: [1, 2, 3])
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)


def _queue(spec: str, tenant: str | None = None) -> deque:
    """'a b a' -> sequences a0 (adapter a), b1, a2; '-' is the base model."""
    return deque(
        _Seq(f"{a}{i}", None if a == "-" else a, tenant, seq_id=i)
        for i, a in enumerate(spec.split())
    )


def _drain(affinity: Affinity, queue: deque, admit: bool = True) -> list[str]:
    order = []
    while queue:
        seq = affinity.take(queue)
        order.append(seq.name)
        if admit:
            affinity.admitted(seq)
    return order


def test_requests_of_running_adapters_go_first_and_the_others_keep_their_order():
    queue = _queue("b c a b a c")
    order = _drain(Affinity([_Seq("r", "a")], limit=8), queue)
    # a2 and a4 first; then the head (b0), whose admission makes b3 affine; then c1, c5.
    assert order == ["a2", "a4", "b0", "b3", "c1", "c5"]


def test_off_is_the_queue_order_and_base_model_requests_have_affinity():
    assert _drain(Affinity([_Seq("r", "a")], limit=0), _queue("b a - a")) == [
        "b0",
        "a1",
        "-2",
        "a3",
    ]
    assert _drain(Affinity([], limit=4), _queue("b - c")) == ["-1", "b0", "c2"]
    with pytest.raises(ValueError, match="0 \\(off\\) or positive"):
        Affinity([], limit=-1)


def test_only_the_first_limit_requests_are_looked_at():
    queue = _queue("b c d a")
    # a3 is behind the first three: the head goes; then a3 is among them.
    assert _drain(Affinity([_Seq("r", "a")], limit=3), queue, admit=False) == [
        "b0", "a3", "c1", "d2",
    ]  # fmt: skip


def test_a_request_is_passed_at_most_limit_times():
    running = [_Seq("r", "a")]
    queue = _queue("b a a a a a")
    affinity = Affinity(running, limit=3)
    taken = []
    for _ in range(4):
        taken.append(affinity.take(queue))
        affinity.admitted(taken[-1])
    assert [s.name for s in taken] == ["a1", "a2", "a3", "b0"]  # b0 passed three times: next
    assert taken[-1].passed_over == 3 and [s.passed_over for s in queue] == [0, 0]
    # The count is the request's own: it holds across steps (a new Affinity each step).
    queue = _queue("b a a")
    queue[0].passed_over = 2
    affinity = Affinity(running, limit=3)
    first = affinity.take(queue)
    affinity.admitted(first)
    assert [first.name, affinity.take(queue).name] == ["a1", "b0"]


def test_only_an_admission_passes_a_request_over():
    """A request offered but not admitted (no room for its pages this step, its adapter still
    loading) passes nobody: a saturated engine offers one every step, and counted so the
    requests ahead of it came due within the bound's steps, undoing affinity."""
    running = [_Seq("r", "a")]
    queue = _queue("b c a a")
    for _ in range(10):  # ten steps, each offering a2 (affine) and stopping there
        offered = deque(queue)  # the scheduler offers from a copy of its queue
        assert Affinity(running, limit=3).take(offered).name == "a2"
    assert [s.passed_over for s in queue] == [0, 0, 0, 0]
    # Offered and skipped (not ready), then another admitted: only the admitted one counts.
    affinity, offered = Affinity(running, limit=3), deque(queue)
    assert affinity.take(offered).name == "a2"  # skipped: its adapter is not ready
    a3 = affinity.take(offered)
    affinity.admitted(a3)
    assert a3.name == "a3" and [s.passed_over for s in queue] == [1, 1, 0, 0]
    # Passed enough, the head comes due in the same step, even after the memo of plain heads.
    queue[0].passed_over = queue[1].passed_over = 2
    affinity, offered = Affinity(running, limit=3), deque(queue)
    a2 = affinity.take(offered)
    affinity.admitted(a2)
    assert a2.name == "a2" and affinity.take(offered).name == "b0"


def test_the_batch_is_read_once_and_grows_with_admissions():
    running = [_Seq("r", "a")]
    affinity = Affinity(running, limit=8)
    queue = _queue("b c b")
    assert affinity.take(queue).name == "b0"  # nothing affine: the head
    running.append(_Seq("late", "c"))  # read already: not seen in this step
    affinity.admitted(_Seq("b0", "b"))
    assert [affinity.take(queue).name for _ in range(2)] == ["b2", "c1"]


def test_fair_share_reorders_within_a_tenant_not_between_tenants():
    fair = FairShare()
    light, heavy = _queue("x y x", tenant="l"), _queue("y y", tenant="h")
    for s in [*light, *heavy]:
        fair.arrive(s)
    fair.served([(heavy[0], 100)])  # the heavy tenant is served more: the light one goes first
    running = [_Seq("r", "x", tenant="h")]
    order = fair.admission([*light, *heavy], running, max_num_seqs=8, affinity=8)
    got = []
    for seq in order:
        got.append((seq.tenant, seq.name))
        order.admitted(seq, 3)
    # The light tenant first (least served; three admissions at 3 tokens stay below the
    # heavy tenant's 100), its x's before its y; then the heavy tenant.
    assert got == [("l", "x0"), ("l", "x2"), ("l", "y1"), ("h", "y0"), ("h", "y1")]
    fcfs = FirstComeFirstServed().admission(_queue("y x x"), running, 8, affinity=8)
    assert [s.name for s in fcfs] == ["x1", "x2", "y0"]
    plain = FirstComeFirstServed().admission(_queue("y x x"), running, 8)
    assert [s.name for s in plain] == ["y0", "x1", "x2"]


def test_engine_config_checks_the_bound():
    with pytest.raises(ValueError, match="adapter_affinity"):
        EngineConfig(model_dir="m", adapter_affinity=-1)
    assert EngineConfig(model_dir="m", adapter_affinity=0).adapter_affinity == 0


def _requests(keys, out=6):
    return [
        GenerationRequest(
            f"r{i}-{key.adapter_id}",
            prompt_token_ids=list(range(20 + i, 30 + i)),
            adapter=key,
            sampling=SamplingParams(out, ignore_eos=True),
        )
        for i, key in enumerate(keys)
    ]


@pytest.mark.parametrize("scheduling", ["fair", "fcfs"])
def test_the_engine_packs_a_full_batch_on_fewer_adapters_with_the_same_tokens(
    tiny_models, scheduling
):
    model_dir = tiny_models.model("tiny-llama")
    a, b = AdapterKey("a", 1), AdapterKey("b", 1)
    keys = [a, b] * 4
    results, adapters_per_step = {}, {}
    for affinity in (0, 2):
        recorder = Recorder()
        core = make_core(
            model_dir, recorder, max_num_seqs=2, adapter_affinity=affinity, scheduling=scheduling
        )
        core.add_adapter_dir(a, tiny_models.adapter("tiny-llama", "r8"))
        core.add_adapter_dir(b, tiny_models.adapter("tiny-llama", "r16"))
        results[affinity] = run(core, {0: _requests(keys)}, recorder)
        adapters_per_step[affinity] = [r.adapters for r in core.step_log.recent]
        assert core.scheduler.affinity == affinity
        core.check_integrity()
        assert core.pool.allocator.num_owned(OwnerKind.KV) == 0  # every sequence's pages freed
    tokens = {aff: {rid: r.token_ids for rid, r in res.items()} for aff, res in results.items()}
    assert tokens[0] == tokens[2] and len(tokens[0]) == 8
    # In arrival order every batch of two holds both adapters; with affinity each batch holds
    # two requests of one adapter.
    assert set(adapters_per_step[0]) == {2}
    assert set(adapters_per_step[2]) == {1}
    # The default bound is two batches' worth of admissions.
    assert make_core(model_dir, max_num_seqs=3).scheduler.affinity == 6


def _reference_take(queue: deque, active: set, limit: int):
    """The order take promises, looking at every request each time: the request, and those it
    passes over if it is admitted."""
    for k, seq in enumerate(list(queue)[:limit]):
        if seq.adapter is None or seq.adapter in active or seq.passed_over >= limit:
            ahead = list(queue)[:k]
            del queue[k]
            return seq, ahead
    return queue.popleft(), []


@pytest.mark.parametrize("seed", range(40))
def test_take_remembers_what_it_passed_without_changing_the_order(seed):
    """take skips the head requests it already found without affinity (until the batch's
    adapters change): the same order as looking at every request every time."""
    import random

    rng = random.Random(seed)
    limit = rng.choice([1, 2, 3, 5, 8])
    adapters = [None, "a", "b", "c", "d", "e", "f"]
    spec = [(rng.choice(adapters), rng.randrange(limit + 1)) for _ in range(rng.randrange(1, 40))]
    mine, ref = deque(), deque()
    for i, (adapter, passed) in enumerate(spec):
        mine.append(_Seq(f"s{i}", adapter, passed_over=passed))
        ref.append(_Seq(f"s{i}", adapter, passed_over=passed))
    running = [_Seq("r", rng.choice(adapters[1:]))]
    affinity, active = Affinity(running, limit), {running[0].adapter}
    while mine:
        got, (want, ahead) = affinity.take(mine), _reference_take(ref, active, limit)
        assert got.name == want.name
        if rng.random() < 0.3:  # joined (the others were offered but not ready)
            affinity.admitted(got)
            active.add(got.adapter)
            for passed in ahead:
                passed.passed_over += 1
        assert [s.passed_over for s in mine] == [s.passed_over for s in ref]


def test_a_full_batch_offering_the_same_request_every_step_passes_nobody(tiny_models):
    """The engine's scheduler offers a queued request in every step even while it cannot admit
    it (here: the batch is full, first come first served); only admissions pass the requests
    ahead of it over, so r2 (adapter b) waits for four admissions of the running adapter a, not
    four steps."""
    model_dir = tiny_models.model("tiny-llama")
    a = AdapterKey("a", 1)
    core = make_core(model_dir, max_num_seqs=2, adapter_affinity=4, scheduling="fcfs")
    core.add_adapter_dir(a, tiny_models.adapter("tiny-llama", "r8"))
    b = AdapterKey("b", 1)
    core.add_adapter_dir(b, tiny_models.adapter("tiny-llama", "r16"))
    keys = [a, a, b, a, a, a, a, a, a]
    requests = _requests(keys, out=2)
    # r0 holds the batch's second place for eight steps, r1 runs adapter a throughout
    requests[0] = dataclasses.replace(requests[0], sampling=SamplingParams(8, ignore_eos=True))
    requests[1] = dataclasses.replace(requests[1], sampling=SamplingParams(40, ignore_eos=True))
    joined: list[str] = []

    def after(core, step):
        for seq in core.scheduler.running:
            if seq.request_id not in joined:
                joined.append(seq.request_id)

    results = run(core, {0: requests}, after_step=after)
    assert len(results) == 9
    assert [rid.split("-")[0] for rid in joined] == [
        "r0", "r1", "r3", "r4", "r5", "r6", "r2", "r7", "r8",
    ]  # fmt: skip
    core.check_integrity()
