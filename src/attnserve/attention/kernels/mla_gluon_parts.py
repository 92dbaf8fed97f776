"""Pieces both Gluon MLA decode kernels share (mla_decode_seesaw.py, mla_decode_narrow.py): a split's key range,
a key tile's pool rows, the cp.async copies of 64-column chunks, the query's copy, a stage's release."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import mbarrier


@gluon.jit
def _split_range(seq, n_splits, split, BLOCK_N: gl.constexpr):
    """(lo, hi, tiles, active) of one split of keys 0..seq, as mla_decode.split_bounds cuts them; an inactive
    split (past its request's count) has no tiles."""
    active = split < n_splits
    chunk = gl.cdiv(gl.cdiv(seq, n_splits), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = gl.minimum(lo + chunk, seq)
    return lo, hi, gl.where(active, gl.cdiv(gl.maximum(hi - lo, 0), BLOCK_N), 0), active


@gluon.jit
def _tile_rows(kv_indices, page_base, n0, hi, PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr,
               layout: gl.constexpr):
    """Pool rows `[BLOCK_N]` of the key tile at n0; keys past hi repeat the last key (a valid row, never NaN)."""
    offs_n = gl.minimum(n0 + gl.arange(0, BLOCK_N, layout=layout), hi - 1)
    page = gl.load(kv_indices + page_base + offs_n // PAGE_SIZE)
    return page.to(gl.int64) * PAGE_SIZE + offs_n % PAGE_SIZE


@gluon.jit
def _copy_columns(c_dst, base, FIRST_CHUNK: gl.constexpr, CHUNKS: gl.constexpr, CHUNK: gl.constexpr, mask=None):
    """cp.async of columns [FIRST_CHUNK * CHUNK, (FIRST_CHUNK + CHUNKS) * CHUNK) of a tile."""
    for k in gl.static_range(FIRST_CHUNK, FIRST_CHUNK + CHUNKS):
        async_copy.async_copy_global_to_shared(c_dst.slice(k * CHUNK, CHUNK, dim=1), base + k * CHUNK, mask=mask)


@gluon.jit
def _copy_query(q_ptrs, q_mask, q_c_smem, q_r_smem, q_loaded, LATENT: gl.constexpr, ROPE: gl.constexpr):
    """The query rows into shared memory by cp.async (q_ptrs `[rows, ROPE]`: their first 64 columns), all copies in
    flight at once; q_loaded (128 arrivals) completes when they land. Issued by the producer's threads before the
    partitions start, so the first latent copies follow right behind."""
    _copy_columns(q_c_smem, q_ptrs, 0, LATENT // ROPE, ROPE, q_mask)
    async_copy.async_copy_global_to_shared(q_r_smem, q_ptrs + LATENT, mask=q_mask)
    async_copy.mbarrier_arrive(q_loaded, increment_count=False)


@gluon.jit
def _release(bar):
    gl.thread_barrier()  # every warp's wgmmas on the group are done
    mbarrier.arrive(bar, count=1)
