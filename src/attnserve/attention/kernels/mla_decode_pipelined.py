"""The column-split MLA decode (mla_decode_colsplit.py) on 32-key tiles in four stages, its scores issued a tile
ahead: the next tile's score wgmmas run on the tensor pipe while warpgroup 0 computes this tile's softmax.

The column-split kernel leaves the tensor pipe idle under the softmax: its two 72 KB stages hold the tile being
multiplied and the one being copied, so the next score has no tile to read. Halving the tile to 32 keys gives four
stages in the same 144 KB: tile t is multiplied, tile t + 1 is scored, tiles t + 2 and t + 3 are in flight.

    wg0: issue S_L(t+1)   S(t) = S_L(t) + x(t), softmax   publish P(t)   wait PV_L(t-1), S_L(t+1)   issue PV_L(t)
    wg1: issue S_R(t+1)   wait P(t)   wait PV_R(t-1), S_R(t+1)   issue PV_R(t)   publish x(t+1)
    each, then: refill the stage of tile t - 1 with tile t + 3 (its PV and its score are done)

The scores' halves cross through two 64 x 32 float32 buffers (x(t), x(t + 1)); the probabilities go to the tile's
rope slot as before. The last iteration scores a tile past the end (whatever its stage holds) so that every
iteration has the same wgmmas in flight; its result is dropped.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)

from attnserve.attention.kernels.mla_decode_seesaw import _row_token_head, _store_output
from attnserve.attention.kernels.mla_gluon_parts import _copy_columns, _release, _split_range, _tile_rows

STAGES = 4
TILE_KEYS = 32


@gluon.jit
def _copy_half(KV, rows, stride_kvt, c_ring, r_ring, t, num_tiles, W: gl.constexpr, LATENT: gl.constexpr,
               ROPE: gl.constexpr, STAGES: gl.constexpr, copy_layout: gl.constexpr):
    """Tile t's latent columns of warpgroup W (0: 0-255; 1: 256-511 and the rope) into stage t % STAGES by cp.async,
    rows `[32]` its pool rows, as one commit group (empty past the last tile)."""
    QUARTER: gl.constexpr = LATENT // 2 // ROPE
    if t < num_tiles:
        offs = gl.arange(0, ROPE, layout=gl.SliceLayout(0, copy_layout))
        base = KV + rows[:, None] * stride_kvt + offs[None, :]  # [32, ROPE] pointers
        _copy_columns(c_ring.index(t % STAGES), base, W * QUARTER, QUARTER, ROPE)
        if W == 1:
            async_copy.async_copy_global_to_shared(r_ring.index(t % STAGES), base + LATENT)
    async_copy.commit_group()


@gluon.jit
def _score_half(q_half, q_pe, c_ring, r_ring, t, W: gl.constexpr, HALF: gl.constexpr, STAGES: gl.constexpr,
                s_layout: gl.constexpr):
    """Issue warpgroup W's half of tile t's score `[64, 32]` (warpgroup 1: with the rope), asynchronously."""
    BLOCK_N: gl.constexpr = c_ring.shape[1]
    st = t % STAGES
    s = warpgroup_mma(q_half, c_ring.index(st).slice(W * HALF, HALF, dim=1).permute((1, 0)),
                      gl.zeros([64, BLOCK_N], gl.float32, layout=s_layout), use_acc=False, is_async=True)
    if W == 1:
        s = warpgroup_mma(q_pe, r_ring.index(st).permute((1, 0)), s, is_async=True)
    return s


@gluon.jit
def _pipelined_warpgroup(
    Q, KV, Out, PartialO, PartialLse, kv_indices, b, hg, split, lo, hi, num_tiles, active,
    page_base, qk_scale_log2, stride_qb, stride_qh, stride_kvt, stride_ob, stride_oh, stride_pb, stride_ph, stride_ps,
    stride_lb, stride_lh, q_c_smem, q_r_view, c_ring, r_ring, p_ring, out_stages, x_smem, alpha_smem, l_smem,
    amax_smem, x_ready, x_free, p_ready, fin, W: gl.constexpr, NUM_HEADS: gl.constexpr, LATENT: gl.constexpr,
    ROPE: gl.constexpr, PAGE_SIZE: gl.constexpr, WRITE_FINAL: gl.constexpr, SCALED: gl.constexpr,
    STAGES: gl.constexpr,
):
    BLOCK_H: gl.constexpr = 64
    BLOCK_N: gl.constexpr = c_ring.shape[1]
    HALF: gl.constexpr = LATENT // 2
    dtype: gl.constexpr = q_c_smem.dtype
    copy_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    copy_rows: gl.constexpr = gl.SliceLayout(1, copy_layout)
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HALF, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    # the query's half (warpgroup 1: and the rope part), then tiles 0, 1, 2: three commit groups, the query in the first
    tok, head, row_ok = _row_token_head(b, 1, hg, NUM_HEADS, 1, BLOCK_H, copy_rows)
    offs = gl.arange(0, ROPE, layout=gl.SliceLayout(0, copy_layout))
    q_ptrs = Q + tok[:, None] * stride_qb + head[:, None] * stride_qh + offs[None, :]  # [64, 64]
    q_mask = row_ok[:, None] & (offs < ROPE)[None, :]
    _copy_columns(q_c_smem, q_ptrs, W * (HALF // ROPE), HALF // ROPE, ROPE, q_mask)
    if W == 1:
        async_copy.async_copy_global_to_shared(q_r_view, q_ptrs + LATENT, mask=q_mask)
    for i in gl.static_range(3):
        rows = _tile_rows(kv_indices, page_base, lo + i * BLOCK_N, hi, PAGE_SIZE, BLOCK_N, copy_rows)
        _copy_half(KV, rows, stride_kvt, c_ring, r_ring, i, num_tiles, W, LATENT, ROPE, STAGES, copy_layout)
    rows = _tile_rows(kv_indices, page_base, lo + 3 * BLOCK_N, hi, PAGE_SIZE, BLOCK_N, copy_rows)

    acc = gl.zeros([BLOCK_H, HALF], gl.float32, layout=o_layout)
    m_run = gl.full([BLOCK_H], -1.0e30, gl.float32, layout=row_s)
    l_i = gl.zeros([BLOCK_H], gl.float32, layout=row_s)
    q_half = q_c_smem.slice(W * HALF, HALF, dim=1)
    async_copy.wait_group(2)  # the query and tile 0
    gl.thread_barrier()
    q_pe = gl.zeros([BLOCK_H, ROPE], dtype, layout=gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2))
    if W == 1:
        q_pe = q_r_view.load(gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2))  # [64, 64]
        gl.thread_barrier()  # every thread holds its rope before the buffer takes scores
    fence_async_shared()
    s_cur = _score_half(q_half, q_pe, c_ring, r_ring, 0, W, HALF, STAGES, s_layout)
    s_cur = warpgroup_mma_wait(num_outstanding=0, deps=(s_cur,))
    if W == 1:
        x_smem.index(0).store(s_cur)
        _release(x_ready.index(0))
    acc = warpgroup_mma_init(acc)  # loop-carried in flight: each iteration's PV is waited on in the next

    for t in range(num_tiles):
        st = t % STAGES
        c_half = c_ring.index(st).slice(W * HALF, HALF, dim=1)
        async_copy.wait_group(1)  # tile t + 1 (tile t + 2's copies may fly)
        gl.thread_barrier()
        fence_async_shared()
        s_next = _score_half(q_half, q_pe, c_ring, r_ring, t + 1, W, HALF, STAGES, s_layout)
        if W == 0:
            mbarrier.wait(x_ready.index(t % 2), (t // 2) & 1)
            s = s_cur + x_smem.index(t % 2).load(s_layout)
            _release(x_free.index(t % 2))
            offs_n = lo + t * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            s = gl.where((offs_n < hi)[None, :], s * qk_scale_log2, float("-inf"))
            m_new = gl.maximum(m_run, gl.max(s, axis=1))
            p = gl.exp2(s - m_new[:, None])
            alpha = gl.exp2(m_run - m_new)
            l_i = l_i * alpha + gl.sum(p, axis=1)
            m_run = m_new
            p = p.to(dtype)
            p_ring.index(st).store(p)
            alpha_smem.store(alpha)
            fence_async_shared()
            _release(p_ready)
            acc, s_cur = warpgroup_mma_wait(num_outstanding=0, deps=(acc, s_next))  # PV_L(t - 1), S_L(t + 1)
            acc = acc * gl.convert_layout(alpha, row_o)[:, None]
            acc = warpgroup_mma(gl.convert_layout(p, p_layout), c_half, acc, is_async=True)
        else:
            mbarrier.wait(p_ready, t & 1)
            fence_async_shared()
            alpha = alpha_smem.load(row_s)
            acc, s_next = warpgroup_mma_wait(num_outstanding=0, deps=(acc, s_next))  # PV_R(t - 1), S_R(t + 1)
            acc = acc * gl.convert_layout(alpha, row_o)[:, None]
            acc = warpgroup_mma(p_ring.index(st), c_half, acc, is_async=True)
            if t + 1 < num_tiles:
                nb = (t + 1) % 2
                mbarrier.wait(x_free.index(nb), (((t + 1) // 2) & 1) ^ 1, pred=t + 1 >= 2)
                x_smem.index(nb).store(s_next)
                _release(x_ready.index(nb))
        gl.thread_barrier()  # every warp's PV and score of tile t - 1 are done: refill its stage with tile t + 3
        _copy_half(KV, rows, stride_kvt, c_ring, r_ring, t + 3, num_tiles, W, LATENT, ROPE, STAGES, copy_layout)
        rows = _tile_rows(kv_indices, page_base, lo + (t + 4) * BLOCK_N, hi, PAGE_SIZE, BLOCK_N, copy_rows)

    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))  # the last PV (and the score past the end)
    async_copy.wait_group(0)
    if SCALED:
        amax_smem.slice(W * BLOCK_H, BLOCK_H).store(gl.max(gl.abs(acc), axis=1))
    if W == 0:
        l_smem.store(l_i)
        _release(fin.index(0))
        mbarrier.wait(fin.index(1), 0)
        l_o = gl.convert_layout(l_i, row_o)
        if not WRITE_FINAL:
            tok_l, head_l, ok_l = _row_token_head(b, 1, hg, NUM_HEADS, 1, BLOCK_H, row_s)
            lse = gl.where(l_i > 0.0, m_run + gl.log2(gl.where(l_i > 0.0, l_i, 1.0)), float("-inf"))
            gl.store(PartialLse + tok_l * stride_lb + head_l * stride_lh + split, lse, mask=ok_l & active)
    else:
        _release(fin.index(1))
        mbarrier.wait(fin.index(0), 0)
        l_o = l_smem.load(row_o)
    inv_l = 1.0 / gl.where(l_o > 0.0, l_o, 1.0)
    if SCALED:
        row_max = gl.maximum(amax_smem.slice(0, BLOCK_H).load(row_o),
                             amax_smem.slice(BLOCK_H, BLOCK_H).load(row_o)) * inv_l
        k = gl.where(row_max > 0.0, 14.0 - gl.floor(gl.log2(gl.where(row_max > 0.0, row_max, 1.0))), 0.0)
        k = gl.minimum(gl.maximum(k, -100.0), 100.0)
        inv_l = inv_l * gl.exp2(k)
        if W == 0:
            tok_k, head_k, ok_k = _row_token_head(b, 1, hg, NUM_HEADS, 1, BLOCK_H, row_o)
            gl.store(PartialO + tok_k * stride_pb + head_k * stride_ph + split * stride_ps + LATENT,
                     k.to(PartialO.dtype.element_ty), mask=ok_k & active)
    _store_output(acc * inv_l[:, None], out_stages.index(W), Out, PartialO, b, 1, hg, split, active, stride_ob,
                  stride_oh, stride_pb, stride_ph, stride_ps, W * HALF, NUM_HEADS, 1, BLOCK_H, HALF, WRITE_FINAL)


@gluon.jit
def _mla_decode_pipelined_kernel(
    Q, KV, Out, PartialO, PartialLse, kv_indptr, kv_indices, seq_lens, num_splits, group_first, group_ntok,
    qk_scale_log2,
    stride_qb, stride_qh, stride_kvt, stride_ob, stride_oh, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
    NUM_HEADS: gl.constexpr, LATENT: gl.constexpr, ROPE: gl.constexpr, PAGE_SIZE: gl.constexpr,
    WRITE_FINAL: gl.constexpr, CONSUMER_REGS: gl.constexpr, TOKENS: gl.constexpr, SCALED: gl.constexpr,
):
    BLOCK_H: gl.constexpr = 64
    BLOCK_N: gl.constexpr = 32
    STAGES: gl.constexpr = 4
    dtype: gl.constexpr = Q.dtype.element_ty
    q_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, LATENT], dtype)
    c_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, LATENT], dtype)
    r_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, ROPE], dtype)
    p_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_N], dtype)
    qr_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, ROPE], dtype)
    gl.static_assert(TOKENS == 1, "one query token a CTA")
    gl.static_assert(BLOCK_N * ROPE == BLOCK_H * BLOCK_N, "a tile's probabilities fill its rope slot")
    vec_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    x_layout: gl.constexpr = gl.SwizzledSharedLayout(8, 1, 4, order=[1, 0])

    hg = gl.program_id(0)
    g = gl.program_id(1)
    split = gl.program_id(2)
    lo, hi, num_tiles, active = _split_range(gl.load(seq_lens + g), gl.load(num_splits + g), split, BLOCK_N)
    page_base = gl.load(kv_indptr + g)

    q_c_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, LATENT], q_smem_layout)  # 64 KB
    x_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_H, BLOCK_N], x_layout)  # 16 KB
    q_r_view = x_smem._reinterpret(dtype, [2, BLOCK_H, ROPE], qr_smem_layout).index(0)
    c_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, LATENT], c_smem_layout)  # 128 KB
    out_stages = c_ring._reinterpret(dtype, [2, BLOCK_H, LATENT], q_smem_layout)  # a warpgroup's output staging
    r_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, ROPE], r_smem_layout)  # 16 KB
    p_ring = r_ring._reinterpret(dtype, [STAGES, BLOCK_H, BLOCK_N], p_smem_layout)
    alpha_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_H], vec_layout)
    l_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_H], vec_layout)
    amax_smem = gl.allocate_shared_memory(gl.float32, [2 * BLOCK_H], vec_layout)
    fin = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    x_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    x_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    p_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(fin.index(i), count=1)
        mbarrier.init(x_ready.index(i), count=1)
        mbarrier.init(x_free.index(i), count=1)
    mbarrier.init(p_ready, count=1)
    fence_async_shared()

    gl.warp_specialize([
        (_pipelined_warpgroup, (Q, KV, Out, PartialO, PartialLse, kv_indices, g, hg, split, lo, hi, num_tiles, active,
                                page_base, qk_scale_log2, stride_qb, stride_qh, stride_kvt, stride_ob, stride_oh,
                                stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, q_c_smem, q_r_view, c_ring,
                                r_ring, p_ring, out_stages, x_smem, alpha_smem, l_smem, amax_smem, x_ready, x_free,
                                p_ready, fin, 0, NUM_HEADS, LATENT, ROPE, PAGE_SIZE, WRITE_FINAL, SCALED, STAGES)),
        (_pipelined_warpgroup, (Q, KV, Out, PartialO, PartialLse, kv_indices, g, hg, split, lo, hi, num_tiles, active,
                                page_base, qk_scale_log2, stride_qb, stride_qh, stride_kvt, stride_ob, stride_oh,
                                stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, q_c_smem, q_r_view, c_ring,
                                r_ring, p_ring, out_stages, x_smem, alpha_smem, l_smem, amax_smem, x_ready, x_free,
                                p_ready, fin, 1, NUM_HEADS, LATENT, ROPE, PAGE_SIZE, WRITE_FINAL, SCALED, STAGES)),
    ], [4], [CONSUMER_REGS])
