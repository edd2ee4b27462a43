"""Host-side allocator of the unified page pool: one free list for KV blocks and adapter pages.

Pure Python, no torch: the device tensor lives in page_pool.py. Every page is either on the free
list or owned by exactly one owner (a sequence's KV cache or a resident adapter); allocate and
release cost O(pages touched), and check_integrity() proves the invariant on demand.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable
from typing import NamedTuple


class OwnerKind(enum.Enum):
    KV = "kv"  # a sequence's KV-cache blocks, in position order
    ADAPTER = "adapter"  # a resident adapter's slot table, in slot-table order
    RESERVED = "reserved"  # kept by the engine itself (the padding rows of CUDA-graph steps)


class PageOwner(NamedTuple):
    kind: OwnerKind
    key: Hashable  # sequence id or AdapterKey


class OutOfPages(Exception):
    """Fewer free pages than asked for; nothing was allocated."""


class PoolIntegrityError(AssertionError):
    """The allocator's bookkeeping is inconsistent (a bug, never a user error)."""


class PageAllocator:
    def __init__(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        self.num_pages = num_pages
        # Pop from the end: low page ids are handed out first, which keeps tests readable.
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._owner: list[PageOwner | None] = [None] * num_pages
        self._pages: dict[PageOwner, list[int]] = {}
        # Pages owned per kind, kept as counters so that stats() from another thread reads
        # plain ints instead of iterating a dict that the step thread mutates.
        self._owned = dict.fromkeys(OwnerKind, 0)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def num_owned(self, kind: OwnerKind) -> int:
        return self._owned[kind]

    def pages_of(self, owner: PageOwner) -> list[int]:
        """The owner's pages in allocation order (a copy; empty when it owns none)."""
        return list(self._pages.get(owner, ()))

    def num_pages_of(self, owner: PageOwner) -> int:
        return len(self._pages.get(owner, ()))

    def allocate(self, owner: PageOwner, n: int) -> list[int]:
        """Append ``n`` pages to ``owner``'s list and return them; all or nothing."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            raise OutOfPages(
                f"{owner.kind.value} {owner.key!r} needs {n} pages, {self.num_free} free"
            )
        if n == 0:
            return []
        got = self._free[-n:]
        del self._free[-n:]
        for p in got:
            self._owner[p] = owner
        self._pages.setdefault(owner, []).extend(got)
        self._owned[owner.kind] += n
        return got

    def release(self, owner: PageOwner) -> int:
        """Return all of ``owner``'s pages to the free list; returns how many."""
        pages = self._pages.pop(owner, None)
        if not pages:
            return 0
        for p in pages:
            if self._owner[p] != owner:
                raise PoolIntegrityError(
                    f"page {p} is listed for {owner} but owned by {self._owner[p]}"
                )
            self._owner[p] = None
        self._free.extend(pages)
        self._owned[owner.kind] -= len(pages)
        return len(pages)

    def check_integrity(self) -> None:
        """Raise PoolIntegrityError unless every page is free or owned exactly once."""
        seen = [0] * self.num_pages
        for p in self._free:
            if self._owner[p] is not None:
                raise PoolIntegrityError(f"free page {p} has owner {self._owner[p]}")
            seen[p] += 1
        for owner, pages in self._pages.items():
            if not pages:
                raise PoolIntegrityError(f"{owner} is listed with no pages")
            for p in pages:
                if self._owner[p] != owner:
                    raise PoolIntegrityError(f"page {p} of {owner} is marked {self._owner[p]}")
                seen[p] += 1
        for kind in OwnerKind:
            listed = sum(len(p) for o, p in self._pages.items() if o.kind is kind)
            if listed != self._owned[kind]:
                raise PoolIntegrityError(
                    f"{kind.value} owns {listed} pages, counted {self._owned[kind]}"
                )
        for p, count in enumerate(seen):
            if count != 1:
                raise PoolIntegrityError(f"page {p} appears {count} times (free or owned)")
