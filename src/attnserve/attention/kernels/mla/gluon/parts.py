"""Every helper the Gluon MLA decode kernels (seesaw.py, scorer.py, narrow.py) share: a split's key range, a key
tile's pool rows, the cp.async copies of 64-column chunks and TMA tiles, the query's copy, a stage's release, a
CTA row's token and head, a tile's probabilities, and the epilogues that store the output through shared memory."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

# how a warpgroup holds `[rows, 64]` bf16 chunks for cp.async (the query's and the key tiles'): 128 B of a row per
# 8 threads, 4 rows a warp
COPY_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0]))


@gluon.jit
def split_range(seq, n_splits, split, BLOCK_N: gl.constexpr):
    """(lo, hi, tiles, active) of one split of keys 0..seq, as split_kv.split_bounds cuts them; an inactive
    split (past its request's count) has no tiles."""
    active = split < n_splits
    chunk = gl.cdiv(gl.cdiv(seq, n_splits), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = gl.minimum(lo + chunk, seq)
    return lo, hi, gl.where(active, gl.cdiv(gl.maximum(hi - lo, 0), BLOCK_N), 0), active


@gluon.jit
def tile_rows(kv_indices, page_base, n0, hi, PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr,
               layout: gl.constexpr):
    """Pool rows `[BLOCK_N]` of the key tile at n0; keys past hi repeat the last key (a valid row, never NaN)."""
    page, in_page = tile_pages(kv_indices, page_base, n0, hi, PAGE_SIZE, BLOCK_N, layout)
    return pool_rows(page, in_page, PAGE_SIZE)


@gluon.jit
def tile_pages(kv_indices, page_base, n0, hi, PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr,
               layout: gl.constexpr):
    """(page index, row in the page) `[BLOCK_N]` int32 of each key of the tile at n0, as tile_rows counts them."""
    offs_n = gl.minimum(n0 + gl.arange(0, BLOCK_N, layout=layout), hi - 1)
    return gl.load(kv_indices + page_base + offs_n // PAGE_SIZE), offs_n % PAGE_SIZE


@gluon.jit
def pool_rows(page, in_page, PAGE_SIZE: gl.constexpr):
    return page.to(gl.int64) * PAGE_SIZE + in_page


@gluon.jit
def fetch_tile(kv_indices, page_base, n0, hi, PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, layout: gl.constexpr,
               AHEAD: gl.constexpr):
    """A later copy's key tile, loaded now: (its pool rows, -) or with AHEAD (its page indices, rows in the page).

    Why AHEAD: the pool rows are computed from the loaded indices, so where they are computed the warp waits for
    the load. Computed at the load (tile_rows), that wait comes before the barrier wait that follows in the
    loop, a global load's latency each tile; AHEAD carries the loaded indices to the copy (rows_of), by when
    they have landed."""
    page, in_page = tile_pages(kv_indices, page_base, n0, hi, PAGE_SIZE, BLOCK_N, layout)
    if not AHEAD:
        page = pool_rows(page, in_page, PAGE_SIZE)
    return page, in_page


@gluon.jit
def rows_of(fetched, in_page, PAGE_SIZE: gl.constexpr, AHEAD: gl.constexpr):
    """The pool rows of what fetch_tile returned."""
    if AHEAD:
        rows = pool_rows(fetched, in_page, PAGE_SIZE)
    else:
        rows = fetched
    return rows


@gluon.jit
def copy_columns(c_dst, base, FIRST_CHUNK: gl.constexpr, CHUNKS: gl.constexpr, CHUNK: gl.constexpr, mask=None):
    """cp.async of columns [FIRST_CHUNK * CHUNK, (FIRST_CHUNK + CHUNKS) * CHUNK) of a tile."""
    for k in gl.static_range(FIRST_CHUNK, FIRST_CHUNK + CHUNKS):
        async_copy.async_copy_global_to_shared(c_dst.slice(k * CHUNK, CHUNK, dim=1), base + k * CHUNK, mask=mask)


@gluon.jit
def copy_query(q_ptrs, q_mask, q_c_smem, q_r_smem, q_loaded, LATENT: gl.constexpr, ROPE: gl.constexpr):
    """The query rows into shared memory by cp.async (q_ptrs `[rows, ROPE]`: their first 64 columns), all copies in
    flight at once; q_loaded (128 arrivals) completes when they land. Issued by the producer's threads before the
    partitions start, so the first latent copies follow right behind."""
    copy_columns(q_c_smem, q_ptrs, 0, LATENT // ROPE, ROPE, q_mask)
    async_copy.async_copy_global_to_shared(q_r_smem, q_ptrs + LATENT, mask=q_mask)
    async_copy.mbarrier_arrive(q_loaded, increment_count=False)


@gluon.jit
def release_stage(bar):
    gl.thread_barrier()  # every warp's wgmmas on the group are done
    mbarrier.arrive(bar, count=1)


@gluon.jit
def tma_tile(kv_desc, kv_indices, page_base, n0, loaded, bar_index, c_ring, r_ring, slot, FIRST: gl.constexpr,
              CHUNKS: gl.constexpr, WITH_ROPE: gl.constexpr, LATENT: gl.constexpr, ROPE: gl.constexpr,
              PAGE_SIZE: gl.constexpr):
    """Columns FIRST * 64 .. (FIRST + CHUNKS) * 64 of the tile at key n0 (64 rows of one page) into stage `slot`,
    one TMA box of 64 x 64 each, and with WITH_ROPE the rope's; loaded[bar_index] counts their bytes. (The page
    index is loaded before the barrier and stage addresses are computed.)"""
    row0 = gl.load(kv_indices + page_base + n0 // PAGE_SIZE) * PAGE_SIZE + n0 % PAGE_SIZE
    bar = loaded.index(bar_index)
    stage = c_ring.index(slot)
    if WITH_ROPE:
        mbarrier.expect(bar, (CHUNKS + 1) * 64 * ROPE * 2)  # 16-bit rows
    else:
        mbarrier.expect(bar, CHUNKS * 64 * ROPE * 2)
    for k in gl.static_range(FIRST, FIRST + CHUNKS):
        tma.async_copy_global_to_shared(kv_desc, [row0, k * ROPE], bar, stage.slice(k * ROPE, ROPE, dim=1))
    if WITH_ROPE:
        tma.async_copy_global_to_shared(kv_desc, [row0, LATENT], bar, r_ring.index(slot))


@gluon.jit
def zero_rows_past(c_half, n_valid, copy_layout: gl.constexpr):
    """Zeroes rows n_valid.. of this warpgroup's half of a stage `[64 keys, 256]`: a TMA tile's rows past the
    request's end are its page's unused slots, and whatever they hold (NaN, Inf) would reach the PV as 0 x NaN.
    Their scores need nothing: the softmax masks them before its max."""
    rows = gl.arange(0, 64, layout=gl.SliceLayout(1, copy_layout))
    for k in gl.static_range(c_half.shape[1] // 64):
        chunk = c_half.slice(k * 64, 64, dim=1)
        x = chunk.load(copy_layout)
        chunk.store(gl.where((rows < n_valid)[:, None], x, gl.zeros_like(x)))


@gluon.jit
def two_warpgroup_epilogue(acc, l_i, m_run, c_ring, amax_smem, l_smem, fin, Out, PartialO, PartialLse, b, hg, split,
                           active, stride_ob, stride_oh, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
                           W: gl.constexpr, NUM_HEADS: gl.constexpr, LATENT: gl.constexpr, WRITE_FINAL: gl.constexpr,
                           SCALED: gl.constexpr, row_s: gl.constexpr, row_o: gl.constexpr):
    """Both warpgroups' epilogue: warpgroup 0 holds the row sums and the max, and writes the LSE; each normalises
    and stores its 256 columns through its own stage (float16 partials scaled a row, as mla/attention.py says)."""
    BLOCK_H: gl.constexpr = 64
    HALF: gl.constexpr = LATENT // 2
    if SCALED:  # [64] this half's largest magnitude a row, for both warpgroups
        amax_smem.slice(W * BLOCK_H, BLOCK_H).store(gl.max(gl.abs(acc), axis=1))
    if W == 0:
        l_smem.store(l_i)
        release_stage(fin.index(0))
        mbarrier.wait(fin.index(1), 0)
        l_o = gl.convert_layout(l_i, row_o)
        if not WRITE_FINAL:
            tok_l, head_l, ok_l = row_token_head(b, 1, hg, NUM_HEADS, 1, BLOCK_H, row_s)
            lse = gl.where(l_i > 0.0, m_run + gl.log2(gl.where(l_i > 0.0, l_i, 1.0)), float("-inf"))
            gl.store(PartialLse + tok_l * stride_lb + head_l * stride_lh + split, lse, mask=ok_l & active)
    else:
        release_stage(fin.index(1))
        mbarrier.wait(fin.index(0), 0)
        l_o = l_smem.load(row_o)
    inv_l = 1.0 / gl.where(l_o > 0.0, l_o, 1.0)  # a reciprocal a row, not a division an element
    if SCALED:  # float16 partials: each row scaled by 2^k so that its largest value lands in [2^14, 2^15)
        row_max = gl.maximum(amax_smem.slice(0, BLOCK_H).load(row_o),
                             amax_smem.slice(BLOCK_H, BLOCK_H).load(row_o)) * inv_l
        k = gl.where(row_max > 0.0, 14.0 - gl.floor(gl.log2(gl.where(row_max > 0.0, row_max, 1.0))), 0.0)
        k = gl.minimum(gl.maximum(k, -100.0), 100.0)
        inv_l = inv_l * gl.exp2(k)
        if W == 0:
            tok_k, head_k, ok_k = row_token_head(b, 1, hg, NUM_HEADS, 1, BLOCK_H, row_o)
            gl.store(PartialO + tok_k * stride_pb + head_k * stride_ph + split * stride_ps + LATENT,
                     k.to(PartialO.dtype.element_ty), mask=ok_k & active)
    store_output(acc * inv_l[:, None], c_ring.index(W), Out, PartialO, b, 1, hg, split, active, stride_ob,
                  stride_oh, stride_pb, stride_ph, stride_ps, W * HALF, NUM_HEADS, 1, BLOCK_H, HALF, WRITE_FINAL)


@gluon.jit
def row_token_head(tok0, ntok, hg, NUM_HEADS: gl.constexpr, TOKENS: gl.constexpr, BLOCK_H: gl.constexpr,
                    layout: gl.constexpr):
    """Per row `[BLOCK_H]` of the CTA: its query token, its head, and whether it is a real (token, head).

    A CTA's 64 rows are TOKENS consecutive tokens x 64 / TOKENS heads (decode: 1 token, 64 heads of group hg)."""
    ROW_HEADS: gl.constexpr = BLOCK_H // TOKENS
    r = gl.arange(0, BLOCK_H, layout=layout)
    head = hg * ROW_HEADS + r % ROW_HEADS
    return tok0 + r // ROW_HEADS, head, (r // ROW_HEADS < ntok) & (head < NUM_HEADS)


@gluon.jit
def tile_probabilities(s, m_run, n0, hi, hi_row, qk_scale_log2, TOKENS: gl.constexpr, s_layout: gl.constexpr):
    """(p `[64, 64]` float32 at the new max, the new max, the factor from m_run to it) of the tile at key n0."""
    offs_n = n0 + gl.arange(0, 64, layout=gl.SliceLayout(0, s_layout))
    if TOKENS > 1:  # each row's own causal horizon (extend rows)
        s = gl.where(offs_n[None, :] < hi_row[:, None], s * qk_scale_log2, float("-inf"))
    else:
        s = gl.where((offs_n < hi)[None, :], s * qk_scale_log2, float("-inf"))
    m_new = gl.maximum(m_run, gl.max(s, axis=1))
    return gl.exp2(s - m_new[:, None]), m_new, gl.exp2(m_run - m_new)


@gluon.jit
def softmax_tile(s, m_run, n0, hi, hi_row, hi_min, qk_scale_log2, TOKENS: gl.constexpr, s_layout: gl.constexpr):
    """tile_probabilities, with no mask where every row sees the whole tile (n0 + 64 <= hi_min, the CTA's least
    horizon): a compare and a select an element fewer on all but a request's last tiles, as the scorer's whole
    tiles."""
    if hi_min - n0 >= 64:
        s = s * qk_scale_log2
        m_new = gl.maximum(m_run, gl.max(s, axis=1))
        p = gl.exp2(s - m_new[:, None])
        alpha = gl.exp2(m_run - m_new)
    else:
        p, m_new, alpha = tile_probabilities(s, m_run, n0, hi, hi_row, qk_scale_log2, TOKENS, s_layout)
    return p, m_new, alpha


@gluon.jit
def store_output(o, stage, Out, PartialO, tok0, ntok, hg, split, active, stride_ob, stride_oh, stride_pb, stride_ph,
                  stride_ps, col0, NUM_HEADS: gl.constexpr, TOKENS: gl.constexpr, BLOCK_H: gl.constexpr,
                  HALF: gl.constexpr, WRITE_FINAL: gl.constexpr):
    """This warpgroup's output columns (o `[64, HALF]` float32, the wgmma's layout) to global memory, through its
    own stage (free once both warpgroups passed `fin`: every copy consumed, every wgmma waited on).

    Why through shared memory: in the wgmma layout a warp's store covers 8 rows x 32 bytes, and of a 16-bit
    output 8 rows x 16 bytes (half sectors). Read back a row segment a warp (512 contiguous bytes), the stores
    coalesce. A 16-bit output is converted before it is staged: the staging's shared-memory traffic, not the
    stores, is what the epilogue costs."""
    out_ty: gl.constexpr = Out.dtype.element_ty if WRITE_FINAL else PartialO.dtype.element_ty
    STAGE_16: gl.constexpr = out_ty.primitive_bitwidth == 16
    # 16-bit: [64, HALF] in the stage's own 128-byte swizzle (the wgmma layout's 8 rows x 16 bytes and a warp's row
    # read, 4 x 128 bytes, both conflict-free), a warp reading 256 columns of a row. float32: over the stage's
    # [64, 2 * HALF] 16-bit bytes, 32-byte chunks XOR-swizzled over 4 rows so a warp's 8 rows x 32 bytes land in
    # different banks (two wavefronts, the minimum for 256 bytes), a warp reading 128 columns of a row
    stage_ty: gl.constexpr = out_ty if STAGE_16 else gl.float32
    staging_layout: gl.constexpr = (gl.NVMMASharedLayout.get_default_for([BLOCK_H, HALF], out_ty) if STAGE_16
                                    else gl.SwizzledSharedLayout(8, 1, 4, order=[1, 0]))
    rows_layout: gl.constexpr = gl.BlockedLayout([1, 8 if STAGE_16 else 4], [1, 32], [4, 1], [1, 0])
    staging = stage._reinterpret(stage_ty, [BLOCK_H, HALF], staging_layout)
    staging.store(o.to(stage_ty))
    gl.thread_barrier()
    o = staging.load(rows_layout)
    tok, head, ok = row_token_head(tok0, ntok, hg, NUM_HEADS, TOKENS, BLOCK_H, gl.SliceLayout(1, rows_layout))
    cols = col0 + gl.arange(0, HALF, layout=gl.SliceLayout(0, rows_layout))
    mask = (ok & active)[:, None]
    if WRITE_FINAL:
        gl.store(Out + tok[:, None] * stride_ob + head[:, None] * stride_oh + cols[None, :],
                 o.to(Out.dtype.element_ty), mask=mask)
    else:
        gl.store(PartialO + tok[:, None] * stride_pb + head[:, None] * stride_ph + split * stride_ps + cols[None, :],
                 o.to(PartialO.dtype.element_ty), mask=mask)
