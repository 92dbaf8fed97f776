"""Radix prefix cache: matching, splitting, reference counts and LRU eviction over a real allocator."""

import random

import pytest

from attnserve.kvcache.allocator import PageAllocator
from attnserve.kvcache.radix import RadixCache


def _cache_request(cache, alloc, tokens, page_size):
    """What the engine does: reuse the cached prefix, allocate the rest, insert, release."""
    pages = cache.match_prefix(tokens)
    alloc.share(pages)
    need = -(-len(tokens) // page_size) - len(pages)
    pages = pages + alloc.alloc(need)
    cache.insert(tokens, pages)
    alloc.free(pages)
    return pages


@pytest.mark.parametrize("page_size", [1, 4])
def test_match_returns_page_aligned_prefix(page_size):
    alloc = PageAllocator(64)
    cache = RadixCache(alloc, page_size)
    a = list(range(10))
    _cache_request(cache, alloc, a, page_size)
    full = 10 // page_size * page_size
    assert len(cache.match_prefix(a)) * page_size == full
    # a prompt diverging at token 6 matches the whole pages before it
    b = a[:6] + [99, 98, 97, 96]
    got = cache.match_prefix(b)
    assert len(got) == 6 // page_size
    assert got == cache.match_prefix(a)[: len(got)]
    # max_len caps the match (the engine's "recompute the last token")
    assert len(cache.match_prefix(a, max_len=len(a) - 1)) * page_size == (len(a) - 1) // page_size * page_size


@pytest.mark.parametrize("diverge", [0, 3, 511, 512, 513, 1500, 2047])
@pytest.mark.parametrize("page_size", [1, 4])
def test_long_prefix_diverging_anywhere_matches_the_whole_pages_before_it(page_size, diverge):
    """Keys longer than one compare chunk (512 tokens): the match is exact wherever they differ."""
    alloc = PageAllocator(4096)
    cache = RadixCache(alloc, page_size)
    rng = random.Random(diverge)
    a = [rng.randrange(1000) for _ in range(2048)]
    _cache_request(cache, alloc, a, page_size)
    b = a[:diverge] + [a[diverge] + 1] + a[diverge + 1 :]
    assert len(cache.match_prefix(b)) == diverge // page_size
    assert len(cache.match_prefix(a[: diverge + 1])) == (diverge + 1) // page_size  # shorter than the key


def test_split_keeps_pages_and_refcounts():
    alloc = PageAllocator(32)
    cache = RadixCache(alloc, 2)
    a = [1, 2, 3, 4, 5, 6, 7, 8]
    b = [1, 2, 3, 4, 9, 9, 9, 9]
    pa = _cache_request(cache, alloc, a, 2)
    pb = _cache_request(cache, alloc, b, 2)
    assert pb[:2] == pa[:2]  # shared prefix pages reused
    assert cache.num_nodes() == 3  # [1..4] -> {[5..8], [9..9]}
    assert cache.num_pages == 6
    assert all(alloc.refcount[p] == 1 for p in set(pa + pb))
    alloc.check_leaks()
    assert alloc.num_free == alloc.total - 6


def test_duplicate_insert_keeps_tree_pages_and_frees_callers():
    alloc = PageAllocator(16)
    cache = RadixCache(alloc, 1)
    tokens = [5, 6, 7]
    first = alloc.alloc(3)
    second = alloc.alloc(3)
    assert cache.insert(tokens, first) == 3
    assert cache.insert(tokens, second) == 0
    alloc.free(first)
    alloc.free(second)
    assert cache.match_prefix(tokens) == first
    assert alloc.num_free == alloc.total - 3
    alloc.check_leaks()


def test_eviction_is_lru_and_skips_pages_in_use():
    alloc = PageAllocator(16)
    cache = RadixCache(alloc, 1)
    old = [1, 1, 1]
    mid = [2, 2, 2]
    new = [3, 3, 3]
    for t in (old, mid, new):
        _cache_request(cache, alloc, t, 1)
    # a running request holds `old` (touching it also makes it the most recent)
    held = cache.match_prefix(old)
    alloc.share(held)
    assert cache.evictable_pages() == 6
    assert cache.evict(3) == 3
    assert cache.match_prefix(mid, record=False) == []  # least recently used went first
    assert len(cache.match_prefix(new, record=False)) == 3
    assert cache.evict(100) == 3  # only `new` can go; `old` is in use
    assert len(cache.match_prefix(old, record=False)) == 3
    alloc.free(held)
    assert cache.evict(100) == 3
    assert cache.num_pages == 0 and alloc.num_free == alloc.total
    alloc.check_leaks()


def test_evicting_a_leaf_exposes_its_parent():
    alloc = PageAllocator(16)
    cache = RadixCache(alloc, 1)
    _cache_request(cache, alloc, [1, 2, 3, 4], 1)
    _cache_request(cache, alloc, [1, 2, 7, 8], 1)
    assert cache.evict(6) == 6
    assert cache.num_nodes() == 0
    alloc.check_leaks()


def test_hit_statistics():
    alloc = PageAllocator(16)
    cache = RadixCache(alloc, 1)
    _cache_request(cache, alloc, [1, 2, 3, 4], 1)  # a miss: 0 of 4
    cache.match_prefix([1, 2, 3, 9])  # 3 of 4
    assert cache.stats.lookup_tokens == 8
    assert cache.stats.hit_tokens == 3
    assert cache.stats.hit_rate == pytest.approx(3 / 8)


def test_random_workload_never_leaks():
    rng = random.Random(0)
    alloc = PageAllocator(200)
    cache = RadixCache(alloc, 4)
    prefixes = [[rng.randrange(5) for _ in range(rng.randrange(4, 20))] for _ in range(5)]
    for _ in range(300):
        tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 12))]
        need = -(-len(tokens) // 4)
        if alloc.num_free < need:
            cache.evict(need - alloc.num_free)
        _cache_request(cache, alloc, tokens, 4)
        alloc.check_leaks()
        assert alloc.num_used == cache.num_pages
        # every cached path reads back the pages it was stored with
        assert len(cache.match_prefix(tokens, record=False)) == len(tokens) // 4
    cache.reset()
    assert alloc.num_free == alloc.total


def test_unused_parent_of_a_leaf_in_use_is_not_evictable():
    # two requests computed the same prefix in one step: the tree kept the first one's prefix pages
    # (now read by nobody) and took the second one's suffix page, which it still reads
    alloc = PageAllocator(16)
    cache = RadixCache(alloc, 1)
    first = alloc.alloc(2)
    cache.insert([1, 2], first)
    alloc.free(first)
    running = alloc.alloc(3)
    cache.insert([1, 2, 3], running)
    assert cache.num_nodes() == 2
    assert cache.evictable_pages() == 0  # [1, 2] is unused but sits above the running leaf
    assert cache.evict(100) == 0
    alloc.free(running)
    assert cache.evictable_pages() == 3
    assert cache.evict(100) == 3
    alloc.check_leaks()


def test_evictable_pages_is_what_evict_frees():
    rng = random.Random(3)
    for trial in range(20):
        alloc = PageAllocator(400)
        cache = RadixCache(alloc, 2)
        held = []
        for _ in range(25):
            tokens = [rng.randrange(3) for _ in range(rng.randrange(2, 16))]
            pages = cache.match_prefix(tokens, record=False)
            alloc.share(pages)
            if rng.random() < 0.3:  # sometimes recompute a cached prefix instead of reusing it
                alloc.free(pages)
                pages = []
            pages = pages + alloc.alloc(-(-len(tokens) // 2) - len(pages))
            cache.insert(tokens, pages)
            if rng.random() < 0.4:
                held.append(pages)  # still running
            else:
                alloc.free(pages)
        promised = cache.evictable_pages()
        assert cache.evict(10**6) == promised, f"trial {trial}"
        assert cache.evictable_pages() == 0
        for pages in held:
            alloc.free(pages)
        alloc.check_leaks()
