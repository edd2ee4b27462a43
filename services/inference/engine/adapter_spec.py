"""AdapterSpec: where a validated adapter's tensors lie in its file, and its ranks and scales.

Computed without torch from the parsed config and safetensors header, so that the fetch worker
process computes it next to the validation and hands it over in plain tuples: a Llama-7B
rank-16 adapter (224 LoRA pairs) then costs the service process, whose GIL the engine's step
thread needs, about 0.9 ms (unpickle 0.3, HostAdapter 0.6) instead of 2.2 ms for unpickling its
parsed header and describing it there (a 2-core development machine). host_adapter.py turns a
spec into a HostAdapter.

Scales follow host_adapter.py's rule: a module whose layers all share one scale carries it in
the LoRA index; otherwise the index scale is 1 and each layer's scale is folded into its B.
"""

from __future__ import annotations

from typing import NamedTuple

from store.lora_config import LoraAdapterConfig
from store.peft import BaseModelShape, check_adapter_file, lora_pairs, parse_adapter_config
from store.safetensors_header import SafetensorsHeader


class PairSpec(NamedTuple):
    """One layer's LoRA pair of one module: byte offsets in the file, dtypes, shapes."""

    layer: int
    module: str
    a_offset: int
    a_dtype: str  # "F16" | "BF16" | "F32"
    a_shape: tuple[int, int]  # [r, d_in]
    b_offset: int
    b_dtype: str
    b_shape: tuple[int, int]  # [d_out, r]
    fold: float | None  # this layer's scale, folded into B; None = the module's index scale


class AdapterSpec(NamedTuple):
    total_size: int  # bytes of adapter_model.safetensors
    ranks: dict[str, int]  # module -> largest rank over its layers (targeted modules only)
    scales: dict[str, float]  # module -> the LoRA index scale (targeted modules only)
    # PairSpec's fields as plain tuples, sorted by (layer, module) (PairSpec(*p) names one). A
    # plain tuple of ints, strings, floats and None is one the garbage collector stops tracking
    # (a named tuple it never does), and the service's host cache holds a spec for every adapter
    # it caches: 2000 Llama-7B S1 specs of named tuples were 260,000 objects that every full
    # collection of its event loop's thread scanned.
    pairs: tuple[tuple, ...]


def describe_adapter(config: LoraAdapterConfig, header: SafetensorsHeader) -> AdapterSpec:
    """The spec of an adapter whose config and header passed validate_adapter."""
    by_pair = lora_pairs(header)
    ranks: dict[str, int] = {}
    layer_scales: dict[str, set[float]] = {}
    for (layer, module), ab in by_pair.items():
        ranks[module] = max(ranks.get(module, 0), ab["A"].shape[0])
        layer_scales.setdefault(module, set()).add(config.scale(layer, module))
    uniform = {module: len(s) == 1 for module, s in layer_scales.items()}
    scales = {m: next(iter(s)) if uniform[m] else 1.0 for m, s in layer_scales.items()}
    start = header.data_offset
    pairs = tuple(
        (
            layer,
            module,
            start + ab["A"].begin,
            ab["A"].dtype,
            tuple(ab["A"].shape),
            start + ab["B"].begin,
            ab["B"].dtype,
            tuple(ab["B"].shape),
            None if uniform[module] else config.scale(layer, module),
        )  # fmt: skip
        for (layer, module), ab in sorted(by_pair.items())
    )
    return AdapterSpec(header.total_size, ranks, scales, pairs)


def validate_and_describe(
    config_json: bytes | str | dict, data: memoryview, base: BaseModelShape, max_rank: int
) -> AdapterSpec:
    """Check an adapter's config and file against the base model and rank limit (store.peft)
    and describe its tensors. Raises AdapterFormatError (BaseModelMismatch included)."""
    config = parse_adapter_config(config_json, max_rank=max_rank)
    return describe_adapter(config, check_adapter_file(config, data, base))
