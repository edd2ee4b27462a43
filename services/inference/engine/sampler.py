"""Turns one step's logits into one token per row: greedy, temperature, top-k, top-p.

Reproducibility: a sampled row draws exactly one uniform number from its own generator per
token, and everything else it does is row-wise, so a seeded request gets the same tokens
whichever rows are next to it in the batch and wherever its own row is. Greedy rows draw
nothing and are taken together with one argmax.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
from torch import Tensor

from services.inference.engine.sampling_params import SamplingParams


def make_generator(params: SamplingParams, device: torch.device | str) -> torch.Generator | None:
    """The request's own random stream: None for greedy, else seeded from params.seed or,
    when there is no seed, from fresh OS entropy (so unseeded requests never share a stream)."""
    if params.greedy:
        return None
    g = torch.Generator(device=device)
    seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little")
    g.manual_seed(seed)
    return g


class Sampler:
    """Stateless; one call per step."""

    def __call__(
        self,
        logits: Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
    ) -> Tensor:
        """logits [B, V] float32 -> token ids [B] int64 on logits' device."""
        if logits.dim() != 2:
            raise ValueError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
        batch = logits.shape[0]
        if len(params) != batch or len(generators) != batch:
            raise ValueError(
                f"{batch} logit rows but {len(params)} params and {len(generators)} generators"
            )
        out = torch.argmax(logits, dim=-1)  # [B]; final for greedy rows
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if not rows:
            return out
        for i in rows:
            if generators[i] is None:
                raise ValueError(f"row {i} samples (temperature > 0) but has no generator")
        # One uniform per sampled row, drawn from that row's generator only.
        u = torch.stack(
            [
                torch.rand((), generator=generators[i], device=logits.device, dtype=torch.float32)
                for i in rows
            ]
        )  # [S]
        dev = logits.device
        idx = to_device(rows, torch.int64, dev)
        temps = to_device([params[i].temperature for i in rows], torch.float32, dev)
        top_k = to_device([params[i].top_k for i in rows], torch.int64, dev)
        top_p = to_device([params[i].top_p for i in rows], torch.float32, dev)
        out[idx] = _sample_rows(logits[idx].float(), temps, top_k, top_p, u)
        return out


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A small host list on the device without waiting for the GPU: through pinned memory with a
    non-blocking copy on CUDA (torch.tensor(values, device=cuda) copies from pageable memory and
    synchronizes the stream, which would wait for the step launched ahead)."""
    host = torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)


def _sample_rows(logits: Tensor, temps: Tensor, top_k: Tensor, top_p: Tensor, u: Tensor) -> Tensor:
    """Inverse-CDF sampling over each row's filtered distribution, in descending-prob order.

    logits [S, V], temps/top_k/top_p/u [S] -> [S] token ids. Every operation is row-wise.
    """
    vocab = logits.shape[-1]
    # Shifted by the row's maximum first, so that a tiny temperature cannot overflow finite
    # logits to inf (softmax is unchanged by the shift).
    scaled = (logits - logits.amax(dim=-1, keepdim=True)) / temps[:, None]  # [S, V]
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True, stable=True)  # [S, V]
    probs = torch.softmax(sorted_logits, dim=-1)  # [S, V]
    rank = torch.arange(vocab, device=logits.device)[None, :]  # [1, V]
    # top-k: keep ranks < k (k = 0 keeps all).
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
    keep = rank < k[:, None]
    # top-p: keep a token while the mass before it is < p, so the nucleus is the smallest
    # prefix whose mass reaches p; the top token is always kept (its prior mass is 0).
    mass_before = torch.cumsum(probs, dim=-1) - probs
    keep &= mass_before < top_p[:, None]
    probs = torch.where(keep, probs, 0.0)
    cdf = torch.cumsum(probs, dim=-1)  # [S, V], non-decreasing
    target = u * cdf[:, -1]  # [S], in [0, total)
    # First position whose cdf exceeds the target: never a zero-probability (dropped or
    # underflowed) token, since its cdf equals the one before it. Positive entries form a
    # prefix (probs are sorted and both filters keep prefixes; the top token is always
    # positive), so the clamp, which only catches float rounding at the end, stays inside it.
    pos = torch.searchsorted(cdf, target[:, None], right=True).squeeze(-1)  # [S]
    # A row whose logits are not finite has no positive entry (NaN compares false): it gets
    # position 0 rather than an index error (the engine fails that request, not the step).
    pos = torch.minimum(pos, (probs > 0).sum(dim=-1) - 1).clamp(min=0)
    return order.gather(-1, pos[:, None]).squeeze(-1)
