"""HostAdapter: a validated PEFT LoRA adapter whose weights stay where its bytes arrived.

Validation is store.peft's (the same checks the adapter store runs on upload). The adapter's
``adapter_model.safetensors`` bytes are kept as one uint8 tensor, ``raw``, and never copied on
the host: when the caller hands over pinned memory (the inference service's host arena), the
whole file goes to the device in one asynchronous copy, and dtype conversion, scale folding and
the pool layout happen there (adapter_copy.py). Each (layer, module) pair is described by where
its A and B lie in ``raw``; ``host_view`` gives a tensor view of them without copying.

Scales: the LoRA index holds one scale per (adapter, module). When rank_pattern or alpha_pattern
give a module different scales in different layers, the index scale is 1 and each layer's scale
is folded into its B when it is written; otherwise B is written as is and the index carries the
scale, so the common case computes exactly what PEFT computes.

Under tensor parallelism each rank's HostAdapter names its ``shard``: its plan is laid out for the
rank's module dimensions (models/shard.py), and adapter_copy.py writes only the rank's slice of
each A or B; ``dims`` and ``pairs`` still describe the whole file.

The pairs are held as one int64 table (``pair_table``, pack_pairs), not as a dict of named tuples:
an engine holds its adapters for as long as it runs, and each pair as a named tuple was three
objects that every full garbage collection scans (a Llama-7B S1 adapter: 384; with 500 such
adapters held, a full collection took 18 ms on a 2-core development machine, 0.3 ms with the
table). ``pairs`` builds the dict when asked (the torch copy path, tests).
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from kernels.lora_layout import (
    MODULE_ID,
    MODULES,
    PIECE_COLS,
    PIECE_DTYPES,
    AdapterPlan,
    plan_adapter,
)
from services.inference.engine.adapter_spec import AdapterSpec, validate_and_describe
from services.inference.models.shard import Shard, lora_slices, shard_base_shape
from store.peft import BaseModelShape

TORCH_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32}


class TensorRef(NamedTuple):
    """Where one LoRA matrix lies in the adapter's bytes."""

    offset: int  # bytes from the start of the file
    dtype: torch.dtype
    shape: tuple[int, int]


class LoraPair(NamedTuple):
    a: TensorRef  # [r_l, d_in]
    b: TensorRef  # [d_out, r_l]
    fold: float | None  # the layer's scale, multiplied into B when written; None = index scale


# pair_table's columns: layer, module id, then A's and B's byte offset, dtype (its code in the
# copy's pieces table, PIECE_DTYPES) and two dims each, then whether the pair folds a scale and
# that scale's float64 bits
PAIR_COLS = 12
_CODE_DTYPE = {code: dtype for dtype, code in PIECE_DTYPES.items()}
# Each dtype code's element size, indexed by code (the codes are 0, 1, ...).
_CODE_SIZES = np.array([_CODE_DTYPE[c].itemsize for c in range(len(_CODE_DTYPE))], dtype=np.int64)


def _pair_table(rows) -> torch.Tensor:
    """pair_table from (layer, module id, A offset, A dtype, A shape, B offset, B dtype, B shape,
    fold) rows, dtypes as torch dtypes."""
    table = [
        (layer, m, a_off, PIECE_DTYPES[a_dt], *a_shape, b_off, PIECE_DTYPES[b_dt], *b_shape,
         fold is not None, 0 if fold is None else int(np.float64(fold).view(np.int64)))
        for layer, m, a_off, a_dt, a_shape, b_off, b_dt, b_shape, fold in rows
    ]  # fmt: skip
    return torch.from_numpy(np.asarray(table, dtype=np.int64).reshape(-1, PAIR_COLS))


def pack_pairs(pairs: dict[tuple[int, int], LoraPair]) -> torch.Tensor:
    """``pairs`` as one int64 tensor [len(pairs), PAIR_COLS], rows by (layer, module)."""
    return _pair_table(
        (layer, m, p.a.offset, p.a.dtype, p.a.shape, p.b.offset, p.b.dtype, p.b.shape, p.fold)
        for (layer, m), p in sorted(pairs.items())
    )


def _fold(folds: int, bits: int) -> float | None:
    """A pair_table row's scale to fold into B (its last two columns); None: the index scale."""
    return float(np.int64(bits).view(np.float64)) if folds else None


def unpack_pairs(table: torch.Tensor) -> dict[tuple[int, int], LoraPair]:
    """pack_pairs' inverse."""
    out = {}
    for row in table.tolist():
        layer, m, a_off, a_dt, a0, a1, b_off, b_dt, b0, b1, folds, bits = row
        fold = _fold(folds, bits)
        a = TensorRef(a_off, _CODE_DTYPE[a_dt], (a0, a1))
        b = TensorRef(b_off, _CODE_DTYPE[b_dt], (b0, b1))
        out[layer, m] = LoraPair(a, b, fold)
    return out


@dataclass(frozen=True)
class HostAdapter:
    key: object  # the engine's AdapterKey
    ranks: tuple[int, ...]  # per module id: largest rank over layers, 0 = not targeted
    dims: tuple[tuple[int, int], ...]  # per module id: (d_in, d_out) in the base model
    scales: tuple[float, ...]  # per module id: the LoRA index scale
    pair_table: torch.Tensor  # where each (layer, module id)'s weights are (pack_pairs)
    plan: AdapterPlan  # where the weights go in the adapter's slot table
    num_layers: int  # the base model's layers (a pair may be missing for some)
    raw: torch.Tensor  # uint8 [file size]: the adapter file's bytes (pinned on CUDA)
    shard: Shard | None = None  # a tensor-parallel rank's share: the plan is the shard's

    @property
    def pairs(self) -> dict[tuple[int, int], LoraPair]:
        """(layer, module id) -> where its weights are: built from pair_table at each call."""
        return unpack_pairs(self.pair_table)

    @property
    def max_rank(self) -> int:
        return max(self.ranks)

    @property
    def nbytes(self) -> int:
        return self.raw.numel()

    def host_view(self, ref: TensorRef) -> torch.Tensor:
        return typed_view(self.raw, ref)

    @functools.cached_property
    def pieces(self) -> torch.Tensor | None:
        """The copy's pieces table for kernels/adapter_write.py (int64 [pieces, PIECE_COLS], on
        the host), built once: a piece per (layer, module, half) of the plan, zeros where the file
        has no pair. None when a matrix lies at an offset its dtype does not divide (then
        adapter_copy.py's torch path writes the adapter)."""
        return copy_pieces(self)


def typed_view(buf: torch.Tensor, ref: TensorRef) -> torch.Tensor:
    """``ref`` as a tensor over ``buf`` (uint8, host or device). A view when the offset is
    aligned to the dtype, as safetensors writers lay files out; a copy of that tensor if not."""
    size = ref.dtype.itemsize
    flat = buf[ref.offset : ref.offset + ref.shape[0] * ref.shape[1] * size]
    if ref.offset % size:
        flat = flat.clone()
    return flat.view(ref.dtype).view(ref.shape)


def _as_bytes(weights: bytes | bytearray | memoryview | torch.Tensor) -> torch.Tensor:
    if isinstance(weights, torch.Tensor):
        if weights.dtype != torch.uint8 or weights.dim() != 1 or weights.device.type != "cpu":
            raise TypeError("weights as a tensor must be 1-D uint8 on the CPU")
        return weights
    with warnings.catch_warnings():
        # bytes are read-only; nothing ever writes through this tensor.
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(memoryview(weights).cast("B"), dtype=torch.uint8)


def build_host_adapter(
    key: object,
    config_json: bytes | str | dict,
    weights: bytes | bytearray | memoryview | torch.Tensor,
    base: BaseModelShape,
    width: int,
    max_rank: int,
    pin: bool,
    spec: AdapterSpec | None = None,
    shard: Shard | None = None,
) -> HostAdapter:
    """Validate ``adapter_config.json`` + ``adapter_model.safetensors`` against the base model and
    describe its tensors in place. Raises AdapterFormatError / BaseModelMismatch. With ``pin``,
    bytes that are not page-locked already are copied once into pinned memory. ``spec``: what
    describe_adapter made of these bytes after validating them against this base model and
    max_rank (in another process: the fetch worker); then nothing is parsed or checked again.
    ``shard``: the tensor-parallel rank whose share this engine places (None: the whole)."""
    raw = _as_bytes(weights)
    if spec is None or spec.total_size != raw.numel():
        spec = validate_and_describe(config_json, memoryview(raw.numpy()), base, max_rank)
    if pin and not raw.is_pinned():
        raw = raw.pin_memory()
    # spec.pairs: adapter_spec.PairSpec's fields, sorted by (layer, module)
    pair_table = _pair_table(
        (layer, MODULE_ID[module], a_off, TORCH_DTYPES[a_dt], a_shape, b_off, TORCH_DTYPES[b_dt],
         b_shape, fold)
        for layer, module, a_off, a_dt, a_shape, b_off, b_dt, b_shape, fold in spec.pairs
    )  # fmt: skip
    ranks = tuple(spec.ranks.get(name, 0) for name in MODULES)
    scales = tuple(spec.scales.get(name, 0.0) for name in MODULES)
    dims = tuple(tuple(base.module_dims(name)) for name in MODULES)
    plan_base = base if shard is None else shard_base_shape(base, shard.size)
    plan = plan_for(spec, plan_base, width)
    return HostAdapter(
        key, ranks, dims, scales, pair_table, plan, num_layers=base.num_layers, raw=raw,
        shard=shard,
    )  # fmt: skip


def copy_pieces(host: HostAdapter) -> torch.Tensor | None:
    """HostAdapter.pieces: where each row of every (layer, module, half) comes from in the file
    and goes to in the adapter's slots (kernels/adapter_write.py documents the columns), by
    module, then layer, then half. A's rows are the file's rows (columns contiguous), Bᵀ's rows
    the file's B columns (stride r_l); a shard's slice of A's columns or B's rows moves the
    start. Array operations over pair_table for all pieces at once: a 7B model's rank-16 file on
    every module (448 pieces) took 0.35-0.63 ms built row by row in Python, on the step thread at
    the adapter's first copy (docs/kernels.md)."""
    pairs = host.pair_table.numpy()
    a_size, b_size = _CODE_SIZES[pairs[:, 3]], _CODE_SIZES[pairs[:, 7]]
    if (pairs[:, 2] % a_size).any() or (pairs[:, 6] % b_size).any():
        return None
    placed = [(m, p) for m, p in enumerate(host.plan.placements) if p is not None]
    num_layers = host.num_layers
    if not placed:
        return torch.zeros(0, PIECE_COLS, dtype=torch.int64)
    # Per placed module: its slots' geometry and the part of A's columns / B's rows it writes.
    geometry = []
    for m, place in placed:
        d_in, d_out = host.dims[m]
        a_part, b_part = range(d_in), range(d_out)
        if host.shard is not None:
            a_cols, b_rows = lora_slices(m, d_in, d_out, host.shard)
            a_part, b_part = a_part[a_cols], b_part[b_rows]
        geometry.append((place.a_offset, place.b_offset, place.rank, place.in_chunks,
                         place.out_chunks, a_part.start, len(a_part), b_part.start,
                         len(b_part)))  # fmt: skip
    columns = np.array(geometry, dtype=np.int64).T[:, :, None]  # each [modules, 1]
    a_slot, b_slot, rank, in_ch, out_ch, a_first, a_len, b_first, b_len = columns
    grid = np.full((len(host.plan.placements), num_layers), -1, dtype=np.int64)
    grid[pairs[:, 1], pairs[:, 0]] = np.arange(len(pairs))
    at = grid[[m for m, _ in placed]]  # [modules, layers]: the pair_table row, -1: none
    src = np.maximum(at, 0)  # a row for every piece; those of no pair are cleared below
    row = pairs[src]  # [modules, layers, PAIR_COLS]
    r_l = row[..., 4]
    # The pair's scale folded into B, as float32 bits (the index scale's pieces: 1.0).
    fold_bits = row[..., 11].view(np.float64).astype(np.float32).view(np.int32).astype(np.int64)
    out = np.zeros((len(placed), num_layers, 2, PIECE_COLS), dtype=np.int64)
    out[..., 0] = np.arange(num_layers)[None, :, None]
    out[..., 1] = (0, 1)
    for half, slot, chunks in ((0, a_slot, in_ch), (1, b_slot, out_ch)):
        out[:, :, half, 2], out[:, :, half, 3], out[:, :, half, 4] = slot, rank, chunks
    a, b = out[:, :, 0], out[:, :, 1]  # views
    a[..., 5] = row[..., 2] // a_size[src] + a_first
    a[..., 6], a[..., 7], a[..., 8], a[..., 9], a[..., 10] = row[..., 5], 1, r_l, a_len, row[..., 3]
    a[..., 11] = _F32_ONE
    b[..., 5] = row[..., 6] // b_size[src] + b_first * r_l
    b[..., 6], b[..., 7], b[..., 8], b[..., 9], b[..., 10] = 1, r_l, r_l, b_len, row[..., 7]
    b[..., 11] = np.where(row[..., 10] != 0, fold_bits, _F32_ONE)
    # A layer the module does not transform: no source, no valid rows (zeros written).
    out[at < 0, :, 5:] = (0, 0, 0, 0, 0, 0, _F32_ONE)
    table = torch.from_numpy(out.reshape(-1, PIECE_COLS))
    # Pinned beside pinned bytes: a copy from pageable memory would wait for the copy stream.
    return table.pin_memory() if host.raw.is_pinned() else table


# 1.0 as float32, its bits as an int (a pieces column: kernels/adapter_write.py).
_F32_ONE = int(np.float32(1.0).view(np.int32))


def plan_for(spec: AdapterSpec, base: BaseModelShape, width: int) -> AdapterPlan:
    """Where a described adapter's weights go in its slot table (and so how many it needs)."""
    ranks = {MODULE_ID[name]: r for name, r in spec.ranks.items() if r}
    dims = {m: tuple(base.module_dims(name)) for m, name in enumerate(MODULES)}
    return plan_adapter(ranks, dims, width)
