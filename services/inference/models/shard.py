"""Which slice of each weight a tensor-parallel rank takes: Megatron's layout, LoRA to match.

With N ranks, q/k/v and gate/up are split by output columns (q/k/v by whole heads: rank r takes
query heads [r * H / N, (r + 1) * H / N) and the kv heads of the same span), o and down by input
rows, so each rank computes its heads' attention and its slice of the MLP on a replicated x and
one all-reduce (sum) after o and one after down make x whole again. Embeddings, norms and
lm_head are replicated; a bias of o or down is added on rank 0 only (the sum adds it once).

LoRA follows S-LoRA's scheme and needs no collective of its own. A column-split projection
shrinks with the whole A (x is whole) and expands with the rows of B of the rank's columns. A
row-split one shrinks its x shard with the matching columns of A, a partial h; B·h_partial added
to the rank's partial output before the all-reduce sums to B·A·x. So each rank's share of an
adapter is a smaller LoRA adapter: the module dimensions of shard_base_shape, the same on every
rank, so the adapter's plan (kernels/lora_layout.py) and slots are the same on every rank.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from kernels.lora_layout import DOWN, GATE, UP, K, O, Q, V
from services.inference.models.config import ModelConfig
from store.peft import BaseModelShape

COLUMN_SPLIT = frozenset({Q, K, V, GATE, UP})  # output columns split: B's rows sliced
ROW_SPLIT = frozenset({O, DOWN})  # input rows split: A's columns sliced


class Shard(NamedTuple):
    rank: int
    size: int  # N, the tensor-parallel size

    def part(self, full: int) -> slice:
        """This rank's contiguous share of a dimension of ``full`` elements."""
        step = full // self.size
        return slice(self.rank * step, (self.rank + 1) * step)


def check_shardable(num_heads: int, num_kv_heads: int, intermediate: int, n: int) -> None:
    """ValueError unless the heads, the kv heads and the MLP width divide by ``n``."""
    for name, value in (
        ("num_kv_heads", num_kv_heads),
        ("num_heads", num_heads),
        ("intermediate_size", intermediate),
    ):
        if value % n:
            raise ValueError(
                f"tensor_parallel_size {n} must divide the model's {name} ({value}): each rank "
                "holds whole heads and an equal share of the MLP"
            )


def _divided(config, n: int):
    """A copy of ``config`` (a ModelConfig or a BaseModelShape: both name the fields alike) with
    the heads, kv heads and MLP width one rank of ``n`` holds."""
    check_shardable(config.num_heads, config.num_kv_heads, config.intermediate_size, n)
    return dataclasses.replace(
        config,
        num_heads=config.num_heads // n,
        num_kv_heads=config.num_kv_heads // n,
        intermediate_size=config.intermediate_size // n,
    )


def shard_model_config(cfg: ModelConfig, n: int) -> ModelConfig:
    """The model one rank of ``n`` computes: its heads, its kv heads, its share of the MLP."""
    return _divided(cfg, n)


def shard_base_shape(base: BaseModelShape, n: int) -> BaseModelShape:
    """The module dimensions of one rank's share of an adapter (module_dims of the shard)."""
    return _divided(base, n)


def lora_slices(module: int, d_in: int, d_out: int, shard: Shard) -> tuple[slice, slice]:
    """The rank's (columns of A [r, d_in], rows of B [d_out, r]) of a module of the full model."""
    if module in ROW_SPLIT:
        return shard.part(d_in), slice(None)
    return slice(None), shard.part(d_out)
