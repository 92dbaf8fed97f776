"""Scatter this step's K/V into the paged pool at out_cache_loc, quantising for FP8 pools.

One program per token writes all of its KV heads. FP8 pools store x / scale clamped
to the format's range (the same rule as KVPool.store), so readers multiply by the
layer's scale.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnserve.attention.kernels.common import interpreting, next_pow2

# (mantissa bits, smallest normal exponent) of the FP8 formats, for rounding in float32
_FP8_GRID = {torch.float8_e4m3fn: (3, -6), torch.float8_e5m2: (2, -14)}


@triton.jit
def _round_to_fp8_grid(x, MANT_BITS: tl.constexpr, MIN_EXP: tl.constexpr):
    """Round float32 x to the nearest FP8 value (ties to even) while still in float32.

    Only used under the interpreter, whose float->fp8 cast rounds wrongly; a value already
    on the grid converts exactly. 1.5 * 2**23 added and removed rounds to an integer.
    """
    bits = x.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) - 127
    exponent = tl.maximum(exponent, MIN_EXP)
    ulp = tl.exp2((exponent - MANT_BITS).to(tl.float32))
    y = x / ulp
    y = (y + 12582912.0) - 12582912.0
    return y * ulp


@triton.jit
def _quantize(x, inv_scale, fp8_max, OUT_DTYPE: tl.constexpr, IS_FP8: tl.constexpr, ROUND_IN_F32: tl.constexpr,
              MANT_BITS: tl.constexpr, MIN_EXP: tl.constexpr):
    if IS_FP8:
        y = tl.minimum(tl.maximum(x.to(tl.float32) * inv_scale, -fp8_max), fp8_max)
        if ROUND_IN_F32:
            y = _round_to_fp8_grid(y, MANT_BITS, MIN_EXP)
        return y.to(OUT_DTYPE)
    return x.to(OUT_DTYPE)


@triton.jit
def _store_kv_kernel(
    K_new, V_new, K_buf, V_buf, loc, k_inv_scale, v_inv_scale, fp8_max,
    stride_knt, stride_knh, stride_vnt, stride_vnh, stride_kbt, stride_kbh, stride_vbt, stride_vbh,
    NUM_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    V_DIM: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_V: tl.constexpr,
    IS_FP8: tl.constexpr, ROUND_IN_F32: tl.constexpr, MANT_BITS: tl.constexpr, MIN_EXP: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(loc + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    h_mask = offs_h < NUM_HEADS
    offs_d = tl.arange(0, BLOCK_D)
    mask = h_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
    k = tl.load(K_new + t * stride_knt + offs_h[:, None] * stride_knh + offs_d[None, :], mask=mask)
    k = _quantize(k, k_inv_scale, fp8_max, K_buf.dtype.element_ty, IS_FP8, ROUND_IN_F32, MANT_BITS, MIN_EXP)
    tl.store(K_buf + slot * stride_kbt + offs_h[:, None] * stride_kbh + offs_d[None, :], k, mask=mask)
    if HAS_V:
        offs_dv = tl.arange(0, BLOCK_DV)
        vmask = h_mask[:, None] & (offs_dv < V_DIM)[None, :]
        v = tl.load(V_new + t * stride_vnt + offs_h[:, None] * stride_vnh + offs_dv[None, :], mask=vmask)
        v = _quantize(v, v_inv_scale, fp8_max, V_buf.dtype.element_ty, IS_FP8, ROUND_IN_F32, MANT_BITS, MIN_EXP)
        tl.store(V_buf + slot * stride_vbt + offs_h[:, None] * stride_vbh + offs_dv[None, :], v, mask=vmask)


def store_kv(
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor | None,
    loc: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor | None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """k `[T, H, D]` -> k_buffer[loc] (`[slots, H, D]`), v likewise; v None stores K only (MLA).

    The last dim of k/v and of the buffers must be contiguous; token and head strides are free,
    so k and v may be views into a fused qkv projection. No device sync: slots are trusted
    to be in range (they come from the allocator).
    """
    if k.dim() != 3 or k.shape[1:] != k_buffer.shape[1:]:
        raise ValueError(f"k shape {tuple(k.shape)} does not match pool [tokens, {', '.join(map(str, k_buffer.shape[1:]))}]")
    if loc.dim() != 1 or loc.numel() != k.shape[0]:
        raise ValueError(f"out_cache_loc has shape {tuple(loc.shape)} but k has {k.shape[0]} tokens")
    has_v = v is not None and v_buffer is not None
    if has_v and (v.shape[0] != k.shape[0] or v.shape[1:] != v_buffer.shape[1:]):
        raise ValueError(f"v shape {tuple(v.shape)} does not match pool [tokens, {', '.join(map(str, v_buffer.shape[1:]))}]")
    if k.stride(-1) != 1 or (has_v and v.stride(-1) != 1):
        raise ValueError("k and v must be contiguous in their last (head_dim) dimension")
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    is_fp8 = k_buffer.dtype in _FP8_GRID
    mant_bits, min_exp = _FP8_GRID.get(k_buffer.dtype, (0, 0))
    fp8_max = float(torch.finfo(k_buffer.dtype).max) if is_fp8 else 0.0
    vv, vb = (v, v_buffer) if has_v else (k, k_buffer)
    _store_kv_kernel[(num_tokens,)](
        k, vv, k_buffer, vb, loc, 1.0 / k_scale, 1.0 / v_scale, fp8_max,
        k.stride(0), k.stride(1), vv.stride(0), vv.stride(1),
        k_buffer.stride(0), k_buffer.stride(1), vb.stride(0), vb.stride(1),
        NUM_HEADS=num_heads, BLOCK_H=next_pow2(num_heads), HEAD_DIM=head_dim, BLOCK_D=next_pow2(head_dim),
        V_DIM=vv.shape[-1], BLOCK_DV=next_pow2(vv.shape[-1]), HAS_V=has_v,
        IS_FP8=is_fp8, ROUND_IN_F32=is_fp8 and interpreting(), MANT_BITS=mant_bits, MIN_EXP=min_exp,
        num_warps=4,
    )
