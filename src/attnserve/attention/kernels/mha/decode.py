"""Flash-Decoding over the paged pool: split-KV partial attention, then a log-sum-exp merge.

Stage 1 runs one program per (request, KV head, split). The query heads sharing a
KV head (the GQA group) are one tile, so a single tl.dot scores the whole group
and each KV byte is read once per group. Stage 2 merges a request's splits by
their log-sum-exps; attention sinks join the denominator there. When every
request has one split (and no CUDA graph needs a fixed grid), stage 1 writes the
final output itself and stage 2 is skipped.

Scores are kept in base 2 (scaled by log2(e)) so the kernels use exp2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnserve.attention.kernels import common
from attnserve.attention.kernels.gpu_target import GpuTarget, TileShape, settle_config, target_for
from attnserve.attention.kernels.mha.configs import DecodeConfig, default_decode_config
from attnserve.attention.kernels.params import DecodeRows, LayerParams
from attnserve.attention.kernels.split_kv import (
    finish_split,
    partial_strides,
    split_bounds,
    split_outputs,
    split_program,
)


@triton.jit
def _decode_split_kernel(
    Q, K, V, Out, PartialO, PartialLse,
    kv_indptr, kv_indices, seq_lens, num_splits, Sinks,
    qk_scale_log2, sm_scale_k, v_scale, softcap, window,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, V_DIM: tl.constexpr, BLOCK_DV: tl.constexpr,
    PAGE_SIZE: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr, WRITE_FINAL: tl.constexpr, DOT_F32: tl.constexpr,
):
    b, kvh, split, n_splits = split_program(num_splits)
    if split >= n_splits:
        return
    seq = tl.load(seq_lens + b)
    start = 0
    if HAS_WINDOW:
        start = tl.maximum(seq - window, 0)
    lo, hi = split_bounds(start, seq, n_splits, split, BLOCK_N)
    page_base = tl.load(kv_indptr + b)

    offs_h = tl.arange(0, BLOCK_H)
    head = kvh * GROUP + offs_h  # [BLOCK_H] query heads of this KV head
    h_mask = offs_h < GROUP
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_mask = offs_dv < V_DIM

    q = tl.load(Q + b * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=h_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_H, BLOCK_D]
    if DOT_F32:
        q = q.to(tl.float32)
    m_i, l_i, acc = common.online_softmax_start(BLOCK_H, BLOCK_DV)
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < hi
        page = tl.load(kv_indices + page_base + offs_n // PAGE_SIZE, mask=n_mask, other=0)
        slot = page.to(tl.int64) * PAGE_SIZE + offs_n % PAGE_SIZE  # [BLOCK_N]
        k = tl.load(K + slot[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :],
                    mask=n_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
        s = common.dot_qk(q, k, DOT_F32)  # [BLOCK_H, BLOCK_N]
        p, alpha, m_i, l_i = common.online_softmax_tile(s, n_mask[None, :], m_i, l_i, qk_scale_log2, sm_scale_k,
                                                        softcap, HAS_SOFTCAP, True)
        v = tl.load(V + slot[:, None] * stride_vt + kvh * stride_vh + offs_dv[None, :],
                    mask=n_mask[:, None] & dv_mask[None, :], other=0.0)  # [BLOCK_N, BLOCK_DV]
        acc = common.dot_pv(p, v, acc * alpha[:, None], q, DOT_F32)

    finish_split(acc, m_i, l_i, Out, PartialO, PartialLse, Sinks, b, head, h_mask, split, offs_dv, dv_mask, v_scale,
                 stride_ot, stride_oh, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, HAS_SINKS, WRITE_FINAL)


@triton.jit
def _merge_splits_kernel(
    Out, PartialO, PartialLse, num_splits, Sinks, v_scale,
    stride_ot, stride_oh, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
    V_DIM: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    n_splits = tl.load(num_splits + b)
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_mask = offs_dv < V_DIM
    m = tl.full([], -1.0e30, dtype=tl.float32)
    total = tl.full([], 0.0, dtype=tl.float32)
    acc = tl.zeros([BLOCK_DV], dtype=tl.float32)
    for s in range(n_splits):
        lse = tl.load(PartialLse + b * stride_lb + h * stride_lh + s)
        o = tl.load(PartialO + b * stride_pb + h * stride_ph + s * stride_ps + offs_dv, mask=dv_mask, other=0.0)
        m_new = tl.maximum(m, lse)
        alpha = tl.exp2(m - m_new)
        w = tl.exp2(lse - m_new)
        acc = acc * alpha + w * o
        total = total * alpha + w
        m = m_new
    if HAS_SINKS:
        total += tl.exp2(tl.minimum(common.to_log2(tl.load(Sinks + h)) - m, 126.0))
    total = tl.where(total > 0.0, total, 1.0)
    out = acc / total * v_scale
    tl.store(Out + b * stride_ot + h * stride_oh + offs_dv, out.to(Out.dtype.element_ty), mask=dv_mask)


def merge_splits(out: torch.Tensor, partial_o: torch.Tensor, partial_lse: torch.Tensor, num_splits: torch.Tensor,
                 sinks: torch.Tensor | None, v_scale: float) -> None:
    """Stage 2: each (request, head) merges its splits' partials by their LSEs into out `[B, Hq, Dv]`."""
    batch, num_heads, v_dim = out.shape
    _merge_splits_kernel[(batch, num_heads)](
        out, partial_o, partial_lse, num_splits, sinks if sinks is not None else out, v_scale,
        out.stride(0), out.stride(1), *partial_strides(partial_o, partial_lse),
        V_DIM=v_dim, BLOCK_DV=common.next_pow2(v_dim), HAS_SINKS=sinks is not None,
        num_warps=4 if v_dim >= 256 else 2,
    )


def decode_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    out: torch.Tensor,
    rows: DecodeRows,
    layer: LayerParams,
    partials: tuple[torch.Tensor, torch.Tensor] | None = None,
    write_final: bool | None = None,
    config: DecodeConfig | None = None,
    target: GpuTarget | None = None,
) -> torch.Tensor:
    """One query token per request against its paged KV.

    q `[B, Hq, D]`; k_buffer `[slots, Hkv, D]`, v_buffer `[slots, Hkv, Dv]` (the pool's layout);
    out `[B, Hq, Dv]`; rows: the step's pages and split plan (params.DecodeRows); layer: its scales and
    masking (params.LayerParams). `write_final` (default: max_splits == 1)
    lets stage 1 write `out` directly; it requires every num_splits to be 1. `target` (default: q's
    GPU) picks the default tiles and bounds their shared memory.
    """
    kv_indptr, kv_indices, seq_lens, num_splits = rows.kv_indptr, rows.kv_indices, rows.seq_lens, rows.num_splits
    max_splits, page_size = rows.max_splits, rows.page_size
    batch, num_heads, head_dim = q.shape
    num_kv_heads, v_dim = k_buffer.shape[1], v_buffer.shape[-1]
    if num_heads % num_kv_heads:
        raise ValueError(f"query heads {num_heads} are not a multiple of KV heads {num_kv_heads}")
    if batch == 0:
        return out
    group = num_heads // num_kv_heads
    target = target or target_for(q.device)
    block_h = max(16, common.next_pow2(group))

    def tile_shape(c: DecodeConfig) -> TileShape:
        return TileShape(block_h, common.next_pow2(head_dim), c.block_n,
                         common.next_pow2(head_dim) + common.next_pow2(v_dim), c.num_stages, q.element_size())

    config = settle_config("decode", config, default_decode_config(head_dim, page_size, target), tile_shape, target)
    if write_final is None:
        write_final = max_splits == 1
    partial_o, partial_lse = split_outputs(out, partials, max_splits, write_final)
    grid = (batch, num_kv_heads, max_splits)
    _decode_split_kernel[grid](
        q, k_buffer, v_buffer, out, partial_o, partial_lse,
        kv_indptr, kv_indices, seq_lens, num_splits, layer.sinks if layer.sinks is not None else q,
        *common.layer_scalars(layer),
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        out.stride(0), out.stride(1), *partial_strides(partial_o, partial_lse),
        GROUP=group, BLOCK_H=block_h, BLOCK_N=config.block_n, PAGE_SIZE=page_size, WRITE_FINAL=write_final,
        DOT_F32=common.dot_dtype_is_f32(q), **common.layer_constexprs(layer, head_dim, v_dim),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if not write_final:
        merge_splits(out, partial_o, partial_lse, num_splits, layer.sinks, layer.v_scale)
    return out
