"""engine/host_adapter.py: the pair table (pack_pairs) describes every pair of the file, per-layer
folds included, and an adapter costs the garbage collector a few objects, not a few per pair; so
does the AdapterSpec (engine/adapter_spec.py) that the service's host cache holds for it."""

from __future__ import annotations

import gc
import json

import safetensors.torch
import torch

from services.inference.engine.adapter_spec import PairSpec, validate_and_describe
from services.inference.engine.host_adapter import (
    LoraPair,
    TensorRef,
    build_host_adapter,
    pack_pairs,
    unpack_pairs,
)
from store.peft import BaseModelShape
from store.synthetic import lora_config_json, lora_tensors, safetensors_bytes

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")


def _shape(layers: int) -> BaseModelShape:
    return BaseModelShape(
        num_layers=layers, hidden_size=32, intermediate_size=48, num_heads=4, num_kv_heads=2,
        head_dim=8, vocab_size=64,
    )  # fmt: skip


def _files(shape: BaseModelShape, dtype: str = "F16", extra: dict | None = None):
    tensors = dict(lora_tensors(shape, rank=4, modules=MODULES, dtype=dtype, seed=3))
    config = json.loads(lora_config_json(4, 8.0, MODULES))
    config.update(extra or {})
    return json.dumps(config).encode(), safetensors_bytes(tensors), tensors


def test_pack_and_unpack_are_inverse():
    pairs = {
        (0, 1): LoraPair(TensorRef(128, torch.float16, (4, 32)),
                         TensorRef(384, torch.bfloat16, (16, 4)), None),
        (3, 0): LoraPair(TensorRef(8, torch.float32, (2, 32)),
                         TensorRef(1000, torch.float32, (32, 2)), 0.3125),
        (1, 6): LoraPair(TensorRef(0, torch.bfloat16, (8, 48)),
                         TensorRef(96, torch.float16, (32, 8)), -1.5e-7),
    }  # fmt: skip
    table = pack_pairs(pairs)
    assert table.dtype == torch.int64 and table.shape[0] == 3
    assert unpack_pairs(table) == pairs
    assert unpack_pairs(pack_pairs({})) == {}


def test_each_pair_names_its_matrices_and_its_fold():
    shape = _shape(3)
    # alpha_pattern gives q_proj's layers different scales: they fold into B per layer
    config, body, tensors = _files(
        shape, "BF16", {"alpha_pattern": {"layers.1.self_attn.q_proj": 2}}
    )
    host = build_host_adapter("k", config, body, shape, 16, 16, pin=False)
    pairs = host.pairs
    stored = safetensors.torch.load(body)  # the file's tensors, as safetensors reads them
    assert len(pairs) == shape.num_layers * len(MODULES)
    folds = {key: pair.fold for key, pair in pairs.items() if pair.fold is not None}
    assert folds and all(m == 0 for _, m in folds)  # q_proj's, every layer of it
    for name in tensors:
        layer = int(name.split("layers.")[1].split(".")[0])
        m = MODULES.index(name.split(".")[-3])
        ref = pairs[layer, m].a if "lora_A" in name else pairs[layer, m].b
        assert torch.equal(host.host_view(ref), stored[name])


def test_an_adapter_costs_the_collector_the_same_few_objects_at_any_depth():
    def tracked_per_adapter(layers: int, count: int = 20) -> float:
        shape = _shape(layers)
        config, body, _ = _files(shape)
        build_host_adapter("warm", config, body, shape, 16, 16, pin=False)  # caches, once
        gc.collect()
        before = len(gc.get_objects())
        held = [build_host_adapter(("k", i), config, body, shape, 16, 16, pin=False)
                for i in range(count)]  # fmt: skip
        gc.collect()
        grown = len(gc.get_objects()) - before
        del held
        return grown / count

    shallow, deep = tracked_per_adapter(2), tracked_per_adapter(32)
    # 32 layers x 4 modules as named tuples would be 384 objects an adapter
    assert deep <= 40, deep
    assert abs(deep - shallow) <= 4, (shallow, deep)


def test_a_spec_is_one_object_to_the_collector_and_names_its_pairs():
    shape = _shape(32)
    config, body, tensors = _files(shape)
    spec = validate_and_describe(config, memoryview(body), shape, 16)
    # the collector stops tracking a plain tuple once what it holds is untracked, one level a
    # collection: the shapes, then each pair, then the tuple of pairs
    for _ in range(3):
        gc.collect()
    assert not gc.is_tracked(spec.pairs)
    assert all(not gc.is_tracked(p) for p in spec.pairs)
    named = [PairSpec(*p) for p in spec.pairs]
    assert len(named) == len(tensors) // 2 == shape.num_layers * len(MODULES)
    assert all(isinstance(p, PairSpec) for p in named)
    assert [(p.layer, p.module) for p in named] == sorted((p.layer, p.module) for p in named)
    host = build_host_adapter("k", config, body, shape, 16, 16, pin=False, spec=spec)
    assert host.pairs == build_host_adapter("k", config, body, shape, 16, 16, pin=False).pairs
