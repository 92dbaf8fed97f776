"""What both Triton MLA kernels (decode.py, extend.py) read of the latent pool and of the query.

A pool row is [c | k_pe]: the compressed latent (LATENT wide, a power of two) and the decoupled RoPE key (ROPE
wide, padded to BLOCK_R for tl.arange); a query row is [q_c | q_pe] in the same layout, already absorbed.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def latent_rows(KV, kv_indices, page_base, n0, lo, hi, stride_kvt,
                BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, TILE_IN_PAGE: tl.constexpr):
    """Row pointers `[BLOCK_N, 1]` of the key tile starting at n0, and which rows lie in [lo, hi) `[BLOCK_N]`."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_mask = (offs_n >= lo) & (offs_n < hi)
    if TILE_IN_PAGE:
        # the tile lies inside one page (tiles start at multiples of BLOCK_N, which divides the page):
        # one page index per tile, and its rows are contiguous in the pool
        page = tl.load(kv_indices + page_base + tl.maximum(n0, 0) // PAGE_SIZE)
        first = page.to(tl.int64) * PAGE_SIZE + (n0 % PAGE_SIZE)
        row = KV + (first + tl.arange(0, BLOCK_N))[:, None] * stride_kvt
    else:
        page = tl.load(kv_indices + page_base + offs_n // PAGE_SIZE, mask=n_mask, other=0)
        row = KV + (page.to(tl.int64) * PAGE_SIZE + offs_n % PAGE_SIZE)[:, None] * stride_kvt
    return row, n_mask


@triton.jit
def latent_query(q_ptrs, row_mask, LATENT: tl.constexpr, ROPE: tl.constexpr, BLOCK_R: tl.constexpr,
                 DOT_F32: tl.constexpr):
    """q_c `[M, LATENT]` and q_pe `[M, BLOCK_R]` of the query rows at q_ptrs `[M, 1]`; rows outside row_mask and
    the rope's padding load as zeros, and a float32 dot takes them in float32."""
    q_c = tl.load(q_ptrs + tl.arange(0, LATENT)[None, :], mask=row_mask[:, None], other=0.0)
    offs_r = tl.arange(0, BLOCK_R)
    q_r = tl.load(q_ptrs + LATENT + offs_r[None, :], mask=row_mask[:, None] & (offs_r < ROPE)[None, :], other=0.0)
    if DOT_F32:
        q_c = q_c.to(tl.float32)
        q_r = q_r.to(tl.float32)
    return q_c, q_r
