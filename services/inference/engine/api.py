"""The engine's public request and output types."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from services.inference.engine.gc_pacing import PacingStats
from services.inference.engine.sampling_params import SamplingParams


class AdapterKey(NamedTuple):
    """One immutable version of one adapter."""

    adapter_id: str
    version: int


class FinishReason(enum.Enum):
    LENGTH = "length"  # max_new_tokens or the context window reached
    STOP = "stop"  # a stop string or a stop token id
    EOS = "eos"  # the model's end-of-sequence token
    ABORT = "abort"  # abort(request_id) or the caller went away


@dataclass(frozen=True)
class GenerationRequest:
    """Exactly one of ``prompt`` (text, tokenized by the engine) or ``prompt_token_ids``."""

    request_id: str
    prompt: str | None = None
    prompt_token_ids: Sequence[int] | None = None
    adapter: AdapterKey | None = None  # None = the base model
    sampling: SamplingParams = field(default_factory=SamplingParams)
    # Who asked: a tenant's name, or None (anonymous or admin). The scheduler shares the batch
    # fairly between tenants (engine/fairness.py).
    tenant: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError("request_id must be a non-empty string")
        if (self.prompt is None) == (self.prompt_token_ids is None):
            raise ValueError("give exactly one of prompt and prompt_token_ids")
        if self.prompt_token_ids is not None:
            object.__setattr__(self, "prompt_token_ids", tuple(self.prompt_token_ids))
        if self.adapter is not None and not isinstance(self.adapter, AdapterKey):
            raise TypeError("adapter must be an AdapterKey or None")
        if self.tenant is not None and not isinstance(self.tenant, str):
            raise TypeError("tenant must be a string or None")


class TopLogprob(NamedTuple):
    token_id: int
    token: str  # the token's own text (a piece of a character may show as U+FFFD)
    logprob: float


class TokenLogprob(NamedTuple):
    """A generated token's log-probability under the model (its raw logits, before temperature
    or top-k/top-p), and the most likely tokens at that position with theirs, best first."""

    token_id: int
    token: str
    logprob: float
    top: tuple[TopLogprob, ...]


@dataclass(frozen=True)
class GenerationOutput:
    """One streamed update of one request: what is new since the previous update."""

    request_id: str
    token_ids: tuple[int, ...]  # tokens generated this step
    text: str  # newly complete text (never a broken UTF-8 character, never a stop string)
    finish_reason: FinishReason | None  # None while the request is still streaming
    prompt_tokens: int
    completion_tokens: int  # generated so far, this update included
    # One per token of token_ids when the request asked for logprobs (SamplingParams.logprobs)
    logprobs: tuple[TokenLogprob, ...] = ()

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class DeviceMemory(NamedTuple):
    """The engine's device memory in bytes (all 0 on the CPU): its size, what is free on it (any
    process's use counted), and the most the engine's allocator has held at once."""

    total: int = 0
    free: int = 0
    peak_reserved: int = 0


@dataclass(frozen=True)
class EngineStats:
    """A snapshot taken after the latest step."""

    num_running: int
    num_waiting: int
    num_pages: int
    free_pages: int
    kv_pages: int
    adapter_pages: int
    adapters_in_pool: int
    adapters_loading: int
    adapters_host: int
    steps: int
    computed_tokens: int  # tokens run through the model: prefill, decode and recomputation
    generated_tokens: int
    preemptions: int
    adapter_loads: int
    adapter_evictions: int
    adapter_evictions_queued: int  # of those, adapters queued requests wait for (KV took them)
    memory: DeviceMemory = DeviceMemory()  # read at most once a second (DeviceMemoryReader)
    gc: PacingStats = PacingStats()  # the step thread's paced garbage collections (gc_pacing)
