"""The header of a PEFT adapter_model.safetensors: parsed whole or incrementally as bytes arrive.

File format: an 8-byte little-endian header length N, N bytes of JSON
(``{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}}``), then the data
section. Offsets are relative to the data section. A valid file's tensors tile the data section
exactly: sorted by offset, each begins where the previous ended, and the last ends at the file's
end, so the header alone fixes the file's total size.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass

from store.base_model import ATTENTION_MODULES, MAX_LAYERS, MLP_MODULES
from store.format_errors import AdapterFormatError

MAX_HEADER_BYTES = 1 << 20
DTYPE_SIZES = {"F16": 2, "BF16": 2, "F32": 4}
# Exactly the names PEFT saves and loads: PEFT finds a tensor's module by the name's path, and
# torch names the layers of a ModuleList by str(index), so a layer index is canonical ASCII
# decimal (no leading zeros, no other digits: "layers.03" and "layers.\u0663" name no module and
# PEFT drops them). One tensor then has exactly one name.
_NAME = re.compile(
    r"base_model\.model\.model\.layers\.(?P<layer>0|[1-9][0-9]*)\.(?P<block>self_attn|mlp)\."
    r"(?P<module>[A-Za-z0-9_]+)\.lora_(?P<kind>[AB])\.weight",
    re.ASCII,
)
_LAYER = re.compile(r"\.layers\.([^.]+)\.")
_EXAMPLE = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


@dataclass(frozen=True)
class TensorEntry:
    name: str
    layer: int
    module: str
    kind: str  # "A" ([r, d_in]) or "B" ([d_out, r])
    dtype: str  # "F16" | "BF16" | "F32"
    shape: tuple[int, int]
    begin: int  # byte offsets relative to the data section
    end: int


@dataclass(frozen=True)
class SafetensorsHeader:
    data_offset: int  # 8 + header length: where the data section starts in the file
    tensors: tuple[TensorEntry, ...]  # sorted by begin
    total_size: int  # exact size the whole file must have

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(sorted({t.layer for t in self.tensors}))


def _parse_name(name: str) -> tuple[int, str, str]:
    match = _NAME.fullmatch(name)
    if match is None:
        layer = _LAYER.search(name)
        canonical = layer is not None and name[: layer.start(1)] + "0" + name[layer.end(1) :]
        if layer is not None and layer[1].isdecimal() and _NAME.fullmatch(canonical):
            raise AdapterFormatError(
                f"tensor {name!r}: layer index {layer[1]!r} is not written as PEFT writes "
                f"layer indices (ASCII digits without leading zeros), so PEFT would not load it"
            )
        for unsupported in ("embed_tokens", "lm_head"):
            if unsupported in name:
                raise AdapterFormatError(f"LoRA on {unsupported} is not supported (tensor {name})")
        if "lora_magnitude_vector" in name:
            raise AdapterFormatError(f"DoRA weights are not supported (tensor {name})")
        raise AdapterFormatError(
            f"tensor {name!r} is not a LoRA weight of a decoder projection "
            f"(expected names like {_EXAMPLE})"
        )
    module, block = match["module"], match["block"]
    expected_block = (
        "self_attn" if module in ATTENTION_MODULES else "mlp" if module in MLP_MODULES else None
    )
    if expected_block is None:
        raise AdapterFormatError(
            f"tensor {name!r} targets {module}, which is not a supported module"
        )
    if block != expected_block:
        raise AdapterFormatError(f"tensor {name!r}: {module} belongs under {expected_block}")
    digits = match["layer"]
    if len(digits) > len(str(MAX_LAYERS)) or int(digits) >= MAX_LAYERS:
        raise AdapterFormatError(
            f"tensor {name!r}: layer {digits[:12]} is beyond the largest layer index "
            f"supported ({MAX_LAYERS - 1})"
        )
    return int(digits), module, match["kind"]


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in pairs:
        if key in out:
            raise AdapterFormatError(f"safetensors header names {key!r} twice")
        out[key] = value
    return out


def _entry(name: str, info: object) -> TensorEntry:
    if not isinstance(info, dict):
        raise AdapterFormatError(f"safetensors header entry {name!r} is not an object")
    layer, module, kind = _parse_name(name)
    dtype = info.get("dtype")
    if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
        raise AdapterFormatError(
            f"tensor {name} has dtype {dtype!r}; supported are {', '.join(DTYPE_SIZES)}"
        )
    shape = info.get("shape")
    if (
        not isinstance(shape, list)
        or len(shape) != 2
        or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in shape)
    ):
        raise AdapterFormatError(f"tensor {name} has shape {shape!r}; expected two positive dims")
    offsets = info.get("data_offsets")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise AdapterFormatError(f"tensor {name} has bad data_offsets {offsets!r}")
    begin, end = offsets
    expected = shape[0] * shape[1] * DTYPE_SIZES[dtype]
    if end - begin != expected:
        raise AdapterFormatError(
            f"tensor {name}: data_offsets span {end - begin} bytes but {dtype} {shape} "
            f"needs {expected}"
        )
    return TensorEntry(name, layer, module, kind, dtype, (shape[0], shape[1]), begin, end)


def _check_length(length: int, max_header_bytes: int) -> None:
    if length < 2:
        raise AdapterFormatError(f"safetensors header length {length} is too short")
    if length > max_header_bytes:
        raise AdapterFormatError(
            f"safetensors header is {length} bytes; at most {max_header_bytes} allowed"
        )


def _parse_json(raw: bytes, data_offset: int) -> SafetensorsHeader:
    try:
        doc = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterFormatError(f"safetensors header is not valid JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise AdapterFormatError("safetensors header must be a JSON object")
    metadata = doc.pop("__metadata__", None)
    if metadata is not None and not (
        isinstance(metadata, dict)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
    ):
        raise AdapterFormatError("safetensors __metadata__ must map strings to strings")
    if not doc:
        raise AdapterFormatError("adapter_model.safetensors holds no tensors")
    tensors = sorted((_entry(name, info) for name, info in doc.items()), key=lambda t: t.begin)
    position = 0
    for tensor in tensors:
        if tensor.begin < position:
            raise AdapterFormatError(f"tensor {tensor.name} overlaps the tensor before it")
        if tensor.begin > position:
            raise AdapterFormatError(
                f"tensor {tensor.name} leaves a gap of {tensor.begin - position} bytes before it"
            )
        position = tensor.end
    return SafetensorsHeader(data_offset, tuple(tensors), data_offset + position)


def parse_safetensors_header(
    buf: bytes | memoryview, max_header_bytes: int = MAX_HEADER_BYTES
) -> SafetensorsHeader:
    """Parse the header from the start of a file (``buf`` may hold more than the header)."""
    buf = bytes(buf[: 8 + max_header_bytes])
    if len(buf) < 8:
        raise AdapterFormatError("adapter_model.safetensors is shorter than its 8-byte prefix")
    (length,) = struct.unpack("<Q", buf[:8])
    _check_length(length, max_header_bytes)
    if len(buf) < 8 + length:
        raise AdapterFormatError(f"adapter_model.safetensors ends inside its {length}-byte header")
    return _parse_json(buf[8 : 8 + length], 8 + length)


class SafetensorsHeaderReader:
    """Collects the header from a stream of chunks; holds at most the header in memory."""

    def __init__(self, max_header_bytes: int = MAX_HEADER_BYTES) -> None:
        self._max = max_header_bytes
        self._buf = bytearray()
        self._need = 8  # bytes of the file needed before the next step: prefix, then header
        self.header: SafetensorsHeader | None = None

    def feed(self, chunk: bytes | memoryview) -> SafetensorsHeader | None:
        """Take the next bytes of the file; returns the header once it is complete."""
        while self.header is None and chunk:
            take = self._need - len(self._buf)
            self._buf += chunk[:take]
            chunk = chunk[take:]
            if len(self._buf) < self._need:
                return None
            if self._need == 8:
                (length,) = struct.unpack("<Q", self._buf)
                _check_length(length, self._max)
                self._need = 8 + length
            else:
                self.header = _parse_json(bytes(self._buf[8:]), self._need)
                self._buf = bytearray()
        return self.header
