"""The base model's shape, as far as LoRA adapters care: layer count and projection sizes."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

# The projections of a Llama/Mistral/Qwen2 decoder layer that an adapter may target, in the
# order used everywhere (the same order as the kernels' module ids).
SUPPORTED_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
# Layer indices an adapter may name: far above any model of the supported families (Llama 3.1
# 405B has 126 layers), and a bound on the work that checking an adapter's layers costs.
MAX_LAYERS = 256


class ModuleDims(NamedTuple):
    d_in: int
    d_out: int


@dataclass(frozen=True)
class BaseModelShape:
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int

    def __post_init__(self) -> None:
        for name in (
            "num_layers",
            "hidden_size",
            "intermediate_size",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "vocab_size",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"base model {name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"base model num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any]) -> BaseModelShape:
        """Read a Hugging Face config.json (Llama, Mistral, Qwen2 families)."""
        missing = [
            key
            for key in (
                "num_hidden_layers",
                "hidden_size",
                "intermediate_size",
                "num_attention_heads",
                "vocab_size",
            )
            if cfg.get(key) is None
        ]
        if missing:
            raise ValueError(f"base model config.json lacks {', '.join(missing)}")
        num_heads = cfg["num_attention_heads"]
        # Absent or null in many configs: the defaults the model code itself uses.
        num_kv_heads = cfg.get("num_key_value_heads") or num_heads
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        return cls(
            num_layers=cfg["num_hidden_layers"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            vocab_size=cfg["vocab_size"],
        )

    def module_dims(self, module: str) -> ModuleDims:
        """(d_in, d_out) of a projection's weight as the layer applies it: y = x @ W.T."""
        q_out = self.num_heads * self.head_dim
        kv_out = self.num_kv_heads * self.head_dim
        hidden, inter = self.hidden_size, self.intermediate_size
        dims = {
            "q_proj": ModuleDims(hidden, q_out),
            "k_proj": ModuleDims(hidden, kv_out),
            "v_proj": ModuleDims(hidden, kv_out),
            "o_proj": ModuleDims(q_out, hidden),
            "gate_proj": ModuleDims(hidden, inter),
            "up_proj": ModuleDims(hidden, inter),
            "down_proj": ModuleDims(inter, hidden),
        }
        if module not in dims:
            raise ValueError(f"unknown module {module!r}; expected one of {SUPPORTED_MODULES}")
        return dims[module]
