"""Sequence: one request's state inside the engine, from admission to its last token."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from services.inference.engine.api import AdapterKey, FinishReason
from services.inference.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from services.inference.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued: new, or preempted and to be recomputed from scratch
    RUNNING = "running"  # holds KV pages; prefilling (maybe in chunks) or decoding
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    seq_id: int  # engine-unique; owns the sequence's KV pages in the pool
    prompt_ids: list[int]
    sampling: SamplingParams
    adapter: AdapterKey | None
    finish_ids: frozenset[int]  # eos (unless ignore_eos) and stop_token_ids
    eos_ids: frozenset[int]
    generator: torch.Generator | None
    detokenizer: IncrementalDetokenizer
    stops: StopStringMatcher
    output_ids: list[int] = field(default_factory=list)
    # Tokens whose K/V are in the cache. Invariant: num_computed <= num_tokens - 1 while the
    # sequence still generates, since the newest token's K/V are computed by the next step.
    num_computed: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    tenant: str | None = None  # GenerationRequest.tenant: whose share of the batch it uses

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    def next_chunk(self, n: int) -> list[int]:
        """Tokens [num_computed, num_computed + n) of prompt + output (recompute included)."""
        start, end, p = self.num_computed, self.num_computed + n, len(self.prompt_ids)
        if start >= p:
            return self.output_ids[start - p : end - p]
        return self.prompt_ids[start:end] + self.output_ids[: max(0, end - p)]
