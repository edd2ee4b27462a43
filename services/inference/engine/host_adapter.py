"""HostAdapter: a validated PEFT LoRA adapter, its weights in host memory, laid out for the pool.

Validation is store.peft's (the same checks the adapter store runs on upload); this module only
turns the validated bytes into per-(layer, module) tensors in the pool's dtype, pinned when the
pool is on CUDA so the host->pool copy can be asynchronous, and plans the adapter's place in the
pool with kernels.lora_layout.

Scales: the LoRA index holds one scale per (adapter, module). When rank_pattern or alpha_pattern
give a module different scales in different layers, the index scale is 1 and each layer's scale
is folded into its B; otherwise B is kept as is and the index carries the scale, so the common
case computes exactly what PEFT computes.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import NamedTuple

import torch

from kernels.lora_layout import MODULE_ID, MODULES, NUM_MODULES, AdapterPlan, plan_adapter
from store.peft import (
    AdapterFormatError,
    BaseModelShape,
    parse_adapter_config,
    parse_safetensors_header,
    validate_adapter,
)

_TORCH_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32}


class LoraPair(NamedTuple):
    a: torch.Tensor  # [r_l, d_in]
    b: torch.Tensor  # [d_out, r_l], the layer's scale folded in when scales differ by layer


@dataclass(frozen=True)
class HostAdapter:
    key: object  # the engine's AdapterKey
    ranks: tuple[int, ...]  # per module id: largest rank over layers, 0 = not targeted
    dims: tuple[tuple[int, int], ...]  # per module id: (d_in, d_out) in the base model
    scales: tuple[float, ...]  # per module id: the LoRA index scale
    pairs: dict[tuple[int, int], LoraPair]  # (layer, module id) -> weights
    plan: AdapterPlan  # where the weights go in the adapter's slot table
    nbytes: int  # host memory held by the weights

    @property
    def max_rank(self) -> int:
        return max(self.ranks)


def _tensor(buf: memoryview, offset: int, dtype: str, shape: tuple[int, int]) -> torch.Tensor:
    with warnings.catch_warnings():
        # The buffer may be read-only (bytes); the view is copied before anyone could write.
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(
            buf, dtype=_TORCH_DTYPES[dtype], count=shape[0] * shape[1], offset=offset
        )
    return flat.view(shape)


def build_host_adapter(
    key: object,
    config_json: bytes | str | dict,
    weights: bytes | bytearray | memoryview,
    base: BaseModelShape,
    width: int,
    max_rank: int,
    dtype: torch.dtype,
    pin: bool,
) -> HostAdapter:
    """Validate ``adapter_config.json`` + ``adapter_model.safetensors`` against the base model and
    copy the weights into host tensors. Raises AdapterFormatError / BaseModelMismatch."""
    config = parse_adapter_config(config_json, max_rank=max_rank)
    buf = memoryview(weights).cast("B")
    header = parse_safetensors_header(buf)
    if len(buf) != header.total_size:
        raise AdapterFormatError(
            f"adapter_model.safetensors is {len(buf)} bytes; its header describes "
            f"{header.total_size}"
        )
    validate_adapter(config, header, base)

    raw: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
    for entry in header.tensors:
        t = _tensor(buf, header.data_offset + entry.begin, entry.dtype, entry.shape)
        raw.setdefault((entry.layer, MODULE_ID[entry.module]), {})[entry.kind] = t

    ranks = [0] * NUM_MODULES
    layer_scales: list[set[float]] = [set() for _ in range(NUM_MODULES)]
    for (layer, m), ab in raw.items():
        ranks[m] = max(ranks[m], ab["A"].shape[0])
        layer_scales[m].add(config.scale(layer, MODULES[m]))
    uniform = [len(s) <= 1 for s in layer_scales]
    scales = tuple(
        (next(iter(s)) if s else 0.0) if uniform[m] else 1.0 for m, s in enumerate(layer_scales)
    )

    pairs: dict[tuple[int, int], LoraPair] = {}
    nbytes = 0
    for (layer, m), ab in sorted(raw.items()):
        a = ab["A"].to(dtype=dtype, copy=True)
        b = ab["B"]
        if not uniform[m]:
            b = b.float() * config.scale(layer, MODULES[m])
        b = b.to(dtype=dtype, copy=True)
        if pin:
            a, b = a.pin_memory(), b.pin_memory()
        pairs[(layer, m)] = LoraPair(a, b)
        nbytes += a.nbytes + b.nbytes

    dims = tuple(tuple(base.module_dims(name)) for name in MODULES)
    plan = plan_adapter({m: r for m, r in enumerate(ranks) if r}, dict(enumerate(dims)), width)
    return HostAdapter(key, tuple(ranks), dims, scales, pairs, plan, nbytes)
