"""Per-request sampling parameters, validated once when the request is made."""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed takes up to 64 bits
MAX_LOGPROBS = 20  # alternatives reported per token, at most (as OpenAI's API allows)


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops.

    temperature 0 means greedy (top_p, top_k and seed are then unused); top_k 0 means off.
    stop strings are matched on the detokenized text and are not emitted; sampling one of
    stop_token_ids ends the request as EOS does; ignore_eos keeps going past EOS (until
    max_new_tokens, a stop string or a stop token id).
    logprobs (None: off) reports each generated token's log-probability under the model, and
    the ``logprobs`` most likely alternatives with theirs (0 to MAX_LOGPROBS).
    Lists given for stop or stop_token_ids are stored as tuples, so params stay hashable.
    """

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not _is_real(self.temperature) or not 0.0 <= self.temperature < math.inf:
            raise ValueError(
                f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}"
            )
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= MAX_SEED):
            raise ValueError(
                f"seed must be None or an integer in [0, 2**64 - 1], got {self.seed!r}"
            )
        if isinstance(self.stop, str):
            raise ValueError("stop must be a sequence of strings, not one string")
        stop = tuple(self.stop)
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop must hold non-empty strings, got {stop!r}")
        stop_ids = tuple(self.stop_token_ids)
        if any(not _is_int(t) or t < 0 for t in stop_ids):
            raise ValueError(f"stop_token_ids must be integers >= 0, got {stop_ids!r}")
        if self.logprobs is not None and (
            not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(
                f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}"
            )
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        # Frozen: normalize through object.__setattr__, once, before anyone can see the object.
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", stop_ids)
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "top_p", float(self.top_p))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and not math.isnan(x)
