"""How much of the GPU the page pool takes (pool_sizing.pool_pages): the free memory after the
weights, less the activation reserve and less what is kept beyond them, gpu_memory_utilization's
rest and, where CUDA graphs are captured, at least 6 GiB per 32 layers (what the graphs and
their kernels take outside the allocator grows with the layers, not with the GPU). The driver's
answer is given here; a GPU's own is in the engine's log and GetStats (test_engine_cuda.py)."""

from __future__ import annotations

import pytest
import torch

from services.inference.engine.config import EngineConfig
from services.inference.engine.page_pool import page_bytes
from services.inference.engine.pool_sizing import beyond_pool_reserve, pool_pages
from services.inference.models.config import ModelConfig

CUDA = torch.device("cuda")
GiB = 2**30
# the activation reserve of the 7B shape: 2048 tokens x the widest output (2 x 11008) x 8 fp32
# copies, and two fp32 rows of logits for 512 sequences
ACT = 2048 * 22016 * 4 * 8 + 512 * 32000 * 4 * 2


def _llama(layers: int) -> ModelConfig:
    return ModelConfig.from_dict({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 32000, "hidden_size": 4096,
        "intermediate_size": 11008, "num_hidden_layers": layers, "num_attention_heads": 32,
    })  # fmt: skip


def _pages(monkeypatch, total_gib, free_gib, config=None, layers=32):
    free, total = int(free_gib * GiB), int(total_gib * GiB)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free, total))
    config = config or EngineConfig(model_dir="m")
    return pool_pages(config, _llama(layers), CUDA, torch.bfloat16)


def _page(layers=32):
    return page_bytes(layers, 4096, 16, torch.bfloat16)


def test_the_h200_keeps_the_share_rest(monkeypatch):
    """139.8 GiB, 12.6 of them the weights: 7% (9.8 GiB) is above a 32-layer model's floor."""
    rest = int(0.07 * int(139.8 * GiB))
    assert rest > 6 * GiB
    assert _pages(monkeypatch, 139.8, 126.7) == (int(126.7 * GiB) - rest - ACT) // _page()


def test_a_smaller_gpu_or_a_deeper_model_keeps_the_graphs_floor(monkeypatch):
    # an 80 GB card: 7% is 5.5 GiB, under the floor
    assert _pages(monkeypatch, 79.1, 66.0) == (66 * GiB - 6 * GiB - ACT) // _page()
    # 64 layers: twice the floor (12 GiB) is above the H200's 9.8
    want = (int(76.7 * GiB) - 12 * GiB - ACT) // _page(64)
    assert _pages(monkeypatch, 139.8, 76.7, layers=64) == want


def test_without_graphs_the_share_alone(monkeypatch):
    """No graphs (cuda_graphs off): no floor."""
    rest = int(0.07 * int(79.1 * GiB))
    config = EngineConfig(model_dir="m", cuda_graphs=False)
    assert _pages(monkeypatch, 79.1, 66.0, config) == (66 * GiB - rest - ACT) // _page()
    assert beyond_pool_reserve(config, _llama(32), int(79.1 * GiB)) == rest
    assert beyond_pool_reserve(EngineConfig(model_dir="m"), _llama(32), int(79.1 * GiB)) == 6 * GiB


def test_tensor_parallel_ranks_keep_the_floor_of_every_layer():
    """Each rank captures graphs that run all the layers (on its share of the width): 80
    layers keep 15 GiB on every rank, as on one GPU."""
    config = EngineConfig(model_dir="m", tensor_parallel_size=2)
    assert beyond_pool_reserve(config, _llama(80), int(139.8 * GiB)) == 15 * GiB
    assert beyond_pool_reserve(config, _llama(32), int(79.1 * GiB)) == 6 * GiB


def test_a_share_that_leaves_no_pool_names_the_budget(monkeypatch):
    with pytest.raises(ValueError, match="page pool budget .* gpu_memory_utilization 0.5's"):
        _pages(monkeypatch, 24.0, 10.5, EngineConfig(model_dir="m", gpu_memory_utilization=0.5))
