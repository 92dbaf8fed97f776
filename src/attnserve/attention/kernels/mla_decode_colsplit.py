"""The Gluon MLA decode kernel (Hopper) at 64+ heads: the latent's columns split between the two warpgroups, both
on one key tile at a time, each copying its own half of every tile.

(Sweep 13 moved 128 heads to the scorer kernel, mla_decode_scorer.py, which divides the same CTA by role: 27.7
against 29.1 us at 1 x 32768, 258.7 against 296.7 over 64-token pages; the sweep still races this one.)

A CTA owns 64 heads of one (request, split), as the seesaw kernel does (mla_decode_seesaw.py), and has two
warpgroups and no producer. Warpgroup 0 owns latent columns 0-255, warpgroup 1 columns 256-511 and the rope, for
the copies, the score and the output alike:

    wg0: S_L = q_L K_L^T                 wait S_R:  S = S_L + S_R, softmax   publish P, alpha   o_L = o_L alpha + P V_L
    wg1: S_R = q_R K_R^T + q_pe K_pe^T   publish S_R                         wait P, alpha      o_R = o_R alpha + P V_R
    each, once its PV is done: copy its half of tile t + 2 into the stage tile t leaves (cp.async, any page size)

Why: the seesaw gives each warpgroup its own tile of a round and refills a stage only once its tile is consumed,
so the next tile's copies start a PV before they are needed. Nsight Compute on the H200 (1 x 32768 and
128 x 4096, 128 heads; benchmarks/ncu_mla_decode.sh) had its warpgroup 1 waiting on its tile's copies and
warpgroup 0 on warpgroup 1's probabilities, the tensor pipe busy 28 % and 48 % of the time. Here a tile's copies
are issued a whole tile ahead: the copy waits fell from the largest stall to about 0.5 % of the samples.

Why no producer: with a third, copying warpgroup the kernel runs 384 threads at 168 registers, and ptxas then
waits on every wgmma (its C7512: a warpgroup's 64 x 256 float32 output, a score in flight and the rope operand do
not fit); with two warpgroups each gets 255 and the wgmmas stay asynchronous.

The partial scores cross through shared memory (64 x 64 float32), the probabilities go to the tile's rope slot
(free once warpgroup 1's score has read it) for warpgroup 1's PV. Shared memory: q_c 64 KB + 2 x 72 KB of latent
+ the 16 KB exchange = 225 KB; the query's rope part lives in warpgroup 1's registers (it lands in the exchange
buffer first). H200 sweep 10 (same run as the seesaw): 314.6 against 318.3 us at 128 x 4096, 298.6 against 304.5
over 64-token pages, 32.3 against 35.4 at 1 x 32768. What is left, by the same profile: each warpgroup waits on
the other (warpgroup 0 on the second half of the score, warpgroup 1 on the softmax), the tensor pipe idle under
the softmax; hiding it needs the next tile's score issued before the softmax, which with two stages would have
to wait for that tile's copies again (benchmarks/NOTES.md).

Over pages of 64 tokens or more a tile is 64 consecutive rows of one page, and each warpgroup loads its half by
TMA (four 64 x 64 boxes, warpgroup 1 also the rope's), counted on its own mbarrier per stage; over smaller pages
by cp.async, 18 16-byte copies a thread a tile. Why: on the H200 a tile whose loop issued no copies (the last)
took 2.0 us against 2.23 for the others (benchmarks/mla_colsplit_timeline.py at 1 x 32768); issuing cp.async is
on the consumers' path, a TMA is one instruction. A page's rows past the request's end come with its last tile;
each warpgroup zeroes them in its columns before that tile's wgmmas (an unused slot may hold anything).

A split decode may store float16 partials (SCALED; mla_decode.py says why): the warpgroups swap their halves' row
maxima with the row sums, and each row is scaled by the power of two that brings its largest value to [2^14,
2^15), the exponent stored in column 512 by warpgroup 0. (A merge inside this kernel after a grid barrier, its
CTAs launched cooperatively, was slower than the merge kernel: 30.0 against 28.6-29.0 us at 1 x 32768, the
barrier alone 1.6 us; benchmarks/NOTES.md, in history at 67d53d0.)
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from attnserve.attention.kernels.mla_decode_seesaw import _probabilities, _row_token_head, _store_output
from attnserve.attention.kernels.mla_gluon_parts import _copy_columns, _release, _split_range, _tile_rows


@gluon.jit
def _copy_half(KV, rows, stride_kvt, c_ring, r_ring, t, num_tiles, W: gl.constexpr, LATENT: gl.constexpr,
               ROPE: gl.constexpr, copy_layout: gl.constexpr):
    """Tile t's latent columns of warpgroup W (0: 0-255; 1: 256-511 and the rope) into stage t % 2 by cp.async,
    rows `[64]` its pool rows, as one commit group (empty past the last tile)."""
    QUARTER: gl.constexpr = LATENT // 2 // ROPE  # 4 chunks of 64 columns: one warpgroup's half
    if t < num_tiles:
        offs = gl.arange(0, ROPE, layout=gl.SliceLayout(0, copy_layout))
        base = KV + rows[:, None] * stride_kvt + offs[None, :]  # [64, ROPE] pointers, 4 rows a thread
        _copy_columns(c_ring.index(t % 2), base, W * QUARTER, QUARTER, ROPE)
        if W == 1:
            async_copy.async_copy_global_to_shared(r_ring.index(t % 2), base + LATENT)
    async_copy.commit_group()


@gluon.jit
def _tma_tile(kv_desc, kv_indices, page_base, n0, loaded, bar_index, c_ring, r_ring, slot, FIRST: gl.constexpr,
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
def _load_half(KV, kv_desc, rows, kv_indices, page_base, lo, stride_kvt, c_ring, r_ring, loaded, t, num_tiles,
               W: gl.constexpr, LATENT: gl.constexpr, ROPE: gl.constexpr, PAGE_SIZE: gl.constexpr,
               TMA: gl.constexpr, copy_layout: gl.constexpr):
    """Tile t's half of warpgroup W into stage t % 2: by TMA where a tile is 64 consecutive rows of one page
    (loaded[W, stage] counts the bytes), else by cp.async from `rows`."""
    if TMA:
        if t < num_tiles:  # four 64-column boxes (warpgroup 1: and the rope's)
            _tma_tile(kv_desc, kv_indices, page_base, lo + t * 64, loaded, W * 2 + t % 2, c_ring, r_ring, t % 2,
                      W * 4, 4, W == 1, LATENT, ROPE, PAGE_SIZE)
    else:
        _copy_half(KV, rows, stride_kvt, c_ring, r_ring, t, num_tiles, W, LATENT, ROPE, copy_layout)


@gluon.jit
def _zero_rows_past(c_half, n_valid, copy_layout: gl.constexpr):
    """Zeroes rows n_valid.. of this warpgroup's half of a stage `[64 keys, 256]`: a TMA tile's rows past the
    request's end are its page's unused slots, and whatever they hold (NaN, Inf) would reach the PV as 0 x NaN.
    Their scores need nothing: the softmax masks them before its max."""
    rows = gl.arange(0, 64, layout=gl.SliceLayout(1, copy_layout))
    for k in gl.static_range(c_half.shape[1] // 64):
        chunk = c_half.slice(k * 64, 64, dim=1)
        x = chunk.load(copy_layout)
        chunk.store(gl.where((rows < n_valid)[:, None], x, gl.zeros_like(x)))


@gluon.jit
def _finish(acc, l_i, m_run, c_ring, amax_smem, l_smem, fin, Out, PartialO, PartialLse, b, hg, split, active,
            stride_ob, stride_oh, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, W: gl.constexpr,
            NUM_HEADS: gl.constexpr, LATENT: gl.constexpr, WRITE_FINAL: gl.constexpr, SCALED: gl.constexpr,
            row_s: gl.constexpr, row_o: gl.constexpr):
    """Both warpgroups' epilogue: warpgroup 0 holds the row sums and the max, and writes the LSE; each normalises
    and stores its 256 columns through its own stage (float16 partials scaled a row, as the module says)."""
    BLOCK_H: gl.constexpr = 64
    HALF: gl.constexpr = LATENT // 2
    if SCALED:  # [64] this half's largest magnitude a row, for both warpgroups
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
    inv_l = 1.0 / gl.where(l_o > 0.0, l_o, 1.0)  # a reciprocal a row, not a division an element
    if SCALED:  # float16 partials: each row scaled by 2^k so that its largest value lands in [2^14, 2^15)
        row_max = gl.maximum(amax_smem.slice(0, BLOCK_H).load(row_o),
                             amax_smem.slice(BLOCK_H, BLOCK_H).load(row_o)) * inv_l
        k = gl.where(row_max > 0.0, 14.0 - gl.floor(gl.log2(gl.where(row_max > 0.0, row_max, 1.0))), 0.0)
        k = gl.minimum(gl.maximum(k, -100.0), 100.0)
        inv_l = inv_l * gl.exp2(k)
        if W == 0:
            tok_k, head_k, ok_k = _row_token_head(b, 1, hg, NUM_HEADS, 1, BLOCK_H, row_o)
            gl.store(PartialO + tok_k * stride_pb + head_k * stride_ph + split * stride_ps + LATENT,
                     k.to(PartialO.dtype.element_ty), mask=ok_k & active)
    _store_output(acc * inv_l[:, None], c_ring.index(W), Out, PartialO, b, 1, hg, split, active, stride_ob,
                  stride_oh, stride_pb, stride_ph, stride_ps, W * HALF, NUM_HEADS, 1, BLOCK_H, HALF, WRITE_FINAL)


@gluon.jit
def _colsplit_warpgroup(
    Q, KV, kv_desc, Out, PartialO, PartialLse, kv_indices, b, hg, split, lo, hi, num_tiles, active,
    page_base, qk_scale_log2, stride_qb, stride_qh, stride_kvt, stride_ob, stride_oh, stride_pb, stride_ph, stride_ps,
    stride_lb, stride_lh, q_c_smem, q_r_view, c_ring, r_ring, x_smem, alpha_smem, l_smem, amax_smem, x_ready, x_free,
    p_ready, fin, loaded, W: gl.constexpr, NUM_HEADS: gl.constexpr, LATENT: gl.constexpr, ROPE: gl.constexpr,
    PAGE_SIZE: gl.constexpr, WRITE_FINAL: gl.constexpr, SCALED: gl.constexpr,
):
    """One warpgroup: its half of the query and of every tile, copied by itself (a stage's half is its own to
    refill once its PV is done), its half of each score, and its 256 output columns. Warpgroup 0 also adds the
    halves, runs the softmax and publishes the probabilities; warpgroup 1 multiplies them by its columns."""
    BLOCK_H: gl.constexpr = 64
    BLOCK_N: gl.constexpr = 64
    HALF: gl.constexpr = LATENT // 2
    dtype: gl.constexpr = q_c_smem.dtype
    copy_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])  # 128 B of a row per 8 threads
    copy_rows: gl.constexpr = gl.SliceLayout(1, copy_layout)
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HALF, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    # this warpgroup's query columns (and, for warpgroup 1, the rope part into the exchange buffer), then tiles 0
    # and 1: two commit groups, the query in the first
    tok, head, row_ok = _row_token_head(b, 1, hg, NUM_HEADS, 1, BLOCK_H, copy_rows)
    offs = gl.arange(0, ROPE, layout=gl.SliceLayout(0, copy_layout))
    q_ptrs = Q + tok[:, None] * stride_qb + head[:, None] * stride_qh + offs[None, :]  # [64, 64]
    q_mask = row_ok[:, None] & (offs < ROPE)[None, :]  # rows past the heads / tokens are zeros
    _copy_columns(q_c_smem, q_ptrs, W * (HALF // ROPE), HALF // ROPE, ROPE, q_mask)
    if W == 1:
        async_copy.async_copy_global_to_shared(q_r_view, q_ptrs + LATENT, mask=q_mask)
    TMA: gl.constexpr = PAGE_SIZE % BLOCK_N == 0
    rows = _tile_rows(kv_indices, page_base, lo, hi, PAGE_SIZE, BLOCK_N, copy_rows)  # [64] pool rows (cp.async)
    _load_half(KV, kv_desc, rows, kv_indices, page_base, lo, stride_kvt, c_ring, r_ring, loaded, 0, num_tiles, W,
               LATENT, ROPE, PAGE_SIZE, TMA, copy_layout)
    rows = _tile_rows(kv_indices, page_base, lo + BLOCK_N, hi, PAGE_SIZE, BLOCK_N, copy_rows)
    _load_half(KV, kv_desc, rows, kv_indices, page_base, lo, stride_kvt, c_ring, r_ring, loaded, 1, num_tiles, W,
               LATENT, ROPE, PAGE_SIZE, TMA, copy_layout)
    rows = _tile_rows(kv_indices, page_base, lo + 2 * BLOCK_N, hi, PAGE_SIZE, BLOCK_N, copy_rows)

    acc = gl.zeros([BLOCK_H, HALF], gl.float32, layout=o_layout)  # output columns W * 256 ...
    m_run = gl.full([BLOCK_H], -1.0e30, gl.float32, layout=row_s)  # warpgroup 0's running base-2 max
    l_i = gl.zeros([BLOCK_H], gl.float32, layout=row_s)
    if TMA:  # the query is the only cp.async group
        async_copy.wait_group(0)
        gl.thread_barrier()
        fence_async_shared()
    if W == 1:
        if not TMA:
            async_copy.wait_group(1)  # the query
            gl.thread_barrier()
        q_pe = q_r_view.load(gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2))  # [64, 64]
        gl.thread_barrier()  # every thread holds its rope before the buffer takes scores
    for t in range(num_tiles):
        st = t % 2
        if TMA:
            mbarrier.wait(loaded.index(W * 2 + st), (t // 2) & 1)
            if hi - (lo + t * BLOCK_N) < BLOCK_N:  # the request's last, partial tile (once a CTA at most)
                _zero_rows_past(c_ring.index(st).slice(W * HALF, HALF, dim=1), hi - (lo + t * BLOCK_N), copy_layout)
                gl.thread_barrier()
                fence_async_shared()  # the zeros before the wgmmas read the stage
        else:
            async_copy.wait_group(1)  # tile t's copies (tile t + 1's may still fly)
            gl.thread_barrier()
            fence_async_shared()  # cp.async's writes before the wgmmas read them
        c_half = c_ring.index(st).slice(W * HALF, HALF, dim=1)
        s = warpgroup_mma(q_c_smem.slice(W * HALF, HALF, dim=1), c_half.permute((1, 0)),
                          gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=s_layout), use_acc=False, is_async=True)
        if W == 0:
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
            mbarrier.wait(x_ready, t & 1)
            s = s + x_smem.load(s_layout)  # + warpgroup 1's columns and rope
            _release(x_free)
            p, m_new, alpha = _probabilities(s, m_run, lo + t * BLOCK_N, hi, hi, qk_scale_log2, 1, s_layout)
            l_i = l_i * alpha + gl.sum(p, axis=1)
            m_run = m_new
            p = p.to(dtype)
            r_ring.index(st).store(p)  # the rope slot: warpgroup 1's score read it before publishing its half
            alpha_smem.store(alpha)
            fence_async_shared()  # warpgroup 1's wgmma reads p
            _release(p_ready)
            acc = acc * gl.convert_layout(alpha, row_o)[:, None]
            acc = warpgroup_mma(gl.convert_layout(p, p_layout), c_half, acc, is_async=True)
        else:
            s = warpgroup_mma(q_pe, r_ring.index(st).permute((1, 0)), s, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
            mbarrier.wait(x_free, (t & 1) ^ 1, pred=t > 0)  # warpgroup 0 has read the last one
            x_smem.store(s)
            _release(x_ready)
            mbarrier.wait(p_ready, t & 1)
            fence_async_shared()
            alpha = alpha_smem.load(row_s)
            acc = acc * gl.convert_layout(alpha, row_o)[:, None]
            acc = warpgroup_mma(r_ring.index(st), c_half, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        gl.thread_barrier()  # every warp's PV has read the stage's half: refill it with tile t + 2
        _load_half(KV, kv_desc, rows, kv_indices, page_base, lo, stride_kvt, c_ring, r_ring, loaded, t + 2,
                   num_tiles, W, LATENT, ROPE, PAGE_SIZE, TMA, copy_layout)
        if not TMA:
            rows = _tile_rows(kv_indices, page_base, lo + (t + 3) * BLOCK_N, hi, PAGE_SIZE, BLOCK_N, copy_rows)

    # the output through this warpgroup's own stage, once the other warpgroup is done with it
    async_copy.wait_group(0)  # no copy outlives the CTA (a split with no tiles never waited for its query)
    _finish(acc, l_i, m_run, c_ring, amax_smem, l_smem, fin, Out, PartialO, PartialLse, b, hg, split, active,
            stride_ob, stride_oh, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, W, NUM_HEADS, LATENT,
            WRITE_FINAL, SCALED, row_s, row_o)


@gluon.jit
def _mla_decode_colsplit_kernel(
    Q, KV, Out, PartialO, PartialLse, kv_indptr, kv_indices, seq_lens, num_splits, group_first, group_ntok,
    qk_scale_log2,
    stride_qb, stride_qh, stride_kvt, stride_ob, stride_oh, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
    NUM_HEADS: gl.constexpr, LATENT: gl.constexpr, ROPE: gl.constexpr, PAGE_SIZE: gl.constexpr,
    WRITE_FINAL: gl.constexpr, CONSUMER_REGS: gl.constexpr, TOKENS: gl.constexpr, SCALED: gl.constexpr,
    kv_desc=None,
):
    """The seesaw kernel's arguments and grid (mla_decode_gluon.launch_mla_decode_gluon), two warpgroups; decode
    only (TOKENS 1: the extend rows' token groups stay on the seesaw kernel, faster there)."""
    BLOCK_H: gl.constexpr = 64
    BLOCK_N: gl.constexpr = 64
    dtype: gl.constexpr = Q.dtype.element_ty
    c_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, LATENT], dtype)
    r_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, ROPE], dtype)
    gl.static_assert(ROPE == BLOCK_N, "a tile's probabilities [64 rows, 64 keys] live in its [64 keys, 64] rope slot")
    gl.static_assert(TOKENS == 1, "one query token a CTA")
    vec_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    # [64, 64] float32 in the wgmma's layout: 32-byte chunks XOR-swizzled over 4 rows, as _store_output's staging
    x_layout: gl.constexpr = gl.SwizzledSharedLayout(8, 1, 4, order=[1, 0])

    hg = gl.program_id(0)
    g = gl.program_id(1)
    split = gl.program_id(2)
    lo, hi, num_tiles, active = _split_range(gl.load(seq_lens + g), gl.load(num_splits + g), split, BLOCK_N)
    page_base = gl.load(kv_indptr + g)

    q_c_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, LATENT], c_smem_layout)  # 64 KB
    x_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_H, BLOCK_N], x_layout)  # 16 KB: warpgroup 1's scores
    q_r_view = x_smem._reinterpret(dtype, [2, BLOCK_H, ROPE], r_smem_layout).index(0)  # q_pe, until wg1 holds it
    c_ring = gl.allocate_shared_memory(dtype, [2, BLOCK_N, LATENT], c_smem_layout)  # 128 KB
    r_ring = gl.allocate_shared_memory(dtype, [2, BLOCK_N, ROPE], r_smem_layout)  # 16 KB: rope, then probabilities
    alpha_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_H], vec_layout)  # the tile's rescale factor
    l_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_H], vec_layout)  # the final row sums
    amax_smem = gl.allocate_shared_memory(gl.float32, [2 * BLOCK_H], vec_layout)  # each half's row maxima
    # one arrival each; x_ready, x_free and p_ready complete one phase a tile, fin one in all
    fin = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    x_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    x_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    p_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    loaded = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())  # [W * 2 + stage]: TMA bytes
    for i in gl.static_range(2):
        mbarrier.init(fin.index(i), count=1)
    for i in gl.static_range(4):
        mbarrier.init(loaded.index(i), count=1)
    mbarrier.init(x_ready, count=1)
    mbarrier.init(x_free, count=1)
    mbarrier.init(p_ready, count=1)
    fence_async_shared()  # the barriers' init before the partitions use them

    gl.warp_specialize([
        (_colsplit_warpgroup, (Q, KV, kv_desc, Out, PartialO, PartialLse, kv_indices, g, hg, split, lo, hi,
                               num_tiles, active, page_base, qk_scale_log2, stride_qb, stride_qh, stride_kvt,
                               stride_ob, stride_oh, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, q_c_smem,
                               q_r_view, c_ring, r_ring, x_smem, alpha_smem, l_smem, amax_smem, x_ready, x_free,
                               p_ready, fin, loaded, 0, NUM_HEADS, LATENT, ROPE, PAGE_SIZE, WRITE_FINAL, SCALED)),
        (_colsplit_warpgroup, (Q, KV, kv_desc, Out, PartialO, PartialLse, kv_indices, g, hg, split, lo, hi,
                               num_tiles, active, page_base, qk_scale_log2, stride_qb, stride_qh, stride_kvt,
                               stride_ob, stride_oh, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, q_c_smem,
                               q_r_view, c_ring, r_ring, x_smem, alpha_smem, l_smem, amax_smem, x_ready, x_free,
                               p_ready, fin, loaded, 1, NUM_HEADS, LATENT, ROPE, PAGE_SIZE, WRITE_FINAL, SCALED)),
    ], [4], [CONSUMER_REGS])
