"""A record of every step: what it computed and how long it took, for the serving benchmark's
roofline shares and for operators (EngineConfig.step_log writes each as a JSON line).

A record is begun when the step is launched and ended when its tokens are read (EngineCore's
launch and finish). Times: ``launched_at`` is time.perf_counter when scheduling began
(CLOCK_MONOTONIC on Linux, so it compares with a client's clock on the same machine),
``host_ms`` the host's scheduling, batch fill and launch, ``gpu_ms`` the device's time from
the step's first queued work to its sampled tokens (CUDA events; on the CPU the forward's
wall time), which, with steps launched ahead, begins once the device finished the previous
step.
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO

import torch

_KEEP = 4096  # records kept in memory (StepLog.recent)


@dataclass(slots=True)
class StepRecord:
    step: int
    launched_at: float
    seqs: int
    tokens: int  # computed this step (prefill chunks and decodes)
    prefill_tokens: int  # of those, in chunks of more than one token
    kv_read: int  # context tokens attended over: every sequence's tokens up to this step's
    kv_written: int  # K/V rows written (= tokens)
    attn_pairs: int  # (query, key) pairs of the causal attention
    adapters: int  # distinct adapters among the step's sequences
    adapter_bytes: int  # their weights' bytes (each read at least once by the step)
    graph: bool  # replayed a CUDA graph
    lora: str  # its LoRA kernels' path (ModelRunner's LoraMode: "none" without adapters)
    host_ms: float = 0.0
    gpu_ms: float | None = None
    _start: object = field(default=None, repr=False)
    _end: object = field(default=None, repr=False)

    def public(self) -> dict:
        d = asdict(self)
        d.pop("_start")
        d.pop("_end")
        return d


class StepLog:
    def __init__(self, device: torch.device, path: str | Path | None = None) -> None:
        self._cuda = device.type == "cuda"
        self.recent: deque[StepRecord] = deque(maxlen=_KEEP)
        self._file: IO[str] | None = None
        if path is not None:
            self._file = open(path, "a", buffering=1)  # noqa: SIM115 (closed by close())
        self._count = 0

    def mark(self) -> object:
        """Called before the step's first device work is queued: its start mark."""
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def begin(
        self,
        scheduled: Sequence,
        graph: bool,
        launched_at: float,
        start: object,
        lora: str,
    ):
        """After the step's work (sampling included) is queued. ``scheduled``: the scheduler's
        ScheduledSeq list, with each sequence's num_computed already counting this step;
        ``lora``: the path its LoRA kernels took."""
        tokens = prefill = kv_read = pairs = 0
        rows = {}
        for s in scheduled:
            n = s.num_tokens
            end = s.seq.num_computed
            tokens += n
            if n > 1:
                prefill += n
            kv_read += end
            pairs += n * (end - n) + n * (n + 1) // 2
            if s.lora_row is not None:
                rows[s.lora_row] = s.seq.adapter_bytes
        record = StepRecord(
            self._count, launched_at, len(scheduled), tokens, prefill, kv_read, tokens, pairs,
            len(rows), sum(rows.values()), graph, lora,
            1e3 * (time.perf_counter() - launched_at),
        )  # fmt: skip
        self._count += 1
        record._start = start
        if self._cuda:
            record._end = torch.cuda.Event(enable_timing=True)
            record._end.record()
        else:
            record._end = time.perf_counter()
        return record

    def end(self, record: StepRecord) -> None:
        """Once the step's tokens were read (its device work is done)."""
        if self._cuda:
            record._end.synchronize()
            record.gpu_ms = record._start.elapsed_time(record._end)
        else:
            record.gpu_ms = 1e3 * (record._end - record._start)
        record._start = record._end = None
        self.recent.append(record)
        if self._file is not None:
            self._file.write(json.dumps(record.public()) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
