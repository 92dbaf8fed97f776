"""MLA decode on Hopper in Gluon: FlashMLA's warp-specialised ping-pong over 64 heads per CTA.

Why not `triton.language`: a 64-head program keeps a 64 x 512 float32 output (128 registers a thread over two
warpgroups), and Triton's Hopper layout then computes the 64 x 64 score tile on both warpgroups (53 % of the
FLOPs twice), waits on every wgmma and gives no producer/consumer roles (benchmarks/NOTES.md, MLA). Here:

- three partitions: a 4-warp producer (40 registers) gathers latent rows by cp.async (any page size, page 1
  included) into a two-stage ring of `[64 keys, 512]` + `[64 keys, 64]` tiles; two 4-warp consumers, one per
  warpgroup, each own the 256 output columns of their half;
- the warpgroups take turns owning key tiles: the owner of tile t (t % 2, its tiles in stage t % 2) computes
  the whole 64 x 64 score (n64 wgmmas, q from shared memory), the softmax against the chain's running max (the
  max after tile t-1, from the other warpgroup) and publishes the probabilities, the rescale factor and the
  new max in shared memory; both multiply them by their half of the tile's latent (the owner with the
  probabilities in registers); the producer refills a stage once both have;
- the two warpgroups' row sums are added at the end.

Shared memory: q 72 KB + 2 x 72 KB of latent + 8 KB of probabilities = 225 KB, one CTA per SM. The split plan
and the LSE merge are mla_decode.py's (the same partial layout), with 64-head groups.

The 64 rows need not be heads of one token: for extend as decode rows (mla_extend_rows.py) with fewer heads, a
CTA takes consecutive query tokens of one request x all their heads (16 heads: 4 tokens), each row masked to
its own causal horizon, so few-head models fill the wgmma rows too.

Two other schedules were raced on the H200 and measured slower (benchmarks/NOTES.md): both warpgroups in
lockstep, each half of every score and output tile; and the next own score issued before the other
warpgroup's probabilities are waited on.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from attnserve.attention.kernels.common import LOG2E

GLUON_BLOCK_H = 64  # heads per CTA: one 64-row wgmma per warpgroup
GLUON_LATENT = 512
GLUON_ROPE = 64


def gluon_mla_decode_unsupported(q: torch.Tensor, kv_buffer: torch.Tensor, kv_lora_rank: int) -> str | None:
    """Why the Gluon kernel cannot run this call (None: it can)."""
    if q.device.type != "cuda":
        return "the Gluon MLA kernel needs a CUDA device (no interpreter)"
    if torch.cuda.get_device_capability(q.device)[0] != 9:
        return "the Gluon MLA kernel is written for Hopper (sm90) wgmma"
    if q.dtype not in (torch.bfloat16, torch.float16) or kv_buffer.dtype != q.dtype:
        return f"the Gluon MLA kernel takes a bf16/fp16 query and latent of one dtype, got {q.dtype} / {kv_buffer.dtype}"
    if kv_lora_rank != GLUON_LATENT or q.shape[-1] != GLUON_LATENT + GLUON_ROPE:
        return f"the Gluon MLA kernel is built for a {GLUON_LATENT}+{GLUON_ROPE} latent, got {kv_lora_rank}+" \
               f"{q.shape[-1] - kv_lora_rank}"
    if kv_buffer.stride(0) % 8 or q.stride(1) % 8 or q.stride(0) % 8:
        return "the Gluon MLA kernel copies 16-byte vectors: row strides must be multiples of 8 elements"
    return None


@gluon.jit
def _tile_rows(kv_indices, page_base, n0, hi, PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr,
               layout: gl.constexpr):
    """Pool rows `[BLOCK_N]` of the key tile at n0; keys past hi repeat the last key (a valid row, never NaN)."""
    offs_n = gl.minimum(n0 + gl.arange(0, BLOCK_N, layout=layout), hi - 1)
    page = gl.load(kv_indices + page_base + offs_n // PAGE_SIZE)
    return page.to(gl.int64) * PAGE_SIZE + offs_n % PAGE_SIZE


@gluon.jit
def _row_token_head(tok0, ntok, hg, NUM_HEADS: gl.constexpr, TOKENS: gl.constexpr, BLOCK_H: gl.constexpr,
                    layout: gl.constexpr):
    """Per row `[BLOCK_H]` of the CTA: its query token, its head, and whether it is a real (token, head).

    A CTA's 64 rows are TOKENS consecutive tokens x 64 / TOKENS heads (decode: 1 token, 64 heads of group hg)."""
    ROW_HEADS: gl.constexpr = BLOCK_H // TOKENS
    r = gl.arange(0, BLOCK_H, layout=layout)
    head = hg * ROW_HEADS + r % ROW_HEADS
    return tok0 + r // ROW_HEADS, head, (r // ROW_HEADS < ntok) & (head < NUM_HEADS)


# mbarriers, each completing one phase per tile of its stage / owner (tile t: phase (t // 2) & 1):
#   loaded[s]  the tile's copies have landed (128 arrivals: every producer thread)
#   free[s]    both warpgroups' PV of the tile in stage s are done (2 arrivals)
#   ready[w]   warpgroup w published its tile's probabilities, rescale factor and max
#   fin[w]     warpgroup w's row sum is in shared memory (the epilogue adds the two)
PINGPONG_CONSUMER_REGS = 232  # two warpgroups at 232 + the producer at 40: 64512 of the SM's 65536 registers
PINGPONG_MAXNREG = 168  # the kernel-wide figure the partitions' budgets are carved from: 168 x 384 threads


@gluon.jit
def _pingpong_producer(KV, kv_indices, lo, hi, num_tiles, page_base, stride_kvt, c_ring, r_ring, loaded, free,
                       LATENT: gl.constexpr, ROPE: gl.constexpr, PAGE_SIZE: gl.constexpr):
    BLOCK_N: gl.constexpr = 64
    copy_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])  # 128 B of a row per 8 threads
    copy_rows: gl.constexpr = gl.SliceLayout(1, copy_layout)
    offs = gl.arange(0, ROPE, layout=gl.SliceLayout(0, copy_layout))
    rows = _tile_rows(kv_indices, page_base, lo, hi, PAGE_SIZE, BLOCK_N, copy_rows)
    for t in range(num_tiles):
        stage = t % 2
        # the stage's previous tile (t - 2) must be done by both warpgroups
        mbarrier.wait(free.index(stage), ((t // 2) & 1) ^ 1, pred=t >= 2)
        base = KV + rows[:, None] * stride_kvt + offs[None, :]  # [BLOCK_N, ROPE] pointers, 4 rows a thread
        rows = _tile_rows(kv_indices, page_base, lo + (t + 1) * BLOCK_N, hi, PAGE_SIZE, BLOCK_N, copy_rows)
        c_dst = c_ring.index(stage)
        for k in gl.static_range(LATENT // ROPE):  # 64 columns (128 B) at a time: 4 addresses live, not 36
            async_copy.async_copy_global_to_shared(c_dst.slice(k * ROPE, ROPE, dim=1), base + k * ROPE)
        async_copy.async_copy_global_to_shared(r_ring.index(stage), base + LATENT)
        async_copy.mbarrier_arrive(loaded.index(stage), increment_count=False)  # when this thread's copies land


@gluon.jit
def _pingpong_consumer(
    Q, Out, PartialO, PartialLse, seq_lens, tok0, ntok, hg, split, lo, hi, num_tiles, active, qk_scale_log2,
    stride_ob, stride_oh, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
    q_c_smem, q_r_smem, c_ring, r_ring, p_smem, alpha_smem, m_smem, l_smem, loaded, free, ready, fin,
    W: gl.constexpr, NUM_HEADS: gl.constexpr, LATENT: gl.constexpr, WRITE_FINAL: gl.constexpr,
    TOKENS: gl.constexpr,
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

    if TOKENS > 1:  # each row's own causal horizon within the split: rows of earlier tokens see fewer keys
        row_tok, _, row_ok = _row_token_head(tok0, ntok, hg, NUM_HEADS, TOKENS, BLOCK_H, row_s)
        hi_row = gl.minimum(gl.load(seq_lens + row_tok, mask=row_ok, other=0), hi)
    m_last = gl.full([BLOCK_H], -1.0e30, gl.float32, layout=row_s)  # the chain's max after the last tile seen
    l_i = gl.zeros([BLOCK_H], gl.float32, layout=row_s)  # this warpgroup's tiles' row sums, kept at m_last
    acc = gl.zeros([BLOCK_H, HALF], gl.float32, layout=o_layout)  # columns W * HALF ... of the output
    for t in range(num_tiles):
        stage = t % 2
        phase = (t // 2) & 1
        c_tile = c_ring.index(stage)
        v_half = c_tile.slice(W * HALF, HALF, dim=1)  # [BLOCK_N, HALF]
        if stage == W:  # this warpgroup's tile: score, softmax, publish, PV
            mbarrier.wait(loaded.index(W), phase)
            fence_async_shared()  # cp.async's writes before the wgmmas read them
            s = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=s_layout)  # made here: not live across the loop
            s = warpgroup_mma(q_r_smem, r_ring.index(W).permute((1, 0)), s, use_acc=False, is_async=True)
            s = warpgroup_mma(q_c_smem, c_tile.permute((1, 0)), s, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
            offs_n = lo + t * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            if TOKENS > 1:
                s = gl.where(offs_n[None, :] < hi_row[:, None], s * qk_scale_log2, float("-inf"))
            else:
                s = gl.where((offs_n < hi)[None, :], s * qk_scale_log2, float("-inf"))
            m_new = gl.maximum(m_last, gl.max(s, axis=1))
            alpha = gl.exp2(m_last - m_new)
            p = gl.exp2(s - m_new[:, None]).to(dtype)
            l_i = l_i * alpha + gl.sum(p.to(gl.float32), axis=1)
            m_last = m_new
            p_smem.store(p)
            alpha_smem.store(alpha)
            m_smem.store(m_new)
            fence_async_shared()  # the other warpgroup's wgmma reads p_smem
            gl.thread_barrier()
            mbarrier.arrive(ready.index(W), count=1)
            acc = acc * gl.convert_layout(alpha, row_o)[:, None]
            acc = warpgroup_mma(gl.convert_layout(p, p_layout), v_half, acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        else:  # the other warpgroup's tile: its probabilities times this warpgroup's half
            mbarrier.wait(ready.index(1 - W), phase)
            fence_async_shared()
            alpha = alpha_smem.load(row_s)
            m_last = m_smem.load(row_s)
            l_i = l_i * alpha
            acc = acc * gl.convert_layout(alpha, row_o)[:, None]
            acc = warpgroup_mma(p_smem, v_half, acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        gl.thread_barrier()
        mbarrier.arrive(free.index(stage), count=1)

    # the row sum is the two warpgroups' (each kept at the chain's final max, m_last in both)
    l_smem.slice(W * BLOCK_H, BLOCK_H).store(l_i)
    gl.thread_barrier()
    mbarrier.arrive(fin.index(W), count=1)
    mbarrier.wait(fin.index(1 - W), 0)
    l_tot = l_i + l_smem.slice((1 - W) * BLOCK_H, BLOCK_H).load(row_s)
    l_safe = gl.where(l_tot > 0.0, l_tot, 1.0)
    o = acc / gl.convert_layout(l_safe, row_o)[:, None]
    tok_o, head_o, ok_o = _row_token_head(tok0, ntok, hg, NUM_HEADS, TOKENS, BLOCK_H, row_o)
    offs_o = W * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, o_layout))
    o_mask = (ok_o & active)[:, None]
    if WRITE_FINAL:
        gl.store(Out + tok_o[:, None] * stride_ob + head_o[:, None] * stride_oh + offs_o[None, :], o.to(dtype),
                 mask=o_mask)
    else:
        gl.store(PartialO + tok_o[:, None] * stride_pb + head_o[:, None] * stride_ph + split * stride_ps
                 + offs_o[None, :], o, mask=o_mask)
        if W == 0:
            tok_l, head_l, ok_l = _row_token_head(tok0, ntok, hg, NUM_HEADS, TOKENS, BLOCK_H, row_s)
            lse = gl.where(l_tot > 0.0, m_last + gl.log2(l_safe), float("-inf"))
            gl.store(PartialLse + tok_l * stride_lb + head_l * stride_lh + split, lse, mask=ok_l & active)


@gluon.jit
def _mla_decode_pingpong_kernel(
    Q, KV, Out, PartialO, PartialLse, kv_indptr, kv_indices, seq_lens, num_splits, group_first, group_ntok,
    qk_scale_log2,
    stride_qb, stride_qh, stride_kvt, stride_ob, stride_oh, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
    NUM_HEADS: gl.constexpr, LATENT: gl.constexpr, ROPE: gl.constexpr, PAGE_SIZE: gl.constexpr,
    WRITE_FINAL: gl.constexpr, CONSUMER_REGS: gl.constexpr, TOKENS: gl.constexpr,
):
    """Per-token arrays (kv_indptr's starts, seq_lens, num_splits) are indexed by query token. TOKENS > 1 (extend
    rows, few heads): CTA g takes tokens group_first[g] ... + group_ntok[g] - 1 of one request, whose horizon
    grows by one per token, so the last one's is the CTA's key range."""
    BLOCK_H: gl.constexpr = 64
    BLOCK_N: gl.constexpr = 64
    dtype: gl.constexpr = Q.dtype.element_ty
    q_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    c_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, LATENT], dtype)
    r_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, ROPE], dtype)
    p_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_N], dtype)
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
    n_splits = gl.load(num_splits + tok0)
    active = split < n_splits
    seq = gl.load(seq_lens + tok0 + ntok - 1)
    chunk = gl.cdiv(gl.cdiv(seq, n_splits), BLOCK_N) * BLOCK_N  # mla_decode.split_bounds
    lo = split * chunk
    hi = gl.minimum(lo + chunk, seq)
    num_tiles = gl.where(active, gl.cdiv(gl.maximum(hi - lo, 0), BLOCK_N), 0)
    page_base = gl.load(kv_indptr + tok0)

    # the query in shared memory, the score wgmma's A: q_c [64, 512] (64 KB) and q_pe [64, 64] (8 KB)
    tok, head, row_ok = _row_token_head(tok0, ntok, hg, NUM_HEADS, TOKENS, BLOCK_H, gl.SliceLayout(1, q_layout))
    offs = gl.arange(0, ROPE, layout=gl.SliceLayout(0, q_layout))
    q_ptrs = Q + tok[:, None] * stride_qb + head[:, None] * stride_qh + offs[None, :]  # [64, 64]: 64 columns a time
    q_mask = row_ok[:, None]
    q_c_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, LATENT], c_smem_layout)
    for k in gl.static_range(LATENT // ROPE):
        q_c_smem.slice(k * ROPE, ROPE, dim=1).store(gl.load(q_ptrs + k * ROPE, mask=q_mask, other=0.0))
    q_r_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, ROPE], r_smem_layout,
                                         gl.load(q_ptrs + LATENT, mask=q_mask, other=0.0))
    c_ring = gl.allocate_shared_memory(dtype, [2, BLOCK_N, LATENT], c_smem_layout)  # 128 KB
    r_ring = gl.allocate_shared_memory(dtype, [2, BLOCK_N, ROPE], r_smem_layout)  # 16 KB
    p_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, BLOCK_N], p_smem_layout)  # 8 KB
    alpha_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_H], vec_layout)
    m_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_H], vec_layout)
    l_smem = gl.allocate_shared_memory(gl.float32, [2 * BLOCK_H], vec_layout)  # each warpgroup's row sums
    loaded = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    fin = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(loaded.index(i), count=128)  # one cp.async arrival per producer thread
        mbarrier.init(free.index(i), count=2)
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(fin.index(i), count=1)
    fence_async_shared()  # the query's stores and the barriers' init before the partitions use them

    gl.warp_specialize([
        (_pingpong_producer, (KV, kv_indices, lo, hi, num_tiles, page_base, stride_kvt, c_ring, r_ring, loaded, free,
                              LATENT, ROPE, PAGE_SIZE)),
        (_pingpong_consumer, (Q, Out, PartialO, PartialLse, seq_lens, tok0, ntok, hg, split, lo, hi, num_tiles,
                              active, qk_scale_log2, stride_ob, stride_oh, stride_pb, stride_ph, stride_ps, stride_lb,
                              stride_lh, q_c_smem, q_r_smem, c_ring, r_ring, p_smem, alpha_smem, m_smem, l_smem,
                              loaded, free, ready, fin, 0, NUM_HEADS, LATENT, WRITE_FINAL, TOKENS)),
        (_pingpong_consumer, (Q, Out, PartialO, PartialLse, seq_lens, tok0, ntok, hg, split, lo, hi, num_tiles,
                              active, qk_scale_log2, stride_ob, stride_oh, stride_pb, stride_ph, stride_ps, stride_lb,
                              stride_lh, q_c_smem, q_r_smem, c_ring, r_ring, p_smem, alpha_smem, m_smem, l_smem,
                              loaded, free, ready, fin, 1, NUM_HEADS, LATENT, WRITE_FINAL, TOKENS)),
    ], [4, 4], [CONSUMER_REGS, CONSUMER_REGS])


def tokens_per_cta(num_heads: int) -> int:
    """Query tokens that share a CTA's 64 rows in extend rows: 64 / heads where heads divide 64 (16 heads: 4)."""
    return GLUON_BLOCK_H // num_heads if num_heads < GLUON_BLOCK_H and GLUON_BLOCK_H % num_heads == 0 else 1


def head_groups_per_cta_row(num_heads: int, tokens: int = 1) -> int:
    """CTAs per (token group, split): the grid's first dimension, and what the split plan counts as programs."""
    return triton.cdiv(num_heads * tokens, GLUON_BLOCK_H)


def launch_mla_decode_gluon(q, kv_buffer, out, partial_o, partial_lse, kv_indptr, kv_indices, seq_lens, num_splits,
                            max_splits: int, page_size: int, sm_scale: float, write_final: bool,
                            partial_strides: tuple[int, ...], token_groups=None, schedule: str = "gluon_ws") -> None:
    """Stage 1 of the split decode (mla_decode.mla_decode_attention merges the partials).

    schedule: the MLADecodeConfig kernel, "gluon_ws" (this file's ping-pong) or "gluon_seesaw"
    (mla_decode_seesaw.py); both take the same arguments and grid.

    token_groups: (group_first `[G]`, group_ntok `[G]`, tokens): CTAs of several query tokens each (extend rows,
    mla_extend_rows.py); the per-token arrays stay per token."""
    batch, num_heads, _ = q.shape
    first, ntok, tokens = token_groups if token_groups is not None else (seq_lens, seq_lens, 1)
    rows = first.numel() if tokens > 1 else batch
    grid = (head_groups_per_cta_row(num_heads, tokens), rows, max_splits)  # a request's head groups are neighbours
    kernel = _mla_decode_pingpong_kernel
    if schedule == "gluon_seesaw":
        from attnserve.attention.kernels.mla_decode_seesaw import _mla_decode_seesaw_kernel as kernel
    kernel[grid](
        q, kv_buffer, out, partial_o, partial_lse, kv_indptr, kv_indices, seq_lens, num_splits, first, ntok,
        sm_scale * LOG2E,
        q.stride(0), q.stride(1), kv_buffer.stride(0), out.stride(0), out.stride(1), *partial_strides,
        NUM_HEADS=num_heads, LATENT=GLUON_LATENT, ROPE=GLUON_ROPE, PAGE_SIZE=page_size, WRITE_FINAL=write_final,
        CONSUMER_REGS=PINGPONG_CONSUMER_REGS, TOKENS=tokens, num_warps=4, maxnreg=PINGPONG_MAXNREG,
    )
