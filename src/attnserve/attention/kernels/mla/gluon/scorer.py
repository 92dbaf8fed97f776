"""The scorer Gluon MLA decode kernel (Hopper) at 64+ heads: one warpgroup scores, the other copies; both
multiply ("scorer": the warpgroup that computes each key tile's whole score and its softmax).

A CTA owns 64 heads of one (request, split), with two warpgroups and two 72 KB stages, the roles split by work:

    scorer (wg0): S = q K^T over all 576 columns   softmax   publish P, alpha   o_L = o_L alpha + P V_L
    loader (wg1):                                             wait P, alpha      o_R = o_R alpha + P V_R
                  then, once both PVs have read the stage: copy tile t + 2 into it

Why: with the latent's columns split between the warpgroups, the two halves of a score cross through shared
memory (a float32 exchange and a wait) before the softmax, and each warpgroup issues its own copies on its path
to the next score. Here the score needs no exchange, and the copies are issued by the warpgroup that waits for
the probabilities anyway, during the next score. FlashInfer's Hopper MLA kernel divides its two warpgroups the
same way. Two warpgroups and no producer partition leave 255 registers a thread, so ptxas keeps the wgmmas
asynchronous.

Tiles come by cp.async (36 16-byte copies a loader thread), over pages of 64 tokens or more by TMA (nine 64 x 64
boxes of one page: one instruction instead of a thread's copies); a TMA tile's rows past the request's end are
zeroed by the scorer before either PV (an unused slot may hold anything; the score masks them). The
probabilities go to the tile's rope slot (the score has read it), the rescale factors to a slot per stage.

A split decode may store float16 partials (SCALED; mla/attention.py says why): both warpgroups write each row's
largest magnitude, and each row is scaled by the power of two that brings its largest value to [2^14, 2^15),
the exponent stored in column 512 by warpgroup 0 (parts.two_warpgroup_epilogue).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia import hopper
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from attnserve.attention.kernels.mla.gluon import parts


@gluon.jit
def _copy_tile(KV, kv_desc, rows, kv_indices, page_base, lo, stride_kvt, c_ring, r_ring, loaded, t, num_tiles,
               LATENT: gl.constexpr, ROPE: gl.constexpr, PAGE_SIZE: gl.constexpr):
    """Tile t `[64 keys, 576]` into stage t % 2. Over pages of 64 tokens or more a tile is 64 rows of one page:
    nine TMA boxes, loaded[t % 2] counting their bytes. Else by cp.async from `rows` (its pool rows), loaded[t % 2]
    counting this thread's arrival once its copies land. Nothing past the last tile."""
    if t < num_tiles:
        if PAGE_SIZE % 64 == 0:
            parts.tma_tile(kv_desc, kv_indices, page_base, lo + t * 64, loaded, t % 2, c_ring, r_ring, t % 2, 0,
                            LATENT // ROPE, True, LATENT, ROPE, PAGE_SIZE)
        else:
            offs = gl.arange(0, ROPE, layout=gl.SliceLayout(0, parts.COPY_LAYOUT))
            base = KV + rows[:, None] * stride_kvt + offs[None, :]  # [64, ROPE] pointers, 4 rows a thread
            parts.copy_columns(c_ring.index(t % 2), base, 0, LATENT // ROPE, ROPE)
            async_copy.async_copy_global_to_shared(r_ring.index(t % 2), base + LATENT)
            async_copy.mbarrier_arrive(loaded.index(t % 2), increment_count=False)


@gluon.jit
def _scorer(Out, PartialO, PartialLse, b, hg, split, lo, hi, num_tiles, active, qk_scale_log2, stride_ob, stride_oh,
            stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, q_c_smem, q_r_smem, c_ring, r_ring, alpha_smem,
            l_smem, amax_smem, q_loaded, loaded, p_ready, pv_done, fin, NUM_HEADS: gl.constexpr,
            LATENT: gl.constexpr, PAGE_SIZE: gl.constexpr, WRITE_FINAL: gl.constexpr, SCALED: gl.constexpr):
    """Warpgroup 0: each tile's whole score, its softmax, the probabilities for the loader, output columns 0-255."""
    BLOCK_H: gl.constexpr = 64
    BLOCK_N: gl.constexpr = 64
    HALF: gl.constexpr = LATENT // 2
    dtype: gl.constexpr = q_c_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HALF, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    acc = gl.zeros([BLOCK_H, HALF], gl.float32, layout=o_layout)  # output columns 0-255
    m_run = gl.full([BLOCK_H], -1.0e30, gl.float32, layout=row_s)
    l_i = gl.zeros([BLOCK_H], gl.float32, layout=row_s)
    mbarrier.wait(q_loaded, 0)
    for t in range(num_tiles):
        st = t % 2
        mbarrier.wait(loaded.index(st), (t // 2) & 1)
        hopper.fence_async_shared()  # cp.async's writes before the wgmmas read them
        s = hopper.warpgroup_mma(q_c_smem, c_ring.index(st).permute((1, 0)),
                                 gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=s_layout), use_acc=False,
                                 is_async=True)
        s = hopper.warpgroup_mma(q_r_smem, r_ring.index(st).permute((1, 0)), s, is_async=True)
        s = hopper.warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        if PAGE_SIZE % BLOCK_N == 0:
            if hi - (lo + t * BLOCK_N) < BLOCK_N:  # a TMA tile's rows past the request's end: zeros for the PVs
                parts.zero_rows_past(c_ring.index(st), hi - (lo + t * BLOCK_N), parts.COPY_LAYOUT)
                gl.thread_barrier()
                hopper.fence_async_shared()  # the zeros before either PV reads the stage
        if hi - (lo + t * BLOCK_N) >= BLOCK_N:  # a whole tile: no key to mask
            s = s * qk_scale_log2
            m_new = gl.maximum(m_run, gl.max(s, axis=1))
            p = gl.exp2(s - m_new[:, None])
            alpha = gl.exp2(m_run - m_new)
        else:
            p, m_new, alpha = parts.tile_probabilities(s, m_run, lo + t * BLOCK_N, hi, hi, qk_scale_log2, 1, s_layout)
        l_i = l_i * alpha + gl.sum(p, axis=1)
        m_run = m_new
        p = p.to(dtype)
        r_ring.index(st).store(p)  # the rope slot, read by this tile's score already
        if st == 0:  # by stage: the loader may read tile t's while the scorer writes tile t + 1's
            alpha_smem.slice(0, BLOCK_H).store(alpha)
        else:
            alpha_smem.slice(BLOCK_H, BLOCK_H).store(alpha)
        hopper.fence_async_shared()  # the loader's wgmma reads p
        parts.release_stage(p_ready.index(st))
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        acc = hopper.warpgroup_mma(gl.convert_layout(p, p_layout), c_ring.index(st).slice(0, HALF, dim=1), acc,
                                   is_async=True)
        acc = hopper.warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        parts.release_stage(pv_done.index(st))  # this warpgroup is done with the stage
    parts.two_warpgroup_epilogue(acc, l_i, m_run, c_ring, amax_smem, l_smem, fin, Out, PartialO, PartialLse, b, hg,
            split, active, stride_ob, stride_oh, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, 0, NUM_HEADS,
            LATENT, WRITE_FINAL, SCALED, row_s, row_o)


@gluon.jit
def _loader(Q, KV, kv_desc, Out, PartialO, PartialLse, kv_indices, b, hg, split, lo, hi, num_tiles, active, page_base,
            stride_qb, stride_qh, stride_kvt, stride_ob, stride_oh, stride_pb, stride_ph, stride_ps, stride_lb,
            stride_lh, q_c_smem, q_r_smem, c_ring, r_ring, alpha_smem, l_smem, amax_smem, q_loaded, loaded, p_ready,
            pv_done, fin, NUM_HEADS: gl.constexpr, LATENT: gl.constexpr, ROPE: gl.constexpr,
            PAGE_SIZE: gl.constexpr, WRITE_FINAL: gl.constexpr, SCALED: gl.constexpr):
    """Warpgroup 1: the query and every tile's copies, output columns 256-511.

    A later tile's page indices are loaded a tile ahead and kept as loaded; their pool rows are computed at its
    copy. Computed at the load, this warp waited for the load before its next barrier wait, a global load's latency
    each tile (1.25x at 128 x 4096 over single-token pages on an H100, sweep-mla-switches-h100-2.json)."""
    BLOCK_H: gl.constexpr = 64
    BLOCK_N: gl.constexpr = 64
    HALF: gl.constexpr = LATENT // 2
    copy_rows: gl.constexpr = gl.SliceLayout(1, parts.COPY_LAYOUT)
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HALF, 16])
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    tok, head, row_ok = parts.row_token_head(b, 1, hg, NUM_HEADS, 1, BLOCK_H, copy_rows)
    offs = gl.arange(0, ROPE, layout=gl.SliceLayout(0, parts.COPY_LAYOUT))
    q_ptrs = Q + tok[:, None] * stride_qb + head[:, None] * stride_qh + offs[None, :]  # [64, 64]
    q_mask = row_ok[:, None] & (offs < ROPE)[None, :]  # rows past the heads are zeros
    rows = parts.tile_rows(kv_indices, page_base, lo, hi, PAGE_SIZE, BLOCK_N, copy_rows)  # [64] pool rows
    rows1 = parts.tile_rows(kv_indices, page_base, lo + BLOCK_N, hi, PAGE_SIZE, BLOCK_N, copy_rows)
    parts.copy_query(q_ptrs, q_mask, q_c_smem, q_r_smem, q_loaded, LATENT, ROPE)  # while the page indices come
    _copy_tile(KV, kv_desc, rows, kv_indices, page_base, lo, stride_kvt, c_ring, r_ring, loaded, 0, num_tiles,
               LATENT, ROPE, PAGE_SIZE)
    _copy_tile(KV, kv_desc, rows1, kv_indices, page_base, lo, stride_kvt, c_ring, r_ring, loaded, 1, num_tiles,
               LATENT, ROPE, PAGE_SIZE)
    page, in_page = parts.tile_pages(kv_indices, page_base, lo + 2 * BLOCK_N, hi, PAGE_SIZE, BLOCK_N, copy_rows)

    acc = gl.zeros([BLOCK_H, HALF], gl.float32, layout=o_layout)  # output columns 256-511
    for t in range(num_tiles):
        st = t % 2
        mbarrier.wait(p_ready.index(st), (t // 2) & 1)
        hopper.fence_async_shared()  # the scorer's stores of p before this wgmma reads them
        if st == 0:
            alpha = alpha_smem.slice(0, BLOCK_H).load(row_o)
        else:
            alpha = alpha_smem.slice(BLOCK_H, BLOCK_H).load(row_o)
        acc = acc * alpha[:, None]
        acc = hopper.warpgroup_mma(r_ring.index(st), c_ring.index(st).slice(HALF, HALF, dim=1), acc, is_async=True)
        acc = hopper.warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        gl.thread_barrier()  # every warp's PV has read the stage
        if t + 2 < num_tiles:
            mbarrier.wait(pv_done.index(st), (t // 2) & 1)  # and the scorer's
            _copy_tile(KV, kv_desc, parts.pool_rows(page, in_page, PAGE_SIZE), kv_indices, page_base, lo,
                       stride_kvt, c_ring, r_ring, loaded, t + 2, num_tiles, LATENT, ROPE, PAGE_SIZE)
            page, in_page = parts.tile_pages(kv_indices, page_base, lo + (t + 3) * BLOCK_N, hi, PAGE_SIZE, BLOCK_N,
                                             copy_rows)
    async_copy.wait_group(0)  # no copy outlives the CTA (a split with no tiles never waited for its query)
    parts.two_warpgroup_epilogue(acc, gl.zeros([BLOCK_H], gl.float32, layout=row_s),
            gl.zeros([BLOCK_H], gl.float32, layout=row_s), c_ring, amax_smem, l_smem, fin, Out, PartialO, PartialLse,
            b, hg, split, active, stride_ob, stride_oh, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, 1,
            NUM_HEADS, LATENT, WRITE_FINAL, SCALED, row_s, row_o)


@gluon.jit
def mla_decode_scorer_kernel(
    Q, KV, Out, PartialO, PartialLse, kv_indptr, kv_indices, seq_lens, num_splits, group_first, group_ntok,
    qk_scale_log2,
    stride_qb, stride_qh, stride_kvt, stride_ob, stride_oh, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
    NUM_HEADS: gl.constexpr, LATENT: gl.constexpr, ROPE: gl.constexpr, PAGE_SIZE: gl.constexpr,
    WRITE_FINAL: gl.constexpr, CONSUMER_REGS: gl.constexpr, TOKENS: gl.constexpr, SCALED: gl.constexpr,
    kv_desc=None,
):
    """Grid (head groups, requests, splits); kv_desc: the latent pool's TMA descriptor over 64-token pages
    (None: cp.async tiles)."""
    BLOCK_H: gl.constexpr = 64
    BLOCK_N: gl.constexpr = 64
    dtype: gl.constexpr = Q.dtype.element_ty
    c_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, LATENT], dtype)
    r_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, ROPE], dtype)
    gl.static_assert(ROPE == BLOCK_N, "a tile's probabilities [64 rows, 64 keys] live in its [64 keys, 64] rope slot")
    gl.static_assert(TOKENS == 1, "one query token a CTA")
    vec_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])

    hg = gl.program_id(0)
    g = gl.program_id(1)
    split = gl.program_id(2)
    lo, hi, num_tiles, active = parts.split_range(gl.load(seq_lens + g), gl.load(num_splits + g), split, BLOCK_N)
    page_base = gl.load(kv_indptr + g)

    q_c_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, LATENT], c_smem_layout)  # 64 KB
    q_r_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, ROPE], r_smem_layout)  # 8 KB
    c_ring = gl.allocate_shared_memory(dtype, [2, BLOCK_N, LATENT], c_smem_layout)  # 128 KB
    r_ring = gl.allocate_shared_memory(dtype, [2, BLOCK_N, ROPE], r_smem_layout)  # 16 KB: rope, then probabilities
    alpha_smem = gl.allocate_shared_memory(gl.float32, [2 * BLOCK_H], vec_layout)  # a tile's rescale, by stage
    l_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_H], vec_layout)
    amax_smem = gl.allocate_shared_memory(gl.float32, [2 * BLOCK_H], vec_layout)
    q_loaded = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())  # 128 arrivals
    loaded = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())  # 128 arrivals a fill
    p_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())  # a tile's p and alpha
    pv_done = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())  # the scorer's PV, by stage
    fin = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_loaded, count=128)
    for i in gl.static_range(2):
        mbarrier.init(loaded.index(i), count=1 if PAGE_SIZE % BLOCK_N == 0 else 128)  # TMA bytes / cp.async
        mbarrier.init(pv_done.index(i), count=1)
        mbarrier.init(p_ready.index(i), count=1)
        mbarrier.init(fin.index(i), count=1)
    hopper.fence_async_shared()  # the barriers' init before the partitions use them

    gl.warp_specialize([
        (_scorer, (Out, PartialO, PartialLse, g, hg, split, lo, hi, num_tiles, active, qk_scale_log2, stride_ob,
                   stride_oh, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, q_c_smem, q_r_smem, c_ring,
                   r_ring, alpha_smem, l_smem, amax_smem, q_loaded, loaded, p_ready, pv_done, fin,
                   NUM_HEADS, LATENT, PAGE_SIZE, WRITE_FINAL, SCALED)),
        (_loader, (Q, KV, kv_desc, Out, PartialO, PartialLse, kv_indices, g, hg, split, lo, hi, num_tiles, active, page_base,
                   stride_qb, stride_qh, stride_kvt, stride_ob, stride_oh, stride_pb, stride_ph, stride_ps,
                   stride_lb, stride_lh, q_c_smem, q_r_smem, c_ring, r_ring, alpha_smem, l_smem, amax_smem,
                   q_loaded, loaded, p_ready, pv_done, fin, NUM_HEADS, LATENT, ROPE, PAGE_SIZE,
                   WRITE_FINAL, SCALED)),
    ], [4], [CONSUMER_REGS])
