"""The model runner's per-step choice of the LoRA kernel path (kernels/lora_paths.py), from the
host's view of the step: which tokens use which adapters, of which rank. The path itself runs
on CUDA only (test_engine_cuda.py checks its output there); the choice is made on any device.
"""

from __future__ import annotations

import pytest

from kernels import lora_paths
from services.inference.engine.adapter_manager import AdapterState
from services.inference.engine.api import AdapterKey
from services.inference.engine.batch import BatchEntry
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


def test_runner_prefers_fused_for_many_distinct_adapters(core, monkeypatch):
    """Fused steps are those of (mostly) distinct adapters whose ranks fit the engine's fused
    launch (FUSED_DECODE_ROWS = 16), whatever the engine's max_lora_rank (32 here)."""
    monkeypatch.setattr(lora_paths, "FUSED_DECODE_MIN_ROWS", 32)  # 2 tokens x 16 rank rows
    r32, r16 = _load(core, "r32"), _load(core, "r16")
    row_ranks = core.adapters.row_ranks
    free = [r for r in range(4) if r not in (r32, r16)]
    row_ranks[free[0]] = 32  # a second rank-32 and a rank-8 adapter's rows, as
    row_ranks[free[1]] = 8  # the manager writes them
    prefers = core.runner.prefers_fused
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
    assert prefers(prefill) is None  # prefill-sized: the shapes decide
