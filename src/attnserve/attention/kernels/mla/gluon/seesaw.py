"""The seesaw Gluon MLA decode kernel (Hopper): two key tiles a round, one per warpgroup ("seesaw": FlashMLA's
name for the schedule in which the two warpgroups' softmaxes alternate, each under the other's matrix products).

It runs the absorbed extend as decode rows (mla/extend_rows.py), 64 query rows a CTA whatever the heads: with
fewer heads a CTA takes consecutive tokens of one request.

A CTA owns 64 query rows of a (request, split) and three partitions: a 4-warp producer gathers latent rows by
cp.async (any page size, page 1 included) into a two-stage ring of `[64 keys, 512]` + `[64 keys, 64]` tiles; two
4-warp consumers, one per warpgroup, each keep 256 output columns. Tile 2j (stage 0) is warpgroup 0's, tile 2j+1
(stage 1) warpgroup 1's (after FlashMLA's write-up of its schedule):

    wg0: S0 = q K0^T        softmax(S0) against m       publish p0, scale0   o_L = o_L scale0 + p0 V0_L
         wait p1, scale1:   o_L = o_L scale1 + p1 V1_L
    wg1: S1 = q K1^T        wait p0, scale0:            o_R = o_R scale0 + p0 V0_R   (in flight while:)
         softmax(S1) against m_new0: publish p1, scale1   o_R = o_R scale1 + p1 V1_R

Why this schedule: run one after another, a tile's score, softmax and both halves of its PV leave the tensor
cores idle while a softmax runs. Here both scores are issued without waiting on anything but their tile,
warpgroup 1's softmax runs under its own wgmma of p0 and under warpgroup 0's PV, and warpgroup 0's softmax under
warpgroup 1's score. The two row sums are each warpgroup's own tiles' at the running max, added at the end.

Shared memory: q 72 KB + 2 x 72 KB of latent = 216 KB, one CTA per SM. A tile's probabilities go to its stage's
rope slot, free once the score has read it. The stages are refilled in two column groups so that neither waits
for a whole tile: a stage's "early" group is its owner's 256 output columns (free once the owner's own PV is
done), its "late" group the other half and the rope slot (free once the other warpgroup has multiplied the
probabilities held there); each score reads its groups in the producer's order, and the producer loads the next
round's page indices while this round's copies wait for their stages.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia import hopper
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from attnserve.attention.kernels.mla.gluon import parts


@gluon.jit
def _load_stage0(base, c_ring, r_ring, loaded_e, loaded_l, free_e, free_l, phase, refill, LATENT: gl.constexpr,
                 ROPE: gl.constexpr):
    """Stage 0's tile (base: `[64 keys, ROPE]` pointers to its rows): columns 0-255 once warpgroup 0's own PV freed
    them, then 256-511 and the rope."""
    QUARTER: gl.constexpr = LATENT // 2 // ROPE
    mbarrier.wait(free_e.index(0), phase, pred=refill)
    parts.copy_columns(c_ring.index(0), base, 0, QUARTER, ROPE)
    async_copy.mbarrier_arrive(loaded_e.index(0), increment_count=False)
    mbarrier.wait(free_l.index(0), phase, pred=refill)
    parts.copy_columns(c_ring.index(0), base, QUARTER, QUARTER, ROPE)
    async_copy.async_copy_global_to_shared(r_ring.index(0), base + LATENT)
    async_copy.mbarrier_arrive(loaded_l.index(0), increment_count=False)


@gluon.jit
def _seesaw_producer(KV, kv_indices, lo, hi, num_tiles, page_base, stride_kvt, c_ring, r_ring,
                     loaded_e, loaded_l, free_e, free_l,
                     LATENT: gl.constexpr, ROPE: gl.constexpr, PAGE_SIZE: gl.constexpr, AHEAD: gl.constexpr):
    """Per round: stage 0's columns 0-255 (early), 256-511 + rope (late); stage 1's 0-255 + rope (late), 256-511
    (early). Both stages' scores read columns 0-255 first, so the loads land in the order they are read. The next
    round's page indices are loaded while this round's copies wait for their stages (AHEAD: parts.fetch_tile)."""
    BLOCK_N: gl.constexpr = 64
    QUARTER: gl.constexpr = LATENT // 2 // ROPE  # 4 chunks of 64 columns: one warpgroup's half
    copy_rows: gl.constexpr = gl.SliceLayout(1, parts.COPY_LAYOUT)
    offs = gl.arange(0, ROPE, layout=gl.SliceLayout(0, parts.COPY_LAYOUT))
    # [BLOCK_N] pool rows (AHEAD: page indices, rows in the page)
    rows0, in_page0 = parts.fetch_tile(kv_indices, page_base, lo, hi, PAGE_SIZE, BLOCK_N, copy_rows, AHEAD)
    rows1, in_page1 = parts.fetch_tile(kv_indices, page_base, lo + BLOCK_N, hi, PAGE_SIZE, BLOCK_N, copy_rows, AHEAD)
    rounds = num_tiles // 2
    for j in range(rounds):
        phase = (j & 1) ^ 1  # the free barriers' phase of round j - 1
        # [BLOCK_N, ROPE] pointers, 4 rows a thread
        base0 = KV + parts.rows_of(rows0, in_page0, PAGE_SIZE, AHEAD)[:, None] * stride_kvt + offs[None, :]
        base1 = KV + parts.rows_of(rows1, in_page1, PAGE_SIZE, AHEAD)[:, None] * stride_kvt + offs[None, :]
        rows0, in_page0 = parts.fetch_tile(kv_indices, page_base, lo + (2 * j + 2) * BLOCK_N, hi, PAGE_SIZE, BLOCK_N,
                                           copy_rows, AHEAD)
        rows1, in_page1 = parts.fetch_tile(kv_indices, page_base, lo + (2 * j + 3) * BLOCK_N, hi, PAGE_SIZE, BLOCK_N,
                                           copy_rows, AHEAD)
        _load_stage0(base0, c_ring, r_ring, loaded_e, loaded_l, free_e, free_l, phase, j > 0, LATENT, ROPE)
        mbarrier.wait(free_l.index(1), phase, pred=j > 0)
        parts.copy_columns(c_ring.index(1), base1, 0, QUARTER, ROPE)
        async_copy.async_copy_global_to_shared(r_ring.index(1), base1 + LATENT)
        async_copy.mbarrier_arrive(loaded_l.index(1), increment_count=False)
        mbarrier.wait(free_e.index(1), phase, pred=j > 0)
        parts.copy_columns(c_ring.index(1), base1, QUARTER, QUARTER, ROPE)
        async_copy.mbarrier_arrive(loaded_e.index(1), increment_count=False)
    if num_tiles % 2:  # a last, odd tile: a round of stage 0 alone
        _load_stage0(KV + parts.rows_of(rows0, in_page0, PAGE_SIZE, AHEAD)[:, None] * stride_kvt + offs[None, :],
                     c_ring, r_ring, loaded_e, loaded_l, free_e,
                     free_l, (rounds & 1) ^ 1, rounds > 0, LATENT, ROPE)


@gluon.jit
def _score(q_c_smem, q_r_smem, c_tile, r_tile, first_bar, second_bar, phase, ROPE_FIRST: gl.constexpr,
           HALF: gl.constexpr, s_layout: gl.constexpr):
    """S `[64, 64]` = q . tile: columns 0-255 once the first group lands, 256-511 once the second does; the
    rope with the group that carries it."""
    s = gl.zeros([64, 64], gl.float32, layout=s_layout)
    mbarrier.wait(first_bar, phase)
    hopper.fence_async_shared()  # cp.async's writes before the wgmmas read them
    s = hopper.warpgroup_mma(q_c_smem.slice(0, HALF, dim=1), c_tile.slice(0, HALF, dim=1).permute((1, 0)), s,
                             use_acc=False, is_async=True)
    if ROPE_FIRST:
        s = hopper.warpgroup_mma(q_r_smem, r_tile.permute((1, 0)), s, is_async=True)
    mbarrier.wait(second_bar, phase)
    hopper.fence_async_shared()
    s = hopper.warpgroup_mma(q_c_smem.slice(HALF, HALF, dim=1), c_tile.slice(HALF, HALF, dim=1).permute((1, 0)), s,
                             is_async=True)
    if not ROPE_FIRST:
        s = hopper.warpgroup_mma(q_r_smem, r_tile.permute((1, 0)), s, is_async=True)
    return hopper.warpgroup_mma_wait(num_outstanding=0, deps=(s,))


@gluon.jit
def _publish(p, alpha, m_new, p_dst, scale_dst, max_dst, ready_bar):
    """The tile's probabilities (in its stage's rope slot), rescale factor and max, for the other warpgroup."""
    p_dst.store(p)
    scale_dst.store(alpha)
    max_dst.store(m_new)
    hopper.fence_async_shared()  # the other warpgroup's wgmma reads p_dst
    gl.thread_barrier()
    mbarrier.arrive(ready_bar, count=1)


@gluon.jit
def _scale_to_other(scale_smem, max_smem, ready, acc, l_i, phase, OWNER: gl.constexpr, row_s: gl.constexpr,
                    row_o: gl.constexpr):
    """Once the owner of the other tile has published: this warpgroup's output and row sums moved to its max."""
    mbarrier.wait(ready.index(OWNER), phase)
    hopper.fence_async_shared()  # its probabilities' stores before this warpgroup's wgmma reads them
    alpha = scale_smem.slice(OWNER * 64, 64).load(row_s)
    m_run = max_smem.slice(OWNER * 64, 64).load(row_s)
    return acc * gl.convert_layout(alpha, row_o)[:, None], l_i * alpha, m_run


@gluon.jit
def _probabilities(s, m_run, n0, hi, hi_row, hi_min, qk_scale_log2, TOKENS: gl.constexpr, s_layout: gl.constexpr,
                   WHOLE_TILES: gl.constexpr):
    """The tile's probabilities, its max and rescale factor; with WHOLE_TILES unmasked where every row sees the
    whole tile."""
    if WHOLE_TILES:
        p, m_new, alpha = parts.softmax_tile(s, m_run, n0, hi, hi_row, hi_min, qk_scale_log2, TOKENS, s_layout)
    else:
        p, m_new, alpha = parts.tile_probabilities(s, m_run, n0, hi, hi_row, qk_scale_log2, TOKENS, s_layout)
    return p, m_new, alpha


@gluon.jit
def _wg0_own_tile(q_c_smem, q_r_smem, c0, r_ring, scale_smem, max_smem, loaded_e, loaded_l, free_e, ready, acc, l_i,
                  m_run, j, lo, hi, hi_row, hi_min, qk_scale_log2, TOKENS: gl.constexpr, HALF: gl.constexpr,
                  s_layout: gl.constexpr, o_layout: gl.constexpr, p_layout: gl.constexpr,
                  WHOLE_TILES: gl.constexpr):
    """Warpgroup 0's tile of round j (stage 0): score, softmax against the last round's max, publish, and its
    columns 0-255 of the PV, after which those columns of the stage can be refilled."""
    BLOCK_N: gl.constexpr = 64
    s = _score(q_c_smem, q_r_smem, c0, r_ring.index(0), loaded_e.index(0), loaded_l.index(0), j & 1, False, HALF,
               s_layout)
    p, m_new, alpha = _probabilities(s, m_run, lo + 2 * j * BLOCK_N, hi, hi_row, hi_min, qk_scale_log2, TOKENS,
                                     s_layout, WHOLE_TILES)
    l_i = l_i * alpha + gl.sum(p, axis=1)
    p = p.to(c0.dtype)
    _publish(p, alpha, m_new, r_ring.index(0), scale_smem.slice(0, 64), max_smem.slice(0, 64), ready.index(0))
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    acc = hopper.warpgroup_mma(gl.convert_layout(p, p_layout), c0.slice(0, HALF, dim=1), acc, is_async=True)
    acc = hopper.warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    parts.release_stage(free_e.index(0))
    return acc, l_i, m_new


@gluon.jit
def _seesaw_consumer(
    Q, Out, PartialO, PartialLse, seq_lens, tok0, ntok, hg, split, lo, hi, num_tiles, active, qk_scale_log2,
    stride_ob, stride_oh, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
    q_c_smem, q_r_smem, c_ring, r_ring, scale_smem, max_smem, l_smem, loaded_e, loaded_l, free_e, free_l, ready,
    fin, q_loaded, W: gl.constexpr, NUM_HEADS: gl.constexpr, LATENT: gl.constexpr, WRITE_FINAL: gl.constexpr,
    TOKENS: gl.constexpr, WHOLE_TILES: gl.constexpr,
):
    BLOCK_H: gl.constexpr = 64
    BLOCK_N: gl.constexpr = 64
    HALF: gl.constexpr = LATENT // 2
    dtype: gl.constexpr = Q.dtype.element_ty
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HALF, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    hi_row = hi
    hi_min = hi  # the least horizon of the CTA's rows: tiles below it need no mask
    if TOKENS > 1:  # rows of earlier tokens see fewer keys
        row_tok, _, row_ok = parts.row_token_head(tok0, ntok, hg, NUM_HEADS, TOKENS, BLOCK_H, row_s)
        hi_row = gl.minimum(gl.load(seq_lens + row_tok, mask=row_ok, other=0), hi)
        hi_min = gl.min(gl.where(row_ok, hi_row, hi), axis=0)
    mbarrier.wait(q_loaded, 0)  # (the scores' fence after their tiles' waits covers the query's copies too)
    m_run = gl.full([BLOCK_H], -1.0e30, gl.float32, layout=row_s)  # the running max after the last round
    l_i = gl.zeros([BLOCK_H], gl.float32, layout=row_s)  # this warpgroup's tiles' row sums, at m_run
    acc = gl.zeros([BLOCK_H, HALF], gl.float32, layout=o_layout)  # output columns W * HALF ...
    c0 = c_ring.index(0)
    c1 = c_ring.index(1)
    rounds = num_tiles // 2
    if W == 0:
        for j in range(rounds):
            acc, l_i, m_run = _wg0_own_tile(q_c_smem, q_r_smem, c0, r_ring, scale_smem, max_smem, loaded_e, loaded_l,
                                            free_e, ready, acc, l_i, m_run, j, lo, hi, hi_row, hi_min, qk_scale_log2,
                                            TOKENS, HALF, s_layout, o_layout, p_layout, WHOLE_TILES)
            # warpgroup 1's tile: its probabilities times columns 0-255
            acc, l_i, m_run = _scale_to_other(scale_smem, max_smem, ready, acc, l_i, j & 1, 1, row_s, row_o)
            acc = hopper.warpgroup_mma(r_ring.index(1), c1.slice(0, HALF, dim=1), acc, is_async=True)
            acc = hopper.warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            parts.release_stage(free_l.index(1))
        if num_tiles % 2:  # a last, odd tile: warpgroup 0's alone
            acc, l_i, m_run = _wg0_own_tile(q_c_smem, q_r_smem, c0, r_ring, scale_smem, max_smem, loaded_e,
                                            loaded_l, free_e, ready, acc, l_i, m_run, rounds, lo, hi, hi_row, hi_min,
                                            qk_scale_log2, TOKENS, HALF, s_layout, o_layout, p_layout, WHOLE_TILES)
    else:
        for j in range(rounds):
            phase = j & 1
            s = _score(q_c_smem, q_r_smem, c1, r_ring.index(1), loaded_l.index(1), loaded_e.index(1), phase, True,
                       HALF, s_layout)
            # warpgroup 0's tile first: its probabilities times columns 256-511, in flight under this softmax
            acc, l_i, m_run = _scale_to_other(scale_smem, max_smem, ready, acc, l_i, phase, 0, row_s, row_o)
            acc = hopper.warpgroup_mma(r_ring.index(0), c0.slice(HALF, HALF, dim=1), acc, is_async=True)
            p, m_new, alpha = _probabilities(s, m_run, lo + (2 * j + 1) * BLOCK_N, hi, hi_row, hi_min,
                                             qk_scale_log2, TOKENS, s_layout, WHOLE_TILES)
            l_i = l_i * alpha + gl.sum(p, axis=1)
            p = p.to(dtype)
            _publish(p, alpha, m_new, r_ring.index(1), scale_smem.slice(64, 64), max_smem.slice(64, 64),
                     ready.index(1))
            m_run = m_new
            acc = hopper.warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            parts.release_stage(free_l.index(0))
            acc = acc * gl.convert_layout(alpha, row_o)[:, None]
            acc = hopper.warpgroup_mma(gl.convert_layout(p, p_layout), c1.slice(HALF, HALF, dim=1), acc, is_async=True)
            acc = hopper.warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            parts.release_stage(free_e.index(1))
        if num_tiles % 2:
            acc, l_i, m_run = _scale_to_other(scale_smem, max_smem, ready, acc, l_i, rounds & 1, 0, row_s, row_o)
            acc = hopper.warpgroup_mma(r_ring.index(0), c0.slice(HALF, HALF, dim=1), acc, is_async=True)
            acc = hopper.warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            parts.release_stage(free_l.index(0))

    # the row sum is the two warpgroups' (each kept at the final max, m_run in both)
    l_smem.slice(W * BLOCK_H, BLOCK_H).store(l_i)
    gl.thread_barrier()
    mbarrier.arrive(fin.index(W), count=1)
    mbarrier.wait(fin.index(1 - W), 0)
    l_tot = l_i + l_smem.slice((1 - W) * BLOCK_H, BLOCK_H).load(row_s)
    l_safe = gl.where(l_tot > 0.0, l_tot, 1.0)
    o = acc / gl.convert_layout(l_safe, row_o)[:, None]
    parts.store_output(o, c_ring.index(W), Out, PartialO, tok0, ntok, hg, split, active, stride_ob, stride_oh,
                       stride_pb, stride_ph, stride_ps, W * HALF, NUM_HEADS, TOKENS, BLOCK_H, HALF, WRITE_FINAL)
    if not WRITE_FINAL and W == 0:
        tok_l, head_l, ok_l = parts.row_token_head(tok0, ntok, hg, NUM_HEADS, TOKENS, BLOCK_H, row_s)
        lse = gl.where(l_tot > 0.0, m_run + gl.log2(l_safe), float("-inf"))
        gl.store(PartialLse + tok_l * stride_lb + head_l * stride_lh + split, lse, mask=ok_l & active)


@gluon.jit
def mla_decode_seesaw_kernel(
    Q, KV, Out, PartialO, PartialLse, kv_indptr, kv_indices, seq_lens, num_splits, group_first, group_ntok,
    qk_scale_log2,
    stride_qb, stride_qh, stride_kvt, stride_ob, stride_oh, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
    NUM_HEADS: gl.constexpr, LATENT: gl.constexpr, ROPE: gl.constexpr, PAGE_SIZE: gl.constexpr,
    WRITE_FINAL: gl.constexpr, CONSUMER_REGS: gl.constexpr, TOKENS: gl.constexpr, WHOLE_TILES: gl.constexpr = False,
    AHEAD: gl.constexpr = False,
):
    """Per-token arrays (kv_indptr's starts, seq_lens, num_splits) are indexed by query token. TOKENS > 1 (extend
    rows, few heads): CTA g takes tokens group_first[g] ... + group_ntok[g] - 1 of one request, whose horizon
    grows by one per token, so the last one's is the CTA's key range."""
    BLOCK_H: gl.constexpr = 64
    BLOCK_N: gl.constexpr = 64
    dtype: gl.constexpr = Q.dtype.element_ty
    c_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, LATENT], dtype)
    r_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, ROPE], dtype)
    gl.static_assert(ROPE == BLOCK_N, "a tile's probabilities [64 rows, 64 keys] live in its [64 keys, 64] rope slot")
    vec_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])

    hg = gl.program_id(0)
    g = gl.program_id(1)
    split = gl.program_id(2)
    if TOKENS > 1:
        tok0 = gl.load(group_first + g)
        ntok = gl.load(group_ntok + g)
    else:
        tok0 = g
        ntok = 1
    lo, hi, num_tiles, active = parts.split_range(gl.load(seq_lens + tok0 + ntok - 1), gl.load(num_splits + tok0),
                                                  split, BLOCK_N)
    page_base = gl.load(kv_indptr + tok0)

    # the query in shared memory, both scores' A: q_c [64, 512] (64 KB) and q_pe [64, 64] (8 KB)
    tok, head, row_ok = parts.row_token_head(tok0, ntok, hg, NUM_HEADS, TOKENS, BLOCK_H,
                                             gl.SliceLayout(1, parts.COPY_LAYOUT))
    offs = gl.arange(0, ROPE, layout=gl.SliceLayout(0, parts.COPY_LAYOUT))
    q_ptrs = Q + tok[:, None] * stride_qb + head[:, None] * stride_qh + offs[None, :]  # [64, 64]: 64 columns a time
    q_mask = row_ok[:, None] & (offs < ROPE)[None, :]  # rows past the heads / tokens are zeros
    q_c_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, LATENT], c_smem_layout)
    q_r_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, ROPE], r_smem_layout)
    q_loaded = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(q_loaded, count=128)
    parts.copy_query(q_ptrs, q_mask, q_c_smem, q_r_smem, q_loaded, LATENT, ROPE)  # the consumers wait on q_loaded
    c_ring = gl.allocate_shared_memory(dtype, [2, BLOCK_N, LATENT], c_smem_layout)  # 128 KB
    r_ring = gl.allocate_shared_memory(dtype, [2, BLOCK_N, ROPE], r_smem_layout)  # 16 KB: rope, then probabilities
    scale_smem = gl.allocate_shared_memory(gl.float32, [2 * BLOCK_H], vec_layout)  # each tile owner's factor
    max_smem = gl.allocate_shared_memory(gl.float32, [2 * BLOCK_H], vec_layout)  # and new max
    l_smem = gl.allocate_shared_memory(gl.float32, [2 * BLOCK_H], vec_layout)  # each warpgroup's row sums
    # each completes one phase per round (round j: phase j & 1); loaded_*: 128 arrivals (every producer thread)
    loaded_e = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    loaded_l = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    free_e = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    free_l = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    fin = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(loaded_e.index(i), count=128)
        mbarrier.init(loaded_l.index(i), count=128)
        mbarrier.init(free_e.index(i), count=1)
        mbarrier.init(free_l.index(i), count=1)
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(fin.index(i), count=1)
    hopper.fence_async_shared()  # the barriers' init before the partitions use them

    gl.warp_specialize([
        (_seesaw_producer, (KV, kv_indices, lo, hi, num_tiles, page_base, stride_kvt, c_ring, r_ring, loaded_e,
                            loaded_l, free_e, free_l, LATENT, ROPE, PAGE_SIZE, AHEAD)),
        (_seesaw_consumer, (Q, Out, PartialO, PartialLse, seq_lens, tok0, ntok, hg, split, lo, hi, num_tiles, active,
                            qk_scale_log2, stride_ob, stride_oh, stride_pb, stride_ph, stride_ps, stride_lb,
                            stride_lh, q_c_smem, q_r_smem, c_ring, r_ring, scale_smem, max_smem, l_smem, loaded_e,
                            loaded_l, free_e, free_l, ready, fin, q_loaded, 0, NUM_HEADS, LATENT, WRITE_FINAL, TOKENS,
                            WHOLE_TILES)),
        (_seesaw_consumer, (Q, Out, PartialO, PartialLse, seq_lens, tok0, ntok, hg, split, lo, hi, num_tiles, active,
                            qk_scale_log2, stride_ob, stride_oh, stride_pb, stride_ph, stride_ps, stride_lb,
                            stride_lh, q_c_smem, q_r_smem, c_ring, r_ring, scale_smem, max_smem, l_smem, loaded_e,
                            loaded_l, free_e, free_l, ready, fin, q_loaded, 1, NUM_HEADS, LATENT, WRITE_FINAL, TOKENS,
                            WHOLE_TILES)),
    ], [4, 4], [CONSUMER_REGS, CONSUMER_REGS])
