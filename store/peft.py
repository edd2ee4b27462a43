"""PEFT LoRA adapters: the format checks shared by the adapter store and the inference engine.

An adapter is ``adapter_config.json`` plus ``adapter_model.safetensors``. This module parses both
(see lora_config.py and safetensors_header.py) and checks that they agree with each other and,
when it is known, with the base model. Nothing here imports torch or grpc.
"""

from __future__ import annotations

from collections import defaultdict

from store.base_model import SUPPORTED_MODULES, BaseModelShape, ModuleDims
from store.format_errors import AdapterFormatError, BaseModelMismatch
from store.lora_config import LoraAdapterConfig, module_key, parse_adapter_config
from store.safetensors_header import (
    DTYPE_SIZES,
    MAX_HEADER_BYTES,
    SafetensorsHeader,
    SafetensorsHeaderReader,
    TensorEntry,
    parse_safetensors_header,
)
from store.tensor_values import check_values

__all__ = [
    "check_adapter_file",
    "lora_pairs",
    "DTYPE_SIZES",
    "MAX_HEADER_BYTES",
    "SUPPORTED_MODULES",
    "AdapterFormatError",
    "BaseModelMismatch",
    "BaseModelShape",
    "LoraAdapterConfig",
    "ModuleDims",
    "SafetensorsHeader",
    "SafetensorsHeaderReader",
    "TensorEntry",
    "module_key",
    "parse_adapter_config",
    "parse_safetensors_header",
    "validate_adapter",
]

# Dimensions that must be equal across modules: (module, "in" | "out") members of each group.
_DIM_GROUPS = {
    "hidden size": (
        ("q_proj", "in"),
        ("k_proj", "in"),
        ("v_proj", "in"),
        ("gate_proj", "in"),
        ("up_proj", "in"),
        ("o_proj", "out"),
        ("down_proj", "out"),
    ),
    "attention width": (("q_proj", "out"), ("o_proj", "in")),
    "key/value width": (("k_proj", "out"), ("v_proj", "out")),
    "intermediate size": (("gate_proj", "out"), ("up_proj", "out"), ("down_proj", "in")),
}
_MAX_LISTED = 4


def _listing(pairs: set[tuple[int, str]]) -> str:
    shown = ", ".join(f"layer {layer} {module}" for layer, module in sorted(pairs)[:_MAX_LISTED])
    more = len(pairs) - _MAX_LISTED
    return shown + (f" and {more} more" if more > 0 else "")


def lora_pairs(header: SafetensorsHeader) -> dict[tuple[int, str], dict[str, TensorEntry]]:
    """The header's tensors by (layer, module), then "A" / "B"; a half pair is an error."""
    pairs: dict[tuple[int, str], dict[str, TensorEntry]] = defaultdict(dict)
    for tensor in header.tensors:
        kinds = pairs[(tensor.layer, tensor.module)]
        other = kinds.setdefault(tensor.kind, tensor)
        if other is not tensor:  # one silently replacing the other would serve a third model
            raise AdapterFormatError(
                f"tensors {other.name!r} and {tensor.name!r} are both layer {tensor.layer} "
                f"{tensor.module} lora_{tensor.kind}"
            )
    for (layer, module), kinds in pairs.items():
        for kind, other in (("A", "B"), ("B", "A")):
            if kind in kinds and other not in kinds:
                raise AdapterFormatError(
                    f"layer {layer} {module} has lora_{kind} but no lora_{other}"
                )
    return pairs


def _check_coverage(
    config: LoraAdapterConfig,
    present: set[tuple[int, str]],
    num_layers: int,
    error: type[AdapterFormatError],
) -> None:
    """The pairs present must be exactly those the config targets in layers [0, num_layers)."""
    layers = range(num_layers)
    expected = {(i, m) for i in layers for m in SUPPORTED_MODULES if config.targets(i, m)}
    extra = present - expected
    if extra:
        raise error(
            f"the file has weights that adapter_config.json does not target in a "
            f"{num_layers}-layer model: {_listing(extra)}"
        )
    missing = expected - present
    if missing:
        raise error(
            f"adapter_config.json targets modules the file has no weights for: {_listing(missing)}"
        )


def _check_layers(config: LoraAdapterConfig, last: int, base: BaseModelShape) -> None:
    beyond = sorted(i for i in config.layers_to_transform or () if i >= base.num_layers)
    if beyond:
        raise BaseModelMismatch(
            f"layers_to_transform names layers {beyond} but the base model has "
            f"{base.num_layers} layers"
        )
    if last >= base.num_layers:
        raise BaseModelMismatch(
            f"the adapter has weights for layer {last} but the base model has "
            f"{base.num_layers} layers"
        )


def _check_shapes(
    config: LoraAdapterConfig,
    pairs: dict[tuple[int, str], dict[str, TensorEntry]],
    base: BaseModelShape | None,
) -> None:
    seen: dict[tuple[str, str], tuple[int, str]] = {}  # (module, side) -> (size, tensor name)
    for (layer, module), kinds in sorted(pairs.items()):
        a, b = kinds["A"], kinds["B"]
        rank = config.rank(layer, module)
        if a.shape[0] != rank or b.shape[1] != rank:
            raise AdapterFormatError(
                f"layer {layer} {module}: lora_A is {list(a.shape)} and lora_B is "
                f"{list(b.shape)} but the rank from adapter_config.json is {rank} "
                f"(A must be [r, d_in], B [d_out, r])"
            )
        for side, size, name in (("in", a.shape[1], a.name), ("out", b.shape[0], b.name)):
            first = seen.setdefault((module, side), (size, name))
            if first[0] != size:
                raise AdapterFormatError(
                    f"{name} has d_{side}={size} but {first[1]} has {first[0]}"
                )
    for group, members in _DIM_GROUPS.items():
        sizes = {seen[m] for m in members if m in seen}
        if len({size for size, _ in sizes}) > 1:
            detail = ", ".join(f"{name}: {size}" for size, name in sorted(sizes))
            raise AdapterFormatError(f"the {group} differs between modules ({detail})")
    if base is None:
        return
    in_module_order = sorted(seen.items(), key=lambda kv: SUPPORTED_MODULES.index(kv[0][0]))
    for (module, side), (size, name) in in_module_order:
        dims = base.module_dims(module)
        want = dims.d_in if side == "in" else dims.d_out
        if size != want:
            raise BaseModelMismatch(
                f"{name} has d_{side}={size} but the base model's {module} has d_{side}={want}"
            )


def validate_adapter(
    config: LoraAdapterConfig, header: SafetensorsHeader, base: BaseModelShape | None = None
) -> None:
    """Check that the weights are exactly the pairs the config targets, with its ranks, and
    (given the base model) that every layer and dimension fits it. Raises AdapterFormatError or
    its subclass BaseModelMismatch."""
    pairs = lora_pairs(header)
    present = set(pairs)
    last = max(layer for layer, _ in present)
    # First on its own (the layers it has weights for), so that a malformed adapter is an
    # AdapterFormatError whatever the base; then against the base model.
    _check_coverage(config, present, last + 1, AdapterFormatError)
    if base is not None:
        _check_layers(config, last, base)
        _check_coverage(config, present, base.num_layers, BaseModelMismatch)
    _check_shapes(config, pairs, base)


def check_adapter_file(
    config: LoraAdapterConfig, data: memoryview | bytes, base: BaseModelShape | None
) -> SafetensorsHeader:
    """The header of a whole ``adapter_model.safetensors`` (``data``), validated with its config
    (and against the base model when given), every value finite. Raises AdapterFormatError /
    BaseModelMismatch."""
    header = parse_safetensors_header(data)
    if len(data) != header.total_size:
        raise AdapterFormatError(
            f"adapter_model.safetensors is {len(data)} bytes; its header describes "
            f"{header.total_size}"
        )
    validate_adapter(config, header, base)
    check_values(header, data)
    return header
