"""kernels/adapter_write.py (the CUDA path of an adapter's copy into the pool) against
adapter_copy.write_adapter_torch (the CPU path, itself checked against the pool geometry in
tests/services/inference/test_adapter_path.py): bit for bit, in every pool dtype, for file
dtypes F16/BF16/F32, files in layer and in name order, rank and alpha patterns (per-layer ranks
and folded scales), layers_to_transform and a tensor-parallel shard. Slots nobody owns hold NaN
and must keep it; every slot the adapter owns must be written."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from kernels import adapter_write
from kernels.lora_layout import MODULES, PIECE_COLS
from services.inference.engine.adapter_copy import to_device, write_adapter_torch
from services.inference.engine.host_adapter import build_host_adapter, pack_pairs
from services.inference.models.shard import Shard
from store.peft import BaseModelShape
from store.synthetic import lora_config_json, lora_tensors, safetensors_bytes

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
SHAPE = BaseModelShape(
    num_layers=4, hidden_size=48, intermediate_size=80, num_heads=4, num_kv_heads=2,
    head_dim=12, vocab_size=64,
)  # fmt: skip
WIDTH = SHAPE.num_kv_heads * SHAPE.head_dim  # 24: rows of 48 and 80 span several chunks
SLOTS = 1024


def _adapter(order: str, dtype: str, extra: dict | None = None, rank: int = 4):
    tensors = dict(lora_tensors(SHAPE, rank=rank, dtype=dtype, seed=5))
    config = json.loads(lora_config_json(rank, 2.0 * rank, MODULES))
    config.update(extra or {})
    if "layers_to_transform" in config and config["layers_to_transform"] is not None:
        keep = {f"layers.{i}." for i in config["layers_to_transform"]}
        tensors = {k: v for k, v in tensors.items() if any(s in k for s in keep)}
    if "rank_pattern" in (extra or {}):  # down_proj at the pattern's rank 2
        for k, (dt, v) in tensors.items():
            if "down_proj.lora_A" in k:
                tensors[k] = (dt, v[:2])
            elif "down_proj.lora_B" in k:
                tensors[k] = (dt, v[:, :2])
    if order == "by-name":  # as safetensors' own writer lays a PEFT file out
        tensors = dict(sorted(tensors.items()))
    return json.dumps(config), safetensors_bytes(tensors)


def _write_both(host, pool_dtype):
    gen = torch.Generator().manual_seed(1)
    slots = torch.randperm(SLOTS, generator=gen)[: host.plan.num_slots].to(DEVICE)
    pool = torch.full((SHAPE.num_layers, 2, SLOTS, WIDTH), float("nan"), dtype=pool_dtype,
                      device=DEVICE)  # fmt: skip
    expected = pool.clone()
    write_adapter_torch(expected, host, slots.long(), host.raw.to(DEVICE))
    adapter_write.adapter_write(
        pool, slots.int(), to_device(host.raw, DEVICE), host.pieces.to(DEVICE), host.max_rank
    )
    return pool, expected, slots


CASES = [
    ("by-layer", "F16", None, None),
    ("by-name", "BF16", None, None),
    ("by-name", "F32", {"rank_pattern": {"down_proj": 2},
                        "alpha_pattern": {"layers.3.mlp.up_proj": 2}}, None),  # folds
    ("by-layer", "F16", {"layers_to_transform": [0, 2]}, None),
    ("by-name", "BF16", None, Shard(1, 2)),
    ("by-layer", "F32", {"rank_pattern": {"down_proj": 2}}, Shard(0, 2)),
]  # fmt: skip


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("order", "dtype", "extra", "shard"), CASES)
def test_kernel_writes_what_the_torch_path_writes(order, dtype, extra, shard, pool_dtype):
    config, body = _adapter(order, dtype, extra)
    host = build_host_adapter("k", config, body, SHAPE, WIDTH, 16, pin=False, shard=shard)
    pool, expected, slots = _write_both(host, pool_dtype)
    torch.testing.assert_close(pool, expected, rtol=0, atol=0, equal_nan=True)
    owned = torch.zeros(SLOTS, dtype=torch.bool, device=DEVICE)
    owned[slots.long()] = True
    # Each half fills its own share of the adapter's slots; what neither half uses stays NaN.
    a_used = sum(p.rank * p.in_chunks for p in host.plan.placements if p is not None)
    b_used = sum(p.rank * p.out_chunks for p in host.plan.placements if p is not None)
    for half, used in ((0, a_used), (1, b_used)):
        mine = pool[:, half, slots[:used].long()]
        assert not mine.isnan().any(), "a slot of the adapter was not written"
    assert pool[:, :, ~owned].isnan().all(), "a slot the adapter does not own was written"


def test_pieces_cover_every_layer_module_and_half():
    config, body = _adapter("by-name", "F16", {"layers_to_transform": [1]})
    host = build_host_adapter("k", config, body, SHAPE, WIDTH, 16, pin=False)
    pieces = host.pieces
    targeted = sum(p is not None for p in host.plan.placements)
    assert pieces.shape == (SHAPE.num_layers * targeted * 2, PIECE_COLS)
    # layers 0, 2 and 3 are not transformed: their pieces write zeros (no valid rows)
    valid_rows = pieces[:, 8].reshape(targeted, SHAPE.num_layers, 2)
    assert (valid_rows[:, [0, 2, 3]] == 0).all() and (valid_rows[:, 1] == 4).all()
    assert host.pieces is pieces  # built once


def test_a_matrix_at_an_offset_its_dtype_does_not_divide_takes_the_torch_path():
    config, body = _adapter("by-layer", "F32")
    host = build_host_adapter("k", config, body, SHAPE, WIDTH, 16, pin=False)
    (key, pair), *_ = host.pairs.items()
    odd = pair._replace(a=pair.a._replace(offset=pair.a.offset + 2))
    moved = dataclasses.replace(host, pair_table=pack_pairs({**host.pairs, key: odd}))
    assert moved.pieces is None


def test_bad_arguments_are_refused():
    config, body = _adapter("by-layer", "F16")
    host = build_host_adapter("k", config, body, SHAPE, WIDTH, 16, pin=False)
    pool = torch.zeros(SHAPE.num_layers, 2, SLOTS, WIDTH, device=DEVICE)
    slots = torch.arange(host.plan.num_slots, device=DEVICE)
    src = host.raw.to(DEVICE)
    with pytest.raises(ValueError, match="multiple of 4"):
        adapter_write.adapter_write(pool, slots, src[:-1], host.pieces.to(DEVICE), 4)
    with pytest.raises(ValueError, match="int64"):
        adapter_write.adapter_write(pool, slots, to_device(host.raw, DEVICE),
                                    host.pieces.int().to(DEVICE), 4)  # fmt: skip


def test_a_piece_of_no_rows_writes_nothing():
    """What adapter_copy.warm_up launches at start-up to compile the kernel."""
    pool = torch.full((SHAPE.num_layers, 2, SLOTS, WIDTH), float("nan"), device=DEVICE)
    pieces = torch.zeros(1, PIECE_COLS, dtype=torch.int64, device=DEVICE)
    slots = torch.zeros(4, dtype=torch.int32, device=DEVICE)
    src = torch.zeros(4, dtype=torch.uint8, device=DEVICE)
    adapter_write.adapter_write(pool, slots, src, pieces, 1)
    assert pool.isnan().all()
