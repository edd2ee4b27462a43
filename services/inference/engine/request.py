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
    adapter_bytes: int = 0  # the adapter's weight bytes, read by every step it joins (step log)
    output_ids: list[int] = field(default_factory=list)
    # Tokens sampled by launched steps whose ids the host has not read yet (EngineCore.launch
    # and finish): 0, 1, or 2 while step t + 1 is launched before step t's tokens are read.
    # They are the sequence's newest tokens; the latest one's id is row ``last_row`` of the
    # tokens the last launched step sampled, which the next step reads on the device.
    inflight: int = 0
    last_row: int = 0
    # Tokens whose K/V are in the cache (or are computed by launched steps). Invariant:
    # num_computed <= num_tokens - 1 while the sequence still generates, since the newest
    # token's K/V are computed by the next step.
    num_computed: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    tenant: str | None = None  # GenerationRequest.tenant: whose share of the batch it uses
    passed_over: int = 0  # queued requests admitted before it by adapter affinity (affinity.py)

    @property
    def num_known(self) -> int:
        """Prompt and output tokens whose ids the host holds."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_tokens(self) -> int:
        """Every token of the sequence, those still in flight included."""
        return len(self.prompt_ids) + len(self.output_ids) + self.inflight

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    def can_extend(self, max_len: int) -> bool:
        """Whether one more token may be sampled: neither max_new_tokens nor the context window
        is reached by the tokens known and in flight."""
        return (
            len(self.output_ids) + self.inflight < self.sampling.max_new_tokens
            and self.num_tokens < max_len
        )

    def next_chunk(self, n: int) -> tuple[list[int], bool]:
        """Tokens [num_computed, num_computed + n) of prompt + output (recompute included), and
        whether the last of them is in flight: its id is then a placeholder (0) that the step
        reads on the device from row ``last_row`` of the previous step's tokens. Only the newest
        token can be one: a step computes a token only once it is the sequence's last."""
        start, end, p = self.num_computed, self.num_computed + n, len(self.prompt_ids)
        known = self.num_known
        if end > known + 1 or (end == known + 1 and self.inflight != 1):
            raise ValueError(
                f"request {self.request_id}: tokens up to {end} asked of {known} known and "
                f"{self.inflight} in flight"
            )
        pending = end > known
        stop = min(end, known)
        if start >= p:
            ids = self.output_ids[start - p : stop - p]
        else:
            ids = self.prompt_ids[start:stop] + self.output_ids[: max(0, stop - p)]
        if pending:
            ids.append(0)
        return ids, pending
