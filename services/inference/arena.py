"""A reusable arena of host memory for adapter bytes, pinned when the engine runs on CUDA.

One buffer is allocated (and pinned) once at start-up; adapters fetched from the store are
written straight into contiguous blocks of it, and the engine copies from there to the page pool
with asynchronous host-to-device copies, which need page-locked memory to overlap with compute.
Pinning is slow (hundreds of milliseconds per GiB) and a pinned allocation per adapter would
fragment the driver's page-locked memory, hence one arena with its own allocator.

The buffer is a memfd mapped shared, so the fetch worker process (fetch_worker.py) can map the
same memory (``fd``) and write fetched bytes into it, and the engine process
(engine_process.py) read them there; on CUDA the process that copies to the GPU page-locks its
own mapping with cudaHostRegister (map_shared), which makes it pinned memory like torch's own.

The allocator is pure host-side bookkeeping: a list of free ranges sorted by offset, first fit,
neighbours coalesced on free. Every block starts on an ALIGN-byte boundary so that tensors of
any supported dtype can be viewed in place.
"""

from __future__ import annotations

import bisect
import logging
import mmap
import os
import warnings
from typing import NamedTuple

import torch

log = logging.getLogger(__name__)

ALIGN = 4096  # block granularity: page-aligned for DMA, a multiple of every dtype's size


class ArenaBlock(NamedTuple):
    offset: int  # bytes from the start of the arena; a multiple of ALIGN
    size: int  # bytes requested (the block reserves size rounded up to ALIGN)

    @property
    def reserved(self) -> int:
        return _round_up(self.size)


class ArenaStats(NamedTuple):
    capacity: int
    used: int
    largest_free: int
    blocks: int


def _round_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _page_lock(buffer: torch.Tensor) -> None:
    """Registers ``buffer``'s memory with CUDA (page-locked, mapped for DMA) for the process's
    lifetime; torch then treats it as pinned memory."""
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(buffer.data_ptr(), buffer.numel(), 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of the {buffer.numel()}-byte arena failed: {err}")
    if not buffer.is_pinned():
        raise RuntimeError("the host arena is registered with CUDA, yet torch sees it unpinned")


def map_shared(fd: int, size: int, pin: bool) -> torch.Tensor:
    """The arena's memfd mapped shared in this process, as a uint8 tensor; with ``pin``,
    page-locked for CUDA (each process that copies from it to a GPU locks its own mapping).
    The mapping lives as long as the tensor."""
    mapping = mmap.mmap(fd, size)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "non-writable buffer": it is writable
        buffer = torch.frombuffer(mapping, dtype=torch.uint8)
    if pin:
        _page_lock(buffer)
    return buffer


class SharedArena(NamedTuple):
    """A process's mapping of the arena with the memfd behind it: what another process needs to
    map the same memory (tensor-parallel workers read adapter bytes where they lie)."""

    fd: int
    buffer: torch.Tensor  # this process's mapping, uint8


class HostArena:
    """Contiguous blocks of one preallocated host buffer. Not thread-safe: one owner (the
    service's event loop) allocates and frees; readers only view blocks they were given."""

    def __init__(self, capacity: int, pin: bool) -> None:
        if capacity <= 0:
            raise ValueError(f"arena capacity must be positive, got {capacity} bytes")
        capacity = _round_up(capacity)
        self.pinned = pin
        self.fd = os.memfd_create("lorafleet-host-arena", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, capacity)
        self.buffer = map_shared(self.fd, capacity, pin)
        # Free ranges (offset, size), sorted by offset, never adjacent (coalesced).
        self._free: list[tuple[int, int]] = [(0, capacity)]
        self._live: dict[int, int] = {}  # offset -> reserved size of each allocated block
        log.info("host arena: %.1f MiB%s", capacity / 2**20, " pinned" if pin else "")

    @property
    def shared(self) -> SharedArena:
        return SharedArena(self.fd, self.buffer)

    @property
    def capacity(self) -> int:
        return self.buffer.numel()

    def alloc(self, size: int) -> ArenaBlock | None:
        """First-fit block of ``size`` bytes, or None when no free range is large enough."""
        if size <= 0:
            raise ValueError(f"block size must be positive, got {size}")
        need = _round_up(size)
        for i, (off, free) in enumerate(self._free):
            if free >= need:
                if free == need:
                    del self._free[i]
                else:
                    self._free[i] = (off + need, free - need)
                self._live[off] = need
                return ArenaBlock(off, size)
        return None

    def free(self, block: ArenaBlock) -> None:
        need = self._live.pop(block.offset, None)
        if need is None or need != block.reserved:
            raise ValueError(f"block at offset {block.offset} is not allocated in this arena")
        i = bisect.bisect_left(self._free, (block.offset, 0))
        off, size = block.offset, need
        if i < len(self._free) and self._free[i][0] == off + size:  # merge with the next range
            size += self._free.pop(i)[1]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == off:  # and the previous one
            prev_off, prev_size = self._free.pop(i - 1)
            off, size, i = prev_off, prev_size + size, i - 1
        self._free.insert(i, (off, size))

    def tensor(self, block: ArenaBlock) -> torch.Tensor:
        """The block's bytes as a uint8 tensor sharing the arena's (pinned) memory."""
        return self.buffer[block.offset : block.offset + block.size]

    def view(self, block: ArenaBlock) -> memoryview:
        """A writable memoryview of the block (no copy)."""
        return memoryview(self.tensor(block).numpy()).cast("B")

    def stats(self) -> ArenaStats:
        used = sum(self._live.values())
        largest = max((s for _, s in self._free), default=0)
        return ArenaStats(self.capacity, used, largest, len(self._live))

    def check_integrity(self) -> None:
        """Free and live ranges tile the buffer exactly once; raises AssertionError if not."""
        ranges = sorted([*self._free, *self._live.items()])
        pos = 0
        for off, size in ranges:
            assert off == pos, f"arena gap or overlap at offset {pos} (next range at {off})"
            pos += size
        assert pos == self.capacity, f"arena ranges cover {pos} of {self.capacity} bytes"
        for (a, sa), (b, _) in zip(self._free, self._free[1:], strict=False):
            assert a + sa < b, f"free ranges at {a} and {b} are not coalesced"
