"""ModelConfig: what the engine needs from a Hugging Face config.json, checked on the way in."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.inference.engine.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
ROPE_TYPES = ("default", "linear", "llama3")
DEFAULT_ROPE_THETA = 10000.0
CONFIG = "config.json"
# How models/loader.py gets the weights: the directory's checkpoint, or drawn at load.
LOAD_FORMATS = ("safetensors", "random")


@dataclass(frozen=True)
class RopeConfig:
    rope_type: str  # one of ROPE_TYPES
    theta: float
    factor: float = 1.0  # linear and llama3
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 8192  # llama3


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2 always; Llama/Mistral with attention_bias
    o_bias: bool  # Llama/Mistral with attention_bias
    mlp_bias: bool  # Llama with mlp_bias
    sliding_window: int | None  # attention is exact only for contexts up to this length

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Also the pool's row width W: one token's K (or V) in one layer."""
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ModelConfig:
        return cls.from_dict(read_config_json(model_dir), source=str(Path(model_dir) / CONFIG))

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], source: str = "config.json") -> ModelConfig:
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"{source}: architecture {arch!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ModelLoadError(f"{source}: hidden_act {act!r} is not supported (only silu)")

        def need(key: str) -> Any:
            if key not in cfg:
                raise ModelLoadError(f"{source}: required key {key!r} is missing")
            return cfg[key]

        hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
        qwen2 = arch == "Qwen2ForCausalLM"
        attention_bias = bool(cfg.get("attention_bias", False))
        sliding = cfg.get("sliding_window")
        if qwen2 and not cfg.get("use_sliding_window", False):
            sliding = None  # Qwen2 keeps the key but attends to everything unless told to
        return cls(
            architecture=arch,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            rope=_rope_config(cfg, source),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=qwen2 or attention_bias,
            o_bias=attention_bias and not qwen2,
            mlp_bias=bool(cfg.get("mlp_bias", False)) and not qwen2,
            sliding_window=int(sliding) if sliding else None,
        )

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"num_attention_heads {self.num_heads} is not a multiple of "
                f"num_key_value_heads {self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ModelLoadError(f"head_dim {self.head_dim} must be even for rotary embeddings")


def read_config_json(model_dir: str | Path) -> dict[str, Any]:
    """The model directory's config.json as a dict (ModelLoadError if missing or not JSON)."""
    path = Path(model_dir) / CONFIG
    if not path.is_file():
        raise ModelLoadError(f"{path} is missing: not a Hugging Face model directory")
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from e


def _rope_config(cfg: dict[str, Any], source: str) -> RopeConfig:
    # transformers 5 writes rope_parameters (theta inside); older configs write rope_scaling
    # next to a top-level rope_theta. Read both; rope_parameters wins.
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ModelLoadError(f"{source}: rope_parameters must be an object, got {params!r}")
    if any(isinstance(v, dict) for v in params.values()):
        raise ModelLoadError(f"{source}: per-layer-type rope parameters are not supported")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ModelLoadError(
            f"{source}: rope type {rope_type!r} is not supported "
            f"(supported: {', '.join(ROPE_TYPES)})"
        )
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ModelLoadError(f"{source}: partial_rotary_factor {partial} is not supported")
    theta = float(params.get("rope_theta", cfg.get("rope_theta", DEFAULT_ROPE_THETA)))
    if rope_type == "default":
        return RopeConfig("default", theta)
    if "factor" not in params:
        raise ModelLoadError(f"{source}: rope type {rope_type!r} needs a 'factor'")
    if rope_type == "linear":
        return RopeConfig("linear", theta, factor=float(params["factor"]))
    original = cfg.get("original_max_position_embeddings") or params.get(
        "original_max_position_embeddings", cfg.get("max_position_embeddings", 8192)
    )
    try:
        return RopeConfig(
            "llama3",
            theta,
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(original),
        )
    except KeyError as e:
        raise ModelLoadError(f"{source}: llama3 rope scaling needs {e.args[0]!r}") from e
