"""How long a context the engine serves, how many pages its pool gets, and the limits that
follow from them when the configuration leaves them open (engine_limits): sequences per step,
requests in flight, and the rows of the LoRA index (adapters resident in the pool at once)."""

from __future__ import annotations

import logging
import time
from typing import NamedTuple

import torch

from kernels.lora_layout import MODULES, NUM_MODULES, plan_adapter
from services.inference.engine.api import DeviceMemory
from services.inference.engine.config import EngineConfig
from services.inference.engine.page_pool import page_bytes, pages_needed
from services.inference.models.config import ModelConfig
from store.peft import BaseModelShape

log = logging.getLogger(__name__)

CPU_POOL_BYTES = 128 * 2**20
CPU_MAX_NUM_SEQS = 64
# On CUDA, max_num_seqs follows the pool: a running sequence is assumed to hold this many
# tokens on average (prompt and output so far; the serving benchmark's sequences hold ~390 at
# their middle), so that many fit before preemption starts; rounded down to 16, within these
# bounds. On the H200 with a 7B model (213k pool tokens, at a 0.85 memory share: 512
# sequences) the saturating trace ran at 9700 output tokens/s, against 9773 with 416 and 9551
# with 272 (bench/serving.py); at 0.93 (233k tokens) it holds 512 too.
_TOKENS_PER_SEQ = 400
_MIN_SEQS, _MAX_SEQS = 16, 512
# Requests that may wait per running slot, and at least, when neither max_queue nor max_waiting
# is set (waiting requests cost host memory only).
_WAITING_PER_SEQ = 16
_MIN_WAITING = 1024
# The LoRA index has one row per adapter resident in the pool. Every adapter takes at least one
# pool page, so the pool's page count bounds the rows it can ever use; the index's bytes stay
# within this share of the pool's, and it has at least _MIN_LORA_ROWS rows. For the serving
# benchmark on the H200 (Llama-7B shape in bf16: 32 layers, W = 4096, pages of 16 tokens are
# 8 MiB, 14568 pages; max_lora_rank 128 on all seven modules is 1408 slots a row) that is a
# row per page: 14568 rows, a 78.2 MiB slot table (79.8 MiB with ranks, offsets and scales),
# 0.07% of the pool (tests/inference/test_lora_rows.py).
_LORA_INDEX_SHARE = 0.01
_MIN_LORA_ROWS = 16


class EngineLimits(NamedTuple):
    max_num_seqs: int  # sequences in one step
    max_queue: int  # requests waiting or running before new ones are refused
    max_loras: int  # rows of the LoRA index: adapters resident in the pool at once


def slot_capacity(shape: BaseModelShape, max_lora_rank: int, width: int, page_size: int) -> int:
    """Slots in a row of the LoRA index's slot table: what the largest adapter allowed takes
    (every module at max_lora_rank), in whole pages."""
    dims = {m: tuple(shape.module_dims(name)) for m, name in enumerate(MODULES)}
    biggest = plan_adapter(dict.fromkeys(dims, max_lora_rank), dims, width)
    return pages_needed(biggest.num_slots, page_size) * page_size


def lora_row_bytes(slot_capacity: int) -> int:
    """Device bytes of one LoRA index row: ``slot_capacity`` int32 slots, and each module's rank,
    A and B offsets (int32) and scale (float32)."""
    return 4 * (slot_capacity + 4 * NUM_MODULES)


def cuda_max_num_seqs(num_pages: int, page_size: int, max_num_batched_tokens: int) -> int:
    """The running batch's default bound on CUDA: as many sequences as ``num_pages`` pages hold
    at _TOKENS_PER_SEQ tokens each, in steps of 16, within [_MIN_SEQS, _MAX_SEQS] and at most a
    step's tokens (an H200 serving a 7B model in bf16: 512; an H100: 288)."""
    fit = num_pages * page_size // _TOKENS_PER_SEQ // 16 * 16
    return min(max(_MIN_SEQS, min(_MAX_SEQS, fit)), max_num_batched_tokens)


def engine_limits(
    config: EngineConfig,
    num_pages: int,
    device: torch.device,
    page_nbytes: int,
    slot_capacity: int,
) -> EngineLimits:
    """config's limits, with those it leaves open derived from the pool and the device: on
    CUDA as many sequences as the pool holds at _TOKENS_PER_SEQ tokens each (an H200 serving
    a 7B model in bf16 gets 512), on the CPU 64; 16 waiting requests per running one, at
    least 1024; and a LoRA index row per pool page (``page_nbytes`` each), as many as fit in 1%
    of the pool's bytes at ``slot_capacity`` slots a row, at least 16."""
    seqs = config.max_num_seqs
    if seqs is None:
        if device.type == "cuda":
            seqs = cuda_max_num_seqs(num_pages, config.page_size, config.max_num_batched_tokens)
        else:
            seqs = min(CPU_MAX_NUM_SEQS, config.max_num_batched_tokens)
    queue = config.max_queue
    if queue is None:
        waiting = config.max_waiting
        if waiting is None:
            waiting = max(_MIN_WAITING, _WAITING_PER_SEQ * seqs)
        queue = seqs + waiting
    loras = config.max_loras
    if loras is None:
        budget = int(num_pages * page_nbytes * _LORA_INDEX_SHARE) // lora_row_bytes(slot_capacity)
        loras = max(_MIN_LORA_ROWS, min(num_pages, budget))
    return EngineLimits(seqs, queue, loras)


# Activations of one step are a few times the widest layer output per token; this many
# float32 copies of it are kept out of the pool budget on CUDA.
_ACTIVATION_COPIES = 8
# What the captured CUDA graphs and the kernels they launch take outside the allocator grows
# with the layers each graph runs, not with the GPU: so the memory left beyond the pool, the
# weights and the activation reserve is the gpu_memory_utilization share's rest, and at least
# this much per 32 layers where graphs are captured. H200, Llama-7B shape (32 layers) at the
# service's defaults (688 graphs): after the saturating traces 5.8 of 139.8 GiB stayed free
# with the allocator's peak at 128.0 GiB, so what came after the sizing took about 3.8-5.5 GiB
# outside the allocator (bench/results/serving_s2_share.json; the capture's log line now
# reports it); the share's rest there, 9.8 GiB, is above this floor, which keeps a smaller GPU
# (an 80 GB card's 7% is 5.5 GiB) or a deeper model from running out at the capture.
_GRAPH_RESERVE_PER_32_LAYERS = 6 * 2**30


def context_window(mc: ModelConfig, max_model_len: int | None) -> int:
    """The longest prompt + generation served: the config's limit within the model's own."""
    limit = mc.max_position_embeddings
    if mc.sliding_window is not None and mc.sliding_window < limit:
        # Attention here is full attention; within the window it equals sliding attention.
        limit = mc.sliding_window
    if max_model_len is None:
        return limit
    if max_model_len > limit:
        raise ValueError(
            f"max_model_len {max_model_len} exceeds what the model attends over ({limit})"
        )
    return max_model_len


def beyond_pool_reserve(config: EngineConfig, mc: ModelConfig, total: int) -> int:
    """Bytes of a ``total``-byte GPU kept beyond the pool, the weights and the activation
    reserve: the gpu_memory_utilization share's rest, and where CUDA graphs are captured at
    least _GRAPH_RESERVE_PER_32_LAYERS per 32 of the model's layers (every tensor-parallel rank
    runs all the layers, each on its share of the width)."""
    rest = int((1.0 - config.gpu_memory_utilization) * total)
    if not config.cuda_graphs:
        return rest
    return max(rest, _GRAPH_RESERVE_PER_32_LAYERS * mc.num_layers // 32)


def pool_pages(
    config: EngineConfig, mc: ModelConfig, device: torch.device, dtype: torch.dtype
) -> int:
    """config.num_pages, or as many pages as the memory budget holds."""
    if config.num_pages is not None:
        return config.num_pages
    per_page = page_bytes(mc.num_layers, mc.kv_dim, config.page_size, dtype)
    kept = ""  # what the budget left aside, for the error below
    if config.pool_memory_bytes is not None:
        budget = config.pool_memory_bytes
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)  # after the weights were loaded
        widest = max(mc.q_dim + 2 * mc.kv_dim, 2 * mc.intermediate_size, mc.hidden_size)
        activations = (
            config.max_num_batched_tokens * widest * 4 * _ACTIVATION_COPIES
            + (config.max_num_seqs or _MAX_SEQS) * mc.vocab_size * 4 * 2
        )
        reserve = beyond_pool_reserve(config, mc, total)
        budget = free - reserve - activations
        share = config.gpu_memory_utilization
        kept = f" ({reserve} bytes kept beyond it: gpu_memory_utilization {share}'s rest, or "
        kept += "room for the CUDA graphs)"
    else:
        budget = CPU_POOL_BYTES
    pages = budget // per_page
    if pages < 2:
        raise ValueError(
            f"the page pool budget of {budget} bytes holds {max(pages, 0)} pages of "
            f"{per_page} bytes{kept}; give more memory or set num_pages"
        )
    return int(pages)


class DeviceMemoryReader:
    """DeviceMemory of one device, read from the driver and the allocator at most once a
    ``every`` seconds (the engine takes stats every 50 ms while busy, on its step thread)."""

    def __init__(self, device: torch.device, every: float = 1.0) -> None:
        self._device, self._every = device, every
        self._last, self._at = DeviceMemory(), float("-inf")

    def read(self) -> DeviceMemory:
        if self._device.type != "cuda":
            return DeviceMemory()
        now = time.monotonic()
        if now - self._at >= self._every:
            free, total = torch.cuda.mem_get_info(self._device)
            peak = torch.cuda.max_memory_reserved(self._device)
            self._last, self._at = DeviceMemory(total, free, peak), now
        return self._last
