"""The narrow Gluon MLA decode kernel for few heads (Hopper): keys as the wgmma's rows, heads as its columns
("narrow": the wgmma's N is the 16 or 32 heads).

At 16 heads (DeepSeek-V2-Lite; V3 at tensor parallel 8) decode is memory-bound: 2 x 16 x 1088 FLOPs per 1152-byte
latent row. A heads-major CTA would compute a 64-row wgmma for 16 real rows, and a Triton tile's warps issue the
next tile's copies only between two tiles' math. Here a producer warpgroup keeps copies in flight whatever the
consumer does, and the consumer warpgroup does no masked work:

    S^T [64 keys, H]   = K [64, 576] . q^T [576, H]          (m64nHk16, A and B from shared memory)
    softmax over the keys (the columns' max and sum across the warpgroup)
    O^T [512, H]      += V^T [512, 64] . P^T [64, H]         (8 x m64nHk16; V^T is the latent tile, transposed)

A CTA owns H = 16 or 32 query heads of one (request, split); O^T's float32 accumulator is 4H registers a thread.
Shared memory: q (H x 576) + two 72 KB stages of `[64 keys, 512]` + `[64 keys, 64]` + P^T (64 x H). The consumer
is serial (score, softmax, PV, each waited for): at 16 heads its math stays under the copies; at 128 heads, as
four 32-head CTAs, it does not, so the decode table puts it on few heads only.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia import hopper
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from attnserve.attention.kernels.mla.gluon import parts


@gluon.jit
def _narrow_producer(KV, kv_indices, lo, hi, num_tiles, page_base, stride_kvt, c_ring, r_ring, loaded, free,
                     LATENT: gl.constexpr, ROPE: gl.constexpr, PAGE_SIZE: gl.constexpr, STAGES: gl.constexpr):
    """Tile i into stage i % STAGES once the consumer freed it; the next tile's page indices are loaded before
    this tile's copies wait for their stage."""
    BLOCK_N: gl.constexpr = 64
    copy_rows: gl.constexpr = gl.SliceLayout(1, parts.COPY_LAYOUT)
    offs = gl.arange(0, ROPE, layout=gl.SliceLayout(0, parts.COPY_LAYOUT))
    rows = parts.tile_rows(kv_indices, page_base, lo, hi, PAGE_SIZE, BLOCK_N, copy_rows)  # [BLOCK_N] pool rows
    for i in range(num_tiles):
        s = i % STAGES
        base = KV + rows[:, None] * stride_kvt + offs[None, :]  # [BLOCK_N, ROPE] pointers
        rows = parts.tile_rows(kv_indices, page_base, lo + (i + 1) * BLOCK_N, hi, PAGE_SIZE, BLOCK_N, copy_rows)
        mbarrier.wait(free.index(s), ((i // STAGES) & 1) ^ 1, pred=i >= STAGES)
        parts.copy_columns(c_ring.index(s), base, 0, LATENT // ROPE, ROPE)
        async_copy.async_copy_global_to_shared(r_ring.index(s), base + LATENT)
        async_copy.mbarrier_arrive(loaded.index(s), increment_count=False)


@gluon.jit
def _narrow_consumer(Out, PartialO, PartialLse, b, hg, split, lo, hi, num_tiles, active, qk_scale_log2,
                     stride_ob, stride_oh, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
                     q_c_smem, q_r_smem, c_ring, r_ring, p_smem, loaded, free, q_loaded,
                     NUM_HEADS: gl.constexpr, BLOCK_H: gl.constexpr, LATENT: gl.constexpr,
                     STAGES: gl.constexpr, WRITE_FINAL: gl.constexpr):
    BLOCK_N: gl.constexpr = 64
    dtype: gl.constexpr = q_c_smem.dtype
    # one layout for S^T [64, H] and O^T [512, H]: a head's column sits on the same lanes in both
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_H, 16])
    per_head: gl.constexpr = gl.SliceLayout(0, mma)
    per_row: gl.constexpr = gl.SliceLayout(1, mma)

    mbarrier.wait(q_loaded, 0)
    m_run = gl.full([BLOCK_H], -1.0e30, gl.float32, layout=per_head)  # running base-2 max per head
    l_i = gl.zeros([BLOCK_H], gl.float32, layout=per_head)
    acc = gl.zeros([LATENT, BLOCK_H], gl.float32, layout=mma)  # O^T
    s_zero = gl.zeros([BLOCK_N, BLOCK_H], gl.float32, layout=mma)
    for i in range(num_tiles):
        s = i % STAGES
        c_tile = c_ring.index(s)
        mbarrier.wait(loaded.index(s), (i // STAGES) & 1)
        hopper.fence_async_shared()  # cp.async's writes (and the query's, the first time) before the wgmmas read them
        st = hopper.warpgroup_mma(c_tile, q_c_smem.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        st = hopper.warpgroup_mma(r_ring.index(s), q_r_smem.permute((1, 0)), st, is_async=True)
        st = hopper.warpgroup_mma_wait(num_outstanding=0, deps=(st,))
        offs_n = lo + i * BLOCK_N + gl.arange(0, BLOCK_N, layout=per_row)
        st = gl.where((offs_n < hi)[:, None], st * qk_scale_log2, float("-inf"))
        m_new = gl.maximum(m_run, gl.max(st, axis=0))
        alpha = gl.exp2(m_run - m_new)
        p = gl.exp2(st - m_new[None, :])  # [64 keys, H]; keys past hi: 0 (their rows repeat a valid key)
        l_i = l_i * alpha + gl.sum(p, axis=0)
        m_run = m_new
        acc = acc * alpha[None, :]
        p_smem.store(p.to(dtype))
        hopper.fence_async_shared()  # P^T's stores before the wgmma reads them
        gl.thread_barrier()
        acc = hopper.warpgroup_mma(c_tile.permute((1, 0)), p_smem, acc, is_async=True)
        acc = hopper.warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        parts.release_stage(free.index(s))

    l_safe = gl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[None, :]  # [LATENT, H]
    head = hg * BLOCK_H + gl.arange(0, BLOCK_H, layout=per_head)
    offs_c = gl.arange(0, LATENT, layout=per_row)
    ok = (head < NUM_HEADS) & active
    if WRITE_FINAL:
        gl.store(Out + b * stride_ob + head[None, :] * stride_oh + offs_c[:, None], o.to(dtype), mask=ok[None, :])
    else:
        gl.store(PartialO + b * stride_pb + head[None, :] * stride_ph + split * stride_ps + offs_c[:, None], o,
                 mask=ok[None, :])
        lse = gl.where(l_i > 0.0, m_run + gl.log2(l_safe), float("-inf"))
        gl.store(PartialLse + b * stride_lb + head * stride_lh + split, lse, mask=ok)


@gluon.jit
def mla_decode_narrow_kernel(
    Q, KV, Out, PartialO, PartialLse, kv_indptr, kv_indices, seq_lens, num_splits, qk_scale_log2,
    stride_qb, stride_qh, stride_kvt, stride_ob, stride_oh, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
    NUM_HEADS: gl.constexpr, BLOCK_H: gl.constexpr, LATENT: gl.constexpr, ROPE: gl.constexpr,
    PAGE_SIZE: gl.constexpr, WRITE_FINAL: gl.constexpr, CONSUMER_REGS: gl.constexpr,
):
    BLOCK_N: gl.constexpr = 64
    STAGES: gl.constexpr = 2
    dtype: gl.constexpr = Q.dtype.element_ty
    c_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, LATENT], dtype)
    r_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, ROPE], dtype)
    qc_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, LATENT], dtype)
    qr_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, ROPE], dtype)
    p_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_H], dtype)

    hg = gl.program_id(0)
    b = gl.program_id(1)
    split = gl.program_id(2)
    lo, hi, num_tiles, active = parts.split_range(gl.load(seq_lens + b), gl.load(num_splits + b), split, BLOCK_N)
    page_base = gl.load(kv_indptr + b)

    # the query by cp.async from these (the producer's) threads, waited for by the consumer: q_c [H, 512], q_pe [H, 64]
    head = hg * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, parts.COPY_LAYOUT))
    offs = gl.arange(0, ROPE, layout=gl.SliceLayout(0, parts.COPY_LAYOUT))
    q_ptrs = Q + b * stride_qb + head[:, None] * stride_qh + offs[None, :]  # [H, 64]: 64 columns a time
    q_mask = (head < NUM_HEADS)[:, None] & (offs < ROPE)[None, :]  # heads past NUM_HEADS are zeros
    q_c_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, LATENT], qc_smem_layout)
    q_r_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, ROPE], qr_smem_layout)
    q_loaded = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(q_loaded, count=128)
    parts.copy_query(q_ptrs, q_mask, q_c_smem, q_r_smem, q_loaded, LATENT, ROPE)
    c_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, LATENT], c_smem_layout)  # 128 KB
    r_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, ROPE], r_smem_layout)  # 16 KB
    p_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_H], p_smem_layout)  # P^T, the PV's B
    loaded = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(loaded.index(i), count=128)  # every producer thread's copies
        mbarrier.init(free.index(i), count=1)
    hopper.fence_async_shared()  # the barriers' init before the partitions use them

    gl.warp_specialize([
        (_narrow_producer, (KV, kv_indices, lo, hi, num_tiles, page_base, stride_kvt, c_ring, r_ring, loaded, free,
                            LATENT, ROPE, PAGE_SIZE, STAGES)),
        (_narrow_consumer, (Out, PartialO, PartialLse, b, hg, split, lo, hi, num_tiles, active, qk_scale_log2,
                            stride_ob, stride_oh, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
                            q_c_smem, q_r_smem, c_ring, r_ring, p_smem, loaded, free, q_loaded,
                            NUM_HEADS, BLOCK_H, LATENT, STAGES, WRITE_FINAL)),
    ], [4], [CONSUMER_REGS])
