"""Tiny models and adapters for the inference tests, built once per test session.

tests/inference/conftest.py re-exports the `tiny_models` fixture, so tests under
tests/inference just ask for it:

    def test_something(tiny_models):
        model_dir = tiny_models.model("tiny-llama")                # cached per session
        sharded = tiny_models.model("tiny-qwen2", shards=3)
        adapter_dir = tiny_models.adapter("tiny-llama", "r8")      # a PARITY_ADAPTERS name
        custom = tiny_models.adapter("tiny-llama", AdapterSpec(rank=2, target_modules=("o_proj",)))

PARITY_ADAPTERS is the issue's parity set: ranks 4, 8, 16 and 32 over different target modules,
one with rslora, one with rank_pattern and alpha_pattern. Each spec seeds its own weights, so two
adapters never share tensors. Directories live under one pytest tmp dir for the session.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from services.inference.tiny_model import make_adapter, make_model


@dataclass(frozen=True)
class AdapterSpec:
    """Arguments of tiny_model.make_adapter, hashable so specs can key the cache."""

    rank: int = 8
    lora_alpha: float = 16
    target_modules: tuple[str, ...] = ("q_proj", "v_proj")
    use_rslora: bool = False
    rank_pattern: tuple[tuple[str, int], ...] = ()
    alpha_pattern: tuple[tuple[str, float], ...] = ()
    layers_to_transform: tuple[int, ...] | None = None
    seed: int = 0


PARITY_ADAPTERS: dict[str, AdapterSpec] = {
    "r4": AdapterSpec(rank=4, lora_alpha=8, target_modules=("q_proj", "v_proj"), seed=4),
    "r8": AdapterSpec(
        rank=8, lora_alpha=16, target_modules=("q_proj", "k_proj", "v_proj", "o_proj"), seed=8
    ),
    # rank_pattern/alpha_pattern: down_proj gets rank 4 and gate_proj alpha 8.
    "r16": AdapterSpec(
        rank=16,
        lora_alpha=32,
        target_modules=("gate_proj", "up_proj", "down_proj"),
        rank_pattern=(("down_proj", 4),),
        alpha_pattern=(("gate_proj", 8.0),),
        seed=16,
    ),
    "r32": AdapterSpec(
        rank=32,
        lora_alpha=16,
        target_modules=(
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ),
        use_rslora=True,
        seed=32,
    ),
}


class TinyModels:
    """Builds models and adapters on first request and returns the cached path afterwards."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._models: dict[tuple[str, int, int], Path] = {}
        self._adapters: dict[tuple[str, AdapterSpec], Path] = {}

    def model(self, preset: str = "tiny-llama", seed: int = 0, shards: int = 1) -> Path:
        key = (preset, seed, shards)
        if key not in self._models:
            out = self.root / f"{preset}-s{seed}-x{shards}"
            self._models[key] = make_model(out, preset=preset, seed=seed, shards=shards)
        return self._models[key]

    def adapter(self, preset: str, spec: str | AdapterSpec) -> Path:
        """An adapter for the (seed 0, unsharded) model of preset; spec names PARITY_ADAPTERS."""
        spec = PARITY_ADAPTERS[spec] if isinstance(spec, str) else spec
        key = (preset, spec)
        if key not in self._adapters:
            out = self.root / f"{preset}-adapters" / f"a{len(self._adapters)}"
            self._adapters[key] = make_adapter(
                self.model(preset),
                out,
                rank=spec.rank,
                lora_alpha=spec.lora_alpha,
                target_modules=spec.target_modules,
                use_rslora=spec.use_rslora,
                rank_pattern=dict(spec.rank_pattern),
                alpha_pattern=dict(spec.alpha_pattern),
                layers_to_transform=spec.layers_to_transform,
                seed=spec.seed,
            )
        return self._adapters[key]


_session: TinyModels | None = None


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> TinyModels:
    # A module that imports this fixture gets its own fixture definition; the module-level
    # instance keeps one cache for the whole session even then.
    global _session
    if _session is None or _session.root.parent != tmp_path_factory.getbasetemp():
        _session = TinyModels(tmp_path_factory.mktemp("tiny_models"))
    return _session
