"""bench/capacity_bound.py: its stand-in adapters take the real ones' pool pages, and on a pool
that the adapters crowd, the bound falls below the pages' share of it, below 1."""

from __future__ import annotations

import json

import pytest

from bench.bench_models import SHAPES
from bench.capacity_bound import Bound, adapter_bytes, adapter_pages, stand_in_rank
from bench.serving import WORKLOADS
from store.base_model import BaseModelShape

QKVO = WORKLOADS["S1"][1]


def test_llama_7b_adapters_pages_and_bytes():
    """A rank-r q/k/v/o adapter of Llama-7B: r/4 pages of 16 tokens (4r slots of the 4096-wide
    pool a layer) and 2 MiB a rank (the serving docs' 16.8 MB at rank 8)."""
    base = SHAPES["llama-7b"].base()
    assert [adapter_pages(base, r, QKVO) for r in (8, 16, 32, 64)] == [2, 4, 8, 16]
    assert adapter_bytes(base, 8, QKVO) == 16_777_216


def test_stand_ins_take_the_same_pages_in_proportion(tiny_models):
    tiny = BaseModelShape.from_hf_config(
        json.loads((tiny_models.model("tiny-llama") / "config.json").read_text())
    )
    ranks = [stand_in_rank(tiny, p, QKVO) for p in (2, 4, 8, 16)]
    assert [adapter_pages(tiny, t, QKVO) for t in ranks] == [2, 4, 8, 16]
    assert [t / ranks[0] for t in ranks] == [1, 2, 4, 8]
    with pytest.raises(ValueError, match="takes exactly"):
        stand_in_rank(tiny, 0, QKVO)


def test_adapters_that_crowd_the_pool_cost_steps(tiny_models):
    """Thirty requests at once on 600 pages, with S2's stand-ins (2 to 16 pages each) and each
    step at a cost linear in its tokens and context: their pages alone leave fewer tokens to
    each step, so the trace takes more steps and less throughput than the base model's, and
    their bytes take more still (a little less where steps with prefill hide them)."""

    def cost(record: dict) -> float:
        return 1.0 + 0.01 * record["tokens"] + 1e-4 * record["kv_read"]

    model = tiny_models.model("tiny-llama")
    # the service's running batch on 600 pages would be its floor of 16 sequences; with 32, all
    # 30 requests fit the batch and the pool is what binds
    default = Bound(model, SHAPES["llama-7b"].base(), "S2", cost, 4e12, 600, "inf:30")
    assert default.max_num_seqs == 16
    bound = Bound(model, SHAPES["llama-7b"].base(), "S2", cost, copy_bw=4e12, pool_pages=600,
                  run="inf:30", max_num_seqs=32)  # fmt: skip
    base, (row,) = bound.rows([24])
    assert base["requests"] == row["runs"]["every step"]["requests"] == 30
    pages_only = row["runs"]["no step"]
    assert pages_only["kv_read_p90"] < base["kv_read_p90"]
    assert pages_only["steps"] > base["steps"]
    assert row["bound"] < row["bound_hidden_in_prefill"] < row["pages_alone"] < 1.0
    # The activations the LoRA calls move cost more still: every token of a step with
    # adapters, 2.62 MB of S2's q/k/v/o calls on Llama-7B's 32 layers.
    assert row["bound_with_activations"] < row["bound"]
    assert bound.token_bytes == 40960 * 2 * 32
    with pytest.raises(ValueError, match="bytes_in"):
        bound.run(1, "some steps")
    # The bytes: every step with adapters pays their real bytes at 4 TB/s.
    record = {"adapters": 2, "adapter_bytes": 2 * bound.header, "tokens": 2, "kv_read": 0}
    assert bound.real_bytes(record) == pytest.approx(0.0, abs=1e-6)
    one = bound.files[8]
    record = {"adapters": 1, "adapter_bytes": len(one.safetensors)}
    assert bound.real_bytes(record) == pytest.approx(
        adapter_bytes(SHAPES["llama-7b"].base(), 8, QKVO), rel=1e-9
    )
