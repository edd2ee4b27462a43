"""Synthetic PEFT LoRA adapters (random weights, exact PEFT file format) for tests and benchmarks.

Written with numpy and the safetensors layout directly, so that tests can also build files that
are subtly wrong. bf16 values are float32 values with the low 16 bits dropped.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Iterator, Mapping
from typing import NamedTuple

import numpy as np

from store.base_model import SUPPORTED_MODULES, BaseModelShape
from store.lora_config import module_key

_NUMPY = {"F16": np.float16, "F32": np.float32}


class AdapterFiles(NamedTuple):
    config_json: bytes
    safetensors: bytes


def tensor_name(layer: int, module: str, kind: str) -> str:
    return f"base_model.model.{module_key(layer, module)}.lora_{kind}.weight"


def _raw(values: np.ndarray, dtype: str) -> bytes:
    if dtype == "BF16":
        bits = values.astype(np.float32).view(np.uint32) >> 16
        return bits.astype("<u2").tobytes()
    return values.astype(_NUMPY[dtype]).astype(np.dtype(_NUMPY[dtype]).newbyteorder("<")).tobytes()


def safetensors_header_bytes(entries: Mapping[str, tuple[str, tuple[int, ...], int]]) -> bytes:
    """Prefix + JSON header for ``{name: (dtype, shape, nbytes)}`` laid out in the given order."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (dtype, shape, nbytes) in entries.items():
        header[name] = {
            "dtype": dtype,
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # safetensors pads the header to 8 bytes
    return struct.pack("<Q", len(text)) + text


def safetensors_bytes(tensors: Mapping[str, tuple[str, np.ndarray]]) -> bytes:
    """A safetensors file holding ``{name: (dtype, 2-D array)}``."""
    raws = {name: _raw(values, dtype) for name, (dtype, values) in tensors.items()}
    entries = {
        name: (tensors[name][0], tensors[name][1].shape, len(raw)) for name, raw in raws.items()
    }
    return safetensors_header_bytes(entries) + b"".join(raws.values())


def lora_config_json(rank: int, alpha: float, modules: Iterable[str], **extra: object) -> bytes:
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": list(modules),
        "bias": "none",
        "use_dora": False,
        "use_rslora": False,
        "modules_to_save": None,
        "layers_to_transform": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }
    config.update(extra)
    return json.dumps(config, indent=2).encode()


def lora_tensors(
    base: BaseModelShape,
    rank: int,
    modules: Iterable[str] = SUPPORTED_MODULES,
    dtype: str = "F16",
    seed: int = 0,
) -> Iterator[tuple[str, tuple[str, np.ndarray]]]:
    """(name, (dtype, values)) of every LoRA pair, layer by layer, in PEFT's naming."""
    rng = np.random.default_rng(seed)
    for layer in range(base.num_layers):
        for module in modules:
            d_in, d_out = base.module_dims(module)
            a = rng.standard_normal((rank, d_in), dtype=np.float32) / np.sqrt(d_in)
            b = rng.standard_normal((d_out, rank), dtype=np.float32) * 0.01
            yield tensor_name(layer, module, "A"), (dtype, a)
            yield tensor_name(layer, module, "B"), (dtype, b)


def synthetic_adapter(
    base: BaseModelShape,
    rank: int = 8,
    alpha: float = 16.0,
    modules: Iterable[str] = SUPPORTED_MODULES,
    dtype: str = "F16",
    seed: int = 0,
) -> AdapterFiles:
    """A random adapter on every layer of ``base`` for the given modules."""
    modules = tuple(modules)
    tensors = dict(lora_tensors(base, rank, modules, dtype, seed))
    return AdapterFiles(lora_config_json(rank, alpha, modules), safetensors_bytes(tensors))
