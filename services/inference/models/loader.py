"""Load a Hugging Face model directory into models/llama.Transformer.

Weights are read memory-mapped from model.safetensors or from the shards named by
model.safetensors.index.json, and moved to the device one layer at a time: the host never holds
a second full copy of the model (each tensor is a view of the mapped file until it is copied to
the device, converted, or fused with its siblings). With a tensor-parallel ``shard`` only the
rank's slice of each split weight is copied (models/shard.py).

With ``load_format="random"`` the directory needs its config and tokenizer only: each weight is
drawn on the device from a seed of its name (RandomWeights), for benchmarks of shapes whose
checkpoint would not fit the machine's disk (a 70B model is 138 GB in bf16). Every rank draws
the same full tensor and keeps its slice, so a sharded model is the unsharded one, split.
"""

from __future__ import annotations

import json
import logging
import math
import zlib
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from services.inference.engine.errors import ModelLoadError
from services.inference.models.config import LOAD_FORMATS, ModelConfig
from services.inference.models.llama import Transformer
from services.inference.models.shard import Shard, shard_model_config

log = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
ALL = slice(None)


class WeightFiles:
    """Name -> memory-mapped tensor across one file or an index of shards."""

    def __init__(self, model_dir: Path, stack: ExitStack) -> None:
        index_path = model_dir / INDEX_FILE
        if (model_dir / SINGLE_FILE).is_file():
            files = {SINGLE_FILE}
            self._where: dict[str, str] | None = None
        elif index_path.is_file():
            try:
                self._where = dict(json.loads(index_path.read_text())["weight_map"])
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise ModelLoadError(f"{index_path} has no readable weight_map: {e}") from e
            files = set(self._where.values())
        else:
            raise ModelLoadError(f"{model_dir} has neither {SINGLE_FILE} nor {INDEX_FILE}")
        self._handles = {}
        for name in sorted(files):
            path = model_dir / name
            if not path.is_file():
                raise ModelLoadError(f"{path} is missing (named by {INDEX_FILE})")
            self._handles[name] = stack.enter_context(safe_open(str(path), framework="pt"))
        if self._where is None:
            self._where = {k: SINGLE_FILE for k in self._handles[SINGLE_FILE].keys()}  # noqa: SIM118

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in self._where:
            raise ModelLoadError(f"tensor {name!r} is missing from the checkpoint")
        t = self._handles[self._where[name]].get_tensor(name)  # a view of the mapped file
        if tuple(t.shape) != shape:
            raise ModelLoadError(f"tensor {name!r} has shape {tuple(t.shape)}, expected {shape}")
        return t


class RandomWeights:
    """Weights drawn on the device, each from a seed of its name: norms' scales 1, biases 0,
    embeddings N(0, 1), every projection N(0, 1 / its input width), so that activations neither
    vanish nor blow up over the layers. Drawn in float32, whole, whatever slice the caller
    keeps."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __contains__(self, name: str) -> bool:
        return True

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name.endswith("norm.weight"):
            return torch.ones(shape, device=self.device)
        if name.endswith(".bias"):
            return torch.zeros(shape, device=self.device)
        gen = torch.Generator(self.device).manual_seed(zlib.crc32(name.encode()))
        std = 1.0 if name == "model.embed_tokens.weight" else 1 / math.sqrt(shape[-1])
        return torch.randn(shape, generator=gen, device=self.device).mul_(std)


def load_model(
    model_dir: str | Path,
    device: torch.device,
    dtype: torch.dtype,
    max_len: int,
    cfg: ModelConfig | None = None,
    shard: Shard | None = None,
    load_format: str = "safetensors",
) -> Transformer:
    """Build the model for ``model_dir`` on ``device`` in ``dtype``; rope tables up to max_len.
    ``cfg``: the directory's config, when the caller has read it already. ``shard``: build only
    that tensor-parallel rank's share (the caller joins the model to its group).
    ``load_format``: "safetensors" (the directory's weights) or "random" (RandomWeights)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    model_dir = Path(model_dir)
    cfg = cfg or ModelConfig.from_model_dir(model_dir)
    shard = shard or Shard(0, 1)
    with torch.device("meta"):
        model = Transformer(shard_model_config(cfg, shard.size), max_len)
    h, v, i = cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size
    q_part, kv_part, i_part = shard.part(cfg.q_dim), shard.part(cfg.kv_dim), shard.part(i)

    with ExitStack() as stack:
        drawn = load_format == "random"
        files = RandomWeights(device) if drawn else WeightFiles(model_dir, stack)

        def put(
            name: str, shape: tuple[int, ...], rows: slice = ALL, cols: slice = ALL
        ) -> torch.Tensor:
            t = files.get(name, shape)
            if shard.size > 1:  # the rank's slice: still a view of the mapped file until copied
                t = (t[rows] if len(shape) == 1 else t[rows, cols]).contiguous()
            return t.to(device=device, dtype=dtype)

        def fuse(names: list[str], shapes: list[tuple[int, ...]], parts: list[slice]):
            # Copy each part to the device first, so the host only ever holds mapped views.
            return torch.cat(
                [put(n, s, p) for n, s, p in zip(names, shapes, parts, strict=True)], dim=0
            )

        def rank0_bias(name: str) -> torch.Tensor:
            # A row-split projection's bias is added once: on rank 0, before the sum.
            b = put(name, (h,))
            return b if shard.rank == 0 else torch.zeros_like(b)

        model.embed_tokens = put("model.embed_tokens.weight", (v, h))
        for layer in model.layers:
            p = f"model.layers.{layer.layer_id}."
            qkv = ["q_proj", "k_proj", "v_proj"]
            qkv_dims = [cfg.q_dim, cfg.kv_dim, cfg.kv_dim]
            qkv_parts = [q_part, kv_part, kv_part]  # whole heads: by output rows of W
            attn = layer.attn
            attn.wqkv = fuse(
                [f"{p}self_attn.{m}.weight" for m in qkv], [(d, h) for d in qkv_dims], qkv_parts
            )
            if cfg.qkv_bias:
                attn.bqkv = fuse(
                    [f"{p}self_attn.{m}.bias" for m in qkv], [(d,) for d in qkv_dims], qkv_parts
                )
            attn.wo = put(f"{p}self_attn.o_proj.weight", (h, cfg.q_dim), ALL, q_part)
            if cfg.o_bias:
                attn.bo = rank0_bias(f"{p}self_attn.o_proj.bias")
            mlp = layer.mlp
            gate_up = [f"{p}mlp.gate_proj.weight", f"{p}mlp.up_proj.weight"]
            mlp.w_gate_up = fuse(gate_up, [(i, h)] * 2, [i_part] * 2)
            mlp.w_down = put(f"{p}mlp.down_proj.weight", (h, i), ALL, i_part)
            if cfg.mlp_bias:
                mlp.b_gate_up = fuse(
                    [f"{p}mlp.gate_proj.bias", f"{p}mlp.up_proj.bias"], [(i,)] * 2, [i_part] * 2
                )
                mlp.b_down = rank0_bias(f"{p}mlp.down_proj.bias")
            layer.input_layernorm.weight = put(f"{p}input_layernorm.weight", (h,))
            layer.post_attention_layernorm.weight = put(f"{p}post_attention_layernorm.weight", (h,))
        model.norm.weight = put("model.norm.weight", (h,))
        if cfg.tie_word_embeddings or "lm_head.weight" not in files:
            if not cfg.tie_word_embeddings:
                log.warning("%s has no lm_head.weight: using the tied input embeddings", model_dir)
            model.lm_head = model.embed_tokens
        else:
            model.lm_head = put("lm_head.weight", (v, h))
    model.init_rope(device)
    model.eval()
    log.info(
        "loaded %s (%d layers, hidden %d, %d/%d heads) on %s as %s%s%s",
        cfg.architecture, cfg.num_layers, h, cfg.num_heads, cfg.num_kv_heads, device, dtype,
        f", tensor-parallel rank {shard.rank} of {shard.size}" if shard.size > 1 else "",
        ", random weights (--load-format random)" if drawn else "",
    )  # fmt: skip
    return model
