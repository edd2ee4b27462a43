"""Llama-family decoder: Llama (Llama 3 rope scaling), Mistral and Qwen2 (q/k/v bias).

One forward pass serves a whole engine step: packed tokens of many sequences ([T] = the step's
tokens), each sequence's K/V in pages of the unified pool, each token's adapter in the LoRA index.
Every projection is one base GEMM for all tokens followed by the LoRA hook, kernels.lora_apply,
which adds scale * x·Aᵀ·Bᵀ for the tokens whose request uses an adapter (linear_lora). q/k/v and
gate/up are fused into one GEMM each, so their hooks cover several output slices in one call.

Weights are buffers created on the meta device and filled by models/loader.py. Under tensor
parallelism (models/shard.py) the model holds one rank's heads and MLP share, and the outputs of
o and down are partial sums that all_reduce makes whole (Transformer.tp: the rank's group).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from kernels import LoraIndex, lora_paths
from kernels.lora_layout import DOWN, GATE, UP, K, O, Q, V
from services.inference.engine.batch import StepBatch
from services.inference.models.config import ModelConfig, RopeConfig


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2], float32 (computed as transformers does, for parity)."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponent)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        # Llama 3.1: wavelengths longer than the original context / low_freq_factor are divided
        # by `factor`; shorter than context / high_freq_factor are kept; in between, blend.
        wavelen = 2 * math.pi / inv_freq
        low_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
        high_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        blend = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        blended = (1 - blend) * scaled / rope.factor + blend * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, blended, scaled)
    return inv_freq


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.register_buffer("weight", torch.empty(dim))

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
        """RMSNorm of x [T, D]; with ``delta``, the residual add x += delta (in place) first:
        one kernel on CUDA (kernels/layer_ops.py)."""
        return kernels.rmsnorm(x, self.weight, self.eps, delta=delta)


class LoraContext:
    """What the LoRA hooks need besides the activations and the step's token -> row addressing
    (StepBatch.lora_tokens): the resident adapters' index rows, and what the engine sets per
    step (ModelRunner): the kernel path (``fused``: None leaves it to the shapes; each call's
    own path is kernels.lora_paths.decode_call_fused), the rank rows the step's calls are sized
    for (``rows``: the engine's max_lora_rank, or fewer when every adapter of the step fits
    fewer), the modules they cover (``modules``: bits, module m = bit m; None: all), the two
    launches' rank rows a program (``rank_block``: kernels.lora_paths.step_is_wide), and whether
    the step's tile table holds every token as its own tile (``one_token``: every call fused,
    kernels.lora_paths.one_token_step_fuses). A call none of whose modules is covered is not
    made: no adapter of the step has them.

    ``addend`` (set per step by the engine with lora_addend: its steps of 256 tokens or more
    whose calls are all fused, model_runner.ADDEND_MODES): each call writes its LoRA delta
    first, zeros for the tokens without one, and the base GEMM adds x · Wᵀ onto it (cuBLAS's
    beta = 1, in the GEMM's epilogue), where otherwise the LoRA kernel reads the GEMM's output
    back and writes it again. A GEMM of that many tokens is about compute-bound, so its extra
    read mostly hides, where the LoRA kernel's read of y is bandwidth it waits on. The step's
    tile tables must then list its tokens without an adapter too (StepBatch.fill's zero_tiles).

    ``beside`` (set per step by the engine, which gave the context a workspace with
    use_side_stream): the step's calls compute their LoRA delta into the zeroed workspace on a
    side stream while the base GEMM runs on the step's stream, which then adds it (linear_lora).
    A small decode step's LoRA launches are latency-bound, a few programs each: run after the
    GEMM, each adds its whole latency to the step; beside it they run slower (on the SMs the
    GEMM leaves) but mostly hidden, and the add stays on the step's path. Without a side stream
    (the CPU) the same delta is computed before the GEMM."""

    def __init__(self, index: LoraIndex, max_rank: int) -> None:
        self.index = index
        self.fused: bool | None = None
        self.rows = max_rank
        self.modules: int | None = None
        self.rank_block = 16
        self.one_token = False
        self.addend = False
        self.beside = False
        self._side: torch.cuda.Stream | None = None
        self._workspace: torch.Tensor | None = None  # 1-D, the output dtype

    def covers(self, modules: tuple[int, ...]) -> bool:
        return self.modules is None or any(self.modules >> m & 1 for m in modules)

    def use_side_stream(self, workspace: torch.Tensor, side: torch.cuda.Stream | None) -> None:
        """Steps may compute their deltas beside the GEMMs, into ``workspace`` (1-D, at least
        tokens x the widest call's output elements), on ``side`` (None: the step's stream)."""
        self._workspace, self._side = workspace, side

    def delta(self, tokens: int, width: int) -> torch.Tensor:
        """The workspace as a contiguous [tokens, width] delta buffer."""
        assert self._workspace is not None and tokens * width <= self._workspace.numel()
        return self._workspace[: tokens * width].view(tokens, width)

    @contextmanager
    def on_side(self) -> Iterator[None]:
        """Work inside runs on the side stream, after everything the step's stream issued so
        far (its input); join() makes the step's stream wait for it."""
        if self._side is None:
            yield
            return
        self._side.wait_stream(torch.cuda.current_stream(self._side.device))
        with torch.cuda.stream(self._side):
            yield

    def join(self) -> None:
        if self._side is not None:
            torch.cuda.current_stream(self._side.device).wait_stream(self._side)


def add_lora(
    out: torch.Tensor,  # [T, sum(widths)]
    x: torch.Tensor,  # [T, d_in]
    batch: StepBatch,
    pool_layer: torch.Tensor,
    lora: LoraContext,
    modules: tuple[int, ...],
    widths: tuple[int, ...],
    delta: bool = False,
) -> None:
    """The step's LoRA call for ``modules``, on the path its context chose: adds each token's
    delta into ``out``, or with ``delta`` writes it (every row: zeros without one)."""
    kernels.lora_apply(
        out, x, pool_layer, lora.index, batch.lora_tokens, modules, widths, lora.rows,
        fused=lora_paths.decode_call_fused(
            lora.fused, x.shape[0], len(modules), lora.rows, lora.one_token
        ),
        rank_block=lora.rank_block, delta=delta,
    )  # fmt: skip


def linear_lora(
    x: torch.Tensor,  # [T, d_in]
    weight: torch.Tensor,  # [d_out, d_in]
    bias: torch.Tensor | None,
    batch: StepBatch,
    pool_layer: torch.Tensor,
    lora: LoraContext | None,
    modules: tuple[int, ...],
    widths: tuple[int, ...],
) -> torch.Tensor:
    """x · Wᵀ + b, then each token's LoRA delta added on the output slices ``modules`` (tokens
    without an adapter cost the LoRA kernels nothing): in place after the GEMM, with
    ``lora.addend`` written first for the GEMM to add onto, or with ``lora.beside`` computed
    beside it into a buffer that is added after (LoraContext): [T, d_out]."""
    if lora is None or not lora.covers(modules):
        return F.linear(x, weight, bias)
    args = batch, pool_layer, lora, modules, widths
    if lora.addend:
        y = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
        add_lora(y, x, *args, delta=True)  # every row written: the delta, zeros without one
        if bias is not None:
            y.add_(bias)
        return y.addmm_(x, weight.t())

    if not lora.beside:
        y = F.linear(x, weight, bias)
        add_lora(y, x, *args)
        return y
    delta = lora.delta(x.shape[0], weight.shape[0])  # [T, d_out]
    with lora.on_side():
        delta.zero_()
        add_lora(delta, x, *args)
    y = F.linear(x, weight, bias)
    lora.join()
    return y.add_(delta)


# Sums a tensor over the tensor-parallel ranks, in place (engine/tensor_parallel.py).
AllReduce = Callable[[torch.Tensor], None]


def all_reduce(x: torch.Tensor, tp: AllReduce | None) -> torch.Tensor:
    """x, summed over the ranks when the model is sharded: the partial outputs of o and down."""
    if tp is not None:
        tp(x)
    return x


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.tp: AllReduce | None = None
        self.n_heads, self.n_kv, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_dim, self.kv_dim, self.hidden = cfg.q_dim, cfg.kv_dim, cfg.hidden_size
        self.scale = cfg.head_dim**-0.5
        self.register_buffer("wqkv", torch.empty(cfg.q_dim + 2 * cfg.kv_dim, cfg.hidden_size))
        self.register_buffer(
            "bqkv", torch.empty(cfg.q_dim + 2 * cfg.kv_dim) if cfg.qkv_bias else None
        )
        self.register_buffer("wo", torch.empty(cfg.hidden_size, cfg.q_dim))
        self.register_buffer("bo", torch.empty(cfg.hidden_size) if cfg.o_bias else None)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin tables [max_len, head_dim // 2]
        batch: StepBatch,
        pool_layer: torch.Tensor,  # [2, slots, W]: this layer's K/V pages and adapter rows
        lora: LoraContext | None,
    ) -> torch.Tensor:
        t = x.shape[0]
        widths = (self.q_dim, self.kv_dim, self.kv_dim)
        qkv = linear_lora(x, self.wqkv, self.bqkv, batch, pool_layer, lora, (Q, K, V), widths)
        # qkv: [T, q_dim + 2 * kv_dim]
        q, k, v = qkv.split([self.q_dim, self.kv_dim, self.kv_dim], dim=-1)
        q = q.view(t, self.n_heads, self.head_dim)  # [T, n_heads, head_dim]
        k = k.view(t, self.n_kv, self.head_dim)  # [T, n_kv, head_dim]
        v = v.view(t, self.n_kv, self.head_dim)  # [T, n_kv, head_dim]
        # q rotated in place; k rotated and v copied into the pool at each token's slot
        kernels.rope_write_kv(q, k, v, *rope, batch.positions, pool_layer, batch.slot_mapping)
        o = kernels.paged_attention(
            q, pool_layer, batch.block_tables, batch.seq_lens, batch.query_starts,
            batch.page_size, self.scale, prefill_tiles=batch.attention_tiles,
        )  # fmt: skip
        o = o.reshape(t, self.q_dim)  # [T, n_heads * head_dim]
        # Row-split under tensor parallelism: this rank's partial sum (its LoRA share included).
        out = linear_lora(o, self.wo, self.bo, batch, pool_layer, lora, (O,), (self.hidden,))
        return all_reduce(out, self.tp)  # [T, hidden]


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.tp: AllReduce | None = None
        self.inter, self.hidden = cfg.intermediate_size, cfg.hidden_size
        self.register_buffer("w_gate_up", torch.empty(2 * self.inter, cfg.hidden_size))
        self.register_buffer("b_gate_up", torch.empty(2 * self.inter) if cfg.mlp_bias else None)
        self.register_buffer("w_down", torch.empty(cfg.hidden_size, self.inter))
        self.register_buffer("b_down", torch.empty(cfg.hidden_size) if cfg.mlp_bias else None)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        batch: StepBatch,
        pool_layer: torch.Tensor,
        lora: LoraContext | None,
    ) -> torch.Tensor:
        gate_up = linear_lora(
            x, self.w_gate_up, self.b_gate_up, batch, pool_layer, lora, (GATE, UP),
            (self.inter, self.inter),
        )  # fmt: skip
        # gate_up: [T, 2 * inter] = [gate | up]
        h = kernels.silu_mul(gate_up)  # [T, inter]: SiLU(gate) * up
        out = linear_lora(
            h, self.w_down, self.b_down, batch, pool_layer, lora, (DOWN,), (self.hidden,)
        )  # [T, hidden]: row-split under tensor parallelism, a partial sum
        return all_reduce(out, self.tp)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, h, rope, batch, pool_layer, lora) -> torch.Tensor:
        """x: the residual stream [T, hidden], updated in place; h = input_layernorm(x).
        Returns the MLP's output, which the next norm adds to x (Transformer.forward)."""
        attn = self.attn(h, rope, batch, pool_layer, lora)  # [T, hidden]
        h = self.post_attention_layernorm(x, delta=attn)  # x += attn; h = norm(x)
        return self.mlp(h, batch, pool_layer, lora)  # [T, hidden]


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, max_len: int) -> None:
        super().__init__()
        self.cfg, self.max_len = cfg, max_len
        self.register_buffer("embed_tokens", torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.register_buffer("lm_head", torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.register_buffer("rope_cos", torch.empty(max_len, cfg.head_dim // 2))
        self.register_buffer("rope_sin", torch.empty(max_len, cfg.head_dim // 2))

    def join_group(self, tp: AllReduce) -> None:
        """Make this rank's shard sum its partial outputs over the tensor-parallel group."""
        for layer in self.layers:
            layer.attn.tp = layer.mlp.tp = tp

    def init_rope(self, device: torch.device) -> None:
        """Tables of cos/sin for positions [0, max_len), float32 like transformers computes them."""
        inv_freq = rope_inv_freq(self.cfg.rope, self.cfg.head_dim)  # [head_dim // 2]
        angles = torch.outer(torch.arange(self.max_len, dtype=torch.float32), inv_freq)
        self.rope_cos = angles.cos().to(device)  # [max_len, head_dim // 2]
        self.rope_sin = angles.sin().to(device)

    def forward(
        self,
        batch: StepBatch,
        pool: torch.Tensor,
        lora: LoraContext | None,
        logits_out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Float32 logits [S_sample, vocab] at the batch's logits_indices: a new tensor, or with
        ``logits_out`` (float32 [>= S_sample, vocab]) its first S_sample rows, written.

        pool: [layers, 2, slots, W], the unified page pool."""
        x = F.embedding(batch.input_ids, self.embed_tokens)  # [T, hidden]: the residual stream
        rope = (self.rope_cos, self.rope_sin)
        h = self.layers[0].input_layernorm(x)
        for layer in self.layers:
            mlp = layer(x, h, rope, batch, pool[layer.layer_id], lora)
            if layer.layer_id + 1 < len(self.layers):  # x += mlp; h = the next layer's norm(x)
                h = self.layers[layer.layer_id + 1].input_layernorm(x, delta=mlp)
            else:
                x.add_(mlp)
        x = x[batch.logits_indices]  # [S_sample, hidden]: only sampled positions need logits
        x = self.norm(x)
        logits = F.linear(x, self.lm_head)  # [S_sample, vocab]
        if logits_out is None:
            return logits.float()
        return logits_out[: logits.shape[0]].copy_(logits)
