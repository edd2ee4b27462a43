"""adapter_config.json of a PEFT LoRA adapter: parsing, the checks lorafleet needs, and the
per-(layer, module) rank, scale and targeting rules that PEFT applies when it builds the model.

Matching follows PEFT: a module is named by its key in the base model, e.g.
``model.layers.3.self_attn.q_proj``. A list target matches a key equal to it or ending in
``.<target>``; a string target is a regex that must match the whole key. rank_pattern and
alpha_pattern keys are regexes matched against the key's tail (``(.*\\.)?(<key>)$``); the first
matching key in the file's order wins.
"""

from __future__ import annotations

import json
import math
import re
import types
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from store.base_model import ATTENTION_MODULES, SUPPORTED_MODULES
from store.format_errors import AdapterFormatError

MAX_CONFIG_BYTES = 1 << 20
# Regex targets are resolved to module names by probing this many layers; no model in the
# supported families comes close to it.
_PROBE_LAYERS = 256
_UNSUPPORTED_TARGETS = ("embed_tokens", "lm_head")
# Options that change what the adapter computes in ways the LoRA kernels do not implement.
_FLAG_OPTIONS = {
    "use_dora": "DoRA (use_dora)",
    "use_qalora": "QA-LoRA (use_qalora)",
    "lora_bias": "LoRA bias terms (lora_bias)",
}
_PRESENT_OPTIONS = {
    "modules_to_save": "fully trained extra modules (modules_to_save)",
    "target_parameters": "LoRA on parameters (target_parameters)",
    "trainable_token_indices": "trainable token embeddings (trainable_token_indices)",
    "layer_replication": "layer replication (layer_replication)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "monteclora_config": "the MonteCLoRA variant",
    "velora_config": "the VeLoRA variant",
    "kasa_config": "the KaSA variant",
    "arrow_config": "the Arrow variant",
    "use_bdlora": "the block-diagonal LoRA variant (use_bdlora)",
}
# These initialisations change the base weights, so the saved adapter is only right on top
# of a modified base model unless it was converted when saved.
_BASE_MUTATING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")


def module_key(layer: int, module: str) -> str:
    """The module's name in a Hugging Face Llama/Mistral/Qwen2 causal LM."""
    block = "self_attn" if module in ATTENTION_MODULES else "mlp"
    return f"model.layers.{layer}.{block}.{module}"


def _tail_matches(pattern: str, key: str) -> bool:
    return re.match(rf"(.*\.)?({pattern})$", key) is not None


def _list_matches(names: tuple[str, ...], key: str) -> bool:
    return any(key == name or key.endswith(f".{name}") for name in names)


@dataclass(frozen=True)
class LoraAdapterConfig:
    r: int
    lora_alpha: float
    target_modules: tuple[str, ...]  # module names, in SUPPORTED_MODULES order
    use_rslora: bool = False
    rank_pattern: Mapping[str, int] = field(default_factory=lambda: types.MappingProxyType({}))
    alpha_pattern: Mapping[str, float] = field(default_factory=lambda: types.MappingProxyType({}))
    layers_to_transform: tuple[int, ...] | None = None
    # How targets are matched, as in the file: list entries, or one regex (target_regex).
    target_names: tuple[str, ...] = ()
    target_regex: str | None = None
    exclude_names: tuple[str, ...] = ()
    exclude_regex: str | None = None

    def rank(self, layer: int, module: str) -> int:
        key = module_key(layer, module)
        for pattern, rank in self.rank_pattern.items():
            if _tail_matches(pattern, key):
                return rank
        return self.r

    def alpha(self, layer: int, module: str) -> float:
        key = module_key(layer, module)
        for pattern, alpha in self.alpha_pattern.items():
            if _tail_matches(pattern, key):
                return alpha
        return self.lora_alpha

    def scale(self, layer: int, module: str) -> float:
        """The factor PEFT multiplies B·A·x by: alpha/r, or alpha/sqrt(r) with rsLoRA."""
        rank = self.rank(layer, module)
        alpha = self.alpha(layer, module)
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank

    def targets(self, layer: int, module: str) -> bool:
        """Whether PEFT puts a LoRA pair on this layer's module."""
        if module not in SUPPORTED_MODULES:
            return False
        key = module_key(layer, module)
        if self.exclude_regex is not None and re.fullmatch(self.exclude_regex, key):
            return False
        if _list_matches(self.exclude_names, key):
            return False
        if self.target_regex is not None:
            return re.fullmatch(self.target_regex, key) is not None
        if not _list_matches(self.target_names, key):
            return False
        return self.layers_to_transform is None or layer in self.layers_to_transform

    @property
    def max_rank(self) -> int:
        return max([self.r, *self.rank_pattern.values()])


def _load(raw: bytes | str | Mapping[str, Any]) -> dict[str, Any]:
    if isinstance(raw, Mapping):
        return dict(raw)
    if len(raw) > MAX_CONFIG_BYTES:
        raise AdapterFormatError(
            f"adapter_config.json is {len(raw)} bytes; at most {MAX_CONFIG_BYTES} allowed"
        )
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise AdapterFormatError(f"adapter_config.json is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise AdapterFormatError("adapter_config.json must be a JSON object")
    return data


def _compile(pattern: Any, what: str) -> str:
    if not isinstance(pattern, str) or not pattern:
        raise AdapterFormatError(f"{what} must be a non-empty string, got {pattern!r}")
    if len(pattern) > 1024:
        raise AdapterFormatError(f"{what} is longer than 1024 characters")
    try:
        re.compile(pattern)
    except re.error as exc:
        raise AdapterFormatError(f"{what} {pattern!r} is not a valid regex: {exc}") from exc
    return pattern


def _check_name(name: Any, what: str) -> str:
    if not isinstance(name, str) or not name:
        raise AdapterFormatError(f"{what} entries must be non-empty strings, got {name!r}")
    leaf = name.rsplit(".", 1)[-1]
    if leaf in _UNSUPPORTED_TARGETS:
        raise AdapterFormatError(f"LoRA on {leaf} is not supported ({what} names {name!r})")
    if leaf not in SUPPORTED_MODULES:
        raise AdapterFormatError(
            f"{what} entry {name!r} is not one of the supported modules {SUPPORTED_MODULES}"
        )
    return name


def _targets(data: dict[str, Any]) -> tuple[tuple[str, ...], str | None]:
    raw = data.get("target_modules")
    if raw == "all-linear" or raw == ["all-linear"]:
        return SUPPORTED_MODULES, None
    if isinstance(raw, str):
        regex = _compile(raw, "target_modules")
        for other in ("model.embed_tokens", "lm_head"):
            if re.fullmatch(regex, other):
                leaf = other.rsplit(".", 1)[-1]
                raise AdapterFormatError(
                    f"LoRA on {leaf} is not supported (target_modules {regex!r} matches it)"
                )
        return (), regex
    if isinstance(raw, list) and raw:
        return tuple(_check_name(name, "target_modules") for name in raw), None
    raise AdapterFormatError(
        f"target_modules must be a non-empty list of module names or a regex, got {raw!r}"
    )


def _excludes(data: dict[str, Any]) -> tuple[tuple[str, ...], str | None]:
    raw = data.get("exclude_modules")
    if raw is None or raw == []:
        return (), None
    if isinstance(raw, str):
        return (), _compile(raw, "exclude_modules")
    if isinstance(raw, list) and all(isinstance(n, str) and n for n in raw):
        return tuple(raw), None
    raise AdapterFormatError(f"exclude_modules must be a list of names or a regex, got {raw!r}")


def _positive_rank(value: Any, what: str, max_rank: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise AdapterFormatError(f"{what} must be a positive integer, got {value!r}")
    if value > max_rank:
        raise AdapterFormatError(f"{what} is {value}; this store accepts ranks up to {max_rank}")
    return value


def _finite(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise AdapterFormatError(f"{what} must be a finite number, got {value!r}")
    return float(value)


def _pattern_map(data: dict[str, Any], name: str, convert) -> types.MappingProxyType:
    raw = data.get(name) or {}
    if not isinstance(raw, dict):
        raise AdapterFormatError(f"{name} must be an object mapping module patterns to values")
    # Insertion order is kept: PEFT uses the first key that matches.
    return types.MappingProxyType(
        {
            _compile(key, f"{name} key"): convert(value, f"{name}[{key!r}]")
            for key, value in raw.items()
        }
    )


def _check_unsupported(data: dict[str, Any]) -> None:
    peft_type = data.get("peft_type")
    if peft_type != "LORA":
        raise AdapterFormatError(f"peft_type is {peft_type!r}; only LORA adapters are supported")
    for option, what in _FLAG_OPTIONS.items():
        if data.get(option):
            raise AdapterFormatError(f"{what} is not supported; set {option} to false")
    for option, what in _PRESENT_OPTIONS.items():
        if data.get(option) not in (None, [], {}, False):
            raise AdapterFormatError(f"{what} is not supported; {option} must be null")
    bias = data.get("bias", "none")
    if bias != "none":
        raise AdapterFormatError(f'bias is {bias!r}; only "none" is supported')
    init = data.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(_BASE_MUTATING_INITS):
        raise AdapterFormatError(
            f"init_lora_weights {init!r} changes the base weights; save the adapter with "
            "path_initial_model_for_weight_conversion to get a plain LoRA adapter"
        )
    pattern = data.get("layers_pattern")
    if pattern not in (None, "", [], "layers", ["layers"]):
        raise AdapterFormatError(
            f"layers_pattern {pattern!r} does not name the decoder layers; expected 'layers'"
        )


def _layers(data: dict[str, Any], regex: str | None) -> tuple[int, ...] | None:
    raw = data.get("layers_to_transform")
    if raw is None or raw == []:
        return None
    if regex is not None:
        raise AdapterFormatError("layers_to_transform cannot be used with a regex target_modules")
    values = [raw] if isinstance(raw, int) and not isinstance(raw, bool) else raw
    if not isinstance(values, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values
    ):
        raise AdapterFormatError(
            f"layers_to_transform must be a layer index or a list of them, got {raw!r}"
        )
    return tuple(sorted(set(values)))


def parse_adapter_config(
    raw: bytes | str | Mapping[str, Any], max_rank: int = 128
) -> LoraAdapterConfig:
    """Parse and check adapter_config.json; raises AdapterFormatError naming what is wrong."""
    data = _load(raw)
    _check_unsupported(data)
    names, regex = _targets(data)
    exclude_names, exclude_regex = _excludes(data)
    use_rslora = data.get("use_rslora", False)
    if not isinstance(use_rslora, bool):
        raise AdapterFormatError(f"use_rslora must be true or false, got {use_rslora!r}")
    config = LoraAdapterConfig(
        r=_positive_rank(data.get("r"), "r", max_rank),
        lora_alpha=_finite(data.get("lora_alpha", 8), "lora_alpha"),
        target_modules=(),
        use_rslora=use_rslora,
        rank_pattern=_pattern_map(
            data, "rank_pattern", lambda v, w: _positive_rank(v, w, max_rank)
        ),
        alpha_pattern=_pattern_map(data, "alpha_pattern", _finite),
        layers_to_transform=_layers(data, regex),
        target_names=names,
        target_regex=regex,
        exclude_names=exclude_names,
        exclude_regex=exclude_regex,
    )
    probe = max([_PROBE_LAYERS - 1, *(config.layers_to_transform or ())]) + 1
    targeted = tuple(
        module
        for module in SUPPORTED_MODULES
        if any(config.targets(layer, module) for layer in range(probe))
    )
    if not targeted:
        raise AdapterFormatError(
            f"target_modules {data.get('target_modules')!r} selects none of {SUPPORTED_MODULES}"
        )
    return replace(config, target_modules=targeted)
