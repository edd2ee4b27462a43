"""Sampled token ids from the device to the host without stalling the next launch.

Each step's ids go twice: into StepBatch.prev_tokens on the device (the next step reads the
ids it needs from there, before the host knows them), and with a non-blocking copy into a pinned
host buffer followed by an event. take() waits for that event only: the step launched after it
keeps the GPU busy meanwhile. The buffers rotate: the step loop has at most two steps in flight
and reads the older one's before launching a third, so three buffers never hand out one still
being written or read.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

_BUFFERS = 3


class TokenTicket(NamedTuple):
    host: torch.Tensor  # [n] int64, the step's ids once ``ready`` completed
    ready: torch.cuda.Event | None  # None on the CPU: the copy already happened
    extras: tuple[torch.Tensor, ...] = ()  # host copies of put()'s extras, ready with ``host``


class TokenTransfer:
    def __init__(self, capacity: int, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._bufs = [
            torch.zeros(capacity, dtype=torch.int64, pin_memory=self._cuda) for _ in range(_BUFFERS)
        ]
        self._next = 0

    def put(
        self,
        tokens: torch.Tensor,
        prev_tokens: torch.Tensor,
        host: torch.Tensor | None = None,
        extras: tuple[torch.Tensor, ...] = (),
    ) -> TokenTicket:
        """Queue ``tokens`` [n] (on the device) for the next step, and ``host`` (the same shape;
        default ``tokens``) and ``extras`` (any device tensors: the rows' logprobs) for the
        host, all ready when the ticket is."""
        n = tokens.numel()
        if n > prev_tokens.numel() or n > self._bufs[0].numel():
            raise ValueError(f"{n} sampled tokens exceed the capacity {prev_tokens.numel()}")
        prev_tokens[:n].copy_(tokens)
        out = self._bufs[self._next][:n]
        self._next = (self._next + 1) % _BUFFERS
        out.copy_(tokens if host is None else host, non_blocking=self._cuda)
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
