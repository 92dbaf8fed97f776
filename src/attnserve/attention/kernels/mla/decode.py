"""MLA decode over the latent pool in Triton: Flash-Decoding with one shared KV "head" per token.

The pool row of a token is [c | k_pe]: the compressed latent (kv_lora_rank wide, e.g. 512) and
the decoupled RoPE key (e.g. 64). In the absorbed form every query head is MQA against it:
score = q_c . c + q_pe . k_pe and output = sum p c, so V is the latent already loaded for K.
One program owns BLOCK_H query heads of one request and one KV split: each latent byte is
read once per head group, and the two dots of the score share one online softmax. FP8 (e4m3)
latents carry one per-tensor scale, folded into the softmax scale and the output.

The split partials are split_kv.py's; mla/attention.py merges them (merge_tiled.py) and picks this kernel
or a Gluon one by the layer's KernelPlan.
"""

from __future__ import annotations

import triton
import triton.language as tl

from attnserve.attention.kernels import common
from attnserve.attention.kernels.gpu_target import check_shared_memory
from attnserve.attention.kernels.mla.decode_table import mla_tile_shape
from attnserve.attention.kernels.mla.latent import latent_query, latent_rows
from attnserve.attention.kernels.params import DecodeRows
from attnserve.attention.kernels.plan import KernelPlan
from attnserve.attention.kernels.split_kv import finish_split, partial_strides, split_bounds, split_program


@triton.jit
def mla_decode_split_kernel(
    Q, KV, Out, PartialO, PartialLse, kv_indptr, kv_indices, seq_lens, num_splits,
    qk_scale_log2, v_scale,
    stride_qb, stride_qh, stride_kvt, stride_ob, stride_oh,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
    NUM_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    LATENT: tl.constexpr, ROPE: tl.constexpr, BLOCK_R: tl.constexpr,
    PAGE_SIZE: tl.constexpr, TILE_IN_PAGE: tl.constexpr, DEFER_PV: tl.constexpr, WRITE_FINAL: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    b, hg, split, n_splits = split_program(num_splits)
    if split >= n_splits:
        return
    seq = tl.load(seq_lens + b)
    lo, hi = split_bounds(0, seq, n_splits, split, BLOCK_N)
    page_base = tl.load(kv_indptr + b)

    head = hg * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    h_mask = head < NUM_HEADS
    offs_c = tl.arange(0, LATENT)  # the latent width is a power of two (512 in DeepSeek)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < ROPE
    # [BLOCK_H, LATENT] and [BLOCK_H, BLOCK_R]
    q_c, q_r = latent_query(Q + b * stride_qb + head[:, None] * stride_qh, h_mask, LATENT, ROPE, BLOCK_R, DOT_F32)

    m_i, l_i, acc = common.online_softmax_start(BLOCK_H, LATENT)
    # DEFER_PV: a tile's probabilities are multiplied by its latent one iteration later (the tile is read again,
    # from L2). The score dot then feeds no dot of its own iteration, so Triton's Hopper layout splits its keys
    # over the two warpgroups of 8 warps instead of computing the whole score tile on both.
    # p_prev: the last tile's probabilities (relative to the running max m_i); alpha_prev: the factor taking acc
    # (the tiles before it, relative to the max before it) to m_i, applied as the dot's accumulator input
    p_prev = tl.zeros([BLOCK_H, BLOCK_N], dtype=tl.float32)
    alpha_prev = tl.full([BLOCK_H], 1.0, dtype=tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        if DEFER_PV:
            row_prev, prev_mask = latent_rows(KV, kv_indices, page_base, n0 - BLOCK_N, lo, hi, stride_kvt,
                                              BLOCK_N, PAGE_SIZE, TILE_IN_PAGE)
            c_prev = tl.load(row_prev + offs_c[None, :], mask=prev_mask[:, None], other=0.0)  # [BLOCK_N, LATENT]
            acc = common.dot_pv(p_prev, c_prev, acc * alpha_prev[:, None], q_c, DOT_F32)
        row, n_mask = latent_rows(KV, kv_indices, page_base, n0, lo, hi, stride_kvt, BLOCK_N, PAGE_SIZE,
                                  TILE_IN_PAGE)
        c = tl.load(row + offs_c[None, :], mask=n_mask[:, None], other=0.0)  # [BLOCK_N, LATENT]: K and V
        k_pe = tl.load(row + LATENT + offs_r[None, :], mask=n_mask[:, None] & r_mask[None, :], other=0.0)
        if DEFER_PV:  # the latent dot, the larger, must be the one that feeds no dot (common.dot_qk_into)
            s = common.dot_qk_into(q_c, c, common.dot_qk(q_r, k_pe, DOT_F32), DOT_F32)  # [BLOCK_H, BLOCK_N]
        else:  # both dots, then their sum: the layouts ptxas keeps apart from the deferred PV
            s = common.dot_qk(q_c, c, DOT_F32) + common.dot_qk(q_r, k_pe, DOT_F32)
        p, alpha, m_i, l_i = common.online_softmax_tile(s, n_mask[None, :], m_i, l_i, qk_scale_log2, 1.0, 1.0,
                                                        False, True)
        if DEFER_PV:
            p_prev = p
            alpha_prev = alpha
        else:
            acc = common.dot_pv(p, c, acc * alpha[:, None], q_c, DOT_F32)
    if DEFER_PV:  # the last tile's values
        last = lo + tl.maximum(hi - lo - 1, 0) // BLOCK_N * BLOCK_N
        row_last, last_mask = latent_rows(KV, kv_indices, page_base, last, lo, hi, stride_kvt, BLOCK_N,
                                          PAGE_SIZE, TILE_IN_PAGE)
        c_last = tl.load(row_last + offs_c[None, :], mask=last_mask[:, None], other=0.0)
        acc = common.dot_pv(p_prev, c_last, acc * alpha_prev[:, None], q_c, DOT_F32)

    finish_split(acc, m_i, l_i, Out, PartialO, PartialLse, Q, b, head, h_mask, split, offs_c, offs_c < LATENT,
                 v_scale, stride_ob, stride_oh, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
                 False, WRITE_FINAL)


def launch_triton_mla_decode(q, kv_buffer, out, partial_o, partial_lse, rows: DecodeRows, plan: KernelPlan,
                             sm_scale: float, kv_scale: float, write_final: bool) -> None:
    """Stage 1 of the split decode on the plan's Triton tile (mla/attention.py merges the splits)."""
    kv_indptr, kv_indices, seq_lens, num_splits = rows.kv_indptr, rows.kv_indices, rows.seq_lens, rows.num_splits
    max_splits, page_size = rows.max_splits, rows.page_size
    batch, num_heads, width = q.shape
    config, kv_lora_rank = plan.config, plan.signature.kv_lora_rank
    rope = width - kv_lora_rank
    check_shared_memory("MLA decode", mla_tile_shape(config, width, kv_lora_rank, q.element_size()),
                        plan.signature.target)
    grid = (batch, plan.programs_per_split, max_splits)
    mla_decode_split_kernel[grid](
        q, kv_buffer, out, partial_o, partial_lse, kv_indptr, kv_indices, seq_lens, num_splits,
        sm_scale * kv_scale * common.LOG2E, kv_scale,
        q.stride(0), q.stride(1), kv_buffer.stride(0), out.stride(0), out.stride(1),
        *partial_strides(partial_o, partial_lse),
        NUM_HEADS=num_heads, BLOCK_H=config.block_h, BLOCK_N=config.block_n,
        LATENT=kv_lora_rank, ROPE=rope, BLOCK_R=max(16, common.next_pow2(rope)),
        PAGE_SIZE=page_size, TILE_IN_PAGE=page_size % config.block_n == 0, DEFER_PV=config.defer_pv,
        WRITE_FINAL=write_final,
        DOT_F32=common.dot_dtype_is_f32(q),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
