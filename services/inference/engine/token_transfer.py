"""Sampled token ids from the device to the host without stalling the next launch.

Each step's ids go twice: into StepBatch.prev_tokens on the device (the next step reads the
ids it needs from there, before the host knows them), and with a non-blocking copy into a pinned
host buffer followed by an event. take() waits for that event only: the step launched after it
keeps the GPU busy meanwhile. The host buffers alternate: the step loop has at most two steps
in flight and reads the older one's tokens before it launches the next, so the buffer a launch
writes is never one still to be read.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

_BUFFERS = 2


class TokenTicket(NamedTuple):
    host: torch.Tensor  # [n] int64, the step's ids once ``ready`` completed
    ready: torch.cuda.Event | None  # None on the CPU: the copy already happened
    extras: tuple[torch.Tensor, ...] = ()  # host copies of put()'s extras, ready with ``host``


class TokenTransfer:
    def __init__(self, prev_tokens: torch.Tensor) -> None:
        """``prev_tokens``: the next step's device buffer of this step's tokens
        (StepBatch.prev_tokens), which also sets the capacity."""
        self._prev = prev_tokens
        self._cuda = prev_tokens.device.type == "cuda"
        self._bufs = [
            torch.zeros(prev_tokens.numel(), dtype=torch.int64, pin_memory=self._cuda)
            for _ in range(_BUFFERS)
        ]
        self._next = 0

    def put(
        self, tokens: torch.Tensor, host: torch.Tensor, extras: tuple[torch.Tensor, ...] = ()
    ) -> TokenTicket:
        """Queue ``tokens`` [n] (on the device) for the next step, and ``host`` (the same shape:
        what the host reads of them) and ``extras`` (any device tensors: the rows' logprobs) for
        the host, all ready when the ticket is."""
        n = tokens.numel()
        if n > self._prev.numel():
            raise ValueError(f"{n} sampled tokens exceed the capacity {self._prev.numel()}")
        self._prev[:n].copy_(tokens)
        out = self._bufs[self._next][:n]
        self._next = (self._next + 1) % _BUFFERS
        out.copy_(host, non_blocking=self._cuda)
        copies = tuple(
            torch.empty(x.shape, dtype=x.dtype, pin_memory=self._cuda).copy_(
                x, non_blocking=self._cuda
            )
            for x in extras
        )  # pinned buffers come from torch's caching host allocator
        ready = None
        if self._cuda:
            ready = torch.cuda.Event()
            ready.record()
        return TokenTicket(out, ready, copies)

    @staticmethod
    def take(ticket: TokenTicket) -> list[int]:
        if ticket.ready is not None:
            ticket.ready.synchronize()
        return ticket.host.tolist()
