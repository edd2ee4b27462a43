"""The LoRA index's rows come from the pool: a row per page (the least an adapter takes), within
1% of the pool's bytes, at least 16; an explicit max_loras wins. The engine builds its index,
its scheduler and its model runner with the derived number, and more adapters than the old
fixed 32 stay resident at once."""

from __future__ import annotations

import logging

import pytest
import torch

from services.inference.engine.api import AdapterKey, GenerationRequest
from services.inference.engine.config import EngineConfig
from services.inference.engine.page_pool import page_bytes
from services.inference.engine.pool_sizing import engine_limits, lora_row_bytes, slot_capacity
from services.inference.engine.sampling_params import SamplingParams
from store.peft import BaseModelShape
from tests.inference.engine_harness import make_core, run

CUDA = torch.device("cuda")  # engine_limits only reads the device's type
LLAMA_7B = BaseModelShape(
    num_layers=32, hidden_size=4096, intermediate_size=11008, num_heads=32, num_kv_heads=32,
    head_dim=128, vocab_size=32000,
)  # fmt: skip


def test_the_h200_serving_case():
    """Llama-7B shape in bf16 with pages of 16 tokens (8 MiB each) and the H200's 14568 pages
    (at the default memory share), max_lora_rank 128: a row per page, 14568 rows; the slot
    table is 78.2 MiB (79.8 MiB with ranks, offsets and scales), 0.07% of the 113.8 GiB
    pool."""
    capacity = slot_capacity(LLAMA_7B, 128, LLAMA_7B.num_kv_heads * LLAMA_7B.head_dim, 16)
    per_page = page_bytes(32, 4096, 16, torch.bfloat16)
    assert capacity == 1408 and per_page == 8 * 2**20
    limits = engine_limits(EngineConfig(model_dir="m"), 14568, CUDA, per_page, capacity)
    assert limits.max_loras == 14568
    assert limits.max_num_seqs == 512  # 233k tokens at 400 a sequence: the cap
    assert round(limits.max_loras * capacity * 4 / 2**20, 1) == 78.2
    index = limits.max_loras * lora_row_bytes(capacity)
    assert round(index / 2**20, 1) == 79.8 and index / (14568 * per_page) < 0.0007


def test_rows_within_the_pool_share_and_at_least_16():
    cfg = EngineConfig(model_dir="m")
    row = lora_row_bytes(1408)
    # Small pages: 1% of 100k pages of 4 KiB holds 713 rows of 5744 bytes, not 100k.
    assert engine_limits(cfg, 100_000, CUDA, 4096, 1408).max_loras == 100_000 * 4096 // 100 // row
    assert engine_limits(cfg, 4, CUDA, 8 * 2**20, 1408).max_loras == 16  # a tiny pool
    assert engine_limits(cfg, 10_000, CUDA, 4096, 10**6).max_loras == 16  # a huge row
    given = EngineConfig(model_dir="m", max_loras=3)
    assert engine_limits(given, 13136, CUDA, 8 * 2**20, 1408).max_loras == 3
    with pytest.raises(ValueError, match="max_loras"):
        EngineConfig(model_dir="m", max_loras=0)


def test_the_engine_builds_its_index_with_the_derived_rows(tiny_models, caplog):
    """40 adapters, more than the former fixed 32 rows, run at once and all stay resident: none
    is evicted for a row."""
    model = tiny_models.model("tiny-llama")
    with caplog.at_level(logging.INFO, logger="services.inference.engine.core"):
        core = make_core(model, max_loras=None, max_num_seqs=48, num_pages=None, page_size=16)
    rows = core.limits.max_loras
    assert rows > 40 and core.adapters.index.slot_table.shape[0] == rows
    assert len(core.adapters.row_ranks) == rows
    assert f"{rows} resident adapters" in caplog.text
    path = tiny_models.adapter("tiny-llama", "r4")
    keys = [AdapterKey(f"t{i}", 1) for i in range(40)]
    for key in keys:
        core.add_adapter_dir(key, path)
    two = SamplingParams(max_new_tokens=2)
    requests = [GenerationRequest(k.adapter_id, "hello", adapter=k, sampling=two) for k in keys]
    results = run(core, {0: requests})
    assert all(len(results[k.adapter_id].token_ids) == 2 for k in keys)
    # Same weights under every key: every request computed the same tokens.
    assert len({tuple(r.token_ids) for r in results.values()}) == 1
    stats = core.stats()
    assert stats.adapters_in_pool == 40 and stats.adapter_evictions == 0
    core.check_integrity()
