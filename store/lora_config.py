"""adapter_config.json of a PEFT LoRA adapter: parsing, the checks lorafleet needs, and the
per-(layer, module) rank, scale and targeting rules that PEFT applies when it builds the model.

Matching follows PEFT: a module is named by its key in the base model, e.g.
``model.layers.3.self_attn.q_proj``. A list target matches a key equal to it or ending in
``.<target>``; a string target is a regex that must match the whole key. rank_pattern and
alpha_pattern keys are regexes matched against the key's tail (``(.*\\.)?(<key>)$``); the first
matching key in the file's order wins.

Regexes are matched with RE2, in time linear in the module name: Python's backtracking ``re``
(which PEFT uses) takes exponential time on patterns such as ``(.*)*x``, so one adapter's config
could keep a validator busy for hours. A regex must compile with both (RE2 has no
backreferences or lookarounds); for every pattern both accept, both give the same answer on
module names.
"""

from __future__ import annotations

import functools
import json
import math
import re
import types
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import re2

from store.base_model import ATTENTION_MODULES, MAX_LAYERS, SUPPORTED_MODULES
from store.format_errors import AdapterFormatError

MAX_CONFIG_BYTES = 1 << 20
# Entries of rank_pattern / alpha_pattern: each may be matched against every module.
MAX_PATTERNS = 256
# Regex targets are resolved to module names by probing every layer an adapter may have.
_PROBE_LAYERS = MAX_LAYERS
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


_RE2_OPTIONS = re2.Options()
_RE2_OPTIONS.log_errors = False  # a refused pattern is the caller's error, reported as such


@functools.lru_cache(maxsize=1024)
def _regex(pattern: str):
    return re2.compile(pattern, _RE2_OPTIONS)


@functools.lru_cache(maxsize=256)
def _tail_set(patterns: tuple[str, ...]):
    """One RE2 set of every pattern's tail match: one pass over a key finds all that match."""
    table = re2.Set.MatchSet(_RE2_OPTIONS)
    for pattern in patterns:
        table.Add(rf"(.*\.)?({pattern})$")
    table.Compile()
    return table


def _first_tail_match(patterns: tuple[str, ...], key: str) -> int | None:
    if not patterns:
        return None
    matched = _tail_set(patterns).Match(key)
    return min(matched) if matched else None


def _list_matches(names: frozenset[str], key: str) -> bool:
    """Whether a name equals ``key`` or one of its dot-separated tails (PEFT's rule): a few set
    lookups per key however long the list."""
    if key in names:
        return True
    dot = key.find(".")
    while dot >= 0:
        if key[dot + 1 :] in names:
            return True
        dot = key.find(".", dot + 1)
    return False


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
    target_names: frozenset[str] = frozenset()
    target_regex: str | None = None
    exclude_names: frozenset[str] = frozenset()
    exclude_regex: str | None = None
    # rank_pattern's and alpha_pattern's keys and values, in order: built once, read per module.
    _ranks: tuple[tuple[str, ...], tuple[int, ...]] = field(init=False, repr=False, compare=False)
    _alphas: tuple[tuple[str, ...], tuple[float, ...]] = field(
        init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        for name, pattern in (("_ranks", self.rank_pattern), ("_alphas", self.alpha_pattern)):
            object.__setattr__(self, name, (tuple(pattern), tuple(pattern.values())))

    def rank(self, layer: int, module: str) -> int:
        keys, values = self._ranks
        first = _first_tail_match(keys, module_key(layer, module))
        return self.r if first is None else values[first]

    def alpha(self, layer: int, module: str) -> float:
        keys, values = self._alphas
        first = _first_tail_match(keys, module_key(layer, module))
        return self.lora_alpha if first is None else values[first]

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
        if self.exclude_regex is not None and _regex(self.exclude_regex).fullmatch(key):
            return False
        if _list_matches(self.exclude_names, key):
            return False
        if self.target_regex is not None:
            return _regex(self.target_regex).fullmatch(key) is not None
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
    except (re.error, RecursionError, OverflowError) as exc:
        raise AdapterFormatError(f"{what} {pattern[:80]!r} is not a valid regex: {exc}") from exc
    try:
        _regex(pattern)
        _tail_set((pattern,))
    except re2.error as exc:
        raise AdapterFormatError(
            f"{what} {pattern[:80]!r} uses regex syntax that cannot be matched in linear time "
            f"(backreferences, lookarounds): {exc}"
        ) from None
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


def _targets(data: dict[str, Any]) -> tuple[frozenset[str], str | None]:
    raw = data.get("target_modules")
    if raw == "all-linear" or raw == ["all-linear"]:
        return frozenset(SUPPORTED_MODULES), None
    if isinstance(raw, str):
        regex = _compile(raw, "target_modules")
        for other in ("model.embed_tokens", "lm_head"):
            if _regex(regex).fullmatch(other):
                leaf = other.rsplit(".", 1)[-1]
                raise AdapterFormatError(
                    f"LoRA on {leaf} is not supported (target_modules {regex!r} matches it)"
                )
        return frozenset(), regex
    if isinstance(raw, list) and raw:
        return frozenset(_check_name(name, "target_modules") for name in raw), None
    raise AdapterFormatError(
        f"target_modules must be a non-empty list of module names or a regex, got {raw!r:.200}"
    )


def _excludes(data: dict[str, Any]) -> tuple[frozenset[str], str | None]:
    raw = data.get("exclude_modules")
    if raw is None or raw == []:
        return frozenset(), None
    if isinstance(raw, str):
        return frozenset(), _compile(raw, "exclude_modules")
    if isinstance(raw, list) and all(isinstance(n, str) and n for n in raw):
        return frozenset(raw), None
    raise AdapterFormatError(
        f"exclude_modules must be a list of names or a regex, got {raw!r:.200}"
    )


def _positive_rank(value: Any, what: str, max_rank: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise AdapterFormatError(f"{what} must be a positive integer, got {value!r}")
    if value > max_rank:
        raise AdapterFormatError(f"{what} is {value}; this store accepts ranks up to {max_rank}")
    return value


def _alpha(value: Any, what: str) -> float:
    """A LoRA alpha: PEFT scales the update by alpha / r, so 0 switches the adapter off and a
    negative alpha turns it around; neither is a trained adapter."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise AdapterFormatError(f"{what} must be a finite number > 0, got {value!r}")
    return float(value)


def _pattern_map(data: dict[str, Any], name: str, convert) -> types.MappingProxyType:
    raw = data.get(name) or {}
    if not isinstance(raw, dict):
        raise AdapterFormatError(f"{name} must be an object mapping module patterns to values")
    if len(raw) > MAX_PATTERNS:
        raise AdapterFormatError(f"{name} has {len(raw)} entries; at most {MAX_PATTERNS} allowed")
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
    if regex is not None or isinstance(data.get("target_modules"), str):
        # PEFT refuses it with any string target_modules, "all-linear" included.
        raise AdapterFormatError(
            'layers_to_transform cannot be used with a regex or "all-linear" target_modules'
        )
    values = [raw] if isinstance(raw, int) and not isinstance(raw, bool) else raw
    if not isinstance(values, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) and 0 <= v < MAX_LAYERS for v in values
    ):
        raise AdapterFormatError(
            f"layers_to_transform must be a layer index in [0, {MAX_LAYERS}) or a list of "
            f"them, got {str(raw)[:80]}"
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
        lora_alpha=_alpha(data.get("lora_alpha", 8), "lora_alpha"),
        target_modules=(),
        use_rslora=use_rslora,
        rank_pattern=_pattern_map(
            data, "rank_pattern", lambda v, w: _positive_rank(v, w, max_rank)
        ),
        alpha_pattern=_pattern_map(data, "alpha_pattern", _alpha),
        layers_to_transform=_layers(data, regex),
        target_names=names,
        target_regex=regex,
        exclude_names=exclude_names,
        exclude_regex=exclude_regex,
    )
    probe = range(_PROBE_LAYERS)
    names = config.target_names | config.exclude_names
    if regex is None and exclude_regex is None and not any(c.isdigit() for n in names for c in n):
        # Names without a layer index match every layer alike (but layers_to_transform's).
        probe = config.layers_to_transform or (0,)
    targeted = tuple(
        module
        for module in SUPPORTED_MODULES
        if any(config.targets(layer, module) for layer in probe)
    )
    if not targeted:
        raise AdapterFormatError(
            f"target_modules {data.get('target_modules')!r} selects none of {SUPPORTED_MODULES}"
        )
    return replace(config, target_modules=targeted)
