"""MLA's absorbed query and latent row, assembled in one launch.

Unfused, an MLA layer's step between its projections and attention is about twenty small launches: the
latent's RMSNorm, RoPE on q_pe and on k_pe (slices, four products, a difference, a sum and a stack each, in
DeepSeek's interleaved layout), then two concatenations into the absorbed query `[q_latent, q_pe]` and the
pool row `[latent, k_pe]`. At batch 1 each launch costs more than its bytes, and the DeepSeek-V2-Lite step
has 27 such layers. Here one program per (token, block of heads) does all of it; the first head block of a
token also writes the latent row.

Rounding follows the unfused path where it is a fixed point: the latent's RMSNorm keeps ops/reference.py's
(normalised row rounded before the weight). The rotation runs in float32 and rounds once, as the fused
RoPE + store kernel (rope_store.py) does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnserve.attention.kernels.common import next_pow2
from attnserve.ops.kernels.pdl import launch_options, wait_for_predecessor

HEADS_PER_PROGRAM = 16


@triton.jit
def rotated(X, i1, i2, pair_ok, cos, sin, row_ok):
    """The pairs (X[i1], X[i2]) of rows `row_ok`, rotated in float32: two `[rows, R/2]` blocks."""
    x1 = tl.load(X + i1, mask=row_ok & pair_ok, other=0.0).to(tl.float32)
    x2 = tl.load(X + i2, mask=row_ok & pair_ok, other=0.0).to(tl.float32)
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


@triton.jit
def rope_pairs(Cos, Sin, t, stride_ct, stride_st, ROPE: tl.constexpr, BLOCK_HALF: tl.constexpr,
               INTERLEAVED: tl.constexpr):
    """Token t's rotation: the channel pairs (i1, i2) `[1, BLOCK_HALF]`, which are real, and cos/sin."""
    i = tl.arange(0, BLOCK_HALF)
    pair_ok = (i < ROPE // 2)[None, :]
    if INTERLEAVED:  # DeepSeek's layout: pairs are channels 2i, 2i + 1
        i1, i2 = 2 * i[None, :], 2 * i[None, :] + 1
    else:
        i1, i2 = i[None, :], i[None, :] + ROPE // 2
    cos = tl.load(Cos + t * stride_ct + i[None, :], mask=pair_ok, other=0.0).to(tl.float32)  # [1, BLOCK_HALF]
    sin = tl.load(Sin + t * stride_st + i[None, :], mask=pair_ok, other=0.0).to(tl.float32)
    return i1, i2, pair_ok, cos, sin


@triton.jit
def latent_row(Latent, KPe, NormW, KVRow, t, stride_lt, stride_kt, stride_kvt, eps, i1, i2, pair_ok, cos, sin,
               RANK: tl.constexpr, BLOCK_RANK: tl.constexpr):
    """Token t's pool row: the normalised latent, then the rotated k_pe."""
    r = tl.arange(0, BLOCK_RANK)[None, :]
    r_ok = r < RANK
    x = tl.load(Latent + t * stride_lt + r, mask=r_ok, other=0.0).to(tl.float32)  # [1, BLOCK_RANK]
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / RANK + eps)  # [1]
    y = (x * rstd[:, None]).to(KVRow.dtype.element_ty).to(tl.float32)
    w = tl.load(NormW + r, mask=r_ok, other=0.0).to(tl.float32)
    row = KVRow + t * stride_kvt
    tl.store(row + r, (w * y).to(KVRow.dtype.element_ty), mask=r_ok)
    k1, k2 = rotated(KPe + t * stride_kt, i1, i2, pair_ok, cos, sin, True)
    tl.store(row + RANK + i1, k1.to(KVRow.dtype.element_ty), mask=pair_ok)
    tl.store(row + RANK + i2, k2.to(KVRow.dtype.element_ty), mask=pair_ok)


@triton.jit
def _mla_rope_kernel(
    QLatent, QPe, Latent, KPe, NormW, Cos, Sin, QFull, KVRow, eps,
    stride_qlt, stride_qlh, stride_qpt, stride_qph, stride_lt, stride_kt, stride_ct, stride_st,
    stride_qft, stride_qfh, stride_kvt,
    H: tl.constexpr, RANK: tl.constexpr, BLOCK_RANK: tl.constexpr, ROPE: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_H: tl.constexpr, INTERLEAVED: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_predecessor(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    h_ok = (h < H)[:, None]
    i1, i2, pair_ok, cos, sin = rope_pairs(Cos, Sin, t, stride_ct, stride_st, ROPE, BLOCK_HALF, INTERLEAVED)

    # the absorbed query: q_latent copied, q_pe rotated behind it
    r = tl.arange(0, BLOCK_RANK)[None, :]
    r_ok = r < RANK
    q_latent = tl.load(QLatent + t * stride_qlt + h[:, None] * stride_qlh + r, mask=h_ok & r_ok, other=0.0)
    out = QFull + t * stride_qft + h[:, None] * stride_qfh  # [BLOCK_H, 1] row starts
    tl.store(out + r, q_latent.to(QFull.dtype.element_ty), mask=h_ok & r_ok)
    o1, o2 = rotated(QPe + t * stride_qpt + h[:, None] * stride_qph, i1, i2, pair_ok, cos, sin, h_ok)
    tl.store(out + RANK + i1, o1.to(QFull.dtype.element_ty), mask=h_ok & pair_ok)
    tl.store(out + RANK + i2, o2.to(QFull.dtype.element_ty), mask=h_ok & pair_ok)
    if tl.program_id(1) == 0:  # the first head block writes the token's pool row
        latent_row(Latent, KPe, NormW, KVRow, t, stride_lt, stride_kt, stride_kvt, eps, i1, i2, pair_ok, cos, sin,
                   RANK, BLOCK_RANK)


def checked_assembly_inputs(op: str, tokens: int, heads: int, rank: int, q_pe: torch.Tensor, latent: torch.Tensor,
                            k_pe: torch.Tensor, norm_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                            **more: torch.Tensor) -> torch.Tensor:
    """The inputs both MLA assembly kernels take, checked (`more`: the op's own, for the last-dimension check);
    -> k_pe as `[T, rope]`."""
    rope = q_pe.shape[-1]
    k_pe = k_pe.reshape(tokens, rope) if k_pe.dim() == 3 else k_pe
    if q_pe.shape[:2] != (tokens, heads) or latent.shape != (tokens, rank) or k_pe.shape != (tokens, rope):
        raise ValueError(f"{op}: q_pe {tuple(q_pe.shape)}, latent {tuple(latent.shape)} and k_pe {tuple(k_pe.shape)} "
                         f"disagree with {tokens} tokens of {heads} heads and a rank of {rank}")
    if cos.shape != (tokens, rope // 2) or sin.shape != cos.shape or norm_weight.shape != (rank,):
        raise ValueError(f"{op}: cos/sin {tuple(cos.shape)} must be [{tokens}, {rope // 2}] and the norm weight "
                         f"{tuple(norm_weight.shape)} [{rank}]")
    for name, x in (("q_pe", q_pe), ("latent", latent), ("k_pe", k_pe), ("cos", cos), ("sin", sin),
                    ("norm_weight", norm_weight), *more.items()):
        if x.stride(-1) != 1:
            raise ValueError(f"{op}: {name} must be contiguous in its last dimension")
    return k_pe


def assembly_outputs(tokens: int, heads: int, rank: int, rope: int, q_dtype: torch.dtype,
                     latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q_full = torch.empty(tokens, heads, rank + rope, dtype=q_dtype, device=latent.device)  # [T, H, R+P]
    kv_row = torch.empty(tokens, 1, rank + rope, dtype=latent.dtype, device=latent.device)  # [T, 1, R+P]
    return q_full, kv_row


def mla_rope(q_latent: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor,
             norm_weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
             interleaved: bool, pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The absorbed query `[T, H, rank + rope]` (q_latent, then q_pe rotated) and the pool row `[T, 1, rank +
    rope]` (RMSNorm(latent) * norm_weight, then k_pe rotated).

    q_latent `[T, H, rank]`, q_pe `[T, H, rope]`, latent `[T, rank]`, k_pe `[T, rope]` (or `[T, 1, rope]`):
    views with free token and head strides, each contiguous in its last dimension; cos/sin `[T, rope/2]`.
    """
    tokens, heads, rank = q_latent.shape
    rope = q_pe.shape[-1]
    k_pe = checked_assembly_inputs("mla_rope", tokens, heads, rank, q_pe, latent, k_pe, norm_weight, cos, sin,
                                   q_latent=q_latent)
    q_full, kv_row = assembly_outputs(tokens, heads, rank, rope, q_latent.dtype, latent)
    if tokens == 0:
        return q_full, kv_row
    block_h = min(next_pow2(heads), HEADS_PER_PROGRAM)
    _mla_rope_kernel[(tokens, triton.cdiv(heads, block_h))](
        q_latent, q_pe, latent, k_pe, norm_weight, cos, sin, q_full, kv_row, float(eps),
        q_latent.stride(0), q_latent.stride(1), q_pe.stride(0), q_pe.stride(1), latent.stride(0), k_pe.stride(0),
        cos.stride(0), sin.stride(0), q_full.stride(0), q_full.stride(1), kv_row.stride(0),
        H=heads, RANK=rank, BLOCK_RANK=next_pow2(rank), ROPE=rope, BLOCK_HALF=next_pow2(rope // 2),
        BLOCK_H=block_h, INTERLEAVED=interleaved, num_warps=4, **launch_options(pdl),
    )
    return q_full, kv_row
