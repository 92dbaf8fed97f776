"""MLA's query absorption with the query and latent-row assembly, in one launch for decode-sized batches.

After ops/kernels/mla_rope.py, a DeepSeek layer's step between its projections and attention is still two
launches: the key up-projection's absorption of q_nope (q_latent[t, h] = q_nope[t, h] W_UK[h], a batched GEMM
of H heads x nope x rank, 2 MB for DeepSeek-V2-Lite) and the assembly. At batch 1 the batched GEMM is a few
microseconds of launch and latency for well under one of bytes. Here one program per (token, head, block of
BLOCK_R latent channels) reads its slice of W_UK (BLOCK_R columns of one head: 16 KB), so a token's 2 MB are
read by some hundred programs at once; the head's first block also rotates q_pe behind its q_latent, and the
token's first program writes the pool row. Each program re-reads W_UK for its token, so this pays only for a
few tokens: larger batches keep cuBLAS's batched GEMM and mla_rope (models/deepseek.py picks,
`ABSORB_MAX_TOKENS`).

Rounding: q_latent is accumulated in float32 and rounded once, as a GEMM rounds its output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnserve.attention.kernels.common import next_pow2
from attnserve.ops.kernels.mla_rope import (
    assembly_outputs,
    checked_assembly_inputs,
    latent_row,
    rope_pairs,
    rotated,
)
from attnserve.ops.kernels.pdl import launch_options, wait_for_predecessor

BLOCK_R = 64  # latent channels per program: 512 / 64 = 8 programs a head


@triton.jit
def _mla_absorb_kernel(
    QNope, QPe, WUK, Latent, KPe, NormW, Cos, Sin, QFull, KVRow, eps,
    stride_qnt, stride_qnh, stride_qpt, stride_qph, stride_wh, stride_wn, stride_lt, stride_kt, stride_ct, stride_st,
    stride_qft, stride_qfh, stride_kvt,
    NOPE: tl.constexpr, BLOCK_NOPE: tl.constexpr, RANK: tl.constexpr, BLOCK_RANK: tl.constexpr,
    BLOCK_R: tl.constexpr, ROPE: tl.constexpr, BLOCK_HALF: tl.constexpr, INTERLEAVED: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_predecessor(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    block = tl.program_id(2)
    n = tl.arange(0, BLOCK_NOPE)
    n_ok = n < NOPE
    r = block * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < RANK
    q = tl.load(QNope + t * stride_qnt + h * stride_qnh + n, mask=n_ok, other=0.0).to(tl.float32)  # [BLOCK_NOPE]
    w = tl.load(WUK + h * stride_wh + n[:, None] * stride_wn + r[None, :], mask=n_ok[:, None] & r_ok[None, :],
                other=0.0).to(tl.float32)  # [BLOCK_NOPE, BLOCK_R]
    q_latent = tl.sum(q[:, None] * w, axis=0)  # [BLOCK_R]
    out = QFull + t * stride_qft + h * stride_qfh
    tl.store(out + r, q_latent.to(QFull.dtype.element_ty), mask=r_ok)
    if block == 0:  # the head's rotated q_pe behind its q_latent; the token's first head writes the pool row
        i1, i2, pair_ok, cos, sin = rope_pairs(Cos, Sin, t, stride_ct, stride_st, ROPE, BLOCK_HALF, INTERLEAVED)
        o1, o2 = rotated(QPe + t * stride_qpt + h * stride_qph, i1, i2, pair_ok, cos, sin, True)
        tl.store(out + RANK + i1, o1.to(QFull.dtype.element_ty), mask=pair_ok)
        tl.store(out + RANK + i2, o2.to(QFull.dtype.element_ty), mask=pair_ok)
        if h == 0:
            latent_row(Latent, KPe, NormW, KVRow, t, stride_lt, stride_kt, stride_kvt, eps, i1, i2, pair_ok, cos,
                       sin, RANK, BLOCK_RANK)


def mla_absorb_rope(q_nope: torch.Tensor, q_pe: torch.Tensor, w_uk: torch.Tensor, latent: torch.Tensor,
                    k_pe: torch.Tensor, norm_weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                    interleaved: bool, pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """mla_rope's outputs with the absorption done here: the absorbed query `[T, H, rank + rope]`
    ([q_nope W_UK, q_pe rotated]) and the pool row `[T, 1, rank + rope]`.

    q_nope `[T, H, nope]`, q_pe `[T, H, rope]`, w_uk `[H, nope, rank]` (kv_b_proj's view), latent `[T, rank]`,
    k_pe `[T, rope]` (or `[T, 1, rope]`): free leading strides, each contiguous in its last dimension."""
    tokens, heads, nope = q_nope.shape
    rank, rope = w_uk.shape[2], q_pe.shape[-1]
    if w_uk.shape[:2] != (heads, nope):
        raise ValueError(f"mla_absorb_rope: w_uk {tuple(w_uk.shape)} must be [{heads}, {nope}, rank] for q_nope "
                         f"{tuple(q_nope.shape)}")
    k_pe = checked_assembly_inputs("mla_absorb_rope", tokens, heads, rank, q_pe, latent, k_pe, norm_weight, cos, sin,
                                   q_nope=q_nope, w_uk=w_uk)
    q_full, kv_row = assembly_outputs(tokens, heads, rank, rope, q_nope.dtype, latent)
    if tokens == 0:
        return q_full, kv_row
    block_r = min(BLOCK_R, next_pow2(rank))
    _mla_absorb_kernel[(tokens, heads, triton.cdiv(rank, block_r))](
        q_nope, q_pe, w_uk, latent, k_pe, norm_weight, cos, sin, q_full, kv_row, float(eps),
        q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1), w_uk.stride(0), w_uk.stride(1),
        latent.stride(0), k_pe.stride(0), cos.stride(0), sin.stride(0), q_full.stride(0), q_full.stride(1),
        kv_row.stride(0),
        NOPE=nope, BLOCK_NOPE=next_pow2(nope), RANK=rank, BLOCK_RANK=next_pow2(rank), BLOCK_R=block_r, ROPE=rope,
        BLOCK_HALF=next_pow2(rope // 2), INTERLEAVED=interleaved, num_warps=4, **launch_options(pdl),
    )
    return q_full, kv_row
