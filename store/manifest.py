"""AdapterRecord: one stored version of an adapter, as written in its manifest."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from store.errors import DataCorruption

MANIFEST_FORMAT = 1


@dataclass(frozen=True)
class AdapterRecord:
    adapter_id: str
    version: int
    rank: int  # largest rank of any module
    lora_alpha: float
    target_modules: tuple[str, ...]
    size_bytes: int
    sha256: str  # lowercase hex of adapter_model.safetensors
    adapter_config_json: str
    description: str
    created_at: float  # seconds since the epoch, UTC
    dtype: str
    num_layers: int  # 1 + highest layer index with weights
    blob_key: str  # object that holds adapter_model.safetensors

    def to_json(self) -> bytes:
        doc = {"format": MANIFEST_FORMAT, **asdict(self)}
        doc["target_modules"] = list(self.target_modules)
        return json.dumps(doc, indent=1, sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes, key: str) -> AdapterRecord:
        try:
            doc = json.loads(raw)
            if doc.pop("format") != MANIFEST_FORMAT:
                raise ValueError("unknown manifest format")
            doc["target_modules"] = tuple(doc["target_modules"])
            return cls(**doc)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise DataCorruption(f"manifest {key} is unreadable: {exc}") from exc
