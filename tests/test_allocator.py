"""Page allocator invariants: no partial allocation, reference counts, leak check."""

import random

import pytest

from attnserve.kvcache.allocator import PADDING_PAGE, KVCacheExhausted, PageAllocator


def _snapshot(a: PageAllocator):
    return a.refcount.copy(), list(a._free)


def test_alloc_hands_out_distinct_pages_never_the_padding_page():
    a = PageAllocator(9)
    pages = a.alloc(5) + a.alloc(3)
    assert len(set(pages)) == 8
    assert PADDING_PAGE not in pages
    assert a.num_free == 0 and a.num_used == 8 == a.total
    a.check_leaks()


def test_exhaustion_raises_and_leaves_allocator_unchanged():
    a = PageAllocator(8)
    held = a.alloc(4)
    before = _snapshot(a)
    with pytest.raises(KVCacheExhausted) as info:
        a.alloc(4)  # only 3 free
    assert info.value.requested == 4 and info.value.available == 3
    after = _snapshot(a)
    assert (before[0] == after[0]).all() and before[1] == after[1]
    a.check_leaks()
    assert len(a.alloc(3)) == 3  # everything that was free is still usable
    a.free(held)
    a.check_leaks()


def test_negative_and_zero_allocations():
    a = PageAllocator(4)
    assert a.alloc(0) == []
    with pytest.raises(ValueError, match="negative"):
        a.alloc(-1)
    with pytest.raises(ValueError, match="num_pages"):
        PageAllocator(1)


def test_share_and_free_follow_reference_counts():
    a = PageAllocator(6)
    pages = a.alloc(2)
    a.share(pages)
    a.share(pages[:1])
    assert a.refcount[pages[0]] == 3 and a.refcount[pages[1]] == 2
    a.free(pages)
    assert a.num_free == 3  # both still referenced
    a.free(pages)
    assert a.refcount[pages[0]] == 1 and a.refcount[pages[1]] == 0
    assert a.num_free == 4
    a.free(pages[:1])
    assert a.num_free == 5
    a.check_leaks()


def test_bad_free_and_share_raise_without_changing_counts():
    a = PageAllocator(6)
    (p,) = a.alloc(1)
    before = _snapshot(a)
    with pytest.raises(ValueError, match="not allocated"):
        a.free([p, a._free[0]])  # the second page is free, so nothing may be freed
    with pytest.raises(ValueError, match="out of range"):
        a.share([a.num_pages])
    with pytest.raises(ValueError, match="freed 2 times"):
        a.free([p, p])  # one reference, two frees
    after = _snapshot(a)
    assert (before[0] == after[0]).all() and before[1] == after[1]
    a.check_leaks()


def test_random_alloc_share_free_sequences_keep_the_books_balanced():
    rng = random.Random(0)
    a = PageAllocator(33)
    owned: list[int] = []  # one entry per reference held
    for _ in range(400):
        op = rng.random()
        if op < 0.4:
            n = rng.randint(0, 6)
            try:
                owned += a.alloc(n)
            except KVCacheExhausted:
                assert n > a.num_free
        elif op < 0.6 and owned:
            p = rng.choice(owned)
            a.share([p])
            owned.append(p)
        elif owned:
            p = owned.pop(rng.randrange(len(owned)))
            a.free([p])
        a.check_leaks()
        for p in set(owned):
            assert a.refcount[p] == owned.count(p)
    a.free(owned)
    assert a.num_free == a.total


def test_leak_check_catches_a_leak_and_a_double_free():
    a = PageAllocator(8)
    a.alloc(3)
    a.check_leaks()
    a._free.pop()  # a page vanishes from the books
    with pytest.raises(AssertionError, match="leak"):
        a.check_leaks()

    b = PageAllocator(8)
    (p,) = b.alloc(1)
    b._free.append(b._free[0])  # the same page twice on the free list
    with pytest.raises(AssertionError, match="duplicate"):
        b.check_leaks()
    b._free.pop()
    b.refcount[b._free[0]] = 1  # free but counted as used
    with pytest.raises(AssertionError):
        b.check_leaks()
    assert p not in b._free
