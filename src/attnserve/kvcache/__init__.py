"""Paged KV cache: page allocator, request->slot table, per-layer K/V pools, calculator."""

from attnserve.kvcache.allocator import KVCacheExhausted, PageAllocator
from attnserve.kvcache.pool import KVPool, MHAKVPool, MLAKVPool, ReqToTokenPool

__all__ = ["KVCacheExhausted", "KVPool", "MHAKVPool", "MLAKVPool", "PageAllocator", "ReqToTokenPool"]
