"""Page allocator with reference counts.

Pages are integers. Page 0 is reserved as the padding page: padded CUDA-graph
replays and dummy tokens write there, so it is never handed out. Sharing a page
(the radix cache, forked requests) raises its count; a page returns to the free
list when its count drops to zero.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

PADDING_PAGE = 0


class KVCacheExhausted(RuntimeError):
    """Not enough free pages; the allocator is left exactly as it was."""

    def __init__(self, requested: int, available: int):
        super().__init__(f"KV cache exhausted: requested {requested} pages, {available} free")
        self.requested = requested
        self.available = available


class PageAllocator:
    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is reserved for padding), got {num_pages}")
        self.num_pages = num_pages
        self.refcount = np.zeros(num_pages, dtype=np.int32)  # [num_pages]
        # LIFO free list: recently freed pages are reused first (warm in cache)
        self._free: list[int] = list(range(num_pages - 1, PADDING_PAGE, -1))

    @property
    def total(self) -> int:
        """Pages that can be handed out (all but the padding page)."""
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return int(np.count_nonzero(self.refcount))

    def alloc(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of pages ({n})")
        if n > len(self._free):
            raise KVCacheExhausted(n, len(self._free))
        if n == 0:
            return []
        pages = self._free[-n:]
        del self._free[-n:]
        self.refcount[pages] = 1
        return pages

    def _check(self, pages: list[int]) -> None:
        for p in pages:
            if not 0 < p < self.num_pages:
                raise ValueError(f"page {p} out of range [1, {self.num_pages})")
            if self.refcount[p] <= 0:
                raise ValueError(f"page {p} is not allocated")

    def share(self, pages: Iterable[int]) -> None:
        """Add one reference to each page (another owner now reads it)."""
        pages = list(pages)
        self._check(pages)
        np.add.at(self.refcount, pages, 1)

    def free(self, pages: Iterable[int]) -> None:
        """Drop one reference from each page; pages reaching zero become free."""
        pages = list(pages)
        self._check(pages)
        counts: dict[int, int] = {}
        for p in pages:
            counts[p] = counts.get(p, 0) + 1
        for p, c in counts.items():
            if c > self.refcount[p]:
                raise ValueError(f"page {p} freed {c} times but holds {self.refcount[p]} references")
        for p, c in counts.items():
            self.refcount[p] -= c
            if self.refcount[p] == 0:
                self._free.append(p)

    def check_leaks(self) -> None:
        """Raise if pages went missing or are double-counted: free + used must equal total."""
        free_set = set(self._free)
        if len(free_set) != len(self._free):
            raise AssertionError("free list holds duplicate pages")
        if PADDING_PAGE in free_set:
            raise AssertionError("padding page is on the free list")
        if any(self.refcount[p] != 0 for p in free_set):
            raise AssertionError("a free page has a nonzero reference count")
        if self.num_free + self.num_used != self.total:
            raise AssertionError(
                f"page leak: free {self.num_free} + used {self.num_used} != total {self.total}"
            )
