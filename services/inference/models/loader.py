"""Load a Hugging Face model directory into models/llama.Transformer.

Weights are read memory-mapped from model.safetensors or from the shards named by
model.safetensors.index.json, and moved to the device one layer at a time: the host never holds
a second full copy of the model (each tensor is a view of the mapped file until it is copied to
the device, converted, or fused with its siblings).
"""

from __future__ import annotations

import json
import logging
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from services.inference.engine.errors import ModelLoadError
from services.inference.models.config import ModelConfig
from services.inference.models.llama import Transformer

log = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


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


def load_model(
    model_dir: str | Path,
    device: torch.device,
    dtype: torch.dtype,
    max_len: int,
    cfg: ModelConfig | None = None,
) -> Transformer:
    """Build the model for ``model_dir`` on ``device`` in ``dtype``; rope tables up to max_len.
    ``cfg``: the directory's config, when the caller has read it already."""
    model_dir = Path(model_dir)
    cfg = cfg or ModelConfig.from_model_dir(model_dir)
    with torch.device("meta"):
        model = Transformer(cfg, max_len)
    h, v, i = cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size

    with ExitStack() as stack:
        files = WeightFiles(model_dir, stack)

        def put(name: str, shape: tuple[int, ...]) -> torch.Tensor:
            return files.get(name, shape).to(device=device, dtype=dtype)

        def fuse(names: list[str], shapes: list[tuple[int, ...]]) -> torch.Tensor:
            # Copy each part to the device first, so the host only ever holds mapped views.
            return torch.cat([put(n, s) for n, s in zip(names, shapes, strict=True)], dim=0)

        model.embed_tokens = put("model.embed_tokens.weight", (v, h))
        for layer in model.layers:
            p = f"model.layers.{layer.layer_id}."
            qkv = ["q_proj", "k_proj", "v_proj"]
            qkv_dims = [cfg.q_dim, cfg.kv_dim, cfg.kv_dim]
            attn = layer.attn
            attn.wqkv = fuse([f"{p}self_attn.{m}.weight" for m in qkv], [(d, h) for d in qkv_dims])
            if cfg.qkv_bias:
                attn.bqkv = fuse([f"{p}self_attn.{m}.bias" for m in qkv], [(d,) for d in qkv_dims])
            attn.wo = put(f"{p}self_attn.o_proj.weight", (h, cfg.q_dim))
            if cfg.o_bias:
                attn.bo = put(f"{p}self_attn.o_proj.bias", (h,))
            mlp = layer.mlp
            mlp.w_gate_up = fuse(
                [f"{p}mlp.gate_proj.weight", f"{p}mlp.up_proj.weight"], [(i, h)] * 2
            )
            mlp.w_down = put(f"{p}mlp.down_proj.weight", (h, i))
            if cfg.mlp_bias:
                mlp.b_gate_up = fuse([f"{p}mlp.gate_proj.bias", f"{p}mlp.up_proj.bias"], [(i,)] * 2)
                mlp.b_down = put(f"{p}mlp.down_proj.bias", (h,))
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
        "loaded %s (%d layers, hidden %d, %d/%d heads) on %s as %s",
        cfg.architecture, cfg.num_layers, h, cfg.num_heads, cfg.num_kv_heads, device, dtype,
    )  # fmt: skip
    return model
