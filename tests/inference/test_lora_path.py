"""The model runner's per-step choice of the LoRA kernel path (kernels/lora_paths.py), from the
host's view of the step: which tokens use which adapters, of which rank. The path itself runs
on CUDA only (test_engine_cuda.py checks its output there); the choice is made on any device.
"""

from __future__ import annotations

import pytest

from kernels import lora_paths
from kernels.lora_layout import DOWN, GATE, UP, K, O, Q, V
from services.inference.engine.adapter_manager import AdapterState
from services.inference.engine.api import AdapterKey, GenerationRequest
from services.inference.engine.batch import BatchEntry
from services.inference.engine.model_runner import LoraMode, StepLora
from services.inference.engine.sampling_params import SamplingParams
from tests.inference.engine_harness import make_core


def _decode(rows):
    return [BatchEntry((5,), 3, (0,), row, True) for row in rows]


@pytest.fixture
def core(tiny_models):
    core = make_core(tiny_models.model("tiny-llama"), max_lora_rank=32, max_loras=4)
    for name in ("r16", "r32"):
        core.add_adapter_dir(AdapterKey(name, 1), tiny_models.adapter("tiny-llama", name))
    return core


def _load(core, name: str) -> int:
    key = AdapterKey(name, 1)
    assert core.adapters.begin_load(key)
    core.adapters.poll_loads()
    return core.adapters.row(key)


def test_row_ranks_follow_loads_and_evictions(core):
    r32, r16 = _load(core, "r32"), _load(core, "r16")
    assert core.adapters.row_ranks[r32] == 32 and core.adapters.row_ranks[r16] == 16
    assert core.adapters.evict_idle() and core.adapters.evict_idle()
    assert core.adapters.row_ranks == [0] * 4


def test_idle_evictions_go_least_recently_used_first_and_skip_adapters_in_use(core, tiny_models):
    """evict_idle sorts the idle adapters once per step (clock) and takes them in that order,
    skipping one that a request took meanwhile; a touch (the next step) orders them again."""
    core.add_adapter_dir(AdapterKey("r8", 1), tiny_models.adapter("tiny-llama", "r8"))
    adapters = core.adapters
    keys = {n: AdapterKey(n, 1) for n in ("r32", "r16", "r8")}
    for name in keys:
        _load(core, name)
    adapters.touch([keys["r8"]])
    adapters.touch([keys["r32"]])  # least recently used first: r16, r8, r32
    assert adapters.evict_idle() and adapters.state(keys["r16"]) is AdapterState.HOST
    adapters.acquire(keys["r8"])  # in use now: the order built above must skip it
    assert adapters.evict_idle() and adapters.state(keys["r32"]) is AdapterState.HOST
    assert not adapters.evict_idle() and adapters.state(keys["r8"]) is AdapterState.IN_POOL
    adapters.release(keys["r8"])
    _load(core, "r16")
    adapters.touch([keys["r16"]])  # the next step: r8 is now the least recently used
    assert adapters.evict_idle() and adapters.state(keys["r8"]) is AdapterState.HOST
    assert adapters.state(keys["r16"]) is AdapterState.IN_POOL
    assert adapters.evictions == 3


def test_a_load_evicts_idle_adapters_until_its_reserve_is_free(core, tiny_models):
    """begin_load(reserve=R) leaves R pages free (a page per running sequence's next decode),
    evicting idle adapters for them too, not only for the adapter's own pages."""
    _load(core, "r32"), _load(core, "r16")
    pool, adapters = core.pool, core.adapters
    adapters.touch([AdapterKey("r16", 1)])  # r32 is the least recently used
    key = AdapterKey("r8", 1)
    core.add_adapter_dir(key, tiny_models.adapter("tiny-llama", "r8"))
    need = adapters.pages_of(adapters._entries[key].host)
    reserve = 3
    # KV takes all but need + 1 pages: the adapter fits, its reserve does not without evicting.
    pool.grow_kv("kv", (pool.num_free - need - 1) * pool.page_size)
    assert adapters.begin_load(key, reserve=reserve)
    assert pool.num_free >= reserve
    adapters.poll_loads()
    states = {n: adapters.state(AdapterKey(n, 1)) for n in ("r32", "r16", "r8")}
    # the least recently used idle adapter made the room; the other stays resident
    assert states == {"r32": AdapterState.HOST, "r16": AdapterState.IN_POOL,
                      "r8": AdapterState.IN_POOL}  # fmt: skip


def test_issued_copies_keep_to_the_budget_in_the_order_they_were_prepared(
    core, tiny_models, monkeypatch
):
    """issue_loads(budget_s) stops once its budget is spent, having issued at least one copy;
    the others wait, in order, for the next call (without a budget: all of them)."""
    adapters = core.adapters
    core.add_adapter_dir(AdapterKey("r8", 1), tiny_models.adapter("tiny-llama", "r8"))
    for name in ("r32", "r16", "r8"):
        assert adapters.begin_load(AdapterKey(name, 1))
    prepared = list(adapters._unissued)
    issued = []
    real = adapters.copier.issue
    monkeypatch.setattr(
        adapters.copier, "issue", lambda t, b=None, a=None: (issued.append(t), real(t, b, a))[1]
    )
    adapters.issue_loads(budget_s=0.0)
    assert issued == prepared[:1]
    adapters.issue_loads(budget_s=0.0)
    assert issued == prepared[:2]
    adapters.issue_loads()
    assert issued == prepared and not adapters._unissued


def test_issued_copies_keep_to_the_byte_budget(core, tiny_models, monkeypatch):
    """issue_loads(budget_bytes=B) queues about B bytes of the adapters' transfers: a transfer
    the budget cuts stays first in the queue, its rest queued by the next calls, and the copies
    after it wait; a copy is taken off the queue once all of it is queued (ticket.issued)."""
    adapters = core.adapters
    core.add_adapter_dir(AdapterKey("r8", 1), tiny_models.adapter("tiny-llama", "r8"))
    for name in ("r32", "r16", "r8"):
        assert adapters.begin_load(AdapterKey(name, 1))
    prepared = list(adapters._unissued)
    left = {id(t): 100 for t in prepared}  # bytes each transfer has still to queue
    calls = []

    def issue(ticket, max_bytes=None, after=None):  # AdapterCopier.issue's, without a device
        n = left[id(ticket)] if max_bytes is None else min(left[id(ticket)], max_bytes)
        left[id(ticket)] -= n
        calls.append((prepared.index(ticket), n))
        if not left[id(ticket)]:
            ticket._job = None
        else:
            ticket._job = ticket._job or "part"
        return n

    monkeypatch.setattr(adapters.copier, "issue", issue)
    adapters.issue_loads(budget_bytes=60)
    assert calls == [(0, 60)] and adapters._unissued == prepared  # the first, cut at 60
    adapters.issue_loads(budget_bytes=150)
    assert calls[1:] == [(0, 40), (1, 100), (2, 10)]  # its rest, the second whole, then 10
    assert adapters._unissued == prepared[2:]
    adapters.issue_loads()  # no budget: the rest of everything
    assert calls[4:] == [(2, 90)] and not adapters._unissued


def test_a_launch_gives_the_copies_a_byte_budget_from_the_last_step(core, monkeypatch):
    """Each launch issues the prepared copies with the time budget and the byte budget the last
    finished step set (core.DMA_SHARE of its GPU time at the copier's measured bandwidth) and
    the step's input-copy event; without a measured bandwidth (the CPU) no byte budget."""
    from services.inference.engine import core as core_module

    calls = []
    monkeypatch.setattr(
        core.adapters, "issue_loads", lambda s=None, b=None, after=None: calls.append((s, b))
    )
    sampling = SamplingParams(max_new_tokens=8, ignore_eos=True)  # a step at each call below
    core.add_request(GenerationRequest("r", prompt_token_ids=[3, 4, 5], sampling=sampling))
    core.step()
    core.step()
    assert calls[0][1] is None and calls[1][1] is None  # no bandwidth measured on the CPU
    core.adapters.copier.h2d_bytes_per_s = 1e9
    core.step()  # the step before it set the budgets with no bandwidth
    core.step()
    gpu_s = core.step_log.recent[-2].gpu_ms / 1e3  # the step finished before the last launch
    assert calls[-1] == (
        max(core_module.ISSUE_MIN_S, core_module.ISSUE_SHARE * gpu_s),
        int(core_module.DMA_SHARE * gpu_s * 1e9),
    )


def test_runner_prefers_fused_for_many_distinct_adapters(core, monkeypatch):
    """Fused steps are those of (mostly) distinct adapters whose ranks fit the engine's fused
    launch (FUSED_DECODE_ROWS = 16), whatever the engine's max_lora_rank (32 here)."""
    monkeypatch.setattr(lora_paths, "FUSED_DECODE_MIN_ROWS", 32)  # 2 tokens x 16 rank rows
    r32, r16 = _load(core, "r32"), _load(core, "r16")
    row_ranks = core.adapters.row_ranks
    free = [r for r in range(4) if r not in (r32, r16)]
    row_ranks[free[0]] = 32  # a second rank-32 and a rank-8 adapter's rows, as
    row_ranks[free[1]] = 8  # the manager writes them

    def prefers(entries):  # the step's path: fused (True), two launches (False), shapes (None)
        return core.runner.step_lora(entries).mode.fused

    assert prefers(_decode([r16, free[1]]))  # two distinct adapters of rank <= 16
    assert prefers(_decode([None, r16, free[1]]))  # base-model tokens do not count
    assert not prefers(_decode([r16]))  # one token: too few rank rows
    assert not prefers(_decode([r16, r16, r16]))  # a shared adapter
    assert not prefers(_decode([r32, free[0]]))  # rank 32: above the fused launch's rows
    assert not prefers(_decode([r16, r32]))  # the step's largest rank decides
    assert not prefers(_decode([None, None]))
    # A prefill chunk counts its tokens: 30 tokens of one adapter make the step shared.
    chunk = BatchEntry(tuple(range(30)), 0, tuple(range(8)), r16, False)
    assert not prefers([*_decode([r16, free[1]]), chunk])
    prefill = [BatchEntry(tuple(range(600)), 0, tuple(range(150)), r16, True)]
    assert prefers(prefill) is True  # prefill-sized, every adapter within 16 rows: NARROW
    prefill.append(BatchEntry((1,), 4, (8,), r32, True))
    assert prefers(prefill) is False  # prefill-sized with a rank-32 adapter: two launches, wide


def test_decode_steps_fuse_on_one_token_tiles(core):
    """Decode steps whose adapters all fit ONE_TOKEN_ROWS (8) rank rows are ONE_TOKEN (every
    call fused, a tile a token), shared adapters included, while their tokens fit the batch's
    segment capacity (6 here: max_loras 4 + 2); a prefill chunk, a wider adapter or more tokens
    than that take the other rules. Their calls are sized for 8 rows whatever the engine's
    max_lora_rank (32 here), and the context tells each call to fuse."""
    r32, r16 = _load(core, "r32"), _load(core, "r16")
    free = [r for r in range(4) if r not in (r32, r16)]
    core.adapters.row_ranks[free[0]] = 8
    core.adapters.row_ranks[free[1]] = 4
    r8, r4 = free
    step = core.runner.step_lora
    assert core.runner.batch.max_segments == 6
    assert step(_decode([r8])).mode is LoraMode.ONE_TOKEN
    assert step(_decode([r8, r8, r4, None])).mode is LoraMode.ONE_TOKEN  # shared, base beside
    assert step(_decode([r8] * 6)).mode is LoraMode.ONE_TOKEN
    assert step(_decode([r8] * 7)).mode is LoraMode.TWO  # more tiles than the table holds
    assert step(_decode([r8, r16])).mode is LoraMode.TWO  # rank 16: above 8 rows
    assert step(_decode([r8, r32])).mode is LoraMode.WIDE
    chunk = BatchEntry((1, 2), 0, (0,), r8, False)
    assert step([*_decode([r4]), chunk]).mode is LoraMode.TWO  # not every entry one token
    ctx = core.runner._lora_for(LoraMode.ONE_TOKEN, None)
    assert ctx.rows == lora_paths.ONE_TOKEN_ROWS and ctx.fused is True and ctx.one_token
    assert ctx.rank_block == 16
    assert not core.runner._lora_for(LoraMode.FUSED, None).one_token


def test_decode_steps_from_the_fused_rules_size_need_adapters_shared_little(core):
    """Below the fused rule's size (64 adapter tokens) a decode step of rank-8 adapters is
    ONE_TOKEN whatever its tokens share; from there only while they share adapters at most
    ONE_TOKEN_MAX_SHARING (8) to one (lora_paths.one_token_step_fuses: here two adapters hold
    32 tokens each, so the fused rule decides: two launches); and one whose tiles would not fit
    the tile table keeps the other rules at any size."""
    runner = core.runner
    r32, r16 = _load(core, "r32"), _load(core, "r16")
    r8, r4 = [r for r in range(4) if r not in (r32, r16)]
    core.adapters.row_ranks[r8] = 8
    core.adapters.row_ranks[r4] = 4
    runner.batch.max_segments = 200  # the capacity of an engine of many resident adapters
    try:
        assert runner.step_lora(_decode([r8] * 32 + [r4] * 31)).mode is LoraMode.ONE_TOKEN
        assert runner.step_lora(_decode([r8] * 32 + [r4] * 32)).mode is LoraMode.TWO
        runner.batch.max_segments = 6  # 12 tiles would not fit the table
        assert runner.step_lora(_decode([r8] * 6 + [r4] * 6)).mode is LoraMode.TWO
    finally:
        runner.batch.max_segments = 6


def test_prefill_sized_steps_are_sized_for_their_adapters_ranks(core):
    """A prefill-sized step whose adapters all fit FUSED_PREFILL_MAX_ROWS (16) rank rows makes
    its calls with that many (NARROW: every call fused), whatever the engine's
    max_lora_rank (32 here); one with a larger adapter keeps the engine's, on two launches of
    WIDE_RANK_ROWS-row programs (WIDE), decode-sized or not. A step's modules are those of its
    adapters."""
    r32, r16 = _load(core, "r32"), _load(core, "r16")
    modules = core.adapters.row_modules

    def prefill(row, n=600):
        return BatchEntry(tuple(range(n)), 0, tuple(range(n // 4)), row, True)

    step, lora_for = core.runner.step_lora, core.runner._lora_for
    assert step([prefill(r16)]) == StepLora(LoraMode.NARROW, modules[r16])
    # an adapter above 16 rank rows: two launches of 32-row programs, prefill- or decode-sized
    assert step([prefill(r16), *_decode([r32])]) == StepLora(
        LoraMode.WIDE, modules[r16] | modules[r32]
    )
    assert step([prefill(r16, 100), *_decode([r32])]).mode is LoraMode.WIDE
    assert step([prefill(r16, 100), *_decode([r16])]).mode is LoraMode.TWO  # decode-sized
    assert step([prefill(None), *_decode([None])]) == StepLora(LoraMode.NONE, None)
    # The context each path's calls are made with.
    assert lora_for(LoraMode.NONE, None) is None
    assert lora_for(LoraMode.NARROW, modules[r16]).rows == lora_paths.FUSED_PREFILL_MAX_ROWS
    assert core.runner.lora.modules == modules[r16] and core.runner.lora.fused is True
    assert lora_for(LoraMode.SHAPES, None).rows == 32 and core.runner.lora.fused is None
    assert lora_for(LoraMode.FUSED, None).rows == lora_paths.FUSED_DECODE_ROWS
    assert core.runner.lora.fused is True
    assert lora_for(LoraMode.TWO, None).rows == 32 and core.runner.lora.fused is False
    assert core.runner.lora.rank_block == 16
    assert lora_for(LoraMode.WIDE, None).rows == 32 and core.runner.lora.fused is False
    assert core.runner.lora.rank_block == lora_paths.WIDE_RANK_ROWS
    assert lora_for(LoraMode.NARROW, None).rank_block == 16  # back to 16 for the next step


def test_decode_sized_mixed_steps_narrow_on_many_adapters(core, tiny_models, monkeypatch):
    """lora_paths.NARROW_MIN_ADAPTERS: a decode-sized mixed step whose adapters fit 16 rank rows
    and that holds that many distinct adapters takes NARROW (rather than the fused rule or the
    two launches), its decode tokens apart by the same rule, and NARROW graphs are captured at
    every mixed size whose sequences can hold that many; a step on fewer adapters, a decode
    step, or a step with an adapter above 16 rows keeps its path. WIDE_FUSED stays
    prefill-sized. (The default, 48, lowered to 2: the engine holds four adapters.)"""
    for name in ("r4", "r8"):
        core.add_adapter_dir(AdapterKey(name, 1), tiny_models.adapter("tiny-llama", name))
    r16, r4, r32, r8 = (_load(core, name) for name in ("r16", "r4", "r32", "r8"))
    runner = core.runner
    step = runner.step_lora

    def prefill(row, n):
        return BatchEntry(tuple(range(n)), 0, tuple(range(n // 4 + 1)), row, True)

    mixed = [prefill(r16, 100), *_decode([r4] * 4)]  # two adapters
    spread = [prefill(r8, 100), *_decode([r4, r8] * 4)]  # 4 decode tokens an adapter
    assert step(mixed).mode is LoraMode.TWO  # the default: too few adapters
    assert LoraMode.NARROW not in {k.lora for k in runner.graph_keys((), (128,))}
    monkeypatch.setattr(lora_paths, "NARROW_MIN_ADAPTERS", 2)
    assert step(mixed) == StepLora(LoraMode.NARROW, core.adapters.row_modules[r16]
                                   | core.adapters.row_modules[r4])  # fmt: skip
    assert step(spread) == StepLora(LoraMode.NARROW, step(spread).modules, True)  # apart
    assert step([prefill(r16, 100), *_decode([r16] * 8)]).mode is LoraMode.TWO  # one adapter
    assert step([prefill(r16, 100), *_decode([r4, r32])]).mode is LoraMode.WIDE
    assert step(_decode([r4, r8] * 35)).mode is not LoraMode.NARROW  # a decode step
    keys = runner.graph_keys((), (2, 4, 128, 640))
    assert {k.tokens for k in keys if k.lora is LoraMode.NARROW} == {4, 128, 640}  # 2: 1 seq
    assert {k.tokens for k in keys if k.lora is LoraMode.WIDE_FUSED} <= {640}


def test_the_wide_fused_rule_wants_many_adapters_none_above_its_rows():
    """lora_paths.prefill_step_fuses_wide: an adapter above FUSED_PREFILL_MAX_ROWS (16), none
    above WIDE_FUSED_ROWS (64), and at least WIDE_FUSED_MIN_ADAPTERS (48) distinct adapters."""
    many = lora_paths.WIDE_FUSED_MIN_ADAPTERS
    assert lora_paths.prefill_step_fuses_wide(64, many)
    assert lora_paths.prefill_step_fuses_wide(17, many)
    assert not lora_paths.prefill_step_fuses_wide(64, many - 1)  # few adapters: two launches
    assert not lora_paths.prefill_step_fuses_wide(16, many)  # fits 16 rows: narrow instead
    assert not lora_paths.prefill_step_fuses_wide(65, many)  # 128 rows: two launches


def test_prefill_sized_steps_of_many_wide_adapters_fuse_at_64_rows(tiny_models, monkeypatch):
    """In an engine sized for rank 64, a prefill-sized step with a rank-32 adapter among at
    least WIDE_FUSED_MIN_ADAPTERS distinct adapters (lowered to 3 here: the engine holds 4) runs
    every call fused at WIDE_FUSED_ROWS rank rows (WIDE_FUSED); with fewer adapters, decode-sized,
    or in an engine sized for rank 32 (the fixture's) it keeps the two launches (WIDE)."""
    monkeypatch.setattr(lora_paths, "WIDE_FUSED_MIN_ADAPTERS", 3)
    wide = make_core(tiny_models.model("tiny-llama"), max_lora_rank=64, max_loras=4)
    for name in ("r16", "r32"):
        wide.add_adapter_dir(AdapterKey(name, 1), tiny_models.adapter("tiny-llama", name))
    r32, r16 = _load(wide, "r32"), _load(wide, "r16")
    r8 = next(r for r in range(4) if r not in (r32, r16))
    wide.adapters.row_ranks[r8] = 8
    chunk = BatchEntry(tuple(range(600)), 0, tuple(range(150)), r16, True)
    step, modules = wide.runner.step_lora, wide.adapters.row_modules
    assert step([chunk, *_decode([r32, r8])]) == StepLora(
        LoraMode.WIDE_FUSED, modules[r16] | modules[r32] | modules[r8]
    )
    assert step([chunk, *_decode([r32, r32])]).mode is LoraMode.WIDE  # two adapters
    small = chunk._replace(token_ids=tuple(range(100)))
    assert step([small, *_decode([r32, r8])]).mode is LoraMode.WIDE  # decode-sized
    ctx = wide.runner._lora_for(LoraMode.WIDE_FUSED, None)
    assert ctx.rows == lora_paths.WIDE_FUSED_ROWS and ctx.fused is True and not ctx.one_token
    assert LoraMode.WIDE_FUSED.fused is True


@pytest.mark.parametrize(
    "adapter, want",
    [("r8", {(Q, K, V), (O,)}), ("r16", {(GATE, UP), (DOWN,)}), ("r4", {(Q, K, V)})],
)
def test_a_step_makes_no_call_for_modules_its_adapters_lack(tiny_models, monkeypatch, adapter,
                                                            want):  # fmt: skip
    """Each step's LoRA calls cover only the modules some adapter of it has (r8: q/k/v and o;
    r16: gate/up and down; r4: q and v, one q/k/v call), and the output still matches the
    reference path (test_engine_parity.py checks it against HF + PEFT)."""
    import kernels

    core = make_core(tiny_models.model("tiny-llama"))
    key = AdapterKey(adapter, 1)
    core.add_adapter_dir(key, tiny_models.adapter("tiny-llama", adapter))
    calls = []
    apply = kernels.lora_apply

    def spy(y, x, pool_layer, index, tokens, modules, *args, **kwargs):
        calls.append(tuple(modules))
        return apply(y, x, pool_layer, index, tokens, modules, *args, **kwargs)

    monkeypatch.setattr(kernels, "lora_apply", spy)
    sampling = SamplingParams(max_new_tokens=3, ignore_eos=True)
    core.add_request(GenerationRequest("a", prompt_token_ids=[5, 9, 13], adapter=key,
                                       sampling=sampling))  # fmt: skip
    while core.has_work:
        core.step()
    assert calls and set(calls) == want


def test_the_addend_takes_steps_whose_calls_all_fuse(tiny_models, monkeypatch, caplog):
    """lora_addend (ModelRunner._zero_tiles): a step writes its deltas for its GEMMs to add onto
    on a fused mode (NARROW, WIDE_FUSED, FUSED, ONE_TOKEN) from ADDEND_MIN_TOKENS tokens, and only
    where its single-slice calls fuse too (a delta needs the fused kernel); never on the two
    launches or by shapes, and never with the option off. The engine's start-up line says
    which."""
    import logging

    from services.inference.engine.model_runner import ADDEND_MIN_TOKENS

    with caplog.at_level(logging.INFO, logger="services.inference.engine.core"):
        on = make_core(tiny_models.model("tiny-llama"), max_lora_rank=64)  # the default
        assert f"GEMMs' addends from {ADDEND_MIN_TOKENS} tokens" in caplog.text
        caplog.clear()
        off = make_core(tiny_models.model("tiny-llama"), max_lora_rank=64, lora_addend=False)
        assert "GEMMs' addends off" in caplog.text
    on, off = on.runner, off.runner
    big = max(ADDEND_MIN_TOKENS, lora_paths.FUSED_MAX_TOKENS + 1)
    for mode in (LoraMode.NARROW, LoraMode.WIDE_FUSED, LoraMode.FUSED, LoraMode.ONE_TOKEN):
        assert on._zero_tiles(mode, big) and not off._zero_tiles(mode, big)
        assert not on._zero_tiles(mode, ADDEND_MIN_TOKENS - 1)
    for mode in (LoraMode.NONE, LoraMode.TWO, LoraMode.SHAPES, LoraMode.WIDE):
        assert not on._zero_tiles(mode, big)
    # where a FUSED step's o and down calls would take the two launches, no addend
    monkeypatch.setattr(lora_paths, "FUSED_SINGLE_SLICE_MIN_ROWS", 1 << 30)
    assert not on._zero_tiles(LoraMode.FUSED, big)
    assert on._zero_tiles(LoraMode.ONE_TOKEN, big)  # every call of it fuses
    # the context the step's calls are made with, and its tables listing every token
    on.batch.fill([BatchEntry(tuple(range(big)), 0, tuple(range(big // 4 + 1)), None, True)])
    assert on._lora_for(LoraMode.ONE_TOKEN, None).addend
    assert not on._lora_for(LoraMode.TWO, None).addend


def test_the_byte_budget_share_is_read_from_the_environment_with_a_clear_error(monkeypatch):
    """LORAFLEET_ADAPTER_DMA_SHARE: 0.5 unset, 0 turns the byte budget off, and a value that is
    not a share of a step (0 to 1) is refused naming the variable."""
    from services.inference.engine import core as core_module

    monkeypatch.delenv(core_module.DMA_SHARE_ENV, raising=False)
    assert core_module._dma_share() == 0.5
    monkeypatch.setenv(core_module.DMA_SHARE_ENV, "0")
    assert core_module._dma_share() == 0.0
    for bad in ("half", "1.5", "-0.1", "nan"):
        monkeypatch.setenv(core_module.DMA_SHARE_ENV, bad)
        with pytest.raises(ValueError, match="LORAFLEET_ADAPTER_DMA_SHARE must be a number"):
            core_module._dma_share()
