"""The pool's host-side allocator on its own: no torch, no model."""

from __future__ import annotations

import random

import pytest

from services.inference.engine.page_allocator import (
    OutOfPages,
    OwnerKind,
    PageAllocator,
    PageOwner,
    PoolIntegrityError,
)


def kv(i: int) -> PageOwner:
    return PageOwner(OwnerKind.KV, i)


def adapter(name: str) -> PageOwner:
    return PageOwner(OwnerKind.ADAPTER, name)


def test_allocate_and_release_return_every_page():
    alloc = PageAllocator(10)
    a = alloc.allocate(kv(1), 3)
    b = alloc.allocate(adapter("x"), 4)
    assert len(set(a) | set(b)) == 7
    assert alloc.num_free == 3
    assert alloc.num_owned(OwnerKind.KV) == 3 and alloc.num_owned(OwnerKind.ADAPTER) == 4
    more = alloc.allocate(kv(1), 2)  # a KV cache grows by appending pages
    assert alloc.pages_of(kv(1)) == a + more
    alloc.check_integrity()
    assert alloc.release(kv(1)) == 5
    assert alloc.release(kv(1)) == 0  # releasing twice is harmless
    assert alloc.release(adapter("x")) == 4
    assert alloc.num_free == 10
    alloc.check_integrity()


def test_allocation_is_all_or_nothing():
    alloc = PageAllocator(4)
    alloc.allocate(kv(1), 3)
    with pytest.raises(OutOfPages, match="needs 2 pages, 1 free"):
        alloc.allocate(kv(2), 2)
    assert alloc.num_free == 1 and alloc.pages_of(kv(2)) == []
    alloc.check_integrity()


def test_rejects_bad_arguments():
    with pytest.raises(ValueError, match="positive"):
        PageAllocator(0)
    with pytest.raises(ValueError, match="cannot allocate -1"):
        PageAllocator(2).allocate(kv(0), -1)


def test_integrity_check_catches_double_ownership_and_leaks():
    alloc = PageAllocator(6)
    pages = alloc.allocate(kv(1), 2)
    alloc._pages[kv(2)] = [pages[0]]  # corrupt: one page listed for two owners
    with pytest.raises(PoolIntegrityError, match=f"page {pages[0]}"):
        alloc.check_integrity()

    alloc = PageAllocator(6)
    alloc.allocate(kv(1), 2)
    alloc._free.pop()  # corrupt: a page is neither free nor owned (leaked)
    with pytest.raises(PoolIntegrityError, match="appears 0 times"):
        alloc.check_integrity()

    alloc = PageAllocator(6)
    alloc._free.append(alloc._free[0])  # corrupt: a page on the free list twice
    with pytest.raises(PoolIntegrityError, match="appears 2 times"):
        alloc.check_integrity()


def test_random_sequences_keep_the_invariant():
    rng = random.Random(0)
    alloc = PageAllocator(64)
    owners = [kv(i) for i in range(8)] + [adapter(f"a{i}") for i in range(4)]
    held = dict.fromkeys(owners, 0)
    for _ in range(2000):
        owner = rng.choice(owners)
        if rng.random() < 0.6:
            n = rng.randint(0, 6)
            if n <= alloc.num_free:
                alloc.allocate(owner, n)
                held[owner] += n
            else:
                with pytest.raises(OutOfPages):
                    alloc.allocate(owner, n)
        else:
            assert alloc.release(owner) == held[owner]
            held[owner] = 0
        assert alloc.num_free == 64 - sum(held.values())
        alloc.check_integrity()
    for owner in owners:
        alloc.release(owner)
    assert alloc.num_free == 64
    alloc.check_integrity()


def test_release_touches_only_the_owners_pages():
    """Cost O(pages touched): releasing one small owner in a big pool leaves the rest alone."""
    alloc = PageAllocator(100_000)
    alloc.allocate(kv("big"), 90_000)
    alloc.allocate(kv("small"), 3)
    free_before = list(alloc._free)
    assert alloc.release(kv("small")) == 3
    assert alloc._free[: len(free_before)] == free_before  # appended, nothing rescanned
    assert alloc.num_pages_of(kv("big")) == 90_000
