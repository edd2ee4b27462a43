"""Host -> pool copies of adapters: one transfer of the file's bytes, then one kernel.

On CUDA the step thread issues a copy on a side stream: a non-blocking copy of the whole
adapter file from pinned host memory into a device staging buffer, then one launch of
kernels/adapter_write.py, which converts every layer's A and Bᵀ to the pool's dtype, pads them
to the pool's chunk width and writes them into the adapter's slots (kernels/lora_layout.py's
geometry) from the adapter's pieces table (HostAdapter.pieces, built once on the host), then an
event. On the CPU, and for a file whose matrices lie at offsets their dtype does not divide,
write_adapter_torch does the same with torch operations, a few per module (the reference of the
kernel's tests). The step thread only polls the event (CopyTicket.done), so it never waits on
the transfer or the kernels. (A loader thread that issued the copies instead made the steps it
overlapped slower: its Python competed with the step thread's for the GIL.
bench/adapter_load.py, decode step p99 under loads: 1.087x with the thread, 1.034x without.)

Issuing is two calls. prepare(), when the scheduler takes the pages, does host work only: it
writes the adapter's LoRA index row (slot table, ranks, offsets, scales) into a pinned host copy
of the index and records an event on the scheduling stream: the slots were taken from freed
pages and rows, which work queued before (the last use of those KV pages, an evicted adapter's
index row being cleared) may still touch. issue(), which the engine calls once the step's own
GPU work is queued (AdapterManager.issue_loads; at once when no step runs), makes the side
stream wait for that event only, not for the step, and queues there the row's copy into the
device index (non-blocking, from pinned memory), the transfer and the kernel; so the host time
that issuing takes (about a dozen operations) passes while the GPU computes the step, and
nothing between steps waits for the GPU. (With the row written by pageable copies on the
scheduling stream, begin_load took 0.7 ms between steps, p99 1.1-1.4 ms:
bench/results/service_load_engines_3/4.txt.) The row reaches the device before the copy's end
event, and a step reads it only once that event has passed (the adapter is IN_POOL then). On the
CPU the same function runs in place, synchronously, at prepare(), writing the index row and
reading the host bytes directly.

A step's own inputs reach the device by a copy on the step's stream (StepBatch), which shares
the copy engine with the side stream's: an adapter's transfer that starts while a step's input
copies are still pending holds back those not yet begun, and the step with them, for the whole
transfer (an H100, 80 MB: 1.45 ms, the last three of a step's then 14 copies waiting for its end;
the decode step's p99 under loads 1.15-1.19x of the p99 without:
bench/results/service_load_profile_8ee6990_h100.json). So a transfer waits for the step's input
copies (issue(after=StepBatch.copied); since then 1.029-1.031x on an H100,
bench/results/service_load_1bf6a4c_h100.json) and is queued in parts (issue(ticket, max_bytes)): the
engine gives each launch a byte budget, a share of what the last step's GPU time moves at the
host -> device bandwidth measured at start-up (h2d_bytes_per_s), so that a part ends before the
copies that follow it (a sampling step's parameters, after its forward, and the next step's
inputs); the rest of a large adapter goes
at the next launches, and the write kernel and the end event once every byte is queued. The
price: with steps launched ahead, a launch's input copies run when the step before it ends, so
a transfer issued at that launch starts then, up to a step later than it would unordered."""

from __future__ import annotations

import functools
import time
from types import ModuleType

import torch

from kernels import LoraIndex
from kernels.lora_layout import PIECE_COLS
from services.inference.engine.host_adapter import HostAdapter, LoraPair, TensorRef, typed_view
from services.inference.models.shard import lora_slices

ALL = slice(None)
# The least a budgeted issue() queues of a transfer: smaller parts cost more launches than they
# save (a part of 4 MiB takes about 0.1-0.4 ms of a PCIe link).
MIN_PART_BYTES = 4 << 20


def _stacked(src: torch.Tensor, refs: list[TensorRef]) -> torch.Tensor:
    """The layers' matrices of one module and kind as one [L, rows, cols] tensor over ``src``:
    a strided view when they lie at equal distances (one kernel-free view), else a stack."""
    first = refs[0]
    size = first.dtype.itemsize
    step = refs[1].offset - first.offset if len(refs) > 1 else 0
    regular = all(
        r.dtype == first.dtype and r.shape == first.shape and r.offset == first.offset + i * step
        for i, r in enumerate(refs)
    )
    if regular and first.offset % size == 0 and step % size == 0 and step >= 0:
        whole = src[: src.numel() - src.numel() % size].view(first.dtype)
        rows, cols = first.shape
        start = whole.storage_offset() + first.offset // size  # as_strided counts from storage
        return whole.as_strided((len(refs), rows, cols), (step // size, cols, 1), start)
    return torch.stack([typed_view(src, r) for r in refs])


@functools.cache
def _triton_writer() -> ModuleType:
    from kernels import adapter_write

    return adapter_write


def staging_buffer(n: int, device: torch.device) -> torch.Tensor:
    """A device buffer for a file of ``n`` bytes, its length a multiple of 4, as
    kernels/adapter_write.py reads it."""
    return torch.empty(-(-n // 4) * 4, dtype=torch.uint8, device=device)


def to_device(raw: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The file's bytes on ``device`` (non-blocking from pinned memory), in a staging_buffer."""
    staged = staging_buffer(raw.numel(), device)
    staged[: raw.numel()].copy_(raw, non_blocking=True)
    return staged


def warm_up(pool: torch.Tensor, slots: torch.Tensor) -> None:
    """Compile (or load from Triton's cache) the write kernel for this pool and a slot table of
    this dtype now, at start-up: the first adapter's load would otherwise spend that time on the
    step thread, every running request waiting (a second and more on a fresh machine). One
    program that writes nothing (a piece of no rows)."""
    if not pool.is_cuda:
        return
    pieces = torch.zeros(1, PIECE_COLS, dtype=torch.int64, device=pool.device)
    src = torch.zeros(4, dtype=torch.uint8, device=pool.device)
    _triton_writer().adapter_write(pool, slots, src, pieces, 1)


def write_adapter(pool: torch.Tensor, host: HostAdapter, slots: torch.Tensor, src: torch.Tensor):
    """Write every layer's A and Bᵀ of ``host`` into its ``slots`` of ``pool`` [layers, 2, slots,
    W]. ``src`` holds the adapter file's bytes (uint8) on the pool's device (to_device). Layers a
    module does not transform, rows past a layer's rank and columns past a dimension are written
    as zeros. With ``host.shard``, only the rank's columns of A (row-split modules) or rows of B
    (column-split ones) are written (models/shard.py). On CUDA one kernel launch."""
    pieces = host.pieces if pool.is_cuda else None
    if pieces is None or src.numel() % 4:
        write_adapter_torch(pool, host, slots.long(), src)
        return
    pieces = pieces.to(pool.device, non_blocking=True)
    _triton_writer().adapter_write(pool, slots, src, pieces, host.max_rank)


def write_adapter_torch(
    pool: torch.Tensor, host: HostAdapter, slots: torch.Tensor, src: torch.Tensor
) -> None:
    """write_adapter with torch operations (``slots`` int64): the CPU path."""
    num_layers, width = pool.shape[0], pool.shape[-1]
    by_pair = host.pairs
    for m, place in enumerate(host.plan.placements):
        if place is None:
            continue
        a_cols, b_rows = ALL, ALL  # A [r, d_in] and B [d_out, r] of the whole file
        d_in, d_out = host.dims[m]
        if host.shard is not None:
            a_cols, b_rows = lora_slices(m, d_in, d_out, host.shard)
            d_in = len(range(d_in)[a_cols])
            d_out = len(range(d_out)[b_rows])
        a_pad = torch.zeros(num_layers, place.rank, place.in_chunks * width, dtype=pool.dtype,
                            device=pool.device)  # fmt: skip
        b_pad = torch.zeros(num_layers, place.rank, place.out_chunks * width, dtype=pool.dtype,
                            device=pool.device)  # fmt: skip
        pairs: list[LoraPair | None] = [by_pair.get((layer, m)) for layer in range(num_layers)]
        uniform = all(
            p is not None and p.fold is None and p.a.shape[0] == place.rank for p in pairs
        )
        if uniform:  # every layer, one rank, one scale: all layers at once
            a_pad[:, :, :d_in] = _stacked(src, [p.a for p in pairs])[:, :, a_cols]  # [L, r, d_in]
            b_pad[:, :, :d_out] = _stacked(src, [p.b for p in pairs])[:, b_rows].transpose(1, 2)
        else:  # layers_to_transform, rank_pattern or per-layer scales: layer by layer
            for layer, p in enumerate(pairs):
                if p is None:
                    continue
                r_l = p.a.shape[0]
                a_pad[layer, :r_l, :d_in] = typed_view(src, p.a)[:, a_cols]
                b = typed_view(src, p.b)[b_rows]  # [d_out, r_l]
                if p.fold is not None:
                    b = b.float() * p.fold
                b_pad[layer, :r_l, :d_out] = b.t()
        n_a, n_b = place.rank * place.in_chunks, place.rank * place.out_chunks
        a_slots = slots[place.a_offset : place.a_offset + n_a]
        b_slots = slots[place.b_offset : place.b_offset + n_b]
        pool[:, 0, a_slots] = a_pad.view(num_layers, n_a, width)  # [L, n_a, W]
        pool[:, 1, b_slots] = b_pad.view(num_layers, n_b, width)  # [L, n_b, W]


class CopyTicket:
    """One host -> pool copy. done() never blocks (False until issued, on CUDA); seconds() is
    the copy's duration (device time between events on CUDA, wall time on the CPU) once done.
    A copy that failed is done once the work it queued has run, with ``error`` set."""

    def __init__(self, cuda: bool) -> None:
        self._error: BaseException | None = None
        self._start = torch.cuda.Event(enable_timing=True) if cuda else None
        self._end = torch.cuda.Event(enable_timing=True) if cuda else None
        self._after = torch.cuda.Event() if cuda else None  # the scheduling stream's work
        self._job: tuple[HostAdapter, int, int] | None = None  # prepared: (host, row, num_slots)
        self._staged: torch.Tensor | None = None  # the device buffer of a transfer under way
        self._sent = 0  # bytes of the file queued so far
        self._seconds = 0.0

    @property
    def issued(self) -> bool:
        """Whether all of the copy is queued (or it needs no queueing: the CPU, or failed)."""
        return self._job is None

    @property
    def error(self) -> BaseException | None:
        return self._error

    def done(self) -> bool:
        return self._end is None or (self._job is None and self._end.query())

    def seconds(self) -> float:
        if self._end is not None:
            return self._start.elapsed_time(self._end) / 1000.0
        return self._seconds


def write_row(index: LoraIndex, row: int, host: HostAdapter, slots: torch.Tensor) -> None:
    """Fill ``row`` of ``index`` (host tensors) for ``host`` stored in ``slots``."""
    index.slot_table[row].zero_()
    index.slot_table[row, : slots.numel()] = slots
    places = host.plan.placements
    index.ranks[row] = torch.tensor(host.ranks, dtype=torch.int32)
    index.a_offsets[row] = torch.tensor([p.a_offset if p else 0 for p in places], dtype=torch.int32)
    index.b_offsets[row] = torch.tensor([p.b_offset if p else 0 for p in places], dtype=torch.int32)
    index.scales[row] = torch.tensor(host.scales, dtype=torch.float32)


class AdapterCopier:
    """Issues host -> pool copies, with their index rows, on the calling thread (the engine's
    step thread): on CUDA as asynchronous work on a side stream, on the CPU synchronously."""

    def __init__(self, pool: torch.Tensor, index: LoraIndex) -> None:
        self.pool, self.index = pool, index
        self.cuda = pool.device.type == "cuda"
        # Under tensor parallelism, rank 0's TensorParallel: each copy prepared here is also
        # sent to the workers, which write their shards at once (the step thread's call).
        self.mirror = None
        self._stream = torch.cuda.Stream(pool.device) if self.cuda else None
        # The index rows as prepare() writes them, in pinned memory, for non-blocking copies. A
        # row is written again only after it was freed, which needs its copy to have completed.
        self._staged = (
            LoraIndex(*(torch.zeros(t.shape, dtype=t.dtype, pin_memory=True) for t in index))
            if self.cuda
            else index
        )
        warm_up(pool, index.slot_table[0])
        # What a budgeted transfer moves in a given time (issue(); the engine's byte budgets).
        self.h2d_bytes_per_s = h2d_bytes_per_s(pool.device) if self.cuda else None

    def prepare(self, host: HostAdapter, row: int, slots: torch.Tensor) -> CopyTicket:
        """A copy of ``host`` into ``slots`` (host tensor) and of its index ``row``, ordered after
        the work queued so far on the current stream; on CUDA issue(ticket) queues it, on the
        CPU it is done already."""
        ticket = CopyTicket(self.cuda)
        if self.mirror is not None:  # a failure here is the group's: it stops the engine
            self.mirror.load(host, row, slots)
        try:
            write_row(self._staged, row, host, slots)
            if self.cuda:
                ticket._after.record(torch.cuda.current_stream(self.pool.device))
                ticket._job = (host, row, slots.numel())
            else:
                start = time.perf_counter()
                write_adapter(self.pool, host, slots, host.raw)
                ticket._seconds = time.perf_counter() - start
        except Exception as exc:  # reported to the step thread through ticket.error
            ticket._error = exc
        return ticket

    def issue(
        self,
        ticket: CopyTicket,
        max_bytes: int | None = None,
        after: torch.cuda.Event | None = None,
    ) -> int:
        """Queue a prepared copy on the side stream: its index row and the file's bytes, at most
        ``max_bytes`` of them this call (at least MIN_PART_BYTES; None: all that remain), then,
        once every byte is queued, the write kernel and the end event (ticket.issued). With
        ``after`` (the step's input copies: StepBatch.copied) the bytes wait for that event.
        Returns the file's bytes queued (0 once issued, and on the CPU)."""
        if ticket._job is None:
            return 0
        host, row, num_slots = ticket._job
        side = self._stream
        n = host.raw.numel()
        try:
            with torch.cuda.device(self.pool.device), torch.cuda.stream(side):
                if ticket._staged is None:
                    side.wait_event(ticket._after)
                    ticket._start.record(side)
                    for dst, src in zip(self.index, self._staged, strict=True):
                        dst[row].copy_(src[row], non_blocking=True)
                    ticket._staged = staging_buffer(n, self.pool.device)
                if after is not None:
                    side.wait_event(after)
                first = ticket._sent
                end = n if max_bytes is None else min(n, first + max(max_bytes, MIN_PART_BYTES))
                ticket._staged[first:end].copy_(host.raw[first:end], non_blocking=True)
                ticket._sent = end
                if end == n:
                    slots = self.index.slot_table[row, :num_slots]
                    write_adapter(self.pool, host, slots, ticket._staged)
                    ticket._end.record(side)
                    ticket._job = ticket._staged = None
                return end - first
        except Exception as exc:  # reported to the step thread through ticket.error
            ticket._error = exc
            # done() once what was queued before the failure has run: then the pages may go
            # back to the pool. If even that fails the device is unusable: the step fails.
            ticket._end.record(self._stream)
            ticket._job = ticket._staged = None
            return 0


def h2d_bytes_per_s(device: torch.device, size: int = 16 << 20, reps: int = 3) -> float:
    """Host (pinned) -> device copy bandwidth, the best of ``reps`` copies of ``size`` bytes on
    a side stream: what a budgeted adapter transfer moves in a given time (issue())."""
    src = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(size, dtype=torch.uint8, device=device)
    stream = torch.cuda.Stream(device)
    best = float("inf")
    with torch.cuda.device(device), torch.cuda.stream(stream):
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            dst.copy_(src, non_blocking=True)
            end.record(stream)
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
    return size / best
