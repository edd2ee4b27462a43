"""The unified page pool: one device tensor for the KV cache and resident adapter weights.

Geometry (kernels/lora_layout.py): ``[layers, 2, slots, W]`` with ``W = kv_heads * head_dim`` and
``slots = num_pages * page_size``. A page is ``page_size`` consecutive slots. A sequence's KV
cache is a list of pages (its block table); an adapter's slot table is the slots of its pages in
order. Both come from the same PageAllocator, so memory that adapters do not use serves the KV
cache and the other way round.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from services.inference.engine.page_allocator import OwnerKind, PageAllocator, PageOwner


def page_bytes(num_layers: int, width: int, page_size: int, dtype: torch.dtype) -> int:
    """Bytes one page occupies across all layers and both halves."""
    return num_layers * 2 * page_size * width * dtype.itemsize


def pages_needed(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


class PagePool:
    def __init__(
        self,
        num_layers: int,
        width: int,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_layers, self.width = num_layers, width
        self.num_pages, self.page_size = num_pages, page_size
        # Zero-filled: adapter pages are written in full (adapter_copy.py pads with zeros) and KV
        # slots are written before they are read, so no stale value is ever used; zeros keep
        # a bug from turning into NaNs.
        self.tensor = torch.zeros(
            num_layers, 2, num_pages * page_size, width, dtype=dtype, device=device
        )  # [layers, 2, slots, W]
        self.allocator = PageAllocator(num_pages)

    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    @property
    def num_usable(self) -> int:
        """Pages that KV blocks and adapters can ever hold: all but the engine's reserved ones."""
        return self.num_pages - self.allocator.num_owned(OwnerKind.RESERVED)

    def reserve_page(self, name: str) -> int:
        """Take one page for the engine's own use, for good."""
        return self.allocator.allocate(PageOwner(OwnerKind.RESERVED, name), 1)[0]

    def check_integrity(self) -> None:
        self.allocator.check_integrity()

    # KV cache

    def kv_pages(self, seq_id: Hashable) -> list[int]:
        return self.allocator.pages_of(PageOwner(OwnerKind.KV, seq_id))

    def kv_pages_missing(self, seq_id: Hashable, num_tokens: int) -> int:
        """How many more pages the sequence needs to hold ``num_tokens`` tokens."""
        have = self.allocator.num_pages_of(PageOwner(OwnerKind.KV, seq_id))
        return max(0, pages_needed(num_tokens, self.page_size) - have)

    def grow_kv(self, seq_id: Hashable, num_tokens: int) -> list[int]:
        """Extend the sequence's pages to hold ``num_tokens`` tokens (OutOfPages: nothing taken)."""
        owner = PageOwner(OwnerKind.KV, seq_id)
        self.allocator.allocate(owner, self.kv_pages_missing(seq_id, num_tokens))
        return self.allocator.pages_of(owner)

    def free_kv(self, seq_id: Hashable) -> int:
        return self.allocator.release(PageOwner(OwnerKind.KV, seq_id))

    # Adapters

    def allocate_adapter(self, key: Hashable, num_slots: int) -> torch.Tensor:
        """Pages for an adapter of ``num_slots`` slots; returns its slot table (int64, host
        memory: adapter_copy.py stages it with the adapter's index row)."""
        n = pages_needed(num_slots, self.page_size)
        pages = self.allocator.allocate(PageOwner(OwnerKind.ADAPTER, key), n)
        return self.slot_table(pages)

    def free_adapter(self, key: Hashable) -> int:
        return self.allocator.release(PageOwner(OwnerKind.ADAPTER, key))

    def slot_table(self, pages: list[int]) -> torch.Tensor:
        """Slots of ``pages`` in order (host memory): page p covers slots [p * page_size,
        (p + 1) * page_size)."""
        p = torch.tensor(pages, dtype=torch.int64)
        return (p[:, None] * self.page_size + torch.arange(self.page_size)).flatten()
