"""Small random Hugging Face-format models and PEFT LoRA adapters, generated locally.

Tests and the demo cannot download weights, so this module writes complete model directories:
config.json, model.safetensors (or shards with model.safetensors.index.json), tokenizer.json
(byte-level BPE trained here on a built-in corpus), tokenizer_config.json (with a small chat
template) and generation_config.json. Everything is deterministic for a given seed, and nothing
here imports transformers or peft (they are test-only references).

Config keys follow what transformers 5 reads. Llama 3 rope scaling is written the way
transformers 5 saves it (`rope_parameters` with `rope_type`, `rope_theta`, ...); presets with
`legacy_rope_keys` write the older layout that most published checkpoints still use
(top-level `rope_theta`, `rope_scaling`), so loaders are exercised on both.

Weights are random but well conditioned: projections have std 1/sqrt(fan_in), RMSNorm weights lie
around 1 and the lm_head is scaled so logits spread over several units; greedy parity tests
against transformers then do not hinge on near-ties between the top two logits.

    python -m services.inference.tiny_model OUT_DIR --preset tiny-llama [--seed N] [--shards N]
    python -m services.inference.tiny_model adapter OUT_DIR --model MODEL_DIR --rank 8 \
        [--alpha 16] [--targets q_proj,v_proj] [--rslora] [--seed N]
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from store.base_model import BaseModelShape

logger = logging.getLogger(__name__)

BOS_TOKEN, EOS_TOKEN, PAD_TOKEN = "<s>", "</s>", "<pad>"
ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
LORA_MODULES = ATTN_MODULES + MLP_MODULES
# Target std of the logits (lm_head std = LOGIT_SCALE / sqrt(hidden) on a unit-RMS input).
LOGIT_SCALE = 4.0
# A LoRA delta is drawn to be about this fraction of the base projection's output.
LORA_STRENGTH = 0.75
# The chat template written into tokenizer_config.json (Hugging Face's Jinja conventions):
# "role: content</s>" per message, then "assistant: " when a generation prompt is asked for.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('roles must be system, user or assistant') }}{% endif %}"
    "{{ message['role'] + ': ' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
)

# The tokenizer's training text: prose, code and multi-byte UTF-8 (accents, CJK, emoji), so
# that merges cover common English and some characters span several byte-level tokens.
CORPUS = """\
The harbour was quiet before dawn. Fishing boats rocked against the pier while gulls argued
over the nets, and the baker on the corner opened his shutters to let out the smell of bread.
A small engine coughed, caught, and settled into a steady rhythm as the first crew left.
Serving many fine-tuned models from one machine is a question of memory: the base weights stay
resident, and each request brings only a small low-rank update with it. Requests arrive, wait
in a queue, run for a while in a batch with others, and leave when they are done.
She wrote the numbers down: 3 apples, 12 pears, 250 grams of flour and 1.5 litres of milk.
"Where are you going?" he asked. "To the market, then home," she said, and smiled.

def fibonacci(n: int) -> list[int]:
    values = [0, 1]
    while len(values) < n:
        values.append(values[-1] + values[-2])
    return values[:n]

for (int i = 0; i < count; ++i) { total += weights[i] * inputs[i]; }
if err != nil { return fmt.Errorf("open %s: %w", path, err) }
SELECT name, count(*) FROM requests WHERE status = 'done' GROUP BY name;

Le café était fermé, alors nous avons marché jusqu'à la gare. Über den Wolken ist die Freiheit
grenzenlos. El niño comió piñata en la mañana. Ångström, façade, naïve, coöperate, São Paulo.
東京の朝はとても静かです。私は毎日コーヒーを飲みます。今天天气很好，我们去公园散步吧。
서울에서 만나요. Привет, как дела? Γειά σου κόσμε. שלום עולם. مرحبا بالعالم.
Emoji too: 🙂 🚀 🎉 👍🏽 ❤️ ☕ 🐍 — and symbols: € £ ¥ © ® ™ ± × ÷ ≤ ≥ ∞ → ✓.
"""


@dataclass(frozen=True)
class ModelPreset:
    """Shape and architecture of one generated model."""

    architecture: str  # LlamaForCausalLM | MistralForCausalLM | Qwen2ForCausalLM
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int = 512  # BPE trainer target, special tokens and 256 byte symbols included
    rope_theta: float = 10000.0
    llama3_rope: bool = False  # Llama 3 frequency scaling (factor 8, low 1, high 4)
    rope_original_max: int = 64  # original_max_position_embeddings for the llama3 scaling
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-5
    qkv_bias: bool = False
    tie_word_embeddings: bool = False
    legacy_rope_keys: bool = False

    def __post_init__(self) -> None:
        if self.architecture not in _MODEL_TYPES:
            raise ValueError(f"architecture must be one of {sorted(_MODEL_TYPES)}")
        if self.hidden_size % self.num_heads:
            raise ValueError("hidden_size must be a multiple of num_heads")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if self.qkv_bias != (self.architecture == "Qwen2ForCausalLM"):
            raise ValueError("qkv_bias is exactly the Qwen2 architecture's q/k/v bias")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def model_type(self) -> str:
        return _MODEL_TYPES[self.architecture]

    def module_shape(self, module: str) -> tuple[int, int]:
        """(d_in, d_out) of a projection, as nn.Linear(d_in, d_out)."""
        q_dim, kv_dim = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return {
            "q_proj": (self.hidden_size, q_dim),
            "k_proj": (self.hidden_size, kv_dim),
            "v_proj": (self.hidden_size, kv_dim),
            "o_proj": (q_dim, self.hidden_size),
            "gate_proj": (self.hidden_size, self.intermediate_size),
            "up_proj": (self.hidden_size, self.intermediate_size),
            "down_proj": (self.intermediate_size, self.hidden_size),
        }[module]


_MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}

PRESETS: dict[str, ModelPreset] = {
    # Grouped-query attention, intermediate not a multiple of hidden, Llama 3 rope scaling.
    "tiny-llama": ModelPreset(
        "LlamaForCausalLM", 64, 3, 4, 2, 160, llama3_rope=True, rope_theta=500000.0
    ),
    # q/k/v bias and tied embeddings; 6 query heads over 2 kv heads.
    "tiny-qwen2": ModelPreset(
        "Qwen2ForCausalLM",
        96,
        2,
        6,
        2,
        224,
        qkv_bias=True,
        tie_word_embeddings=True,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
    ),
    # Older key layout (top-level rope_theta), 8 heads of 8 over 2 kv heads.
    "tiny-mistral": ModelPreset("MistralForCausalLM", 64, 2, 8, 2, 192, legacy_rope_keys=True),
    # Multi-head attention as Llama-7B's: q/k/v and o as wide as the KV pool's rows, so that
    # their LoRA calls take the fused kernel's GEMV body with every load issued first.
    "tiny-mha": ModelPreset("LlamaForCausalLM", 64, 2, 4, 4, 160),
    # The local demo stack's model: still fast on a CPU.
    "demo": ModelPreset(
        "LlamaForCausalLM",
        256,
        4,
        8,
        4,
        688,
        vocab_size=1024,
        llama3_rope=True,
        rope_theta=500000.0,
        rope_original_max=256,
    ),
}


def train_tokenizer(vocab_size: int = 512) -> Tokenizer:
    """Byte-level BPE over CORPUS; <s>, </s>, <pad> first, then all 256 byte symbols.

    BOS is added by a post-processor as in Llama 3's tokenizer.json, and tokenizer_config.json
    says add_bos_token, so both transformers and our Tokenizer prepend exactly one <s>.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS_TOKEN, EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    bos_id = tok.token_to_id(BOS_TOKEN)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    return tok


def _config_json(p: ModelPreset, vocab_size: int, special: dict[str, int]) -> dict:
    cfg: dict = {
        "architectures": [p.architecture],
        "model_type": p.model_type,
        "vocab_size": vocab_size,
        "hidden_size": p.hidden_size,
        "intermediate_size": p.intermediate_size,
        "num_hidden_layers": p.num_layers,
        "num_attention_heads": p.num_heads,
        "num_key_value_heads": p.num_kv_heads,
        "head_dim": p.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": p.max_position_embeddings,
        "rms_norm_eps": p.rms_norm_eps,
        "tie_word_embeddings": p.tie_word_embeddings,
        "bos_token_id": special[BOS_TOKEN],
        "eos_token_id": special[EOS_TOKEN],
        "pad_token_id": special[PAD_TOKEN],
        "dtype": "float32",
        "use_cache": True,
    }
    if p.architecture == "LlamaForCausalLM":
        cfg |= {"attention_bias": False, "mlp_bias": False}
    else:  # Mistral and Qwen2 both have sliding-window fields; the tiny models attend fully.
        cfg |= {"sliding_window": None}
        if p.architecture == "Qwen2ForCausalLM":
            cfg |= {"use_sliding_window": False, "max_window_layers": p.num_layers}
    rope: dict = {"rope_type": "default", "rope_theta": p.rope_theta}
    if p.llama3_rope:
        rope |= {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": p.rope_original_max,
        }
    if p.legacy_rope_keys:
        cfg["rope_theta"] = rope.pop("rope_theta")
        cfg["rope_scaling"] = rope if p.llama3_rope else None
    else:
        cfg["rope_parameters"] = rope
    return cfg


def _random_weights(p: ModelPreset, vocab_size: int, seed: int) -> dict[str, torch.Tensor]:
    """All base-model tensors in HF naming; the draw order is fixed, so a seed fixes them."""
    g = torch.Generator().manual_seed(seed)

    def normal(shape: tuple[int, ...], std: float) -> torch.Tensor:
        return torch.randn(shape, generator=g, dtype=torch.float32) * std

    def norm_weight(n: int, center: float = 1.0) -> torch.Tensor:
        return center * (1.0 + normal((n,), 0.1))

    h = p.hidden_size
    # Untied: embeddings of unit scale, lm_head std LOGIT_SCALE/sqrt(h) on a unit-RMS input.
    # Tied: a token's own embedding stays in the residual stream and adds |E_t|^2 / rms(h) to
    # its own logit, which makes a model repeat one token forever. Small embeddings (std
    # 1/sqrt(h)) keep that self term below the layers' contribution; the final norm's weight
    # (around LOGIT_SCALE) restores the logits' spread.
    embed_std = 1.0 / math.sqrt(h) if p.tie_word_embeddings else 1.0
    final_norm_center = LOGIT_SCALE if p.tie_word_embeddings else 1.0
    w = {"model.embed_tokens.weight": normal((vocab_size, h), embed_std)}
    for i in range(p.num_layers):
        pre = f"model.layers.{i}."
        w[pre + "input_layernorm.weight"] = norm_weight(h)
        for m in ATTN_MODULES:
            d_in, d_out = p.module_shape(m)
            w[f"{pre}self_attn.{m}.weight"] = normal((d_out, d_in), 1.0 / math.sqrt(d_in))
            if p.qkv_bias and m != "o_proj":
                w[f"{pre}self_attn.{m}.bias"] = normal((d_out,), 0.2)
        w[pre + "post_attention_layernorm.weight"] = norm_weight(h)
        for m in MLP_MODULES:
            d_in, d_out = p.module_shape(m)
            w[f"{pre}mlp.{m}.weight"] = normal((d_out, d_in), 1.0 / math.sqrt(d_in))
    w["model.norm.weight"] = norm_weight(h, final_norm_center)
    if not p.tie_word_embeddings:
        w["lm_head.weight"] = normal((vocab_size, h), LOGIT_SCALE / math.sqrt(h))
    return w


def _write_weights(out: Path, weights: dict[str, torch.Tensor], shards: int) -> None:
    if shards == 1:
        save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
        return
    names = list(weights)
    if shards > len(names):
        raise ValueError(f"shards={shards} exceeds the {len(names)} tensors of this model")
    per = math.ceil(len(names) / shards)
    weight_map: dict[str, str] = {}
    for k in range(shards):
        chunk = names[k * per : (k + 1) * per]
        fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: weights[n] for n in chunk}, out / fname, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(chunk, fname)
    total = sum(t.numel() * t.element_size() for t in weights.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def make_model(
    out_dir: str | Path, preset: str = "tiny-llama", seed: int = 0, shards: int = 1
) -> Path:
    """Write a random model of `preset` into out_dir (created if needed); returns the path."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    p = PRESETS[preset]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(p.vocab_size)
    special = {t: tok.token_to_id(t) for t in (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)}
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    tok.save(str(out / "tokenizer.json"))
    _write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS_TOKEN,
            "eos_token": EOS_TOKEN,
            "pad_token": PAD_TOKEN,
            "add_bos_token": True,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": p.max_position_embeddings,
            "chat_template": CHAT_TEMPLATE,
        },
    )
    _write_json(
        out / "generation_config.json",
        {
            "bos_token_id": special[BOS_TOKEN],
            "eos_token_id": special[EOS_TOKEN],
            "pad_token_id": special[PAD_TOKEN],
        },
    )
    _write_json(out / "config.json", _config_json(p, vocab_size, special))
    _write_weights(out, _random_weights(p, vocab_size, seed), shards)
    logger.info("wrote %s model (seed %d, %d shard(s)) to %s", preset, seed, shards, out)
    return out


def _pattern_value(pattern: dict, module_name: str, default: float) -> float:
    """PEFT's rank_pattern/alpha_pattern lookup: first key matching the name's tail wins."""
    for key, value in pattern.items():
        if re.match(rf"(.*\.)?({key})$", module_name):
            return value
    return default


def make_adapter(
    model_dir: str | Path,
    out_dir: str | Path,
    rank: int = 8,
    lora_alpha: float = 16,
    target_modules: Sequence[str] = ("q_proj", "v_proj"),
    use_rslora: bool = False,
    rank_pattern: dict[str, int] | None = None,
    alpha_pattern: dict[str, float] | None = None,
    layers_to_transform: Sequence[int] | None = None,
    seed: int = 0,
) -> Path:
    """Write a random PEFT LoRA adapter for the model in model_dir; returns out_dir.

    A is [r, d_in] with std 1/sqrt(d_in); B is [d_out, r], drawn so that scaling * B @ A @ x is
    about LORA_STRENGTH times the base projection's output: large enough to change greedy
    tokens, small enough to keep activations in range.
    """
    base = BaseModelShape.from_hf_config(json.loads((Path(model_dir) / "config.json").read_text()))
    unknown = set(target_modules) - set(LORA_MODULES)
    if unknown or not target_modules:
        raise ValueError(f"target_modules must be a non-empty subset of {LORA_MODULES}")
    if rank < 1:
        raise ValueError(f"rank must be >= 1, got {rank}")
    layers = (
        list(range(base.num_layers)) if layers_to_transform is None else list(layers_to_transform)
    )
    if not layers or any(not 0 <= i < base.num_layers for i in layers):
        raise ValueError(f"layers_to_transform must lie in [0, {base.num_layers})")
    rank_pattern, alpha_pattern = dict(rank_pattern or {}), dict(alpha_pattern or {})
    g = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for i in sorted(layers):
        for m in LORA_MODULES:  # fixed order, so the seed fixes every tensor
            if m not in target_modules:
                continue
            block = "self_attn" if m in ATTN_MODULES else "mlp"
            name = f"model.layers.{i}.{block}.{m}"
            r = int(_pattern_value(rank_pattern, name, rank))
            alpha = _pattern_value(alpha_pattern, name, lora_alpha)
            scaling = alpha / (math.sqrt(r) if use_rslora else r)
            d_in, d_out = base.module_dims(m)
            a = torch.randn((r, d_in), generator=g) / math.sqrt(d_in)
            b = torch.randn((d_out, r), generator=g) * (LORA_STRENGTH / (scaling * math.sqrt(r)))
            tensors[f"base_model.model.{name}.lora_A.weight"] = a
            tensors[f"base_model.model.{name}.lora_B.weight"] = b
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "adapter_model.safetensors", metadata={"format": "pt"})
    _write_json(
        out / "adapter_config.json",
        {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": Path(model_dir).name,
            "r": rank,
            "lora_alpha": lora_alpha,
            "lora_dropout": 0.0,
            "target_modules": sorted(target_modules),
            "bias": "none",
            "use_rslora": use_rslora,
            "use_dora": False,
            "fan_in_fan_out": False,
            "rank_pattern": rank_pattern,
            "alpha_pattern": alpha_pattern,
            "layers_to_transform": None if layers_to_transform is None else sorted(layers),
            "layers_pattern": None,
            "modules_to_save": None,
            "init_lora_weights": True,
            "inference_mode": True,
        },
    )
    logger.info(
        "wrote rank-%d adapter on %s (seed %d) to %s", rank, list(target_modules), seed, out
    )
    return out


def _main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args[:1] == ["adapter"]:
        ap = argparse.ArgumentParser(prog="python -m services.inference.tiny_model adapter")
        ap.add_argument("out_dir")
        ap.add_argument("--model", required=True, help="model directory made by this module")
        ap.add_argument("--rank", type=int, default=8)
        ap.add_argument("--alpha", type=float, default=16.0)
        ap.add_argument("--targets", default="q_proj,v_proj", help="comma-separated modules")
        ap.add_argument("--rslora", action="store_true")
        ap.add_argument("--seed", type=int, default=0)
        a = ap.parse_args(args[1:])
        path = make_adapter(
            a.model,
            a.out_dir,
            rank=a.rank,
            lora_alpha=a.alpha,
            target_modules=tuple(t for t in a.targets.split(",") if t),
            use_rslora=a.rslora,
            seed=a.seed,
        )
    else:
        ap = argparse.ArgumentParser(prog="python -m services.inference.tiny_model")
        ap.add_argument("out_dir")
        ap.add_argument("--preset", default="tiny-llama", choices=sorted(PRESETS))
        ap.add_argument("--seed", type=int, default=0)
        ap.add_argument("--shards", type=int, default=1)
        a = ap.parse_args(args)
        path = make_model(a.out_dir, preset=a.preset, seed=a.seed, shards=a.shards)
    print(path)


if __name__ == "__main__":
    _main()
