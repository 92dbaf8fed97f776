"""Triton kernels of the differentiable FlashAttention: a forward that also writes the row LSE, and a
backward that recomputes P tile by tile from Q, K and that LSE.

Layout: q [B, Hq, Tq, D], k and v [B, Hkv, Tk, D] (the last dimension contiguous), Hq a multiple of Hkv.
Query row i sits at position i + (Tk - Tq) of the key sequence (bottom-right alignment, so a query block
appended to a cached prefix lines up with its keys). Key j is visible to row i when

    causal:          j <= i + Tk - Tq
    sliding window:  j >  i + Tk - Tq - window   (the window counts the query's own key)

Scores are kept in base-2 units inside the kernels (exp2 is the fast exponential); the LSE they write is
the natural-log one, log(sum_j exp(s_ij)), in float32 (float64 for float64 inputs).

Kernels:
    _fwd_kernel     one program per (query block, query head): online softmax over the visible key blocks;
                    writes O and LSE.
    _delta_kernel   delta_i = rowsum(dO_i * O_i).
    _dkdv_kernel    one program per (key block, KV head): for every query head of the group and every query
                    block that sees the key block, P^T = exp(S^T - LSE); dV += P^T dO; dP^T = V dO^T;
                    dS^T = P^T * (dP^T - delta); dK += dS^T Q. The group's query heads are summed in
                    registers, so GQA needs no atomics and no per-query-head dK/dV.
    _dq_kernel      one program per (query block, query head): dQ += dS K over the visible key blocks.

A causal bf16 / fp16 forward in a layout the serving prefill kernel reads in place goes to that kernel instead
(forward_tma: TMA loads, warp-specialised on Hopper), which writes the same O and LSE.

No kernel writes anything of size Tq x Tk: the only tensors besides the inputs and their gradients are
LSE and delta, one float per query row. Each loop over blocks is split into blocks that need no score mask
(every pair visible) and the boundary blocks that apply it; rows and keys past the ends load as zeros, and
where those zeros could reach a stored result (a padded key's score in the forward) the mask covers them.
Tiles are fixed per head dim (GPU_TILES); no kernel is autotuned.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from attnserve.analysis.training import forward_tma
from attnserve.attention.kernels.common import interpreting
from attnserve.attention.kernels.interpreter_compat import let_interpreter_index_with_loaded_scalars

# ---------------------------------------------------------------------------------------------- tiles

@dataclass(frozen=True)
class Tiles:
    """(BLOCK_M query rows, BLOCK_N keys, num_warps, num_stages) of each kernel. The backward kernels take more:
    the diagonal split (default 1), which sweeps the causal diagonal's masked blocks in steps of BLOCK_M (dkdv) or
    BLOCK_N (dq) divided by it; descriptors (default 0), 1 to read the loop's tiles (Q and dO in dkdv, K and V
    in dq) through TMA descriptors instead of pointer loads, where the tensors allow it; and on dkdv, fused dQ
    (default 0), 1 to add each block's dS K share into a float32 accumulator (one TMA reduction a block on a
    GPU) and launch no dq kernel. At head_dim 128 dkdv sits at the 255-register ceiling and spills when causal
    (tools/compile_training_sm90.py, sm_90, the launcher's 16-divisible pointers and strides: (32, 128, 8, 3)
    stores 196 bytes a thread, 172 with the diagonal split, 164 with descriptors, none when not causal); dq
    (128, 64, 8, 3) uses 255 registers and does not spill, 183 with descriptors. training_h200.py races them
    all; on an H100 none beat the plain tiles (docs/kernels.md, "Training")."""

    fwd: tuple[int, ...]
    dkdv: tuple[int, ...]
    dq: tuple[int, ...]


# by head dim; the key-block kernel wants many keys per program (its dK and dV accumulators stay resident),
# the query-block kernels many rows. Each was the sweep's pick (benchmarks/training_h200.py) on an H100:
# training-h100.json at 128 (whose forward is the prefill kernel: forward_tma), training-h100-d64.json at 64
GPU_TILES: dict[int, Tiles] = {
    64: Tiles(fwd=(128, 64, 8, 3), dkdv=(64, 128, 8, 3), dq=(128, 64, 8, 3)),
    128: Tiles(fwd=(128, 128, 8, 3), dkdv=(32, 128, 8, 3), dq=(128, 64, 8, 3)),
}
# unequal tiles, as on the GPU, so that the block-range arithmetic is exercised on the CPU too
INTERPRETER_TILES = Tiles(fwd=(32, 16, 4, 1), dkdv=(16, 32, 4, 1), dq=(32, 16, 4, 1))


def tiles_for(head_dim: int) -> Tiles:
    if interpreting():
        return INTERPRETER_TILES
    return GPU_TILES[64 if head_dim <= 64 else 128]


def _launch(t: tuple[int, ...]) -> dict:
    return dict(BLOCK_M=t[0], BLOCK_N=t[1], num_warps=t[2], num_stages=t[3])


def _full(t: tuple[int, ...]) -> tuple[int, ...]:
    """A backward tile with its optional entries filled in: (..., diagonal split 1, descriptors 0, fused dQ 0)."""
    return tuple(t) + (1, 0, 0)[len(t) - 4:]


def _launch_backward(t: tuple[int, ...]) -> dict:
    t = _full(t)
    return dict(_launch(t), DIAG_SPLIT=t[4], DESC=bool(t[5]))


# ---------------------------------------------------------------------------------------------- helpers

@triton.jit
def _tanh(x):
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x >= 0, t, -t)


@triton.jit
def _logits(qk, sm_scale, softcap, SOFTCAP: tl.constexpr):
    """Scores in base-2 units, and tanh(x / softcap) for the backward (qk itself when there is no softcap)."""
    if SOFTCAP:
        t = _tanh(qk * (sm_scale / softcap))
        return t * (softcap * 1.4426950408889634), t
    else:
        return qk * (sm_scale * 1.4426950408889634), qk


@triton.jit
def _visible(offs_m, offs_n, Tq, Tk, off, window, CAUSAL: tl.constexpr, WINDOW: tl.constexpr):
    """[M, N] mask of the (row, key) pairs that are in bounds and visible."""
    ok = (offs_m[:, None] < Tq) & (offs_n[None, :] < Tk)
    if CAUSAL:
        ok = ok & (offs_n[None, :] <= offs_m[:, None] + off)
    if WINDOW:
        ok = ok & (offs_n[None, :] > offs_m[:, None] + off - window)
    return ok


@triton.jit
def _visible_t(offs_m, offs_n, off, window, CAUSAL: tl.constexpr, WINDOW: tl.constexpr):
    """[N, M] mask of the visible (key, row) pairs; bounds are left to the loads (see _dkdv_inner)."""
    ok = offs_n[:, None] >= 0
    if CAUSAL:
        ok = ok & (offs_n[:, None] <= offs_m[None, :] + off)
    if WINDOW:
        ok = ok & (offs_n[:, None] > offs_m[None, :] + off - window)
    return ok


@triton.jit
def _batch_head(heads):
    """program_id(1), the grid's (batch x head) axis over `heads` heads, as (its index, batch, head); batch and
    head in int64, as the offsets they scale need."""
    bh = tl.program_id(1)
    return bh, (bh // heads).to(tl.int64), (bh % heads).to(tl.int64)


@triton.jit
def _query_program(H, GROUP, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr):
    """A query-block program's first row, its (batch x head) index, batch, query head and KV head."""
    pid_m = tl.program_id(0)
    if CAUSAL:  # the longest rows first
        pid_m = tl.num_programs(0) - 1 - pid_m
    bh, b, h = _batch_head(H)
    return pid_m * BLOCK_M, bh, b, h, h // GROUP


@triton.jit
def _key_blocks(start_m, Tk, off, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                WINDOW: tl.constexpr):
    """The key blocks a query block visits: [lo, full) need no score mask (every row sees every key there),
    [full, hi) do. Under a window every block is masked: full == lo."""
    hi = Tk
    if CAUSAL:
        hi = tl.minimum(Tk, start_m + BLOCK_M + off)
    if WINDOW:
        lo = tl.maximum(start_m + off - window + 1, 0) // BLOCK_N * BLOCK_N
        full = lo
    else:
        lo = 0
        full = Tk // BLOCK_N * BLOCK_N
        if CAUSAL:
            full = tl.minimum(full, (start_m + off + 1) // BLOCK_N * BLOCK_N)
    return lo, full, hi


@triton.jit
def _head_rows(base, stride_t, offs, offs_d, n, MASKED: tl.constexpr):
    """Rows `offs` `[BLOCK, HEAD_DIM]` of one (batch, head)'s n rows at base; MASKED: rows past n load as zeros
    (a block that cannot reach past n skips the mask)."""
    if MASKED:
        return tl.load(base + offs[:, None] * stride_t + offs_d[None, :], mask=offs[:, None] < n, other=0.0)
    return tl.load(base + offs[:, None] * stride_t + offs_d[None, :])


@triton.jit
def _key_block(q, k_base, stride_kt, start_n, offs_d, Tk, sm_scale, softcap, BLOCK_N: tl.constexpr,
               MASKED: tl.constexpr, SOFTCAP: tl.constexpr):
    """The key block at start_n against a query block: its key offsets, K rows, and _logits' two results."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k = _head_rows(k_base, stride_kt, offs_n, offs_d, Tk, MASKED)
    s, t = _logits(tl.dot(q, tl.trans(k)), sm_scale, softcap, SOFTCAP)
    return offs_n, k, s, t


# ---------------------------------------------------------------------------------------------- forward

@triton.jit
def _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, offs_m, offs_d, lo, hi,
               Tq, Tk, off, window, sm_scale, softcap,
               BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
               SOFTCAP: tl.constexpr):
    for start_n in range(lo, hi, BLOCK_N):
        offs_n, _k, s, _t = _key_block(q, k_base, stride_kt, start_n, offs_d, Tk, sm_scale, softcap, BLOCK_N, MASKED,
                                       SOFTCAP)
        if MASKED:
            s = tl.where(_visible(offs_m, offs_n, Tq, Tk, off, window, CAUSAL, WINDOW), s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = m_new
        p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v = _head_rows(v_base, stride_vt, offs_n, offs_d, Tk, MASKED)
        acc += tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _fwd_kernel(Q, K, V, O, LSE,
                stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
                stride_vb, stride_vh, stride_vt, stride_ob, stride_oh, stride_ot,
                H, GROUP, Tq, Tk, off, window, sm_scale, softcap,
                HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
                ACC_DTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    start_m, bh, b, h, hk = _query_program(H, GROUP, BLOCK_M, CAUSAL)
    q_base = Q + b * stride_qb + h * stride_qh
    k_base = K + b * stride_kb + hk * stride_kh
    v_base = V + b * stride_vb + hk * stride_vh
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q = _head_rows(q_base, stride_qt, offs_m, offs_d, Tq, True)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=ACC_DTYPE)
    l_i = tl.zeros([BLOCK_M], dtype=ACC_DTYPE)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=ACC_DTYPE)

    lo, full, hi = _key_blocks(start_m, Tk, off, window, BLOCK_M, BLOCK_N, CAUSAL, WINDOW)
    if not WINDOW:
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, offs_m, offs_d, lo, full,
                                   Tq, Tk, off, window, sm_scale, softcap, BLOCK_N, False, CAUSAL, WINDOW, SOFTCAP)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, offs_m, offs_d, full, hi,
                               Tq, Tk, off, window, sm_scale, softcap, BLOCK_N, True, CAUSAL, WINDOW, SOFTCAP)

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None]
    lse = (m_i + tl.log2(l_safe)) * 0.6931471805599453
    o_base = O + b * stride_ob + h * stride_oh
    tl.store(o_base + offs_m[:, None] * stride_ot + offs_d[None, :], o.to(O.dtype.element_ty),
             mask=offs_m[:, None] < Tq)
    tl.store(LSE + bh.to(tl.int64) * Tq + offs_m, lse, mask=offs_m < Tq)


# ---------------------------------------------------------------------------------------------- backward

@triton.jit
def _delta_kernel(O, DO, DELTA, stride_ob, stride_oh, stride_ot, stride_db, stride_dh, stride_dt, H, Tq,
                  HEAD_DIM: tl.constexpr, ACC_DTYPE: tl.constexpr, BLOCK_M: tl.constexpr):
    bh, b, h = _batch_head(H)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    o = _head_rows(O + b * stride_ob + h * stride_oh, stride_ot, offs_m, offs_d, Tq, True)
    do = _head_rows(DO + b * stride_db + h * stride_dh, stride_dt, offs_m, offs_d, Tq, True)
    delta = tl.sum(o.to(ACC_DTYPE) * do.to(ACC_DTYPE), 1)
    tl.store(DELTA + bh.to(tl.int64) * Tq + offs_m, delta, mask=offs_m < Tq)


@triton.jit
def _dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qt, stride_dot,
                offs_n, offs_d, lo, hi, Tq, Tk, off, window, sm_scale, softcap,
                BLOCK_M: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
                SOFTCAP: tl.constexpr, DESC: tl.constexpr, dq_acc, DQ_FUSED: tl.constexpr, TMA_REDUCE: tl.constexpr,
                HEAD_DIM: tl.constexpr):
    offs_m0 = tl.arange(0, BLOCK_M)
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + offs_m0
        # rows past Tq load as zeros (dO and delta too), so they add nothing to dK or dV: only the score
        # masks depend on MASKED
        row_ok = offs_m < Tq
        if DESC:  # q_base, do_base: descriptors of this head's [Tq, HEAD_DIM] rows (zeros past Tq)
            qT = tl.trans(q_base.load([start_m, 0]))
        else:
            qT = tl.load(q_base + offs_m[None, :] * stride_qt + offs_d[:, None], mask=row_ok[None, :], other=0.0)
        lse = tl.load(lse_base + offs_m, mask=row_ok, other=0.0)
        sT, tT = _logits(tl.dot(k, qT), sm_scale, softcap, SOFTCAP)
        pT = tl.exp2(sT - lse[None, :] * 1.4426950408889634)
        if MASKED:
            pT = tl.where(_visible_t(offs_m, offs_n, off, window, CAUSAL, WINDOW), pT, 0.0)
        if DESC:
            do = do_base.load([start_m, 0])
        else:
            do = _head_rows(do_base, stride_dot, offs_m, offs_d, Tq, True)
        delta = tl.load(delta_base + offs_m, mask=row_ok, other=0.0)
        dv += tl.dot(pT.to(do.dtype), do)
        dpT = tl.dot(v, tl.trans(do))
        dsT = pT * (dpT - delta[None, :])
        if SOFTCAP:
            dsT = dsT * (1.0 - tT * tT)
        dk += tl.dot(dsT.to(qT.dtype), tl.trans(qT))
        if DQ_FUSED:  # this block's share of dQ = dS K * scale
            dq_part = tl.dot(tl.trans(dsT.to(k.dtype)), k) * sm_scale
            if TMA_REDUCE:  # added in L2 by one TMA reduction; rows past Tq are clipped
                dq_acc.atomic_add([start_m, 0], dq_part)
            else:  # the interpreter has no descriptor reductions: the same sums, element by element
                tl.atomic_add(dq_acc + offs_m[:, None] * HEAD_DIM + offs_d[None, :], dq_part, mask=row_ok[:, None])
    return dk, dv


@triton.jit
def _dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, DQ_ACC,
                 stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
                 stride_vb, stride_vh, stride_vt, stride_dob, stride_doh, stride_dot,
                 stride_dkb, stride_dkh, stride_dkt, stride_dvb, stride_dvh, stride_dvt,
                 H, HK, GROUP, Tq, Tk, off, window, sm_scale, softcap,
                 HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
                 ACC_DTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DIAG_SPLIT: tl.constexpr,
                 DESC: tl.constexpr, DQ_FUSED: tl.constexpr, TMA_REDUCE: tl.constexpr):
    start_n = tl.program_id(0) * BLOCK_N
    _bhk, b, hk = _batch_head(HK)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    kv_mask = offs_n[:, None] < Tk
    k = _head_rows(K + b * stride_kb + hk * stride_kh, stride_kt, offs_n, offs_d, Tk, True)
    v = _head_rows(V + b * stride_vb + hk * stride_vh, stride_vt, offs_n, offs_d, Tk, True)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=ACC_DTYPE)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=ACC_DTYPE)

    # the query rows that see some key of this block, and those that see all of them
    lo = 0
    if CAUSAL:
        lo = tl.maximum(start_n - off, 0) // BLOCK_M * BLOCK_M
    hi = Tq
    if WINDOW:
        hi = tl.minimum(Tq, start_n + BLOCK_N - off + window - 1)
    for g in range(0, GROUP):
        h = hk * GROUP + g
        q_base = Q + b * stride_qb + h * stride_qh
        do_base = DO + b * stride_dob + h * stride_doh
        q_diag = q_base
        do_diag = do_base
        if DESC:  # TMA: each tile lands in shared memory once, where both its uses read it
            q_diag = tl.make_tensor_descriptor(q_base, [Tq, HEAD_DIM], [stride_qt, 1],
                                               [BLOCK_M // DIAG_SPLIT, HEAD_DIM])
            do_diag = tl.make_tensor_descriptor(do_base, [Tq, HEAD_DIM], [stride_dot, 1],
                                                [BLOCK_M // DIAG_SPLIT, HEAD_DIM])
            q_base = tl.make_tensor_descriptor(q_base, [Tq, HEAD_DIM], [stride_qt, 1], [BLOCK_M, HEAD_DIM])
            do_base = tl.make_tensor_descriptor(do_base, [Tq, HEAD_DIM], [stride_dot, 1], [BLOCK_M, HEAD_DIM])
        row = (b * H + h) * Tq
        dq_acc = DQ_ACC
        dq_acc_diag = DQ_ACC
        if DQ_FUSED and not TMA_REDUCE:
            dq_acc = DQ_ACC + row * HEAD_DIM
            dq_acc_diag = dq_acc
        if DQ_FUSED and TMA_REDUCE:  # DQ_ACC: [B, H, Tq, HEAD_DIM] contiguous, float32, zeroed
            dq_acc_diag = tl.make_tensor_descriptor(DQ_ACC + row * HEAD_DIM, [Tq, HEAD_DIM], [HEAD_DIM, 1],
                                                    [BLOCK_M // DIAG_SPLIT, HEAD_DIM])
            dq_acc = tl.make_tensor_descriptor(DQ_ACC + row * HEAD_DIM, [Tq, HEAD_DIM], [HEAD_DIM, 1],
                                               [BLOCK_M, HEAD_DIM])
        if WINDOW:
            dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, LSE + row, DELTA + row, stride_qt, stride_dot,
                                 offs_n, offs_d, lo, hi, Tq, Tk, off, window, sm_scale, softcap,
                                 BLOCK_M, True, CAUSAL, WINDOW, SOFTCAP, DESC, dq_acc, DQ_FUSED, TMA_REDUCE, HEAD_DIM)
        else:
            full_lo = lo
            if CAUSAL:  # the diagonal blocks, then the rows that see every key of the block
                full_lo = tl.minimum((tl.maximum(start_n + BLOCK_N - 1 - off, 0) + BLOCK_M - 1) // BLOCK_M * BLOCK_M,
                                     hi)
                dk, dv = _dkdv_inner(dk, dv, k, v, q_diag, do_diag, LSE + row, DELTA + row, stride_qt, stride_dot,
                                     offs_n, offs_d, lo, full_lo, Tq, Tk, off, window, sm_scale, softcap,
                                     BLOCK_M // DIAG_SPLIT, True, CAUSAL, WINDOW, SOFTCAP, DESC, dq_acc_diag, DQ_FUSED,
                                     TMA_REDUCE, HEAD_DIM)
            # keys past Tk load as zeros and their dK, dV rows are never stored: no mask needed for them
            dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, LSE + row, DELTA + row, stride_qt, stride_dot,
                                 offs_n, offs_d, full_lo, hi, Tq, Tk, off, window, sm_scale, softcap,
                                 BLOCK_M, False, CAUSAL, WINDOW, SOFTCAP, DESC, dq_acc, DQ_FUSED, TMA_REDUCE, HEAD_DIM)
    dk = dk * sm_scale
    tl.store(DK + b * stride_dkb + hk * stride_dkh + offs_n[:, None] * stride_dkt + offs_d[None, :],
             dk.to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + b * stride_dvb + hk * stride_dvh + offs_n[:, None] * stride_dvt + offs_d[None, :],
             dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _dq_inner(dq, q, do, lse, delta, k_base, v_base, stride_kt, stride_vt, offs_m, offs_d, lo, hi,
              Tq, Tk, off, window, sm_scale, softcap,
              BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
              SOFTCAP: tl.constexpr, DESC: tl.constexpr):
    for start_n in range(lo, hi, BLOCK_N):
        if DESC:  # k_base, v_base: descriptors of this head's [Tk, HEAD_DIM] rows (rows past Tk read as zeros)
            offs_n = start_n + tl.arange(0, BLOCK_N)
            k = k_base.load([start_n, 0])
            s, t = _logits(tl.dot(q, tl.trans(k)), sm_scale, softcap, SOFTCAP)
            v = v_base.load([start_n, 0])
        else:
            offs_n, k, s, t = _key_block(q, k_base, stride_kt, start_n, offs_d, Tk, sm_scale, softcap, BLOCK_N,
                                         MASKED, SOFTCAP)
            v = _head_rows(v_base, stride_vt, offs_n, offs_d, Tk, MASKED)
        p = tl.exp2(s - lse[:, None])
        if MASKED:
            p = tl.where(_visible(offs_m, offs_n, Tq, Tk, off, window, CAUSAL, WINDOW), p, 0.0)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            ds = ds * (1.0 - t * t)
        dq += tl.dot(ds.to(k.dtype), k)
    return dq


@triton.jit
def _dq_kernel(Q, K, V, DO, LSE, DELTA, DQ,
               stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
               stride_vb, stride_vh, stride_vt, stride_dob, stride_doh, stride_dot,
               stride_dqb, stride_dqh, stride_dqt,
               H, GROUP, Tq, Tk, off, window, sm_scale, softcap,
               HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
               ACC_DTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DIAG_SPLIT: tl.constexpr,
               DESC: tl.constexpr):
    start_m, bh, b, h, hk = _query_program(H, GROUP, BLOCK_M, CAUSAL)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < Tq
    q = _head_rows(Q + b * stride_qb + h * stride_qh, stride_qt, offs_m, offs_d, Tq, True)
    do = _head_rows(DO + b * stride_dob + h * stride_doh, stride_dot, offs_m, offs_d, Tq, True)
    row = bh.to(tl.int64) * Tq
    lse = tl.load(LSE + row + offs_m, mask=row_ok, other=0.0) * 1.4426950408889634
    delta = tl.load(DELTA + row + offs_m, mask=row_ok, other=0.0)
    k_base = K + b * stride_kb + hk * stride_kh
    v_base = V + b * stride_vb + hk * stride_vh
    k_diag = k_base
    v_diag = v_base
    if DESC:  # TMA: each tile lands in shared memory once, where both its uses read it
        k_diag = tl.make_tensor_descriptor(k_base, [Tk, HEAD_DIM], [stride_kt, 1], [BLOCK_N // DIAG_SPLIT, HEAD_DIM])
        v_diag = tl.make_tensor_descriptor(v_base, [Tk, HEAD_DIM], [stride_vt, 1], [BLOCK_N // DIAG_SPLIT, HEAD_DIM])
        k_base = tl.make_tensor_descriptor(k_base, [Tk, HEAD_DIM], [stride_kt, 1], [BLOCK_N, HEAD_DIM])
        v_base = tl.make_tensor_descriptor(v_base, [Tk, HEAD_DIM], [stride_vt, 1], [BLOCK_N, HEAD_DIM])
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=ACC_DTYPE)

    lo, full, hi = _key_blocks(start_m, Tk, off, window, BLOCK_M, BLOCK_N, CAUSAL, WINDOW)
    if not WINDOW:
        dq = _dq_inner(dq, q, do, lse, delta, k_base, v_base, stride_kt, stride_vt, offs_m, offs_d, lo, full,
                       Tq, Tk, off, window, sm_scale, softcap, BLOCK_N, False, CAUSAL, WINDOW, SOFTCAP, DESC)
    dq = _dq_inner(dq, q, do, lse, delta, k_diag, v_diag, stride_kt, stride_vt, offs_m, offs_d, full, hi,
                   Tq, Tk, off, window, sm_scale, softcap, BLOCK_N // DIAG_SPLIT, True, CAUSAL, WINDOW, SOFTCAP, DESC)
    dq = dq * sm_scale
    tl.store(DQ + b * stride_dqb + h * stride_dqh + offs_m[:, None] * stride_dqt + offs_d[None, :],
             dq.to(DQ.dtype.element_ty), mask=row_ok[:, None])


# ---------------------------------------------------------------------------------------------- launchers

def _acc_dtype(t: torch.Tensor):
    return tl.float64 if t.dtype == torch.float64 else tl.float32


def _lse_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _tma_readable(*tensors: torch.Tensor) -> bool:
    """Whether a descriptor over each (batch, head)'s [T, D] rows can read these tensors: 16-byte aligned base,
    batch, head and row strides (TMA's rule)."""
    return all(t.data_ptr() % 16 == 0 and all(st * t.element_size() % 16 == 0 for st in t.stride()[:3])
               for t in tensors)


def _s(t: torch.Tensor) -> tuple[int, int, int]:
    return t.stride(0), t.stride(1), t.stride(2)


def forward(q, k, v, causal: bool, sm_scale: float, window: int | None, softcap: float | None,
            tiles: Tiles | None = None, tma="default"):
    """O [B, Hq, Tq, D] in q's dtype and the natural-log row LSE [B, Hq, Tq].

    tma: the prefill kernel's forward (forward_tma.TmaForward) where it applies, "default" for the table's
    choice of this GPU and head dim, None for the blocked kernel below.
    """
    if interpreting():
        let_interpreter_index_with_loaded_scalars()
    if tma == "default":
        tma = forward_tma.default_tma_forward(q.shape[-1], q.device)
    kind = forward_tma.applicable_layout(q, k, v, causal, tma)
    if kind is not None:
        return forward_tma.forward_tma(q, k, v, sm_scale, window, softcap, tma, kind)
    B, H, Tq, D = q.shape
    HK, Tk = k.shape[1], k.shape[2]
    o = torch.empty_like(q)
    lse = torch.empty((B, H, Tq), device=q.device, dtype=_lse_dtype(q))
    t = (tiles or tiles_for(D)).fwd
    _fwd_kernel[(triton.cdiv(Tq, t[0]), B * H)](
        q, k, v, o, lse, *_s(q), *_s(k), *_s(v), *_s(o),
        H, H // HK, Tq, Tk, Tk - Tq, window or 0, sm_scale, softcap or 1.0,
        HEAD_DIM=D, CAUSAL=causal, WINDOW=window is not None, SOFTCAP=softcap is not None,
        ACC_DTYPE=_acc_dtype(q), **_launch(t))
    return o, lse


def backward(do, q, k, v, o, lse, causal: bool, sm_scale: float, window: int | None, softcap: float | None,
             tiles: Tiles | None = None):
    """dQ, dK, dV (dK and dV with K's head count: the group's query heads summed)."""
    if interpreting():
        let_interpreter_index_with_loaded_scalars()
    B, H, Tq, D = q.shape
    HK, Tk = k.shape[1], k.shape[2]
    acc = _acc_dtype(q)
    delta = torch.empty_like(lse)
    block = 16 if interpreting() else 64
    _delta_kernel[(triton.cdiv(Tq, block), B * H)](o, do, delta, *_s(o), *_s(do), H, Tq,
                                                   HEAD_DIM=D, ACC_DTYPE=acc, BLOCK_M=block)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    common = dict(HEAD_DIM=D, CAUSAL=causal, WINDOW=window is not None, SOFTCAP=softcap is not None, ACC_DTYPE=acc)
    scalars = (Tq, Tk, Tk - Tq, window or 0, sm_scale, softcap or 1.0)

    tiles = tiles or tiles_for(D)
    # TMA loads where asked for and the rows they read allow them; the descriptors are built on the device
    dkdv_tile, dq_tile = _full(tiles.dkdv), _full(tiles.dq)
    fused = bool(dkdv_tile[6]) and q.dtype != torch.float64  # TMA reductions add float32 at most
    if not _tma_readable(q, do):
        dkdv_tile = dkdv_tile[:5] + (0,) + dkdv_tile[6:]
    if not _tma_readable(k, v):
        dq_tile = dq_tile[:5] + (0,) + dq_tile[6:]
    if q.is_cuda and (dkdv_tile[5] or fused or dq_tile[5]):
        from attnserve.attention.kernels.mha.prefill_tma import _scratch

        triton.set_allocator(_scratch)
    # with dQ fused into dkdv, every key block adds its share into one float32 accumulator: [B, H, Tq, D]
    dq_acc = torch.zeros((B, H, Tq, D), device=q.device, dtype=torch.float32) if fused else delta  # else unused
    _dkdv_kernel[(triton.cdiv(Tk, tiles.dkdv[1]), B * HK)](
        q, k, v, do, lse, delta, dk, dv, dq_acc, *_s(q), *_s(k), *_s(v), *_s(do), *_s(dk), *_s(dv),
        H, HK, H // HK, *scalars, **common, **_launch_backward(dkdv_tile), DQ_FUSED=fused, TMA_REDUCE=q.is_cuda)
    if fused:
        return dq_acc.to(q.dtype), dk, dv
    dq = torch.empty_like(q)
    _dq_kernel[(triton.cdiv(Tq, tiles.dq[0]), B * H)](
        q, k, v, do, lse, delta, dq, *_s(q), *_s(k), *_s(v), *_s(do), *_s(dq),
        H, H // HK, *scalars, **common, **_launch_backward(dq_tile))
    return dq, dk, dv
