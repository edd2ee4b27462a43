"""Random models and adapters of real shapes for the benchmarks, generated on the fly.

The weights are random (scaled normal) and written as Hugging Face safetensors, one shard per
layer; the tokenizer is the tiny models' byte-level BPE with a word added for every id beyond
its 512, so that every generated token decodes to text. Adapters are store.synthetic's PEFT files.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from services.inference.tiny_model import BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, train_tokenizer
from store.base_model import BaseModelShape

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    max_positions: int = 4096

    def base(self) -> BaseModelShape:
        return BaseModelShape.from_hf_config(self.config({BOS_TOKEN: 0, EOS_TOKEN: 1}))

    def config(self, special: dict[str, int]) -> dict:
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab,
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.hidden // self.heads,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_positions,
            "rms_norm_eps": 1e-5,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
            "tie_word_embeddings": False,
            "attention_bias": False,
            "mlp_bias": False,
            "bos_token_id": special[BOS_TOKEN],
            "eos_token_id": special[EOS_TOKEN],
            "dtype": "bfloat16",
        }


SHAPES = {
    # Llama-2-7B: 6.7 B parameters, 13.5 GB in bf16.
    "llama-7b": Shape(
        hidden=4096, layers=32, heads=32, kv_heads=32, intermediate=11008, vocab=32000
    ),
    # Llama-2-70B: 69 B parameters, 138 GB in bf16: more than the GPU machines' disks hold, so
    # its benchmarks write the config and tokenizer only (make_model(weights=False)) and the
    # service draws the weights (--load-format random).
    "llama-70b": Shape(
        hidden=8192, layers=80, heads=64, kv_heads=8, intermediate=28672, vocab=32000
    ),
    # A smoke-test shape that runs anywhere in seconds.
    "tiny": Shape(hidden=256, layers=4, heads=8, kv_heads=4, intermediate=688, vocab=1024),
}


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def _vocab_size(path: Path) -> int | None:
    if not path.exists():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path)).get_vocab_size()


def make_model(
    out: Path, shape: Shape, device: torch.device, seed: int = 0, weights: bool = True
) -> Path:
    """Writes the model unless ``out`` already holds one of this shape; returns ``out``.
    ``weights=False``: the config and tokenizer only, for a service that draws its weights
    (--load-format random)."""
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(512)
    # Every id the model can generate decodes to text (one word each beyond the BPE's 512), as
    # with a real tokenizer: the streams carry text for every token.
    tok.add_tokens([f" w{i}" for i in range(tok.get_vocab_size(), shape.vocab)])
    special = {t: tok.token_to_id(t) for t in (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)}
    config = shape.config(special)
    done = out / "config.json"
    if (
        done.exists()
        and json.loads(done.read_text()) == config
        and _vocab_size(out / "tokenizer.json") == shape.vocab
        and (not weights or (out / "model.safetensors.index.json").exists())
    ):
        return out
    tok.save(str(out / "tokenizer.json"))
    _write_json(
        out / "tokenizer_config.json",
        {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN,
         "add_bos_token": True, "add_eos_token": False},
    )  # fmt: skip
    _write_json(out / "generation_config.json", {"eos_token_id": special[EOS_TOKEN]})
    if not weights:
        done.write_text(json.dumps(config, indent=2) + "\n")
        log.info("wrote the config and tokenizer of a %s model to %s (no weights)", shape, out)
        return out
    gen = torch.Generator(device).manual_seed(seed)
    dtype = torch.bfloat16

    def normal(*size: int, std: float) -> torch.Tensor:
        return (torch.randn(size, generator=gen, device=device) * std).to(dtype).cpu()

    h, kv = shape.hidden, shape.kv_heads * (shape.hidden // shape.heads)
    files: dict[str, str] = {}
    n = shape.layers + 2
    shards: list[dict[str, torch.Tensor]] = [
        {"model.embed_tokens.weight": normal(shape.vocab, h, std=1.0)}
    ]
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        dims = {
            "self_attn.q_proj": (h, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
            "self_attn.o_proj": (h, h), "mlp.gate_proj": (shape.intermediate, h),
            "mlp.up_proj": (shape.intermediate, h), "mlp.down_proj": (h, shape.intermediate),
        }  # fmt: skip
        layer = {
            f"{p}{m}.weight": normal(o, i_, std=1 / math.sqrt(i_)) for m, (o, i_) in dims.items()
        }
        layer[p + "input_layernorm.weight"] = torch.ones(h, dtype=dtype)
        layer[p + "post_attention_layernorm.weight"] = torch.ones(h, dtype=dtype)
        shards.append(layer)
    shards.append(
        {
            "model.norm.weight": torch.ones(h, dtype=dtype),
            "lm_head.weight": normal(shape.vocab, h, std=4 / math.sqrt(h)),
        }
    )
    total = 0
    for k, tensors in enumerate(shards):
        name = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
        save_file(tensors, out / name, metadata={"format": "pt"})
        files |= dict.fromkeys(tensors, name)
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": files}
    _write_json(out / "model.safetensors.index.json", index)
    done.write_text(json.dumps(config, indent=2) + "\n")  # written last: the model is complete
    log.info("wrote a random %s model (%.1f GB) to %s", shape, total / 1e9, out)
    return out
