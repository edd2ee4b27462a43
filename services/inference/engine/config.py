"""EngineConfig: the one frozen configuration of an inference engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from services.inference.engine.limits import RequestLimits
from services.inference.models.config import LOAD_FORMATS

# The default bound of adapter affinity (engine/affinity.py), in full batches of admissions:
# a queued request waits at most this many batches' worth of admissions beyond its place. On one
# H100 through the services, S2 n = 100 at 0.879 of the base model with one batch, 0.897 with two
# (bench/results/serving_s2_aff{1,2b}_11d4682_h100.json, passes counted on offers: affinity.py);
# counted on admissions, 0.920 on one H200 (serving_s2_n100_0d95b5f_h200.json).
AFFINITY_BATCHES = 2

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def decode_graph_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """Batch sizes captured as CUDA graphs: a decode step of n sequences replays the smallest
    size >= n, padded. Powers of two to 16, then every 16, up to max_num_seqs."""
    sizes = {b for b in (1, 2, 4, 8) if b < max_num_seqs}
    sizes |= set(range(16, max_num_seqs, 16)) | {max_num_seqs}
    return tuple(sorted(sizes))


@dataclass(frozen=True)
class EngineConfig:
    model_dir: str | Path
    device: str = "auto"  # "cpu" | "cuda" | "auto" (cuda when available)
    dtype: str | None = None  # None: float32 on cpu, bfloat16 on cuda
    page_size: int = 16  # tokens per KV block = slots per page
    num_pages: int | None = None  # None: derived from the pool memory budget below
    pool_memory_bytes: int | None = None  # None: cpu 128 MiB; cuda a share of free memory
    # Share of the GPU the engine may fill (cuda only): the pool takes what the weights and the
    # activation reserve leave of it. What lies beyond the allocator (CUDA context, kernels,
    # captured graphs) takes the rest, which is at least 6 GiB per 32 layers where graphs are
    # captured (pool_sizing.beyond_pool_reserve): H200, Llama-7B shape in bf16 at the
    # service's defaults, 0.93 left 5.8 of 139.8 GiB free after the saturating S2 trace
    # (allocator peak 128.0 GiB, 14,568 pages; bench/results/serving_s2_share.json), where
    # 0.85's 13,136 pages left adapters of the running batch too little room beside the KV.
    gpu_memory_utilization: float = 0.93
    max_num_seqs: int | None = None  # requests in one step; None: from the pool (pool_sizing)
    max_num_batched_tokens: int = 2048  # tokens in one step (prefill chunks + decodes)
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_lora_rank: int = 128
    # Rows of the LoRA index = adapters resident in the pool at once; None: from the pool
    # (pool_sizing.engine_limits: a row per pool page, within 1% of the pool's bytes).
    max_loras: int | None = None
    max_queue: int | None = None  # requests waiting or running before generate() is refused
    max_waiting: int | None = None  # or: requests waiting besides max_num_seqs running
    # (max_queue wins when both are set; None for both: 16 x max_num_seqs waiting)
    cuda_graphs: bool = True  # on CUDA, run decode and mixed steps as captured CUDA graphs
    step_log: str | Path | None = None  # append one JSON line per step here (step_log.py)
    limits: RequestLimits = field(default_factory=RequestLimits)  # per-request input sizes
    scheduling: str = "fair"  # "fair": tenants share the batch (engine/fairness.py); "fcfs"
    # Under "fair", while several tenants are active: prefill tokens per step for each tenant,
    # so steps stay short for the others' first tokens (fairness.py).
    fair_prefill_tokens: int = 256
    # Adapter affinity in admission (engine/affinity.py): how often a queued request may be
    # passed by later ones whose adapter the batch already runs; 0: off; None:
    # AFFINITY_BATCHES x max_num_seqs.
    adapter_affinity: int | None = None
    # Ranks the model is sharded over (engine/tensor_parallel.py); its heads, kv heads and MLP
    # width must divide by it. On CUDA rank r uses GPU r; CUDA graphs are off when above 1.
    tensor_parallel_size: int = 1
    # Small decode steps (model_runner.SIDE_STREAM_MAX_TOKENS) compute their LoRA deltas beside
    # the base GEMMs, on a second stream on CUDA (ModelRunner, LoraContext), rather than in
    # place after each GEMM.
    lora_side_stream: bool = True
    # Steps of ADDEND_MIN_TOKENS (256) tokens or more whose LoRA calls are all fused write each
    # call's delta first and the base GEMM adds onto it (model_runner.ADDEND_MODES,
    # LoraContext.addend), rather than the LoRA kernel reading the GEMM's output back
    # (bench/lora_addend.py: the mixed steps' LoRA time beyond the GEMMs 0.71-0.95x of in place
    # on an H100).
    lora_addend: bool = True
    # "safetensors": the model directory's weights; "random": drawn at load from a seed of each
    # weight's name (models/loader.py RandomWeights), for benchmarks of shapes whose checkpoint
    # does not fit the disk; the directory then needs its config and tokenizer only.
    load_format: str = "safetensors"

    def __post_init__(self) -> None:
        if not str(self.model_dir):
            raise ValueError("model_dir must name a model directory")
        if self.device not in ("cpu", "cuda", "auto"):
            raise ValueError(f"device must be cpu, cuda or auto, got {self.device!r}")
        if self.dtype is not None and self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)} or None, got {self.dtype!r}")
        positive = {
            "page_size": self.page_size,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_lora_rank": self.max_lora_rank,
            "fair_prefill_tokens": self.fair_prefill_tokens,
            "tensor_parallel_size": self.tensor_parallel_size,
        }
        for name, value in positive.items():
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        optional = (
            "num_pages", "pool_memory_bytes", "max_model_len", "max_num_seqs", "max_queue",
            "max_waiting", "max_loras",
        )  # fmt: skip
        for name in optional:
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        affinity = self.adapter_affinity
        if affinity is not None and (not isinstance(affinity, int) or affinity < 0):
            raise ValueError(
                f"adapter_affinity must be 0 (off), positive or None, got {affinity!r}"
            )
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        if self.scheduling not in ("fair", "fcfs"):
            raise ValueError(f"scheduling must be 'fair' or 'fcfs', got {self.scheduling!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.max_num_seqs is not None and self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                f"max_num_seqs ({self.max_num_seqs}): every running request decodes each step"
            )

    def graph_sizes(self, max_num_seqs: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The CUDA graphs' decode batch sizes and mixed-step token counts, given the engine's
        max_num_seqs (every tensor-parallel rank captures these, from rank 0's limits)."""
        return decode_graph_sizes(max_num_seqs), self.mixed_graph_tokens

    @property
    def mixed_graph_tokens(self) -> tuple[int, ...]:
        """Token counts captured as CUDA graphs of mixed (prefill + decode) steps: a step of n
        tokens replays the smallest count >= n, padded. Every 16 to 64, every 32 to 1024, then
        every 64, up to max_num_batched_tokens: a mixed step's GEMMs are compute-bound, so
        padding costs its share of them (under 5% from 640 tokens)."""
        sizes = set(range(16, 65, 16)) | set(range(96, 1025, 32)) | set(range(1088, 2**20, 64))
        sizes = {n for n in sizes if n < self.max_num_batched_tokens}
        return tuple(sorted(sizes | {self.max_num_batched_tokens}))

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("device='cuda' but torch sees no CUDA device (CPU build of torch?)")
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype is not None:
            return _DTYPES[self.dtype]
        return torch.bfloat16 if self.torch_device.type == "cuda" else torch.float32
