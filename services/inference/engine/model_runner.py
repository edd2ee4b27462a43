"""ModelRunner: one forward pass per step over the scheduler's choice."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels import LoraIndex
from services.inference.engine.batch import BatchEntry, StepBatch
from services.inference.engine.page_pool import PagePool
from services.inference.models.llama import LoraContext, Transformer


class ModelRunner:
    def __init__(
        self,
        model: Transformer,
        pool: PagePool,
        lora_index: LoraIndex,
        max_lora_rank: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        max_loras: int,
    ) -> None:
        self.model, self.pool = model, pool
        # The shrunk activations are max_lora_rank wide whatever the step holds: a fixed shape
        # for CUDA graphs later; the kernels only compute up to each adapter's own rank.
        self.lora = LoraContext(lora_index, max_lora_rank)
        self.batch = StepBatch(
            max_tokens=max_num_batched_tokens,
            max_seqs=max_num_seqs,
            max_pages_per_seq=-(-max_model_len // pool.page_size),
            max_segments=max_loras + 1,  # one per resident adapter, plus the base model
            page_size=pool.page_size,
            device=pool.tensor.device,
        )

    @torch.inference_mode()
    def execute(self, entries: Sequence[BatchEntry]) -> torch.Tensor:
        """Run one step; returns float32 logits [number of sampling entries, vocab], in order."""
        self.batch.fill(entries)
        lora = self.lora if self.batch.has_lora else None
        return self.model(self.batch, self.pool.tensor, lora)
